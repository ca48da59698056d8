"""CUDA graphs for the dI and dW graphs (``mode="reduce-overhead"``), on any device.

The slot logic of :mod:`fxsplit.cudagraphs` runs here through
:class:`~fxsplit.cudagraphs.SimulatedCapture`: a "replay" writes the captured
output buffers in place, exactly where a CUDA graph replay writes them, so a
live-in that a later replay overwrote would show. Real capture and replay on
a GPU are in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import copy
import gc
import logging
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit import _torch_internals as ti
from fxsplit import cudagraphs, runtime
from fxsplit.cudagraphs import RegionCapture, SimulatedCapture
from stage_check import new_regions


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> SimulatedCapture:
    sim = SimulatedCapture()
    monkeypatch.setattr(runtime, "capture_backend", lambda device: sim)
    return sim


def _zb_step(module: nn.Module, compiled: Any, xs: list[torch.Tensor], gs: list[torch.Tensor]) -> list[torch.Tensor]:
    """B for every microbatch, then W in reverse: all of them in flight at once."""
    params = list(module.parameters())
    works, dxs = [], []
    for x, g in zip(xs, gs):
        xi = x.detach().requires_grad_()
        (dx,), work = fxsplit.stage_backward_input([compiled(xi)], [g], [xi], params)
        works.append(work)
        dxs.append(dx)
    for work in reversed(works):
        fxsplit.stage_backward_weight(params, work)
    return dxs


def _pair(mode: str | None = "reduce-overhead") -> tuple[nn.Module, Any, nn.Module, Any]:
    torch.manual_seed(0)
    base = Block()
    captured, plain = copy.deepcopy(base), copy.deepcopy(base)
    return (captured, torch.compile(captured, backend=fxsplit.backend(compiler="eager", mode=mode)),
            plain, torch.compile(plain, backend=fxsplit.backend(compiler="eager")))


def _bitwise_step(captured: nn.Module, fn: Any, plain: nn.Module, plain_fn: Any, microbatches: int, step: int) -> None:
    """One step of ``microbatches`` in flight through the captured region and
    through its plain twin: input and weight gradients bitwise equal, ``.grad``
    in the same strides."""
    xs = [torch.randn(2, 3, 8) for _ in range(microbatches)]
    gs = [torch.randn(2, 3, 8) for _ in range(microbatches)]
    for a, b in zip(_zb_step(captured, fn, xs, gs), _zb_step(plain, plain_fn, xs, gs)):
        assert torch.equal(a, b), f"step {step}: input gradient differs"
    for (name, p), q in zip(captured.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), f"step {step}: {name}"
        assert p.grad.stride() == q.grad.stride(), f"step {step}: {name}"


def test_replays_give_bitwise_the_uncaptured_split_with_microbatches_in_flight(simulated: SimulatedCapture) -> None:
    captured, fn, plain, plain_fn = _pair()
    before = fxsplit.compiled_regions()
    for step in range(2):  # the second step accumulates into the first's .grad (captured accumulating dW)
        _bitwise_step(captured, fn, plain, plain_fn, 3, step)
    region = next(r for r in new_regions(before) if r.capture is not None)
    capture = region.capture
    assert capture.status == "captured"
    # W of the first microbatch starts from .grad = None (plain dW), the other five accumulate in the graph
    assert capture.replays == {"dI": 6, "dW": 1, "dW+accumulate": 5}
    assert len(capture.slots) >= 3  # three microbatches held live-ins at once
    assert not any(s.busy for s in capture.slots)  # every W released its slot
    assert "CUDA graphs: " in capture.describe()


def test_a_busy_slot_is_never_replayed() -> None:
    """The same inputs (same addresses) while the first microbatch's W is
    pending: dI replays into another slot, and the pending live-ins keep
    their values; once W released it, the slot is replayed again."""
    sim = SimulatedCapture()
    capture = RegionCapture("region-test", sim, torch.device("cpu"))
    w = torch.randn(4, 4)

    def di(args: list[Any]) -> list[Any]:
        (x,) = args
        return [x * 2, x @ w]  # an input gradient, then a live-in

    class Pending:
        pending = True

    x = torch.randn(3, 4)
    (dx0, live0), slot0 = capture.run_di(di, [x], 1)
    holder0 = Pending()
    slot0.hold(holder0)
    kept = live0.clone()
    x.add_(1.0)  # the same tensor (same address), other values: the next microbatch
    (dx1, live1), slot1 = capture.run_di(di, [x], 1)
    assert slot1 is not slot0 and live1.data_ptr() != live0.data_ptr()
    assert torch.equal(live0, kept), "a replay overwrote a pending microbatch's live-in"
    torch.testing.assert_close(live1, x @ w)
    holder0.pending = False  # W of microbatch 0 done
    slot1.hold(holder0)
    (_, live2), slot2 = capture.run_di(di, [x], 1)
    assert slot2 in (slot0, slot1) and len(capture.slots) == 2
    # input gradients leave the slot as copies: a later replay does not change them
    assert dx0.data_ptr() not in {t.data_ptr() for s in capture.slots for t in s.di.outs}


def test_more_microbatches_than_slots_run_uncaptured_and_say_so(
    simulated: SimulatedCapture, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cudagraphs, "MAX_SLOTS", 2)
    captured, fn, plain, plain_fn = _pair()
    xs = [torch.randn(2, 3, 8) for _ in range(4)]
    gs = [torch.randn(2, 3, 8) for _ in range(4)]
    with caplog.at_level(logging.INFO, logger="fxsplit"):
        got = _zb_step(captured, fn, xs, gs)
    want = _zb_step(plain, plain_fn, xs, gs)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for p, q in zip(captured.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    said = [r.getMessage() for r in caplog.records if "microbatches in flight" in r.getMessage()]
    assert len(said) == 1, said


def test_hooks_fire_as_after_ordinary_backward(simulated: SimulatedCapture) -> None:
    captured, fn, plain, plain_fn = _pair()
    fired: dict[str, list[int]] = {"captured": [], "plain": []}
    for key, mod in (("captured", captured), ("plain", plain)):
        for k, p in enumerate(mod.parameters()):
            p.register_post_accumulate_grad_hook(lambda t, k=k, key=key: fired[key].append(k))
    xs = [torch.randn(2, 3, 8) for _ in range(2)]
    gs = [torch.randn(2, 3, 8) for _ in range(2)]
    _zb_step(captured, fn, xs, gs)
    for x, g in zip(xs, gs):  # ordinary backward on the plain copy
        plain_fn(x).backward(g)
    assert sorted(fired["captured"]) == sorted(fired["plain"]) and fired["captured"]
    for p, q in zip(captured.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_symbolic_sizes_run_uncaptured_and_say_so(simulated: SimulatedCapture, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = Block()
    fn = torch.compile(model, backend=fxsplit.backend(compiler="eager", mode="reduce-overhead"), dynamic=True)
    before = fxsplit.compiled_regions()
    with caplog.at_level(logging.INFO, logger="fxsplit"):
        for t in (3, 5, 7):
            _zb_step(model, fn, [torch.randn(2, t, 8)], [torch.randn(2, t, 8)])
    region = next(r for r in new_regions(before) if r.capture is not None)
    assert region.capture.status == "it has symbolic sizes"
    said = [r.getMessage() for r in caplog.records if "run without CUDA graphs" in r.getMessage()]
    assert len(said) == 1 and "symbolic sizes" in said[0]
    assert simulated.captures == 0


def _uncaptured_step(caplog: pytest.LogCaptureFixture) -> Any:
    """One microbatch through a reduce-overhead region and its plain twin, gradients
    bitwise equal; the reduce-overhead region (whose capture status tells why it ran uncaptured)."""
    captured, fn, plain, plain_fn = _pair()
    xs, gs = [torch.randn(2, 3, 8)], [torch.randn(2, 3, 8)]
    before = fxsplit.compiled_regions()
    with caplog.at_level(logging.INFO, logger="fxsplit"):
        got = _zb_step(captured, fn, xs, gs)
    want = _zb_step(plain, plain_fn, xs, gs)
    assert torch.equal(got[0], want[0])
    assert any("run without CUDA graphs" in r.getMessage() for r in caplog.records)
    return next(r for r in new_regions(before) if r.capture is not None)


def test_cpu_tensors_run_uncaptured_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    """Without a CUDA device (the real capture backend), reduce-overhead changes
    nothing but says once why, as Inductor skips CUDA graphs for CPU tensors."""
    assert "not one CUDA device" in _uncaptured_step(caplog).capture.status


def test_a_capture_that_fails_runs_uncaptured_and_says_why(
    simulated: SimulatedCapture, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(simulated, "capture", broken)
    status = _uncaptured_step(caplog).capture.status
    assert "capturing the dI graph failed" in status and "stream is capturing" in status


def test_without_cudagraphs_nothing_is_captured(simulated: SimulatedCapture) -> None:
    captured, fn, _, _ = _pair(mode=None)
    before = fxsplit.compiled_regions()
    _zb_step(captured, fn, [torch.randn(2, 3, 8)], [torch.randn(2, 3, 8)])
    assert simulated.captures == 0
    assert all(r.capture is None for r in new_regions(before))


def test_a_replay_that_raises_while_accumulating_is_the_loud_case(
    simulated: SimulatedCapture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay writes every accumulated .grad at once, or (raising) any of
    them: W then says which weights it cannot vouch for, and refuses to run
    again rather than add a gradient twice or not at all."""
    captured, fn, _, _ = _pair()
    params = list(captured.parameters())
    _zb_step(captured, fn, [torch.randn(2, 3, 8)], [torch.randn(2, 3, 8)])  # .grad exists now
    x = torch.randn(2, 3, 8, requires_grad=True)
    _, work = fxsplit.stage_backward_input([fn(x)], [torch.randn(2, 3, 8)], [x], params)
    real = simulated.replay

    def failing(handle: Any) -> None:
        raise torch.cuda.OutOfMemoryError("simulated failure during replay")

    monkeypatch.setattr(simulated, "replay", failing)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fxsplit.stage_backward_weight(params, work)
    monkeypatch.setattr(simulated, "replay", real)
    with pytest.raises(RuntimeError, match="cannot be repeated"):
        fxsplit.stage_backward_weight(params, work)


