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
* **first stage** (stage 0, inputs need no gradient): upstream's stage
  skips ``I`` for stage 0 and runs a full backward at ``W``, so ``W`` is as
  long as ``I`` and ``W`` together and every activation is held until then.
  Here stage 0 is balanced like the others: ``I`` runs the
  activation-gradient chain (each compiled region's dI graph, and the eager
  code above the regions) and frees the activations ``W`` does not need;
  ``W`` runs only the weight-gradient work (the dW graphs, and eager code
  below the regions, e.g. an eager embedding's backward). No work is
  duplicated. A stage 0 with no compiled region keeps upstream's way
  (everything at ``W``). See :meth:`PipelineStage.backward_one_chunk`.

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
* Data parallelism: wrap the (in-place compiled) stage module as a whole in
  ``DistributedDataParallel``, or shard it with FSDP2 (``fully_shard`` on each
  block, then on the stage module). ``W`` commits the weight gradients
  through autograd's accumulation, so the wrappers' hooks see them; DDP
  all-reduces in the stage's last ``W`` (or ``B``) of the step, FSDP2
  reduce-scatters at the schedule's ``REDUCE_GRAD``, once per step either way.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage as _UpstreamPipelineStage

from fxsplit import _torch_internals as ti
from fxsplit.api import PendingWeightGrads, stage_backward, stage_backward_input, stage_backward_weight

log = logging.getLogger("fxsplit")

__all__ = ["PipelineStage"]


def _data_parallel_kind(module: torch.nn.Module) -> str | None:
    """``"ddp"``, ``"fsdp"`` (``fully_shard``) or ``None`` for the stage module, after
    checking the wrapping is one this stage can drive.

    Raises ``ValueError`` naming the problem when a wrapper sits where the
    schedule cannot reach it (inside the stage module rather than around it),
    when DDP and FSDP are mixed, or for DDP options that cannot work with a
    backward split in time (see :class:`PipelineStage`).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    prefix = "fxsplit.pipelining.PipelineStage: "
    if isinstance(module, DistributedDataParallel):
        inner = [n for n, m in module.module.named_modules() if isinstance(m, (DistributedDataParallel, FSDPModule))]
        if inner:
            raise ValueError(
                prefix + f"the stage module is DistributedDataParallel around another data-parallel wrapper "
                f"({', '.join(n or 'its module' for n in inner)}); wrap the stage in DDP or FSDP2, not both"
            )
        if module.static_graph:
            raise ValueError(
                prefix + "DistributedDataParallel(static_graph=True) is not supported: DDP's static-graph mode "
                "assumes one backward per forward and per synchronisation, while a pipeline stage runs one "
                "backward per microbatch under no_sync; its reducer then fails (on torch 2.13: an internal "
                "assert 'expect_autograd_hooks_' with ScheduleZBVZeroBubble, an abort with Schedule1F1B). "
                "Use static_graph=False (the default)."
            )
        return "ddp"
    nested_ddp = [n for n, m in module.named_modules() if isinstance(m, DistributedDataParallel)]
    if nested_ddp:
        raise ValueError(
            prefix + f"DistributedDataParallel is applied to submodule(s) {', '.join(nested_ddp)} of the stage "
            "module; the schedule can only defer DDP's all-reduce to the end of the step when DDP wraps the "
            "whole stage module: pass DistributedDataParallel(stage_module) instead"
        )
    replicated = [n or "the stage module" for n, m in module.named_modules() if ti.is_fsdp_replicate_module(m)]
    if replicated:
        raise ValueError(
            prefix + f"{', '.join(replicated)} is wrapped with the FSDP-based replicate(), which fxsplit's stage "
            "has not been made to work with (only fully_shard and DistributedDataParallel are); use one of those"
        )
    fsdp = [n for n, m in module.named_modules() if isinstance(m, FSDPModule)]
    if isinstance(module, FSDPModule):
        return "fsdp"
    if fsdp:
        raise ValueError(
            prefix + f"fully_shard was applied to submodule(s) {', '.join(fsdp)} but not to the stage module "
            "itself; the schedule turns FSDP's per-microbatch gradient reduction off, and reduces once at the "
            "end of the step, through the stage module: call fully_shard(stage_module) after sharding its blocks"
        )
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
    is replaced, and, for stage 0, the input step upstream skips is added
    (:meth:`backward_one_chunk`, :meth:`backward_weight_one_chunk`). The ``param_groups`` it returns for an ``"input"`` backward is
    a :class:`fxsplit.PendingWeightGrads`, which the stage keeps in its
    backward state until the matching ``"weight"`` backward consumes it.

    Data parallelism: the stage module may be wrapped, as a whole, in
    ``DistributedDataParallel`` or sharded with FSDP2 (``fully_shard`` on the
    stage module, usually after ``fully_shard`` on each block). Weight
    gradients reach ``.grad`` through autograd's own accumulation at ``W``, so
    the wrappers' hooks see them as in ordinary backward; the synchronisation
    happens once per step:

    * DDP: every backward but the stage's last of the step runs under
      ``no_sync()``; before the last one (a ``W``, or a full ``B`` where the
      schedule issues one) the reducer is armed, and its hooks all-reduce the
      accumulated gradients as that backward commits them.
    * FSDP2: gradient sync and resharding after backward are off for every
      backward; the schedule's ``REDUCE_GRAD`` action (upstream's
      :meth:`perform_reduce_grad`, after the stage's last ``W``/``B``)
      reduce-scatters the accumulated gradients once.

    ``scale_grads`` runs once, at ``REDUCE_GRAD``, after the synchronisation.

    Raises ``ValueError`` at construction if ``dw_builder`` is given (it would
    replace the split this class exists for), and at construction or when
    :attr:`submod` is set again if the data-parallel wrapping is one the
    schedule cannot drive (see ``_data_parallel_kind``).
    """

    def __init__(self, submodule: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(_UpstreamPipelineStage.__init__).bind(self, submodule, *args, **kwargs)
        if bound.arguments.get("dw_builder") is not None:
            raise ValueError(
                "fxsplit.pipelining.PipelineStage: dw_builder replaces the B/W split with your own W runner; "
                "use torch.distributed.pipelining.PipelineStage for that"
            )
        super().__init__(submodule, *args, **kwargs)  # sets self.submod first thing (see below)
        # FSDP2 with manual backward finalization (torch >= 2.15): set by a forward that
        # enabled it, cleared by perform_reduce_grad (see forward_maybe_with_nosync).
        self._fsdp_finalization_armed = False

    @property
    def submod(self) -> torch.nn.Module:
        """The stage module. Set again after construction (torchtitan's ``pipeline_llm``
        builds the stages first, then sets each one's module to its parallelized and
        compiled version), the new module's data-parallel wrapping is checked and
        followed from then on: a wrapping the schedule cannot drive raises
        ``ValueError`` and leaves the stage as it was."""
        return self._submod

    @submod.setter
    def submod(self, module: torch.nn.Module) -> None:
        kind = _data_parallel_kind(module)
        skipped = _builtin_modules_compiled_in_place(module)
        if skipped:
            log.warning(
                "fxsplit.pipelining.PipelineStage: .compile() was called on built-in torch.nn module(s) %s; "
                "Dynamo does not trace those in place, so they run eagerly (the eager split still applies). "
                "Compile modules of your own classes instead (e.g. each transformer block).",
                ", ".join(skipped),
            )
        self._submod, self._data_parallel = module, kind

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        """Upstream's forward, with FSDP2's manual backward finalization enabled first
        where torch has it (2.15 on; :func:`~fxsplit._torch_internals.fsdp_has_manual_backward_finalization`).

        From torch 2.15, ``REDUCE_GRAD`` reduces FSDP gradients through
        ``finalize_backward``, which needs the mode enabled before the forward;
        upstream's ``forward_one_chunk`` enables it only when ``has_backward``, and
        its ``perform_reduce_grad`` finalizes only then. This stage turns FSDP's
        gradient sync off for every backward (``backward_maybe_with_nosync``), so
        ``perform_reduce_grad`` is the one place its gradients are ever reduced,
        whoever drives the stage: it enables the mode for every forward that
        records a graph, and :meth:`perform_reduce_grad` finalizes what it armed.
        """
        if self._data_parallel == "fsdp" and torch.is_grad_enabled() and ti.fsdp_has_manual_backward_finalization():
            self.submod.set_manual_backward_finalization(True)  # type: ignore[operator]
            self._fsdp_finalization_armed = True
        return super().forward_maybe_with_nosync(*args, **kwargs)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """Upstream's ``REDUCE_GRAD``: FSDP2 reduce-scatters the gradients accumulated
        over the step (once per parameter group), reshards, then the gradients are
        scaled by ``1 / grad_scale_factor``.

        torch <= 2.13: upstream's own (it runs every FSDP group's post-backward).
        torch >= 2.15: ``start_gradient_reduction`` then ``wait_for_gradient_reduction``
        (``finalize_backward``) whenever a forward armed manual finalization, also
        when the stage is driven without a schedule (``has_backward`` unset), where
        upstream's would reduce nothing and leave the sharded gradients ``None``.
        Multi-stage schedules of torch >= 2.15 call upstream's
        ``start_gradient_reduction``/``wait_for_gradient_reduction`` directly instead.
        """
        armed, self._fsdp_finalization_armed = self._fsdp_finalization_armed, False
        if self._data_parallel == "fsdp" and armed and not self.has_backward:
            # what upstream's does when has_backward (a schedule drives the stage)
            self.start_gradient_reduction()
            self.wait_for_gradient_reduction(grad_scale_factor)
            return
        super().perform_reduce_grad(grad_scale_factor)

    def _compute_outputs(self, *args: Any, module: torch.nn.Module, **kwargs: Any) -> Any:
        """The forward of upstream's shape inference (first step), under DDP's ``no_sync``.

        Upstream runs it as a plain forward, which arms DDP's reducer; the
        inference backward never reaches the grad accumulators, so the reducer
        stays armed into the step, all-reduces at the first microbatch's
        backward and, when two backwards of a stage come before its next
        forward (ZB-V's first stage), fails with "rebuilt parameter indices
        size is not same as original model parameters size". The schedule's
        own forwards run under ``no_sync`` (``forward_maybe_with_nosync``);
        this makes the inference forward do the same. Overrides upstream's
        ``_PipelineStage._compute_outputs`` (torch >= 2.13; unused before).
        """
        if self._data_parallel == "ddp" and module is self.submod:
            with module.no_sync():  # type: ignore[operator]
                return super()._compute_outputs(*args, module=module, **kwargs)  # type: ignore[misc]
        return super()._compute_outputs(*args, module=module, **kwargs)  # type: ignore[misc]

    def _balances_first_stage(self) -> bool:
        """Whether this stage's split actions need the stage-0 overrides below."""
        return self.is_first and self.dw_builder is None and self.has_backward

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        """Upstream's, plus the input step it skips for stage 0.

        Upstream's ``I`` on stage 0 (``full_backward=False``) stores the
        microbatch's outputs and output gradients for ``W`` and runs nothing;
        its ``W`` then runs a full backward. Here, after upstream's bookkeeping
        (caches, received gradients, validation), ``I`` runs
        :func:`fxsplit.stage_backward_input` on what upstream stored and keeps
        the :class:`~fxsplit.PendingWeightGrads` in its place, which
        :meth:`backward_weight_one_chunk` consumes. Every other action is
        upstream's unchanged.
        """
        super().backward_one_chunk(
            bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
        )
        if full_backward or not self._balances_first_stage():
            return
        state = ti.stage_backward_state(self, bwd_chunk_id)
        if state is None or state[1] is not None:  # upstream ran an input step itself (a later torch)
            return
        input_values, _, stage_output, output_grads = state
        _, work = self.backward_maybe_with_nosync(
            "input",
            {"stage_output": stage_output, "output_grads": output_grads, "input_values": input_values},
            last_backward=last_backward,
        )
        ti.set_stage_param_groups(self, bwd_chunk_id, work)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """Upstream's, except that stage 0's ``W`` runs the pending weight work
        its ``I`` left (:meth:`backward_one_chunk`) instead of a full backward."""
        state = ti.stage_backward_state(self, bwd_chunk_id) if self._balances_first_stage() else None
        if state is None or not isinstance(state[1], PendingWeightGrads):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            return
        ti.stage_backward_state(self, bwd_chunk_id, pop=True)
        _, work, stage_output, _ = state
        self.backward_maybe_with_nosync(
            "weight", {"stage_output": stage_output, "param_groups": work}, last_backward=last_backward
        )

    def _split_weights(self) -> list[torch.Tensor]:
        """The weights B and W work on: the stage's parameters as autograd records them.

        Under FSDP2 those are the unsharded parameters (``self.submod.parameters()``
        returns the sharded ones whenever a module is resharded); the mapping is
        stable once each parameter was all-gathered, so B and W of a microbatch
        see the same weights.
        """
        params = list(self.submod.parameters())
        if self._data_parallel != "fsdp":
            return params
        unsharded = ti.fsdp_unsharded_parameters(self.submod)
        return [unsharded.get(id(p), p) for p in params]

    def _run_backward(
        self, backward_type: str, bwd_kwargs: dict[str, Any]
    ) -> tuple[tuple[torch.Tensor | None, ...], PendingWeightGrads | None]:
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
                self._split_weights(),
            )
        if backward_type == "weight":
            # Data-parallel wrappers observe accumulation through hooks on the grad
            # accumulators (DDP's reducer: C++ hooks Python cannot see), so their
            # weights accumulate through autograd, never inside a dW graph.
            fused = False if self._data_parallel is not None else None
            stage_backward_weight(self._split_weights(), bwd_kwargs["param_groups"], fused_accumulation=fused)
            return (), None
        raise ValueError(
            f"fxsplit.pipelining.PipelineStage: unknown backward type {backward_type!r}; "
            "expected 'full', 'input' or 'weight'"
        )

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
        ``last_backward`` is true for the stage's last ``B``/``W`` of the step
        (never for ``I``): with DDP, that backward all-reduces.
        """
        if self._data_parallel == "ddp":
            ddp = self.submod
            if backward_type == "input" and ddp.find_unused_parameters:  # type: ignore[union-attr]
                raise ValueError(
                    "fxsplit.pipelining.PipelineStage: DistributedDataParallel(find_unused_parameters=True) "
                    "cannot be used with a schedule that splits the backward into I and W: DDP finds unused "
                    "parameters by walking the autograd graph from the stage outputs when it is armed for the "
                    "last W, and I has already consumed that graph, so every parameter would be taken as "
                    "unused and then reported ready twice. Use find_unused_parameters=False, or a schedule "
                    "with full backwards only (Schedule1F1B, ScheduleInterleaved1F1B). Raised before this I "
                    "ran: nothing was computed."
                )
            if last_backward:
                # The hooks on the grad accumulators fire as this backward commits
                # the weight gradients (autograd's accumulation, also at W), after
                # every earlier microbatch accumulated into .grad under no_sync.
                ti.ddp_expect_gradients(ddp, bwd_kwargs["stage_output"])
                return self._run_backward(backward_type, bwd_kwargs)
            with ddp.no_sync():  # type: ignore[operator]
                return self._run_backward(backward_type, bwd_kwargs)
        if self._data_parallel == "fsdp":
            # Accumulate unsharded gradients over the step; perform_reduce_grad
            # (the schedule's REDUCE_GRAD, after the last W/B) reduce-scatters once.
            fsdp = self.submod
            # (torch >= 2.15: manual finalization, enabled at forward, supersedes this)
            fsdp.set_is_last_backward(False)  # type: ignore[operator]
            fsdp.set_reshard_after_backward(False)  # type: ignore[operator]
            fsdp.set_requires_gradient_sync(False)  # type: ignore[operator]
        return self._run_backward(backward_type, bwd_kwargs)
