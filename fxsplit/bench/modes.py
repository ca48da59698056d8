"""The six ways the benchmark runs one pipeline stage's backward, and the untimed figures of one step of each.

1. ``eager``: eager module, ordinary backward;
2. ``eager+upstream``: eager module, upstream eager split
   (``torch.distributed.pipelining._backward.stage_backward_input`` then
   ``stage_backward_weight``);
3. ``inductor``: ``torch.compile(backend="inductor")``, ordinary backward
   (the reference the other modes are compared with);
4. ``inductor+upstream``: the same compiled module with the upstream split.
   With AOTAutograd's default ``donated_buffer=True`` it fails (the error is
   recorded); it is measured on a module compiled and run with
   ``torch._functorch.config.donated_buffer=False`` (the config is read when
   the backward is compiled and again when it runs, so every call of this
   mode is made under the patch);
5. ``fxsplit``: ``backend=fxsplit.backend()``, ordinary backward;
6. ``fxsplit+split``: the same module with ``fxsplit.stage_backward_input``
   then ``fxsplit.stage_backward_weight``.

:func:`backward_phases` runs one step of a mode; :func:`count_flops` and
:func:`measure_memory` take its FLOPs and memory (timing is
:mod:`fxsplit.bench.timing`'s).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import fxsplit
from fxsplit.bench import baselines
from fxsplit.bench.flops import flop_counter
from fxsplit.bench.memory import MemoryMeter
from fxsplit.bench.models import Stage

__all__ = ["MODE_KEYS", "REFERENCE", "Mode", "backward_phases", "count_flops", "make_modes", "measure_memory",
           "params_of"]

MODE_KEYS = ("eager", "eager+upstream", "inductor", "inductor+upstream", "fxsplit", "fxsplit+split")
REFERENCE = "inductor"


@dataclasses.dataclass
class Mode:
    """One way of running a stage: a module and how its backward is run."""

    key: str
    label: str
    module: torch.nn.Module
    split: str | None  # None (ordinary backward), "upstream" or "fxsplit"
    context: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    compiled: str | None = None  # name of the compiled module this mode shares
    flops_module: torch.nn.Module | None = None  # runs the same graphs op by op (compiled modes)
    # Why this mode cannot run on this torch (it is then reported "not measurable"), or None.
    unavailable: str | None = None


def make_modes(base: torch.nn.Module, upstream_unavailable: str | None = None) -> list[Mode]:
    """The six modes of :data:`MODE_KEYS` over copies of ``base`` (mode 1 runs ``base`` itself).

    ``upstream_unavailable``: why upstream's split cannot run on a compiled
    module with this torch (:func:`fxsplit.bench.baselines.upstream_split_failure`);
    the ``inductor+upstream`` mode then carries it as ``unavailable`` and is
    neither compiled nor run.

    Nothing is compiled yet: each compiled module compiles on its first call.
    The compiled modes share ``flops_module``, a ``compiler="eager"`` twin that
    runs the graphs Inductor compiles op by op, for the FLOP counts.
    """

    def copy_of() -> torch.nn.Module:
        return copy.deepcopy(base)

    inductor = torch.compile(copy_of(), backend="inductor")
    # Dynamo shares compiled code between torch.compile calls whose backends
    # compare equal, and two backend="inductor" calls with the same options do:
    # a (default-valued) option keeps this module's compile its own.
    with baselines.donated_buffer(False):
        inductor_nodonate = torch.compile(copy_of(), backend="inductor", options={"trace.enabled": False})
    fx = torch.compile(copy_of(), backend=fxsplit.backend())
    fx_graphs = torch.compile(copy_of(), backend=fxsplit.backend(compiler="eager"))
    nodonate = lambda: baselines.donated_buffer(False)  # noqa: E731
    modes = [
        Mode("eager", "eager, ordinary backward", base, None),
        Mode("eager+upstream", "eager + upstream split", copy_of(), "upstream"),
        Mode("inductor", "inductor, ordinary backward", inductor, None, compiled="inductor", flops_module=fx_graphs),
        Mode("inductor+upstream", "inductor + upstream split (donated_buffer=False)", inductor_nodonate, "upstream",
             context=nodonate, compiled="inductor (donated_buffer=False)", flops_module=fx_graphs,
             unavailable=upstream_unavailable),
        Mode("fxsplit", "fxsplit, ordinary backward", fx, None, compiled="fxsplit", flops_module=fx_graphs),
        Mode("fxsplit+split", "fxsplit split (B, then W)", fx, "fxsplit", compiled="fxsplit", flops_module=fx_graphs),
    ]
    assert tuple(m.key for m in modes) == MODE_KEYS
    return modes


def params_of(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights a split mode hands to B and W: all of the module's parameters."""
    return list(module.parameters())


