"""The cut: which values cross from dI to dW, chosen to hold the fewest bytes.

dW needs some values dI has (backward inputs and nodes dI computes). The
*all-crossing* cut hands over every one of them. Often a cheaper one exists:
an upcast ``convert_element_type`` can be recomputed in dW from the narrow
value, two outputs of a pointwise chain from its one input, a view from its
base. This is the problem the min-cut partitioner
(``torch/_functorch/partitioners.py``) solves between forward and backward,
restricted to what costs W no matmul work: only recomputable nodes
(:func:`fxsplit.passes.roles.is_recomputable`: pointwise ops, views, dtype
conversions) may be computed again in dW.

Flow network (as the partitioner builds it): each candidate value ``v`` is an
edge ``v_in -> v_out`` whose capacity is the bytes ``v`` holds; data
dependencies are infinite edges ``u_out -> v_in``; a value dI has but dW
cannot recompute is tied to the source (``source -> v_in``), a value dW
needs is tied to the sink (``v_out -> sink``). A minimum cut crosses the
values whose edge it cuts, and dW recomputes the values on the sink side.
A view holds its base's storage, so its capacity is its base's bytes:
crossing a view or its base costs the same, while crossing two views of one
base costs more than crossing the base once (dW then recomputes the views,
for free). Of all minimum cuts, the one recomputing the fewest nodes is
taken.

Capacities must be numbers while sizes are sympy expressions. They are
compared with every size symbol set to :data:`LARGE_SIZE` (but a size that
divides, which is bounded), so a value that
grows with the batch or sequence outweighs any fixed-size one, regardless of
the sizes the graph was traced with; the cut found is then checked
symbolically (:func:`fxsplit.passes.memory.provably_at_most`) and kept only if
it holds no more bytes than the all-crossing cut for every size the shape
environment allows (Dynamo's dynamic sizes are at least 2), else the
all-crossing cut is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov
import sympy
import torch.fx as fx

from fxsplit.passes.memory import held_bytes, provably_at_most, size_lower_bounds, storage_root, value_bytes
from fxsplit.passes.roles import is_recomputable

__all__ = ["LARGE_SIZE", "Cut", "choose_cut"]

LARGE_SIZE = 2**20
"""The value every size symbol takes when capacities are compared."""


@dataclasses.dataclass(frozen=True)
class Cut:
    """The values that cross and what dW recomputes instead of receiving.

    ``recomputed`` names the dI nodes dW computes again from the live-ins (in
    graph order). ``held_bytes_expr`` is the bytes the chosen live-ins hold,
    ``all_crossing_bytes_expr`` what handing over every value dW reads that dI
    has would hold (see :mod:`fxsplit.passes.memory` for how aliases count);
    the first is never larger than the second, for any size the shape
    environment allows.
    """

    recomputed: tuple[str, ...] = ()
    held_bytes_expr: sympy.Expr = sympy.Integer(0)
    all_crossing_bytes_expr: sympy.Expr = sympy.Integer(0)

    @property
    def saves_bytes(self) -> bool:
        """Whether the chosen cut holds fewer bytes than the all-crossing one (for some size)."""
        return sympy.expand(self.all_crossing_bytes_expr - self.held_bytes_expr) != 0


def _capacity(node: fx.Node) -> int:
    """Bytes holding ``node`` keeps alive (its storage), with every size symbol at
    LARGE_SIZE but those that divide (:func:`_divisors`), which are at 2, the
    least size Dynamo leaves symbolic: a size that divides a constant (a
    dimension of 16 split as ``(16 // s, s)``) is bounded by it, so it is no
    batch or sequence size, and at LARGE_SIZE the quotient would be 0, or a
    division by it. An integer: max-flow on floats may leave a saturated edge
    looking unsaturated."""
    expr = value_bytes(storage_root(node))
    small = _divisors(expr)
    try:
        return int(expr.subs({s: 2 if s in small else LARGE_SIZE for s in expr.free_symbols}))
    except (ArithmeticError, TypeError):  # (undefined there too: counted as large; the cut found is checked anyway)
        return LARGE_SIZE**2


# The sympy functions of torch's size expressions whose arguments after the first divide
# (ModularIndexing(base, divisor, modulus): both).
_DIVIDING = frozenset({"FloorDiv", "CleanDiv", "CeilDiv", "Mod", "PythonMod", "ModularIndexing", "IntTrueDiv"})


def _divisors(expr: sympy.Expr) -> set[sympy.Symbol]:
    """The size symbols ``expr`` divides by (in a divisor of a floor division or modulo)."""
    return {s for f in expr.atoms(sympy.Function) if type(f).__name__ in _DIVIDING for a in f.args[1:]
            for s in a.free_symbols}


def _smallest_sink_side(flow: nx.DiGraph) -> set[Any]:
    """Of all minimum source/sink cuts of ``flow``, the sink side with the
    fewest nodes: the nodes that can still reach the sink in the residual
    network of a maximum flow. (Edges without a capacity are infinite.)"""
    residual = boykov_kolmogorov(flow, "source", "sink")
    can_reach = {"sink"}
    stack = ["sink"]
    while stack:
        v = stack.pop()
        for u in residual.predecessors(v):
            attrs = residual[u][v]
            if u not in can_reach and attrs["flow"] < attrs["capacity"]:
                can_reach.add(u)
                stack.append(u)
    return can_reach


def _candidates(needed: Sequence[fx.Node], available: Collection[fx.Node]) -> list[fx.Node]:
    """The values a cut may cross: ``needed`` and, behind every recomputable
    one, its inputs (transitively). A value that is not recomputable ends the walk."""
    seen: dict[fx.Node, None] = {}
    stack = list(needed)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen[n] = None
        if n.op != "placeholder" and is_recomputable(n):
            stack.extend(a for a in n.all_input_nodes if a in available)
    return list(seen)


def choose_cut(
    graph: fx.Graph, available: Collection[fx.Node], needed: Collection[fx.Node]
) -> tuple[Cut, list[fx.Node], list[fx.Node]]:
    """The cheapest way to give dW the values ``needed``.

    ``available`` are the values dI has (backward inputs and dI's nodes);
    ``needed`` (a subset) are the values dW reads or returns that dI has: the
    all-crossing cut. Returns the :class:`Cut`, the nodes that cross and the
    nodes dW recomputes, both in graph order.
    """
    order = {n: k for k, n in enumerate(graph.nodes)}
    needed_sorted = sorted(needed, key=order.__getitem__)
    all_bytes = held_bytes(needed_sorted)
    all_crossing = (Cut(held_bytes_expr=all_bytes, all_crossing_bytes_expr=all_bytes), needed_sorted, [])
    if not needed_sorted:
        return all_crossing

    available = set(available)
    candidates = _candidates(needed_sorted, available)
    in_region = set(candidates)
    flow = nx.DiGraph()  # edges without a capacity are infinite
    for v in candidates:
        flow.add_edge(("in", v), ("out", v), capacity=_capacity(v))
        if v.op == "placeholder" or not is_recomputable(v) or not all(a in in_region for a in v.all_input_nodes):
            flow.add_edge("source", ("in", v))
        for a in v.all_input_nodes:
            if a in in_region:
                flow.add_edge(("out", a), ("in", v))
    for v in needed_sorted:
        flow.add_edge(("out", v), "sink")

    try:
        sink_side = _smallest_sink_side(flow)
    except nx.NetworkXUnbounded:  # cannot happen with finite node capacities; stay safe
        return all_crossing
    crossing = [v for v in candidates if ("out", v) in sink_side and ("in", v) not in sink_side]
    recomputed = [v for v in candidates if ("in", v) in sink_side]
    crossing.sort(key=order.__getitem__)
    recomputed.sort(key=order.__getitem__)

    chosen = held_bytes(crossing)
    if not provably_at_most(chosen, all_bytes, size_lower_bounds([*needed_sorted, *crossing])):
        return all_crossing
    cut = Cut(
        recomputed=tuple(n.name for n in recomputed),
        held_bytes_expr=chosen,
        all_crossing_bytes_expr=all_bytes,
    )
    return cut, crossing, recomputed
