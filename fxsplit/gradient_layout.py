"""Which backward outputs make up which forward input's gradient.

A compiled region's backward graph returns one output per forward input,
except for tensor subclasses: a DTensor parameter's gradient comes back
flattened, as its local tensor, its device mesh and, with symbolic sizes,
its sizes and strides, each a separate output (AOTAutograd wraps them into
the DTensor after the graph). :class:`GradientLayout` records, per output,
the forward input it belongs to, read off AOTAutograd's descriptors at
compile time (:func:`fxsplit._torch_internals.backward_output_parts`), so
that:

* the split knows every piece of a weight's gradient is weight-gradient work
  (:meth:`GradientLayout.weight_outputs`);
* the runtime finds the autograd edge (and so the parameter) each output
  flows into (:meth:`GradientLayout.edges_by_output`), and W hands autograd
  one gradient per weight (:meth:`GradientLayout.weight_gradients`).

Pure bookkeeping on indices: no tensors, no torch internals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fxsplit._torch_internals import GradientPart

__all__ = ["GradientLayout", "UnidentifiedGradients", "WeightGradient"]


class UnidentifiedGradients(ValueError):
    """Some backward outputs are gradients whose forward input cannot be told,
    so weight gradients cannot be separated from input gradients."""


@dataclasses.dataclass(frozen=True)
class WeightGradient:
    """One weight's gradient among the dW graph's outputs.

    ``input_index`` is the weight's position among the region's forward
    inputs; ``positions`` index the dW graph's outputs that make it up (one
    for a plain tensor; its pieces for a subclass, in output order);
    ``subclass``: the gradient is rebuilt from its pieces (a DTensor).
    """

    input_index: int
    positions: tuple[int, ...]
    subclass: bool


@dataclasses.dataclass(frozen=True)
class GradientLayout:
    """For each backward output, the forward input it is (part of) the gradient of.

    ``owners[i]`` is that input's index (``None``: the output is no gradient,
    e.g. ``None`` or an effect token); ``parts[i]`` the piece (``""`` for a
    plain gradient, ``"._local_tensor"``, ``".device_mesh"``... for a
    subclass); ``input_is_tensor[k]`` whether forward input ``k`` is a tensor
    (the region's autograd node has an edge per tensor input only: a SymInt
    or a device mesh input has none).
    """

    owners: tuple[int | None, ...]
    parts: tuple[str, ...]
    input_is_tensor: tuple[bool, ...]

    @classmethod
    def from_parts(
        cls, parts: Sequence[GradientPart | None], input_is_tensor: Sequence[bool]
    ) -> GradientLayout:
        """The layout described by ``parts`` (one entry per backward output).

        Raises :class:`UnidentifiedGradients`, naming the outputs, if a
        gradient's input cannot be told or lies outside the region's inputs.
        """
        unknown = [
            f"output {i} ({p.desc})"
            for i, p in enumerate(parts)
            if p is not None and (p.input_index is None or not 0 <= p.input_index < len(input_is_tensor))
        ]
        if unknown:
            raise UnidentifiedGradients(
                f"cannot tell which forward input {len(unknown)} backward output(s) are the gradients of, "
                f"so weight gradients cannot be told from input gradients: {'; '.join(unknown[:4])}"
                + (" ..." if len(unknown) > 4 else "")
            )
        return cls(
            owners=tuple(p.input_index if p is not None else None for p in parts),
            parts=tuple(p.part if p is not None else "" for p in parts),
            input_is_tensor=tuple(input_is_tensor),
        )

    @classmethod
    def plain(cls, num_outputs: int) -> GradientLayout:
        """Output ``i`` is the gradient of tensor input ``i`` (a region without subclasses)."""
        return cls(tuple(range(num_outputs)), ("",) * num_outputs, (True,) * num_outputs)

    @property
    def num_outputs(self) -> int:
        return len(self.owners)

    @property
    def subclass_inputs(self) -> frozenset[int]:
        """Inputs whose gradient comes in pieces (tensor subclasses)."""
        return frozenset(k for k, part in zip(self.owners, self.parts) if k is not None and part)

    def weight_outputs(self, is_weight: Sequence[bool]) -> list[int]:
        """Every backward output that is (part of) the gradient of an input with ``is_weight``."""
        return [i for i, k in enumerate(self.owners) if k is not None and k < len(is_weight) and is_weight[k]]

    def weight_gradients(self, dw_outputs: Sequence[int]) -> tuple[WeightGradient, ...]:
        """The weights' gradients among ``dw_outputs`` (backward-output indices
        of the dW graph's outputs), one per weight, in the order of their first output."""
        positions: dict[int, list[int]] = {}
        for k, i in enumerate(dw_outputs):
            owner = self.owners[i]
            if owner is None:
                raise ValueError(f"dW output {k} (backward output {i}) is no weight's gradient")
            positions.setdefault(owner, []).append(k)
        subclass = self.subclass_inputs
        return tuple(WeightGradient(owner, tuple(ks), owner in subclass) for owner, ks in positions.items())

    def edges_by_input(self, edges: Sequence[Any], region: str = "region") -> list[Any]:
        """The autograd edge of each forward input (``None`` for a non-tensor input).

        ``edges`` are the region's autograd node's ``next_functions`` (one per
        tensor input). Raises ``RuntimeError`` if their number does not match
        the tensor inputs (the node is not this region's).
        """
        flags = self.input_is_tensor
        if sum(flags) != len(edges):
            raise RuntimeError(
                f"fxsplit: {region}: the autograd node has {len(edges)} inputs but the region has "
                f"{sum(flags)} tensor inputs ({len(flags)} inputs in all), so weight gradients cannot be "
                "matched to parameters. Compile this module with backend='inductor' and use the eager "
                "split, or report this with the module that triggers it."
            )
        it = iter(edges)
        return [next(it) if is_tensor else None for is_tensor in flags]

    def edges_by_output(self, edges: Sequence[Any], region: str = "region") -> list[Any]:
        """The autograd edge each backward output flows into (``None`` for an
        output that is no gradient or belongs to a non-tensor input)."""
        by_input = self.edges_by_input(edges, region)
        return [by_input[k] if k is not None else None for k in self.owners]