class _IntoBuffer(torch.autograd.Function):
    """Writes ``x * w`` into one persistent buffer and returns it, as Inductor's
    cudagraph trees return the same output tensor object from every replay."""

    buffer: torch.Tensor | None = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        if _IntoBuffer.buffer is None:
            _IntoBuffer.buffer = torch.empty_like(x)
        with torch.no_grad():
            torch.mul(x, w, out=_IntoBuffer.buffer)
        return _IntoBuffer.buffer

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


def test_an_output_object_reused_by_the_next_forward_is_a_new_microbatch() -> None:
    """B marks the outputs it ran on; a later forward that returns the same tensor
    object (cudagraph trees do) is a new microbatch, and B twice on one still raises."""
    w = nn.Parameter(torch.randn(4))
    _IntoBuffer.buffer = None
    works = []
    for step in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        out = _IntoBuffer.apply(x, w)
        assert out is _IntoBuffer.buffer
        (dx,), work = fxsplit.stage_backward_input([out], [torch.ones(2, 4)], [x], [w])
        torch.testing.assert_close(dx, w.detach().expand(2, 4))
        works.append(work)
        with pytest.raises(RuntimeError, match="already ran"):
            fxsplit.stage_backward_input([out], [torch.ones(2, 4)], [x], [w])
    for work in works:
        fxsplit.stage_backward_weight([w], work)
    assert w.grad is not None


