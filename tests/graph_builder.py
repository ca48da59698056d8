"""Hand-built FX backward graphs for the split-pass tests, and the split contract check.

Graphs are written node by node with ATen ops, as AOTAutograd's backward
graphs are: placeholders (saved activations, tangents, SymInts), then the
gradient computation, then one output returning a flat tuple.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, free_symbols
from torch.testing import assert_close

from fxsplit.passes import SplitResult, split_backward

__all__ = [
    "GraphBuilder",
    "check_contract",
    "node_names",
    "placeholder_vals",
    "run",
    "symbolic_mode",
    "unbound_symbols",
]


class GraphBuilder:
    """A thin helper: placeholders carry ``meta["val"]``, nodes get the names we give them.

    With a ``FakeTensorMode`` (and its ``ShapeEnv``), values are fake tensors
    whose sizes may be symbolic, as in AOTAutograd's dynamic-shape graphs.
    """

    def __init__(self, mode: FakeTensorMode | None = None) -> None:
        self.graph = fx.Graph()
        self.mode = mode

    def input(self, name: str, val: Any) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = val
        return node

    def op(self, name: str, target: Any, *args: Any) -> fx.Node:
        node = self.graph.create_node("call_function", target, args, {}, name=name)
        vals = fx.map_arg(args, lambda a: a.meta["val"])
        if self.mode is not None:
            with self.mode:
                node.meta["val"] = target(*vals)
        elif not any(isinstance(v, torch.SymInt) for v in vals):
            node.meta["val"] = target(*vals)  # as AOTAutograd's fake-tensor metadata would be
        return node

    def done(self, *outs: Any) -> fx.GraphModule:
        self.graph.output(tuple(outs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def run(gm: fx.GraphModule, args: list[Any]) -> tuple[Any, ...]:
    return tuple(gm(*args))


def placeholder_vals(gm: fx.GraphModule) -> list[Any]:
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def node_names(gm: fx.GraphModule) -> set[str]:
    return {n.name for n in gm.graph.nodes if n.op == "call_function"}


def check_contract(bw: fx.GraphModule, weight_outputs: list[int], args: list[Any], **kw: Any) -> SplitResult:
    """dI and dW together return exactly what ``bw`` returns (the SplitResult
    contract); ``kw`` goes to :func:`split_backward`. Returns the split."""
    split = split_backward(bw, weight_outputs, **kw)
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
    return split


def symbolic_mode() -> tuple[FakeTensorMode, Callable[[str, int], torch.SymInt]]:
    """A fake mode with a shape environment, and a maker of its size symbols."""
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)

    def size(name: str, hint: int) -> torch.SymInt:
        sym = shape_env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        return shape_env.create_symintnode(sym, hint=hint)

    return mode, size


def unbound_symbols(gm: fx.GraphModule) -> set[sympy.Symbol]:
    """Size symbols a graph's placeholders or nodes mention that no SymInt
    placeholder binds (holds exactly that symbol): what Inductor cannot compile."""
    bound, mentioned = set(), set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if val is None or n.op == "output":
            continue
        if n.op == "placeholder" and isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
            bound.add(val.node.expr)
        mentioned |= set(free_symbols(val))
    return mentioned - bound
