"""What each rank of ``fxsplit bench --pipeline`` does (a world of :mod:`fxsplit.bench.world`).

Every rank builds the same model (``stages`` stage modules of the benchmark's
blocks, :mod:`fxsplit.bench.models`, same seeds everywhere), and, for each
configuration of :data:`CONFIGS`, its own copy of the stages it holds, compiled
in place and wrapped in a pipeline stage whose ``F``/``I``/``B``/``W`` actions
record their start and end (:func:`fxsplit.bench.world.observed_stage_class`
with a :class:`~fxsplit.bench.world.Clock`). It then:

1. measures the hand-over latency of one activation between two ranks
   (ping-pong, half the round trip);
2. runs ``warmup`` steps of every configuration (the first compiles);
3. probes the costs the schedule generator needs: two recorded steps of ZB-V
   with fxsplit (``F``, ``I``, ``W`` per stage) and of interleaved 1F1B with
   Inductor (full backward), and, per stage, the bytes one microbatch holds
   after ``F`` and after ``I`` (:class:`fxsplit.bench.memory.MemoryMeter`,
   ``PendingWeightGrads.held_bytes``); rank 0 generates the schedule
   (:func:`fxsplit.schedules.generate_schedule`) and sends it to every rank,
   which builds and warms up that configuration too;
4. times ``reps`` rounds, each running one step of every configuration, the
   order rotated by one each round; a step is ``schedule.step()`` between two
   barriers, its time the slowest rank's; it counts which fxsplit backward
   graphs (dI, dW, fused) the timed steps ran;
5. runs one more step of each configuration inside a memory meter (peak bytes
   above the level before the step).

It returns the raw records; the parent process (:mod:`fxsplit.bench.pipeline`)
computes every statistic.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fxsplit.bench import world as W
from fxsplit.bench.models import BlockStack

__all__ = ["CONFIGS", "Config", "RankPlan", "rank_main", "threads_per_rank"]


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured configuration: an upstream schedule class (or ``"generated"``)
    and how its stages are compiled: ``"inductor"`` (upstream's ``PipelineStage``,
    modules compiled in place with Inductor, ordinary backward), ``"fxsplit"``
    (fxsplit's ``PipelineStage``, compiled in place with fxsplit) or ``"eager"``
    (upstream's ``PipelineStage`` on uncompiled modules: upstream's own split)."""

    schedule: str
    backend: str

    @property
    def key(self) -> str:
        return f"{self.schedule}+{self.backend}"


CONFIGS = (
    Config("Schedule1F1B", "inductor"),
    Config("ScheduleInterleaved1F1B", "inductor"),
    Config("ScheduleZBVZeroBubble", "fxsplit"),
    Config("ScheduleInterleavedZeroBubble", "fxsplit"),
    Config("ScheduleDualPipeV", "fxsplit"),
    Config("ScheduleZBVZeroBubble", "eager"),
    Config("generated", "fxsplit"),
)
COST_PROBES = (Config("ScheduleZBVZeroBubble", "fxsplit"), Config("ScheduleInterleaved1F1B", "inductor"))
PROBE_STEPS = 2
# fxsplit region counters (CompiledRegion.stats): which backward graphs the timed steps ran
REGION_COUNTERS = W.REGION_COUNTERS


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """Everything a rank needs to know (picklable: it crosses the spawn)."""

    model: dict[str, Any]  # ModelConfig fields of one stage
    device: str  # "cpu" or "cuda"
    dtype: str
    ranks: int
    microbatches: int
    warmup: int
    reps: int
    compiler: str  # "inductor", or "eager" (a smoke test: no Inductor anywhere)
    timeout_s: float


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


@dataclasses.dataclass
class _Built:
    """One configuration on this rank."""

    config: Config
    stages: list[Any]
    schedule: Any
    n_stages: int
    has_first: bool
    has_last: bool


