"""A first stage's split: the activation-gradient chain in dI, the weight-gradient leaves in dW.

When no input of a region needs a gradient (the first stage of a pipeline),
its backward graph has only weight-gradient outputs, so splitting by input
gradients leaves dI empty and dW doing the whole backward. Yet the work still
has two parts: the *activation-gradient chain* (the gradient flowing back
through the region, layer by layer, with its dX matmuls) and the
*weight-gradient leaves* hanging off it (a weight's matmul, or a reduction,
whose result reaches a weight gradient through nothing but glue). Run the
chain in dI and only the leaves in dW, as on every other stage: W does the
weight-gradient work only, and the activations only the chain needs are freed
when dI ends.

Classification, by a walk from the outputs back:

* *tail*: glue (pointwise ops, views, reductions, conversions, ``getitem``,
  size arithmetic, constants) whose every reader is an output or tail: the
  reductions only weights need, and the views and adds after the leaves;
* *leaf*: any other op whose every reader is an output or tail: the
  weight-gradient contractions (and other real work, e.g.
  ``embedding_dense_backward``, that only a weight gradient needs);
* *leaf operand*: a view read only by leaves (the transpose of a gradient
  before its weight matmul);
* everything else is the chain. Its nodes read by the weight side form the
  *frontier*: dI computes them, the cut decides what crosses.

A node with outputs on both sides (``convolution_backward`` computing the
input gradient for the chain and the weight gradient for a leaf) is on the
chain; the split then divides it like any shared node.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from fxsplit.passes.roles import is_plumbing, is_view
from fxsplit.passes.symbols import is_symbolic_scalar

__all__ = ["WeightLeaves", "weight_leaves"]


@dataclasses.dataclass(frozen=True)
class WeightLeaves:
    """The weight side of a backward graph with no input-gradient outputs.

    ``leaves`` names the weight-gradient leaves (dW's real work), ``frontier``
    the chain values the weight side reads (what dI computes for dW), both in
    graph order.
    """

    leaves: tuple[str, ...]
    frontier: tuple[str, ...]


def _is_glue(node: fx.Node) -> bool:
    if is_plumbing(node) or is_symbolic_scalar(node):
        return True
    # A constant (full, arange...): reads no tensor.
    return node.op == "call_function" and not any(
        isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes
    )


def weight_leaves(graph: fx.Graph) -> tuple[WeightLeaves, list[fx.Node], set[fx.Node]]:
    """Classify ``graph`` (a backward graph) as described in the module docs.

    Returns the :class:`WeightLeaves`, the frontier nodes (dI's roots, in graph
    order) and the weight side (tail, leaves and leaf operands).
    """
    tail: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    operands: set[fx.Node] = set()
    for n in reversed(graph.nodes):
        if n.op != "call_function" or not n.users or n.is_impure():
            continue
        if all(u.op == "output" or u in tail for u in n.users):
            (tail if _is_glue(n) else leaves).add(n)
        elif is_view(n) and all(u in leaves or u in operands for u in n.users):
            operands.add(n)
    weight_side = tail | leaves | operands
    frontier = [
        n for n in graph.nodes
        if n.op == "call_function" and n not in weight_side and any(u in weight_side for u in n.users)
    ]
    names = WeightLeaves(
        leaves=tuple(n.name for n in graph.nodes if n in leaves),
        frontier=tuple(n.name for n in frontier),
    )
    return names, frontier, weight_side
