"""Bytes held across the split, as sympy expressions in the graph's size symbols.

What W holds for a microbatch is the storage of its tensor live-ins. Sizes
are symbolic (a ``[s0*s1, 768]`` float32 tensor holds ``3072*s0*s1`` bytes),
so the bytes are an expression, evaluated for a microbatch once its sizes are
known (:func:`evaluate_bytes`, with bindings read off the live-in values by
:func:`bindings_from_values`).

How aliases are counted: a view holds its base's storage, so a set of values
is counted by *storage roots*: each value is followed back through view ops
(``OpOverload.is_view``) to the first value that is not a view, and each
distinct root is counted once, at its own ``numel * itemsize``. Backward
inputs (saved activations, tangents) are roots: the graph cannot say whether
two of them share a storage, so each is counted (an upper bound). SymInts and
opaque values hold no bytes here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx

from fxsplit.passes.roles import is_view

__all__ = [
    "bindings_from_values",
    "evaluate_bytes",
    "held_bytes",
    "provably_at_most",
    "size_expr",
    "size_lower_bounds",
    "storage_root",
    "value_bytes",
]


def size_expr(size: Any) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression."""
    if isinstance(size, torch.SymInt):
        return sympy.sympify(size.node.expr)
    return sympy.Integer(int(size))


def value_bytes(node: fx.Node) -> sympy.Expr:
    """Bytes of ``node``'s value: ``numel * itemsize`` for a tensor (summed over
    a tuple of tensors), 0 for anything else or a node without ``meta["val"]``."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    total: sympy.Expr = sympy.Integer(0)
    for v in vals:
        if isinstance(v, torch.Tensor):
            total += sympy.Mul(*(size_expr(d) for d in v.shape)) * v.dtype.itemsize
    return total


def storage_root(node: fx.Node) -> fx.Node:
    """The value whose storage ``node`` uses: ``node`` itself, or, for a view,
    the first non-view value its chain of view ops starts from."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def held_bytes(nodes: Iterable[fx.Node]) -> sympy.Expr:
    """Bytes that keeping ``nodes`` alive holds: each distinct storage root once."""
    roots = {storage_root(n): None for n in nodes}
    return sympy.Add(*(value_bytes(r) for r in roots)) if roots else sympy.Integer(0)


def evaluate_bytes(expr: sympy.Expr, bindings: Mapping[sympy.Symbol, int]) -> int:
    """``expr`` at the sizes ``bindings`` gives. Raises ``ValueError`` naming the
    symbols ``bindings`` leaves unbound."""
    expr = sympy.sympify(expr)
    missing = expr.free_symbols - set(bindings)
    if missing:
        raise ValueError(
            f"cannot evaluate {expr}: no value for {sorted(map(str, missing))} "
            f"(given: {sorted(map(str, bindings))})"
        )
    value = expr.subs({s: sympy.Integer(int(v)) for s, v in bindings.items()})
    if not value.is_number:
        raise ValueError(f"{expr} did not evaluate to a number at {dict(bindings)}: {value}")
    return int(value)


def bindings_from_values(placeholder_vals: Sequence[Any], values: Sequence[Any]) -> dict[sympy.Symbol, int]:
    """Values of the size symbols, read off actual ``values`` of a graph whose
    placeholders were traced as ``placeholder_vals``: a SymInt placeholder that
    is a plain symbol gives that symbol its value, and each tensor dimension
    traced as a plain symbol gives it the actual size."""
    found: dict[sympy.Symbol, int] = {}

    def bind(traced: Any, actual: Any) -> None:
        if isinstance(traced, torch.SymInt) and isinstance(traced.node.expr, sympy.Symbol):
            found.setdefault(traced.node.expr, int(actual))

    if len(placeholder_vals) != len(values):
        raise ValueError(f"expected {len(placeholder_vals)} values, got {len(values)}")
    for traced, actual in zip(placeholder_vals, values):
        if isinstance(traced, torch.Tensor) and isinstance(actual, torch.Tensor):
            for t, a in zip(traced.shape, actual.shape):
                bind(t, a)
        elif isinstance(traced, torch.SymInt) and isinstance(actual, (int, torch.SymInt)):
            bind(traced, actual)
    return found


def size_lower_bounds(nodes: Iterable[fx.Node]) -> dict[sympy.Symbol, int]:
    """The smallest value each size symbol of ``nodes``' values may take, as the
    shape environment records it (Dynamo's dynamic sizes are at least 2: 0 and
    1 are specialized). A symbol without a known positive bound gets 0."""
    bounds: dict[sympy.Symbol, int] = {}
    for n in nodes:
        val = n.meta.get("val")
        sizes = list(val.shape) if isinstance(val, torch.Tensor) else [val]
        for size in sizes:
            if not isinstance(size, torch.SymInt):
                continue
            ranges = getattr(size.node.shape_env, "var_to_range", {})
            for sym in sympy.sympify(size.node.expr).free_symbols:
                vr = ranges.get(sym)
                lower = vr.lower if vr is not None else None
                bounds[sym] = int(lower) if lower is not None and lower.is_finite and lower > 0 else 0
    return bounds


def provably_at_most(
    small: sympy.Expr, large: sympy.Expr, lower_bounds: Mapping[sympy.Symbol, int] | None = None
) -> bool:
    """Whether ``small <= large`` for every value of the size symbols at or above
    their ``lower_bounds`` (0 when absent): with each symbol shifted by its bound,
    ``large - small``, expanded, is a polynomial with no negative coefficient.
    ``False`` when that cannot be shown (e.g. floor divisions)."""
    diff = sympy.sympify(large) - sympy.sympify(small)
    shift = {sym: sym + lb for sym, lb in (lower_bounds or {}).items() if lb and sym in diff.free_symbols}
    diff = sympy.expand(diff.xreplace(shift) if shift else diff)
    if diff.is_number:
        return bool(diff >= 0)
    symbols = sorted(diff.free_symbols, key=str)
    try:
        poly = sympy.Poly(diff, *symbols)
    except sympy.PolynomialError:
        return False
    return all(c.is_number and c >= 0 for c in poly.coeffs())