def test_output_gradients_are_copied_in_and_cpu_scalars_key_by_value() -> None:
    """A fresh output-gradient tensor every microbatch does not key a slot (it is
    copied into the slot's buffer before the replay); a CPU scalar input keys it
    by its value (a capture reads it on the host)."""
    capture = RegionCapture("region-test", SimulatedCapture(), torch.device("cpu"))
    w = torch.randn(4, 4)

    def di(args: list[Any]) -> list[Any]:
        x, g, scale = args
        return [g @ w.T * scale, x * g]

    x = torch.randn(3, 4)
    seen = []
    for value in (2.0, 2.0, 3.0):
        g = torch.randn(3, 4)  # a new tensor, at a new address, every time
        scale = torch.tensor(value)
        (dx, live), slot = capture.run_di(di, [x, g, scale], 1, copied_inputs=frozenset({1}))
        torch.testing.assert_close(dx, g @ w.T * value)
        torch.testing.assert_close(live, x * g)
        slot.release()
        seen.append(slot)
    assert seen[0] is seen[1] and seen[2] is not seen[0] and len(capture.slots) == 2


# -- weight gradients leave a replay without a copy ---------------------------------------------


def _static_storages(capture: RegionCapture) -> set[int]:
    """Storages of the static output buffers of every captured dW graph."""
    graphs = [s.dw for s in capture.slots] + [g for s in capture.slots for g in s.variants.values()]
    return {ti.storage_ptr(o) for g in graphs if g is not None for o in g.outs if isinstance(o, torch.Tensor)}


