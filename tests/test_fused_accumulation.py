"""Fused gradient accumulation: where a weight already has a
``.grad``, W adds its gradient into it inside the compiled dW graph.

Every test runs several microbatches of B then W on a stage and ordinary
backward on an identical copy, and compares ``.grad`` (values, dtype, strides,
identity of the tensor autograd accumulates into) and hook counts. The fused
path is checked to be taken (``PendingWeightGrads.accumulated_in_graph``) where
it may be and not taken where autograd's accumulation is observable.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit
from zoo import TwoLinear

MICROBATCHES = 3


MLP = TwoLinear


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class TwoRegions(nn.Module):
    """Two compiled bodies (compiled in place) with an eager scale between them."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Body()
        self.scale = nn.Parameter(torch.full((6,), 0.5))
        self.second = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) * self.scale)


class SharedTwoRegions(nn.Module):
    """One Linear on both sides of a graph break: two regions give its weights gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        torch._dynamo.graph_break()
        return self.out(self.lin(h))


def compile_stage(model: nn.Module, compiler: str = "eager", **options: Any) -> Any:
    backend = fxsplit.backend(compiler=compiler, fallback="error", **options)
    if isinstance(model, TwoRegions):
        model.first.compile(backend=backend)
        model.second.compile(backend=backend)
        return model
    return torch.compile(model, backend=backend)


def data(n: int, dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(5, 6, generator=gen).to(dtype) for _ in range(n)]
    gs = [torch.randn(5, 6, generator=gen).to(dtype) for _ in range(n)]
    return xs, gs


def run_reference(ref: nn.Module, xs: list[torch.Tensor], gs: list[torch.Tensor], weights: list[Any] | None = None) -> None:
    for x, g in zip(xs, gs):
        out = ref(x.clone().requires_grad_())
        torch.autograd.backward(out, g, inputs=weights)


def run_split(
    fn: Any, params: list[torch.Tensor], xs: list[torch.Tensor], gs: list[torch.Tensor], **w_kwargs: Any
) -> list[fxsplit.PendingWeightGrads]:
    works = []
    for x, g in zip(xs, gs):
        xi = x.clone().requires_grad_()
        _, work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
        fxsplit.stage_backward_weight(params, work, **w_kwargs)
        works.append(work)
    return works


def assert_same_grads(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        if r.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, r.grad, msg=lambda m: f"{name}: {m}")
        assert p.grad.dtype == r.grad.dtype and p.grad.stride() == r.grad.stride(), name


def fused_names(model: nn.Module, params: list[torch.Tensor], works: list[fxsplit.PendingWeightGrads]) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(params[k])] for w in works for k in w.accumulated_in_graph}


def regions_since(before: list[Any]) -> list[Any]:
    return [r for r in fxsplit.compiled_regions() if r not in before]


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [MLP, TwoRegions, SharedTwoRegions], ids=["mlp", "two_regions", "shared"])
def test_microbatches_accumulate_like_ordinary_backward(kind: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = kind()
    ref = copy.deepcopy(model)
    xs, gs = data(MICROBATCHES)
    run_reference(ref, xs, gs)
    before = fxsplit.compiled_regions()
    fn = compile_stage(model)
    params = list(model.parameters())
    grads_after_first: list[torch.Tensor] = []
    works = []
    for i, (x, g) in enumerate(zip(xs, gs)):
        works += run_split(fn, params, [x], [g])
        if i == 0:
            grads_after_first = [p.grad for p in params]
    assert_same_grads(model, ref)
    # Accumulation is in place into the .grad the first microbatch created, as autograd's.
    assert all(p.grad is g for p, g in zip(params, grads_after_first))
    assert not works[0].accumulated_in_graph  # no .grad yet: autograd creates it
    fused = fused_names(model, params, works[1:])
    if kind is MLP:
        assert fused == {n for n, _ in model.named_parameters()}
    elif kind is TwoRegions:
        assert fused == {"first.lin.weight", "first.lin.bias", "second.lin.weight", "second.lin.bias"}
    else:  # lin's gradients come from two regions: autograd sums them
        assert fused == {"out.weight", "out.bias"}
    assert sum(r.accumulating_runs for r in regions_since(before)) > 0


def test_switched_off_by_config_by_backend_option_and_by_w_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    xs, gs = data(MICROBATCHES)
    for how in ("config", "backend", "argument"):
        torch.manual_seed(0)
        model = MLP()
        ref = copy.deepcopy(model)
        run_reference(ref, xs, gs)
        opts = {"fused_accumulation": False} if how == "backend" else {}
        w_kwargs = {"fused_accumulation": False} if how == "argument" else {}
        with fxsplit.config.patch(fused_accumulation=how != "config"):
            works = run_split(compile_stage(model, **opts), list(model.parameters()), xs, gs, **w_kwargs)
        assert not any(w.accumulated_in_graph for w in works), how
        assert_same_grads(model, ref)


class Hooked:
    def __init__(self, model: nn.Module) -> None:
        self.pre: collections.Counter[str] = collections.Counter()
        self.post: collections.Counter[str] = collections.Counter()
        model.a.weight.register_hook(self._pre("a.weight"))
        model.b.bias.register_post_accumulate_grad_hook(lambda p: self.post.update(["b.bias"]))

    def _pre(self, name: str) -> Any:
        def hook(g: torch.Tensor) -> torch.Tensor:
            self.pre[name] += 1
            return g * 3

        return hook


def test_hooked_weights_take_autograds_path_and_hooks_fire_once_per_microbatch() -> None:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    ref_hooks, hooks = Hooked(ref), Hooked(model)
    xs, gs = data(MICROBATCHES)
    run_reference(ref, xs, gs)
    params = list(model.parameters())
    works = run_split(compile_stage(model), params, xs, gs)
    assert hooks.pre == ref_hooks.pre == {"a.weight": MICROBATCHES}
    assert hooks.post == ref_hooks.post == {"b.bias": MICROBATCHES}
    assert_same_grads(model, ref)
    # The unhooked weights still accumulate in the graph.
    assert fused_names(model, params, works) == {"a.bias", "b.weight"}


def test_grad_dtype_differing_from_the_gradient_takes_autograds_path() -> None:
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    for p in (*model.parameters(), *ref.parameters()):
        p.grad_dtype = torch.float32
    xs, gs = data(MICROBATCHES, torch.bfloat16)
    run_reference(ref, xs, gs)
    params = list(model.parameters())
    works = run_split(compile_stage(model), params, xs, gs)
    assert all(p.grad.dtype == torch.float32 for p in params)
    assert not any(w.accumulated_in_graph for w in works)
    assert_same_grads(model, ref)


def test_a_non_contiguous_grad_the_user_assigned_keeps_its_layout() -> None:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    # Transposed storage (strides (1, 6)): autograd adds into it in place, keeping it.
    start = torch.randn(6, 8).t()
    model.a.weight.grad, ref.a.weight.grad = start.clone(), start.clone()
    assert not model.a.weight.grad.is_contiguous()
    held, ref_held = model.a.weight.grad, ref.a.weight.grad
    xs, gs = data(MICROBATCHES)
    run_reference(ref, xs, gs)
    params = list(model.parameters())
    works = run_split(compile_stage(model), params, xs, gs)
    assert model.a.weight.grad is held and ref.a.weight.grad is ref_held
    assert "a.weight" in fused_names(model, params, works)
    assert_same_grads(model, ref)


def test_an_expanded_grad_fails_as_autograd_fails_and_changes_nothing() -> None:
    """A ``.grad`` whose elements share memory: autograd's in-place accumulation
    refuses it; so does W, through autograd, with ``.grad`` unchanged."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    xs, gs = data(1)
    model.b.bias.grad, ref.b.bias.grad = torch.ones(1).expand(6), torch.ones(1).expand(6)
    with pytest.raises(RuntimeError, match="more than one element") as ref_error:
        run_reference(ref, xs, gs)
    params = list(model.parameters())
    fn = compile_stage(model)
    xi = xs[0].clone().requires_grad_()
    _, work = fxsplit.stage_backward_input([fn(xi)], [gs[0]], [xi], params)
    with pytest.raises(type(ref_error.value), match="more than one element"):
        fxsplit.stage_backward_weight(params, work)
    assert not work.accumulated_in_graph
    torch.testing.assert_close(model.b.bias.grad, torch.ones(6))


