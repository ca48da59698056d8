"""Tensor x pipeline (x FSDP2) parallelism: a small Llama-style LM on ZB-V, CPU with gloo.

    torchrun --nproc-per-node 4 examples/tp_pp_torchrun.py [--tp 2] [--dp 1] [--no-sp]
        [--compiler inductor|eager] [--backend fxsplit|inductor] [--whole-nodes once|again] [--steps 3]

The ranks form a ``(pp, dp, tp)`` device mesh, tensor parallelism innermost
(``tp`` consecutive ranks, on one node when run on several). Each pipeline
rank holds two stages of the model (V placement: pipeline rank r holds
stages r and 2*pp-1-r); stage 0 starts with the token embedding, the last
stage ends with the final norm and the output projection. Every module is
laid out as torchtitan lays it out, with ``parallelize_module`` over ``tp``:
the blocks with :func:`tp_block.block_plan` (``examples/tp_block.py``) (q/k/v and w1/w3
column-wise, o and w2 row-wise; with sequence parallelism, the default, the
norms run on sequence shards), the embedding row-wise, the output projection
column-wise to replicated logits. Then every block (and the embedding and
the head, modules of our own classes) is compiled in place with the fxsplit
backend, then, with ``--dp`` > 1, sharded with ``fully_shard`` over ``dp``,
and the stages run ``ScheduleZBVZeroBubble`` over
:class:`fxsplit.pipelining.PipelineStage`.

At ``I`` the compiled dI graphs run, with the tensor-parallel collectives of
the input-gradient chain; at ``W`` the compiled dW graphs run, communicating
nothing (with sequence parallelism, the all-gathered output gradient that a
weight-gradient matmul also reads is kept from ``I``). The last step is
profiled: rank 0 prints the collectives every rank issued by action, and
each rank's fxsplit region counters.

``--backend inductor`` compiles the same modules with ``backend="inductor"``
instead, for comparison: fxsplit's stage then splits them eagerly. Each
region's whole compiled backward runs once, at ``I``, and ``W`` commits the
weight gradients it kept (``fxsplit.config.whole_nodes="once"``, the
default); ``--whole-nodes again`` splits them as upstream splits compiled
stages: the whole backward at ``I``, and again at ``W``, every collective
included.
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
from torch.distributed.pipelining import ScheduleZBVZeroBubble
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import fxsplit
from fxsplit.bench.models import RMSNorm
from tp_block import TPBlock, block_plan  # examples/tp_block.py, beside this script
from fxsplit.pipelining import PipelineStage


class Embedding(nn.Module):
    """The token embedding, in a class of our own so that it compiles in place."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