def test_weight_gradients_leave_the_dw_graph_without_a_copy(simulated: SimulatedCapture) -> None:
    """W hands autograd the dW graph's static output buffers, as Inductor's
    cudagraph trees hand out theirs: ``.grad`` is a tensor of its own (no
    view) over them. With ``.grad`` set to ``None`` between steps, as
    optimizers do, every step replays and stays bitwise the plain split's."""
    captured, fn, plain, plain_fn = _pair()
    before = fxsplit.compiled_regions()
    for step in range(3):
        for p in (*captured.parameters(), *plain.parameters()):
            p.grad = None
        _bitwise_step(captured, fn, plain, plain_fn, 2, step)
        for p, q in zip(captured.parameters(), plain.parameters()):
            assert p.grad.dtype == q.grad.dtype and not p.grad._is_view() and not p.grad.requires_grad
    capture = next(r for r in new_regions(before) if r.capture is not None).capture
    statics = _static_storages(capture)
    assert all(ti.storage_ptr(p.grad) in statics for p in captured.parameters()), "a weight gradient was copied"
    # per step: W of the second microbatch starts from .grad = None (plain dW), the first accumulates into it
    assert capture.replays == {"dI": 6, "dW": 3, "dW+accumulate": 3} and capture.held_back == 0
    # Each graph captures into a memory pool of its own: graphs sharing a pool reuse each other's
    # freed blocks, and a .grad handed out from a dW graph's outputs must not lie where the slot's
    # next dI replay writes its temporaries.
    pools = [g.handle[3] for s in capture.slots for g in (s.di, s.dw, *s.variants.values()) if g is not None]
    assert len(pools) == 12 and len({id(p) for p in pools}) == len(pools), "two captured graphs share a pool"


