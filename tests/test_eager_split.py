"""Upstream ``stage_backward_input``/``stage_backward_weight`` semantics, on an
eager module and on an fxsplit-compiled one, against plain autograd."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.nn as nn
from stage_check import (
    TwoLayer,
    MODES,
    assert_grads_equal,
    clone_input,
    grads_like,
    prepare,
    reference,
    snapshot_grads,
)

import fxsplit


def MLP() -> TwoLayer:
    return TwoLayer(torch.tanh)


def split(model: nn.Module, mode: str, inputs: list, seed: int = 0):
    """Forward, then B and W; returns (dinputs, .grad of every parameter after W)."""
    fn = prepare(model, mode)
    ins = [clone_input(v) for v in inputs]
    out = fn(*ins)
    params = list(model.parameters())
    before = snapshot_grads(params)
    dinputs, work = fxsplit.stage_backward_input(out, grads_like(out, seed), ins, params)
    assert_grads_equal([p.grad for p in params], before)  # B does no weight work
    fxsplit.stage_backward_weight(params, work)
    return list(dinputs), [p.grad for p in params]


@pytest.mark.parametrize("mode", MODES)
def test_b_leaves_weight_grads_and_w_completes_them(mode: str) -> None:
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 4, requires_grad=True)
    (ref_din,), ref_dw = reference(model, [x])
    # Pre-existing .grad on some weights must be kept by B and added to by W.
    pre = {0: torch.randn(6, 4), 3: torch.randn(3)}
    params = list(model.parameters())
    for k, g in pre.items():
        params[k].grad = g.clone()
    grad_objects = [p.grad for p in params]

    fn = prepare(model, mode)
    xi = clone_input(x)
    out = fn(xi)
    dinputs, work = fxsplit.stage_backward_input([out], [grads_like(out)], [xi], params)
    assert all(p.grad is g for p, g in zip(params, grad_objects))  # not even replaced
    for k, p in enumerate(params):
        if k in pre:
            torch.testing.assert_close(p.grad, pre[k])
        else:
            assert p.grad is None
    assert work.pending
    torch.testing.assert_close(dinputs[0], ref_din[0])
    torch.testing.assert_close(xi.grad, ref_din[0])  # upstream accumulates dinputs into .grad

    fxsplit.stage_backward_weight(params, work)
    expected = [r + pre[k] if k in pre else r for k, r in enumerate(ref_dw)]
    assert_grads_equal([p.grad for p in params], expected)
    assert not work.pending


@pytest.mark.parametrize("mode", MODES)
def test_ten_microbatches_accumulate(mode: str) -> None:
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 4, requires_grad=True)
    seeds = range(10)
    ref_dins, ref_dw = reference(model, [x], seeds)
    fn = prepare(model, mode)
    params = list(model.parameters())
    pending = []
    for s in seeds:  # all B first, then W in reverse order (as a zero-bubble schedule may)
        xi = clone_input(x * (1 + s / 10))
        out = fn(xi)
        dinputs, work = fxsplit.stage_backward_input([out], [grads_like(out, s)], [xi], params)
        torch.testing.assert_close(dinputs[0], ref_dins[s][0])
        pending.append(work)
    assert all(p.grad is None for p in params)
    for work in reversed(pending):
        fxsplit.stage_backward_weight(params, work)
    assert_grads_equal([p.grad for p in params], ref_dw)


class TwoHeads(nn.Module):
    """The stage output, and an auxiliary loss sharing the first layer's graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return self.b(h), h.pow(2).sum()


@pytest.mark.parametrize("mode", MODES)
def test_retain_graph_on_w(mode: str) -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(5, 4, requires_grad=True)
    ref = MLP()
    ref.a, ref.b = model.a, model.b
    (ref_din,), ref_dw = reference(ref, [x])
    fn = prepare(model, mode)
    params = list(model.parameters())
    xi = clone_input(x)
    out, aux = fn(xi)
    dinputs, work = fxsplit.stage_backward_input([out], [grads_like(out)], [xi], params)
    fxsplit.stage_backward_weight(params, work, retain_graph=True)
    torch.testing.assert_close(dinputs[0], ref_din[0])
    assert_grads_equal([p.grad for p in params], ref_dw)
    if mode == "eager":
        # The retained graph below the first layer still serves another backward.
        aux.backward()
        expected = torch.autograd.grad(torch.tanh(model.a(x.detach())).pow(2).sum(), model.a.weight)[0]
        torch.testing.assert_close(model.a.weight.grad, ref_dw[0] + expected)


