"""The cut (:mod:`fxsplit.passes.cut`) and the bytes it holds (:mod:`fxsplit.passes.memory`).

Hand-built graphs where a cheaper cut than handing over everything exists (an
upcast, a pointwise chain with two outputs dW reads, two views of one base)
and where none does; the bytes held as a sympy formula and its value at the
actual sizes; numerics through the backend against eager autograd (and once
with the real Inductor).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import sympy
import torch
import torch.nn as nn
from torch.testing import assert_close

import fxsplit
from fxsplit.passes import split_backward
from fxsplit.passes.memory import evaluate_bytes, provably_at_most, size_lower_bounds, value_bytes
from graph_builder import GraphBuilder, check_contract, node_names, placeholder_vals, run, symbolic_mode
from stage_check import new_regions
from test_split_pass import flattened_linear_backward, mlp_backward

aten = torch.ops.aten
prims = torch.ops.prims


def _upcast_ops(b: GraphBuilder, x: Any, w: Any, g: Any) -> tuple[Any, Any]:
    """The nodes ``(dx, dw)`` of :func:`upcast_backward`'s graph on ``b``'s inputs."""
    h = b.op("h", prims.convert_element_type.default, x, torch.float32)
    gw = b.op("gw", aten.mm.default, g, w)
    dx = b.op("dx", aten.mul.Tensor, gw, h)
    dw = b.op("dw", aten.mm.default, b.op("gt", aten.t.default, g), h)
    return dx, dw


def upcast_backward() -> torch.fx.GraphModule:
    """dI and dW both read ``h = x.float()`` for a bfloat16 saved activation ``x``:
    the input gradient scales by ``h``, the weight gradient is ``g.T @ h``."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(16, 8).to(torch.bfloat16))
    w = b.input("w", torch.randn(4, 8))
    g = b.input("tangents", torch.randn(16, 4))
    dx, dw = _upcast_ops(b, x, w, g)
    return b.done(dx, dw)


def test_upcast_crosses_narrow_and_is_recomputed_in_dw() -> None:
    bw = upcast_backward()
    split = check_contract(bw, [1], placeholder_vals(bw))
    assert [l.name for l in split.live_ins] == ["x", "tangents"]
    assert split.cut.recomputed == ("h",)
    assert "h" in node_names(split.dw_graph) and "dw" in node_names(split.dw_graph)
    # bfloat16 x (16*8*2) instead of float32 h (16*8*4); the tangent crosses either way.
    assert split.live_in_bytes_expr == 16 * 8 * 2 + 16 * 4 * 4
    assert split.all_crossing_bytes_expr == 16 * 8 * 4 + 16 * 4 * 4
    assert split.cut.saves_bytes


def test_pointwise_chain_with_two_outputs_crosses_its_input() -> None:
    """dW reads ``a = exp(z)`` and ``c = sin(z)`` (both also used by dI): one
    ``z`` crosses and dW recomputes both, half the bytes."""
    b = GraphBuilder()
    z = b.input("z", torch.randn(8, 5))
    w = b.input("w", torch.randn(3, 5))
    g = b.input("tangents", torch.randn(8, 3))
    gw = b.op("gw", aten.mm.default, g, w)
    a = b.op("a", aten.exp.default, z)
    c = b.op("c", aten.sin.default, z)
    ac = b.op("ac", aten.mul.Tensor, a, c)
    dx = b.op("dx", aten.mul.Tensor, gw, ac)
    gt = b.op("gt", aten.t.default, g)
    dw1 = b.op("dw1", aten.mm.default, gt, a)
    dw2 = b.op("dw2", aten.mm.default, gt, c)
    bw = b.done(dx, dw1, dw2)
    split = check_contract(bw, [1, 2], placeholder_vals(bw))
    assert [l.name for l in split.live_ins] == ["z", "tangents"]
    assert set(split.cut.recomputed) == {"a", "c"}
    assert split.live_in_bytes_expr == 8 * 5 * 4 + 8 * 3 * 4
    assert split.all_crossing_bytes_expr == 2 * 8 * 5 * 4 + 8 * 3 * 4


