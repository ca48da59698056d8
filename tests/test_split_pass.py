"""Unit tests of the pure split pass (:func:`fxsplit.passes.split_backward`) on hand-built FX graphs.

Each graph is written out node by node with ATen ops, as AOTAutograd's
backward graphs are: placeholders (saved activations, tangents, SymInts),
then the gradient computation, then one output returning a flat tuple.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxsplit.passes import SplitError, SplitRuleError, normalized_graph_code, split_backward
from graph_builder import (
    GraphBuilder,
    check_contract,
    node_names,
    placeholder_vals,
    symbolic_mode,
    unbound_symbols,
)

aten = torch.ops.aten


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


# ---- symbolic sizes ---------------------------------------------------------------


def flattened_linear_backward() -> tuple[fx.GraphModule, list[Any], tuple[torch.SymInt, torch.SymInt]]:
    """Backward of a Linear on a ``[s0, s1, 4]`` activation, as AOTAutograd writes it:
    the SymInts s0 and s1 are inputs, the saved activation is flattened to
    ``[s0*s1, 4]``, and the gradient flowing into the Linear is ``[s0*s1, 5]``.
    Returns the graph, real arguments for it (s0=2, s1=3) and the symbols."""
    mode, size = symbolic_mode()
    s0, s1 = size("s0", 2), size("s1", 3)
    b = GraphBuilder(mode)
    n0, n1 = b.input("s0", s0), b.input("s1", s1)
    with mode:
        x = b.input("x", torch.empty(s0 * s1, 4))
        w = b.input("w", torch.empty(5, 4))
        g = b.input("tangents", torch.empty(s0, s1, 5))
    rows = b.op("rows", operator.mul, n0, n1)
    g2 = b.op("g2", aten.view.default, g, [rows, 5])
    dx2 = b.op("dx2", aten.mm.default, g2, w)
    dx = b.op("dx", aten.view.default, dx2, [n0, n1, 4])
    g2t = b.op("g2t", aten.t.default, g2)
    dw = b.op("dw", aten.mm.default, g2t, x)
    args = [2, 3, torch.randn(6, 4), torch.randn(5, 4), torch.randn(2, 3, 5)]
    return b.done(None, None, dx, None, dw), args, (s0, s1)


def test_dw_receives_the_symints_that_define_its_sizes() -> None:
    """dW reads [s0*s1, .] tensors: it must also take s0 and s1 (a product binds
    neither), as AOTAutograd's partitioner gives them to the backward."""
    bw, args, (s0, s1) = flattened_linear_backward()
    split = split_backward(bw, [4])
    assert [(l.name, l.source, l.kind) for l in split.live_ins] == [
        ("s0", "input", "symint"),
        ("s1", "input", "symint"),
        ("x", "input", "tensor"),
        ("g2", "dI", "tensor"),
    ]
    assert unbound_symbols(split.dw_graph) == set()
    assert unbound_symbols(split.di_graph) == set()
    check_contract(bw, [4], args)


def test_a_value_dw_reads_only_for_its_size_crosses_as_a_symint() -> None:
    """dW divides by the row count of a dI intermediate: the row count crosses
    (a SymInt computed in dI), not the intermediate tensor."""
    mode, size = symbolic_mode()
    s0 = size("s0", 4)
    b = GraphBuilder(mode)
    b.input("s0", s0)  # the size placeholder first, where Dynamo puts it
    with mode:
        x = b.input("x", torch.empty(s0, 3))
        w = b.input("w", torch.empty(2, 3))
        g = b.input("tangents", torch.empty(s0, 2))
    dx = b.op("dx", aten.mm.default, g, w)
    h = b.op("h", aten.relu.default, dx)
    rows = b.op("rows", aten.sym_size.int, h, 0)
    gt = b.op("gt", aten.t.default, g)
    dw_sum = b.op("dw_sum", aten.mm.default, gt, x)
    dw = b.op("dw", aten.div.Tensor, dw_sum, rows)
    bw = b.done(None, h, None, dw)
    split = split_backward(bw, [3])
    assert [(l.name, l.source, l.kind) for l in split.live_ins] == [
        ("x", "input", "tensor"),
        ("tangents", "input", "tensor"),
        ("rows", "dI", "symint"),
    ]
    assert node_names(split.dw_graph) == {"gt", "dw_sum", "dw"}
    assert unbound_symbols(split.dw_graph) == set()  # rows is s0 itself, so it binds s0
    check_contract(bw, [3], [4, torch.randn(4, 3), torch.randn(2, 3), torch.randn(4, 2)])


