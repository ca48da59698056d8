"""The baselines fxsplit's split is measured against, and the private torch APIs they need, in one place.

* upstream's eager split (``torch.distributed.pipelining._backward``), the one
  pipelining schedules use today, and a probe of whether it can run on a
  compiled module with the installed torch;
* AOTAutograd's ``donated_buffer`` config, without which upstream's split
  fails on an Inductor-compiled module (mode 4), and that failure itself;
* Inductor's fresh-cache context, so that compile times start from nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from fxsplit.bench.models import Stage

__all__ = ["default_config_failure", "donated_buffer", "fresh_inductor_cache", "upstream", "upstream_split_failure"]


def upstream() -> Any:
    """``torch.distributed.pipelining._backward``: the eager split that pipelining schedules use today."""
    from torch.distributed.pipelining import _backward

    return _backward


class _ProbeFunction(torch.autograd.Function):
    """``x @ w`` as a custom autograd Function: compiled regions reach autograd the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


def upstream_split_failure() -> str | None:
    """Why upstream's split cannot run on a compiled module with this torch (None if it can).

    Probes ``stage_backward_input`` then ``stage_backward_weight`` on one custom
    autograd Function (microseconds, no compile): a compiled region is such a
    Function (``CompiledFunctionBackward``). torch 2.11's
    ``stage_backward_weight`` fails there: it starts ``autograd.grad`` from
    ``GradientEdge``s to Function nodes whose graph ``stage_backward_input``
    already released (its ``detach_()`` of the stage outputs), and reading such
    a node's ``_input_metadata`` raises (pytorch/pytorch#166577, #161904);
    torch 2.13 and later run it. Feature-detected, not version-compared.
    """
    w = torch.nn.Parameter(torch.ones(2, 2))
    x = torch.ones(1, 2, requires_grad=True)
    out = _ProbeFunction.apply(x, w)
    try:
        _, pending = upstream().stage_backward_input([out], [torch.ones_like(out)], [x], [w])
        upstream().stage_backward_weight([w], pending)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"upstream's split (torch.distributed.pipelining._backward) fails on compiled modules with torch "
                f"{torch.__version__} (pytorch/pytorch#166577: {first[:90]}...), so the inductor+upstream baseline "
                "cannot be measured; torch 2.13 to 2.15 run it")
    return None


def donated_buffer(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """``torch._functorch.config.donated_buffer``: read when AOTAutograd compiles the backward and when it runs."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(donated_buffer=enabled)


def fresh_inductor_cache() -> contextlib.AbstractContextManager[None]:
    """``torch._inductor.utils.fresh_cache``: a temporary cache dir and cleared in-process caches."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache()


def default_config_failure(module: torch.nn.Module, stage: Stage, grad: torch.Tensor) -> str | None:
    """Run the upstream split on a module compiled with AOTAutograd's default
    config; return the error message (None if it did not fail)."""
    x = stage.make_input()
    out = module(x)
    try:
        dinputs, pending = upstream().stage_backward_input([out], [grad], [x], module.parameters())
        upstream().stage_backward_weight(module.parameters(), pending)
    except Exception as e:  # the failure is the result
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        return f"{type(root).__name__}: {str(root).strip()}"
    return None

