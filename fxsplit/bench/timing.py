"""Timing one step of a mode: phase clocks, the timed step with its host-time
and page-fault readings, the compile step, and the statistics of repetitions.

Each repetition runs forward, then B and W (split modes) or the ordinary
backward, with a clock read between phases: ``time.perf_counter`` on CPU (what
``torch.utils.benchmark.Timer`` uses), CUDA events on CUDA. B and W cannot be
timed by ``Timer`` on their own since each needs a fresh forward; medians (and
IQRs) come from :mod:`fxsplit.bench.stats`.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

import fxsplit
from fxsplit.bench import allocator, baselines
from fxsplit.bench.models import Stage
from fxsplit.bench.modes import Mode, backward_phases
from fxsplit.bench.stats import spread

__all__ = ["HOST_KEYS", "fault_summary", "first_step", "stats", "sync", "timed_step"]


class _Clock:
    """Phase timestamps: CUDA events on CUDA, ``time.perf_counter`` otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)]
        return [b - a for a, b in itertools.pairwise(self.marks)]


HOST_KEYS = ("b_ns", "b_graph_ns", "w_ns", "w_graph_ns", "w_commit_ns")


def fault_summary(counts: Sequence[int | None]) -> dict[str, Any]:
    """Median minor page faults of a mode's timed backwards (B + W, or the
    backward), and the count per repetition; ``None`` where not counted."""
    counted = bool(counts) and None not in counts
    return {"minor_faults_backward": statistics.median(counts) if counted else None,  # type: ignore[type-var]
            "minor_faults_samples": list(counts)}


def _fused_graph_ns() -> int | None:
    """Nanoseconds all live fxsplit regions spent in their fused backward
    graphs so far, or ``None`` where this fxsplit does not record it."""
    regions = fxsplit.compiled_regions()
    if any(not isinstance(getattr(r, "graph_ns", None), dict) for r in regions):
        return None
    return sum(r.graph_ns.get("fused", 0) for r in regions)


def timed_step(mode: Mode, stage: Stage, grad: torch.Tensor, device: torch.device,
                host: list[dict[str, int] | None] | None = None,
                ordinary_host: list[float | None] | None = None,
                faults: list[int | None] | None = None) -> dict[str, float]:
    """Seconds per phase of one step. For the fxsplit split, appends to ``host``
    the step's ``PendingWeightGrads.timings`` (nanoseconds in and around the
    compiled graphs), or ``None`` where this fxsplit does not record them.
    For fxsplit's ordinary backward, appends to ``ordinary_host`` its seconds
    outside the fused graphs (the backward phase minus the fused graphs' time),
    or ``None`` where fxsplit does not record graph time. Appends to ``faults``
    the minor page faults from the end of the forward to the end of the step
    (B and W, or the backward), or ``None`` where the platform has no count."""
    x = stage.make_input()
    clock = _Clock(device)
    phases: list[str] = []
    held: list[Any] = []
    fused0 = _fused_graph_ns() if ordinary_host is not None and mode.key == "fxsplit" else None
    faults0: list[int | None] = []

    def between(phase: str) -> None:
        clock.mark()
        phases.append(phase)
        if phase == "forward" and faults is not None:
            faults0.append(allocator.minor_faults())

    clock.mark()
    backward_phases(mode, mode.module, x, grad, between, on_pending=held.append)
    if faults is not None:
        end = allocator.minor_faults()
        faults.append(None if end is None or faults0[0] is None else end - faults0[0])
    if host is not None and mode.split == "fxsplit":
        t = getattr(held[0], "timings", None)
        host.append({k: int(t[k]) for k in HOST_KEYS if k in t} if t is not None else None)
    times = dict(zip(phases, clock.intervals()))
    if ordinary_host is not None and mode.key == "fxsplit":
        fused1 = _fused_graph_ns()
        ordinary_host.append(
            None if fused0 is None or fused1 is None else times["backward"] - (fused1 - fused0) / 1e9
        )
    return times


def first_step(mode: Mode, stage: Stage, grad: torch.Tensor, device: torch.device, fresh: bool) -> float:
    """Compile (on first call) and run one step; returns its wall time in seconds."""
    ctx = contextlib.nullcontext() if not fresh else baselines.fresh_inductor_cache()
    with ctx:
        sync(device)
        t0 = time.perf_counter()
        backward_phases(mode, mode.module, stage.make_input(), grad)
        sync(device)
        return time.perf_counter() - t0


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stats(times: list[float], key: str, phase: str) -> dict[str, float]:
    """Median and IQR (ms) of one phase's repetition times (seconds), and their count."""
    s = spread(times)
    return {"median_ms": s.median * 1e3, "iqr_ms": s.iqr * 1e3, "n": s.n}
