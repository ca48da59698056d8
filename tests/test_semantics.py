"""Autograd is the contract: whatever ordinary backward lets a user observe is
observed the same way after B then W.

Every test runs a stage two ways side by side: ordinary backward on an
identical copy (the reference), and B then W through fxsplit, on an eager
module, a module compiled with fxsplit (``compiler="eager"``), and for a
subset with the real Inductor. Hooks, ``.grad`` values, layout, dtype and
aliasing are compared with ``torch.testing.assert_close``.
"""

from __future__ import annotations

import collections
import copy
import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit
from zoo import ParallelHeads, TwoLinear

MODES = ["eager", "compiled", pytest.param("inductor", marks=pytest.mark.inductor)]
FAST_MODES = ["eager", "compiled"]


def backend_for(mode: str) -> Any:
    return fxsplit.backend(compiler="inductor" if mode == "inductor" else "eager", fallback="error")


# ---------------------------------------------------------------------------------------------
# stages


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


TwoLayer = TwoLinear


class SharedTwoRegions(nn.Module):
    """One Linear used on both sides of a graph break: two compiled regions share its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        torch._dynamo.graph_break()
        return self.lin(h) * 2


class SharedCompiledEager(nn.Module):
    """A weight used inside a compiled body and again by eager code above it (a tied head)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.head_bias = nn.Parameter(torch.randn(6) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) @ self.body.lin.weight.t() + self.head_bias


class SigmoidBody(Body):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # its own code: Dynamo compiles it apart
        return torch.sigmoid(self.lin(x))


