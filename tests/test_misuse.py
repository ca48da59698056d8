"""Misuse of the split API fails loudly, before doing anything: every ``.grad``
and all pending W work stay as they were, and the stage then completes
correctly. Each case on an eager and on an fxsplit-compiled module."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from stage_check import MODES, assert_grads_equal, clone_input, grads_like, prepare, reference, snapshot_grads

from stage_check import TwoLayer

import fxsplit


def Stage() -> TwoLayer:
    return TwoLayer(torch.relu)


@dataclasses.dataclass
class Scene:
    """Microbatch 0 after B (its W pending), microbatch 1 after its forward."""

    model: nn.Module
    params: list[torch.Tensor]
    work0: fxsplit.PendingWeightGrads
    x1: torch.Tensor
    out1: torch.Tensor
    ref_dins: list
    ref_dw: list
    pre: list[torch.Tensor]

    def assert_untouched(self) -> None:
        assert_grads_equal([p.grad for p in self.params], self.pre)
        assert self.work0.pending
        assert self.x1.grad is None

    def finish(self) -> None:
        """B of microbatch 1 and both Ws: the result must equal plain autograd."""
        dinputs, work1 = fxsplit.stage_backward_input([self.out1], [grads_like(self.out1, 1)], [self.x1], self.params)
        torch.testing.assert_close(dinputs[0], self.ref_dins[1][0])
        fxsplit.stage_backward_weight(self.params, work1)
        fxsplit.stage_backward_weight(self.params, self.work0)
        expected = [r + p for r, p in zip(self.ref_dw, self.pre)]
        assert_grads_equal([p.grad for p in self.params], expected)


def scene(mode: str) -> Scene:
    torch.manual_seed(0)
    model = Stage()
    params = list(model.parameters())
    for p in params:  # gradients of an earlier step, which misuse must not touch
        p.grad = torch.randn_like(p)
    pre = snapshot_grads(params)
    x = torch.randn(5, 4, requires_grad=True)
    fresh = Stage()
    fresh.load_state_dict(model.state_dict())
    ref_dins, ref_dw = reference(fresh, [x], seeds=(0, 1))
    fn = prepare(model, mode)
    x0 = clone_input(x)
    out0 = fn(x0)
    _, work0 = fxsplit.stage_backward_input([out0], [grads_like(out0, 0)], [x0], params)
    x1 = clone_input(x * 1.1)
    out1 = fn(x1)
    return Scene(model, params, work0, x1, out1, ref_dins, ref_dw, pre)


def check(mode: str, misuse: Callable[[Scene], Any], error: type[Exception], match: str) -> None:
    s = scene(mode)
    with pytest.raises(error, match=match):
        misuse(s)
    s.assert_untouched()
    s.finish()


@pytest.mark.parametrize("mode", MODES)
def test_w_without_matching_b(mode: str) -> None:
    check(mode, lambda s: fxsplit.stage_backward_weight(s.params, [{"params": set(), "intermediates": []}]),
          TypeError, "no matching B")


@pytest.mark.parametrize("mode", MODES)
def test_w_twice(mode: str) -> None:
    s = scene(mode)
    s.finish()
    after = snapshot_grads(s.params)
    with pytest.raises(RuntimeError, match="already ran"):
        fxsplit.stage_backward_weight(s.params, s.work0)
    assert_grads_equal([p.grad for p in s.params], after)


@pytest.mark.parametrize("mode", MODES)
def test_b_twice_on_the_same_outputs(mode: str) -> None:
    s = scene(mode)
    dinputs, work1 = fxsplit.stage_backward_input([s.out1], [grads_like(s.out1, 1)], [s.x1], s.params)
    x1_grad = s.x1.grad.clone()
    with pytest.raises(RuntimeError, match="already ran"):
        fxsplit.stage_backward_input([s.out1], [grads_like(s.out1, 1)], [s.x1], s.params)
    torch.testing.assert_close(s.x1.grad, x1_grad)
    assert s.work0.pending and work1.pending  # both pending Ws survive the refusal
    assert_grads_equal([p.grad for p in s.params], s.pre)
    fxsplit.stage_backward_weight(s.params, work1)
    fxsplit.stage_backward_weight(s.params, s.work0)
    assert_grads_equal([p.grad for p in s.params], [r + p for r, p in zip(s.ref_dw, s.pre)])


def _b(s: Scene, grads: Any) -> Any:
    return fxsplit.stage_backward_input([s.out1], grads, [s.x1], s.params)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda o: [torch.ones_like(o), torch.ones_like(o)], "length 1, got list of length 2"),
        (lambda o: [torch.ones(o.shape[0], o.shape[1] + 1)], r"shape \(5, 4\) but the stage output has shape \(5, 3\)"),
        (lambda o: [torch.ones_like(o, dtype=torch.float64)], "dtype torch.float64 but the stage output has dtype"),
        (lambda o: None, "implicit gradient exists only for scalar"),
        # (a device no kernel runs on stands for another device: the check comes before any work)
        (lambda o: [torch.empty(o.shape, dtype=o.dtype, device="meta")], "is on meta but the stage output is on cpu"),
    ],
    ids=["length", "shape", "dtype", "missing", "device"],
)
def test_wrong_output_grads(mode: str, bad: Callable, match: str) -> None:
    check(mode, lambda s: _b(s, bad(s.out1)), ValueError, match)


@pytest.mark.parametrize("mode", MODES)
def test_weights_of_another_module(mode: str) -> None:
    other = list(Stage().parameters())
    check(mode, lambda s: fxsplit.stage_backward_weight(other, s.work0), ValueError, "do not belong")
    check(mode, lambda s: _b_with(s, other), ValueError, "do not belong to this stage")
    check(mode, lambda s: fxsplit.stage_backward_weight(s.params[:2], s.work0), ValueError, "2 missing")


@pytest.mark.parametrize("mode", MODES)
def test_weights_that_are_not_leaf_tensors_are_refused_by_name(mode: str) -> None:
    check(mode, lambda s: _b_with(s, [*s.params[:-1], "bias"]), TypeError, "weights must be tensors, got str")
    check(mode, lambda s: _b_with(s, [*s.params[:-1], s.params[-1] * 1.0]), ValueError,
          r"weights must be leaf tensors \(parameters\); got a non-leaf tensor of shape \(3,\) produced by MulBackward0")


def _b_with(s: Scene, weights: list) -> Any:
    return fxsplit.stage_backward_input([s.out1], [grads_like(s.out1, 1)], [s.x1], weights)


@pytest.mark.parametrize("mode", MODES)
def test_create_graph_is_refused(mode: str) -> None:
    msg = "not supported through a split backward"
    check(mode, lambda s: fxsplit.stage_backward_input(
        [s.out1], [grads_like(s.out1, 1)], [s.x1], s.params, create_graph=True), NotImplementedError, msg)
    check(mode, lambda s: fxsplit.stage_backward_weight(s.params, s.work0, create_graph=True),
          NotImplementedError, msg)
    check(mode, lambda s: fxsplit.stage_backward(s.out1, grads_like(s.out1, 1), [s.x1], create_graph=True),
          NotImplementedError, msg)
    # Gradients that require grad ask for a double backward just the same.
    check(mode, lambda s: _b(s, [grads_like(s.out1, 1).requires_grad_()]), NotImplementedError, msg)


@pytest.mark.parametrize("mode", MODES)
def test_split_dinputs_cannot_be_differentiated_again(mode: str) -> None:
    s = scene(mode)
    dinputs, work1 = _b(s, [grads_like(s.out1, 1)])
    assert not dinputs[0].requires_grad  # no graph was built for a second backward
    with pytest.raises(RuntimeError, match="does not require grad"):
        dinputs[0].sum().backward()
    fxsplit.stage_backward_weight(s.params, work1)
    fxsplit.stage_backward_weight(s.params, s.work0)
    assert_grads_equal([p.grad for p in s.params], [r + p for r, p in zip(s.ref_dw, s.pre)])


class Waits(torch.autograd.Function):
    """Identity whose backward runs ``action`` (to hold a split backward call open)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, action) -> torch.Tensor:
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.action()
        return g, None