# ---- multi-output nodes -------------------------------------------------------------


@torch.library.custom_op("fxsplit_test::linear_backward", mutates_args=())
def linear_backward_op(x: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_input, grad_weight) of ``x @ w.T`` in one call, like transformers'
    grouped-mm fallback backward."""
    return grad_out @ w, grad_out.T @ x


@linear_backward_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return grad_out.new_empty(grad_out.shape[0], w.shape[1]), grad_out.new_empty(w.shape)


def fused_op_backward() -> fx.GraphModule:
    """Backward of a Linear whose input and weight gradients come from one
    custom-op call; returns (dx, dw)."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(4, 3))
    w = b.input("w", torch.randn(2, 3))
    g = b.input("tangents", torch.randn(4, 2))
    both = b.op("both", torch.ops.fxsplit_test.linear_backward.default, x, w, g)
    dx = b.op("dx", operator.getitem, both, 0)
    dw = b.op("dw", operator.getitem, both, 1)
    return b.done(dx, dw)


def test_multi_output_op_without_rule_stays_in_di_and_crosses_leaf_by_leaf() -> None:
    """No rule: the node runs whole in dI (correct, but its weight work runs in
    B, which the result reports); what crosses is the weight-gradient leaf, a
    tensor, never the tuple."""
    bw = fused_op_backward()
    split = split_backward(bw, [1])
    assert [(l.name, l.source, l.kind) for l in split.live_ins] == [("dw", "dI", "tensor")]
    assert node_names(split.dw_graph) == set()
    (shared,) = split.weight_work_in_di
    assert (shared.name, shared.op, shared.di_outputs, shared.dw_outputs, shared.how) == (
        "both", "fxsplit_test::linear_backward", (0,), (1,), "unsplit"
    )
    assert "weight work in dI: both (fxsplit_test::linear_backward)" in split.describe()
    check_contract(bw, [1], placeholder_vals(bw))


VIEW_SPLITS = {
    "split": (aten.split.Tensor, (4, 8), (4, 1)),
    "split_with_sizes": (aten.split_with_sizes.default, (4, 8), ([4, 4], 1)),
    "chunk": (aten.chunk.default, (4, 8), (2, 1)),
    "tensor_split": (aten.tensor_split.sections, (4, 8), (2, 1)),
    "unbind": (aten.unbind.int, (4, 2, 4), (1,)),
}


@pytest.mark.parametrize("view", sorted(VIEW_SPLITS))
def test_multi_output_view_feeding_both_sides_is_not_weight_work(view: str) -> None:
    """A multi-output view in dI (a min-cut partitioner recomputes a forward
    ``chunk`` in the backward) whose first part feeds the input-gradient chain
    and second part a weight product: the view computes nothing, so it is no
    shared node, nothing is reported as weight work in dI, and the part dW
    reads crosses as a tensor."""
    op, shape, args = VIEW_SPLITS[view]
    b = GraphBuilder()
    h = b.input("h", torch.randn(shape))
    w = b.input("w", torch.randn(3, 4))
    ga = b.input("tangents_a", torch.randn(4, 4))
    g = b.input("tangents", torch.randn(4, 3))
    parts = b.op("parts", op, h, *args)
    first = b.op("first", operator.getitem, parts, 0)
    second = b.op("second", operator.getitem, parts, 1)
    da = b.op("da", aten.mul.Tensor, b.op("cos", aten.cos.default, first), ga)
    dsecond = b.op("dsecond", aten.mm.default, g, w)
    dw = b.op("dw", aten.mm.default, b.op("gt", aten.t.default, g), second)
    bw = b.done(da, dsecond, dw)

    split = split_backward(bw, [2])
    assert split.shared == () and split.weight_work_in_di == ()
    assert "weight work in dI" not in split.describe() and "shared:" not in split.describe()
    assert "parts" in node_names(split.di_graph) and "dw" in node_names(split.dw_graph)
    assert all(l.kind == "tensor" for l in split.live_ins)
    check_contract(bw, [2], placeholder_vals(bw))


