"""The eager split: B/W over ordinary autograd nodes (the reverse-closure idea of
``torch.distributed.pipelining._backward``), aware of fxsplit-compiled regions.

Terms used below, for one stage:

* *B set*: autograd nodes the input-gradient pass executes, i.e. the nodes
  from which a stage input's gradient node is reachable.
* *W side*: nodes outside the B set from which a weight is reachable.
* *intermediates*: B-set nodes with an edge into the W side. B saves the
  gradients flowing into them; W re-runs them (autograd computes only the
  outputs W needs) and everything on the W side.
* *W roots*: stage-output nodes already on the W side (e.g. every output of a
  first stage, whose inputs need no gradient). W starts there with the
  output gradients.

fxsplit-compiled regions in the B set run their dI graph in B and record
their own dW work, so the edges from such a region to its parameters are
not followed here.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from fxsplit import _torch_internals as ti
from fxsplit.runtime import CompiledSplitBackward

__all__ = ["EagerWeightPlan", "gradient_edge", "plan_eager_weight_work"]


def gradient_edge(t: torch.Tensor | GradientEdge) -> GradientEdge:
    """The autograd edge a tensor's gradient flows into (grad_fn, or the grad
    accumulator of a leaf)."""
    if isinstance(t, GradientEdge):
        return t
    return torch.autograd.graph.get_gradient_edge(t)


def is_split_region(node: Node) -> bool:
    return isinstance(ti.compiled_backward_of(node), CompiledSplitBackward)


def _reverse_edges(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """child -> parents (nodes whose backward feeds the child), for the graph below ``roots``."""
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    seen: set[Node] = set()
    queue = collections.deque(r for r in roots if r is not None)
    seen.update(queue)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _upward_closure(starts: Iterable[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    closure: set[Node] = set()
    queue = collections.deque(s for s in starts if s is not None)
    while queue:
        node = queue.popleft()
        if node in closure:
            continue
        closure.add(node)
        queue.extend(parents.get(node, ()))
    return closure


@dataclasses.dataclass
class EagerWeightPlan:
    """What W must do by running autograd (the non-compiled part of W)."""

    intermediates: list[Node]
    w_roots: list[int]  # indices into the stage's output edges
    eager_weights: list[torch.Tensor]

    @property
    def empty(self) -> bool:
        return not self.eager_weights


def plan_eager_weight_work(
    output_edges: Sequence[GradientEdge],
    input_nodes: Sequence[Node],
    weights: Sequence[torch.Tensor],
) -> EagerWeightPlan:
    """Find the intermediates and W roots that W needs for weights with an eager path."""
    roots = [e.node for e in output_edges]
    parents = _reverse_edges(roots)
    b_set = _upward_closure(input_nodes, parents)
    root_index: dict[Node, list[int]] = collections.defaultdict(list)
    for k, node in enumerate(roots):
        root_index[node].append(k)

    intermediates: dict[Node, None] = {}
    w_roots: dict[int, None] = {}
    eager_weights: list[torch.Tensor] = []
    for w in weights:
        if not (isinstance(w, torch.Tensor) and w.requires_grad):
            continue
        w_node = gradient_edge(w).node
        skip_split_regions = isinstance(w, torch.nn.Parameter)
        found = False
        seen = {w_node}
        queue = collections.deque([w_node])
        while queue:
            node = queue.popleft()
            for k in root_index.get(node, ()):
                w_roots[k] = None
                found = True
            for p in parents.get(node, ()):
                if p in b_set:
                    if node is w_node and skip_split_regions and is_split_region(p):
                        continue  # that region's dW graph computes this gradient
                    intermediates[p] = None
                    found = True
                elif p not in seen:
                    seen.add(p)
                    queue.append(p)
        if found:
            eager_weights.append(w)
    return EagerWeightPlan(list(intermediates), list(w_roots), eager_weights)
