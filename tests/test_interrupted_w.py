"""A W interrupted at any operator loses nothing.

Every operator W dispatches is, in turn, made to raise (a ``TorchDispatchMode``
that raises at the k-th call: an error, ``KeyboardInterrupt`` or out of
memory), on compiled stages (eager inner compiler; Inductor) and uncompiled
ones, with ``.grad`` empty and holding earlier microbatches, fused gradient
accumulation on and off. After each interruption W is called again; the
gradients must then be those of ordinary backward on an identical copy. The
one exception allowed is loud: where the operator that raised sat between the
two brackets of an in-graph accumulation (the write itself, or its closing
bracket), fxsplit cannot tell whether ``.grad`` was written, so the exception
says so, naming the weights, and W raises when called again.

Hooks, a failing plain dW graph and autograd's commit are covered in
``test_semantics.py`` (``test_a_failed_w_can_be_repeated_and_finishes_exactly_the_rest``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxsplit


class Injected(Exception):
    pass


# The operators an interruption may land between the brackets of an in-graph
# accumulation on (``passes/accumulate.py``): only there may W refuse to repeat.
# With the eager inner compiler: the write (``copy_``) or its closing bracket.
# Inductor writes in its own kernels, and one kernel may write several
# gradients (a norm's weight and bias), all of whose opening brackets run
# before it: there, a later opening bracket too.
_BETWEEN_BRACKETS = {
    "eager": {"aten.copy_.default", "fxsplit.accumulation_ends.default"},
    "inductor": {"fxsplit.accumulation_begins.default", "fxsplit.accumulation_ends.default"},
    "uncompiled": set(),
}


class RaiseAt(TorchDispatchMode):
    """Raise ``exc`` instead of running the ``k``-th operator dispatched
    (``k=None``: count only); ``raised_at`` names it."""

    def __init__(self, k: int | None, exc: BaseException | None = None) -> None:
        super().__init__()
        self.k, self.exc, self.n = k, exc, 0
        self.raised_at: str | None = None
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        if self.n == self.k:
            self.n += 1
            self.raised_at = str(func)
            assert self.exc is not None
            raise self.exc
        self.n += 1
        return func(*args, **(kwargs or {}))


class Stage(nn.Module):
    """Two regions (a graph break between them): GEMM weights, biases, a norm,
    a weight used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)
        self.down = nn.Linear(12, 6, bias=False)
        self.mix = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.up(x)))
        torch._dynamo.graph_break()
        h = self.down(h)
        return self.mix(torch.tanh(self.mix(h))) + h


def _exception(k: int) -> BaseException:
    return [Injected(f"injected at operator {k}"), KeyboardInterrupt(), torch.OutOfMemoryError("injected OOM")][k % 3]


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 6, generator=g), torch.randn(4, 3, 6, generator=g)