class _Held:
    """A saved activation as the autograd graph holds it (see saved_tensors_hooks)."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_w_drops_the_graph_it_ran() -> None:
    """The counterpart of test_retain_graph_on_w. W runs the eager graph with
    retain_graph=True (so that a failed W can be repeated) and drops it when
    it completes: the graph lives exactly as long as someone else holds it.
    Documented difference from upstream: a later backward through a graph
    another output still holds works instead of raising "second time"."""
    model = TwoHeads()
    x = torch.randn(5, 4, requires_grad=True)
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> _Held:
        held = _Held(t)
        packed.append(weakref.ref(held))
        return held

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.t):
        out, aux = model(x)
    params = list(model.parameters())
    _, work = fxsplit.stage_backward_input([out], [torch.ones_like(out)], [x], params)
    fxsplit.stage_backward_weight(params, work)
    assert any(r() is not None for r in packed)  # aux still holds the shared part of the graph
    grad_a = model.a.weight.grad.clone()
    aux.backward()
    expected = torch.autograd.grad(torch.tanh(model.a(x.detach())).pow(2).sum(), model.a.weight)[0]
    torch.testing.assert_close(model.a.weight.grad, grad_a + expected)
    del out, aux
    assert [r for r in packed if r() is not None] == [], "W keeps the autograd graph alive"


class MixedInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, n, flag, y_const, tag):
        h = self.lin(x) * n + y_const.sum()
        return h if flag else -h


@pytest.mark.parametrize("mode", MODES)
def test_non_tensor_input_values_get_none(mode: str) -> None:
    torch.manual_seed(0)
    model = MixedInputs()
    inputs = [torch.randn(2, 4, requires_grad=True), 3, True, torch.randn(3), "tag"]
    ref_dins, ref_dw = reference(model, inputs)
    dinputs, dw = split(model, mode, inputs)
    assert dinputs[1:] == [None, None, None, None]
    torch.testing.assert_close(dinputs[0], ref_dins[0][0])
    assert_grads_equal(dw, ref_dw)


class IdentityView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g


class ViewOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return IdentityView.apply(h), h[:, 2:]


@pytest.mark.parametrize("mode", MODES)
def test_view_outputs(mode: str) -> None:
    torch.manual_seed(0)
    model = ViewOutputs()
    x = torch.randn(3, 4, requires_grad=True)
    ref_dins, ref_dw = reference(model, [x])
    fn = prepare(model, mode)
    xi = clone_input(x)
    out = fn(xi)
    assert out[1]._is_view()
    params = list(model.parameters())
    dinputs, work = fxsplit.stage_backward_input(out, grads_like(out), [xi], params)
    fxsplit.stage_backward_weight(params, work)
    torch.testing.assert_close(dinputs[0], ref_dins[0][0])
    assert_grads_equal([p.grad for p in params], ref_dw)


class SomeOutputsNeedNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor):
        y = self.lin(x)
        return y, (y > 0), y.detach() * 2, torch.arange(3)


@pytest.mark.parametrize("mode", MODES)
def test_outputs_that_do_not_require_grad(mode: str) -> None:
    torch.manual_seed(0)
    model = SomeOutputsNeedNoGrad()
    x = torch.randn(2, 4, requires_grad=True)
    ref_dins, ref_dw = reference(model, [x])
    dinputs, dw = split(model, mode, [x])
    torch.testing.assert_close(dinputs[0], ref_dins[0][0])
    assert_grads_equal(dw, ref_dw)


class NestedOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor):
        return {"a": self.a(x), "rest": (self.b(x).relu(), [torch.sigmoid(self.a(x)), 7]), "n": None}


@pytest.mark.parametrize("mode", MODES)
def test_nested_tuple_and_dict_outputs(mode: str) -> None:
    torch.manual_seed(0)
    model = NestedOutputs()
    x = torch.randn(2, 4, requires_grad=True)
    ref_dins, ref_dw = reference(model, [x])
    dinputs, dw = split(model, mode, [x])
    torch.testing.assert_close(dinputs[0], ref_dins[0][0])
    assert_grads_equal(dw, ref_dw)


class ScaledMatmul(torch.autograd.Function):
    """x @ w, computing only the gradients ctx.needs_input_grad asks for."""

    computed: list[tuple[bool, bool]] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        gx = g @ w.t() if ctx.needs_input_grad[0] else None
        gw = x.t() @ g if ctx.needs_input_grad[1] else None
        ScaledMatmul.computed.append((gx is not None, gw is not None))
        return gx, gw


class UsesNeedsInputGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(ScaledMatmul.apply(x, self.w))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_custom_function_checking_needs_input_grad(mode: str, x_requires_grad: bool) -> None:
    torch.manual_seed(0)
    model = UsesNeedsInputGrad()
    x = torch.randn(2, 4, requires_grad=x_requires_grad)
    ref_dins, ref_dw = reference(model, [x])
    ScaledMatmul.computed.clear()
    dinputs, dw = split(model, mode, [x])
    assert_grads_equal(dinputs, ref_dins[0])
    assert_grads_equal(dw, ref_dw)
    if not x_requires_grad and mode == "eager":
        assert ScaledMatmul.computed == [(False, True)]


class SharedWeight(nn.Module):
    """``w`` used at an ancestor and at a descendant site, and a shared scale
    that feeds the weight directly (no per-use node in between)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 5) / 3)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.mid = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w) * self.scale
        h = torch.tanh(self.mid(h))
        return (h @ self.w) * self.scale