def test_only_the_weights_given_are_accumulated() -> None:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    for p, r in zip(model.parameters(), ref.parameters()):
        p.grad = torch.randn_like(p)
        r.grad = p.grad.clone()
    xs, gs = data(MICROBATCHES)
    run_reference(ref, xs, gs, weights=[ref.a.weight, ref.b.bias])
    subset = [model.a.weight, model.b.bias]
    works = run_split(compile_stage(model), subset, xs, gs)
    assert fused_names(model, subset, works) == {"a.weight", "b.bias"}
    assert_same_grads(model, ref)


# ---------------------------------------------------------------------------------------------
# Transactional W. The order: (1) every dW graph that does not accumulate runs (pure); (2) each
# region's accumulating dW graph runs, and is the commit of the weights it accumulates into;
# (3) autograd commits the rest. A failure in (1) changes no .grad; a failure in (2) leaves the
# weights of the graphs that ran (the failing one included) accumulated, everything else pending.


def _two_regions_with_grads(fuse_second: bool) -> tuple[nn.Module, nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = TwoRegions()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        for name, p in m.named_parameters():
            if fuse_second or not name.startswith("second."):
                p.grad = torch.ones_like(p)  # a .grad to accumulate into
    return model, ref, list(model.parameters())


def test_a_failing_dw_graph_changes_no_grad_even_where_another_region_accumulates_in_graph() -> None:
    model, ref, params = _two_regions_with_grads(fuse_second=False)
    xs, gs = data(2)
    run_reference(ref, xs, gs)
    fn = compile_stage(model)
    xi = xs[0].clone().requires_grad_()
    _, work = fxsplit.stage_backward_input([fn(xi)], [gs[0]], [xi], params)
    snapshot = [None if p.grad is None else p.grad.clone() for p in params]
    # The second body's weights have no .grad: its dW graph is a plain one. Make it fail.
    calls = {"n": 0}

    def fail_plain(region: Any) -> None:
        original = region._run_dw

        def run_dw(live_ins: list[Any]) -> Any:
            calls["n"] += 1
            region._run_dw = original
            raise RuntimeError("dW graph failed")

        region._run_dw = run_dw

    # Which region is the second body: the one whose weights are the second Linear's.
    by_weight = {id(p) for p in model.second.parameters()}
    target = next(rec.owner for rec in work.compiled if by_weight & {id(p) for p in rec.weights})
    fail_plain(target)
    with pytest.raises(RuntimeError, match="dW graph failed"):
        fxsplit.stage_backward_weight(params, work)
    assert calls["n"] == 1
    for p, s in zip(params, snapshot):
        assert (p.grad is None) == (s is None) and (s is None or torch.equal(p.grad, s)), "a failed W changed .grad"
    assert work.committed == 0
    fxsplit.stage_backward_weight(params, work)  # the retry finishes all of it
    names = [n for n, _ in model.named_parameters()]
    assert {names[k] for k in work.accumulated_in_graph} == {"first.lin.weight", "first.lin.bias"}
    xi = xs[1].clone().requires_grad_()
    _, work1 = fxsplit.stage_backward_input([fn(xi)], [gs[1]], [xi], params)
    fxsplit.stage_backward_weight(params, work1)
    assert_same_grads(model, ref)


def test_an_interrupted_accumulating_graph_leaves_its_weights_accumulated_and_w_finishes_the_rest() -> None:
    model, ref, params = _two_regions_with_grads(fuse_second=True)
    xs, gs = data(2)
    run_reference(ref, xs, gs)
    before = fxsplit.compiled_regions()
    fn = compile_stage(model)
    xi = xs[0].clone().requires_grad_()
    _, work = fxsplit.stage_backward_input([fn(xi)], [gs[0]], [xi], params)
    snapshot = [p.grad.clone() for p in params]
    # The second accumulating graph to run is interrupted as it returns (its writes done).
    calls = {"n": 0}
    for region in regions_since(before):
        original = region.run_dw

        def interrupted(args: list[Any], timings: Any = None, slot: Any = None, graph: Any = None,
                        positions: Any = (), original: Any = original) -> Any:
            out = original(args, timings, slot, graph, positions)
            if graph is not None:  # an accumulating dW graph
                calls["n"] += 1
                if calls["n"] == 2:
                    raise KeyboardInterrupt
            return out

        region.run_dw = interrupted
    with pytest.raises(KeyboardInterrupt):
        fxsplit.stage_backward_weight(params, work)
    names = [n for n, _ in model.named_parameters()]
    changed = {n for n, p, s in zip(names, params, snapshot) if not torch.equal(p.grad, s)}
    # Both bodies' weights accumulated in their graphs; the eager scale is still pending.
    assert changed == {"first.lin.weight", "first.lin.bias", "second.lin.weight", "second.lin.bias"}
    assert work.pending and work.committed == 4
    fxsplit.stage_backward_weight(params, work)
    assert calls["n"] == 2  # nothing accumulated twice
    xi = xs[1].clone().requires_grad_()
    _, work1 = fxsplit.stage_backward_input([fn(xi)], [gs[1]], [xi], params)
    fxsplit.stage_backward_weight(params, work1)
    assert calls["n"] == 4
    assert_same_grads(model, ref)


def test_fused_accumulation_argument_is_checked_before_anything_changes() -> None:
    model = MLP()
    params = list(model.parameters())
    fn = compile_stage(model)
    xs, gs = data(1)
    xi = xs[0].clone().requires_grad_()
    _, work = fxsplit.stage_backward_input([fn(xi)], [gs[0]], [xi], params)
    with pytest.raises(TypeError, match="fused_accumulation"):
        fxsplit.stage_backward_weight(params, work, fused_accumulation="yes")  # type: ignore[arg-type]
    assert work.pending and all(p.grad is None for p in params)
    fxsplit.stage_backward_weight(params, work)


# ---------------------------------------------------------------------------------------------


@pytest.mark.inductor
def test_inductor_accumulates_in_the_gemm() -> None:
    """With Inductor, the accumulating dW graph's code adds each weight-gradient
    GEMM into ``.grad`` in place (``fxsplit::addmm_into``, ATen's ``addmm_``)
    on its operands as they lie (no copy of the transposed activation
    gradient), adds the bias gradients into ``.grad`` in a fused kernel, and
    allocates no weight-sized temporary (no separate pass over a weight)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    xs, gs = data(MICROBATCHES)
    run_reference(ref, xs, gs)
    before = fxsplit.compiled_regions()
    fn = compile_stage(model, compiler="inductor")
    params = list(model.parameters())
    works = run_split(fn, params, xs[:1], gs[:1])
    (region,) = regions_since(before)
    positions = tuple(range(len(region.split.dw_outputs)))

    def compile_variant() -> Any:
        return region.accumulating_graph(positions, [p.grad for p in params])

    # The variant compiles on first use (the second microbatch's W): compile it here to read its code.
    graph, (code, *_) = run_and_get_code(compile_variant)
    assert graph is not None
    calls = [line.strip() for line in code.splitlines() if "addmm_into.default(" in line]
    assert len(calls) == 2, code  # one per Linear weight
    assert all("reinterpret_tensor" in c for c in calls), calls  # transposed operands passed as views
    assert "extern_kernels.mm(" not in code and "extern_kernels.addmm(" not in code, code
    for p in params:
        assert f"empty_strided_cpu({tuple(p.shape)}" not in code, code  # no weight-sized temporary
    versions = [p.grad._version for p in params]
    works += run_split(fn, params, xs[1:], gs[1:])
    assert fused_names(model, params, works[1:]) == {n for n, _ in model.named_parameters()}
    assert all(p.grad._version > v for p, v in zip(params, versions))  # in-place writes are visible
    assert region.compiled_graphs.count("dW+accumulate") == 1
    assert "fused" not in region.compiled_graphs
    assert_same_grads(model, ref)


def test_a_new_steps_grad_tensors_laid_out_as_before_keep_the_accumulation_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """zero_grad(set_to_none=True) gives every step new ``.grad`` tensors. W
    decides which weights accumulate in the graph once, and keeps the decision
    for new ``.grad`` tensors with the same metadata (a guard on it), deciding
    again where a ``.grad`` comes in another layout; the fused path is taken
    throughout and every ``.grad`` (values, strides) is ordinary backward's."""
    from fxsplit import pending

    decided: list[int] = []
    plan = pending.plan_commits

    def counting(*args: Any) -> Any:
        decided.append(1)
        return plan(*args)

    monkeypatch.setattr(pending, "plan_commits", counting)
    torch.manual_seed(0)
    model = MLP()
    ref, ordinary = copy.deepcopy(model), copy.deepcopy(model)  # uncompiled, and compiled by fxsplit
    backend = fxsplit.backend(fallback="error")
    compiled, ordinary_fn = torch.compile(model, backend=backend), torch.compile(ordinary, backend=backend)
    params = list(model.parameters())
    for step in range(4):
        for p, q, r in zip(params, ref.parameters(), ordinary.parameters()):
            p.grad = q.grad = r.grad = None
        if step == 3:  # a .grad in another layout: decided again, accumulated as autograd would
            for m in (model, ref, ordinary):
                first = next(iter(m.parameters()))
                first.grad = torch.zeros(first.shape[1], first.shape[0]).t()
        for mb in range(MICROBATCHES):
            x, g = torch.randn(4, 6), torch.randn(4, 6)
            xa = x.clone().requires_grad_()
            _, work = fxsplit.stage_backward_input([compiled(xa)], [g], [xa], params)
            fxsplit.stage_backward_weight(params, work)
            if mb or step == 3:
                assert work.accumulated_in_graph, (step, mb)
            ref(x).backward(g)
            ordinary_fn(x).backward(g)
        for p, q, r in zip(params, ref.parameters(), ordinary.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            torch.testing.assert_close(p.grad, r.grad)  # (accumulated in the GEMM: not bitwise)
            assert p.grad.stride() == q.grad.stride() == r.grad.stride()
        if step < 3:  # the first microbatch's plan (.grad empty), the later ones' (.grad set)
            assert len(decided) == 2, f"step {step}: planned {len(decided)} times"
    # step 3: once with only the transposed .grad present (the others empty), once with all present
    assert len(decided) == 4
