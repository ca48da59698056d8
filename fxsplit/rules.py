"""Split rules: how to compute only some outputs of a multi-output backward op.

A backward op that returns an input gradient and a weight gradient from one
call (``transformers::grouped_mm_fallback_backward(input, weight, offs,
grad_output) -> (grad_input, grad_weight)``) would run whole in dI, doing the
weight-gradient work in B. A split rule tells fxsplit how to compute a subset
of the op's outputs, so dI computes only the input gradient and dW only the
weight gradient::

    def rule(outputs, input, weight, offs, grad_output):
        grad_input = my_input_grad(grad_output, weight, offs) if 0 in outputs else None
        grad_weight = my_weight_grad(input, grad_output, offs) if 1 in outputs else None
        return grad_input, grad_weight

    fxsplit.register_split_rule("mylib::grouped_mm_backward", rule)

``rule(outputs, *args, **kwargs)`` gets the op's arguments and the frozenset of
output indices wanted, and returns one entry per output of the op: a tensor
for each wanted index, anything (``None``) for the others. It is traced with
the op's traced arguments (fake tensors, symbolic sizes) into the backward
graph, once for dI and once for dW, so it must be written in torch operations
(ATen or custom ops with a fake implementation). Returning ``NotImplemented``
declines: the op then runs whole in dI, reported as weight work in B. A rule
whose outputs differ in dtype or shape from the op's fails the region's
compile with a message naming the rule. Give them the op's strides too (its
fake implementation's): the rest of the graph was traced for those. Other
strides are correct but may cost a copy, e.g. a weight gradient that ends up
in another layout than its weight's, which W hands to autograd to copy
where ``.grad`` is empty; a warning says so once per op, and the split's
``shared`` entry lists those outputs (``other_strides``).

Ops with an ``output_mask`` argument (``convolution_backward`` and friends)
need no rule: the split runs them twice with complementary masks. A rule
registered for such an op takes precedence.

Rules are keyed by operator name, so a rule can be registered for an op that
does not exist yet (or never will, when the library that defines it is not
installed); it applies only when the op appears in a backward graph. Higher-order
operators are named ``"higher_order::name"`` (``torch.ops.higher_order.name``).

Some ops are better left whole: :data:`KEEP_IN_DI` as the rule says so
(``register_split_rule(op, KEEP_IN_DI)``). The op runs whole in dI, its
weight gradients cross to W as live-ins, and nothing is logged above DEBUG
(``describe()`` lists it as kept). fxsplit ships one such decision:
FlexAttention's backward (``higher_order::flex_attention_backward``) computes
the gradients of the buffers its ``score_mod`` / ``mask_mod`` read (a learned
bias) in the kernel that computes dQ, dK and dV, from the same recomputed
attention probabilities; computing them in W would run that backward again.
Kept in dI, they cost B nothing but their accumulation, and no FLOP is done
twice (docs/how-the-split-works.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch._prims_common
import torch.fx as fx
from torch.utils.flop_counter import register_flop_formula

from fxsplit import _torch_internals as ti
from fxsplit.passes.shared import KEEP_WHOLE, op_name

__all__ = [
    "KEEP_IN_DI",
    "SplitRule",
    "grouped_mm_backward_rule",
    "register_split_rule",
    "split_rules",
    "trace_split_rule",
    "unregister_split_rule",
]

SplitRule = Callable[..., Any]
"""``rule(outputs: frozenset[int], *args, **kwargs) -> sequence`` (one entry per
op output), or ``NotImplemented`` to decline."""

KEEP_IN_DI: Any = KEEP_WHOLE
"""The rule that keeps an op whole in dI by decision (see the module docs)."""

_RULES: dict[str, SplitRule] = {}
_LOCK = threading.Lock()


def _key(op: Any) -> str:
    """``"ns::name"`` (every overload) or ``"ns::name.overload"`` (one overload)."""
    if isinstance(op, str):
        if "::" not in op:
            raise ValueError(f"fxsplit: a split rule's op name must be 'namespace::name[.overload]', got {op!r}")
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    if isinstance(op, torch._ops.OpOverload):
        return op_name(op)
    if isinstance(op, torch._ops.HigherOrderOperator):
        return f"higher_order::{op.name()}"
    raise TypeError(
        f"fxsplit: register_split_rule needs an operator (torch.ops.ns.name[.overload]) or its "
        f"name 'ns::name[.overload]', got {type(op).__name__}"
    )


def register_split_rule(op: Any, rule: SplitRule | None = None) -> Any:
    """Declare how to compute only some outputs of ``op`` (see the module docs).

    ``op`` is an operator (``torch.ops.ns.name`` for every overload,
    ``torch.ops.ns.name.overload`` for one) or its name
    (``"ns::name[.overload]"``). A rule for one overload wins over a rule for
    all. Registering again replaces the rule. Usable as a decorator
    (``@fxsplit.register_split_rule(op)``). Applies to regions compiled after
    the call.
    """
    key = _key(op)
    if rule is None:
        return lambda fn: register_split_rule(op, fn)
    if not callable(rule) and rule is not KEEP_IN_DI:
        raise TypeError(f"fxsplit: a split rule must be callable or fxsplit.KEEP_IN_DI, got {type(rule).__name__}")
    with _LOCK:
        _RULES[key] = rule
    return rule


def unregister_split_rule(op: Any) -> None:
    """Remove the rule registered for exactly ``op`` (a no-op when there is none)."""
    with _LOCK:
        _RULES.pop(_key(op), None)


def split_rules() -> dict[str, SplitRule]:
    """The registered rules, by operator name (a copy)."""
    with _LOCK:
        return dict(_RULES)


def _rule_for(target: Any) -> SplitRule | None:
    if isinstance(target, torch._ops.HigherOrderOperator):
        with _LOCK:
            return _RULES.get(f"higher_order::{target.name()}")
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None
    with _LOCK:
        return _RULES.get(op_name(target)) or _RULES.get(schema.name)


class _Declined(Exception):
    """Raised out of tracing when a rule returns ``NotImplemented``."""


def trace_split_rule(node: fx.Node, outputs: frozenset[int]) -> fx.GraphModule | None:
    """The graph computing ``outputs`` of ``node`` by its registered rule, or
    ``None`` when no rule is registered or the rule declines.

    This is the ``rule`` argument :func:`fxsplit.passes.split_backward` takes
    (:data:`fxsplit.passes.shared.OutputSubset`): placeholders are
    ``node.all_input_nodes``, outputs the requested ones in index order.
    """
    rule = _rule_for(node.target)
    if rule is None:
        return None
    if rule is KEEP_IN_DI:
        return KEEP_WHOLE  # type: ignore[return-value]
    inputs = list(node.all_input_nodes)
    num_returns = len(node.target._schema.returns)
    wanted = sorted(outputs)

    def only_outputs(*values: Any) -> tuple[Any, ...]:
        env = dict(zip(inputs, values))
        args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
        result = rule(outputs, *args, **kwargs)
        if result is NotImplemented:
            raise _Declined
        if not isinstance(result, (tuple, list)) or len(result) != num_returns:
            raise TypeError(
                f"fxsplit: the split rule for {op_name(node.target)} must return {num_returns} values "
                f"(one per output of the op), got {type(result).__name__}"
                + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
            )
        for i in wanted:
            if not isinstance(result[i], torch.Tensor):
                raise TypeError(
                    f"fxsplit: the split rule for {op_name(node.target)} returned "
                    f"{type(result[i]).__name__} for output {i}, which was asked for"
                )
        return tuple(result[i] for i in wanted)

    try:
        return ti.trace_on_values(only_outputs, [n.meta["val"] for n in inputs])
    except _Declined:
        return None


# ---- rules shipped with fxsplit ---------------------------------------------------
#
# transformers' MoE experts on CPU (and wherever torch's grouped_mm cannot be
# used) run ``transformers::grouped_mm_fallback(input, weight, offs)``, whose
# backward is one custom op returning (grad_input, grad_weight). Its rule uses
# two ops of fxsplit's own, each computing one of the two gradients exactly as
# that backward does (the same matmul per group of rows, into the same layout:
# the weight gradient laid out like the weight it is given, which is the
# transpose of transformers' stored experts, so that transposed back it has
# their layout and W keeps it as the new .grad with no copy),
# so the split gradients equal the unsplit ones bit for bit, and each has a
# FlopCounterMode formula (2 * rows * in * out: the matmul work of one
# gradient). Nothing here imports transformers: the rule applies only when the
# op is in a backward graph.


def _grouped_mm_input_grad(grad_output: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grad_input[rows of g] = grad_output[rows of g] @ weight[g].T`` for the
    row groups ending at ``offs`` (``weight``: ``(groups, in, out)``); rows past
    the last offset are zero."""
    grad_input = grad_output.new_zeros(grad_output.size(0), weight.size(1))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(grad_output[start:end], weight[g].T, out=grad_input[start:end])
        start = end
    return grad_input


