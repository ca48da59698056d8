"""Symbolic sizes across the split: which SymInts a graph must receive.

A graph compiled on its own (the dW graph) must receive, as inputs, a
*binding* for every size symbol its inputs and body mention: a SymInt
input whose expression is exactly that symbol. A tensor of size ``s0*s1``
does not bind ``s0`` or ``s1``; Inductor then fails with "For 2*s27,
expected [s27] to have been codegen-ed". AOTAutograd's partitioner gives the
backward graph these bindings (placeholders whose value is a plain symbol);
the split hands the ones dW needs on to dW, reasoning on the sympy
expressions (``free_symbols``), never on printed names or example sizes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols

__all__ = ["bound_symbol", "is_symbolic_scalar", "missing_bindings", "symbols_of"]

_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_symbolic_scalar(node: fx.Node) -> bool:
    """Whether ``node`` computes a size-like scalar (SymInt/SymFloat/SymBool or
    a plain Python number), as opposed to a tensor or a tuple."""
    val = node.meta.get("val")
    return isinstance(val, (*_SYM_TYPES, int, float, bool))


def symbols_of(node: fx.Node) -> set[sympy.Symbol]:
    """Free size symbols of ``node``'s value: of a SymInt's expression, or of a
    tensor's sizes, strides and storage offset (through tuples too)."""
    val = node.meta.get("val")
    if val is None:
        return set()
    try:
        return set(free_symbols(val))
    except (TypeError, AssertionError):
        return set()  # an opaque value (script object, token): no sizes


def bound_symbol(node: fx.Node) -> sympy.Symbol | None:
    """The symbol ``node`` binds when it is an input of a graph: its value is a
    SymInt whose expression is a single symbol."""
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt):
        expr = val.node.expr
        if isinstance(expr, sympy.Symbol):
            return expr
    return None


def _binders(graph: fx.Graph) -> dict[sympy.Symbol, fx.Node]:
    """For each symbol, the first node of ``graph`` that binds it: a SymInt
    placeholder of a plain symbol, or the node that creates an unbacked
    symbol (``.item()``, ``nonzero`` sizes...)."""
    found: dict[sympy.Symbol, fx.Node] = {}
    for n in graph.nodes:
        sym = bound_symbol(n)
        if sym is not None and (n.op == "placeholder" or free_unbacked_symbols(sym)):
            found.setdefault(sym, n)
    return found


def missing_bindings(
    graph: fx.Graph,
    inputs: Collection[fx.Node],
    body: Iterable[fx.Node],
) -> list[fx.Node]:
    """Nodes of ``graph`` a sub-graph must also take as inputs so that every
    size symbol it mentions is bound.

    The sub-graph takes ``inputs`` (nodes of ``graph``) as placeholders and
    computes ``body``. A symbol is bound if one of ``inputs`` is a SymInt of
    exactly that symbol, or if a ``body`` node creates it (an unbacked symbol).
    For every other symbol of an input's or body node's value, the node of
    ``graph`` that binds it (a SymInt placeholder, as AOTAutograd's partitioner
    provides for the backward) is returned, in graph order. A symbol nothing in
    ``graph`` binds is left alone: Inductor can still bind a symbol that is a
    whole dimension of a tensor input.
    """
    body = list(body)
    in_body = set(body)
    bound = {s for s in map(bound_symbol, inputs) if s is not None}
    needed: set[sympy.Symbol] = set()
    for n in (*inputs, *body):
        needed |= symbols_of(n)
    binders = _binders(graph)
    extra = {
        binders[s]
        for s in needed - bound
        if s in binders and binders[s] not in in_body and binders[s] not in inputs
    }
    order = {n: k for k, n in enumerate(graph.nodes)}
    return sorted(extra, key=order.__getitem__)

