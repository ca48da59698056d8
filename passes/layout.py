"""Weight gradients written in their weights' layout by the graph that computes them.

Into an empty ``.grad``, autograd's ``AccumulateGrad`` keeps a gradient as it
is only when it has the weight's layout (the weight's strides where the
weight is dense, else contiguous); any other gradient it first copies into
that layout. A gradient that comes out of its graph transposed (an MoE
expert weight stored ``(experts, out, in)`` and multiplied as
``(experts, in, out)``) therefore costs W a call into autograd's engine to
make that copy. :func:`lay_out_like` makes the dW graph write such a
gradient in its weight's layout instead: the same copy, done by the compiled
graph, where a compiler may fuse it with the kernel that produces the
gradient. The values are the same tensor's, element for element.

Only the graph's own claim changes (its output's ``meta["val"]``); whoever
runs the compiled graph still checks the layout it returns.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx

__all__ = ["WeightLayout", "is_dense", "lay_out_like"]

_aten = torch.ops.aten

WeightLayout = tuple[tuple[int, ...], tuple[int, ...]]
"""A weight's ``(sizes, strides)``, static integers."""


def is_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a tensor of ``sizes`` and ``strides`` fills its memory exactly
    once (no overlap, no gap) in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(sizes, strides) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _static(values: Sequence[object]) -> bool:
    return all(type(v) is int for v in values)


def lay_out_like(gm: fx.GraphModule, layouts: Mapping[int, WeightLayout]) -> fx.GraphModule:
    """``gm`` with each output at a position of ``layouts`` written in that
    weight layout: the weight's strides where the weight is dense, else
    contiguous (autograd's layout contract for a gradient it keeps).

    An output already so laid out (by its traced ``meta["val"]``), or one that
    is not a tensor of the weight's sizes with static sizes and strides, is
    left alone. The copy is ``aten.copy(aten.empty_strided(...), value)``.
    Pure: ``gm`` itself is returned where nothing changes, else a new graph
    module (``gm`` unchanged).
    """
    output = gm.graph.output_node()
    outs = list(output.args[0])
    wanted: dict[int, tuple[int, ...]] = {}
    for k, (sizes, strides) in layouts.items():
        value = outs[k] if 0 <= k < len(outs) else None
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
            continue
        if not (_static(val.shape) and _static(val.stride())) or tuple(val.shape) != tuple(sizes):
            continue
        target = tuple(strides) if is_dense(sizes, strides) else _contiguous_strides(sizes)
        if tuple(val.stride()) != target:
            wanted[k] = target
    if not wanted:
        return gm
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    graph = new.graph
    output = graph.output_node()
    outs = list(output.args[0])
    for k, strides in wanted.items():
        value = outs[k]
        val = value.meta["val"]
        with graph.inserting_before(output):
            empty = graph.call_function(
                _aten.empty_strided.default, (list(val.shape), list(strides)),
                {"dtype": val.dtype, "device": val.device},
            )
            empty.meta["val"] = _empty_like_strided(val, strides)
            laid = graph.call_function(_aten.copy.default, (empty, value))
            laid.meta["val"] = _empty_like_strided(val, strides)
        outs[k] = laid
    output.args = (tuple(outs),)
    graph.lint()
    new.recompile()
    return new


def _empty_like_strided(val: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """A tensor like ``val`` (a fake tensor stays one, in its fake mode) with ``strides``."""
    return val.new_empty_strided(val.shape, strides)
