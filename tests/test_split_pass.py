"""Unit tests of the pure split pass (:func:`fxsplit.passes.split_backward`) on hand-built FX graphs.

Each graph is written out node by node with ATen ops, as AOTAutograd's
backward graphs are: placeholders (saved activations, tangents, SymInts),
then the gradient computation, then one output returning a flat tuple.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.testing import assert_close

from fxsplit.passes import SplitError, normalized_graph_code, split_backward

aten = torch.ops.aten


class GraphBuilder:
    """A thin helper: placeholders carry ``meta["val"]``, nodes get the names we give them."""

    def __init__(self) -> None:
        self.graph = fx.Graph()

    def input(self, name: str, val: Any) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = val
        return node

    def op(self, name: str, target: Any, *args: Any) -> fx.Node:
        node = self.graph.create_node("call_function", target, args, {}, name=name)
        vals = fx.map_arg(args, lambda a: a.meta["val"])
        if not any(isinstance(v, torch.SymInt) for v in vals):
            node.meta["val"] = target(*vals)  # as AOTAutograd's fake-tensor metadata would be
        return node

    def done(self, *outs: Any) -> fx.GraphModule:
        self.graph.output(tuple(outs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def mlp_backward() -> fx.GraphModule:
    """Backward of ``y = relu(x @ w1.T) @ w2.T``; returns (dx, dw1, dw2)."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(4, 3))
    w1 = b.input("w1", torch.randn(5, 3))
    w2 = b.input("w2", torch.randn(2, 5))
    h = b.input("h", torch.randn(4, 5).relu())
    g = b.input("tangents", torch.randn(4, 2))
    dh = b.op("dh", aten.mm.default, g, w2)
    mask = b.op("mask", aten.le.Scalar, h, 0)
    dpre = b.op("dpre", aten.where.ScalarSelf, mask, 0.0, dh)
    dx = b.op("dx", aten.mm.default, dpre, w1)
    gt = b.op("gt", aten.t.default, g)
    dw2 = b.op("dw2", aten.mm.default, gt, h)
    dpre_t = b.op("dpre_t", aten.t.default, dpre)
    dw1 = b.op("dw1", aten.mm.default, dpre_t, x)
    return b.done(dx, dw1, dw2)


def run(gm: fx.GraphModule, args: list[Any]) -> tuple[Any, ...]:
    return tuple(gm(*args))


def placeholder_vals(gm: fx.GraphModule) -> list[Any]:
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def node_names(gm: fx.GraphModule) -> set[str]:
    return {n.name for n in gm.graph.nodes if n.op == "call_function"}


def check_contract(bw: fx.GraphModule, weight_outputs: list[int], args: list[Any]) -> None:
    """dI and dW together return exactly what ``bw`` returns (the SplitResult contract)."""
    split = split_backward(bw, weight_outputs)
    expected = run(bw, args)
    di = run(split.di_graph, list(args))
    n = len(split.di_outputs)
    dw = run(split.dw_graph, list(di[n:]))
    assert len(di) == n + split.num_live_ins
    got: list[Any] = [None] * split.num_outputs
    for i, v in zip(split.di_outputs, di[:n]):
        got[i] = v
    for i, v in zip(split.dw_outputs, dw):
        got[i] = v
    for i, (e, g) in enumerate(zip(expected, got)):
        assert (e is None) == (g is None), f"output {i}"
        if e is not None:
            assert_close(g, e)


def test_live_ins_are_exactly_what_dw_needs() -> None:
    bw = mlp_backward()
    split = split_backward(bw, [1, 2])
    assert split.di_outputs == (0,)
    assert split.dw_outputs == (1, 2)
    # W needs x and h (activations), the tangent (for dw2) and dpre (computed in dI, for dw1);
    # not the weights, and not dh/mask (only dI needs them).
    assert [(l.name, l.source, l.kind) for l in split.live_ins] == [
        ("x", "input", "tensor"),
        ("h", "input", "tensor"),
        ("tangents", "input", "tensor"),
        ("dpre", "dI", "tensor"),
    ]
    assert [n.name for n in split.dw_graph.graph.nodes if n.op == "placeholder"] == [l.name for l in split.live_ins]
    check_contract(bw, [1, 2], placeholder_vals(bw))


def test_di_has_no_weight_gradient_nodes_and_dw_no_input_gradient_nodes() -> None:
    bw = mlp_backward()
    split = split_backward(bw, [1, 2])
    assert node_names(split.di_graph) == {"dh", "mask", "dpre", "dx"}
    assert node_names(split.dw_graph) == {"gt", "dw2", "dpre_t", "dw1"}


def test_input_graph_is_not_modified() -> None:
    bw = mlp_backward()
    before = normalized_graph_code(bw)
    split_backward(bw, [1, 2])
    assert normalized_graph_code(bw) == before


