"""Pipeline stages for ``torch.distributed.pipelining`` whose backward runs fxsplit's split.

:class:`PipelineStage` is a drop-in for
``torch.distributed.pipelining.PipelineStage`` (same constructor). The
upstream schedules drive it unchanged; only the three backward actions are
routed through fxsplit:

=================  ==========================================  =======================================
schedule action    upstream                                    here
=================  ==========================================  =======================================
``B`` (full)       ``_backward.stage_backward``                :func:`fxsplit.stage_backward`
``I`` (input)      ``_backward.stage_backward_input``          :func:`fxsplit.stage_backward_input`
``W`` (weight)     ``_backward.stage_backward_weight``         :func:`fxsplit.stage_backward_weight`
=================  ==========================================  =======================================

fxsplit-compiled regions of the stage module run their compiled dI graph at
``I`` and their compiled dW graph at ``W``; everything else in the stage
(eager code, the loss) is split by the eager reverse closure.

What runs where, per microbatch:

* **middle stages**: ``I`` runs the dI graphs (input-gradient chain only, no
  weight-gradient work) and sends the input gradient upstream; ``W`` runs the
  dW graphs on the live-ins ``I`` kept.
* **last stage**: ``I`` runs the loss's backward (eager) and the dI graphs;
  ``W`` the dW graphs. Same as a middle stage, the loss being just eager code
  at the top of the stage.
* **first stage** (inputs need no gradient): nothing needs the input-gradient
  chain except the stage's own weight gradients, so all of its backward is
  weight work. Upstream's runtime skips ``I`` for stage 0 and runs a full
  backward at ``W``; we keep that: ``I`` does nothing, ``W`` runs the stage's
  full backward (the fused compiled backward of each region), once. No work
  is duplicated and none of it is on the pipeline's critical path, which is
  what the zero-bubble schedules want of stage 0's backward.

Using it with the upstream schedules:

* The zero-bubble schedules (``ScheduleInterleavedZeroBubble``,
  ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) refuse stage modules that
  contain a ``torch._dynamo.OptimizedModule`` (the wrapper
  ``torch.compile(module)`` returns). Compile **in place** instead, so the
  stage module stays a plain ``nn.Module``::

      stage_module.compile(backend="fxsplit")            # whole stage, or
      for block in stage_module.blocks:                  # per block
          block.compile(backend=fxsplit.backend())

* Compile in place only modules of your own classes: Dynamo does not trace a
  root frame inside ``torch.nn``, so ``nn.Sequential(...).compile()`` or
  ``nn.Linear(...).compile()`` silently stays eager (upstream behaviour).
  :class:`PipelineStage` logs a warning when it finds such a module.
* Pass the *same* (in-place compiled) module to :class:`PipelineStage`.
* DDP/FSDP-wrapped stage modules are not supported: fxsplit writes weight
  gradients into ``.grad`` itself, so their gradient hooks would not fire.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage as _UpstreamPipelineStage

from fxsplit.api import PendingWeightGrads, stage_backward, stage_backward_input, stage_backward_weight

log = logging.getLogger("fxsplit")

__all__ = ["PipelineStage"]


def _is_data_parallel_wrapper(module: torch.nn.Module) -> str | None:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return "DistributedDataParallel"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return None
    if isinstance(module, FSDPModule):
        return "FSDP (fully_shard)"
    return None


def _builtin_modules_compiled_in_place(module: torch.nn.Module) -> list[str]:
    """Names of submodules of built-in ``torch.nn`` classes that ``.compile()`` was
    called on: Dynamo skips their frames, so they run eagerly."""
    return [
        name or type(module).__name__
        for name, m in module.named_modules()
        if getattr(m, "_compiled_call_impl", None) is not None and type(m).__module__.startswith("torch.nn.")
    ]


class PipelineStage(_UpstreamPipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` with fxsplit's B/W split.

    Same constructor and behaviour as the upstream class; only
    :meth:`backward_maybe_with_nosync` (the single place upstream's stage
    calls ``stage_backward``/``stage_backward_input``/``stage_backward_weight``)
    is replaced. The ``param_groups`` it returns for an ``"input"`` backward is
    a :class:`fxsplit.PendingWeightGrads`, which the stage keeps in its
    backward state until the matching ``"weight"`` backward consumes it.

    Raises ``NotImplementedError`` at construction for DDP/FSDP-wrapped stage
    modules and ``ValueError`` if ``dw_builder`` is given (it would replace
    the split this class exists for).
    """

    def __init__(self, submodule: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        wrapper = _is_data_parallel_wrapper(submodule)
        if wrapper is not None:
            raise NotImplementedError(
                f"fxsplit.pipelining.PipelineStage: the stage module is wrapped in {wrapper}; fxsplit "
                "accumulates weight gradients into .grad itself, so the wrapper's gradient hooks would "
                "not run. Use a plain nn.Module (compiled in place with module.compile(backend='fxsplit'))."
            )
        bound = inspect.signature(_UpstreamPipelineStage.__init__).bind(self, submodule, *args, **kwargs)
        if bound.arguments.get("dw_builder") is not None:
            raise ValueError(
                "fxsplit.pipelining.PipelineStage: dw_builder replaces the B/W split with your own W runner; "
                "use torch.distributed.pipelining.PipelineStage for that"
            )
        skipped = _builtin_modules_compiled_in_place(submodule)
        if skipped:
            log.warning(
                "fxsplit.pipelining.PipelineStage: .compile() was called on built-in torch.nn module(s) %s; "
                "Dynamo does not trace those in place, so they run eagerly (the eager split still applies). "
                "Compile modules of your own classes instead (e.g. each transformer block).",
                ", ".join(skipped),
            )
        super().__init__(submodule, *args, **kwargs)

    def backward_maybe_with_nosync(
        self,
        backward_type: str,
        bwd_kwargs: dict[str, Any],
        last_backward: bool = False,
    ) -> tuple[tuple[torch.Tensor | None, ...], PendingWeightGrads | None]:
        """Run one backward action of one microbatch with fxsplit.

        ``backward_type`` is ``"full"`` (``B``: returns the input gradients),
        ``"input"`` (``I``: returns the input gradients and the pending W work)
        or ``"weight"`` (``W``: consumes ``bwd_kwargs["param_groups"]``).
        ``last_backward`` only matters to data-parallel wrappers, which this
        stage does not accept.
        """
        log.debug("fxsplit: stage %d: %s backward", self.stage_index, backward_type)
        if backward_type == "full":
            grads = stage_backward(
                bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
            )
            return grads, None
        if backward_type == "input":
            return stage_backward_input(
                bwd_kwargs["stage_output"],
                bwd_kwargs["output_grads"],
                bwd_kwargs["input_values"],
                self.submod.parameters(),
            )
        if backward_type == "weight":
            stage_backward_weight(self.submod.parameters(), bwd_kwargs["param_groups"])
            return (), None
        raise ValueError(
            f"fxsplit.pipelining.PipelineStage: unknown backward type {backward_type!r}; "
            "expected 'full', 'input' or 'weight'"
        )