@pytest.mark.parametrize("mode", MODES)
def test_weight_shared_at_ancestor_and_descendant(mode: str) -> None:
    torch.manual_seed(0)
    model = SharedWeight()
    x = torch.randn(3, 5, requires_grad=True)
    ref_dins, ref_dw = reference(model, [x])
    dinputs, dw = split(model, mode, [x])
    torch.testing.assert_close(dinputs[0], ref_dins[0][0])
    assert_grads_equal(dw, ref_dw)


class TwoOutputs(torch.autograd.Function):
    """(x * w, x + w): a node with several outputs; the stage uses only the first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor):
        ctx.save_for_backward(x, w)
        return x * w, x + w

    @staticmethod
    def backward(ctx, g_mul: torch.Tensor, g_add: torch.Tensor):
        x, w = ctx.saved_tensors
        return g_mul * w + g_add, (g_mul * x + g_add).sum(0)


class MultiOutputNode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.chunk(self.lin(x), 2, dim=-1)  # b unused: a None gradient into the chunk node
        y, _unused = TwoOutputs.apply(torch.cat([a, a], dim=-1), self.w)
        return y


@pytest.mark.parametrize("mode", MODES)
def test_multi_output_intermediates_and_none_saved_grads(mode: str) -> None:
    torch.manual_seed(0)
    model = MultiOutputNode()
    x = torch.randn(3, 4, requires_grad=True)
    ref_dins, ref_dw = reference(model, [x])
    fn = prepare(model, mode)
    xi = clone_input(x)
    out = fn(xi)
    params = list(model.parameters())
    # whole_nodes="again": the multi-output Function is an intermediate whose saved gradients W re-runs
    # (by default it runs once, at B: tests/test_whole_nodes.py)
    with fxsplit.config.patch(whole_nodes="again"):
        dinputs, work = fxsplit.stage_backward_input([out], [grads_like(out)], [xi], params)
    if mode == "eager":
        saved = [g for group in work for g in group["grads"] if g is not None]
        assert any(None in g for g in saved), "expected an intermediate with a None saved gradient"
    fxsplit.stage_backward_weight(params, work)
    torch.testing.assert_close(dinputs[0], ref_dins[0][0])
    assert_grads_equal([p.grad for p in params], ref_dw)


@pytest.mark.parametrize("mode", MODES)
def test_output_released_between_b_and_w(mode: str) -> None:
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 4, requires_grad=True)
    (ref_din,), ref_dw = reference(model, [x])
    fn = prepare(model, mode)
    xi = clone_input(x)
    out = fn(xi)
    params = list(model.parameters())
    _, work = fxsplit.stage_backward_input([out], [grads_like(out)], [xi], params)
    out_ref = weakref.ref(out)
    del out
    assert out_ref() is None, "B's pending work keeps the stage output alive"
    fxsplit.stage_backward_weight(params, work)
    assert_grads_equal([p.grad for p in params], ref_dw)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_edge_as_stage_output(mode: str) -> None:
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 4, requires_grad=True)
    (ref_din,), ref_dw = reference(model, [x])
    fn = prepare(model, mode)
    params = list(model.parameters())

    xi = clone_input(x)
    out = fn(xi)
    edge = torch.autograd.graph.get_gradient_edge(out)
    with pytest.raises(ValueError, match="GradientEdge"):
        fxsplit.stage_backward_input([edge], None, [xi], params)
    assert xi.grad is None

    dinputs, work = fxsplit.stage_backward_input([edge], [grads_like(out)], [xi], params)
    fxsplit.stage_backward_weight(params, work)
    torch.testing.assert_close(dinputs[0], ref_din[0])
    assert_grads_equal([p.grad for p in params], ref_dw)


def _compiled_only_plan(outs: list[torch.Tensor], xs: list[torch.Tensor], weights: list[torch.Tensor]) -> Any:
    """B's plan (``plan_stage``) where it is one of a stage of compiled regions
    only (kept and replayed; its regions prepared), else ``None``."""
    from fxsplit.stage_plan import plan_stage

    plan = plan_stage(outs, [o.grad_fn for o in outs], xs, weights)
    return plan if plan.prepared else None


def test_compiled_only_plan_reads_each_region_weight_and_leaf_input() -> None:
    """B's plan of a stage of compiled regions only: the parameter behind each
    of a region node's children (``None`` for the stage input, a leaf or not,
    for children that are no grad accumulator, and for a weight the region
    uses that B was not given: nobody computes its gradient, as in upstream's
    B and W)."""

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 4))
    compiled = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback="error"))
    params = list(model.parameters())
    for leaf in (True, False):
        x0 = torch.randn(3, 6, requires_grad=True)
        x = x0 if leaf else x0 * 1.0
        out = compiled(x)
        node = out.grad_fn
        plan = _compiled_only_plan([out], [x], params)
        assert plan is not None and plan.split_regions == [node]
        children = [c for c, _ in node.next_functions]
        expected = [getattr(c, "variable", None) for c in children]
        expected = [v if any(v is p for p in params) else None for v in expected]
        assert plan.region_children[node] == children
        got = plan.region_params[node]
        assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected)), (leaf, got)
        assert sum(v is not None for v in got) == len(params)
        some = _compiled_only_plan([out], [x], params[1:])
        assert some is not None
        assert [v is None for v in some.region_params[node]] == [v is None or v is params[0] for v in got]
        assert not plan.groups and not plan.intermediates and not plan.captures
        # A given weight that needs no gradient is left out, and the weights are not known distinct.
        frozen = nn.Parameter(torch.randn(2), requires_grad=False)
        with_frozen = _compiled_only_plan([out], [x], [*params, frozen])
        assert with_frozen is not None
        assert all(a is b for a, b in zip(with_frozen.region_params[node], got))
        # A region that leads to no stage input: its whole backward is W work (the general plan).
        other = torch.randn(3, 6, requires_grad=True)
        out_alone = compiled(torch.randn(3, 6))  # kept: its node's children are the weights' accumulators only
        assert _compiled_only_plan([out_alone], [other], params) is None
        _, work = fxsplit.stage_backward_input([out], [torch.randn_like(out)], [x], params)
        fxsplit.stage_backward_weight(params, work)


def _ordinary_and_eager_steps(ordinary_fn: Any, eager: nn.Module, xs: list[torch.Tensor], g: torch.Tensor,
                              dx: torch.Tensor) -> None:
    """The same microbatch through ordinary backward on the compiled copy
    (``xs[1]``) and eager autograd on the uncompiled one (``xs[2]``); the
    split's input gradient ``dx`` against both."""
    ordinary_fn(xs[1]).backward(g)
    eager(xs[2]).backward(g)
    torch.testing.assert_close(dx, xs[1].grad)
    torch.testing.assert_close(dx, xs[2].grad)