class TwoRegions(nn.Module):
    """Two compiled bodies (compiled in place) with an eager scale between them."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Body()
        self.scale = nn.Parameter(torch.full((6,), 0.5))
        self.second = SigmoidBody()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) * self.scale)


def prepare(model: nn.Module, mode: str) -> Callable[..., Any]:
    """How the stage is run: eager as is, or compiled (in place where the stage
    mixes compiled and eager parts, otherwise wrapped)."""
    if mode == "eager":
        return model
    backend = backend_for(mode)
    if isinstance(model, SharedCompiledEager):
        model.body.compile(backend=backend)
        return model
    if isinstance(model, TwoRegions):
        model.first.compile(backend=backend)
        model.second.compile(backend=backend)
        return model
    return torch.compile(model, backend=backend)


STAGES = {
    "two_layer": TwoLayer,
    "shared_two_regions": SharedTwoRegions,
    "shared_compiled_eager": SharedCompiledEager,
    "two_regions": TwoRegions,
}


def inputs(n: int, shape: tuple[int, ...] = (5, 6), dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(n)]


def out_grads(n: int, shape: tuple[int, ...] = (5, 6), dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(n)]


class Hooks:
    """Counts every hook autograd runs on a module's parameters: a tensor hook
    that doubles the gradient, a post-accumulate-grad hook, and a post hook on
    the grad accumulator (as data-parallel wrappers register; the accumulators
    are held here, as those wrappers hold them)."""

    def __init__(
        self, model: nn.Module, raise_in: dict[str, BaseException] | None = None, post: bool = True
    ) -> None:
        self.pre: collections.Counter[str] = collections.Counter()
        self.post: collections.Counter[str] = collections.Counter()
        self.acc: collections.Counter[str] = collections.Counter()
        self.raise_pre = dict(raise_in or {})
        self.raise_post: dict[str, BaseException] = {}
        self.accumulators = []
        for name, p in model.named_parameters():
            p.register_hook(self._pre(name))
            if post:
                p.register_post_accumulate_grad_hook(self._post(name))
            acc = torch.autograd.graph.get_gradient_edge(p).node
            acc.register_hook(lambda grad_inputs, grad_outputs, name=name: self.acc.update([name]))
            self.accumulators.append(acc)

    def _pre(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(g: torch.Tensor) -> torch.Tensor:
            self.pre[name] += 1
            exc = self.raise_pre.pop(name, None)
            if exc is not None:
                raise exc
            return g * 2

        return hook

    def _post(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self.post[name] += 1
            exc = self.raise_post.pop(name, None)
            if exc is not None:
                raise exc

        return hook


def reference_grads(model: nn.Module, xs: list[torch.Tensor], gs: list[torch.Tensor]) -> tuple[nn.Module, list]:
    """Ordinary backward, one microbatch after the other, on ``model`` (a copy)."""
    dxs = []
    for x, g in zip(xs, gs):
        xi = x.clone().requires_grad_()
        model(xi).backward(g)
        dxs.append(xi.grad)
    return model, dxs


def assert_same_grads(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if r.grad is None:
            assert p.grad is None, name
        else:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, r.grad, msg=lambda m: f"{name}: {m}")
            assert p.grad.dtype == r.grad.dtype and p.grad.stride() == r.grad.stride(), name


# ---------------------------------------------------------------------------------------------
# 1. hooks fire once per weight per microbatch, at W, with autograd's value


@pytest.mark.parametrize("mode", FAST_MODES)
@pytest.mark.parametrize("kind", list(STAGES))
def test_hooks_fire_once_per_weight_per_microbatch_at_w(kind: str, mode: str) -> None:
    torch.manual_seed(0)
    model = STAGES[kind]()
    ref = copy.deepcopy(model)
    ref_hooks, hooks = Hooks(ref), Hooks(model)
    xs, gs = inputs(3), out_grads(3)
    reference_grads(ref, xs, gs)

    fn = prepare(model, mode)
    params = list(model.parameters())
    pending = []
    for x, g in zip(xs, gs):
        xi = x.clone().requires_grad_()
        _, work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
        pending.append(work)
    assert not hooks.pre and not hooks.post and not hooks.acc, "a weight hook fired during B"
    for work in reversed(pending):
        fxsplit.stage_backward_weight(params, work)
    assert hooks.pre == ref_hooks.pre and hooks.post == ref_hooks.post and hooks.acc == ref_hooks.acc
    assert set(hooks.post.values()) == {3} and set(hooks.acc.values()) == {3}
    assert_same_grads(model, ref)


@pytest.mark.inductor
def test_hooks_on_an_inductor_stage() -> None:
    test_hooks_fire_once_per_weight_per_microbatch_at_w("shared_compiled_eager", "inductor")


@pytest.mark.parametrize("mode", FAST_MODES)
def test_hooks_on_a_first_stage(mode: str) -> None:
    """Inputs need no gradient: B runs the chain, W the weight gradients; hooks fire at W, once."""
    torch.manual_seed(0)
    model = TwoLayer()
    ref = copy.deepcopy(model)
    ref_hooks, hooks = Hooks(ref), Hooks(model)
    xs, gs = inputs(2), out_grads(2)
    for x, g in zip(xs, gs):
        ref(x).backward(g)
    fn = prepare(model, mode)
    params = list(model.parameters())
    for k, (x, g) in enumerate(zip(xs, gs)):
        (dx,), work = fxsplit.stage_backward_input([fn(x)], [g], [x], params)
        assert dx is None and set(hooks.post.values()) <= {k}, "a weight hook fired during B"
        fxsplit.stage_backward_weight(params, work)
    assert hooks.pre == ref_hooks.pre and hooks.post == ref_hooks.post
    assert_same_grads(model, ref)


# ---------------------------------------------------------------------------------------------
# 2. .grad never aliases a user tensor; a parameter returned as an output


class AddPos(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos


class ReturnsParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.table = nn.Parameter(torch.randn(5, 6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.table


@pytest.mark.parametrize("mode", FAST_MODES)
def test_grad_never_aliases_the_callers_output_gradient(mode: str) -> None:
    torch.manual_seed(0)
    model = AddPos()
    ref = copy.deepcopy(model)
    xs, gs = inputs(3), out_grads(3)
    kept = [g.clone() for g in gs]
    reference_grads(ref, xs, gs)
    fn = prepare(model, mode)
    params = list(model.parameters())
    for x, g in zip(xs, gs):
        xi = x.clone().requires_grad_()
        _, work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
        fxsplit.stage_backward_weight(params, work)
        assert all(model.pos.grad.untyped_storage().data_ptr() != h.untyped_storage().data_ptr() for h in gs)
    for g, k in zip(gs, kept):
        torch.testing.assert_close(g, k, rtol=0, atol=0)  # W never added into the caller's tensors
    assert_same_grads(model, ref)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "eager"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "through-autograd"])
def test_w_gives_its_own_gradients_to_an_empty_grad_without_a_copy(mode: str, direct: bool, monkeypatch: Any) -> None:
    """After ordinary backward, AccumulateGrad takes the compiled backward's
    output as an empty ``.grad``; W must do the same with the dW graph's
    output rather than copy every weight gradient on a microbatch that starts
    from ``.grad = None`` (autograd copies a gradient someone else references,
    and a root gradient passed to the engine is referenced by its caller).
    Where nothing observes the accumulation W sets ``.grad`` itself
    (``work.handed_over``); with ``fused_accumulation=False`` the gradients go
    through autograd's engine by a hand-over node that keeps no reference."""
    from fxsplit import pending, runtime

    torch.manual_seed(0)
    model = TwoLayer()
    ref = copy.deepcopy(model)
    (x,), (g,) = inputs(1), out_grads(1)
    reference_grads(ref, [x], [g])
    fn = prepare(model, mode)
    params = list(model.parameters())
    produced: set[int] = set()
    handed: set[int] = set()
    original = pending._HandOver.backward
    original_dw = runtime.CompiledSplitBackward.run_dw

    def spy(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = original(ctx, grad)
        handed.update(t.untyped_storage().data_ptr() for t in out if t is not None)
        return out

    def spy_dw(self: Any, live_ins: list[Any], *rest: Any) -> list[Any]:
        out = original_dw(self, live_ins, *rest)
        produced.update(t.untyped_storage().data_ptr() for t in out if isinstance(t, torch.Tensor))
        return out

    monkeypatch.setattr(pending._HandOver, "backward", staticmethod(spy))
    monkeypatch.setattr(runtime.CompiledSplitBackward, "run_dw", spy_dw)
    xi = x.clone().requires_grad_()
    _, work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
    fxsplit.stage_backward_weight(params, work, fused_accumulation=None if direct else False)
    matrices = [p for p in params if p.dim() == 2]  # computed by the dW graph's matmuls
    assert matrices and all(p.grad.untyped_storage().data_ptr() in produced for p in matrices)
    if direct:  # (a bias gradient dI computed and dW returns as it is, a live-in, goes through autograd)
        assert all(any(params[k] is p for k in work.handed_over) for p in matrices)
        assert not any(p.grad.untyped_storage().data_ptr() in handed for p in matrices)
    else:
        assert not work.handed_over and all(p.grad.untyped_storage().data_ptr() in handed for p in matrices)
    assert_same_grads(model, ref)


@pytest.mark.parametrize("mode", FAST_MODES)
def test_parameter_returned_as_an_output(mode: str) -> None:
    """Every microbatch returns the same parameter: B must not refuse it later,
    and its .grad must not be the caller's gradient tensor."""
    torch.manual_seed(0)
    model = ReturnsParam()
    ref = copy.deepcopy(model)
    xs = inputs(3)
    g_out, g_table = out_grads(3), [t * 3 for t in out_grads(3)]
    for x, a, b in zip(xs, g_out, g_table):
        torch.autograd.backward(ref(x.clone().requires_grad_()), [a, b])
    fn = prepare(model, mode)
    params = list(model.parameters())
    for x, a, b in zip(xs, g_out, g_table):
        xi = x.clone().requires_grad_()
        out = fn(xi)
        assert out[1] is model.table or mode != "eager"
        _, work = fxsplit.stage_backward_input(list(out), [a, b], [xi], params)
        fxsplit.stage_backward_weight(params, work)
        assert model.table.grad.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in g_table}
    assert not hasattr(model.table, "_fxsplit_b_done")
    assert_same_grads(model, ref)