def test_no_cheaper_cut_keeps_the_all_crossing_one() -> None:
    """The MLP backward: dW reads activations, the tangent and a gradient dI
    computes with a matmul behind it: nothing to recompute."""
    bw = mlp_backward()
    split = check_contract(bw, [1, 2], placeholder_vals(bw))
    assert split.cut.recomputed == ()
    assert split.live_in_bytes_expr == split.all_crossing_bytes_expr
    assert not split.cut.saves_bytes
    assert [l.name for l in split.live_ins] == ["x", "h", "tangents", "dpre"]


def test_a_matmul_is_never_recomputed_in_dw() -> None:
    """Crossing the two inputs of a matmul would hold fewer bytes than its
    output, but recomputing it would add matmul FLOPs to W: its output crosses."""
    b = GraphBuilder()
    u = b.input("u", torch.randn(16, 2))
    v = b.input("v", torch.randn(2, 16))
    g = b.input("tangents", torch.randn(16, 16))
    uv = b.op("uv", aten.mm.default, u, v)  # [16, 16] from 64 numbers
    dx = b.op("dx", aten.mul.Tensor, g, uv)
    gt = b.op("gt", aten.t.default, g)
    dw = b.op("dw", aten.mm.default, gt, uv)
    split = check_contract(b.done(dx, dw), [1], [n.meta["val"] for n in b.graph.find_nodes(op="placeholder")])
    assert "uv" in [l.name for l in split.live_ins]
    assert split.cut.recomputed == ()


def views_backward(both: bool) -> torch.fx.GraphModule:
    """dI computes ``gw = g @ w`` and reads it through the view ``v1`` (and ``v2``
    when ``both``); dW reads the same views."""
    b = GraphBuilder()
    w = b.input("w", torch.randn(3, 6))
    g = b.input("tangents", torch.randn(4, 3))
    gw = b.op("gw", aten.mm.default, g, w)  # [4, 6]
    v1 = b.op("v1", aten.view.default, gw, [24])
    v2 = b.op("v2", aten.view.default, gw, [6, 4]) if both else None
    back = b.op("back", aten.view.default, v1, [4, 6])
    dx = b.op("dx", aten.add.Tensor, back, b.op("v2t", aten.t.default, v2)) if both else back
    dw1 = b.op("dw1", aten.mul.Tensor, v1, 2.0)
    if not both:
        return b.done(dx, dw1)
    dw2 = b.op("dw2", aten.mul.Tensor, v2, 3.0)
    return b.done(dx, dw1, dw2)


def test_one_view_crosses_as_is() -> None:
    """A view holds its base's storage: crossing it costs the same as crossing
    the base, so it crosses as is and dW recomputes nothing."""
    bw = views_backward(both=False)
    split = check_contract(bw, [1], placeholder_vals(bw))
    assert [l.name for l in split.live_ins] == ["v1"] and split.cut.recomputed == ()
    assert split.live_in_bytes_expr == 24 * 4


def test_two_views_of_one_base_cross_as_the_base() -> None:
    """The cut weighs each view at its base's size, so handing over both views
    weighs twice the base: the base crosses and dW recomputes both views (free).
    Counted once per storage, both cuts hold the same bytes."""
    bw = views_backward(both=True)
    split = check_contract(bw, [1, 2], placeholder_vals(bw))
    assert [l.name for l in split.live_ins] == ["gw"]
    assert set(split.cut.recomputed) == {"v1", "v2"}
    assert split.all_crossing_bytes_expr == split.live_in_bytes_expr == 24 * 4


# ---- bytes as a formula ------------------------------------------------------------


def test_bytes_held_is_a_formula_in_the_size_symbols() -> None:
    """dW of the flattened Linear holds x ``[s0*s1, 4]`` and g2 ``[s0*s1, 5]``
    (float32): ``36*s0*s1`` bytes; evaluated at the sizes read off the live-ins."""
    bw, args, (s0, s1) = flattened_linear_backward()
    split = split_backward(bw, [4])
    sym0, sym1 = s0.node.expr, s1.node.expr
    assert sympy.expand(split.live_in_bytes_expr - 36 * sym0 * sym1) == 0
    assert {str(s) for s in split.live_in_bytes_expr.free_symbols} == {str(sym0), str(sym1)}

    outs = run(split.di_graph, list(args))
    live = list(outs[len(split.di_outputs):])
    bindings = split.live_in_bindings(live)
    assert bindings == {sym0: 2, sym1: 3}
    actual = sum(v.numel() * v.element_size() for v in live if isinstance(v, torch.Tensor))
    assert split.live_in_bytes(bindings) == actual == 36 * 2 * 3
    assert split.all_crossing_bytes(bindings) == actual
    text = split.describe(bindings)
    assert f"live-in bytes: {split.live_in_bytes_expr}" in text and f": {actual} bytes" in text

    with pytest.raises(ValueError, match=str(sym1)):
        split.live_in_bytes({sym0: 2})


