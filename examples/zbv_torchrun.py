"""ZB-V zero-bubble pipeline with fxsplit-compiled stages, on CPU with gloo.

    torchrun --nproc-per-node 2 examples/zbv_torchrun.py [--compiler inductor|eager] [--steps 4]

Each rank holds two stages of a small GPT-style stack (V placement: rank r
holds stages r and 2*world-1-r), each stage module compiled in place with the
fxsplit backend, and drives them with the upstream ``ScheduleZBVZeroBubble``.
The first step compiles every stage (forward, dI, dW and fused backward
graphs of each region; a minute or two on CPU): rank 0 prints each region
as it is compiled and a line every 15 s until the step ends.
Rank 0 then prints the mean time of each action kind per stage (F forward,
I input-gradient backward, W weight-gradient backward), the bubble rate
implied by the schedule's slot table (idle slots / all slots), and the
bubble rate of the same schedule replayed with the measured action times.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fxsplit.bench.models import Block  # the benchmark's pre-LN transformer block
from torch.distributed.pipelining import ScheduleZBVZeroBubble

import fxsplit
from fxsplit.pipelining import PipelineStage


class Stage(nn.Module):
    def __init__(self, d: int, heads: int, n_blocks: int, last: bool) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(n_blocks)))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) if last else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class TimedStage(PipelineStage):
    """fxsplit's stage, recording the wall time of every F, I/B and W action."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.recording = False

    def _timed(self, kind: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        if self.recording:
            self.times[kind].append(time.perf_counter() - t0)
        return out

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("F", lambda: super(TimedStage, self).forward_one_chunk(*args, **kwargs))

    def backward_one_chunk(self, *args: Any, full_backward: bool = True, **kwargs: Any) -> None:
        kind = "B" if full_backward else "I"
        self._timed(kind, lambda: super(TimedStage, self).backward_one_chunk(
            *args, full_backward=full_backward, **kwargs))

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        self._timed("W", lambda: super(TimedStage, self).backward_weight_one_chunk(*args, **kwargs))


@contextlib.contextmanager
def compile_progress(enabled: bool, every_s: float = 15.0) -> Iterator[None]:
    """While the first step compiles: fxsplit's INFO line for each region compiled, and a heartbeat."""
    if not enabled:
        yield
        return
    log = logging.getLogger("fxsplit")
    level = log.level
    log.setLevel(logging.INFO)  # "fxsplit: compiled regionN with inductor: ..." per region
    t0 = time.perf_counter()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(every_s):
            print(f"step 0: still compiling, {time.perf_counter() - t0:.0f} s", flush=True)

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        yield
    finally:
        done.set()
        beat.join()
        log.setLevel(level)


def slot_bubble_rate(order: dict[int, list[Any]]) -> float:
    """Idle slots / all slots of the schedule's compute table (every action counted as one slot)."""
    width = max(len(actions) for actions in order.values())
    idle = sum(width - len(actions) + sum(a is None for a in actions) for actions in order.values())
    return idle / (width * len(order))


def replayed_bubble_rate(order: dict[int, list[Any]], durations: dict[tuple[int, str], float],
                         n_stages: int) -> tuple[float, float]:
    """Replay the schedule with measured per-(stage, kind) durations (communication taken as free).

    Each rank runs its actions in order; an action starts when its rank is
    free and its inputs exist: F(s, m) after F(s-1, m); I/B(s, m) after
    F(s, m) and I/B(s+1, m); W(s, m) after I(s, m). Returns
    (bubble rate = 1 - busy / (ranks * makespan), makespan seconds).
    """
    done: dict[tuple[str, int, int], float] = {}
    queues = {r: [a for a in actions if a is not None] for r, actions in order.items()}
    free = dict.fromkeys(order, 0.0)
    busy = 0.0
    progress = True
    while progress:
        progress = False
        for r, q in queues.items():
            while q:
                a = q[0]
                kind, s, m = str(a.computation_type.value), a.stage_index, a.microbatch_index
                deps = []
                if kind == "F" and s > 0:
                    deps.append(("F", s - 1, m))
                if kind in ("I", "B"):
                    deps.append(("F", s, m))
                    if s < n_stages - 1:
                        deps.append(("I", s + 1, m))
                if kind == "W":
                    deps.append(("I", s, m))
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                end = start + durations.get((s, kind), 0.0)
                done[(kind, s, m)] = end
                if kind == "B":
                    done[("I", s, m)] = end
                busy += end - start
                free[r] = end
                q.pop(0)
                progress = True
    if any(queues.values()):
        raise RuntimeError("schedule replay deadlocked: the action order has an unmet dependency")
    makespan = max(free.values())
    return 1.0 - busy / (len(order) * makespan), makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks-per-stage", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="measured steps (one more warm-up step compiles)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets MASTER_ADDR/PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    n_stages = 2 * world
    stage_ids = [rank, n_stages - 1 - rank]  # V placement

    torch.manual_seed(0)  # same weights on every rank; each keeps its own stages
    all_stages = [Stage(args.d_model, args.heads, args.blocks_per_stage, last=(s == n_stages - 1))
                  for s in range(n_stages)]
    backend = fxsplit.backend(compiler=args.compiler)
    stages = []
    for s in stage_ids:
        module = all_stages[s]
        module.compile(backend=backend)  # in place: the ZB schedules refuse torch.compile's wrapper
        stages.append(TimedStage(module, s, n_stages, torch.device("cpu")))
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    schedule = ScheduleZBVZeroBubble(stages, args.microbatches, loss_fn=lambda out, y: F.mse_loss(out, y))

    batch = args.microbatch_size * args.microbatches
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, args.seq, args.d_model, generator=g)
    y = torch.randn(batch, args.seq, args.d_model, generator=g)

    step_times = []
    for step in range(args.steps + 1):
        for st in stages:
            st.recording = step > 0
        dist.barrier()
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        if step == 0 and rank == 0:
            print(f"step 0: compiling {n_stages} stages with compiler={args.compiler} "
                  f"(each rank compiles its own two) ...", flush=True)
        with compile_progress(step == 0 and rank == 0):
            # rank 0 holds the first and the last stage of the V
            schedule.step(x, target=y, losses=losses) if rank == 0 else schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        if step > 0:
            step_times.append(time.perf_counter() - t0)
        if rank == 0:
            mean_loss = torch.stack([v.detach() for v in losses]).mean().item()
            print(f"step {step}{' (warm-up, compiles)' if step == 0 else ''}: "
                  f"loss {mean_loss:.4f}, {time.perf_counter() - t0:.3f} s", flush=True)

    counters = collections.Counter()
    for region in fxsplit.compiled_regions():
        counters.update(region.stats)
    local = {(st.stage_index, k): sum(v) / len(v) for st in stages for k, v in st.times.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (local, dict(counters)))

    if rank == 0:
        durations: dict[tuple[int, str], float] = {}
        for part, _ in gathered:
            durations.update(part)
        print(f"\nZB-V, {world} ranks x 2 stages, {args.microbatches} microbatches, compiler={args.compiler}, "
              f"torch {torch.__version__}")
        print("mean action time per microbatch (ms):")
        print(f"{'stage':>5} {'rank':>4} {'F':>8} {'I':>8} {'W':>8} {'B(full)':>8}")
        for s in range(n_stages):
            rank_of = s if s < world else n_stages - 1 - s
            cells = [f"{1e3 * durations[(s, k)]:8.2f}" if (s, k) in durations else f"{'-':>8}"
                     for k in ("F", "I", "W", "B")]
            print(f"{s:>5} {rank_of:>4} " + " ".join(cells))
        for r, (_, c) in enumerate(gathered):
            print(f"rank {r} fxsplit counters (all steps, incl. warm-up): {c}")
        order = schedule.pipeline_order
        print(f"\nbubble rate implied by the schedule's slot table (idle/total slots): "
              f"{slot_bubble_rate(order):.1%}")
        rate, makespan = replayed_bubble_rate(order, durations, n_stages)
        print(f"bubble rate of the schedule replayed with the measured action times: {rate:.1%} "
              f"(makespan {1e3 * makespan:.1f} ms, no communication cost)")
        print(f"measured step time: {1e3 * sum(step_times) / len(step_times):.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