# ---------------------------------------------------------------------------------------------
# 3. .grad layout and dtype are the parameter's


class TransposedUse(nn.Module):
    """A parameter added then transposed: its gradient is computed transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.t() + self.w).t() * 2


class Conv1dLength1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(6, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [TransposedUse, Conv1dLength1], ids=["transposed", "conv1d_length_1"])
def test_grad_has_the_parameters_layout(stage: type[nn.Module], mode: str) -> None:
    torch.manual_seed(0)
    model = stage()
    ref = copy.deepcopy(model)
    shape = (5, 6) if stage is TransposedUse else (3, 6, 1)
    out_shape = (5, 6) if stage is TransposedUse else (3, 4, 1)
    xs, gs = inputs(2, shape), out_grads(2, out_shape)
    reference_grads(ref, xs, gs)
    fn = prepare(model, mode)
    params = list(model.parameters())
    for x, g in zip(xs, gs):
        xi = x.clone().requires_grad_()
        _, work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
        fxsplit.stage_backward_weight(params, work)
    assert_same_grads(model, ref)  # includes strides
    for p in params:
        assert p.grad.is_contiguous() == p.is_contiguous()
        p.grad.view(-1)


@pytest.mark.parametrize("mode", MODES)
def test_bf16_parameters_with_float32_grad_dtype(mode: str) -> None:
    torch.manual_seed(0)
    model = TwoLayer().to(torch.bfloat16)
    for p in model.parameters():
        p.grad_dtype = torch.float32
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad_dtype = torch.float32
    xs, gs = inputs(3, dtype=torch.bfloat16), out_grads(3, dtype=torch.bfloat16)
    reference_grads(ref, xs, gs)
    fn = prepare(model, mode)
    params = list(model.parameters())
    pending = []
    for x, g in zip(xs, gs):
        xi = x.clone().requires_grad_()
        pending.append(fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)[1])
    for work in pending:
        fxsplit.stage_backward_weight(params, work)
    assert all(p.grad.dtype == torch.float32 for p in params)
    assert_same_grads(model, ref)


# ---------------------------------------------------------------------------------------------
# 4. only the weights given get gradients


@pytest.mark.parametrize("mode", FAST_MODES)
@pytest.mark.parametrize("kind", ["two_layer", "shared_compiled_eager"])
def test_only_the_given_weights_get_gradients(kind: str, mode: str) -> None:
    torch.manual_seed(0)
    model = STAGES[kind]()
    ref = copy.deepcopy(model)
    xs, gs = inputs(2), out_grads(2)
    reference_grads(ref, xs, gs)
    fn = prepare(model, mode)
    names = [n for n, _ in model.named_parameters()]
    given = {names[0], names[-1]}
    weights = [p for n, p in model.named_parameters() if n in given]
    for x, g in zip(xs, gs):
        xi = x.clone().requires_grad_()
        _, work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], weights)
        fxsplit.stage_backward_weight(weights, work)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if name in given:
            torch.testing.assert_close(p.grad, r.grad)
        else:
            assert p.grad is None, f"{name} was not given to B/W but got a gradient"


@pytest.mark.parametrize("mode", FAST_MODES)
def test_plain_tensor_weight_used_inside_a_compiled_region(mode: str) -> None:
    """A weight that is a leaf tensor, not an nn.Parameter: Dynamo passes it as an
    ordinary input, so the region computes its gradient in the dI graph and B
    hands it to W, which accumulates it through autograd with the rest."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    w = torch.randn(6, 6, requires_grad=True)
    lin_ref, w_ref = copy.deepcopy(lin), w.detach().clone().requires_grad_()
    calls: collections.Counter[str] = collections.Counter()
    w.register_post_accumulate_grad_hook(lambda t: calls.update(["w"]))

    def f(x: torch.Tensor, weight: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        return torch.tanh(layer(x)) @ weight

    fn = f if mode == "eager" else torch.compile(f, backend=backend_for(mode))
    xs, gs = inputs(2), out_grads(2)
    weights = [w, *lin.parameters()]
    for x, g in zip(xs, gs):
        xr = x.clone().requires_grad_()
        f(xr, w_ref, lin_ref).backward(g)
        xi = x.clone().requires_grad_()
        (dx,), work = fxsplit.stage_backward_input([fn(xi, w, lin)], [g], [xi], weights)
        assert w.grad is None or calls["w"] == 1
        fxsplit.stage_backward_weight(weights, work)
        torch.testing.assert_close(dx, xr.grad)
    assert calls["w"] == 2
    torch.testing.assert_close(w.grad, w_ref.grad)
    for p, r in zip(lin.parameters(), lin_ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad)


# ---------------------------------------------------------------------------------------------
# 5. a W that raises can be called again and finishes exactly the rest


def _fail_dw_once(region: Any, exc: BaseException) -> None:
    """Make ``region``'s next dW graph run raise ``exc`` (then behave normally)."""
    original = region._run_dw

    def run_dw(live_ins: list[Any]) -> Any:
        region._run_dw = original
        raise exc

    region._run_dw = run_dw


FAILURES = {
    # name: (stage, modes it applies to)
    "dw_graph_raises": ("two_layer", ("compiled", "inductor")),
    "keyboard_interrupt_in_second_region_dw": ("two_regions", ("compiled", "inductor")),
    "tensor_hook_of_second_weight_raises": ("two_regions", ("eager", "compiled")),
    # no post-accumulate hooks: which weights accumulated is read off .grad
    "tensor_hook_raises_without_post_hooks": ("two_regions", ("eager", "compiled")),
    "tensor_hook_keyboard_interrupt": ("shared_compiled_eager", ("eager", "compiled")),
    "post_accumulate_hook_raises": ("two_regions", ("eager", "compiled")),
}


def _failure_cases() -> list[Any]:
    cases = []
    for name, (_, modes) in FAILURES.items():
        for mode in modes:
            marks = [pytest.mark.inductor] if mode == "inductor" else []
            cases.append(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}"))
    return cases


@pytest.mark.parametrize("failure, mode", _failure_cases())
def test_a_failed_w_can_be_repeated_and_finishes_exactly_the_rest(failure: str, mode: str) -> None:
    torch.manual_seed(0)
    kind = FAILURES[failure][0]
    model = STAGES[kind]()
    ref = copy.deepcopy(model)
    for p, r in list(zip(model.parameters(), ref.parameters()))[::2]:  # earlier gradients, added to in place
        p.grad = torch.randn_like(p)
        r.grad = p.grad.clone()
    post = failure != "tensor_hook_raises_without_post_hooks"
    ref_hooks, hooks = Hooks(ref, post=post), Hooks(model, post=post)
    xs, gs = inputs(2), out_grads(2)
    reference_grads(ref, xs, gs)

    before = fxsplit.compiled_regions()
    fn = prepare(model, mode)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    xi = xs[0].clone().requires_grad_()
    _, work0 = fxsplit.stage_backward_input([fn(xi)], [gs[0]], [xi], params)
    regions = [r for r in fxsplit.compiled_regions() if r not in before]
    snapshot = [None if p.grad is None else p.grad.clone() for p in params]

    exc_type: type[BaseException] = RuntimeError
    if failure == "dw_graph_raises":
        _fail_dw_once(regions[0], RuntimeError("dW graph failed"))
    elif failure == "keyboard_interrupt_in_second_region_dw":
        assert len(regions) == 2
        _fail_dw_once(regions[1], KeyboardInterrupt())
        exc_type = KeyboardInterrupt
    elif failure in ("tensor_hook_of_second_weight_raises", "tensor_hook_raises_without_post_hooks"):
        hooks.raise_pre[names[1]] = RuntimeError("hook failed")
    elif failure == "tensor_hook_keyboard_interrupt":
        hooks.raise_pre["body.lin.weight"] = KeyboardInterrupt()
        exc_type = KeyboardInterrupt
    else:
        hooks.raise_post[names[1]] = RuntimeError("post hook failed")

    with pytest.raises(exc_type) as info:
        fxsplit.stage_backward_weight(params, work0)
    assert work0.pending
    notes = getattr(info.value, "__notes__", [])
    assert any("pass the same param_groups to stage_backward_weight again" in n for n in notes)
    committed = {n for n, p, s in zip(names, params, snapshot) if not _same(p.grad, s)}
    if failure in ("dw_graph_raises", "keyboard_interrupt_in_second_region_dw"):
        assert committed == set(), "a dW graph failed but .grad changed"
    if failure == "post_accumulate_hook_raises":
        assert names[1] in committed  # accumulated before its post hook raised
    if failure.startswith("tensor_hook"):
        raised = "body.lin.weight" if failure == "tensor_hook_keyboard_interrupt" else names[1]
        assert raised not in committed

    # The next microbatch may come in between; then W of microbatch 0 again.
    xi = xs[1].clone().requires_grad_()
    _, work1 = fxsplit.stage_backward_input([fn(xi)], [gs[1]], [xi], params)
    fxsplit.stage_backward_weight(params, work1)
    fxsplit.stage_backward_weight(params, work0)
    assert not work0.pending
    assert hooks.post == ref_hooks.post, "a weight was accumulated twice or not at all"
    expected_acc = collections.Counter(ref_hooks.acc)
    if failure == "post_accumulate_hook_raises":
        # As in ordinary backward, the exception skipped the hooks that run after it
        # on that weight's accumulator; the weight is committed, so they stay skipped.
        expected_acc[names[1]] -= 1
    assert hooks.acc == expected_acc
    assert_same_grads(model, ref)
    with pytest.raises(RuntimeError, match="already ran"):
        fxsplit.stage_backward_weight(params, work0)


@pytest.mark.parametrize("mode", FAST_MODES)
def test_optimizer_in_backward_survives_a_repeated_w(mode: str) -> None:
    """A post-accumulate hook that steps the weight and clears .grad (optimizer in
    backward): after a W interrupted by another weight's hook and repeated, each
    weight was stepped exactly once, as ordinary backward does."""
    torch.manual_seed(0)
    model = TwoRegions()
    ref = copy.deepcopy(model)
    fail = {"second.lin.weight": 1}

    def attach(m: nn.Module, failing: dict[str, int]) -> collections.Counter[str]:
        steps: collections.Counter[str] = collections.Counter()
        for name, p in m.named_parameters():

            def step(p: torch.Tensor, name: str = name) -> None:
                steps[name] += 1
                with torch.no_grad():
                    p.sub_(0.1 * p.grad)
                p.grad = None

            def pre(g: torch.Tensor, name: str = name) -> None:
                if failing.get(name):
                    failing[name] -= 1
                    raise RuntimeError("hook failed")

            p.register_hook(pre)
            p.register_post_accumulate_grad_hook(step)
        return steps

    ref_steps, steps = attach(ref, {}), attach(model, fail)
    x, g = inputs(1)[0], out_grads(1)[0]
    ref(x.clone().requires_grad_()).backward(g)
    prepare(model, mode)
    params = list(model.parameters())
    xi = x.clone().requires_grad_()
    _, work = fxsplit.stage_backward_input([model(xi)], [g], [xi], params)
    with pytest.raises(RuntimeError, match="hook failed"):
        fxsplit.stage_backward_weight(params, work)
    assert 0 < work.committed < len(params)
    fxsplit.stage_backward_weight(params, work)
    assert steps == ref_steps and set(steps.values()) == {1}
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, r, msg=lambda m: f"{name}: {m}")
        assert p.grad is None


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# 6. isolation: only the autograd calls B makes are split


