"""Placement by cost (:mod:`fxsplit.passes.placement`): cheap weight reductions run in dI.

Hand-built graphs check what moves and what does not; models compiled with
the backend check the numerics against eager autograd under both policies
(``defer="matmuls"``, the default, and ``defer="all"``), and one real-Inductor
run checks that the reductions compile into dI.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import fxsplit
import zoo
from fxsplit.passes import split_backward
from fxsplit.passes.placement import is_small_result
from fxsplit.passes.roles import is_contraction, is_pointwise, is_reduction, is_view
from graph_builder import GraphBuilder, check_contract, node_names, placeholder_vals, symbolic_mode
from stage_check import new_regions

aten = torch.ops.aten


def linear_bias_backward(rows: int = 8) -> Any:
    """Backward of ``y = x @ w.T + b`` on ``rows`` rows; returns (dx, dw, db)."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(rows, 3))
    w = b.input("w", torch.randn(2, 3))
    g = b.input("tangents", torch.randn(rows, 2))
    dx = b.op("dx", aten.mm.default, g, w)
    gt = b.op("gt", aten.t.default, g)
    dw = b.op("dw", aten.mm.default, gt, x)
    db = b.op("db", aten.sum.dim_IntList, g, [0])
    return b.done(dx, dw, db)


def test_bias_gradient_runs_in_di_and_its_result_crosses() -> None:
    bw = linear_bias_backward()
    split = check_contract(bw, [1, 2], placeholder_vals(bw))
    assert split.placement.defer == "matmuls"
    assert split.placement.reductions == ("db",)
    assert node_names(split.di_graph) == {"dx", "db"}
    assert node_names(split.dw_graph) == {"gt", "dw"}  # every weight matmul stays in dW
    assert [(l.name, l.source) for l in split.live_ins] == [("x", "input"), ("tangents", "input"), ("db", "dI")]


def test_defer_all_keeps_every_weight_gradient_node_in_dw() -> None:
    bw = linear_bias_backward()
    split = check_contract(bw, [1, 2], placeholder_vals(bw), defer="all")
    assert split.placement.reductions == ()
    assert node_names(split.di_graph) == {"dx"}
    assert node_names(split.dw_graph) == {"gt", "dw", "db"}


def test_norm_weight_gradient_moves_with_its_pointwise_feeder() -> None:
    """LayerNorm-style weight gradient ``sum(g * xhat, 0)``: ``xhat`` is computed
    in dI (the input gradient needs it), the product is read only by the sum, so
    both move; the result ([d]) crosses instead of the product ([n, d])."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(8, 4))
    rstd = b.input("rstd", torch.rand(8, 1) + 0.5)
    w = b.input("w", torch.randn(4))
    g = b.input("tangents", torch.randn(8, 4))
    xhat = b.op("xhat", aten.mul.Tensor, x, rstd)
    gw = b.op("gw", aten.mul.Tensor, g, w)
    dx = b.op("dx", aten.mul.Tensor, gw, xhat)
    prod = b.op("prod", aten.mul.Tensor, g, xhat)
    dweight = b.op("dweight", aten.sum.dim_IntList, prod, [0])
    dbias = b.op("dbias", aten.sum.dim_IntList, g, [0])
    bw = b.done(dx, None, None, dweight, dbias)
    split = check_contract(bw, [3, 4], placeholder_vals(bw))
    assert split.placement.reductions == ("dweight", "dbias")
    assert split.placement.feeders == ("prod",)
    assert node_names(split.dw_graph) == set()
    assert [l.name for l in split.live_ins] == ["dweight", "dbias"]
    assert split.live_in_bytes_expr == 2 * 4 * 4  # two [4] float32 results


def test_reduction_of_a_value_di_does_not_read_stays_in_dw() -> None:
    """``sum(h)`` where only dW reads the saved activation ``h``: moving it would
    make B read memory it does not otherwise touch."""
    b = GraphBuilder()
    h = b.input("h", torch.randn(8, 4))
    w = b.input("w", torch.randn(4, 4))
    g = b.input("tangents", torch.randn(8, 4))
    dx = b.op("dx", aten.mm.default, g, w)
    dscale = b.op("dscale", aten.sum.dim_IntList, h, [0])
    bw = b.done(dx, None, dscale)
    split = check_contract(bw, [2], placeholder_vals(bw))
    assert split.placement.reductions == ()
    assert node_names(split.dw_graph) == {"dscale"}


def test_reduction_of_a_weight_matmul_stays_in_dw() -> None:
    """A batched weight gradient ``sum(bmm(...), 0)``: the sum reads the matmul,
    which is W's work, so neither moves."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(4, 8, 3))
    w = b.input("w", torch.randn(2, 3))
    g = b.input("tangents", torch.randn(4, 8, 2))
    dx = b.op("dx", aten.matmul.default, g, w)
    gt = b.op("gt", aten.transpose.int, g, 1, 2)
    per_batch = b.op("per_batch", aten.bmm.default, gt, x)
    dw = b.op("dw", aten.sum.dim_IntList, per_batch, [0])
    bw = b.done(dx, dw)
    split = check_contract(bw, [1], placeholder_vals(bw))
    assert split.placement.reductions == ()
    assert {"per_batch", "dw"} <= node_names(split.dw_graph)


