"""``fxsplit bench --pipeline``: whole pipeline training steps on several ranks, measured and simulated.

:func:`run` runs a world of ``ranks`` processes (:mod:`fxsplit.bench.world`;
gloo on CPU, NCCL on CUDA), each running
:func:`fxsplit.bench.pipeline_rank.rank_main`, and turns their raw
records into the result written as JSON:

* ``rows``: per configuration (:data:`~fxsplit.bench.pipeline_rank.CONFIGS`),
  the median step time and its IQR (the slowest rank's ``schedule.step()``
  between barriers, over the timed rounds), the bubble (per rank: 1 - the time
  in ``F``/``I``/``B``/``W`` actions / the step time; the median over rounds,
  then the mean over ranks), the peak memory (highest rank), and two simulated
  step times with their error against the measured one:
  ``simulated_step_ms``, the generator's own replay of that schedule on the
  costs it generated from (the same simulation for every row, so the generated
  row is never slower than an upstream row that fits the memory limit;
  ``over_memory_limit`` marks one that does not), and
  ``own_simulated_step_ms``, :func:`fxsplit.schedules.simulate` with the
  configuration's own median action times (how well the simulator predicts a
  run from its action times);
* ``ratios``: every configuration's step time over ``Schedule1F1B`` with
  Inductor's in the same round (median and quartiles);
* ``costs``: per stage of the two-stages-per-rank cut, ``f_ms``, ``b_ms``
  (``I``) and ``w_ms`` from ZB-V with fxsplit, ``full_backward_ms`` from
  interleaved 1F1B with Inductor, ``comm_ms`` (ping-pong), and the bytes one
  microbatch holds after ``F`` and after ``I``;
* ``generated``: the schedule generated on the ranks from the probe costs;
* ``scaling``: simulated step times for 8 to 64 stages and 16 to 128
  microbatches from the measured costs (:func:`scaling_table`);
* ``timeline``: per configuration, every action of the median step per rank.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import fxsplit
from fxsplit.bench import world
from fxsplit.bench.pipeline_rank import CONFIGS, RankPlan, rank_main, threads_per_rank
from fxsplit.bench.progress import Progress
from fxsplit.bench.settings import device_name
from fxsplit.bench.stats import paired_ratios, spread
from fxsplit.bench.timing import stats
from fxsplit.schedules import (
    PipelineCosts, ScheduleError, StageCosts, generate_schedule, simulate, upstream_order,
)

__all__ = ["PipelineSettings", "REFERENCE", "SCALING_MICROBATCHES", "SCALING_RANKS", "run", "scaling_table"]

SCHEMA_VERSION = 1
REFERENCE = "Schedule1F1B+inductor"
SCALING_RANKS = (4, 8, 16, 32)  # 8 to 64 stages, two per rank
SCALING_MICROBATCHES = (16, 32, 64, 128)
SCALING_SCHEDULES = ("Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble",
                     "ScheduleInterleavedZeroBubble", "ScheduleDualPipeV", "generated")


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """What ``fxsplit bench --pipeline`` runs (checked by :mod:`fxsplit.cli_pipeline`)."""

    model: dict[str, Any]  # ModelConfig fields of one stage (``layers`` blocks)
    device: str = "cpu"
    dtype: str = "float32"
    ranks: int = 2
    microbatches: int = 8
    warmup: int = 2
    reps: int = 30
    compiler: str = "inductor"
    quick: bool = False
    timeout_s: float = 3600.0
    scaling_ranks: tuple[int, ...] | None = None  # None: SCALING_RANKS; () skips the scaling table
    scaling_microbatches: tuple[int, ...] | None = None  # None: SCALING_MICROBATCHES


def _spawn(plan: RankPlan, progress: Progress) -> list[dict[str, Any]]:
    """Run every rank (:func:`fxsplit.bench.world.run_world`); their records, by rank."""
    return world.run_world(rank_main, plan, plan.ranks, timeout_s=plan.timeout_s, device=plan.device,
                           threads=threads_per_rank(plan), on_progress=progress.say)


def _quartiles(values: Sequence[float]) -> dict[str, float]:
    s = spread(values)
    return {"median": s.median, "q1": s.q25, "q3": s.q75}


def _median_durations(records: Sequence[dict[str, Any]], key: str) -> dict[tuple[int, str], float]:
    """Median milliseconds of each (stage, kind) over every timed round and microbatch."""
    acc: dict[tuple[int, str], list[float]] = {}
    for rec in records:
        for step in rec["actions"][key]:
            for s, k, _, a, b in step:
                acc.setdefault((s, k), []).append(b - a)
    return {k: statistics.median(v) for k, v in acc.items()}


def _config_costs(durations: dict[tuple[int, str], float], n_stages: int, comm: float) -> PipelineCosts:
    def d(s: int, k: str) -> float:
        return durations.get((s, k), 0.0)

    return PipelineCosts(tuple(
        StageCosts(f=d(s, "F"), i=d(s, "I") if (s, "I") in durations else d(s, "B"), w=d(s, "W"), b=d(s, "B"),
                   comm=comm)
        for s in range(n_stages)
    ))


def _order_of(schedule: str, ranks: int, microbatches: int, generated: Any) -> dict[int, list[Any]]:
    if schedule == "generated":
        return generated.lowered()
    return upstream_order(schedule, ranks, microbatches, lowered=True)


def _on_generator_costs(schedule: str, generated: Any) -> tuple[float | None, bool]:
    """``(step, over the memory limit)`` of ``schedule`` as the generator replayed it on
    the costs it generated from (``None`` where the generator had no such candidate:
    a class that refuses the sizes)."""
    if schedule == "generated":
        return generated.step_time, False
    cand = generated.upstream.get(schedule)
    return (None, False) if cand is None else (cand.step_time, not cand.fits)


def scaling_table(costs: PipelineCosts, ranks: Sequence[int] = SCALING_RANKS,
                  microbatches: Sequence[int] = SCALING_MICROBATCHES,
                  say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Simulated step time and bubble of each schedule of :data:`SCALING_SCHEDULES` for
    ``2 * ranks`` stages and each number of microbatches, from ``costs`` measured on
    the two-stages-per-rank cut (:meth:`PipelineCosts.extended_to`: more stages of
    the measured size; ``Schedule1F1B`` runs each rank's two consecutive stages as one,
    with full backwards). Every upstream row is the generator's own candidate for
    those sizes (the same replay), ``over_memory_limit`` where the generator's
    memory limit left it out. A schedule that refuses the sizes gets ``None``."""
    rows = []
    for p in ranks:
        fine = costs.extended_to(2 * p)
        for m in microbatches:
            t0 = time.perf_counter()
            try:
                gen = generate_schedule(fine, p, m)
            except (ValueError, ScheduleError) as e:
                gen, refused = None, str(e).splitlines()[0][:200]
            for name in SCALING_SCHEDULES:
                row: dict[str, Any] = {"ranks": p, "stages": 2 * p, "microbatches": m, "schedule": name,
                                       "step_ms": None, "bubble": None, "peak_bytes": None, "source": None,
                                       "over_memory_limit": False}
                try:
                    if gen is None:
                        raise ValueError(refused)
                    if name == "generated":
                        sim, row["source"] = gen.simulation, gen.source
                    else:  # the generator's own replay of the class's order, so the rows compare like for like
                        if name not in gen.upstream:
                            raise ValueError(f"{name} refuses {p} ranks and {m} microbatches")
                        sim = simulate(upstream_order(name, p, m, lowered=True, stages_per_rank=2), fine)
                        row["over_memory_limit"] = not gen.upstream[name].fits
                except (ValueError, AssertionError, ScheduleError) as e:
                    row["refused"] = str(e).splitlines()[0][:200]
                else:
                    row.update(step_ms=sim.step_time, bubble=sim.mean_bubble, peak_bytes=max(sim.peak_bytes))
                rows.append(row)
            if say is not None:
                say(f"scaling: {2 * p} stages, {m} microbatches simulated in {time.perf_counter() - t0:.1f} s")
    return rows


