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

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

# examples/tp_block.py: the Llama-style TP block and its plan, shared with examples/tp_pp_torchrun.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch
import torch.nn as nn

import dp_harness as dh
import pipeline_harness as ph
import tp_harness as th

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


class InputProj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class OutputHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from fxsplit.bench.models import RMSNorm

        self.norm = RMSNorm(DIM)
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def settle(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a plain tensor if an eager DTensor layer returned it as an
    ``AsyncCollectiveTensor`` (its local output while its collective is in
    flight). torch 2.13: such a tensor as a compiled region's input breaks that
    region's backward, with every backend (``aot_eager`` and ``inductor``
    too: a redistribute's backward is handed a plain tensor), so it is
    copied first (its collective waited) when the projection runs eagerly."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return x.clone() if isinstance(x, AsyncCollectiveTensor) else x


class TPStage(nn.Module):
    """One block; stage 0 also has the input projection, the last stage the head."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        from tp_block import TPBlock

        self.inp = InputProj() if first else None
        self.block = TPBlock(DIM, HEADS, HIDDEN)
        self.head = OutputHead() if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = settle(self.inp(x))
        x = self.block(x)
        return self.head(x) if self.head is not None else x


def build_reference() -> list[TPStage]:
    torch.manual_seed(0)
    stages = [TPStage(s == 0, s == N_STAGES - 1) for s in range(N_STAGES)]
    with torch.no_grad():  # norm weights start at 1: make their gradients less special
        for m in stages:
            for p in m.parameters():
                if p.dim() == 1:
                    p.uniform_(0.5, 1.5)
    return stages


def stage_plan(stage: TPStage, sp: bool) -> dict[str, Any]:
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


def _full(g: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    return g.full_tensor() if isinstance(g, DTensor) else g


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


def _stage_class(count_flops: bool) -> type:
    """dp_harness's stage (region counters, FLOPs and collectives per action),
    without the FLOP counter where eager DTensor code runs (see tp_harness.Phase)."""
    base = dh.make_dp_stage_class()
    if count_flops:
        return base

    class NoFlopStage(base):  # type: ignore[misc, valid-type]
        def _record(self, kind: str, mb: int, fn: Any) -> None:
            runs = ph.RegionRuns()
            fn()
            rec = runs.delta()
            rec.update(stage=self.stage_index, kind=kind, mb=mb, flops=None)
            self.actions.append(rec)

    return NoFlopStage


def run_tp_pp_case(case: TPPPCase, rank: int, world: int) -> dict[str, Any]:
    """One case in one rank (see the module docstring); returns what the parent checks."""
    import torch.distributed.pipelining.schedules as schedules
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
    stage_ids, n_stages = ph.stage_ids_for(case.schedule, pp_rank, PP)
    assert n_stages == N_STAGES
    reference = build_reference()
    backend = fxsplit.backend(compiler=case.compiler, fallback="error")
    modules: dict[int, TPStage] = {}
    yardstick: dict[int, tuple[dict[str, int], int]] = {}
    tokens = MB_BATCH * SEQ
    weight_flops: dict[int, int] = {}
    input_proj_flops: dict[int, int] = {}
    for s in stage_ids:
        m = copy.deepcopy(reference[s])
        parallelize_module(m, mesh["tp"], stage_plan(m, case.sp))
        for part in (m.inp, m.block, m.head) if case.compile == "all" else (m.block,):  # in place
            if part is not None:
                part.compile(backend=backend)
        # before FSDP shards them further: each rank's matmuls see the tp shard
        weight_flops[s] = th.weight_grad_flops(m, tokens)
        input_proj_flops[s] = th.weight_grad_flops(m.inp, tokens) if m.inp is not None else 0
        if not case.fsdp:
            yardstick[s] = _ordinary_backward_profile(m, s, case)
        modules[s] = m
    wrapped: dict[int, nn.Module] = dict(modules)
    if case.fsdp:
        from torch.distributed.fsdp import fully_shard

        for s, m in modules.items():
            for part in (m.inp, m.block, m.head):
                if part is not None:
                    fully_shard(part, mesh=mesh["dp"], reshard_after_forward=False)
            wrapped[s] = fully_shard(m, mesh=mesh["dp"], reshard_after_forward=False)

    stage_cls = _stage_class(count_flops=case.compile == "all")
    stages = [stage_cls(wrapped[s], s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for s in stage_ids]
    schedule = getattr(schedules, case.schedule)(stages, N_MICROBATCHES, loss_fn=ph.loss_fn)
    ref_opt = torch.optim.SGD([p for m in reference for p in m.parameters()], lr=LR)
    opt = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=LR)
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids
    n_replicas = DP if case.fsdp else 1
    local = MB_BATCH * N_MICROBATCHES
    step_losses: list[list[float]] = []
    collectives: list[tuple[str, str]] = []
    grads_checked = 0
    for step in range(N_STEPS):
        g = torch.Generator().manual_seed(300 + step)
        x = torch.randn(n_replicas * local, SEQ, DIM, generator=g)
        y = torch.randn(n_replicas * local, SEQ, DIM, generator=g)
        # reference: the mean of every microbatch's loss (all replicas), one backward
        h = x
        for m in reference:
            h = m(h)
        n = n_replicas * N_MICROBATCHES
        ref_losses = [ph.loss_fn(o, t) for o, t in zip(h.chunk(n), y.chunk(n))]
        torch.stack(ref_losses).mean().backward()
        mine = slice(dp_rank * local, (dp_rank + 1) * local)
        for st in stages:
            st.actions.clear()
        losses: list[torch.Tensor] = []
        args = (x[mine],) if has_first else ()
        kwargs: dict[str, Any] = {"target": y[mine], "losses": losses} if has_last else {}
        collectives = dh.step_collecting(schedule, step == N_STEPS - 1, *args, **kwargs) or []
        where = f"{case.name} rank {rank} step {step}"
        if has_last:
            got = [float(v.detach()) for v in losses]
            expected = [float(v.detach()) for v in ref_losses[dp_rank * N_MICROBATCHES:(dp_rank + 1) * N_MICROBATCHES]]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{where}: microbatch losses differ: {m}")
            step_losses.append(got)
        for s, m in modules.items():
            for (name, p), (_, rp) in zip(m.named_parameters(), reference[s].named_parameters(), strict=True):
                full = _full(p.grad)  # a collective over tp (and dp): same order on every rank
                assert full is not None, f"{where}: stage {s} {name}: no gradient"
                torch.testing.assert_close(full, rp.grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda msg, s=s, name=name: f"{where}: stage {s} {name}.grad: {msg}")
                grads_checked += 1
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    actions = [a for st in stages for a in st.actions]
    dh.label_actions(actions, collectives)
    return {
        "case": case.name,
        "rank": rank,
        "pp_rank": pp_rank,
        "stages": stage_ids,
        "losses": step_losses,
        "grads_checked": grads_checked,
        "actions": actions,  # last step
        "collectives": collectives,  # last step: (op, action label)
        "yardstick": yardstick,
        "weight_grad_flops": weight_flops,
        "input_proj_flops": input_proj_flops,
    }
