"""No duplicated work: FLOPs of B and W against ordinary backward.

``torch.utils.flop_counter.FlopCounterMode`` is a dispatch mode: it counts the
ATen ops that reach the dispatcher. With ``compiler="eager"`` the split FX
graphs run op by op, so it sees every op. With the real Inductor on CPU it
sees the matmuls and convolutions, which Inductor calls as extern ATen kernels
(``extern_kernels.mm`` etc.), but not the fused C++ pointwise kernels, which
carry no counted FLOPs anyway; one Inductor case checks that. All other cases
use the eager inner compiler, which is exact and fast.

Only the backward phases run under the counter: a forward run under a
dispatch mode makes Dynamo run that module eagerly from then on (upstream
behaviour), which would silently take the compiled region out of the test.

What B may compute. With the default placement (``defer="matmuls"``), B runs
the input-gradient work and, beside it, the cheap weight reductions: a
reduction (``sum``, ``mean``) of a tensor dI produces or reads, with a small
result, together with the pointwise ops and views that feed only it (bias
gradients, LayerNorm/RMSNorm weight gradients). Those carry no counted FLOPs,
so B's FLOPs still equal those of the input gradients alone, and B does no
weight-gradient matmul. ``test_b_computes_only_input_gradients_and_cheap_reductions``
checks the graph: everything dI runs beyond what its input gradients need is
one of those. With ``defer="all"``, B computes nothing for a weight gradient.
"""

from __future__ import annotations

import collections
import copy
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import fxsplit
import zoo
from fxsplit.passes.roles import is_contraction, is_pointwise, is_reduction, is_view
from fxsplit.passes.symbols import is_symbolic_scalar
from stage_check import new_regions
from zoo import Case, clone_inputs, forward, grad_outputs, make_grads

Counts = collections.Counter