class _Rank:
    def __init__(self, plan: RankPlan, rank: int) -> None:
        from fxsplit.bench.models import ModelConfig, build
        from fxsplit.bench.settings import DTYPES

        self.plan, self.rank = plan, rank
        self.device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if plan.device == "cuda" else "cpu")
        self.dtype = DTYPES[plan.dtype]
        self.n_fine = 2 * plan.ranks
        cfg = ModelConfig(**plan.model)
        self.templates = [build(cfg, self.device, self.dtype, seed=1000 + s) for s in range(self.n_fine)]
        shape = tuple(self.templates[0].make_input().shape)
        g = torch.Generator(device="cpu").manual_seed(7)
        total = (plan.microbatches * shape[0], *shape[1:])
        self.mb_shape = shape
        self.x = torch.randn(total, generator=g).to(self.device, self.dtype)
        self.y = torch.randn(total, generator=g).to(self.device, self.dtype)
        self.clock = W.Clock(cuda=self.device.type == "cuda")
        import fxsplit

        self.fxsplit_backend = fxsplit.backend(compiler="eager") if plan.compiler == "eager" else fxsplit.backend()

    # -- building -----------------------------------------------------------------------------
    def build(self, config: Config, generated: Any = None) -> _Built:
        import torch.distributed.pipelining as pipelining

        from fxsplit.pipelining import PipelineStage as FxsplitStage

        ids, n_stages = W.stage_ids(config.schedule, self.rank, self.plan.ranks,
                                    generated if config.schedule == "generated" else None)
        stage_cls = W.observed_stage_class(FxsplitStage if config.backend == "fxsplit" else pipelining.PipelineStage)
        stages = []
        for s in ids:
            if config.schedule == "Schedule1F1B":
                # two stages of the finer cut run as one (a class of ours: compile in place traces it)
                module: nn.Module = BlockStack([copy.deepcopy(self.templates[2 * s + k].module) for k in (0, 1)])
            else:
                module = copy.deepcopy(self.templates[s].module)
            if config.backend == "inductor":
                module.compile(backend="aot_eager" if self.plan.compiler == "eager" else "inductor")
            elif config.backend == "fxsplit":
                module.compile(backend=self.fxsplit_backend)
            stage = stage_cls(module, s, n_stages, self.device)
            stage.recorded = ("F", "B", "I", "W")
            stages.append(stage)
        schedule = W.build_schedule(config.schedule, stages, self.plan.microbatches, loss_fn,
                                    generated if config.schedule == "generated" else None)
        return _Built(config, stages, schedule, n_stages, 0 in ids, n_stages - 1 in ids)

    # -- running ------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, built: _Built, record: bool) -> tuple[float, list[tuple[int, str, int, float, float]]]:
        """One ``schedule.step()`` between barriers: (this rank's milliseconds, its
        actions as (stage, kind, microbatch, start ms, end ms) when ``record``)."""
        for st in built.stages:
            st.observers = [self.clock.observer] if record else []
            st.actions = []
        args = (self.x,) if built.has_first else ()
        kwargs: dict[str, Any] = {"target": self.y, "losses": []} if built.has_last else {}
        dist.barrier()
        self._sync()
        self.clock.start()
        t0 = time.perf_counter()
        built.schedule.step(*args, **kwargs)
        self._sync()
        took = (time.perf_counter() - t0) * 1e3
        end = self.clock.now()
        dist.barrier()
        actions = []
        if record:
            for st in built.stages:
                actions += [(a["stage"], a["kind"], a["mb"], self.clock.ms(a["start"]), self.clock.ms(a["end"]))
                            for a in st.actions]
            if self.clock.cuda:
                took = self.clock.ms(end)
        for st in built.stages:
            st.observers = []
            for p in st.submod.parameters():
                p.grad = None
        return took, actions

    def comm_latency_ms(self, rounds: int = 20) -> float:
        """Half the round trip of one microbatch activation between ranks 0 and 1
        (the other ranks wait); broadcast to every rank."""
        buf = torch.zeros(self.mb_shape, device=self.device, dtype=self.dtype)
        took = torch.zeros(1, dtype=torch.float64)
        dist.barrier()
        if self.rank in (0, 1):
            peer = 1 - self.rank
            for i in range(rounds + 2):  # two warm-up round trips
                if i == 2:
                    self._sync()
                    t0 = time.perf_counter()
                if self.rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            self._sync()
            took[0] = (time.perf_counter() - t0) * 1e3 / rounds / 2
        out = took.to(self.device)
        dist.broadcast(out, 0)
        return float(out.item())

    def stage_bytes(self, built: _Built) -> dict[int, dict[str, int]]:
        """Per stage this rank holds in ``built`` (an fxsplit configuration): bytes one
        microbatch holds after its forward (allocator, output included) and after
        ``I`` (``PendingWeightGrads.held_bytes``)."""
        import fxsplit
        from fxsplit.bench.memory import MemoryMeter

        out: dict[int, dict[str, int]] = {}
        for st in built.stages:
            module, s = st.submod, st.stage_index
            x = torch.randn(self.mb_shape, device=self.device, dtype=self.dtype).requires_grad_(s > 0)
            params = list(module.parameters())
            meter = MemoryMeter(self.device)
            with meter.window():
                meter.mark("before")
                y = module(x)
                meter.mark("after_forward")
                _, pending = fxsplit.stage_backward_input([y], [torch.ones_like(y)], [x] if s > 0 else [], params)
            held = int(pending.held_bytes)
            fxsplit.stage_backward_weight(params, pending)
            for p in params:
                p.grad = None
            out[s] = {"activation_bytes": int(meter.levels["after_forward"] - meter.levels["before"]),
                      "live_in_bytes": held}
        return out

    def peak_bytes(self, built: _Built) -> int:
        from fxsplit.bench.memory import MemoryMeter

        meter = MemoryMeter(self.device)
        with meter.window():
            self.step(built, record=False)
        return int(meter.peak)


