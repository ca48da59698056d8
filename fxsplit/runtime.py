"""Runtime of fxsplit-compiled backward regions.

AOTAutograd calls :class:`CompiledSplitBackward` wherever it would call
Inductor's compiled backward. What it runs depends on the *phase* the public
API (``fxsplit.stage_backward_input`` / ``stage_backward_weight``) has set:

* no phase (ordinary ``.backward()`` / ``torch.autograd.grad``): the fused
  backward, exactly as ``backend="inductor"`` would (or dI then dW back to
  back when no fused graph was compiled);
* input phase (B): the dI graph only; the W work is recorded as a
  :class:`CompiledWeightWork` holding just the live-ins, and ``None`` is
  returned for every weight gradient so autograd does nothing more for them;
* weight phase (the eager W run re-executing a node that B already ran): the
  input gradients B computed but autograd had no use for then.

The phase is process-global (the CUDA autograd engine runs backward on its
own threads, so a thread-local would not be seen); the public API holds a
lock while a phase is set, so one split backward runs at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fxsplit import _torch_internals as ti
from fxsplit.passes import SplitResult

log = logging.getLogger("fxsplit")

__all__ = ["CompiledSplitBackward", "CompiledWeightWork"]


@dataclasses.dataclass
class InputPhase:
    """B is running: compiled regions record their W work here."""

    records: list[CompiledWeightWork] = dataclasses.field(default_factory=list)


class WeightPhase:
    """The eager part of W is running."""


_phase: InputPhase | WeightPhase | None = None
_phase_lock = threading.RLock()


@contextlib.contextmanager
def active_phase(phase: InputPhase | WeightPhase) -> Iterator[None]:
    global _phase
    with _phase_lock:
        if _phase is not None:
            raise RuntimeError(
                "fxsplit: a split backward is already running in this process; "
                "stage_backward_input/stage_backward_weight cannot be nested"
            )
        _phase = phase
        try:
            yield
        finally:
            _phase = None


_DEFERRED = "_fxsplit_deferred_input_grads"


class CompiledWeightWork:
    """The W half of one compiled region for one microbatch: dW graph + live-ins.

    Holds only the live-ins (and the parameters the gradients belong to), so
    everything else the backward needed is freed when B ends. :meth:`run`
    may be called once; it returns ``(param, grad)`` pairs and drops the
    live-ins.
    """

    __slots__ = ("_owner", "_live_ins", "params")

    def __init__(
        self,
        owner: CompiledSplitBackward,
        live_ins: list[Any],
        params: list[torch.Tensor | None],
    ) -> None:
        self._owner = owner
        self._live_ins: list[Any] | None = live_ins
        self.params = params

    @property
    def region(self) -> str:
        return self._owner.name

    @property
    def live_in_bytes(self) -> int:
        return sum(
            v.numel() * v.element_size() for v in (self._live_ins or []) if isinstance(v, torch.Tensor)
        )

    @property
    def pending(self) -> bool:
        return self._live_ins is not None

    def run(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._live_ins is None:
            raise RuntimeError(f"fxsplit: the W work of {self.region} has already run")
        # Pass a copy: compiled graphs may clear their argument list.
        grads = self._owner.run_dw(list(self._live_ins))
        self._live_ins = None
        self._owner.stats["dw_runs"] += 1
        return [(p, g) for p, g in zip(self.params, grads) if p is not None and g is not None]


class CompiledSplitBackward:
    """The backward of one fxsplit-compiled region, as AOTAutograd calls it.

    ``run_di(args)`` returns the dI outputs followed by the live-ins;
    ``run_dw(live_ins)`` the weight gradients; ``run_fused(args)`` (optional)
    the whole backward. All three follow AOTAutograd's boxed convention.
    """

    def __init__(
        self,
        split: SplitResult,
        run_di: ti.BoxedCallable,
        run_dw: ti.BoxedCallable,
        run_fused: ti.BoxedCallable | None,
        name: str,
        input_is_tensor: Sequence[bool] | None = None,
    ) -> None:
        # An instance attribute, so wrappers that copy __dict__ (torch._dynamo.disable) keep it.
        self._boxed_call = True
        self.split = split
        self._run_di = run_di
        self._run_dw = run_dw
        self._run_fused = run_fused
        self.name = name
        # Which forward inputs are tensors: the autograd node has an edge per
        # tensor input only, while the backward returns one output per input
        # (None for SymInts, e.g. with dynamic shapes).
        self.input_is_tensor = tuple(input_is_tensor) if input_is_tensor is not None else None
        self.stats = {"fused_runs": 0, "di_runs": 0, "dw_runs": 0}

    # -- graph-level pieces -------------------------------------------------
    def run_dw(self, live_ins: list[Any]) -> list[Any]:
        # Outside the autograd engine: reproduce the state it runs backward
        # graphs in (no grad mode; the graph is already autocast-lowered).
        with torch.no_grad(), ti.autocast_disabled():
            return list(self._run_dw(live_ins))

    def _di_and_live(self, args: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = list(self._run_di(args))
        n = len(self.split.di_outputs)
        self.stats["di_runs"] += 1
        return outs[:n], outs[n:]

    def _assemble(self, di_vals: Sequence[Any], dw_vals: Sequence[Any] | None) -> list[Any]:
        result: list[Any] = [None] * self.split.num_outputs
        for i, v in zip(self.split.di_outputs, di_vals):
            result[i] = v
        if dw_vals is not None:
            for i, v in zip(self.split.dw_outputs, dw_vals):
                result[i] = v
        return result

    def _full(self, args: list[Any]) -> list[Any]:
        if self._run_fused is not None:
            self.stats["fused_runs"] += 1
            return list(self._run_fused(args))
        di_vals, live = self._di_and_live(args)
        args.clear()
        dw_vals = self.run_dw(live)
        self.stats["dw_runs"] += 1
        return self._assemble(di_vals, dw_vals)

    # -- AOTAutograd entry point -------------------------------------------
    def __call__(self, args: list[Any]) -> list[Any]:
        phase = _phase
        if phase is None:
            return self._full(args)
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "fxsplit: create_graph=True / double backward through a split backward is not supported"
            )
        node = ti.current_autograd_node()
        if node is None:
            return self._full(args)
        if isinstance(phase, WeightPhase):
            deferred = getattr(node, _DEFERRED, None)
            if deferred is None:
                # Not run in B (e.g. a first stage): W does the whole backward.
                return self._full(args)
            setattr(node, _DEFERRED, None)
            result: list[Any] = [None] * self.split.num_outputs
            for i, v in deferred.items():
                result[i] = v
            return result
        return self._input_phase(phase, node, args)

    def _input_phase(self, phase: InputPhase, node: Any, args: list[Any]) -> list[Any]:
        edges = self._edges_by_output(node.next_functions)
        di_vals, live = self._di_and_live(args)
        args.clear()
        params = self._params_of(edges, self.split.dw_outputs)
        phase.records.append(CompiledWeightWork(self, live, params))
        # Input grads autograd does not need now may be needed by the eager W
        # run (an eager weight upstream of this region): keep them for it.
        deferred = {}
        for i, v in zip(self.split.di_outputs, di_vals):
            fn = edges[i][0] if edges[i] is not None else None
            if v is not None and fn is not None and not ti.engine_will_execute(fn):
                deferred[i] = v
        if deferred:
            setattr(node, _DEFERRED, deferred)
        return self._assemble(di_vals, None)

    def _edges_by_output(self, edges: Sequence[Any]) -> list[Any]:
        """The autograd edge each backward output flows into (``None`` for a
        non-tensor forward input, which has no edge)."""
        n = self.split.num_outputs
        if len(edges) == n:
            return list(edges)
        flags = self.input_is_tensor
        if flags is not None and len(flags) == n and sum(flags) == len(edges):
            it = iter(edges)
            return [next(it) if is_tensor else None for is_tensor in flags]
        raise RuntimeError(
            f"fxsplit: {self.name}: the autograd node has {len(edges)} inputs but the backward "
            f"graph has {n} outputs (forward tensor inputs: "
            f"{'unknown' if flags is None else sum(flags)}), so weight gradients cannot be matched "
            "to parameters. Compile this module with backend='inductor' and use the eager split, "
            "or report this with the module that triggers it."
        )

    @staticmethod
    def _params_of(edges: Sequence[Any], positions: Sequence[int]) -> list[torch.Tensor | None]:
        params: list[torch.Tensor | None] = []
        for i in positions:
            fn = edges[i][0] if edges[i] is not None else None
            var = getattr(fn, "variable", None) if fn is not None and ti.is_accumulate_grad(fn) else None
            params.append(var if isinstance(var, torch.nn.Parameter) else None)
        return params