def test_a_reduction_over_few_rows_is_not_small() -> None:
    """Static sizes: summing 2 rows into 1 keeps half the bytes; below the
    4x threshold the reduction stays in dW."""
    bw = linear_bias_backward(rows=2)
    split = check_contract(bw, [1, 2], placeholder_vals(bw))
    assert split.placement.reductions == ()


def test_small_result_is_decided_on_sympy_sizes() -> None:
    s0, s1 = sympy.symbols("s0 s1", positive=True, integer=True)
    assert is_small_result(sympy.Integer(768), 768 * s0 * s1)  # batch and sequence summed away
    assert is_small_result(s1, 8 * s1)  # constant ratio 8
    assert is_small_result(sympy.Integer(8), sympy.Integer(32))
    assert not is_small_result(s1, 2 * s1)  # ratio 2
    assert not is_small_result(sympy.Integer(4), sympy.Integer(8))
    assert not is_small_result(s1, 8 * s0)  # a symbol the input does not have
    assert not is_small_result(sympy.Integer(0), sympy.Integer(8))  # empty


def test_symbolic_rows_reduction_moves() -> None:
    """``[s0, 4] -> [4]``: the batch symbol is summed away, whatever s0's example value."""
    mode, size = symbolic_mode()
    s0 = size("s0", 2)  # a small example value must not matter
    b = GraphBuilder(mode)
    b.input("s0", s0)
    with mode:
        x = b.input("x", torch.empty(s0, 3))
        w = b.input("w", torch.empty(4, 3))
        g = b.input("tangents", torch.empty(s0, 4))
    dx = b.op("dx", aten.mm.default, g, w)
    gt = b.op("gt", aten.t.default, g)
    dw = b.op("dw", aten.mm.default, gt, x)
    db = b.op("db", aten.sum.dim_IntList, g, [0])
    bw = b.done(None, dx, None, dw, db)
    with mode:
        split = split_backward(bw, [3, 4])
    assert split.placement.reductions == ("db",)
    check_contract(bw, [3, 4], [2, torch.randn(2, 3), torch.randn(4, 3), torch.randn(2, 4)])


def test_unknown_defer_is_refused_before_any_work() -> None:
    with pytest.raises(ValueError, match="defer must be one of"):
        split_backward(linear_bias_backward(), [1, 2], defer="none")
    with pytest.raises(ValueError, match="defer must be one of"):
        fxsplit.backend(defer="some")
    with pytest.raises(ValueError, match=r"fxsplit.config.defer must be one of"):
        with fxsplit.config.patch(defer="bias"):
            pass


# ---- through the backend ---------------------------------------------------------