def test_each_live_in_states_its_bytes() -> None:
    bw = upcast_backward()
    split = split_backward(bw, [1])
    assert [(l.name, l.nbytes) for l in split.live_ins] == [("x", 16 * 8 * 2), ("tangents", 16 * 4 * 4)]


def test_provably_at_most() -> None:
    s0, s1 = sympy.symbols("s0 s1", positive=True, integer=True)
    assert provably_at_most(4 * s0, 8 * s0)
    assert provably_at_most(4 * s0 * s1 + 16, 8 * s0 * s1 + 16)
    assert not provably_at_most(4 * s0 + 100, 8 * s0)  # false for s0 < 25
    assert not provably_at_most(s1, s0)
    assert provably_at_most(sympy.Integer(3), sympy.Integer(3))
    floordiv = torch.utils._sympy.functions.FloorDiv(s0, 2)
    assert not provably_at_most(floordiv, s0)  # true, but not shown by polynomial coefficients
    assert evaluate_bytes(4 * s0 * s1 + 16, {s0: 2, s1: 3}) == 40
    # With the shape environment's lower bounds (Dynamo's sizes are >= 2):
    assert not provably_at_most(2956 * s0 + 128, 3072 * s0)  # false at s0 = 1
    assert provably_at_most(2956 * s0 + 128, 3072 * s0, {s0: 2})


def test_size_lower_bounds_come_from_the_shape_environment() -> None:
    bw, _, (s0, s1) = flattened_linear_backward()
    bounds = size_lower_bounds(bw.graph.nodes)
    assert bounds == {s0.node.expr: 2, s1.node.expr: 2}


def test_symbolic_upcast_keeps_the_narrow_value_for_every_size() -> None:
    """With a symbolic row count, the cheaper cut is kept only because it holds
    fewer bytes for every size (checked on the formulas)."""
    mode, size = symbolic_mode()
    s0 = size("s0", 5)
    b = GraphBuilder(mode)
    b.input("s0", s0)
    with mode:
        x = b.input("x", torch.empty(s0, 8, dtype=torch.bfloat16))
        w = b.input("w", torch.empty(4, 8))
        g = b.input("tangents", torch.empty(s0, 4))
    dx, dw = _upcast_ops(b, x, w, g)
    bw = b.done(None, dx, None, dw)
    with mode:
        split = split_backward(bw, [3])
    assert split.cut.recomputed == ("h",)
    sym = s0.node.expr
    assert sympy.expand(split.live_in_bytes_expr - (16 * sym + 16 * sym)) == 0
    assert sympy.expand(split.all_crossing_bytes_expr - (32 * sym + 16 * sym)) == 0
    args = [5, torch.randn(5, 8).to(torch.bfloat16), torch.randn(4, 8), torch.randn(5, 4)]
    check_contract(bw, [3], args)


# ---- through the backend -------------------------------------------------------------


