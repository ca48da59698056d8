"""Helpers for the split-backward tests: run a stage through B and W, and the
same stage through plain autograd, and compare.

Every model is run two ways (``MODES``): as an ordinary eager module, and
compiled with fxsplit (``compiler="eager"`` for speed).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

import fxsplit

MODES = ("eager", "compiled")


def new_regions(before: Sequence[Any]) -> list[Any]:
    """Regions compiled since ``before = fxsplit.compiled_regions()``. The
    registry is weak (earlier regions may be gone), so compare by identity,
    never by index."""
    return [r for r in fxsplit.compiled_regions() if not any(r is b for b in before)]


def prepare(model: nn.Module, mode: str) -> Callable[..., Any]:
    """``model`` itself, or an fxsplit-compiled wrapper sharing its parameters."""
    if mode == "eager":
        return model
    return torch.compile(model, backend=fxsplit.backend(compiler="eager"))


def clone_input(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone().requires_grad_(v.requires_grad)
    return v


def grads_like(out: Any, seed: int = 0) -> Any:
    """Deterministic output gradients with the structure of ``out``
    (``None`` where an output needs no gradient)."""
    gen = torch.Generator().manual_seed(seed)

    def make(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if not o.requires_grad:
                return None
            return torch.randn(o.shape, generator=gen, dtype=o.dtype)
        if isinstance(o, (list, tuple)):
            return type(o)(make(x) for x in o)
        if isinstance(o, dict):
            return {k: make(x) for k, x in o.items()}
        return None

    return make(out)


def flat_pairs(out: Any, grads: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Tensors of a nested output that need a gradient, with their gradients."""
    outs: list[torch.Tensor] = []
    gs: list[torch.Tensor] = []

    def visit(o: Any, g: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.requires_grad:
                outs.append(o)
                gs.append(g)
        elif isinstance(o, (list, tuple)):
            for a, b in zip(o, g):
                visit(a, b)
        elif isinstance(o, dict):
            for k in o:
                visit(o[k], g[k])

    visit(out, grads)
    return outs, gs


def reference(model: nn.Module, inputs: Sequence[Any], seeds: Sequence[int] = (0,)) -> tuple[list, list]:
    """Input and parameter gradients from plain autograd on a copy of ``model``,
    summed over one microbatch per seed (inputs scaled by the seed)."""
    m = copy.deepcopy(model)
    dins: list[Any] = []
    for s in seeds:
        ins = [clone_input(_scaled(v, s)) for v in inputs]
        out = m(*ins)
        outs, gs = flat_pairs(out, grads_like(out, s))
        torch.autograd.backward(outs, gs)
        dins.append([v.grad if isinstance(v, torch.Tensor) else None for v in ins])
    return dins, [p.grad for p in m.parameters()]


def _scaled(v: Any, seed: int) -> Any:
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v * (1 + seed / 10)
    return v


def assert_grads_equal(actual: Sequence[Any], expected: Sequence[Any]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if e is None:
            assert a is None
        else:
            torch.testing.assert_close(a, e)


def snapshot_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


class TwoLayer(nn.Module):
    """Linear(4, 6) -> ``act`` -> Linear(6, 3): the small stage most semantic tests use."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor] = torch.relu) -> None:
        super().__init__()
        self.act = act
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))