def flops(fn: Callable[[], Any]) -> Counts:
    """FLOPs per ATen op (overload packet name) that ``fn`` dispatches."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return Counts({str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items() if n})


def compile_split(module: nn.Module, compiler: str = "eager", **kw: Any) -> nn.Module:
    return torch.compile(module, backend=fxsplit.backend(compiler=compiler, fallback="error", **kw))


def phase_flops(c: Case, module: nn.Module, cm: nn.Module, inputs: tuple[Any, ...]) -> tuple[Counts, Counts, Counts]:
    """(ordinary backward, B, W) FLOPs of the compiled module ``cm`` on ``inputs``."""
    x = clone_inputs(inputs)
    outs = grad_outputs(forward(c, cm, x))
    fused = flops(lambda: torch.autograd.backward(outs, make_grads(outs)))
    for p in module.parameters():
        p.grad = None

    x = clone_inputs(inputs)
    outs = grad_outputs(forward(c, cm, x))
    res: list[Any] = []
    b = flops(lambda: res.append(fxsplit.stage_backward_input(outs, make_grads(outs), list(x), module.parameters())))
    (_, work), = res
    w = flops(lambda: fxsplit.stage_backward_weight(module.parameters(), work))
    return fused, b, w


SUM_CASES = [
    "linear", "mlp", "layernorm_linear", "attention", "conv_bn", "tied_embedding",
    "weight_twice", "frozen_params", "multi_io", "checkpoint", "first_stage",
]


@pytest.mark.parametrize("defer", ["matmuls", "all"])
@pytest.mark.parametrize("name", SUM_CASES)
def test_b_plus_w_equals_ordinary_backward(name: str, defer: str) -> None:
    c = zoo.case(name)
    module, inputs = c.make()
    cm = compile_split(module, defer=defer)
    fused, b, w = phase_flops(c, module, cm, inputs)
    assert sum(fused.values()) > 0, "the counter saw nothing; the test would be vacuous"
    assert b + w == fused, f"B={dict(b)} W={dict(w)} ordinary={dict(fused)}"
    if "first_stage" in c.flags:
        assert b, "a first stage's B runs the activation-gradient chain (fc2's dX)"


NO_DW_IN_B_CASES = ["linear", "mlp", "layernorm_linear", "attention", "conv_bn", "tied_embedding", "weight_twice"]


@pytest.mark.parametrize("defer", ["matmuls", "all"])
@pytest.mark.parametrize("name", NO_DW_IN_B_CASES)
def test_b_does_only_input_gradient_work(name: str, defer: str) -> None:
    """B's FLOPs equal eager autograd's for the input gradients alone (every
    weight frozen, so eager autograd does no weight-gradient work at all)."""
    c = zoo.case(name)
    module, inputs = c.make()
    frozen = copy.deepcopy(module).requires_grad_(False)
    x = clone_inputs(inputs)
    outs = grad_outputs(forward(c, frozen, x))
    wanted = [t for t in x if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = make_grads(outs)
    expected = flops(lambda: torch.autograd.grad(outs, wanted, grads))
    assert sum(expected.values()) > 0

    _, b, w = phase_flops(c, module, compile_split(module, defer=defer), inputs)
    assert b == expected, f"B={dict(b)}, input-gradient work only={dict(expected)}"
    assert sum(w.values()) > 0


def _beyond_input_gradients(split: Any) -> list[torch.fx.Node]:
    """Nodes the dI graph runs that its input-gradient outputs do not need."""
    (ret,) = split.di_graph.graph.output_node().args
    needed: set[torch.fx.Node] = set()
    stack = [r for r in ret[: len(split.di_outputs)] if isinstance(r, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in split.di_graph.graph.nodes if n.op == "call_function" and n not in needed]


@pytest.mark.parametrize("defer", ["matmuls", "all"])
@pytest.mark.parametrize("name", NO_DW_IN_B_CASES)
def test_b_computes_only_input_gradients_and_cheap_reductions(name: str, defer: str) -> None:
    """What dI runs beyond its input gradients: with ``defer="matmuls"`` only the
    placement's cheap weight reductions and their pointwise/view feeders (never
    a contraction), plus ``getitem``s and size scalars that cross; with
    ``defer="all"`` only the latter."""
    c = zoo.case(name)
    module, inputs = c.make()
    before = fxsplit.compiled_regions()
    forward(c, compile_split(module, defer=defer), clone_inputs(inputs))
    splits = [r.split for r in new_regions(before)]
    assert splits
    for split in splits:
        moved = set(split.placement.reductions) | set(split.placement.feeders)
        for n in _beyond_input_gradients(split):
            if n.target is operator.getitem or is_symbolic_scalar(n):
                continue
            assert n.name in moved, f"dI runs {n.name} ({n.target}) for W, not as a cheap reduction"
            assert not is_contraction(n)
            assert is_reduction(n) if n.name in split.placement.reductions else (is_pointwise(n) or is_view(n))
        if defer == "all":
            assert not moved
    if defer == "matmuls" and name in ("linear", "mlp", "layernorm_linear", "attention"):
        # These have bias (and LayerNorm weight) gradients: the placement must act.
        assert any(s.placement.reductions for s in splits)


@pytest.mark.parametrize("fused", [True, False])
def test_first_stage_b_runs_the_chain_w_the_leaves(fused: bool) -> None:
    """A first stage (MLP d=8 -> h=32 -> d=8, n=4 rows, input needing no grad):
    B runs the chain, fc2's dX matmul, W only the two weight matmuls, with or
    without the fused graph compiled; together ordinary backward's FLOPs."""
    c = zoo.case("first_stage")
    module, inputs = c.make()
    cm = compile_split(module, fused_backward=fused)
    fused_flops, b, w = phase_flops(c, module, cm, inputs)
    one = 2 * 4 * 8 * 32
    assert b == Counts({"aten.mm": one}) and w == Counts({"aten.mm": 2 * one})
    assert b + w == fused_flops
    assert fxsplit.compiled_regions()[-1].split.mode == "first_stage"


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_mlp_flops_by_hand(compiler: str) -> None:
    """MLP d=8 -> h=32 -> d=8 on a batch of n=4: each of the four backward
    matmuls ([n,d]x[d,h]-sized) costs 2*n*d*h FLOPs. B does exactly the two dX
    matmuls, W exactly the two dW matmuls."""
    c = zoo.case("mlp")
    module, inputs = c.make()
    n, d, h = 4, 8, 32
    one = 2 * n * d * h
    fused, b, w = phase_flops(c, module, compile_split(module, compiler), inputs)
    assert fused == Counts({"aten.mm": 4 * one})
    assert b == Counts({"aten.mm": 2 * one})
    assert w == Counts({"aten.mm": 2 * one})