def _probe_costs(rank: _Rank, built: dict[str, _Built], comm_ms: float) -> Any:
    """The per-stage costs the generator gets (the same on every rank)."""
    from fxsplit.schedules import PipelineCosts, StageCosts

    durations: dict[tuple[int, str], list[float]] = {}
    for config in COST_PROBES:
        for _ in range(PROBE_STEPS):
            _, actions = rank.step(built[config.key], record=True)
            for s, k, _, a, b in actions:
                durations.setdefault((s, k), []).append(b - a)
    local_bytes = rank.stage_bytes(built[COST_PROBES[0].key])
    gathered: list[Any] = [None] * rank.plan.ranks
    dist.all_gather_object(gathered, ({k: sorted(v) for k, v in durations.items()}, local_bytes))
    merged: dict[tuple[int, str], list[float]] = {}
    sizes: dict[int, dict[str, int]] = {}
    for d, b in gathered:
        for k, v in d.items():
            merged.setdefault(k, []).extend(v)
        sizes.update(b)

    def median(s: int, k: str) -> float:
        v = sorted(merged[(s, k)])
        return v[len(v) // 2]

    return PipelineCosts(tuple(
        StageCosts(f=median(s, "F"), i=median(s, "I"), w=median(s, "W"), b=median(s, "B"), comm=comm_ms,
                   activation_bytes=sizes[s]["activation_bytes"], live_in_bytes=sizes[s]["live_in_bytes"])
        for s in range(rank.n_fine)
    ))


def rank_main(plan: RankPlan, rank_id: int, ranks: int) -> dict[str, Any]:
    """What one rank of the world (:func:`fxsplit.bench.world.run_world`) runs: the
    raw records of every configuration; rank 0 reports progress on the way."""
    from fxsplit.schedules import generate_schedule

    say = W.progress
    rank = _Rank(plan, rank_id)
    comm_ms = rank.comm_latency_ms()
    say(f"hand-over of one activation {tuple(rank.mb_shape)} between two ranks: {comm_ms:.3f} ms (ping-pong)")
    built: dict[str, _Built] = {}
    fixed = [c for c in CONFIGS if c.schedule != "generated"]
    for n, config in enumerate(fixed, 1):
        t0 = time.perf_counter()
        built[config.key] = rank.build(config)
        for _ in range(plan.warmup):
            rank.step(built[config.key], record=False)
        say(f"{config.key}: built and warmed up ({plan.warmup} step(s), the first compiles) in "
            f"{time.perf_counter() - t0:.1f} s [{n}/{len(CONFIGS)}]")
    costs = _probe_costs(rank, built, comm_ms)
    generated = None
    if rank_id == 0:
        t0 = time.perf_counter()
        generated = generate_schedule(costs, plan.ranks, plan.microbatches)
        say(f"generated a schedule from the measured costs in {time.perf_counter() - t0:.1f} s: {generated.source} "
            f"({generated.placement} placement), simulated {generated.simulation.step_time:.2f} ms")
    box = [generated]
    dist.broadcast_object_list(box, src=0)
    generated = box[0]
    gen_config = CONFIGS[-1]
    t0 = time.perf_counter()
    built[gen_config.key] = rank.build(gen_config, generated)
    for _ in range(plan.warmup):
        rank.step(built[gen_config.key], record=False)
    say(f"{gen_config.key}: built and warmed up in {time.perf_counter() - t0:.1f} s [{len(CONFIGS)}/{len(CONFIGS)}]")

    steps: dict[str, list[float]] = {c.key: [] for c in CONFIGS}
    actions: dict[str, list[list[tuple[int, str, int, float, float]]]] = {c.key: [] for c in CONFIGS}
    runs = {c.key: dict.fromkeys(REGION_COUNTERS, 0) for c in CONFIGS}
    t0 = time.perf_counter()
    last = t0
    for r in range(plan.reps):
        # each round starts one configuration later, so that none always follows the same one
        for config in CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]:
            counted = W.RegionRuns()
            took, acts = rank.step(built[config.key], record=True)
            for k, n in counted.delta().items():
                runs[config.key][k] += n
            steps[config.key].append(took)
            actions[config.key].append(acts)
        if time.perf_counter() - last > 5 or r == plan.reps - 1:
            last = time.perf_counter()
            say(f"timing: round {r + 1}/{plan.reps}, {last - t0:.0f} s")
    peaks = {c.key: rank.peak_bytes(built[c.key]) for c in CONFIGS}
    say("peak memory per configuration measured")
    return {
        "rank": rank_id,
        "steps_ms": steps,
        "actions": actions,
        "peak_bytes": peaks,
        "region_runs": runs,
        "stages": {c.key: [st.stage_index for st in built[c.key].stages] for c in CONFIGS},
        "n_stages": {c.key: built[c.key].n_stages for c in CONFIGS},
        "costs": costs,
        "comm_ms": comm_ms,
        "generated": generated,
        "mb_shape": list(rank.mb_shape),
        "parameters": sum(p.numel() for t in rank.templates for p in t.module.parameters()),
        "description": rank.templates[0].description,
        "threads": torch.get_num_threads(),
    }


def threads_per_rank(plan: RankPlan) -> int:
    """Intra-op threads of each rank: the CPU's cores shared out (one on CUDA)."""
    return max(1, (os.cpu_count() or 1) // plan.ranks) if plan.device == "cpu" else 1
