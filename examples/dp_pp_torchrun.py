"""Data parallel x pipeline parallel: FSDP2-sharded, fxsplit-compiled stages on ZB-V, CPU with gloo.

    torchrun --nproc-per-node 4 examples/dp_pp_torchrun.py [--dp 2] [--compiler inductor|eager]
        [--steps 3] [--no-reshard-after-forward]

The ranks form a (dp, pp) device mesh: ``dp`` pipeline replicas, each of
``pp = world / dp`` ranks. Each rank holds two stages of a small GPT-style
stack (V placement within its replica: pipeline rank r holds stages r and
2*pp-1-r). Every transformer block is compiled in place with the fxsplit
backend and sharded with ``fully_shard`` over the ``dp`` dimension, then the
stage module itself is sharded (the stage's root), and the stages run
``ScheduleZBVZeroBubble`` over :class:`fxsplit.pipelining.PipelineStage`.

At ``I`` the blocks run their compiled dI graphs, at ``W`` their compiled dW
graphs (accumulating into FSDP's unsharded gradients through autograd); the
schedule's ``REDUCE_GRAD`` action reduce-scatters each block's gradients once
per step, after the stage's last ``W``, then scales them by 1/microbatches.
The last step is profiled: rank 0 prints the collectives it issued and the
action each ran in, and every rank's fxsplit region counters.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import ScheduleZBVZeroBubble

import fxsplit
from fxsplit.bench.models import Block  # the benchmark's pre-LN transformer block
from fxsplit.pipelining import PipelineStage


class Stage(nn.Module):
    """A run of blocks; the last stage also has the final LayerNorm and output head."""

    def __init__(self, d: int, heads: int, n_blocks: int, last: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n_blocks))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


class LabelledStage(PipelineStage):
    """Names each action in the profiler, so the collectives can be told apart by action."""

    def forward_one_chunk(self, mb: int, *args, **kwargs):  # type: ignore[no-untyped-def]
        with torch.profiler.record_function(f"action {self.stage_index}:F{mb}"):
            return super().forward_one_chunk(mb, *args, **kwargs)

    def backward_one_chunk(self, mb: int, *args, full_backward: bool = True, **kwargs):  # type: ignore[no-untyped-def]
        with torch.profiler.record_function(f"action {self.stage_index}:{'B' if full_backward else 'I'}{mb}"):
            return super().backward_one_chunk(mb, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(self, mb: int, *args, **kwargs):  # type: ignore[no-untyped-def]
        with torch.profiler.record_function(f"action {self.stage_index}:W{mb}"):
            return super().backward_weight_one_chunk(mb, *args, **kwargs)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        with torch.profiler.record_function(f"action {self.stage_index}:REDUCE_GRAD"):
            super().perform_reduce_grad(grad_scale_factor)


def collectives(prof: torch.profiler.profile) -> collections.Counter:
    """(c10d op, action kind) -> count, for the outermost c10d ops the profiler saw
    (point-to-point sends and receives left out)."""
    counts: collections.Counter = collections.Counter()
    for evt in prof.events():
        if not evt.name.startswith("c10d::") or evt.name in ("c10d::send", "c10d::recv_"):
            continue
        action, parent, nested = "schedule (UNSHARD)", evt.cpu_parent, False
        while parent is not None:
            nested = nested or parent.name.startswith("c10d::")
            if parent.name.startswith("action ") and action.startswith("schedule"):
                action = parent.name.split(":")[1].rstrip("0123456789")
            parent = parent.cpu_parent
        if not nested:
            counts[(evt.name[len("c10d::"):], action)] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2, help="pipeline replicas (the rest of the world is pp)")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks-per-stage", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                        help="keep each block's parameters gathered for the whole step (fewer all-gathers)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets MASTER_ADDR/PORT, RANK, WORLD_SIZE
    world = dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} must divide the world size {world}")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    mesh = init_device_mesh("cpu", (args.dp, world // args.dp), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank(), mesh["pp"].size()
    n_stages = 2 * pp
    stage_ids = [pp_rank, n_stages - 1 - pp_rank]  # V placement

    torch.manual_seed(0)  # the same initial weights on every rank; each keeps (shards of) its stages
    all_stages = [Stage(args.d_model, args.heads, args.blocks_per_stage, last=(s == n_stages - 1))
                  for s in range(n_stages)]
    backend = fxsplit.backend(compiler=args.compiler)
    stages = []
    for s in stage_ids:
        module = all_stages[s]
        for block in module.blocks:
            block.compile(backend=backend)  # in place: the ZB schedules refuse torch.compile's wrapper
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=args.reshard_after_forward)
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=args.reshard_after_forward)
        stages.append(LabelledStage(module, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    opt = torch.optim.SGD([p for st in stages for p in st.submod.parameters()], lr=1e-2)
    schedule = ScheduleZBVZeroBubble(stages, args.microbatches, loss_fn=lambda out, y: F.mse_loss(out, y))

    local = args.microbatch_size * args.microbatches
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.dp * local, args.seq, args.d_model, generator=g)  # the global batch
    y = torch.randn(args.dp * local, args.seq, args.d_model, generator=g)
    mine = slice(dp_rank * local, (dp_rank + 1) * local)  # this replica's share

    for step in range(args.steps):
        losses: list[torch.Tensor] = []
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profiler if step == args.steps - 1 else contextlib.nullcontext():
            # pipeline rank 0 holds the first and the last stage of its replica's V
            schedule.step(x[mine], target=y[mine], losses=losses) if pp_rank == 0 else schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if pp_rank == 0:
            mean = torch.stack([v.detach() for v in losses]).mean()
            dist.all_reduce(mean, group=mesh["dp"].get_group())  # average over the replicas
            if dp_rank == 0:
                print(f"step {step}{' (compiles)' if step == 0 else ''}: loss {mean.item() / args.dp:.4f}", flush=True)

    counters = collections.Counter()
    for region in fxsplit.compiled_regions():
        counters.update(region.stats)
    comm = collectives(profiler)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (stage_ids, dict(counters), comm))
    if dist.get_rank() == 0:
        print(f"\nFSDP2 (dp={args.dp}) x ZB-V (pp={pp}), {args.microbatches} microbatches, compiler={args.compiler}, "
              f"reshard_after_forward={args.reshard_after_forward}, torch {torch.__version__}")
        for r, (ids, c, cm) in enumerate(gathered):
            print(f"rank {r} stages {ids}: fxsplit counters (all steps) {c}")
            for (op, action), n in sorted(cm.items()):
                print(f"    last step: {n} x {op} in {action}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
