"""Placement by cost: which weight-gradient work runs in dI.

Reachability puts in dW every node that only weight gradients need. Not all
of it is worth deferring. The weight side holds two kinds of work:

* *weight-gradient contractions* (``mm``, ``bmm``, the weight output of
  ``convolution_backward``, grouped matmuls: everything FlopCounterMode
  counts). They are the compute W exists to defer, and always stay in dW.
* *cheap weight reductions*: a reduction (``sum``, ``mean``), with the
  pointwise ops and views feeding it that nothing else reads, over tensors dI
  already produces or reads, whose result is small next to its input. Bias
  gradients and LayerNorm/RMSNorm weight gradients are the common ones. In dW
  such a reduction reads its input back from memory; in dI, Inductor fuses it
  into the kernel that produces that input, as TransformerEngine computes bias
  gradients with dgrad. Its small result crosses to dW instead of the input.

With ``defer="matmuls"`` (the default) cheap weight reductions run in dI;
with ``defer="all"`` every weight-gradient node stays in dW (strict
placement: B does no weight-gradient work at all).

"Small" is decided on the graph's sympy sizes, never on example values: the
reduction's output numel mentions no size symbol its input does not, and
either a size symbol of the input is reduced away (the batch or sequence
length of a dynamic graph) or the input is at least 4 times larger (a
constant ratio, as in a static graph), the threshold the min-cut
partitioner uses to call a node a reduction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Set

import sympy
import torch
import torch.fx as fx

from fxsplit.passes.memory import size_expr
from fxsplit.passes.roles import is_contraction, is_pointwise, is_reduction, is_view

__all__ = ["DEFER_MODES", "Placement", "place_weight_work"]

DEFER_MODES = ("matmuls", "all")

# An input at least this many times larger than the reduction's output makes
# the output "small" when no size symbol is reduced away.
_MIN_RATIO = 4


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the weight side's cheap reductions run.

    ``defer`` is the policy (``"matmuls"``: dW defers the weight-gradient
    contractions, dI runs the cheap weight reductions; ``"all"``: dW defers
    every weight-gradient node). ``reductions`` names the reductions moved into
    dI, ``feeders`` the pointwise ops and views moved with them (each read only
    by its group); both empty with ``defer="all"``.
    """

    defer: str = "matmuls"
    reductions: tuple[str, ...] = ()
    feeders: tuple[str, ...] = ()

    def __str__(self) -> str:
        if not self.reductions:
            return f"defer={self.defer}: no weight-gradient work in dI"
        return f"defer={self.defer}: weight reductions in dI: {', '.join(self.reductions)}"


def _numel(val: torch.Tensor) -> sympy.Expr:
    return sympy.Mul(*(size_expr(d) for d in val.shape))


def is_small_result(out_numel: sympy.Expr, in_numel: sympy.Expr) -> bool:
    """Whether a reduction from ``in_numel`` to ``out_numel`` elements yields a
    small result, reasoning only on the sympy expressions (see module docs)."""
    out_syms, in_syms = out_numel.free_symbols, in_numel.free_symbols
    if out_numel.is_zero or in_numel.is_zero:
        return False  # an empty tensor: nothing to gain
    if not out_syms <= in_syms:
        return False
    if out_syms < in_syms:
        return True  # a size symbol (batch, sequence) is summed away
    ratio = sympy.simplify(in_numel / out_numel)
    return bool(ratio.is_number and ratio >= _MIN_RATIO)


def _group(reduction: fx.Node, dw_nodes: Set[fx.Node]) -> list[fx.Node]:
    """``reduction`` and the pointwise ops and views in ``dw_nodes`` that feed it
    and that nothing outside the group reads."""
    group = {reduction}
    order: list[fx.Node] = [reduction]
    frontier = list(reduction.all_input_nodes)
    while frontier:
        n = frontier.pop()
        if n in group or n not in dw_nodes or not (is_pointwise(n) or is_view(n)):
            continue
        if all(u in group for u in n.users):
            group.add(n)
            order.append(n)
            frontier.extend(n.all_input_nodes)
        # else: read elsewhere too; it may still join once its other readers do
    return order


def _reads_only_what_di_has(group: Collection[fx.Node], di_nodes: Set[fx.Node]) -> bool:
    """Every value the group reads from outside is computed by dI or is a
    backward input dI reads, so running the group in dI reads nothing new."""
    members = set(group)
    for n in group:
        for a in n.all_input_nodes:
            if a in members:
                continue
            if a.op == "placeholder":
                if isinstance(a.meta.get("val"), torch.Tensor) and not any(u in di_nodes for u in a.users):
                    return False
            elif a not in di_nodes:
                return False
    return True


def _is_cheap_weight_reduction(node: fx.Node, group: Collection[fx.Node], di_nodes: Set[fx.Node]) -> bool:
    if not is_reduction(node) or any(is_contraction(n) for n in group):
        return False
    out = node.meta.get("val")
    data = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    inp = data.meta.get("val") if data is not None else None
    if not isinstance(out, torch.Tensor) or not isinstance(inp, torch.Tensor):
        return False
    return is_small_result(_numel(out), _numel(inp)) and _reads_only_what_di_has(group, di_nodes)


def place_weight_work(
    graph: fx.Graph, di_nodes: Set[fx.Node], dw_nodes: Set[fx.Node], defer: str = "matmuls"
) -> tuple[Placement, frozenset[fx.Node]]:
    """Which nodes of ``dw_nodes`` (computed only for weight gradients) run in dI.

    ``di_nodes`` are the nodes dI computes. Returns the :class:`Placement` and
    the nodes to move from dW to dI: with ``defer="matmuls"``, every cheap weight
    reduction with its feeders; with ``defer="all"``, none. Raises
    ``ValueError`` for another ``defer``.
    """
    if defer not in DEFER_MODES:
        raise ValueError(f"defer must be one of {DEFER_MODES}, got {defer!r}")
    if defer == "all":
        return Placement(defer=defer), frozenset()
    in_di = set(di_nodes)
    remaining = set(dw_nodes)
    moved: set[fx.Node] = set()
    reductions: list[str] = []
    feeders: list[str] = []
    order = {n: k for k, n in enumerate(graph.nodes)}
    for node in graph.nodes:  # topological: a reduction of a moved result sees it in dI
        if node not in remaining or not is_reduction(node):
            continue
        group = _group(node, remaining)
        if not _is_cheap_weight_reduction(node, group, in_di):
            continue
        in_di.update(group)
        remaining.difference_update(group)
        moved.update(group)
        reductions.append(node.name)
        feeders.extend(n.name for n in sorted(group, key=order.__getitem__) if n is not node)
    return Placement(defer=defer, reductions=tuple(reductions), feeders=tuple(feeders)), frozenset(moved)
