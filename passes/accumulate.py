"""Accumulate weight gradients into existing ``.grad`` tensors inside the dW graph.

After the first microbatch every weight has a ``.grad``; adding a new
gradient to it is a separate memory-bound pass over the weight unless the
kernel that produces the gradient adds it in. :func:`accumulate_into` rewrites
a dW graph so that it does: the ``.grad`` tensors come in as extra inputs and
are updated in place, as TransformerEngine and Megatron accumulate into
``main_grad`` inside the weight-gradient GEMM (``gradient_accumulation_fusion``).

* A gradient that is a matrix product, ``mm(a, b)`` or its transpose
  ``permute(mm(a, b), [1, 0])``, becomes ``matmul_into(grad, a, b)`` (resp.
  ``matmul_into(grad, b^T, a^T)``), an in-place ``grad += a @ b``: one GEMM
  with beta = 1 writing into the gradient buffer (``aten.addmm_`` by
  default; the backend passes an operator Inductor calls with its operands
  as they are laid out, see ``fxsplit._torch_internals.ADDMM_INTO``).
* Any other gradient ``v`` becomes ``copy_(grad, add(grad, v))``: Inductor
  fuses the add and the store with the kernel that produces ``v`` (the
  reduction of a bias or norm-weight gradient).

The pass is pure: a new graph module comes back and the input is unchanged.
Which gradients may be accumulated this way (no hooks, same dtype and layout,
...) is the caller's business.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

__all__ = ["accumulate_into"]

_aten = torch.ops.aten


def _matmul_operands(node: fx.Node, users_ok: int) -> tuple[fx.Node, fx.Node, bool] | None:
    """``(a, b, transposed)`` when ``node`` is ``mm(a, b)`` (or ``permute(mm(a, b), [1, 0])``,
    ``transposed``) and nothing else reads the product."""
    transposed = False
    if node.target is _aten.permute.default and list(node.args[1]) == [1, 0] and len(node.users) == users_ok:
        inner = node.args[0]
        if not isinstance(inner, fx.Node) or len(inner.users) != 1:
            return None
        node, transposed, users_ok = inner, True, 1
    if node.op != "call_function" or node.target is not _aten.mm.default or len(node.users) != users_ok:
        return None
    a, b = node.args[:2]
    return a, b, transposed


def accumulate_into(
    dw: fx.GraphModule,
    positions: Sequence[int],
    matmul_into: Callable[..., Any] = _aten.addmm_.default,
    brackets: tuple[Callable[..., Any], Callable[..., Any]] | None = None,
) -> fx.GraphModule:
    """A copy of ``dw`` that adds its outputs at ``positions`` into tensors
    given as extra trailing placeholders (``grad_<position>``, one per
    position, in that order), in place, and returns ``None`` there.

    Contract: called with the original inputs followed by one tensor per
    position, of the output's shape and dtype, it returns the original
    outputs except ``None`` at ``positions``, and each of those tensors has
    had the corresponding output added to it. ``matmul_into(grad, a, b)``
    must add ``a @ b`` into ``grad`` in place. Raises ``ValueError`` for a
    position that is not an output or whose output is ``None``.

    ``brackets = (begins, ends)``: every write into a ``grad`` other than a
    ``matmul_into`` call (one operator, which can record its own write) is
    preceded by ``begins(grad)`` and followed by ``ends(grad)``, operators
    that declare they mutate ``grad`` (so no compiler reorders them across
    the write or drops them). A caller that records them knows, after an
    exception, which tensors were written (both ran), which were not
    (neither), and which it cannot know (only ``begins``).
    """
    gm = fx.GraphModule(dw, copy.deepcopy(dw.graph))
    graph = gm.graph
    output = graph.output_node()
    outs = list(output.args[0])
    if len(set(positions)) != len(positions):
        raise ValueError(f"fxsplit: accumulate_into: repeated positions {list(positions)}")
    last_placeholder = list(graph.find_nodes(op="placeholder"))[-1]
    grads: list[fx.Node] = []
    with graph.inserting_after(last_placeholder):
        for k in reversed(positions):
            if not 0 <= k < len(outs) or not isinstance(outs[k], fx.Node):
                raise ValueError(f"fxsplit: accumulate_into: dW output {k} is not a tensor the graph computes")
            grads.append(graph.placeholder(f"grad_{k}"))
    grads.reverse()
    for k, grad in zip(positions, grads):
        value = outs[k]
        grad.meta = {key: v for key, v in value.meta.items() if key == "val"}
        uses = sum(1 for o in outs if o is value)
        with graph.inserting_before(output):
            mm = _matmul_operands(value, users_ok=1) if uses == 1 else None
            if mm is not None:
                a, b, transposed = mm
                if transposed:  # (a @ b)^T = b^T @ a^T
                    a, b = (
                        graph.call_function(_aten.permute.default, (b, [1, 0])),
                        graph.call_function(_aten.permute.default, (a, [1, 0])),
                    )
                graph.call_function(matmul_into, (grad, a, b))
            else:
                total = graph.call_function(_aten.add.Tensor, (grad, value))
                if brackets is not None:
                    graph.call_function(brackets[0], (grad,))
                graph.call_function(_aten.copy_.default, (grad, total))
                if brackets is not None:
                    graph.call_function(brackets[1], (grad,))
        outs[k] = None
    output.args = (tuple(outs),)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm
