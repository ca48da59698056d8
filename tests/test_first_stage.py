"""A first stage's split (:mod:`fxsplit.passes.first_stage`): the chain in dI, the leaves in dW.

When no input of a region needs a gradient, the split runs the
activation-gradient chain in dI and only the weight-gradient leaves in dW,
with no work duplicated: FLOPs(dI) + FLOPs(dW) == FLOPs(backward), and dW's
FLOPs are the weight-gradient FLOPs only. Checked on hand-built graphs and on
real backward graphs of compiled models (captured from the backend), then end
to end: B runs the dI graph, W the dW graph (whether or not the fused graph
was compiled), and gradients match eager autograd; ``test_first_stage_runtime``
checks the runtime in depth (stage layouts, FLOPs, memory, hooks).
"""

from __future__ import annotations

import collections
import copy
import importlib
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.testing import assert_close
from torch.utils.flop_counter import FlopCounterMode

import fxsplit
import zoo
from fxsplit.passes import SplitResult, split_backward
from fxsplit.passes.roles import is_contraction
from graph_builder import GraphBuilder, check_contract, node_names, placeholder_vals, run
from test_placement import RMSNormSwiGLU

aten = torch.ops.aten
Counts = collections.Counter


def flops(fn: Callable[[], Any]) -> Counts:
    with FlopCounterMode(display=False) as counter:
        fn()
    return Counts({str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items() if n})


def phase_flops(bw: fx.GraphModule, split: SplitResult, args: list[Any]) -> tuple[Counts, Counts, Counts]:
    """FLOPs of the whole backward graph, of dI and of dW on ``args``."""
    whole = flops(lambda: run(bw, list(args)))
    outs: list[Any] = []
    di = flops(lambda: outs.extend(run(split.di_graph, list(args))))
    dw = flops(lambda: run(split.dw_graph, outs[len(split.di_outputs):]))
    return whole, di, dw


def mlp_first_stage_backward(n: int = 4, d: int = 8, h: int = 32) -> fx.GraphModule:
    """Backward of ``fc2(relu(fc1(x)))`` with biases, ``x`` needing no gradient;
    returns (None, dw1, db1, dw2, db2)."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(n, d))
    w2 = b.input("w2", torch.randn(d, h))
    a = b.input("a", torch.randn(n, h).relu())
    g = b.input("tangents", torch.randn(n, d))
    dh = b.op("dh", aten.mm.default, g, w2)  # the chain: gradient of relu's output
    mask = b.op("mask", aten.le.Scalar, a, 0)
    dpre = b.op("dpre", aten.where.ScalarSelf, mask, 0.0, dh)
    gt = b.op("gt", aten.t.default, g)
    dw2 = b.op("dw2", aten.mm.default, gt, a)
    db2 = b.op("db2", aten.sum.dim_IntList, g, [0])
    dpre_t = b.op("dpre_t", aten.t.default, dpre)
    dw1 = b.op("dw1", aten.mm.default, dpre_t, x)
    db1 = b.op("db1", aten.sum.dim_IntList, dpre, [0])
    return b.done(None, dw1, db1, dw2, db2)


@pytest.mark.parametrize("defer", ["matmuls", "all"])
def test_chain_in_di_leaves_in_dw(defer: str) -> None:
    n, d, h = 4, 8, 32
    bw = mlp_first_stage_backward(n, d, h)
    args = placeholder_vals(bw)
    split = check_contract(bw, [1, 2, 3, 4], args, defer=defer)
    assert split.mode == "first_stage" and split.di_outputs == ()
    assert split.leaves is not None and split.leaves.leaves == ("dw2", "dw1")
    assert split.leaves.frontier == ("dpre",)
    chain = {"dh", "mask", "dpre"}
    if defer == "matmuls":  # the bias gradients join the chain's kernels
        assert node_names(split.di_graph) == chain | {"db1", "db2"}
        assert node_names(split.dw_graph) == {"gt", "dw2", "dpre_t", "dw1"}
    else:
        assert node_names(split.di_graph) == chain
        assert node_names(split.dw_graph) == {"gt", "dw2", "db2", "dpre_t", "dw1", "db1"}
    # What only the chain reads (fc2's weight) is not kept for W.
    assert "w2" not in [l.name for l in split.live_ins]

    one = 2 * n * d * h
    whole, di, dw = phase_flops(bw, split, args)
    assert di + dw == whole == Counts({"aten.mm": 3 * one})
    assert di == Counts({"aten.mm": one})  # the chain's dX matmul
    assert dw == Counts({"aten.mm": 2 * one})  # the two weight-gradient matmuls, nothing else
    assert "first stage" in split.describe()


def test_first_stage_without_a_chain_keeps_everything_in_dw() -> None:
    """A single Linear: its weight gradient reads the tangent and the input
    directly; there is no chain, so dI computes nothing."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(4, 3))
    g = b.input("tangents", torch.randn(4, 2))
    gt = b.op("gt", aten.t.default, g)
    dw = b.op("dw", aten.mm.default, gt, x)
    bw = b.done(None, dw)
    split = check_contract(bw, [1], placeholder_vals(bw))
    assert split.mode == "first_stage" and node_names(split.di_graph) == set()
    assert split.leaves is not None and split.leaves.leaves == ("dw",) and split.leaves.frontier == ()


def test_convolution_backward_on_the_chain_is_divided() -> None:
    """Two convolutions, the first one's input needing no gradient: the second's
    ``convolution_backward`` computes the chain's gradient (for the first conv's
    weight) and its own weight gradient, so it is divided by output_mask: the
    input-gradient part in dI, the weight part in dW."""
    b = GraphBuilder()
    x = b.input("x", torch.randn(2, 3, 8, 8))
    w1 = b.input("w1", torch.randn(4, 3, 3, 3))
    y1 = b.input("y1", torch.randn(2, 4, 6, 6))
    w2 = b.input("w2", torch.randn(5, 4, 3, 3))
    g = b.input("tangents", torch.randn(2, 5, 4, 4))
    stride, padding, dilation = [1, 1], [0, 0], [1, 1]
    cb2 = b.op("cb2", aten.convolution_backward.default, g, y1, w2, [5], stride, padding, dilation,
               False, [0, 0], 1, [True, True, True])
    dy1 = b.op("dy1", operator.getitem, cb2, 0)
    dw2 = b.op("dw2", operator.getitem, cb2, 1)
    db2 = b.op("db2", operator.getitem, cb2, 2)
    cb1 = b.op("cb1", aten.convolution_backward.default, dy1, x, w1, [4], stride, padding, dilation,
               False, [0, 0], 1, [False, True, True])
    dw1 = b.op("dw1", operator.getitem, cb1, 1)
    db1 = b.op("db1", operator.getitem, cb1, 2)
    bw = b.done(None, dw1, db1, dw2, db2)
    args = placeholder_vals(bw)
    split = check_contract(bw, [1, 2, 3, 4], args)
    assert split.mode == "first_stage"
    assert [(s.name, s.how, s.di_outputs, s.dw_outputs) for s in split.shared] == [
        ("cb2", "output_mask", (0,), (1, 2))
    ]

    def masks(gm: fx.GraphModule) -> list[list[bool]]:
        return [n.args[10] for n in gm.graph.nodes if n.target is aten.convolution_backward.default]

    assert masks(split.di_graph) == [[True, False, False]]
    assert sorted(masks(split.dw_graph)) == [[False, True, True], [False, True, True]]
    whole, di, dw = phase_flops(bw, split, args)
    assert di + dw == whole
    assert di and dw


# ---- real backward graphs ------------------------------------------------------------


class ConvFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.conv2 = nn.Conv2d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x)))


def _first_stage_models() -> dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]]:
    return {
        "mlp": lambda: (zoo.MLP(), torch.randn(4, 8)),
        "attention": lambda: (zoo.Attention(), torch.randn(2, 5, 16)),
        "conv": lambda: (ConvFirst(), torch.randn(2, 3, 8, 8)),
        "rmsnorm_swiglu": lambda: (nn.Sequential(nn.Linear(8, 8), RMSNormSwiGLU()), torch.randn(2, 6, 8)),
        "layernorm_linear": lambda: (nn.Sequential(nn.Linear(8, 8), zoo.LayerNormLinear()), torch.randn(4, 8)),
    }


def captured_backward(
    monkeypatch: pytest.MonkeyPatch, module: nn.Module, x: torch.Tensor
) -> tuple[fx.GraphModule, list[int]]:
    """The backward graph the backend splits for ``module`` on ``x`` (no grad),
    and its weight outputs, recorded from the backend's call of split_backward."""
    seen: list[tuple[fx.GraphModule, list[int]]] = []

    def recording(bw: fx.GraphModule, weight_outputs: Any, *args: Any, **kw: Any) -> SplitResult:
        seen.append((fx.GraphModule(bw, copy.deepcopy(bw.graph)), list(weight_outputs)))
        return split_backward(bw, weight_outputs, *args, **kw)

    # The module, not the fxsplit.backend() function that shadows it on the package.
    monkeypatch.setattr(importlib.import_module("fxsplit.backend"), "split_backward", recording)
    torch.compile(module, backend=fxsplit.backend(compiler="eager", fallback="error"))(x)
    (captured,) = seen
    return captured


def random_args(bw: fx.GraphModule) -> list[Any]:
    """Real values shaped like the graph's placeholders (any values do: the
    checks compare the split with the unsplit graph on the same values)."""
    args: list[Any] = []
    for p in bw.graph.find_nodes(op="placeholder"):
        val = p.meta["val"]
        if isinstance(val, torch.Tensor):
            shape = [int(s) for s in val.shape]
            if val.dtype == torch.bool:
                value = torch.rand(shape) > 0.5
            elif val.dtype.is_floating_point:
                value = torch.randn(shape, dtype=val.dtype)
            else:
                value = torch.zeros(shape, dtype=val.dtype)  # indices: 0 is always in range
            laid_out = torch.empty_strided(shape, [int(s) for s in val.stride()], dtype=val.dtype)
            args.append(laid_out.copy_(value))
        else:
            args.append(int(val))
    return args