class Rendezvous(torch.autograd.Function):
    """Identity whose backward calls ``action()`` (to run something while B is in flight)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, action: Callable[[], None]) -> torch.Tensor:
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.action()
        return g, None


class WithRendezvous(nn.Module):
    """A compiled body below an eager rendezvous point: B runs the body's dI
    graph, then calls ``action`` while its autograd call is still running."""

    def __init__(self) -> None:
        super().__init__()
        self.body = TwoLayer()
        self.action: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(Rendezvous.apply(x, self.action))


def _run_in_thread(fn: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the other thread's backward deadlocked"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("same_model", [True, False], ids=["same_model", "another_model"])
def test_ordinary_backward_on_another_thread_during_b_is_ordinary(same_model: bool, mode: str) -> None:
    torch.manual_seed(0)
    model = WithRendezvous()
    ref = copy.deepcopy(model)
    other = model if same_model else copy.deepcopy(model)
    other_ref = copy.deepcopy(other)
    x, g = inputs(1)[0], out_grads(1)[0]
    y, gy = inputs(2)[1], out_grads(2)[1]

    if mode != "eager":
        backend = backend_for(mode)
        model.body.compile(backend=backend)
        if not same_model:
            other.body.compile(backend=backend)  # same code: Dynamo reuses the compiled region
    params = list(model.parameters())

    # The other thread's ordinary backward; for the same model it runs on its own forward.
    y_out = other(y.clone().requires_grad_())
    seen: dict[str, Any] = {}

    def ordinary_backward() -> None:
        before = {n: (None if p.grad is None else p.grad.clone()) for n, p in other.named_parameters()}
        y_out.backward(gy)
        seen["delta"] = {
            n: p.grad - (0 if before[n] is None else before[n]) for n, p in other.named_parameters()
        }

    model.action = lambda: _run_in_thread(ordinary_backward)
    xi = x.clone().requires_grad_()
    out = model(xi)
    model.action = lambda: None
    (dx,), work = fxsplit.stage_backward_input([out], [g], [xi], params)
    assert "delta" in seen, "the other backward did not run during B"
    fxsplit.stage_backward_weight(params, work)

    # The other backward got every weight gradient, at once, in its own .backward().
    other_ref(y.clone().requires_grad_()).backward(gy)
    for n, r in other_ref.named_parameters():
        torch.testing.assert_close(seen["delta"][n], r.grad)
    # B and W of this microbatch are unaffected by it.
    xr = x.clone().requires_grad_()
    ref(xr).backward(g)
    torch.testing.assert_close(dx, xr.grad)
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        expected = r.grad + (other_ref.get_parameter(n).grad if same_model else 0)
        torch.testing.assert_close(p.grad, expected)


def test_two_b_calls_in_flight_in_two_threads() -> None:
    """B of two microbatches running at the same time in two threads (forced to
    overlap): each records its own W work."""
    torch.manual_seed(0)
    model = WithRendezvous()
    ref = copy.deepcopy(model)
    xs, gs = inputs(2), out_grads(2)
    reference_grads(ref, xs, gs)
    model.body.compile(backend=backend_for("compiled"))
    params = list(model.parameters())
    barrier = threading.Barrier(2, timeout=60)
    model.action = barrier.wait
    outs, xis = [], []
    for x in xs:
        xis.append(x.clone().requires_grad_())
        outs.append(model(xis[-1]))
    model.action = lambda: None
    results: dict[int, Any] = {}

    def b(k: int) -> None:
        results[k] = fxsplit.stage_backward_input([outs[k]], [gs[k]], [xis[k]], params)

    t = threading.Thread(target=b, args=(1,))
    t.start()
    b(0)
    t.join(timeout=120)
    assert set(results) == {0, 1}
    for k in (0, 1):
        assert len(results[k][1].compiled) == 1
    for k in (1, 0):
        fxsplit.stage_backward_weight(params, results[k][1])
    assert_same_grads(model, ref)


# ---------------------------------------------------------------------------------------------
# 7. compiled autograd


def _ca() -> Any:
    from torch._dynamo import compiled_autograd

    return compiled_autograd._enable(lambda gm: gm)


def test_compiled_autograd_refuses_b_on_a_compiled_stage_before_anything_changes() -> None:
    torch.manual_seed(0)
    model = TwoLayer()
    ref = copy.deepcopy(model)
    x, g = inputs(1)[0], out_grads(1)[0]
    reference_grads(ref, [x], [g])
    fn = prepare(model, "compiled")
    params = list(model.parameters())
    xi = x.clone().requires_grad_()
    out = fn(xi)
    with _ca(), pytest.raises(RuntimeError, match="compiled autograd"):
        fxsplit.stage_backward_input([out], [g], [xi], params)
    assert xi.grad is None and all(p.grad is None for p in params)
    # Nothing was consumed: B and W outside compiled autograd complete the microbatch.
    (dx,), work = fxsplit.stage_backward_input([out], [g], [xi], params)
    with _ca():  # W of a stage without eager parts commits correctly under it
        fxsplit.stage_backward_weight(params, work)
    assert_same_grads(model, ref)


def test_compiled_autograd_refuses_w_that_passes_through_compiled_regions() -> None:
    torch.manual_seed(0)
    model = SharedCompiledEager()
    ref = copy.deepcopy(model)
    x, g = inputs(1)[0], out_grads(1)[0]
    reference_grads(ref, [x], [g])
    prepare(model, "compiled")
    params = list(model.parameters())
    xi = x.clone().requires_grad_()
    _, work = fxsplit.stage_backward_input([model(xi)], [g], [xi], params)
    with _ca(), pytest.raises(RuntimeError, match="compiled autograd"):
        fxsplit.stage_backward_weight(params, work)
    assert all(p.grad is None for p in params) and work.pending
    fxsplit.stage_backward_weight(params, work)
    assert_same_grads(model, ref)


def test_compiled_autograd_on_an_eager_stage_splits_correctly() -> None:
    torch.manual_seed(0)
    model = TwoLayer()
    ref = copy.deepcopy(model)
    xs, gs = inputs(2), out_grads(2)
    _, ref_dx = reference_grads(ref, xs, gs)
    params = list(model.parameters())
    with _ca():
        for x, g, rdx in zip(xs, gs, ref_dx):
            xi = x.clone().requires_grad_()
            (dx,), work = fxsplit.stage_backward_input([model(xi)], [g], [xi], params)
            assert all(p.grad is None for p in params) or x is not xs[0]
            fxsplit.stage_backward_weight(params, work)
            torch.testing.assert_close(dx, rdx)
    assert_same_grads(model, ref)


# ---------------------------------------------------------------------------------------------
# 8. bounded state: a region lives as long as the code (or pending work) that uses it


@pytest.mark.parametrize("first", [False, True], ids=["middle_stage", "first_stage"])
@pytest.mark.parametrize("mode", ["compiled", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_regions_are_freed_with_their_module(mode: str, first: bool) -> None:
    """Also where B frees a region's saved tensors itself (a first stage runs
    its bottom regions outside the engine): nothing B leaves behind keeps
    the region alive."""
    torch.manual_seed(0)
    before = fxsplit.compiled_regions()
    model = TwoLayer()
    fn = prepare(model, mode)
    params = list(model.parameters())
    x = inputs(1)[0].requires_grad_(not first)
    out = fn(x)
    (region,) = [r for r in fxsplit.compiled_regions() if r not in before]
    ref = weakref.ref(region)
    del region, before
    _, work = fxsplit.stage_backward_input([out], [torch.ones_like(out)], [x], params)
    del fn, model, out, x
    torch._dynamo.reset()
    gc.collect()
    assert ref() is not None and ref() in fxsplit.compiled_regions(), "pending W work must keep its region"
    fxsplit.stage_backward_weight(params, work)
    del work
    gc.collect()
    assert ref() is None, "a region outlived its module, Dynamo's cache and its W work"
    assert all(r is not ref() for r in fxsplit.compiled_regions())


def test_recompiles_do_not_accumulate_regions() -> None:
    """(Only regions made here are checked: on a graph break Dynamo keeps the
    compiled function in the module's globals, even after reset(), and so the
    regions of other tests in this file.)"""
    torch.manual_seed(0)
    before = fxsplit.compiled_regions()
    for _ in range(5):
        model = TwoLayer()
        fn = prepare(model, "compiled")
        fn(inputs(1)[0].requires_grad_()).sum().backward()
        del fn, model
        torch._dynamo.reset()
    gc.collect()
    assert [r for r in fxsplit.compiled_regions() if r not in before] == []


# ---------------------------------------------------------------------------------------------
# differences that come from torch.compile itself (docs/semantics.md)


def test_an_output_given_no_gradient_behaves_as_under_torch_compile() -> None:
    """A compiled region's output that receives no gradient: eager autograd
    leaves ``b``'s ``.grad`` ``None`` and never calls its hooks; torch.compile
    (AOTAutograd, any backend) materializes a zero gradient for the output,
    so ``b`` gets a zero ``.grad`` and its hooks are called. B then W gives
    what the same compile gives (``aot_eager`` here), not what eager gives."""
    torch.manual_seed(0)
    model = ParallelHeads(4)
    x = torch.randn(3, 4)

    def run(kind: str) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        m = copy.deepcopy(model)
        seen: list[torch.Tensor] = []
        m.b.weight.register_hook(lambda g: seen.append(g.clone()))
        xi = x.clone().requires_grad_()
        backend = "aot_eager" if kind == "aot_eager" else backend_for("compiled")
        fn = m if kind == "eager" else torch.compile(m, backend=backend)
        ya, _ = fn(xi)
        g = torch.ones_like(ya)
        if kind == "fxsplit":
            params = list(m.parameters())
            _, work = fxsplit.stage_backward_input([ya], [g], [xi], params)
            fxsplit.stage_backward_weight(params, work)
        else:
            ya.backward(g)
        return [xi.grad] + [p.grad for p in m.parameters()], seen

    eager, eager_hooks = run("eager")
    compiled, compiled_hooks = run("aot_eager")
    split, split_hooks = run("fxsplit")
    assert eager[3] is None and not eager_hooks  # b.weight: eager autograd never reaches it
    assert compiled[3] is not None and len(compiled_hooks) == 1  # torch.compile's own behaviour
    for s, c in zip(split, compiled):
        assert (s is None) == (c is None)
        if c is not None:
            torch.testing.assert_close(s, c)
    assert len(split_hooks) == len(compiled_hooks)
    for s, c in zip(split_hooks, compiled_hooks):
        torch.testing.assert_close(s, c)


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_empty_grad_takes_no_view_after_w_as_after_ordinary_backward(compiler: str) -> None:
    """W sets an empty .grad to the dW graph's gradient itself where autograd would
    take it; a gradient that is a view of a live-in (a bias gradient dI computed
    as a keep-dim sum) is no such tensor: .grad is no view after W, as after
    ordinary backward, and every .grad has ordinary backward's strides."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    split, ordinary = copy.deepcopy(base), copy.deepcopy(base)
    backend = fxsplit.backend(compiler=compiler)
    fs, fo = torch.compile(split, backend=backend), torch.compile(ordinary, backend=backend)
    x, g = torch.randn(3, 5, 8, requires_grad=True), torch.randn(3, 5, 8)
    fo(x).backward(g)
    xi = x.detach().requires_grad_()
    _, work = fxsplit.stage_backward_input([fs(xi)], [g], [xi], list(split.parameters()))
    fxsplit.stage_backward_weight(list(split.parameters()), work)
    assert work.handed_over, "W took no gradient as it is"
    for (name, p), q in zip(split.named_parameters(), ordinary.parameters()):
        assert (p.grad._base is None) == (q.grad._base is None), name
        assert p.grad.stride() == q.grad.stride(), name
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_dw_graph_runs_without_grad_mode_and_w_restores_the_callers(grad_mode: bool) -> None:
    """W runs the dW graph as the engine runs a backward graph (grad mode off)
    and leaves the caller's grad mode as it found it, also when the dW graph
    raises; the W that follows finishes the work."""
    torch.manual_seed(0)
    model = nn.Linear(6, 6)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback="error"))
    params = list(model.parameters())
    x, g = torch.randn(5, 6), torch.randn(5, 6)
    xa = x.clone().requires_grad_()
    _, work = fxsplit.stage_backward_input([compiled(xa)], [g], [xa], params)
    (record,) = work.compiled
    owner = record.owner
    real = owner._run_dw
    seen: list[bool] = []

    def failing(args: list[Any]) -> Any:
        seen.append(torch.is_grad_enabled())
        raise RuntimeError("injected")

    def recording(args: list[Any]) -> Any:
        seen.append(torch.is_grad_enabled())
        return real(args)

    try:
        with torch.set_grad_enabled(grad_mode):
            owner._run_dw = failing
            with pytest.raises(RuntimeError, match="injected"):
                fxsplit.stage_backward_weight(params, work)
            assert torch.is_grad_enabled() is grad_mode
            assert all(p.grad is None for p in params)
            owner._run_dw = recording
            fxsplit.stage_backward_weight(params, work)
            assert torch.is_grad_enabled() is grad_mode
    finally:
        owner._replaced.pop("dW", None)
    assert seen == [False, False]
    ref(x).backward(g)
    for p, q in zip(params, ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class _NormLast(nn.Module):
    """Registers its norm after the layers that follow it in the forward, as
    Hugging Face decoder layers do: the compiled region's weights (in the
    forward's order of use) are not in ``parameters()``'s order."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.out = nn.Linear(8, 5)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(self.norm(x))))


@pytest.mark.inductor
def test_w_takes_gradients_as_they_are_in_any_order_of_the_weights() -> None:
    """Whatever the order of the weights given to B (the region's own, that of
    ``parameters()``, which differs, or reversed), W's common path (one
    region, every ``.grad`` empty) applies and gives the same result: ordinary
    backward's gradients, the same weights taken as they are (without hooks);
    with post-accumulate hooks, each fired once; a third step accumulates into
    ``.grad`` as ordinary backward does."""
    torch.manual_seed(0)
    model = _NormLast()
    compiled = torch.compile(model, backend=fxsplit.backend(fallback="error"))  # Inductor: unviewed gradients
    params = list(model.parameters())
    x0 = torch.randn(4, 6, requires_grad=True)
    _, work = fxsplit.stage_backward_input([compiled(x0)], [torch.randn(4, 5)], [x0], params)
    (record,) = work.compiled
    region_order = list(record.params)
    assert not all(a is b for a, b in zip(region_order, params)), "the orders should differ here"
    fxsplit.stage_backward_weight(params, work)
    fired: list[int] = []
    taken_by_order: dict[str, set[int]] = {}
    for order, weights in (("region", region_order), ("parameters", params), ("reversed", params[::-1])):
        ref = copy.deepcopy(model)
        handles: list[Any] = []
        for p in params:
            p.grad = None
        for step in range(3):
            if step == 1:  # from the second step: hooks (ordinary backward's twin has none to fire)
                handles = [p.register_post_accumulate_grad_hook(lambda _p, k=k: fired.append(k))
                           for k, p in enumerate(params)]
                for p in params:
                    p.grad = None
                for q in ref.parameters():
                    q.grad = None
            x, g = torch.randn(4, 6), torch.randn(4, 5)
            xa = x.clone().requires_grad_()
            dins, work = fxsplit.stage_backward_input([compiled(xa)], [g], [xa], weights)
            fired.clear()
            fxsplit.stage_backward_weight(weights, work)
            if step == 0:  # every gradient taken as it is, whatever the order of the weights
                assert sorted(work.handed_over) == list(range(len(weights))), order
                taken_by_order[order] = {id(weights[k]) for k in work.handed_over}
            else:
                assert sorted(fired) == list(range(len(params))), (order, step, fired)
            xr = x.clone().requires_grad_()
            ref(xr).backward(g)
            torch.testing.assert_close(dins[0], xr.grad)
            for p, q in zip(params, ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{order}, step {step}: {m}")
        for h in handles:
            h.remove()
    assert taken_by_order["region"], "W took no gradient as it is"
    assert taken_by_order["parameters"] == taken_by_order["region"] == taken_by_order["reversed"]