class _WithUnused(nn.Module):
    """A stage with a parameter its forward never uses (as a middle stage
    built from a whole model holds the token embedding) and a frozen one (as
    in fine-tuning), both given to B and W with the others."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 4))
        self.body[0].bias.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("unused_grad", [None, 1.0], ids=["empty_grad", "set_grad"])
def test_a_weight_the_stage_does_not_use_keeps_the_compiled_only_plan(
    unused_grad: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A given weight no output depends on: B still plans the stage as compiled
    regions only (one walk; before, the general plan's per-weight walks, some
    3.6x B's lines of Python on the tiny bench stage, and no direct call),
    counting the weight as unreached, and W plans its commits once and
    replays the plan on the next step, whatever the unused or a frozen
    weight's ``.grad`` is. After W every gradient is
    ordinary backward's and eager autograd's, and the unused weight's
    ``.grad`` (empty, or set) and hooks and the frozen weight's ``.grad`` are
    untouched, as after ordinary backward."""
    import copy

    torch.manual_seed(0)
    model = _WithUnused()
    ordinary, eager = copy.deepcopy(model), copy.deepcopy(model)
    backend = fxsplit.backend(compiler="eager", fallback="error")
    fn, ordinary_fn = torch.compile(model, backend=backend), torch.compile(ordinary, backend=backend)
    params = list(model.parameters())
    # (a module's own parameters come first)
    used = [k for k, p in enumerate(params) if p is not model.unused and p.requires_grad]
    from fxsplit import pending

    planned: list[int] = []
    plan_commits = pending.plan_commits
    monkeypatch.setattr(pending, "plan_commits", lambda *a: planned.append(1) or plan_commits(*a))
    x = torch.randn(3, 6, requires_grad=True)
    before = fxsplit.compiled_regions()
    out = fn(x)
    plan = _compiled_only_plan([out], [x], params)
    assert plan is not None and plan.unreached == 1
    fired: list[str] = []
    for m in (model, ordinary, eager):
        m.unused.register_hook(lambda g: fired.append("unused"))
    with fxsplit.config.patch(direct_b=True):
        for step in range(2):
            g = torch.randn(3, 4)
            x = torch.randn(3, 6)
            xs = [x.clone().requires_grad_() for _ in range(3)]
            for m in (model, ordinary, eager):  # .grad emptied before each step, as optimizers do
                for p in m.parameters():
                    p.grad = None if unused_grad is None or p is not m.unused else torch.full((3,), unused_grad)
            (dx,), work = fxsplit.stage_backward_input([fn(xs[0])], [g], [xs[0]], params)
            assert work.explain().endswith("1 with no gradient from these outputs")
            fxsplit.stage_backward_weight(params, work)
            _ordinary_and_eager_steps(ordinary_fn, eager, xs, g, dx)
            for (name, p), q, r in zip(model.named_parameters(), ordinary.parameters(), eager.parameters()):
                if p is model.unused:
                    assert p.grad is None if unused_grad is None else torch.equal(p.grad, torch.full((3,), unused_grad))
                    assert q.grad is None if unused_grad is None else torch.equal(q.grad, p.grad)
                    continue
                if not p.requires_grad:
                    assert p.grad is None and q.grad is None and r.grad is None, name
                    continue
                torch.testing.assert_close(p.grad, q.grad, msg=name)
                torch.testing.assert_close(p.grad, r.grad, msg=name)
            assert work.handed_over and set(work.handed_over) <= set(used)  # (gradients W set as they are)
    assert not fired
    assert len(planned) == 1  # planned at the first step, replayed at the second
    assert sum(r.direct_b_runs for r in fxsplit.compiled_regions() if r not in before) == 2


