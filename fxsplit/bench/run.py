"""One ``fxsplit bench`` run: every mode and every section on one stage, as the result written as JSON.

One run measures six ways of running the backward of one pipeline stage
(:mod:`fxsplit.bench.modes`), side by side, on the same weights and inputs.
Then, on the same stage: the graph time and host time of mode 6 (from
``PendingWeightGrads.timings`` where fxsplit records them;
:mod:`fxsplit.bench.host_time`), 4 microbatches accumulating into ``.grad``
(Inductor's ordinary backward against fxsplit's B + W;
:mod:`fxsplit.bench.accumulate`), memory between B and W for a middle, a last
and a first stage layout (:mod:`fxsplit.bench.memory`) and compile time per
kind of user (:mod:`fxsplit.bench.compile_time`, last: it resets Dynamo).
Every target is printed as a verdict with the spread it rests on and stored
under ``targets`` (:mod:`fxsplit.bench.targets`). The command line
(:mod:`fxsplit.cli`) checks the options, calls :func:`run`, prints the table
(:mod:`fxsplit.bench.report`) and draws the chart (:mod:`fxsplit.bench.chart`).

How each figure is taken (also stored in the JSON under ``methods``):

* times: each repetition runs forward, then B and W (split modes) or the
  ordinary backward, with a clock read between phases: ``time.perf_counter``
  on CPU (what ``torch.utils.benchmark.Timer`` uses), CUDA events on CUDA.
  B and W cannot be timed by ``Timer`` on their own since each needs a fresh
  forward. Repetitions of the six modes are interleaved round-robin (each
  round starting one mode later, so no mode always follows the same one), so
  background load hits all modes alike; warm-up repetitions are dropped and
  medians (and IQRs) come from ``torch.utils.benchmark.Measurement``.
* FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over B, W and the
  ordinary backward, with :mod:`fxsplit.bench.flops`' formulas for the ops it
  counts as 0 (``_grouped_mm``, CPU flash attention). A dispatch mode cannot see inside a fused Inductor
  kernel, so for the compiled modes FLOPs are counted on the very FX graphs
  Inductor compiles (Inductor's decompositions and partitioner, run op by op
  via ``fxsplit.backend(compiler="eager")``); what the counter observes in
  the real compiled run is stored too (``flops_observed``).
* held between B and W: the allocator-level growth of live memory from
  before the forward to after B, with the stage output, the returned input
  gradients and the input's ``.grad`` dropped (parameters' ``.grad`` already
  exist, so W allocates nothing lasting). On CUDA from
  ``torch.cuda.memory_allocated``; on CPU from the CPU allocator's
  allocation and free events recorded by ``torch.profiler`` with
  ``profile_memory=True``. The declared figure is stored next to it:
  ``PendingWeightGrads.live_in_bytes`` (fxsplit) or the bytes of the
  gradients saved in upstream's ``param_groups``; the measured one also
  counts the activations autograd keeps alive for W.
* peak: highest live memory above the pre-forward level during one
  forward + backward (B + W); ``torch.cuda.max_memory_allocated`` on CUDA,
  the same profiler allocation events on CPU.
* compile: wall time of the first forward + backward of a compiled module
  (Dynamo, AOTAutograd, Inductor codegen and C/C++ or Triton compile), in a
  fresh Inductor cache of its own unless ``--warm-cache``.
"""

from __future__ import annotations

import math
import os
import platform
import time
from typing import Any

import torch

import fxsplit
from fxsplit.bench import allocator, baselines
from fxsplit.bench.accumulate import ACCUMULATE_MICROBATCHES, measure_accumulation
from fxsplit.bench.baselines import default_config_failure
from fxsplit.bench.compile_time import measure_compile_times
from fxsplit.bench.host_time import host_added_target, host_section, host_target
from fxsplit.bench.memory import MEMORY_TARGETS, measure_memory_layouts, memory_targets
from fxsplit.bench.models import build
from fxsplit.bench.modes import REFERENCE, backward_phases, count_flops, make_modes, measure_memory
from fxsplit.bench.progress import Progress
from fxsplit.bench.settings import DTYPES, BenchSettings, device_name
from fxsplit.bench.targets import COMPILE_RELIABLE_MIN_REPS, not_measured, step_targets, timing_target
from fxsplit.bench.timing import fault_summary, first_step, stats, sync, timed_step

__all__ = ["SCHEMA_VERSION", "run"]

# 2: FLOPs include grouped_mm and CPU flash attention; host, accumulate, memory and compile sections.
SCHEMA_VERSION = 2