@pytest.mark.parametrize("name", sorted(_first_stage_models()))
def test_real_first_stage_graphs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    module, x = _first_stage_models()[name]()
    bw, weight_outputs = captured_backward(monkeypatch, module, x)
    split = split_backward(bw, weight_outputs)
    assert split.mode == "first_stage" and split.leaves is not None
    args = random_args(bw)
    check_contract(bw, weight_outputs, args)
    whole, di, dw = phase_flops(bw, split, args)
    assert sum(whole.values()) > 0
    assert di + dw == whole, f"dI={dict(di)} dW={dict(dw)} whole={dict(whole)}"
    # dW's real work is only leaves, each a weight-gradient contraction.
    leaves = set(split.leaves.leaves)
    heavy = [n.name for n in split.dw_graph.graph.nodes if is_contraction(n)]
    assert heavy and set(heavy) <= leaves, (heavy, leaves)
    # Every model here has a layer before its last weight: the chain has matmul work.
    assert di, f"dI does no matmul work: the chain is empty\n{split.describe()}"


def test_real_mlp_first_stage_flops_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """zoo's first stage (MLP d=8 -> h=32 -> d=8, n=4 rows): dI does the one dX
    matmul of fc2 (the chain), dW the two weight matmuls."""
    module, (x,) = zoo.case("first_stage").make()
    bw, weight_outputs = captured_backward(monkeypatch, module, x)
    split = split_backward(bw, weight_outputs)
    one = 2 * 4 * 8 * 32
    _, di, dw = phase_flops(bw, split, random_args(bw))
    assert di == Counts({"aten.mm": one})
    assert dw == Counts({"aten.mm": 2 * one})


# ---- end to end ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "compiler,fused",
    [("eager", True), ("eager", False), pytest.param("inductor", False, marks=pytest.mark.inductor)],
)
def test_first_stage_end_to_end(compiler: str, fused: bool) -> None:
    """B runs the first-stage dI graph and touches no ``.grad``, W the dW graph
    (also when the fused graph was compiled); ordinary backward runs the fused
    graph, or dI then dW. Gradients match eager."""
    c = zoo.case("first_stage")
    ref, (x,) = c.make()
    mod = copy.deepcopy(ref)
    cm = torch.compile(mod, backend=fxsplit.backend(compiler=compiler, fallback="error", fused_backward=fused))
    g = torch.randn(4, 8)
    ref(x).backward(g)
    out = cm(x)
    region = fxsplit.compiled_regions()[-1]
    assert region.split.mode == "first_stage"
    (dx,), work = fxsplit.stage_backward_input([out], [g], [x], mod.parameters())
    assert dx is None and all(p.grad is None for p in mod.parameters())
    assert region.stats == {"fused_runs": 0, "di_runs": 1, "dw_runs": 0}
    fxsplit.stage_backward_weight(mod.parameters(), work)
    assert region.stats == {"fused_runs": 0, "di_runs": 1, "dw_runs": 1}
    for p, q in zip(ref.parameters(), mod.parameters()):
        assert_close(q.grad, p.grad)

    for p, q in zip(ref.parameters(), mod.parameters()):
        p.grad = q.grad = None
    ref(x).backward(g)
    cm(x).backward(g)
    for p, q in zip(ref.parameters(), mod.parameters()):
        assert_close(q.grad, p.grad)


def test_first_stage_divides_a_multi_output_op_by_its_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Linears whose backward is one custom op returning (grad_input,
    grad_weight): on a first stage the second op's grad_input is the chain and
    its grad_weight a leaf, so its split rule divides it (dI: one matmul, dW:
    the other); gradients through the backend match eager."""
    from fxsplit.rules import trace_split_rule
    from test_split_rules import FUSED_BW, FusedLinearStage, fused_linear_rule

    fxsplit.register_split_rule(FUSED_BW, fused_linear_rule)
    try:
        torch.manual_seed(0)
        model, x = FusedLinearStage(), torch.randn(5, 6)
        bw, weight_outputs = captured_backward(monkeypatch, copy.deepcopy(model), x)
        split = split_backward(bw, weight_outputs, rule=trace_split_rule)
        assert split.mode == "first_stage"
        assert [s.how for s in split.shared] == ["rule"]
        args = random_args(bw)
        check_contract(bw, weight_outputs, args, rule=trace_split_rule)
        _, di, _ = phase_flops(bw, split, args)
        assert di == Counts({"aten.mm": 2 * 5 * 6 * 12})  # the chain: grad_input of the second Linear

        monkeypatch.undo()
        torch._dynamo.reset()
        ref, mod = model, copy.deepcopy(model)
        cm = torch.compile(mod, backend=fxsplit.backend(compiler="eager", fallback="error", fused_backward=False))
        g = torch.randn(5, 6)
        ref(x).backward(g)
        out = cm(x)
        _, work = fxsplit.stage_backward_input([out], [g], [x], mod.parameters())
        fxsplit.stage_backward_weight(mod.parameters(), work)
        for p, q in zip(ref.parameters(), mod.parameters()):
            assert_close(q.grad, p.grad)
    finally:
        fxsplit.unregister_split_rule(FUSED_BW)