class Upcast(nn.Module):
    """A bfloat16 activation upcast to float32 before a Linear; the output is
    cast back. The backward's bfloat16 tangent is upcast for both the input and
    the weight gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.fc(h * h).to(x.dtype)


@pytest.mark.parametrize(
    "compiler,defer",
    [("eager", "matmuls"), ("eager", "all"), pytest.param("inductor", "matmuls", marks=pytest.mark.inductor)],
)
def test_cheaper_cut_through_the_backend(compiler: str, defer: str) -> None:
    torch.manual_seed(0)
    ref = Upcast()
    mod = copy.deepcopy(ref)
    cm = torch.compile(mod, backend=fxsplit.backend(compiler=compiler, fallback="error", defer=defer))
    x = torch.randn(16, 8).to(torch.bfloat16)
    xr, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(16, 8).to(torch.bfloat16)
    ref(xr).backward(g)
    before = fxsplit.compiled_regions()
    out = cm(xg)
    (dx,), work = fxsplit.stage_backward_input([out], [g], [xg], mod.parameters())
    fxsplit.stage_backward_weight(mod.parameters(), work)
    assert_close(dx, xr.grad, atol=2e-2, rtol=2e-2)
    for p, q in zip(ref.parameters(), mod.parameters()):
        assert_close(q.grad, p.grad, atol=1e-2, rtol=1e-2)
    (region,) = new_regions(before)
    split = region.split
    # The bfloat16 tangent crosses and dW upcasts it again: fewer bytes held.
    assert split.cut.recomputed, split.describe()
    assert all(
        n.target is prims.convert_element_type.default
        for n in split.dw_graph.graph.nodes
        if n.name in split.cut.recomputed
    )
    bindings: dict[sympy.Symbol, int] = {}
    assert split.live_in_bytes(bindings) < split.all_crossing_bytes(bindings)


class NormMLPStack(nn.Module):
    """Two residual ``LayerNorm -> Linear -> GELU -> Linear`` blocks. With
    ``defer="all"`` the LayerNorm weight gradients stay in dW; their pointwise
    inputs are cheaper to recompute there than to hand over."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_cheaper_cut_with_dynamic_sizes() -> None:
    """``dynamic=True``: the cheaper cut holds fewer bytes for every row count
    the shape environment allows (>= 2), so it is kept; gradients match eager
    at several row counts with the one region."""
    torch.manual_seed(0)
    ref = NormMLPStack()
    mod = copy.deepcopy(ref)
    cm = torch.compile(mod, backend=fxsplit.backend(compiler="eager", fallback="error", defer="all"), dynamic=True)
    before = fxsplit.compiled_regions()
    for rows in (6, 3, 9):
        x = torch.randn(rows, 16)
        xr, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        g = torch.randn(rows, 16)
        for p in (*ref.parameters(), *mod.parameters()):
            p.grad = None
        ref(xr).backward(g)
        (dx,), work = fxsplit.stage_backward_input([cm(xg)], [g], [xg], mod.parameters())
        fxsplit.stage_backward_weight(mod.parameters(), work)
        assert_close(dx, xr.grad)
        for p, q in zip(ref.parameters(), mod.parameters()):
            assert_close(q.grad, p.grad)
    (region,) = new_regions(before)
    split = region.split
    assert split.cut.saves_bytes and split.cut.recomputed, split.describe()
    (sym,) = split.live_in_bytes_expr.free_symbols
    for rows in (2, 3, 100):
        assert split.live_in_bytes({sym: rows}) < split.all_crossing_bytes({sym: rows})


def test_a_size_that_divides_a_constant_is_weighed_as_small() -> None:
    """A dimension of 16 split as ``(16 // s, s)`` and joined back (head splits
    under ``dynamic=True``, as in JetMoE's attention experts) makes byte
    formulas with ``16 // (16 // s)``: at LARGE_SIZE the inner quotient is 0
    and the outer one a division by zero, which failed the whole split. Such a
    size is bounded by what it divides, so it is weighed at 2; the cut is then
    chosen, and checked, as for any symbolic size: a saving behind a floor
    division cannot be proved, so the all-crossing cut is kept."""
    mode, size = symbolic_mode()
    s0, s1 = size("s0", 5), size("s1", 4)
    b = GraphBuilder(mode)
    b.input("s0", s0)
    b.input("s1", s1)
    with mode:
        m = 16 // (16 // s1)
        x = b.input("x", torch.empty(s0, m, dtype=torch.bfloat16))
        w = b.input("w", torch.empty(4, m))
        g = b.input("tangents", torch.empty(s0, 4))
    dx, dw = _upcast_ops(b, x, w, g)
    bw = b.done(None, None, dx, None, dw)
    assert any("FloorDiv" in str(f.func) for f in _size_functions(bw))
    with mode:
        split = split_backward(bw, [4])
    assert split.cut.recomputed == ()
    assert sympy.expand(split.live_in_bytes_expr - split.all_crossing_bytes_expr) == 0
    args = [5, 4, torch.randn(5, 4).to(torch.bfloat16), torch.randn(4, 4), torch.randn(5, 4)]
    check_contract(bw, [4], args)


def _size_functions(bw: torch.fx.GraphModule) -> set[Any]:
    """The sympy functions in the byte formulas of ``bw``'s values."""
    atoms: set[Any] = set()
    for n in bw.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            atoms |= value_bytes(n).atoms(sympy.Function)
    return atoms