def run(settings: BenchSettings, progress: Progress | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the result dict that is written as JSON.

    ``settings`` are taken as valid (:func:`fxsplit.bench.settings.settings_from_args` checks them).
    Where upstream's split cannot run on a compiled module with this torch
    (:func:`fxsplit.bench.baselines.upstream_split_failure`), everything else
    is measured and that baseline (mode 4, the memory section's ``upstream``
    rows, the verdict against it) is reported "not measurable" with the reason.
    """
    progress = progress or Progress()
    wall0 = time.perf_counter()
    if settings.malloc == "retain":
        allocator.retain_freed_memory()
    device = torch.device(settings.device)
    dtype = DTYPES[settings.dtype]
    stage = build(settings.model, device, dtype)
    base = stage.module
    with torch.no_grad():
        probe = base(stage.make_input())
    grad = torch.randn_like(probe)
    del probe
    n_params = sum(p.numel() for p in base.parameters())
    progress.say(f"{stage.description}; {n_params / 1e6:.2f} M parameters; {settings.model.as_dict()}; "
                 f"{settings.dtype} on {device_name(device)} ({device.type}); torch {torch.__version__}")

    upstream_unavailable = baselines.upstream_split_failure()
    if upstream_unavailable is not None:
        progress.say(f"not measurable: {upstream_unavailable}")
    modes = make_modes(base, upstream_unavailable)
    runnable = [m for m in modes if m.unavailable is None]
    inductor, fx_graphs = modes[2].module, modes[2].flops_module
    assert fx_graphs is not None

    layouts = not (settings.model.name == "conv" or settings.model.embedding)
    progress.plan(["compiling", "warm-up", "timing", "accumulating", "memory and FLOPs",
                   *(["memory between B and W"] if layouts else []), "compile time"])

    # 1. compile (first call) and warm up
    progress.section("compiling")
    compile_s: dict[str, float] = {}
    n_compiled = len({m.compiled for m in runnable if m.compiled is not None})
    t0 = time.perf_counter()
    for mode in runnable:
        if mode.compiled is not None and mode.compiled not in compile_s:
            with progress.phase(f"compiling {mode.compiled} ({len(compile_s) + 1}/{n_compiled}, first forward + "
                                "backward)"):
                compile_s[mode.compiled] = first_step(mode, stage, grad, device, fresh=not settings.warm_cache)
            progress.count("compiling, modules done", len(compile_s), n_compiled, t0)
    progress.section("warm-up")
    default_error: str | None = None
    if upstream_unavailable is None:
        with progress.phase("running the upstream split on the default-config inductor module"):
            default_error = default_config_failure(inductor, stage, grad)
        if default_error is None:
            progress.say("note: the upstream split on the default-config inductor module did NOT fail")
    with progress.phase(f"tracing the FLOP-counting twin and {settings.warmup} warm-up step(s) per mode"):
        # the FLOP-counting twin runs eagerly; its compile is not reported
        backward_phases(modes[2], fx_graphs, stage.make_input(), grad)
        step_s: dict[str, float] = {}
        for mode in runnable:
            for _ in range(settings.warmup):
                t = timed_step(mode, stage, grad, device)
            step_s[mode.key] = sum(t.values()) if settings.warmup else 0.0

    # 2. timed repetitions, interleaved round-robin
    want = {
        k: max(settings.min_reps, min(settings.reps, math.ceil(settings.min_time_s / max(s, 1e-6))))
        for k, s in step_s.items()
    }
    rounds = max(want.values())
    progress.section("timing")
    progress.step(f"timing {rounds} round(s), the {len(runnable)} runnable modes interleaved (each round starting "
                  f"one mode later): {', '.join(f'{k} x{n}' for k, n in want.items())}")
    samples: dict[str, dict[str, list[float]]] = {m.key: {} for m in modes}
    host: list[dict[str, int] | None] = []
    ordinary_host: list[float | None] = []
    faults: dict[str, list[int | None]] = {m.key: [] for m in modes}
    t0 = time.perf_counter()
    for r in range(rounds):
        # Each round starts one mode later, so that no mode always follows the same one (a mode that
        # frees a lot of memory would otherwise always hand its allocator state to the same next mode).
        for mode in runnable[r % len(runnable):] + runnable[:r % len(runnable)]:
            if r < want[mode.key]:
                for phase, t in timed_step(mode, stage, grad, device, host, ordinary_host,
                                            faults[mode.key]).items():
                    samples[mode.key].setdefault(phase, []).append(t)
        progress.count("timing, rounds done", r + 1, rounds, t0)

    # 2b. microbatch accumulation: inductor's ordinary backward vs fxsplit's B + W, 4 microbatches into .grad
    progress.section("accumulating")
    acc_section, acc_target = measure_accumulation({m.key: m for m in modes}, stage, grad, device, settings, step_s,
                                                   progress)

    # 3. memory and FLOPs (untimed)
    progress.section("memory and FLOPs")
    results = []
    t0 = time.perf_counter()
    for k, mode in enumerate(modes, 1):
        progress.count("measuring memory and counting FLOPs, modes done", k - 1, len(modes), t0)
        if mode.unavailable is not None:
            results.append(_not_measurable(mode))
            continue
        s = samples[mode.key]
        timing = {ph: stats(v, mode.key, ph) for ph, v in s.items()}
        bwd = [b + w for b, w in zip(s["B"], s["W"])] if mode.split else s["backward"]
        timing["total_backward"] = stats(bwd, mode.key, "B+W" if mode.split else "backward")
        # per repetition, in round order: rep k of every mode ran in the same round
        timing["total_backward"]["samples_ms"] = [v * 1e3 for v in bwd]
        mem = measure_memory(mode, stage, grad, device)
        flops = count_flops(mode, mode.module if mode.flops_module is None else mode.flops_module, stage, grad)
        observed = count_flops(mode, mode.module, stage, grad) if mode.flops_module is not None else None
        results.append({
            "key": mode.key,
            "label": mode.label,
            "split": mode.split,
            "forward_ms": timing["forward"]["median_ms"],
            "b_ms": timing["B"]["median_ms"] if mode.split else None,
            "w_ms": timing["W"]["median_ms"] if mode.split else None,
            "backward_ms": timing["total_backward"]["median_ms"],
            "timing": timing,
            "flops": flops,
            "flops_observed": observed,
            "flops_method": "op by op on the Inductor-input FX graphs (fxsplit compiler='eager')"
            if mode.flops_module is not None else "FlopCounterMode over the eager run",
            **mem,
            "compile_s": compile_s.get(mode.compiled) if mode.compiled else None,
            "compiled_module": mode.compiled,
            **fault_summary(faults[mode.key]),
        })

    progress.count("measuring memory and counting FLOPs, modes done", len(modes), len(modes), t0)
    ref = next(r for r in results if r["key"] == REFERENCE)
    for r in results:
        if r.get("not_measurable"):
            continue
        r["ratio_to_inductor"] = r["backward_ms"] / ref["backward_ms"]
        r["duplicated_flops_pct"] = 100.0 * (r["flops"]["backward"] - ref["flops"]["backward"]) / ref["flops"]["backward"]
    by = {r["key"]: r for r in results}
    by["inductor+upstream"]["default_config_error"] = default_error
    targets = step_targets(by)

    # 4. graph vs host time of the split, accumulation, memory per stage layout, compile time per user
    host_times = host_section(host, by["inductor"], ordinary_host)
    targets["host_time"] = host_target(host_times)
    targets["host_time_added"] = host_added_target(host_times)
    targets["accumulate_vs_inductor"] = acc_target
    memory_section: dict[str, Any] | None = None
    if not layouts:
        why = "the memory layouts wrap a body taking hidden states (batch, ..., dim); this model does not"
        memory_section = {"skipped": why}
        for name in MEMORY_TARGETS:
            targets[name] = not_measured(name, why)
    else:
        progress.section("memory between B and W")
        with progress.phase("memory between B and W: middle, last and first stage layouts"):
            memory_section = measure_memory_layouts(base, stage.make_input, settings.model.dim, settings.model.vocab,
                                                    device, settings.quick, say=progress.step,
                                                    upstream_unavailable=upstream_unavailable)
        targets.update(memory_targets(memory_section))
    progress.section("compile time")
    with progress.phase(f"compile time per user ({settings.compile_reps} round(s); resets Dynamo)"):
        compile_section = measure_compile_times(base, stage.make_input, grad, settings.compile_reps,
                                                settings.warm_cache, sync=lambda: sync(device), say=progress.step)
    progress.close()
    cs = compile_section["samples_s"]
    targets["compile_split_vs_inductor"] = timing_target(
        "compile_split_vs_inductor", 1.1,
        compile_section["median_s"]["fxsplit-split"] / compile_section["median_s"]["inductor"],
        [a / b for a, b in zip(cs["fxsplit-split"], cs["inductor"])], higher_is_better=False,
        min_reps=COMPILE_RELIABLE_MIN_REPS)

    result = {
        "schema": SCHEMA_VERSION,
        "device": {"type": device.type, "name": device_name(device), "torch_threads": torch.get_num_threads(),
                   "cpu_count": os.cpu_count()},
        "dtype": settings.dtype,
        "torch_version": torch.__version__,
        "fxsplit_version": fxsplit.__version__,
        "python": platform.python_version(),
        "model": {**settings.model.as_dict(), "description": stage.description, "parameters": n_params},
        "settings": {"warmup": settings.warmup, "min_reps": settings.min_reps, "reps": settings.reps,
                     "min_time_s": settings.min_time_s, "warm_cache": settings.warm_cache, "quick": settings.quick,
                     "host_bound": settings.host_bound,
                     "malloc": settings.malloc},
        "allocator": allocator.describe(settings.malloc) if device.type == "cpu" else "CUDA caching allocator",
        "reference": REFERENCE,
        "modes": results,
        "mode4_default_config_error": default_error,
        "not_measurable": {m.key: m.unavailable for m in modes if m.unavailable is not None},
        "host": host_times,
        "accumulate": acc_section,
        "memory": memory_section,
        "compile": compile_section,
        "targets": targets,
        "methods": _methods(device),
    }
    result["wall_s"] = time.perf_counter() - wall0
    return result


def _not_measurable(mode: Any) -> dict[str, Any]:
    """The result row of a mode this torch cannot run: every figure None, and why."""
    none = dict.fromkeys(("forward_ms", "b_ms", "w_ms", "backward_ms", "ratio_to_inductor", "duplicated_flops_pct",
                          "held_bytes", "held_bytes_declared", "peak_bytes", "compile_s", "flops_observed"))
    return {"key": mode.key, "label": mode.label, "split": mode.split, "not_measurable": mode.unavailable,
            "timing": {}, "flops": {"B": None, "W": None, "backward": None}, "compiled_module": mode.compiled,
            **none}


def _methods(device: torch.device) -> dict[str, str]:
    """How each figure was taken, as stored in the JSON under ``methods``."""
    cpu = device.type != "cuda"
    return {
        "timing": ("time.perf_counter between phases" if cpu else "CUDA events between phases")
        + "; repetitions of all modes interleaved round-robin, each round starting one mode later; warm-up "
        "excluded; median via "
        "torch.utils.benchmark.Measurement",
        "flops": "FlopCounterMode; compiled modes counted op by op on the FX graphs Inductor compiles "
        "(fxsplit.backend(compiler='eager'): same decompositions and partitioner); flops_observed is what "
        "the counter sees in the real compiled run (only kernels Inductor leaves to ATen, e.g. mm on CPU)",
        "duplicated_flops_pct": "100 * (backward FLOPs of the mode - inductor's ordinary backward FLOPs) / inductor's",
        "held_bytes": ("CPU allocator events from torch.profiler(profile_memory=True)" if cpu
                       else "torch.cuda.memory_allocated")
        + ": live bytes after B minus before the forward, with the stage output, returned input grads and the "
        "input's .grad dropped (parameters' .grad already allocated)",
        "held_bytes_declared": "fxsplit: PendingWeightGrads.live_in_bytes; upstream: bytes of the gradients "
        "saved in param_groups (the activations autograd keeps for W are not in it)",
        "peak_bytes": ("CPU allocator events from torch.profiler(profile_memory=True)" if cpu
                       else "torch.cuda.max_memory_allocated")
        + ": highest live bytes above the pre-forward level during forward + backward",
        "compile_s": "wall time of the first forward + backward (Dynamo + AOTAutograd + Inductor), each compiled "
        "module in a fresh Inductor cache unless --warm-cache; what fxsplit compiles on that first ordinary "
        "backward depends on its runtime (all graphs, or only the fused one with lazy compilation)",
        "host": "PendingWeightGrads.timings of every timed fxsplit+split repetition (ns): host time of B = b_ns - "
        "b_graph_ns, of W = w_ns - w_graph_ns; target: their sum / inductor's ordinary backward of the same round; "
        "ordinary_host_ms: fxsplit's ordinary backward minus its regions' fused graph time (graph_ns) in the same "
        "round; added_ms: the split's host time minus that (target host_time_added)",
        "minor_faults_backward": "getrusage ru_minflt from the end of each timed forward to the end of its B + W "
        "(or backward), median over the timed repetitions (pages the allocator had handed back to the OS and "
        "maps again; see fxsplit.bench.allocator)",
        "accumulate": f"{ACCUMULATE_MICROBATCHES} microbatches, .grad set to None first; backward phases timed "
        "(forwards not counted); inductor and fxsplit+split interleaved per round, each first every other round; "
        "warm-up rounds dropped",
        "memory": "fxsplit.bench.memory: per stage layout (middle / last / first) and split (upstream, fxsplit, "
        "fxsplit defer='all'): allocator bytes alive after F+B, declared bytes, SplitResult live-in and all-crossing "
        "bytes evaluated at the microbatch's sizes, peak over a ZB-V-like sequence of 4 microbatches",
        "compile": "fxsplit.bench.compile_time: first step after torch._dynamo.reset() for backend='inductor', "
        "fxsplit used only split (F, B, W) and fxsplit used only fused (F, backward); rounds interleaved",
    }

