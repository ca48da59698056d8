"""Shared nodes: one backward op computing gradients for both sides of the split.

Some backward ops return an input gradient and a weight gradient from one
call: ``aten.convolution_backward`` (``(grad_input, grad_weight, grad_bias)``)
or transformers' ``grouped_mm_fallback_backward`` (``(grad_input,
grad_weight)``). dI needs the node for its input gradient, so left whole it
runs in B and does the weight-gradient work there. The split gives dI a
computation of only the outputs dI needs and dW a computation of the rest:

* an op with an ``output_mask`` argument runs twice with complementary masks;
* any other op needs a *split rule*: the caller passes a function
  (:data:`OutputSubset`) that returns, for a node and a subset of its output
  indices, an FX graph computing just those outputs;
* with neither, the node stays whole in dI (correct, but weight work in B)
  and is reported as such in :class:`SharedNode`;
* a rule may also answer :data:`KEEP_WHOLE`: the node stays whole in dI *by
  decision* (``how="kept"``), where splitting it would cost more than its
  weight work (FlexAttention's backward computes a ``score_mod`` buffer's
  gradient in the same kernel as dQ, dK and dV: computing it apart would run
  the attention backward a second time).

Only nodes that compute something are shared nodes. A multi-output view
(``split``, ``chunk``, ``unbind``, ``split_with_sizes``, ``tensor_split``:
the schema says its outputs alias its input, :func:`fxsplit.passes.roles.is_view`)
does no work at all, so B does none of W's work by running it: it stays in dI
and each output dW reads crosses as a tensor, like the output of any dI node
(a min-cut partitioner recomputes such views in the backward, so a forward
``chunk`` whose halves feed an input chain and a weight product puts one
there). Every other multi-output op, memory-bound or not, is real work.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxsplit.passes.roles import is_view

__all__ = [
    "KEEP_WHOLE", "OutputSubset", "SharedNode", "SplitRuleError", "find_shared_nodes", "op_name", "split_shared_node",
]


class _KeepWhole:
    """What a split rule answers for a node that stays whole in dI by decision."""

    def __repr__(self) -> str:
        return "KEEP_WHOLE"


KEEP_WHOLE = _KeepWhole()

OutputSubset = Callable[[fx.Node, frozenset[int]], "fx.GraphModule | None"]
"""``rule(node, outputs)``: an FX graph computing only ``outputs`` (indices into
the tuple ``node`` returns), or ``None`` when no rule applies to ``node``.

