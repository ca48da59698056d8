"""Data parallelism x pipeline parallelism (CPU, gloo, 4 ranks): the DDP and FSDP2 cases of :mod:`multirank`.

The 4 ranks form a 2 x 2 device mesh (``dp`` x ``pp``): ranks 0 and 1 are
one pipeline (replica 0), ranks 2 and 3 the other (replica 1); ranks 0 and 2
hold the same stages and synchronise their gradients over the ``dp`` group.

Each case builds the transformer of :mod:`pipeline_harness` in every rank from
the same seed, compiles each stage module with fxsplit (whole stage or per
block, in place), wraps it in DDP or shards it with FSDP2 over the ``dp`` mesh
dimension, and runs two optimizer steps of an upstream schedule through
:func:`multirank.drive`, against a single-process eager reference run on the
full (global) batch: every microbatch loss, and every parameter's full
gradient (FSDP2: ``grad.full_tensor()``). It returns, per action of the last
step, the fxsplit region counters, FLOPs and the collectives issued, so the
tests can check where gradient synchronisation happened.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import multirank
import pipeline_harness as ph
from fxsplit.bench import world as W

DP = 2
PP = 2
WORLD = DP * PP
DP_COLLECTIVES = ("allreduce_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_scatter_",
                  "_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_")


@dataclasses.dataclass
class DPCase:
    """One dp x pp run: ``wrapper`` is ``"ddp"`` or ``"fsdp"``; ``compile`` is
    ``"stage"`` (``stage_module.compile``) or ``"blocks"`` (``block.compile`` per block)."""

    schedule: str
    wrapper: str
    compile: str = "stage"
    reshard_after_forward: bool = True  # FSDP2 only
    compiler: str = "eager"

    @property
    def name(self) -> str:
        extra = f"-raf{int(self.reshard_after_forward)}" if self.wrapper == "fsdp" else ""
        return f"{self.schedule}-{self.wrapper}{extra}-{self.compile}-{self.compiler}"


def make_global_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: DP replicas x N_MICROBATCHES microbatches."""
    g = torch.Generator().manual_seed(200 + step)
    n = DP * ph.MB_BATCH * ph.N_MICROBATCHES
    return torch.randn(n, ph.SEQ, ph.D_MODEL, generator=g), torch.randn(n, ph.SEQ, ph.D_MODEL, generator=g)


def reference_step(stages: list[torch.nn.Module], x: torch.Tensor, y: torch.Tensor, replicas: int = DP,
                   microbatches: int = ph.N_MICROBATCHES) -> list[float]:
    """Single process, full batch: the mean of the per-microbatch losses (microbatches
    of all replicas, replica-major), one backward. Returns every microbatch's loss."""
    h = x
    for s in stages:
        h = s(h)
    n = replicas * microbatches
    losses = [ph.loss_fn(o, t) for o, t in zip(h.chunk(n), y.chunk(n))]
    torch.stack(losses).mean().backward()
    return [float(v) for v in losses]


def replica_data(make: Any, reference: list[torch.nn.Module], dp_rank: int, replicas: int, microbatches: int,
                 local: int) -> Any:
    """``step_data`` for :class:`multirank.Run` where ``replicas`` data replicas share the
    global batch ``make(step)``: the reference runs all of it, this rank gets its share."""

    def step_data(step: int) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        x, y = make(step)
        losses = reference_step(reference, x, y, replicas, microbatches)
        mine = slice(dp_rank * local, (dp_rank + 1) * local)
        return x[mine], y[mine], losses[dp_rank * microbatches:(dp_rank + 1) * microbatches]

    return step_data


def _wrap(case: DPCase, module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    if case.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=mesh["dp"].get_group())
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=case.reshard_after_forward)
    return fully_shard(module, mesh=mesh["dp"], reshard_after_forward=case.reshard_after_forward)


def run_dp_case(case: DPCase, rank: int, world: int) -> dict[str, Any]:
    """One case in one rank (see the module docstring); returns what the tests check."""
    from torch.distributed.device_mesh import init_device_mesh

    import fxsplit

    assert world == WORLD, f"the dp x pp harness needs {WORLD} ranks, got {world}"
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    stage_ids, n_stages = W.stage_ids(case.schedule, pp_rank, PP)
    reference = ph.build_reference(n_stages)
    modules = multirank.deep_copies(reference, stage_ids)
    backend = fxsplit.backend(compiler=case.compiler, fallback="error")
    for m in modules.values():
        for part in [m] if case.compile == "stage" else m.blocks:
            part.compile(backend=backend)
    wrapped = {s: _wrap(case, m, mesh) for s, m in modules.items()}
    out = multirank.drive(multirank.Run(
        name=f"{case.name} rank {rank}", schedule=case.schedule, stage_ids=stage_ids, n_stages=n_stages,
        modules=modules, wrapped=wrapped, group=mesh["pp"].get_group(), reference=reference,
        step_data=replica_data(make_global_data, reference, dp_rank, DP, ph.N_MICROBATCHES,
                               ph.MB_BATCH * ph.N_MICROBATCHES),
        loss_fn=ph.loss_fn, microbatches=ph.N_MICROBATCHES, steps=ph.N_STEPS, lr=ph.LR,
        profile_last=True, keep_grads=True))
    return {
        **out,  # losses, grads_checked, actions and collectives (last step), grads
        "case": case.name,
        "wrapper": case.wrapper,
        "schedule": case.schedule,
        "rank": rank,
        "dp_rank": dp_rank,
        "pp_rank": pp_rank,
        "stages": stage_ids,
        "n_stages": n_stages,
        "n_fsdp_groups": {s: _n_fsdp_param_groups(w) for s, w in wrapped.items()},
        "weight_grad_flops": {s: ph.weight_grad_flops(m) for s, m in modules.items()},
        "reference_flops": {s: ph.reference_backward_flops(reference[s], s == 0, s == n_stages - 1)
                            for s in stage_ids},
    }


def _n_fsdp_param_groups(module: torch.nn.Module) -> int:
    """FSDP modules that own parameters (each reduce-scatters once per step)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(1 for m in module.modules() if isinstance(m, FSDPModule) and _owns_params(m))


def _owns_params(m: torch.nn.Module) -> bool:
    """Whether ``m`` (an FSDP module) owns parameters not owned by a nested FSDP module."""
    from torch.distributed.fsdp import FSDPModule

    owned_elsewhere = {id(p) for sub in m.modules() if sub is not m and isinstance(sub, FSDPModule)
                       for p in sub.parameters()}
    return any(id(p) not in owned_elsewhere for p in m.parameters())