def run(settings: PipelineSettings, progress: Progress | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the result dict written as JSON (the module's docstring)."""
    progress = progress or Progress()
    wall0 = time.perf_counter()
    plan = RankPlan(model=settings.model, device=settings.device, dtype=settings.dtype, ranks=settings.ranks,
                    microbatches=settings.microbatches, warmup=settings.warmup, reps=settings.reps,
                    compiler=settings.compiler, timeout_s=settings.timeout_s)
    progress.say(f"spawning {settings.ranks} ranks ({'NCCL' if settings.device == 'cuda' else 'gloo'}), "
                 f"{len(CONFIGS)} configurations, {settings.microbatches} microbatches, {settings.reps} timed rounds")
    records = _spawn(plan, progress)
    rank0 = records[0]
    p, m = settings.ranks, settings.microbatches
    comm = rank0["comm_ms"]
    generated = rank0["generated"]

    rows, timeline, ratios = [], {}, {}
    durations_of: dict[str, dict[tuple[int, str], float]] = {}
    reps = settings.reps
    step_of = {c.key: [max(rec["steps_ms"][c.key][i] for rec in records) for i in range(reps)] for c in CONFIGS}
    for c in CONFIGS:
        key = c.key
        steps = step_of[key]
        st = stats([t / 1e3 for t in steps], key, "step")
        bubbles = []
        for rec in records:
            per_round = [1.0 - sum(b - a for _, _, _, a, b in acts) / steps[i]
                         for i, acts in enumerate(rec["actions"][key])]
            bubbles.append(statistics.median(per_round))
        durations = _median_durations(records, key)
        durations_of[key] = durations
        n_stages = rank0["n_stages"][key]
        sim_costs = _config_costs(durations, n_stages, comm)
        if c.schedule == "Schedule1F1B":
            order = upstream_order("Schedule1F1B", n_stages, m, lowered=True)
        else:
            order = _order_of(c.schedule, p, m, generated)
        own = simulate(order, sim_costs)
        shared, over_limit = _on_generator_costs(c.schedule, generated)
        median_round = sorted(range(reps), key=lambda i: steps[i])[(reps - 1) // 2]
        timeline[key] = [[list(a) for a in rec["actions"][key][median_round]] for rec in records]
        ratios[key] = _quartiles(paired_ratios(steps, step_of[REFERENCE]))
        rows.append({
            "schedule": c.schedule, "backend": c.backend, "key": key,
            "step_ms": st["median_ms"], "step_iqr_ms": st["iqr_ms"], "n": st["n"],
            "bubble": sum(bubbles) / len(bubbles), "bubble_per_rank": bubbles,
            "peak_bytes": max(rec["peak_bytes"][key] for rec in records),
            "peak_bytes_per_rank": [rec["peak_bytes"][key] for rec in records],
            "simulated_step_ms": shared, "over_memory_limit": over_limit,
            "simulated_error_pct": None if shared is None else 100.0 * (shared - st["median_ms"]) / st["median_ms"],
            "own_simulated_step_ms": own.step_time, "own_simulated_bubble": own.mean_bubble,
            "own_simulated_error_pct": 100.0 * (own.step_time - st["median_ms"]) / st["median_ms"],
            "ratio_to_reference": ratios[key]["median"],
            "stages": n_stages, "stages_of_rank": [rec["stages"][key] for rec in records],
            "step_samples_ms": steps,
            # fxsplit backward graphs the timed steps ran, all ranks (0 where no stage is fxsplit's)
            "region_runs": {k: sum(rec["region_runs"][key][k] for rec in records)
                            for k in records[0]["region_runs"][key]},
        })

    zbv, i1f1b = durations_of["ScheduleZBVZeroBubble+fxsplit"], durations_of["ScheduleInterleaved1F1B+inductor"]
    probe = rank0["costs"]
    costs_rows = [{
        "stage": s, "f_ms": zbv[(s, "F")], "b_ms": zbv[(s, "I")], "w_ms": zbv[(s, "W")],
        "full_backward_ms": i1f1b[(s, "B")], "comm_ms": comm,
        "activation_bytes": probe[s].activation_bytes, "live_in_bytes": probe[s].live_in_bytes,
    } for s in range(2 * p)]
    measured = PipelineCosts(tuple(
        StageCosts(f=c["f_ms"], i=c["b_ms"], w=c["w_ms"], b=c["full_backward_ms"], comm=comm,
                   activation_bytes=c["activation_bytes"], live_in_bytes=c["live_in_bytes"]) for c in costs_rows))
    scaling_ranks = SCALING_RANKS if settings.scaling_ranks is None else settings.scaling_ranks
    scaling_mbs = SCALING_MICROBATCHES if settings.scaling_microbatches is None else settings.scaling_microbatches
    scaling = None
    if scaling_ranks:
        with progress.phase(f"simulating {', '.join(str(2 * r) for r in scaling_ranks)} stages x "
                            f"{', '.join(map(str, scaling_mbs))} microbatches from the measured costs"):
            scaling = scaling_table(measured, scaling_ranks, scaling_mbs, say=progress.say)

    dev = torch.device(settings.device)
    result = {
        "schema": SCHEMA_VERSION,
        "benchmark": "pipeline",
        "device": {"type": dev.type, "name": device_name(dev), "torch_threads_per_rank": rank0["threads"],
                   "cpu_count": os.cpu_count(), "ranks": p,
                   "process_group": "nccl" if dev.type == "cuda" else "gloo"},
        "dtype": settings.dtype,
        "torch_version": torch.__version__,
        "fxsplit_version": fxsplit.__version__,
        "python": platform.python_version(),
        "model": {**settings.model, "description": rank0["description"], "stages": 2 * p,
                  "microbatch_input": rank0["mb_shape"], "parameters": rank0["parameters"]},
        "settings": {"ranks": p, "microbatches": m, "warmup": settings.warmup, "reps": reps,
                     "compiler": settings.compiler, "quick": settings.quick},
        "reference": REFERENCE,
        "rows": rows,
        "ratios": ratios,
        "costs": costs_rows,
        "generated": {
            "source": generated.source, "placement": generated.placement, "summary": generated.summary(),
            "runner_up": None if generated.runner_up is None else dataclasses.asdict(generated.runner_up),
            "stage_to_rank": list(generated.stage_to_rank), "memory_limit_bytes": generated.memory_limit,
            "simulated_step_ms_at_generation": generated.simulation.step_time,
            "order": {str(r): [str(a) for a in acts] for r, acts in generated.order.items()},
            "probe_costs": [dataclasses.asdict(s) for s in probe.stages],
            "candidates": [dataclasses.asdict(c) for c in generated.candidates],
        },
        "scaling": {"ranks": list(scaling_ranks), "microbatches": list(scaling_mbs), "rows": scaling,
                    "note": "simulated (fxsplit.schedules.simulate) from the measured per-stage costs: the first and "
                            "last stage as measured, every other stage the median of the measured middle stages; "
                            "Schedule1F1B runs each rank's two consecutive stages as one, with Inductor's full "
                            "backward; every upstream row is the generator's own replay of that schedule; '*': over "
                            "the generator's memory limit, not a candidate"},
        "timeline": timeline,
        "methods": _methods(dev),
    }
    result["wall_s"] = time.perf_counter() - wall0
    return result


def _methods(device: torch.device) -> dict[str, str]:
    cpu = device.type != "cuda"
    return {
        "step": "schedule.step() between two barriers (no optimizer step), the slowest rank's wall time; all "
                "configurations run once per round, each round starting one configuration later; warm-up steps "
                "dropped; median and IQR via torch.utils.benchmark.Measurement",
        "actions": ("time.perf_counter" if cpu else "CUDA events") + " around each stage's forward_one_chunk, "
                   "backward_one_chunk (I or B) and backward_weight_one_chunk (W); waiting for a receive, the loss "
                   "and the runtime's bookkeeping are outside them",
        "bubble": "per rank and round: 1 - (time in F/I/B/W actions) / the round's step time; median over rounds, "
                  "mean over ranks",
        "peak_bytes": "one extra step per configuration inside fxsplit.bench.memory.MemoryMeter ("
                      + ("CPU allocator events from torch.profiler" if cpu else "torch.cuda.max_memory_allocated")
                      + "): highest bytes above the level before the step, highest rank",
        "simulated": "the generator's own replay (fxsplit.schedules.simulate) of the configuration's lowered action "
                     "order on the probe costs it generated from: one simulation of one cost table for every row",
        "own_simulated": "fxsplit.schedules.simulate on the configuration's lowered action order (Schedule1F1B: its "
                         "order lowered as _PipelineScheduleRuntime lowers it) with its own median action times per "
                         "stage and kind and comm_ms",
        "comm_ms": "half the round trip of one microbatch activation between ranks 0 and 1 (dist.send/recv, 20 "
                   "round trips)",
        "costs": "f_ms, b_ms (I), w_ms: ScheduleZBVZeroBubble+fxsplit's median action times; full_backward_ms: "
                 "ScheduleInterleaved1F1B+inductor's B; activation_bytes: allocator bytes after one forward of the "
                 "stage module (output included); live_in_bytes: PendingWeightGrads.held_bytes after its I",
        "generated": "fxsplit.schedules.generate_schedule on costs from two probe steps of the cost configurations "
                     "after warm-up; memory limit: generate_schedule's default (the higher simulated peak of "
                     "ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble)",
    }