def _sweep(mode: str, populated: bool, fused: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Stage()
    ref = copy.deepcopy(model)
    run: Any = model
    if mode != "uncompiled":
        run = torch.compile(model, backend=fxsplit.backend(fallback="error", compiler=mode))
    weights = list(model.parameters())

    def b(seed: int) -> fxsplit.PendingWeightGrads:
        x, dy = _data(seed)
        xi = x.clone().requires_grad_()
        (dx,), work = fxsplit.stage_backward_input([run(xi)], [dy], [xi], weights)
        xr = x.clone().requires_grad_()
        ref_copy(xr).backward(dy)
        torch.testing.assert_close(dx, xr.grad)
        return work

    # The gradient ordinary backward gives one microbatch, from an identical copy.
    ref_copy = copy.deepcopy(ref)
    # Two whole microbatches first: everything compiled (the accumulating
    # variant too, when .grad is kept), .grad holding earlier microbatches.
    for seed in (1, 2):
        fxsplit.stage_backward_weight(weights, b(seed), fused_accumulation=fused)
    if not populated:
        for p in weights:
            p.grad = None
    start = [None if p.grad is None else p.grad.clone() for p in weights]
    for p in ref_copy.parameters():
        p.grad = None
    counter = RaiseAt(None)
    work = b(3)
    with counter:
        fxsplit.stage_backward_weight(weights, work, fused_accumulation=fused)
    expected = [p.grad.clone() for p in weights]
    # ordinary backward of microbatch 3 on top of the same start
    for e, s, r in zip(expected, start, ref_copy.parameters()):
        torch.testing.assert_close(e, r.grad if s is None else s + r.grad)

    outcome: dict[str, Any] = {"ok": 0, "refused": [], "ops": counter.ops}
    for k in range(counter.n):
        for p, s in zip(weights, start):
            p.grad = None if s is None else s.clone()
        for p in ref_copy.parameters():
            p.grad = None
        work = b(3)
        fault = RaiseAt(k, _exception(k))
        with pytest.raises(type(fault.exc)) as info:
            with fault:
                fxsplit.stage_backward_weight(weights, work, fused_accumulation=fused)
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "fxsplit: W was interrupted" in notes, (k, fault.raised_at)
        try:
            fxsplit.stage_backward_weight(weights, work, fused_accumulation=fused)
        except RuntimeError as e:
            assert "W cannot be repeated" in str(e) and "weights[" in str(e), e
            assert "cannot be known" in notes and "weights[" in notes, notes
            outcome["refused"].append(fault.raised_at)
            with pytest.raises(RuntimeError, match="cannot be repeated"):
                fxsplit.stage_backward_weight(weights, work)
            continue
        for p, e in zip(weights, expected):
            torch.testing.assert_close(p.grad, e, msg=lambda m, k=k, at=fault.raised_at: f"interrupted at {k} ({at}): {m}")
        outcome["ok"] += 1
    return outcome


CASES = [
    pytest.param(mode, populated, fused, id=f"{mode}-{'grad' if populated else 'nograd'}-{'fused' if fused else 'plain'}",
                 marks=[pytest.mark.inductor] if mode == "inductor" else [])
    for mode in ("eager", "uncompiled")
    for populated in (True, False)
    for fused in (True, False)
]
CASES.append(pytest.param("inductor", True, True, id="inductor-grad-fused", marks=[pytest.mark.inductor]))


@pytest.mark.parametrize("mode, populated, fused", CASES)
def test_w_interrupted_at_every_operator_then_repeated_gives_ordinary_backward(
    mode: str, populated: bool, fused: bool
) -> None:
    outcome = _sweep(mode, populated, fused)
    in_graph = mode != "uncompiled" and populated and fused
    if in_graph:
        # the sweep reached the in-graph accumulation (the case that lost gradients)
        assert "fxsplit.addmm_into.default" in outcome["ops"]
    # Refused only between an accumulation's brackets, and only where .grad is written in the graph.
    assert all(at in _BETWEEN_BRACKETS[mode] for at in outcome["refused"]), outcome["refused"]
    assert not outcome["refused"] or in_graph
    assert outcome["ok"] > 0 and outcome["ok"] + len(outcome["refused"]) == len(outcome["ops"])


def test_the_accumulation_ledger_reads_its_own_block_and_keeps_nothing_after() -> None:
    """What the brackets of an in-graph accumulation record, as the ledger of the
    block open in the calling thread reads it: a write begun and ended is
    written, one only begun unknown, one bracketed in a nested block (a CUDA
    graph capture's calls, which a replay does not make) not this ledger's,
    one from before the block not either; another thread's block reads its own
    writes and none of this one's. A bracket run outside any block keeps
    nothing alive, and no ledger is current once the blocks close."""
    import threading
    import weakref

    from fxsplit import _torch_internals as ti

    begins, ends = ti.ACCUMULATION_BEGINS, ti.ACCUMULATION_ENDS
    before, done, half, nested, other = (torch.zeros(4) for _ in range(5))
    begins(before)
    ends(before)  # (outside any block)
    seen: dict[str, str] = {}

    def elsewhere() -> None:
        with ti.recording_accumulation() as theirs:
            begins(other)
            ends(other)
            seen["other"], seen["done"] = theirs.state(other), theirs.state(done)

    with ti.recording_accumulation() as ledger:
        begins(done)
        ends(done)
        begins(half)
        with ti.recording_accumulation() as inner:
            begins(nested)
            ends(nested)
            assert inner.state(nested) == "written" and inner.state(done) == "untouched"
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        states = [ledger.state(t) for t in (done, half, nested, before, other)]
        assert states == ["written", "unknown", "untouched", "untouched", "untouched"], states
    assert seen == {"other": "written", "done": "untouched"}
    assert ti.current_ledger() is None
    gone = weakref.ref(before)
    del before
    assert gone() is None, "a tensor a bracket saw outside any block is still held"


def test_w_interrupted_between_two_gradients_it_takes_then_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    """W sets an empty ``.grad`` to the dW graph's gradient itself where
    autograd would (one assignment per weight, no operator dispatched, so
    the test above cannot interrupt it). Interrupted before the k-th
    assignment (``KeyboardInterrupt`` from the assignment), every weight's
    ``.grad`` is either untouched or final, W called again finishes exactly
    the rest, and the gradients are ordinary backward's on identical copies,
    compiled the same way and uncompiled."""
    from fxsplit import pending

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    ref, ordinary = copy.deepcopy(model), copy.deepcopy(model)  # (uncompiled; compiled as the split copy)
    backend = fxsplit.backend(compiler="eager", fallback="error")
    fn, ordinary_fn = torch.compile(model, backend=backend), torch.compile(ordinary, backend=backend)
    params = list(model.parameters())
    taken: list[int] = []
    k = 0
    while True:
        for p in (*params, *ref.parameters(), *ordinary.parameters()):
            p.grad = None
        x, g = torch.randn(4, 8), torch.randn(4, 8)
        ref(x.clone().requires_grad_()).backward(g)
        ordinary_fn(x.clone().requires_grad_()).backward(g)
        xi = x.clone().requires_grad_()
        _, work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
        calls = []

        def assign(obj: Any, name: str, value: Any) -> None:
            if name == "grad":
                calls.append(1)
                if len(calls) == k + 1:
                    raise KeyboardInterrupt
            setattr(obj, name, value)

        monkeypatch.setattr(pending, "setattr", assign, raising=False)
        try:
            fxsplit.stage_backward_weight(params, work)
        except KeyboardInterrupt as e:
            assert f"interrupted after committing {k} of {len(params)} weight(s)" in "".join(getattr(e, "__notes__", []))
            for p, q in zip(params, ref.parameters()):
                if p.grad is not None:  # untouched or final
                    torch.testing.assert_close(p.grad, q.grad)
            assert sum(p.grad is not None for p in params) == k == len(work.handed_over)
        finally:
            monkeypatch.undo()
        finished = work.done  # (no k-th assignment: every one was made)
        if not finished:
            fxsplit.stage_backward_weight(params, work)
        for other in (ref, ordinary):
            for p, q in zip(params, other.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
        if finished:
            taken = work.handed_over
            break
        k += 1
    assert k == len(taken) >= 2, "the stage should take several gradients as they are"
