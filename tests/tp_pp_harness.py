"""Multi-process harness for 3-D parallelism: tensor x pipeline (x FSDP2) on CPU with gloo.

The ranks form a device mesh ``(pp, tp)`` of 2 x 2 (4 ranks), or ``(pp, dp,
tp)`` of 2 x 2 x 2 (8 ranks) with FSDP2 over ``dp``. Four pipeline stages of
one Llama-style :class:`TPBlock` (``examples/tp_block.py``) each, two per
pipeline rank (V placement for ``ScheduleZBVZeroBubble``, looped for
``ScheduleInterleavedZeroBubble``); stage 0 starts with an input projection,
stage 3 ends with a norm and an output projection. Every module is
parallelized over ``tp`` as torchtitan does (``parallelize_module``: the
block's plan, the input projection row-wise from a replicated input, the
output projection column-wise to a replicated output; with sequence
parallelism the activations between blocks are sharded on the sequence), then
compiled in place per block with fxsplit, then (8 ranks) sharded with
``fully_shard`` per block and per stage, and driven by an upstream schedule
over fxsplit :class:`~fxsplit.pipelining.PipelineStage` s for two steps.

In-rank, against a single-process unsharded reference on the global batch:
every microbatch loss and every parameter's full gradient
(``full_tensor()``). Returned for the parent, for the last step: per action,
the fxsplit region counters, the matmul FLOPs and the collectives it issued;
and, per stage, the same counted over one ordinary backward of that stage
(taken before the schedule runs, as a yardstick).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

# examples/tp_block.py: the Llama-style TP block and its plan, shared with examples/tp_pp_torchrun.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch
import torch.nn as nn

import dp_harness as dh
import multirank
import pipeline_harness as ph
import tp_harness as th
import zoo
from fxsplit.bench import world as W

PP, TP, DP = 2, 2, 2
N_STAGES = 4
DIM, HEADS, HIDDEN = th.DIM, th.HEADS, th.HIDDEN
MB_BATCH, SEQ = 2, 8
N_MICROBATCHES = 4
N_STEPS = 2
LR = 0.1


@dataclasses.dataclass(frozen=True)
class TPPPCase:
    """``schedule``; ``sp``: sequence parallelism; ``fsdp``: 8 ranks, FSDP2 over ``dp``;
    ``compile``: ``"all"`` (the block, the input projection and the head, each
    compiled in place) or ``"blocks"`` (only the block, as torchtitan compiles:
    the projections run eagerly, on DTensors, through the eager split)."""

    schedule: str
    sp: bool
    compiler: str = "eager"
    fsdp: bool = False
    compile: str = "all"

    @property
    def name(self) -> str:
        return (f"{self.schedule}-{'sp' if self.sp else 'tp'}{'-fsdp' if self.fsdp else ''}-{self.compiler}"
                f"{'-blocks' if self.compile == 'blocks' else ''}")

    @property
    def world(self) -> int:
        return PP * TP * (DP if self.fsdp else 1)


def build_reference() -> list[zoo.TPStage]:
    torch.manual_seed(0)
    stages = [zoo.TPStage(DIM, HEADS, HIDDEN, s == 0, s == N_STAGES - 1) for s in range(N_STAGES)]
    with torch.no_grad():  # norm weights start at 1: make their gradients less special
        for m in stages:
            for p in m.parameters():
                if p.dim() == 1:
                    p.uniform_(0.5, 1.5)
    return stages


def stage_plan(stage: zoo.TPStage, sp: bool) -> dict[str, Any]:
    """torchtitan's plan for the stage: the block's, the input projection
    row-wise from a replicated input, the head column-wise to a replicated output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from tp_block import block_plan

    plan = block_plan(sp, prefix="block.")
    if stage.inp is not None:
        plan["inp.proj"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    if stage.head is not None:
        if sp:
            plan["head.norm"] = SequenceParallel()
        plan["head.proj"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
    return plan


def stage_input_shape(stage_id: int, sp: bool) -> tuple[int, ...]:
    seq = SEQ // TP if sp and stage_id > 0 else SEQ
    return (MB_BATCH, seq, DIM)


def _ordinary_backward_profile(module: nn.Module, stage_id: int, case: TPPPCase) -> tuple[dict[str, int], int]:
    """Collectives and matmul FLOPs of one ordinary backward of ``module`` (a
    stage as the schedule runs it), on random data; its gradients are dropped."""
    g = torch.Generator().manual_seed(1000 + stage_id)
    x = torch.randn(stage_input_shape(stage_id, case.sp), generator=g)
    x.requires_grad_(stage_id > 0)
    out = module(x)
    dy = torch.randn(out.shape, generator=g)
    phase = th.Phase(lambda: out.backward(dy), flops=case.compile == "all")
    for p in module.parameters():
        p.grad = None
    return phase.collectives, phase.flops


def run_tp_pp_case(case: TPPPCase, rank: int, world: int) -> dict[str, Any]:
    """One case in one rank (see the module docstring); returns what the tests check."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import fxsplit

    assert world == case.world, f"{case.name} needs {case.world} ranks, got {world}"
    torch._dynamo.reset()
    if case.fsdp:
        mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
        dp_rank = mesh["dp"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
        dp_rank = 0
    pp_rank = mesh["pp"].get_local_rank()
    stage_ids, n_stages = W.stage_ids(case.schedule, pp_rank, PP)
    assert n_stages == N_STAGES
    reference = build_reference()
    backend = fxsplit.backend(compiler=case.compiler, fallback="error")
    modules: dict[int, nn.Module] = multirank.deep_copies(reference, stage_ids)
    yardstick: dict[int, tuple[dict[str, int], int]] = {}
    tokens = MB_BATCH * SEQ
    weight_flops: dict[int, int] = {}
    input_proj_flops: dict[int, int] = {}
    for s, m in modules.items():
        parallelize_module(m, mesh["tp"], stage_plan(m, case.sp))
        for part in (m.inp, m.block, m.head) if case.compile == "all" else (m.block,):  # in place
            if part is not None:
                part.compile(backend=backend)
        # before FSDP shards them further: each rank's matmuls see the tp shard
        weight_flops[s] = th.weight_grad_flops(m, tokens)
        input_proj_flops[s] = th.weight_grad_flops(m.inp, tokens) if m.inp is not None else 0
        if not case.fsdp:
            yardstick[s] = _ordinary_backward_profile(m, s, case)
    wrapped: dict[int, nn.Module] = dict(modules)
    if case.fsdp:
        from torch.distributed.fsdp import fully_shard

        for s, m in modules.items():
            for part in (m.inp, m.block, m.head):
                if part is not None:
                    fully_shard(part, mesh=mesh["dp"], reshard_after_forward=False)
            wrapped[s] = fully_shard(m, mesh=mesh["dp"], reshard_after_forward=False)

    def make(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(300 + step)
        n = n_replicas * MB_BATCH * N_MICROBATCHES
        return torch.randn(n, SEQ, DIM, generator=g), torch.randn(n, SEQ, DIM, generator=g)

    n_replicas = DP if case.fsdp else 1
    # no FLOP counter where eager DTensor code runs under it (see tp_harness.Phase)
    observers = [W.RegionRuns.observer] + ([W.MatmulCounter.observer()] if case.compile == "all" else [])
    out = multirank.drive(multirank.Run(
        name=f"{case.name} rank {rank}", schedule=case.schedule, stage_ids=stage_ids, n_stages=n_stages,
        modules=modules, wrapped=wrapped, group=mesh["pp"].get_group(), reference=reference,
        step_data=dh.replica_data(make, reference, dp_rank, n_replicas, N_MICROBATCHES, MB_BATCH * N_MICROBATCHES),
        loss_fn=ph.loss_fn, microbatches=N_MICROBATCHES, steps=N_STEPS, lr=LR, observers=observers,
        profile_last=True))
    return {
        **out,  # losses, grads_checked, actions and collectives (last step)
        "case": case.name,
        "rank": rank,
        "pp_rank": pp_rank,
        "stages": stage_ids,
        "yardstick": yardstick,
        "weight_grad_flops": weight_flops,
        "input_proj_flops": input_proj_flops,
    }
