"""No leaks: after W nothing of that microbatch stays referenced, and many
rounds of forward + B + W do not grow the number of live tensors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from stage_check import MODES, grads_like, prepare

import fxsplit


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(x))) + x


class _Held:
    """A saved activation as the autograd graph holds it (see saved_tensors_hooks)."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def held_tensors(work: fxsplit.PendingWeightGrads) -> list[torch.Tensor]:
    """Every tensor the pending W work holds: compiled live-ins, saved eager gradients, hand-over values."""
    return work._held_tensors()


@pytest.mark.parametrize("mode", MODES)
def test_nothing_of_a_microbatch_stays_referenced_after_w(mode: str) -> None:
    torch.manual_seed(0)
    model = Stage()
    fn = prepare(model, mode)
    params = list(model.parameters())
    fn(torch.randn(4, 8, requires_grad=True))  # compile outside the measured microbatch

    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> _Held:
        held = _Held(t)
        packed.append(weakref.ref(held))
        return held

    x = torch.randn(4, 8, requires_grad=True)
    if mode == "eager":  # the activations the eager graph saves, observable through the hooks
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.t):
            out = fn(x)
        assert packed
    else:
        out = fn(x)
    dinputs, work = fxsplit.stage_backward_input([out], [grads_like(out)], [x], params)
    held = [weakref.ref(t) for t in held_tensors(work)]
    assert held and work.live_in_bytes > 0
    refs = {"out": weakref.ref(out), "x": weakref.ref(x), "dinput": weakref.ref(dinputs[0])}
    del out, x, dinputs
    assert refs["out"]() is None
    fxsplit.stage_backward_weight(params, work)
    # `work` itself is still alive here, as a pipeline schedule may keep it.
    assert [k for k, r in refs.items() if r() is not None] == []
    assert sum(r() is not None for r in held) == 0, "W work keeps tensors alive after W"
    assert sum(r() is not None for r in packed) == 0, "the autograd graph outlives W"
    assert work.live_in_bytes == 0 and len(work) == 0


def _live_counts() -> tuple[int, int]:
    gc.collect()
    objs = gc.get_objects()
    tensors = sum(1 for o in objs if isinstance(o, torch.Tensor))
    refs = sum(1 for o in objs if isinstance(o, weakref.ref))
    return tensors, refs


@pytest.mark.parametrize("mode", MODES)
def test_many_rounds_do_not_grow_live_tensors(mode: str) -> None:
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = Stage().to(device)
    fn = prepare(model, mode)
    params = list(model.parameters())
    grad_out = torch.randn(4, 8, device=device)

    def round_trip() -> None:
        x = torch.randn(4, 8, device=device, requires_grad=True)
        out = fn(x)
        _, work = fxsplit.stage_backward_input([out], [grad_out], [x], params)
        fxsplit.stage_backward_weight(params, work)

    for _ in range(10):  # warm up: compilation, caches, .grad allocation
        round_trip()
    tensors0, refs0 = _live_counts()
    mem0 = torch.cuda.memory_allocated() if cuda else 0
    for _ in range(200):
        round_trip()
    tensors1, refs1 = _live_counts()
    assert tensors1 <= tensors0, f"live tensors grew from {tensors0} to {tensors1} over 200 rounds"
    assert refs1 <= refs0, f"live weakrefs grew from {refs0} to {refs1} over 200 rounds"
    if cuda:
        assert torch.cuda.memory_allocated() <= mem0