class TwoHeadsOverBody(nn.Module):
    """A compiled body under two eager heads: two outputs through one region node."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Stage()
        self.action = lambda: None

    def forward(self, x: torch.Tensor):
        h = self.body(x)
        return Waits.apply(h * 2, self.action), h * 3


def test_two_split_calls_through_one_microbatch_graph_at_once_are_refused() -> None:
    """B on one output holds the region node; B on the other output of the same
    forward, at the same time in another thread, is refused before it changes anything."""
    torch.manual_seed(0)
    model = TwoHeadsOverBody()
    model.body.compile(backend=fxsplit.backend(compiler="eager", fallback="error"))
    params = list(model.parameters())
    x = torch.randn(5, 4, requires_grad=True)
    errors: list[BaseException] = []

    def other_b() -> None:
        try:
            fxsplit.stage_backward_input([out_b], [torch.ones_like(out_b)], [x], params)
        except RuntimeError as e:
            errors.append(e)

    def action() -> None:
        t = threading.Thread(target=other_b)
        t.start()
        t.join(timeout=60)

    model.action = action
    out_a, out_b = model(x)
    model.action = lambda: None
    _, work = fxsplit.stage_backward_input([out_a], [torch.ones_like(out_a)], [x], params)
    assert len(errors) == 1 and "another split backward is running" in str(errors[0])
    x_grad = x.grad.clone()
    fxsplit.stage_backward_weight(params, work)
    assert all(p.grad is not None for p in params)
    torch.testing.assert_close(x.grad, x_grad)  # the refused B added nothing


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        return a * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def test_registering_nodes_is_all_or_nothing() -> None:
    """fxsplit.runtime.registered: a node another call holds refuses the whole
    registration before any node is set; a node that takes no registration (a
    C++ autograd node) leaves none of the others registered; leaving the block
    unregisters every node."""
    from fxsplit.runtime import SPLIT_DONE, registered

    x = torch.ones(2, requires_grad=True)
    a, b = _Twice.apply(x).grad_fn, _Twice.apply(x).grad_fn
    cpp = (x * 3).grad_fn
    mine = object()
    with registered([a, b], mine):  # type: ignore[arg-type]
        assert a._fxsplit_split_call is mine and b._fxsplit_split_call is mine
        with pytest.raises(RuntimeError, match="another split backward is running"):
            with registered([_Twice.apply(x).grad_fn, b], SPLIT_DONE):
                pass
        assert b._fxsplit_split_call is mine
    assert a._fxsplit_split_call is None and b._fxsplit_split_call is None
    with pytest.raises(AttributeError):
        with registered([a, cpp, b], mine):  # type: ignore[arg-type]
            pass
    assert a._fxsplit_split_call is None and getattr(b, "_fxsplit_split_call", None) is None


@pytest.mark.parametrize("mode", MODES)
def test_w_of_one_param_groups_in_two_threads_is_refused(mode: str) -> None:
    s = scene(mode)
    gate, release = threading.Event(), threading.Event()

    def hold(g: torch.Tensor) -> None:
        gate.set()
        release.wait(timeout=60)

    handle = s.params[0].register_hook(hold)
    t = threading.Thread(target=fxsplit.stage_backward_weight, args=(s.params, s.work0))
    t.start()
    try:
        assert gate.wait(timeout=60)
        with pytest.raises(RuntimeError, match="already running"):
            fxsplit.stage_backward_weight(s.params, s.work0)
    finally:
        release.set()
        t.join(timeout=60)
        handle.remove()
    assert not s.work0.pending
    dinputs, work1 = _b(s, [grads_like(s.out1, 1)])
    fxsplit.stage_backward_weight(s.params, work1)
    assert_grads_equal([p.grad for p in s.params], [r + p for r, p in zip(s.ref_dw, s.pre)])


@pytest.mark.parametrize("mode", MODES)
def test_b_that_fails_inside_autograd_leaves_the_graph_ordinary(mode: str) -> None:
    """An exception inside B's autograd call unregisters B: an ordinary backward
    of the same microbatch afterwards computes every gradient."""
    s = scene(mode)

    def boom(g: torch.Tensor) -> None:
        raise ValueError("hook on the output")

    handle = s.out1.register_hook(boom)
    with pytest.raises(RuntimeError, match="stage_backward_input failed"):
        _b(s, [grads_like(s.out1, 1)])
    handle.remove()
    s.assert_untouched()
    s.out1.backward(grads_like(s.out1, 1))  # ordinary: regions run their whole backward
    torch.testing.assert_close(s.x1.grad, s.ref_dins[1][0])
    fxsplit.stage_backward_weight(s.params, s.work0)
    assert_grads_equal([p.grad for p in s.params], [r + p for r, p in zip(s.ref_dw, s.pre)])


def test_flat_outputs_pair_with_their_gradients_as_nested_ones_do() -> None:
    """B's reading of a flat list of outputs (its quick path) gives what the
    general walk gives for the same tensors nested; an output that needs no
    gradient is dropped, and one B already ran on is refused, naming it."""
    from fxsplit.api import _flatten_outputs

    w = torch.randn(3, requires_grad=True)
    a, b = w * 2, w * 3
    ga, gb = torch.ones(3), torch.full((3,), 2.0)
    outs, grads = _flatten_outputs([a, b], (ga, gb))
    nested_outs, nested_grads = _flatten_outputs({"x": [a], "y": (b,)}, {"x": [ga], "y": (gb,)})
    assert all(o is p for o, p in zip(outs, nested_outs)) and len(outs) == len(nested_outs) == 2
    assert all(g is h for g, h in zip(grads, nested_grads)) and len(grads) == 2
    constant = torch.randn(3)
    outs, grads = _flatten_outputs([a, constant], [ga, torch.ones(3)])
    assert len(outs) == 1 and outs[0] is a and grads[0] is ga
    fxsplit.stage_backward_input([b], [gb], [w], [])
    with pytest.raises(RuntimeError, match=r"already ran on stage output\[1\]"):
        _flatten_outputs([a, b], [ga, gb])
    view = (w * 4)[:2]  # B cannot detach a view: it stays attached, marked on its node
    fxsplit.stage_backward_input([view], [torch.ones(2)], [w], [])
    assert view.requires_grad
    with pytest.raises(RuntimeError, match=r"already ran on stage output\[1\]"):
        _flatten_outputs([a, view], [ga, torch.ones(2)])


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_listed_twice_is_accumulated_once(mode: str) -> None:
    """Weights that list one parameter twice: B then W give ordinary backward's
    gradients, each accumulated (and its post-accumulate hook fired) once, as
    upstream's split does for a parameter reached once; the same with every
    weight listed once, where W takes its common path."""
    torch.manual_seed(0)
    model = Stage()
    ref_model = Stage()
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(5, 4, requires_grad=True)
    ref_dins, ref_dw = reference(ref_model, [x])
    params = list(model.parameters())
    fired: list[int] = []
    for k, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, k=k: fired.append(k))
    fn = prepare(model, mode)
    for weights in (params + [params[0]], params):
        for p in params:
            p.grad = None
        fired.clear()
        x0 = clone_input(x)
        out = fn(x0)
        dins, work = fxsplit.stage_backward_input([out], [grads_like(out, 0)], [x0], weights)
        torch.testing.assert_close(dins[0], ref_dins[0][0])
        fxsplit.stage_backward_weight(weights, work)
        assert_grads_equal([p.grad for p in params], ref_dw)
        assert sorted(fired) == list(range(len(params))), fired


@pytest.mark.parametrize("mode", MODES)
def test_w_takes_b_weights_in_another_order(mode: str) -> None:
    """W given B's weights in another order (the same set) commits each
    weight's own gradient, ordinary backward's, and returns the gradients in
    the order W was given."""
    s = scene(mode)
    dinputs, work1 = fxsplit.stage_backward_input([s.out1], [grads_like(s.out1, 1)], [s.x1], s.params)
    torch.testing.assert_close(dinputs[0], s.ref_dins[1][0])
    reordered = s.params[::-1]
    returned = fxsplit.stage_backward_weight(reordered, work1)
    fxsplit.stage_backward_weight(s.params[1:] + s.params[:1], s.work0)
    assert all(r is p.grad for r, p in zip(returned, reordered))
    assert_grads_equal([p.grad for p in s.params], [r + p for r, p in zip(s.ref_dw, s.pre)])
