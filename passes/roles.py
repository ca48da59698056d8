"""The role an operator plays in the split: contraction, reduction, recomputable.

The placement, the cut and the first-stage split all ask the same questions
of a node: is it matmul-like work (it always belongs to W), a memory-bound
reduction (it may run beside the dI kernel that produces its input), or cheap
enough to compute twice (W may recompute it from a smaller live-in)? The
answers come from torch's own classification wherever it has one: operator
tags (``Tag.pointwise``, ``Tag.reduction``, ``Tag.nondeterministic_seeded``),
the schema's aliasing (``OpOverload.is_view``) and FlopCounterMode's formula
registry, whose ops are exactly the ones that count as compute. An operator
torch says nothing about is treated as heavy: never recomputed, never moved.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

__all__ = [
    "is_contraction",
    "is_plumbing",
    "is_pointwise",
    "is_recomputable",
    "is_reduction",
    "is_view",
]

aten = torch.ops.aten

# Matmul-like ops FlopCounterMode has no formula for on every supported torch
# release (``_grouped_mm``) or that may be registered after this module is
# imported (fxsplit's grouped-mm gradient ops register theirs on import of
# fxsplit.rules). Keyed by ``"ns::name"``.
_CONTRACTION_NAMES = frozenset(
    {
        "aten::mm",
        "aten::bmm",
        "aten::addmm",
        "aten::baddbmm",
        "aten::convolution_backward",
        "aten::_grouped_mm",
        "fxsplit::grouped_mm_input_grad",
        "fxsplit::grouped_mm_weight_grad",
    }
)

# A dtype conversion spelled as a copy (before decompositions turn it into
# prims.convert_element_type, which is tagged pointwise).
_CONVERSIONS = frozenset({aten._to_copy.default})


def _overload(node: fx.Node) -> Any:
    """``node``'s operator overload (it has a schema and tags), or ``None``."""
    target = node.target
    if node.op == "call_function" and hasattr(target, "_schema") and hasattr(target, "tags"):
        return target
    return None


def _has_tag(node: fx.Node, tag: torch.Tag) -> bool:
    op = _overload(node)
    return op is not None and tag in op.tags


def is_contraction(node: fx.Node) -> bool:
    """Matmul-like work: mm/bmm/addmm/baddbmm, convolution_backward, grouped
    matmuls, and every op FlopCounterMode has a FLOP formula for."""
    if node.op != "call_function":
        return False
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if target in flop_registry or (packet is not None and packet in flop_registry):
        return True
    schema = getattr(target, "_schema", None)
    return schema is not None and schema.name in _CONTRACTION_NAMES


def is_reduction(node: fx.Node) -> bool:
    """A reduction ATen tags as one (``sum``, ``mean``, ``amax``...)."""
    return _has_tag(node, torch.Tag.reduction) and not is_contraction(node)


def is_pointwise(node: fx.Node) -> bool:
    """An elementwise op without randomness (ATen's ``pointwise`` tag)."""
    return (
        _has_tag(node, torch.Tag.pointwise)
        and not _has_tag(node, torch.Tag.nondeterministic_seeded)
        and not is_contraction(node)
    )


def is_view(node: fx.Node) -> bool:
    """An op whose output aliases its first input (the schema says so)."""
    op = _overload(node)
    return op is not None and bool(getattr(op, "is_view", False))


def is_recomputable(node: fx.Node) -> bool:
    """Whether dW may compute ``node`` again instead of receiving it: a
    pointwise op, a view or a dtype conversion producing a tensor, with no
    randomness, no mutation, no side effect and no counted FLOPs. Recomputing
    it adds memory traffic to W, never matmul work."""
    op = _overload(node)
    if op is None or node.is_impure() or op._schema.is_mutable:
        return False
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    return is_pointwise(node) or is_view(node) or op in _CONVERSIONS


def is_plumbing(node: fx.Node) -> bool:
    """Memory-bound glue between a gradient computation and a graph output:
    pointwise ops, views, reductions, conversions, and ``getitem`` of a
    multi-output node. Everything else (contractions, and ops torch does not
    classify) is real work."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if is_contraction(node) or _has_tag(node, torch.Tag.nondeterministic_seeded):
        return False
    return is_pointwise(node) or is_view(node) or is_reduction(node) or _overload(node) in _CONVERSIONS