def backward_phases(
    mode: Mode, module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor,
    between: Callable[[str], None] = lambda phase: None,
    on_pending: Callable[[Any], None] = lambda pending: None,
) -> None:
    """Forward then backward of ``module`` as ``mode`` runs it, calling
    ``between(phase)`` after each phase ("forward", "B", "W" or "backward").
    Returns nothing held: everything B left for W has been consumed."""
    inputs = [x]
    with mode.context():
        out = module(x)
        between("forward")
        if mode.split is None:
            torch.autograd.backward([out], [grad])
            del out
            between("backward")
            return None
        params = params_of(module)
        if mode.split == "upstream":
            up = baselines.upstream()
            dinputs, pending = up.stage_backward_input([out], [grad], inputs, iter(params))
        else:
            dinputs, pending = fxsplit.stage_backward_input([out], [grad], inputs, params)
        del out, dinputs
        x.grad = None
        on_pending(pending)
        between("B")
        if mode.split == "upstream":
            baselines.upstream().stage_backward_weight(iter(params), pending)
        else:
            fxsplit.stage_backward_weight(params, pending)
        del pending
        between("W")
    return None


def _held_declared(mode: Mode, pending: Any) -> int:
    if mode.split == "fxsplit":
        return int(pending.live_in_bytes)
    total = 0
    for group in pending:
        for grads in group.get("grads") or ():
            for g in grads or ():
                if isinstance(g, torch.Tensor):
                    total += g.numel() * g.element_size()
    return total


def measure_memory(mode: Mode, stage: Stage, grad: torch.Tensor, device: torch.device) -> dict[str, int | None]:
    """Peak over forward + backward; for split modes also what is held between B and W."""
    meter = MemoryMeter(device)
    x = stage.make_input()
    declared: list[int] = []

    def between(phase: str) -> None:
        if phase == "B":
            meter.mark("B")

    with meter.window():
        backward_phases(mode, mode.module, x, grad, between, on_pending=lambda p: declared.append(_held_declared(mode, p)))
    if mode.split is None:
        return {"peak_bytes": meter.peak, "held_bytes": None, "held_bytes_declared": None}
    return {"peak_bytes": meter.peak, "held_bytes": meter.levels["B"], "held_bytes_declared": declared[0]}


def count_flops(mode: Mode, module: torch.nn.Module, stage: Stage, grad: torch.Tensor) -> dict[str, int | None]:
    """FLOPs of B, W (split modes) and of the whole backward, as FlopCounterMode sees them."""
    counts: dict[str, int | None] = {"B": None, "W": None}
    x = stage.make_input()
    params = params_of(module)
    with mode.context():
        out = module(x)
        if mode.split is None:
            with flop_counter() as fc:
                torch.autograd.backward([out], [grad])
            counts["backward"] = fc.get_total_flops()
            return counts
        with flop_counter() as fb:
            if mode.split == "upstream":
                _, pending = baselines.upstream().stage_backward_input([out], [grad], [x], iter(params))
            else:
                _, pending = fxsplit.stage_backward_input([out], [grad], [x], params)
        del out
        with flop_counter() as fw:
            if mode.split == "upstream":
                baselines.upstream().stage_backward_weight(iter(params), pending)
            else:
                fxsplit.stage_backward_weight(params, pending)
    counts["B"], counts["W"] = fb.get_total_flops(), fw.get_total_flops()
    counts["backward"] = counts["B"] + counts["W"]
    return counts