def hand_rule(wrong_shape: bool = False) -> Callable[[fx.Node, frozenset[int]], fx.GraphModule | None]:
    """A split rule for ``fxsplit_test::linear_backward`` written as FX graphs by
    hand: output 0 is ``grad_out @ w``, output 1 is ``grad_out.T @ x``."""

    def rule(node: fx.Node, outputs: frozenset[int]) -> fx.GraphModule | None:
        if node.target is not torch.ops.fxsplit_test.linear_backward.default:
            return None
        b = GraphBuilder()
        x, w, g = (b.input(f"in{k}", a.meta["val"]) for k, a in enumerate(node.all_input_nodes))
        outs = []
        if 0 in outputs:
            outs.append(b.op("rule_dx", aten.mm.default, g, w))
        if 1 in outputs:
            gt = b.op("rule_gt", aten.t.default, g)
            outs.append(b.op("rule_dw", aten.mm.default, gt, x if not wrong_shape else g))
        return b.done(*outs)

    return rule


def test_multi_output_op_split_by_a_rule() -> None:
    bw = fused_op_backward()
    split = split_backward(bw, [1], rule=hand_rule())
    assert node_names(split.di_graph) == {"rule_dx"}
    assert node_names(split.dw_graph) == {"rule_gt", "rule_dw"}
    assert [(l.name, l.kind) for l in split.live_ins] == [("x", "tensor"), ("tangents", "tensor")]
    assert [s.how for s in split.shared] == ["rule"] and split.weight_work_in_di == ()
    assert normalized_graph_code(bw).count("fxsplit_test.linear_backward") == 1  # input untouched
    check_contract(bw, [1], placeholder_vals(bw))


def test_rule_with_wrong_output_shape_is_refused() -> None:
    bw = fused_op_backward()
    before = normalized_graph_code(bw)
    with pytest.raises(SplitRuleError, match=r"output 1 of both should be torch.float32 \(2, 3\).*\(2, 2\)"):
        split_backward(bw, [1], rule=hand_rule(wrong_shape=True))
    assert normalized_graph_code(bw) == before


def test_rule_that_does_not_apply_leaves_the_node_whole() -> None:
    bw = fused_op_backward()
    split = split_backward(bw, [1], rule=lambda node, outputs: None)
    assert [s.how for s in split.shared] == ["unsplit"]
    check_contract(bw, [1], placeholder_vals(bw))


def test_rule_applies_to_symbolic_sizes() -> None:
    """A rule splits a node whose values have symbolic sizes; dW still binds them."""
    mode, size = symbolic_mode()
    s0 = size("s0", 5)
    b = GraphBuilder(mode)
    b.input("s0", s0)  # the size placeholder first, where Dynamo puts it
    with mode:
        x = b.input("x", torch.empty(s0 * 2, 3))
        w = b.input("w", torch.empty(2, 3))
        g = b.input("tangents", torch.empty(s0 * 2, 2))
    both = b.op("both", torch.ops.fxsplit_test.linear_backward.default, x, w, g)
    dx = b.op("dx", operator.getitem, both, 0)
    dw = b.op("dw", operator.getitem, both, 1)
    bw = b.done(None, dx, dw)
    with mode:
        split = split_backward(bw, [2], rule=hand_rule())
    assert [(l.name, l.kind) for l in split.live_ins] == [("s0", "symint"), ("x", "tensor"), ("tangents", "tensor")]
    assert unbound_symbols(split.dw_graph) == set()
    check_contract(bw, [2], [5, torch.randn(10, 3), torch.randn(2, 3), torch.randn(10, 2)])


def _second(pair: Any) -> Any:
    return pair[1]


def test_a_tuple_that_would_cross_is_refused() -> None:
    """Something other than ``getitem`` reading a multi-output node's tuple in
    dW would make the tuple itself a live-in: refused, naming the value."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(4, 3))
    w = b.input("w", torch.randn(2, 3))
    g = b.input("tangents", torch.randn(4, 2))
    both = b.op("both", torch.ops.fxsplit_test.linear_backward.default, x, w, g)
    dx = b.op("dx", operator.getitem, both, 0)
    dw = b.op("dw", _second, both)
    with pytest.raises(SplitError, match="both .* would cross from dI to dW as a tuple"):
        split_backward(b.done(dx, dw), [1])