class Stage(nn.Module):
    def __init__(self, args: argparse.Namespace, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = Embedding(args.vocab, args.dim) if first else None
        self.layers = nn.ModuleList(TPBlock(args.dim, args.heads, args.hidden) for _ in range(args.blocks_per_stage))
        self.head = Head(args.dim, args.vocab) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def parallelize(stage: Stage, tp_mesh: object, sp: bool) -> None:
    """torchtitan's layout: embedding row-wise (sharded over the vocabulary), the
    blocks' plan, output column-wise to replicated logits; with sequence
    parallelism the activations between them are sharded on the sequence (dim 1)."""
    plan = {}
    if stage.embed is not None:
        plan["embed.tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                       output_layouts=Shard(1) if sp else Replicate())
    for k in range(len(stage.layers)):
        plan.update(block_plan(sp, prefix=f"layers.{k}."))
    if stage.head is not None:
        if sp:
            plan["head.norm"] = SequenceParallel()
        plan["head.output"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                              output_layouts=Replicate())
    parallelize_module(stage, tp_mesh, plan)


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
        action, parent, nested = "schedule", evt.cpu_parent, False
        while parent is not None:
            nested = nested or parent.name.startswith("c10d::")
            if parent.name.startswith("action ") and action == "schedule":
                action = parent.name.split(":")[1].rstrip("0123456789")
            parent = parent.cpu_parent
        if not nested:
            counts[(evt.name[len("c10d::"):], action)] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (innermost mesh dimension)")
    parser.add_argument("--dp", type=int, default=1, help="FSDP2 degree (the rest of the world is pp)")
    parser.add_argument("--no-sp", dest="sp", action="store_false",
                        help="tensor parallelism without sequence parallelism")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "eager"],
                        help="fxsplit's inner compiler")
    parser.add_argument("--backend", default="fxsplit", choices=["fxsplit", "inductor"],
                        help="inductor: no ahead-of-time split, for comparison (the eager split runs each "
                             "region's whole backward at I)")
    parser.add_argument("--whole-nodes", default="once", choices=["once", "again"],
                        help="fxsplit.config.whole_nodes for --backend inductor: again re-runs each region's "
                             "whole backward at W, as upstream's split does")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--blocks-per-stage", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="also record this run (losses, collectives per rank and action) in this "
                                      "JSON file, under a key naming the backend, next to other runs")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets MASTER_ADDR/PORT, RANK, WORLD_SIZE
    world = dist.get_world_size()
    if world % (args.tp * args.dp):
        raise SystemExit(f"--tp {args.tp} x --dp {args.dp} must divide the world size {world}")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    pp = world // (args.tp * args.dp)
    mesh = init_device_mesh("cpu", (pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    n_stages = 2 * pp
    stage_ids = [pp_rank, n_stages - 1 - pp_rank]  # V placement

    torch.manual_seed(0)  # the same initial weights on every rank; each keeps its shards of its stages
    all_stages = [Stage(args, first=(s == 0), last=(s == n_stages - 1)) for s in range(n_stages)]
    fxsplit.config.whole_nodes = args.whole_nodes
    if args.backend == "inductor":
        # W runs regions' backwards with the graph kept (stage 0's, which has no input gradient for
        # I to compute; with --whole-nodes again every region's), which donated buffers forbid
        torch._functorch.config.donated_buffer = False
    backend = fxsplit.backend(compiler=args.compiler) if args.backend == "fxsplit" else "inductor"
    stages = []
    for s in stage_ids:
        module = all_stages[s]
        parallelize(module, mesh["tp"], args.sp)
        parts = [p for p in (module.embed, *module.layers, module.head) if p is not None]
        for part in parts:
            part.compile(backend=backend)  # in place: the ZB schedules refuse torch.compile's wrapper
        if args.dp > 1:
            from torch.distributed.fsdp import fully_shard

            for part in parts:
                fully_shard(part, mesh=mesh["dp"], reshard_after_forward=False)
            fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
        stages.append(LabelledStage(module, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    opt = torch.optim.SGD([p for st in stages for p in st.submod.parameters()], lr=1e-2)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))

    schedule = ScheduleZBVZeroBubble(stages, args.microbatches, loss_fn=loss_fn)
    local = args.microbatch_size * args.microbatches
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.dp * local, args.seq + 1), generator=g)  # the global batch
    x, y = tokens[:, :-1], tokens[:, 1:]
    mine = slice(dp_rank * local, (dp_rank + 1) * local)  # this replica's share; the same on every tp rank

    step_losses: list[float] = []
    for step in range(args.steps):
        losses: list[torch.Tensor] = []
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profiler if step == args.steps - 1 else contextlib.nullcontext():
            # pipeline rank 0 holds the first and the last stage of the V
            schedule.step(x[mine], target=y[mine], losses=losses) if pp_rank == 0 else schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if pp_rank == 0:
            mean = torch.stack([v.detach() for v in losses]).mean()
            dist.all_reduce(mean, group=mesh["dp"].get_group())  # average over the replicas
            if dist.get_rank() == 0:
                step_losses.append(round(mean.item() / args.dp, 6))
                print(f"step {step}{' (compiles)' if step == 0 else ''}: loss {mean.item() / args.dp:.4f}", flush=True)

    counters = collections.Counter()
    for region in fxsplit.compiled_regions():
        counters.update(region.stats)
    comm = collectives(profiler)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (stage_ids, dict(counters), comm))
    if dist.get_rank() == 0:
        print(f"\nTP (tp={args.tp}, sequence parallel: {args.sp}) x ZB-V (pp={pp})"
              f"{f' x FSDP2 (dp={args.dp})' if args.dp > 1 else ''}, {args.microbatches} microbatches, "
              f"{f'compiler={args.compiler}' if args.backend == 'fxsplit' else f'backend=inductor, whole_nodes={args.whole_nodes}'}, "
              f"torch {torch.__version__}")
        for r, (ids, c, cm) in enumerate(gathered):
            print(f"rank {r} stages {ids}: fxsplit counters (all steps) {c}")
            for (op, action), n in sorted(cm.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                print(f"    last step: {n} x {op} in {action}")
        if args.out:
            record(args, gathered, step_losses)
    dist.destroy_process_group()


def record(args: argparse.Namespace, gathered: list, losses: list[float]) -> None:
    """Add this run to the JSON file ``args.out`` (its provenance at the top level: the last run's)."""
    import json
    import sys
    from pathlib import Path

    from fxsplit.bench.settings import provenance

    label = "fxsplit" if args.backend == "fxsplit" else f"inductor-whole_nodes-{args.whole_nodes}"
    command = "torchrun --nproc-per-node {} examples/tp_pp_torchrun.py {}".format(
        dist.get_world_size(), " ".join(sys.argv[1:]))
    path = Path(args.out)
    doc = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    run = {**provenance(command), "losses": losses, "collectives_last_step": {
        f"rank {r}": {"stages": ids, "by_action": {f"{action}: {op}": n for (op, action), n in sorted(cm.items())}}
        for r, (ids, _, cm) in enumerate(gathered)}}
    doc["runs"][label] = run
    doc.update({k: run[k] for k in ("command", "code_revision", "torch_version")},
               device=f"cpu (gloo, {dist.get_world_size()} ranks)",
               what="collectives per rank and action in the last step of ZB-V over TP stages; losses per step")
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"recorded as {label!r} in {path}")


if __name__ == "__main__":
    main()