def _grouped_mm_weight_grad(
    input: torch.Tensor, grad_output: torch.Tensor, offs: torch.Tensor, strides: list[int] | None = None
) -> torch.Tensor:
    """``grad_weight[g] = input[rows of g].T @ grad_output[rows of g]`` for the
    row groups ending at ``offs``; groups without rows get zeros. ``strides``:
    the gradient's (the weight's, as ``torch.zeros_like(weight)`` lays it out),
    else contiguous."""
    sizes = (offs.size(0), input.size(1), grad_output.size(1))
    grad_weight = input.new_zeros(sizes) if strides is None else input.new_empty_strided(sizes, strides).zero_()
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(input[start:end].T, grad_output[start:end], out=grad_weight[g])
        start = end
    return grad_weight


def _strides_like(weight: torch.Tensor) -> list[int] | None:
    """The strides ``torch.zeros_like(weight)`` gives: the weight's own where it
    is non-overlapping and dense (static), else ``None`` (contiguous)."""
    strides = weight.stride()
    if all(type(s) is int for s in strides) and torch._prims_common.is_non_overlapping_and_dense_or_false(weight):
        return list(strides)
    return None


def _grouped_mm_weight_grad_meta(
    input: torch.Tensor, grad_output: torch.Tensor, offs: torch.Tensor, strides: list[int] | None = None
) -> torch.Tensor:
    sizes = (offs.size(0), input.size(1), grad_output.size(1))
    return input.new_empty(sizes) if strides is None else input.new_empty_strided(sizes, strides)