def test_a_weight_gradient_still_held_is_never_overwritten(caplog: pytest.LogCaptureFixture) -> None:
    """Weight gradients leave a replay as aliases of the dW graph's own
    memory, a live-in passed through as a gradient included (the captured
    graph copies it: the slot's buffer is the next dI replay's to write).
    Before the dW graph replays again they must have been dropped (a
    ``.grad`` set to ``None``, every view of it gone): while one is held, W
    runs uncaptured and says so once."""
    capture = RegionCapture("region-test", SimulatedCapture(), torch.device("cpu"))
    w = torch.randn(4, 4)

    def di(args: list[Any]) -> list[Any]:
        (x,) = args
        return [x @ w, x * 2]  # an input gradient, then a live-in

    def dw(args: list[Any]) -> list[Any]:
        (live,) = args
        return [live.sum(0), live]  # a gradient of its own, and the live-in as a gradient

    x = torch.randn(3, 4)
    (_, live), slot = capture.run_di(di, [x], 1)
    grad, passed = capture.run_dw(slot, dw, [live])
    static, static_passed = slot.dw.outs
    assert grad is not static and grad.data_ptr() == static.data_ptr() and not grad._is_view()
    assert passed is not static_passed and passed.data_ptr() == static_passed.data_ptr() != live.data_ptr()
    torch.testing.assert_close(grad, (x * 2).sum(0))
    torch.testing.assert_close(passed, x * 2)
    kept, kept_passed = grad.clone(), passed.clone()
    slot.release()
    x.add_(1.0)  # the same address, other values: the next microbatch replays dI into the same slot
    (_, live), again = capture.run_di(di, [x], 1)
    assert again is slot and torch.equal(passed, kept_passed), "a dI replay overwrote a gradient handed out"
    with caplog.at_level(logging.INFO, logger="fxsplit"):
        assert capture.run_dw(slot, dw, [live]) is None  # `grad` is held
        view = grad.view(2, 2)
        del grad
        assert capture.run_dw(slot, dw, [live]) is None  # a view of it is held
        del passed
        assert capture.run_dw(slot, dw, [live]) is None  # and so is `view`
    assert torch.equal(view.reshape(-1), kept), "a replay overwrote a gradient still held"
    said = [r.getMessage() for r in caplog.records if "still referenced" in r.getMessage()]
    assert len(said) == 1 and capture.held_back == 3 and "still held" in capture.describe()
    del view
    grad, passed = capture.run_dw(slot, dw, [live])
    torch.testing.assert_close(grad, (x * 2).sum(0))
    torch.testing.assert_close(passed, x * 2)
    assert grad.data_ptr() == static.data_ptr() and capture.replays["dW"] == 2


def test_a_w_run_uncaptured_copies_a_live_in_it_passes_through(
    simulated: SimulatedCapture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A W that runs uncaptured on a slot's live-ins (its dW graph's last
    gradients still held, or no variant left to capture) copies a live-in it
    returns as a gradient, as the captured graph does: the slot's buffer
    itself would be overwritten under the caller's ``.grad`` by the next dI
    replay into that slot."""
    monkeypatch.setattr(RegionCapture, "run_dw", lambda *args: None)  # the plain and the accumulating dW graph
    captured, fn, plain, plain_fn = _pair()
    before = fxsplit.compiled_regions()
    xs, gs = [torch.randn(2, 3, 8)], [torch.randn(2, 3, 8)]
    for a, b in zip(_zb_step(captured, fn, xs, gs), _zb_step(plain, plain_fn, xs, gs)):
        assert torch.equal(a, b)
    for p, q in zip(captured.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    (slot,) = next(r for r in new_regions(before) if r.capture is not None).capture.slots
    buffers = {ti.storage_ptr(o) for o in slot.di.outs}
    assert not [n for n, p in captured.named_parameters() if ti.storage_ptr(p.grad) in buffers], (
        "a .grad lies in the slot's memory"
    )


def test_storage_use_counts_every_tensor_that_views_a_storage() -> None:
    """The private pieces :class:`fxsplit._torch_internals.StorageUse` relies on
    (as Inductor's cudagraph trees do): a detached alias, a view and a view of
    a view each count as a holder; a weak reference does not; dropping them
    gives the count back, garbage collection does not change it."""
    t = torch.randn(4, 4)
    use = ti.StorageUse(t)
    assert not use.gained_holders()
    alias = t.detach()
    assert use.gained_holders()
    view = alias[1:].view(-1)
    del alias
    assert use.gained_holders()
    del view
    gc.collect()
    assert not use.gained_holders()
    held = t[0].detach()
    gc.collect()
    assert use.gained_holders()
    del held
    assert not use.gained_holders()


def test_the_batched_check_sees_a_holder_of_any_storage_it_watches() -> None:
    """``StorageUse.any_gained`` (what a captured graph asks before each replay)
    answers as ``any(u.gained_holders() ...)`` over every watched storage, the
    last one included, from the watch on; an empty watch never sees one."""
    ts = [torch.randn(3) for _ in range(3)]
    uses = [ti.StorageUse(t) for t in ts]
    check = ti.StorageUse.any_gained(uses)
    assert not check()
    for t in ts:
        held = t[1:]
        assert check() and check() == any(u.gained_holders() for u in uses)
        del held
        assert not check()
    alias = ts[-1].detach()
    assert check()
    del alias
    assert not check()
    assert not ti.StorageUse.any_gained([])()