class RMSNormSwiGLU(nn.Module):
    """A Llama-style MLP block: RMSNorm (weight only), SwiGLU, no biases, and a
    biased output projection so a bias gradient is present too."""

    def __init__(self, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def _check_against_eager(module: nn.Module, x: torch.Tensor, compiler: str, defer: str, atol: float = 1e-5) -> Any:
    """B then W through the backend vs eager autograd; returns the region's split."""
    ref, mod = module, copy.deepcopy(module)
    cm = torch.compile(mod, backend=fxsplit.backend(compiler=compiler, fallback="error", defer=defer))
    xr, xg = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    g = torch.randn_like(x)
    ref(xr).backward(g)
    before = fxsplit.compiled_regions()
    out = cm(xg)
    (dx,), work = fxsplit.stage_backward_input([out], [g], [xg], mod.parameters())
    assert all(p.grad is None for p in mod.parameters()), "B wrote a weight's .grad"
    fxsplit.stage_backward_weight(mod.parameters(), work)
    assert_close(dx, xr.grad, atol=atol, rtol=1e-4)
    for (n, p), q in zip(ref.named_parameters(), mod.parameters()):
        assert_close(q.grad, p.grad, atol=atol, rtol=1e-4, msg=lambda m: f"{n}.grad: {m}")
    (region,) = new_regions(before)
    return region.split


def moved_nodes(split: Any) -> list[Any]:
    """Nodes of the dI graph that the placement moved there."""
    names = set(split.placement.reductions) | set(split.placement.feeders)
    return [n for n in split.di_graph.graph.nodes if n.name in names]


@pytest.mark.parametrize("defer", ["matmuls", "all"])
@pytest.mark.parametrize("name", ["mlp", "layernorm", "layernorm_linear", "attention", "rmsnorm_swiglu"])
def test_numerics_under_both_placements(name: str, defer: str) -> None:
    if name == "rmsnorm_swiglu":
        module, x = RMSNormSwiGLU(), torch.randn(2, 6, 8)
    else:
        module, (x,) = zoo.case(name).make()
    split = _check_against_eager(module, x, "eager", defer)
    if defer == "all":
        assert split.placement.reductions == () and not moved_nodes(split)
    else:
        assert split.placement.reductions, f"no weight reduction moved into dI:\n{split.describe()}"
        moved = moved_nodes(split)
        assert all(is_reduction(n) or is_pointwise(n) or is_view(n) for n in moved), moved
        assert not any(is_contraction(n) for n in moved)


def test_rmsnorm_weight_and_bias_gradients_run_in_di() -> None:
    split = _check_against_eager(RMSNormSwiGLU(), torch.randn(2, 6, 8), "eager", "matmuls")
    # The RMSNorm weight gradient and the down projection's bias gradient: two
    # [8] reductions over the 12 rows.
    sums = [n for n in moved_nodes(split) if is_reduction(n)]
    assert len(sums) == 2 and all(n.meta["val"].numel() == 8 for n in sums), split.describe()


@pytest.mark.inductor
def test_placement_with_inductor() -> None:
    """The moved reductions compile into dI with the real Inductor; gradients match eager."""
    module, (x,) = zoo.case("layernorm_linear").make()
    split = _check_against_eager(module, x, "inductor", "matmuls")
    assert len(split.placement.reductions) == 3  # LayerNorm weight, LayerNorm bias, Linear bias


def test_config_defer_applies_to_backends_without_the_option() -> None:
    module, (x,) = zoo.case("mlp").make()
    with fxsplit.config.patch(defer="all"):
        cm = torch.compile(copy.deepcopy(module), backend=fxsplit.backend(compiler="eager", fallback="error"))
        cm(x.detach().clone().requires_grad_())
    assert fxsplit.compiled_regions()[-1].split.placement.defer == "all"
    torch._dynamo.reset()
    cm = torch.compile(copy.deepcopy(module), backend=fxsplit.backend(compiler="eager", fallback="error"))
    cm(x.detach().clone().requires_grad_())
    assert fxsplit.compiled_regions()[-1].split.placement.defer == "matmuls"