def test_no_weight_outputs_gives_empty_dw() -> None:
    bw = mlp_backward()
    split = split_backward(bw, [])
    assert split.dw_outputs == () and split.live_ins == ()
    assert node_names(split.dw_graph) == set()
    check_contract(bw, [], placeholder_vals(bw))


def test_first_stage_everything_in_dw() -> None:
    """Only weight gradients (the stage input needs none): dI is empty, dW takes the inputs it reads."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(4, 3))
    g = b.input("tangents", torch.randn(4, 2))
    gt = b.op("gt", aten.t.default, g)
    dw = b.op("dw", aten.mm.default, gt, x)
    db = b.op("db", aten.sum.dim_IntList, g, [0])
    bw = b.done(None, dw, db)
    split = split_backward(bw, [1, 2])
    assert split.di_outputs == () and split.dw_outputs == (1, 2)
    assert node_names(split.di_graph) == set()
    assert [l.name for l in split.live_ins] == ["x", "tangents"]
    check_contract(bw, [1, 2], placeholder_vals(bw))


def test_weight_gradient_that_is_a_placeholder_or_di_value() -> None:
    """A weight gradient computed by dI (or passed straight through) crosses as a live-in."""
    b = GraphBuilder()
    w = b.input("w", torch.randn(3, 3))
    g = b.input("tangents", torch.randn(3, 3))
    dx = b.op("dx", aten.mm.default, g, w)
    bw = b.done(dx, g, dx)  # output 1: the tangent itself; output 2: the same value as dx
    split = split_backward(bw, [1, 2])
    assert [(l.name, l.source) for l in split.live_ins] == [("tangents", "input"), ("dx", "dI")]
    assert node_names(split.dw_graph) == set()
    check_contract(bw, [1, 2], placeholder_vals(bw))


def test_symint_live_in() -> None:
    """A SymInt input that only dW reads (here: the batch size of a mean) crosses as a live-in of kind symint."""
    s0 = ShapeEnv().create_unbacked_symint()
    b = GraphBuilder()
    n = b.input("s0", s0)
    x = b.input("x", torch.randn(4, 3))
    w = b.input("w", torch.randn(2, 3))
    g = b.input("tangents", torch.randn(4, 2))
    dx = b.op("dx", aten.mm.default, g, w)
    gt = b.op("gt", aten.t.default, g)
    dw_sum = b.op("dw_sum", aten.mm.default, gt, x)
    dw = b.op("dw", aten.div.Scalar, dw_sum, n)
    bw = b.done(None, dx, None, dw)
    split = split_backward(bw, [3])
    assert [(l.name, l.source, l.kind) for l in split.live_ins] == [
        ("s0", "input", "symint"),
        ("x", "input", "tensor"),
        ("tangents", "input", "tensor"),
    ]
    dw_inputs = [p for p in split.dw_graph.graph.nodes if p.op == "placeholder"]
    assert dw_inputs[0].meta["val"] is s0
    check_contract(bw, [3], [4, *placeholder_vals(bw)[1:]])


def test_multi_output_op_is_split_by_output_mask() -> None:
    """``convolution_backward`` computes the input, weight and bias gradients in
    one node; dI must get a node computing only the input gradient (mask
    [True, False, False]) and dW one computing the rest."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(2, 3, 6, 6))
    w = b.input("w", torch.randn(4, 3, 3, 3))
    g = b.input("tangents", torch.randn(2, 4, 4, 4))
    cb = b.op(
        "cb", aten.convolution_backward.default,
        g, x, w, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True],
    )
    dx = b.op("dx", operator.getitem, cb, 0)
    dw = b.op("dw", operator.getitem, cb, 1)
    db = b.op("db", operator.getitem, cb, 2)
    bw = b.done(dx, dw, db)
    split = split_backward(bw, [1, 2])

    def masks(gm: fx.GraphModule) -> list[list[bool]]:
        return [n.args[10] for n in gm.graph.nodes if n.target is aten.convolution_backward.default]

    assert masks(split.di_graph) == [[True, False, False]]
    assert masks(split.dw_graph) == [[False, True, True]]
    assert all(l.kind == "tensor" for l in split.live_ins)
    assert masks(bw) == [[True, True, True]]  # the input graph is untouched
    check_contract(bw, [1, 2], placeholder_vals(bw))


@pytest.mark.parametrize("bad", [[3], [-1], [0, 7]])
def test_bad_weight_indices_raise(bad: list[int]) -> None:
    with pytest.raises(SplitError, match="out of range"):
        split_backward(mlp_backward(), bad)


def test_non_tuple_output_raises() -> None:
    b = GraphBuilder()
    x = b.input("x", torch.randn(2))
    y = b.op("y", aten.neg.default, x)
    b.graph.output(y)
    with pytest.raises(SplitError, match="tuple"):
        split_backward(fx.GraphModule(torch.nn.Module(), b.graph), [])


def test_constant_output_raises() -> None:
    b = GraphBuilder()
    x = b.input("x", torch.randn(2))
    with pytest.raises(SplitError, match="constant"):
        split_backward(b.done(x, 3.0), [0])
