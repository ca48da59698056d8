"""No leaks: after W nothing of that microbatch stays referenced, and many
rounds of forward + B + W do not grow the number of live tensors."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn as nn
from stage_check import MODES, grads_like, prepare

import fxsplit
from fxsplit import _torch_internals
from zoo import GeluResidual


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
    model = GeluResidual()
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
    # A live-in dW returns as a weight's gradient (a bias gradient dI computed) is
    # that weight's .grad now, as the compiled backward's output is after ordinary backward.
    grads = [p.grad for p in params]
    alive = [r() for r in held if r() is not None]
    assert not [t for t in alive if not any(t is g for g in grads)], "W work keeps tensors alive after W"
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
    model = GeluResidual().to(device)
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


# -- what B frees: a census of allocator bytes between B and W ------------------------------------
class _Body(nn.Module):
    """A pre-norm MLP block: its compiled backward saves several activations
    of [tokens, 4 * dim], far more than its dW graph needs."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Middle(nn.Module):
    """A middle stage: compiled body only."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.body = _Body(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _Last(nn.Module):
    """The common last stage: compiled body under an eager head and cross-entropy."""

    def __init__(self, dim: int, vocab: int = 96) -> None:
        super().__init__()
        self.body = _Body(dim)
        self.head = nn.Linear(dim, vocab)
        self.labels = torch.randint(0, vocab, (64,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.labels)


class _LastEagerOps(_Last):
    """A last stage whose eager part has weightless ops below the head: their
    saved tensors are B's only (W re-runs the head, not them)."""

    def __init__(self, dim: int, vocab: int = 96) -> None:
        super().__init__(dim, vocab)
        self.head = nn.Linear(4 * dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sin(self.body(x).repeat(1, 1, 4))  # sin saves its [tokens, 4 * dim] input
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), self.labels)


class _GraphBreak(nn.Module):
    """Two compiled regions with eager code holding weights between them
    (a function Dynamo does not trace), as a graph break leaves it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.first = _Body(dim)
        self.mid = nn.LayerNorm(dim)
        self.second = _Body(dim)

    @torch._dynamo.disable
    def _eager(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self._eager(self.first(x)))


def _alive_after(fn: Any) -> int:
    """Allocator bytes allocated while ``fn`` runs and still alive when it returns
    (CPU: the allocation/free events ``torch.profiler`` records with
    ``profile_memory=True``; CUDA: ``memory_allocated``)."""
    gc.collect()
    if torch.cuda.is_available():  # pragma: no cover - CPU in CI
        before = torch.cuda.memory_allocated()
        fn()
        gc.collect()
        return torch.cuda.memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        gc.collect()
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def _stage(layout: str, dim: int) -> tuple[nn.Module, Any]:
    model = {"middle": _Middle, "last": _Last, "last_eager_ops": _LastEagerOps, "graph_break": _GraphBreak}[layout](dim)
    backend = fxsplit.backend(compiler="eager")
    if layout == "graph_break":
        return model, torch.compile(model, backend=backend)
    model.body.compile(backend=backend)  # in place: the head and loss stay eager
    return model, model


@pytest.mark.parametrize("anchored", [False, True], ids=["detected", "anchored"])
@pytest.mark.parametrize("layout", ["middle", "last", "last_eager_ops", "graph_break"])
def test_b_frees_everything_w_does_not_need(layout: str, anchored: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between B and W a microbatch holds only the compiled regions' live-ins
    and the eager part of W's saved state (``work.held_bytes``): compiled
    regions free their saved activations at B even when eager code makes B
    retain the graph (the last and graph-break stages). Gradients after W
    match ordinary backward on an identical copy. ``anchored``: also with
    B's graph anchor (``_torch_internals.graph_anchor``, what torch 2.11 needs
    and gets by detection), whose graph above the intermediates B must free."""
    if anchored:
        monkeypatch.setattr(_torch_internals, "function_nodes_outlive_their_graph", lambda: False)
    torch.manual_seed(0)
    dim = 64
    model, fn = _stage(layout, dim)
    ref = copy.deepcopy(model)
    params = list(model.parameters())
    xs = [torch.randn(4, 16, dim, requires_grad=True) for _ in range(2)]

    def output_grad(out: torch.Tensor) -> torch.Tensor | None:
        return None if out.numel() == 1 else torch.ones_like(out) / out.numel()

    for k, x in enumerate(xs):
        pending: list[fxsplit.PendingWeightGrads] = []

        def forward_and_b(x: torch.Tensor = x) -> None:
            out = fn(x)
            _, work = fxsplit.stage_backward_input(out, output_grad(out), [x], params)
            x.grad = None  # the input gradient goes upstream; the census is about what W holds
            pending.append(work)

        alive = _alive_after(forward_and_b)
        work = pending[0]
        if k == 1:  # the first microbatch also compiled
            assert work.held_bytes > 0
            assert alive <= 1.1 * work.held_bytes, (
                f"{layout}: {alive} bytes alive between B and W, {work.held_bytes} declared "
                f"({work.live_in_bytes} live-ins, {work.eager_saved_bytes} eager saved state)"
            )
        fxsplit.stage_backward_weight(params, work)

    for x in xs:
        out = ref(x.detach().clone().requires_grad_())
        torch.autograd.backward([out], None if out.numel() == 1 else [output_grad(out)])
    for p, q in zip(params, ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_later_backward_through_what_b_freed_raises_as_after_ordinary_backward() -> None:
    """B frees a region's saved activations although it retains the graph:
    a second backward through the region then raises autograd's "second
    time" error, as it does after ordinary backward, instead of computing
    from freed tensors."""

    class TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _Body(8)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.body(x)
            return self.head(h), h

    for split in (True, False):
        model = TwoOutputs()
        model.body.compile(backend=fxsplit.backend(compiler="eager"))
        x = torch.randn(2, 8, requires_grad=True)
        out, h = model(x)
        if split:
            _, work = fxsplit.stage_backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
        else:
            out.backward(torch.ones_like(out))
        with pytest.raises(RuntimeError, match="second time"):
            h.sum().backward()
        if split:
            fxsplit.stage_backward_weight(list(model.parameters()), work)