class _TwoRegions(nn.Module):
    """A graph break between two blocks: two compiled regions. ``tied``: the
    second block's first layer is the first block's (one weight, two regions)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6))
        self.second = nn.Sequential(self.first[1] if tied else nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h)


@pytest.mark.parametrize("tied", [False, True], ids=["own_weights", "tied_across_the_break"])
def test_w_decides_each_region_at_once_where_no_weight_is_in_two(tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage split by a graph break: where each weight is in one region, W
    runs every region's dW graph and sets every empty ``.grad`` to its
    gradient as it is; a weight in both regions goes to autograd's engine,
    which sums its two gradients. W plans this once and replays the plan on
    the next step. Either way the gradients, over two steps with ``.grad``
    emptied before each, are ordinary backward's and eager autograd's."""
    import copy

    from fxsplit import pending

    torch.manual_seed(0)
    model = _TwoRegions(tied)
    ordinary, eager = copy.deepcopy(model), copy.deepcopy(model)
    backend = fxsplit.backend(compiler="eager", fallback="error")
    fn, ordinary_fn = torch.compile(model, backend=backend), torch.compile(ordinary, backend=backend)
    params = list(model.parameters())
    shared = {id(p) for p in model.first[1].parameters()} if tied else set()
    planned: list[int] = []
    plan_commits = pending.plan_commits
    monkeypatch.setattr(pending, "plan_commits", lambda *a: planned.append(1) or plan_commits(*a))
    for step in range(2):
        x, g = torch.randn(3, 6), torch.randn(3, 4)
        xs = [x.clone().requires_grad_() for _ in range(3)]
        for m in (model, ordinary, eager):
            for p in m.parameters():
                p.grad = None
        (dx,), work = fxsplit.stage_backward_input([fn(xs[0])], [g], [xs[0]], params)
        assert len(work.compiled) == 2
        fxsplit.stage_backward_weight(params, work)
        _ordinary_and_eager_steps(ordinary_fn, eager, xs, g, dx)
        for (name, p), q, r in zip(model.named_parameters(), ordinary.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
            torch.testing.assert_close(p.grad, r.grad, msg=name)
        # (the eager compiler may hand a bias gradient as a view of a live-in, which no .grad takes)
        taken = {id(params[k]) for k in work.handed_over}
        assert taken and not taken & shared, step
        assert {id(p) for p in model.second[-1].parameters() if p.dim() == 2} <= taken, step
    assert len(planned) == 1
