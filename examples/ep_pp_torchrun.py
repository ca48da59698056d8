"""Expert x pipeline parallelism: MoE stages on a zero-bubble schedule, CPU with gloo (NCCL on GPUs).

    torchrun --nproc-per-node 4 examples/ep_pp_torchrun.py [--ep 2] [--schedule zbv|interleaved-zb|dualpipev]
        [--experts loop|grouped_mm] [--compiler inductor|eager] [--steps 3]

The ranks form a ``(pp, ep)`` device mesh, expert parallelism innermost. Each
pipeline rank holds two stages (V placement for ZB-V and DualPipeV, looped for
interleaved ZB); each stage is a mixture-of-experts block: a dense projection,
a softmax router choosing the top 2 experts per token, and experts sharded
over ``ep``. Tokens reach their experts as torchtitan's all-to-all token
dispatcher sends them: each rank counts its tokens per expert, the counts go
through one all-to-all, the tokens through ``all_to_all_single_autograd`` with
the split sizes those counts give (``.tolist()``: a graph break), the local
experts run (a loop, or ``torch._grouped_mm`` in bfloat16), and a second
all-to-all brings the results back. Each stage module is compiled in place
with fxsplit: a stage is several compiled regions between the graph breaks,
each split ahead of time.

What runs where, per microbatch and stage (printed from a profile of the last
step): the forward issues 3 all-to-alls (counts, tokens, results); ``I``
issues 2 (the backward of the token and result all-to-alls: input-gradient
work), and runs no expert weight-gradient matmul; ``W`` issues none and runs
the expert weight-gradient matmuls from what ``I`` kept. Each ep rank is a
data replica for the dense weights: reduce their gradients over ``ep`` (and
over your data-parallel dimension) before the optimizer step, as torchtitan
does with FSDP over the ranks that include ``ep``; this example does it with
one all-reduce.
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
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

import fxsplit
from fxsplit.pipelining import PipelineStage

SCHEDULES = {"zbv": ScheduleZBVZeroBubble, "interleaved-zb": ScheduleInterleavedZeroBubble,
             "dualpipev": ScheduleDualPipeV}


class MoEBlock(nn.Module):
    """x + experts(route(proj(x))), the experts of ``expert_ids`` on this rank."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, ep: int, ep_rank: int,
                 group: object, experts: str) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.ep, self.local = n_experts, top_k, ep, n_experts // ep
        self.group, self.mode = group, experts
        self.proj = nn.Linear(dim, dim)
        self.router = nn.Linear(dim, n_experts, bias=False)
        dtype = torch.bfloat16 if experts == "grouped_mm" else torch.float32
        g = torch.Generator().manual_seed(100 + ep_rank)  # each rank's own experts
        self.w_in = nn.Parameter(torch.randn(self.local, dim, hidden, generator=g, dtype=dtype) * dim**-0.5)
        self.w_out = nn.Parameter(torch.randn(self.local, hidden, dim, generator=g, dtype=dtype) * hidden**-0.5)

    def experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.mode == "grouped_mm":
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = F.gelu(torch._grouped_mm(rows.to(torch.bfloat16), self.w_in, offs=offs))
            return torch._grouped_mm(h, self.w_out, offs=offs).to(rows.dtype)
        parts = rows.split(counts.tolist())
        return torch.cat([F.gelu(p @ self.w_in[e]) @ self.w_out[e] for e, p in enumerate(parts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.proj(x).reshape(b * t, d)
        weights, chosen = self.router(h).softmax(-1).topk(self.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        rows = h[order // self.top_k]
        counts = torch.bincount(flat, minlength=self.n_experts)
        # dispatch: counts, then tokens, to the ranks owning the experts
        received = all_to_all_single(counts, None, None, self.group)
        send = counts.view(self.ep, self.local).sum(1).tolist()
        recv = received.view(self.ep, self.local).sum(1).tolist()
        got = all_to_all_single_autograd(rows, recv, send, self.group)
        expert_of_row = torch.arange(self.local).repeat(self.ep).repeat_interleave(received, output_size=got.shape[0])
        perm = expert_of_row.argsort(stable=True)
        out = self.experts(got[perm], received.view(self.ep, self.local).sum(0))
        back = all_to_all_single_autograd(torch.empty_like(out).index_copy(0, perm, out), send, recv, self.group)
        combined = torch.zeros_like(h).index_add(0, order // self.top_k, back * weights.reshape(-1)[order].unsqueeze(1))
        return x + combined.reshape(b, t, d)


class CountingStage(PipelineStage):
    """fxsplit's PipelineStage, labelling each action for the profile."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: object, **kwargs: object) -> object:
        with torch.profiler.record_function(f"action:{self.stage_index}:F"):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: object = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        with torch.profiler.record_function(f"action:{self.stage_index}:{'B' if full_backward else 'I'}"):
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        with torch.profiler.record_function(f"action:{self.stage_index}:W"):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)


def all_to_alls(profiler: torch.profiler.profile) -> collections.Counter:
    """All-to-alls per action kind (``stage:F|I|W|B``) in the profile."""
    found: collections.Counter = collections.Counter()
    for evt in profiler.events():
        if evt.name.startswith("c10d::alltoall"):
            parent = evt.cpu_parent
            while parent is not None and not parent.name.startswith("action:"):
                parent = parent.cpu_parent
            found[parent.name[len("action:"):] if parent is not None else "schedule"] += 1
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree (innermost mesh dimension)")
    parser.add_argument("--schedule", default="zbv", choices=sorted(SCHEDULES))
    parser.add_argument("--experts", default="loop", choices=["loop", "grouped_mm"])
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--experts-total", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # "nccl" on GPUs; torchrun sets MASTER_ADDR/PORT, RANK, WORLD_SIZE
    world = dist.get_world_size()
    if world % args.ep or args.experts_total % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide the world size {world} and --experts-total {args.experts_total}")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    pp = world // args.ep
    mesh = init_device_mesh("cpu", (pp, args.ep), mesh_dim_names=("pp", "ep"))
    pp_rank, ep_rank = mesh["pp"].get_local_rank(), mesh["ep"].get_local_rank()
    n_stages = 2 * pp
    v = args.schedule in ("zbv", "dualpipev")
    stage_ids = [pp_rank, n_stages - 1 - pp_rank] if v else [pp_rank, pp_rank + pp]

    backend = fxsplit.backend(compiler=args.compiler)
    stages = []
    for s in stage_ids:
        torch.manual_seed(s)  # the dense weights of a stage: the same on every ep rank
        block = MoEBlock(args.dim, args.hidden, args.experts_total, 2, args.ep, ep_rank, mesh["ep"].get_group(),
                         args.experts)
        block.compile(backend=backend)  # in place: the zero-bubble schedules refuse torch.compile's wrapper
        stages.append(CountingStage(block, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    dense = [p for st in stages for n, p in st.submod.named_parameters() if not n.startswith("w_")]
    opt = torch.optim.SGD([p for st in stages for p in st.submod.parameters()], lr=1e-2)
    schedule = SCHEDULES[args.schedule](stages, args.microbatches, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(1 + ep_rank)  # each ep rank its own data
    x = torch.randn(args.microbatch_size * args.microbatches, args.seq, args.dim, generator=g)
    y = torch.randn_like(x)

    for step in range(args.steps):
        losses: list[torch.Tensor] = []
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profiler if step == args.steps - 1 else contextlib.nullcontext():
            schedule.step(x, target=y, losses=losses) if pp_rank == 0 else schedule.step()
        for p in dense:  # the dense weights are replicated over ep: average their gradients
            dist.all_reduce(p.grad, group=mesh["ep"].get_group())
            p.grad /= args.ep
        opt.step()
        opt.zero_grad(set_to_none=True)
        if pp_rank == 0 and ep_rank == 0:
            print(f"step {step}{' (compiles)' if step == 0 else ''}: loss "
                  f"{torch.stack([v.detach() for v in losses]).mean().item():.4f}", flush=True)

    counters = collections.Counter()
    for region in fxsplit.compiled_regions():
        counters.update(region.stats)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (stage_ids, len(fxsplit.compiled_regions()), dict(counters),
                                      dict(all_to_alls(profiler)), [str(f) for f in fxsplit.fallbacks()]))
    if dist.get_rank() == 0:
        print(f"\nEP (ep={args.ep}, {args.experts_total} experts, {args.experts}) x {args.schedule} (pp={pp}), "
              f"{args.microbatches} microbatches, compiler={args.compiler}, torch {torch.__version__}")
        for r, (ids, n_regions, c, a2a, fallbacks) in enumerate(gathered):
            print(f"rank {r} stages {ids}: {n_regions} compiled regions, counters (all steps) {c}"
                  f"{f', fallbacks {fallbacks}' if fallbacks else ''}")
            print(f"    last step, all-to-alls per action kind: {dict(sorted(a2a.items()))}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