# Defined as plain library ops (a schema, a kernel, a meta kernel): the
# dispatcher calls each kernel directly. They run in backward graphs only
# (no autograd), once per MoE layer and microbatch in B and again in W,
# where torch.library.custom_op's Python wrappers would cost B and W about
# 55 lines of Python per call.
_LIB = torch.library.Library("fxsplit", "FRAGMENT")
_LIB.define("grouped_mm_input_grad(Tensor grad_output, Tensor weight, Tensor offs) -> Tensor")
_LIB.impl("grouped_mm_input_grad", _grouped_mm_input_grad, "CompositeExplicitAutograd")
_LIB.impl("grouped_mm_input_grad", lambda grad_output, weight, offs: grad_output.new_empty(
    grad_output.size(0), weight.size(1)), "Meta")
_LIB.define("grouped_mm_weight_grad(Tensor input, Tensor grad_output, Tensor offs, int[]? strides=None) -> Tensor")
_LIB.impl("grouped_mm_weight_grad", _grouped_mm_weight_grad, "CompositeExplicitAutograd")
_LIB.impl("grouped_mm_weight_grad", _grouped_mm_weight_grad_meta, "Meta")


@register_flop_formula(torch.ops.fxsplit.grouped_mm_input_grad)
def _grouped_mm_input_grad_flops(grad_output_shape: Any, weight_shape: Any, offs_shape: Any, **kwargs: Any) -> int:
    # Each row of grad_output is multiplied by one (out x in) expert matrix.
    rows, out_features = grad_output_shape
    return 2 * rows * out_features * weight_shape[1]


@register_flop_formula(torch.ops.fxsplit.grouped_mm_weight_grad)
def _grouped_mm_weight_grad_flops(
    input_shape: Any, grad_output_shape: Any, offs_shape: Any, strides: Any = None, **kwargs: Any
) -> int:
    # Each row contributes one (in x out) outer product to its expert's gradient.
    rows, in_features = input_shape
    return 2 * rows * in_features * grad_output_shape[1]


def grouped_mm_backward_rule(
    outputs: frozenset[int], input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Split rule for ``(input, weight, offs, grad_output) -> (grad_input, grad_weight)``
    backward ops of a grouped matmul ``out[rows of g] = input[rows of g] @ weight[g]``
    (``weight``: ``(groups, in, out)``; ``offs``: cumulative row counts), such as
    ``transformers::grouped_mm_fallback_backward``."""
    grad_input = torch.ops.fxsplit.grouped_mm_input_grad(grad_output, weight, offs) if 0 in outputs else None
    grad_weight = (torch.ops.fxsplit.grouped_mm_weight_grad(input, grad_output, offs, _strides_like(weight))
                   if 1 in outputs else None)
    return grad_input, grad_weight


register_split_rule("transformers::grouped_mm_fallback_backward", grouped_mm_backward_rule)

# FlexAttention (see the module docs): the score_mod / mask_mod buffers' gradients
# come out of the kernel that computes dQ, dK and dV.
register_split_rule("higher_order::flex_attention_backward", KEEP_IN_DI)