The graph's placeholders are ``node.all_input_nodes`` in order; it returns a
tuple of the requested outputs in increasing index order. Its nodes carry
``meta["val"]`` (it was traced on the node's input values). It may also return
:data:`KEEP_WHOLE`: the node stays whole in dI by decision."""


class SplitRuleError(ValueError):
    """A split rule produced outputs that do not match the node it replaces."""


@dataclasses.dataclass(frozen=True)
class SharedNode:
    """A node of the backward graph whose outputs both dI and dW read.

    ``how`` says what the split did with it: ``"output_mask"`` or ``"rule"``
    (dI computes ``di_outputs``, dW computes ``dw_outputs``), ``"unsplit"``
    (no way to split it is known: the whole node runs in dI, so the weight
    work behind ``dw_outputs`` runs in B and those outputs cross as live-ins)
    or ``"kept"`` (the same, by a rule's decision: :data:`KEEP_WHOLE`).
    ``other_strides``: for a rule, the outputs it computes in other strides
    than the node's (the graph after it was traced for the node's; where
    such an output becomes a weight's gradient out of the weight's layout,
    autograd copies it at W).
    """

    name: str
    op: str
    di_outputs: tuple[int, ...]
    dw_outputs: tuple[int, ...]
    how: str
    other_strides: tuple[int, ...] = ()

    def __str__(self) -> str:
        if self.how == "unsplit":
            return (
                f"{self.name} ({self.op}): no split rule; runs whole in dI, so the work for its "
                f"outputs {list(self.dw_outputs)} (read only by dW) runs in B"
            )
        if self.how == "kept":
            return (
                f"{self.name} ({self.op}) kept whole in dI by its rule: its outputs {list(self.dw_outputs)} "
                "come from the kernel that computes the input gradients, and cross to dW"
            )
        strides = f"; outputs {list(self.other_strides)} in other strides than the op's" if self.other_strides else ""
        return (
            f"{self.name} ({self.op}) split by {self.how}: outputs {list(self.di_outputs)} in dI, "
            f"{list(self.dw_outputs)} in dW{strides}"
        )


def op_name(target: Any) -> str:
    """``"namespace::op.overload"`` for an operator overload (``".default"``
    omitted), else the target's name."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        overload = schema.overload_name
        return f"{schema.name}.{overload}" if overload else schema.name
    return getattr(target, "__name__", None) or str(target)


def _getitem_users(node: fx.Node) -> list[fx.Node] | None:
    """The ``getitem(node, i)`` users of ``node``, or ``None`` if something
    else reads the tuple itself."""
    users = list(node.users)
    if any(u.op != "call_function" or u.target is not operator.getitem or not isinstance(u.args[1], int) for u in users):
        return None
    return users


def find_shared_nodes(
    graph: fx.Graph, di_nodes: Collection[fx.Node], dw_needed: Collection[fx.Node]
) -> list[tuple[fx.Node, tuple[int, ...], tuple[int, ...]]]:
    """Multi-output nodes dI runs that also compute outputs only dW reads,
    views left out (they compute nothing: module docs).

    Returns ``(node, di_outputs, dw_outputs)``: the output indices dI reads,
    and those dW reads that dI does not.
    """
    found = []
    for n in graph.nodes:
        if n not in di_nodes or n.op != "call_function" or is_view(n):
            continue
        users = _getitem_users(n)
        if not users:
            continue
        di_idx = sorted({u.args[1] for u in users if u in di_nodes})
        dw_idx = sorted({u.args[1] for u in users if u in dw_needed and u not in di_nodes})
        if di_idx and dw_idx:
            found.append((n, tuple(di_idx), tuple(dw_idx)))
    return found


def split_shared_node(
    graph: fx.Graph,
    node: fx.Node,
    di_outputs: tuple[int, ...],
    dw_outputs: tuple[int, ...],
    rule: OutputSubset | None,
) -> SharedNode:
    """Rewrite ``node`` (in place, in ``graph``) into a dI part and a dW part
    when a split rule or an ``output_mask`` allows it; see :class:`SharedNode`.

    A rule is tried first, then ``output_mask``. Raises :class:`SplitRuleError`
    (before changing ``graph``) if a rule's outputs differ in dtype or shape
    from the node's.
    """
    name = op_name(node.target)
    parts = None
    if rule is not None:
        di_sub = rule(node, frozenset(di_outputs))
        if di_sub is KEEP_WHOLE:
            return SharedNode(node.name, name, di_outputs, dw_outputs, "kept")
        dw_sub = rule(node, frozenset(dw_outputs)) if di_sub is not None else None
        if di_sub is not None and dw_sub is not None:
            parts = ((di_sub, di_outputs), (dw_sub, dw_outputs))
    if parts is not None:
        other = sorted(i for sub, idx in parts for i in _check_rule_outputs(node, name, sub, idx))
        for sub, idx in parts:
            _replace_outputs(node, idx, _inline(graph, node, sub))
        _erase_with_getitems(graph, node)
        return SharedNode(node.name, name, di_outputs, dw_outputs, "rule", tuple(other))
    if _split_by_output_mask(graph, node, di_outputs, dw_outputs):
        return SharedNode(node.name, name, di_outputs, dw_outputs, "output_mask")
    return SharedNode(node.name, name, di_outputs, dw_outputs, "unsplit")


# ---- output_mask ---------------------------------------------------------------


def _mask_position(node: fx.Node) -> int | None:
    """Position of the ``output_mask`` argument in ``node``'s schema, or ``None``."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for k, arg in enumerate(schema.arguments):
        if arg.name == "output_mask":
            return k
    return None


def _split_by_output_mask(
    graph: fx.Graph, node: fx.Node, di_outputs: tuple[int, ...], dw_outputs: tuple[int, ...]
) -> bool:
    pos = _mask_position(node)
    if pos is None:
        return False
    in_args = pos < len(node.args)
    mask = node.args[pos] if in_args else node.kwargs.get("output_mask")
    if not isinstance(mask, (list, tuple)) or not all(isinstance(m, bool) for m in mask):
        return False
    for idx in (di_outputs, dw_outputs):
        part_mask = [bool(m) and i in idx for i, m in enumerate(mask)]
        args, kwargs = list(node.args), dict(node.kwargs)
        if in_args:
            args[pos] = part_mask
        else:
            kwargs["output_mask"] = part_mask
        with graph.inserting_before(node):
            part = graph.call_function(node.target, tuple(args), kwargs)
        part.meta = dict(node.meta)
        for u in list(node.users):
            if u.args[1] in idx:
                u.replace_input_with(node, part)
    _erase_with_getitems(graph, node)
    return True


# ---- split rules ---------------------------------------------------------------


def _rule_outputs(sub: fx.GraphModule) -> list[Any]:
    (ret,) = sub.graph.output_node().args
    return list(ret) if isinstance(ret, (tuple, list)) else [ret]


def _same_size(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def _other_strides(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether ``got`` is known to have other strides than ``want`` (same
    shape) in some dimension of more than one element."""
    return any(
        not statically_known_true(size <= 1) and statically_known_true(g != w)
        for size, g, w in zip(want.shape, got.stride(), want.stride())
    )


def _check_rule_outputs(node: fx.Node, name: str, sub: fx.GraphModule, idx: tuple[int, ...]) -> list[int]:
    """Check the rule's graph ``sub`` for outputs ``idx`` of ``node`` (raises
    :class:`SplitRuleError`, naming the mismatch); the outputs it computes in
    other strides than the node's."""
    outs = _rule_outputs(sub)
    placeholders = sub.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(node.all_input_nodes):
        raise SplitRuleError(
            f"split rule for {name}: its graph takes {len(placeholders)} inputs, the node "
            f"{node.name} has {len(node.all_input_nodes)}"
        )
    if len(outs) != len(idx):
        raise SplitRuleError(
            f"split rule for {name}: asked for outputs {list(idx)} of {node.name}, got {len(outs)} values"
        )
    expected = node.meta.get("val")
    other = []
    for i, o in zip(idx, outs):
        got = o.meta.get("val") if isinstance(o, fx.Node) else o
        want = expected[i] if isinstance(expected, (tuple, list)) else None
        if not isinstance(want, torch.Tensor):
            continue  # nothing to compare against (hand-built graph without values)
        ok = (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.dim() == want.dim()
            and all(_same_size(g, w) for g, w in zip(got.shape, want.shape))
        )
        if not ok:
            desc = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)
            raise SplitRuleError(
                f"split rule for {name}: output {i} of {node.name} should be {want.dtype} "
                f"{tuple(want.shape)}, the rule computed {desc}"
            )
        if _other_strides(got, want):
            other.append(i)
    return other


def _inline(graph: fx.Graph, node: fx.Node, sub: fx.GraphModule) -> list[fx.Node]:
    """Copy ``sub``'s body into ``graph`` just before ``node``, wired to
    ``node``'s inputs; returns the nodes computing its outputs."""
    env: dict[fx.Node, Any] = dict(zip(sub.graph.find_nodes(op="placeholder"), node.all_input_nodes))
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op not in ("placeholder", "output"):
                env[n] = graph.node_copy(n, lambda a: env[a])
    return [env[o] if isinstance(o, fx.Node) else o for o in _rule_outputs(sub)]


def _replace_outputs(node: fx.Node, idx: tuple[int, ...], values: list[Any]) -> None:
    by_index = dict(zip(idx, values))
    for u in list(node.users):
        if u.args[1] in by_index:
            value = by_index[u.args[1]]
            if not isinstance(value, fx.Node):
                raise SplitRuleError(f"split rule for {op_name(node.target)}: output {u.args[1]} is not a tensor")
            u.replace_all_uses_with(value)


def _erase_with_getitems(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and its remaining ``getitem`` users (now unused) from ``graph``."""
    for u in list(node.users):
        if not u.users:
            graph.erase_node(u)
    if not node.users:
        graph.erase_node(node)
