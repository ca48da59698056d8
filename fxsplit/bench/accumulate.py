"""Microbatch accumulation (the benchmark's ``accumulate`` section).

:data:`ACCUMULATE_MICROBATCHES` microbatches into ``.grad`` (set to ``None``
first, so that the later ones accumulate), backward time summed over them:
Inductor's ordinary backward against fxsplit's B then W per microbatch, the two
interleaved per round (each first every other round), warm-up rounds dropped.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from fxsplit.bench.models import Stage
from fxsplit.bench.modes import Mode, params_of
from fxsplit.bench.progress import Progress
from fxsplit.bench.settings import BenchSettings
from fxsplit.bench.stats import paired_ratios
from fxsplit.bench.targets import timing_target
from fxsplit.bench.timing import stats, timed_step

__all__ = ["ACCUMULATE_MICROBATCHES", "measure_accumulation"]

ACCUMULATE_MICROBATCHES = 4


def _accumulate_step(mode: Mode, stage: Stage, grad: torch.Tensor, device: torch.device) -> float:
    """Seconds of backward (B + W, or the ordinary backward) summed over
    :data:`ACCUMULATE_MICROBATCHES` microbatches accumulating into ``.grad``,
    which starts as ``None`` (as after ``zero_grad(set_to_none=True)``): the
    first microbatch allocates ``.grad``, the others add to it. Forwards are
    not counted."""
    for p in params_of(mode.module):
        p.grad = None
    total = 0.0
    for _ in range(ACCUMULATE_MICROBATCHES):
        t = timed_step(mode, stage, grad, device)
        total += sum(v for k, v in t.items() if k != "forward")
    return total


def measure_accumulation(modes: dict[str, Mode], stage: Stage, grad: torch.Tensor, device: torch.device,
                         settings: BenchSettings, step_s: dict[str, float],
                         progress: Progress) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``accumulate`` section and its verdict (``accumulate_vs_inductor``).

    ``modes`` by key (``inductor`` and ``fxsplit+split`` are run); ``step_s``:
    each mode's seconds per warm-up step, from which the number of rounds is
    chosen as for the timed repetitions.
    """
    acc_rounds = max(settings.min_reps, min(settings.reps, math.ceil(
        settings.min_time_s / max(ACCUMULATE_MICROBATCHES * (step_s["inductor"] + step_s["fxsplit+split"]), 1e-6))))
    acc: dict[str, list[float]] = {"inductor": [], "fxsplit+split": []}
    t0 = time.perf_counter()
    for r in range(settings.warmup + acc_rounds):
        for key in list(acc)[::-1] if r % 2 else list(acc):  # each goes first every other round
            t = _accumulate_step(modes[key], stage, grad, device)
            if r >= settings.warmup:
                acc[key].append(t)
        progress.count(f"accumulating {ACCUMULATE_MICROBATCHES} microbatches into .grad, rounds done", r + 1,
                       settings.warmup + acc_rounds, t0)
    acc_section = {
        "microbatches": ACCUMULATE_MICROBATCHES,
        "what": f"backward time summed over {ACCUMULATE_MICROBATCHES} microbatches accumulating into .grad "
        "(set to None first): inductor's ordinary backward vs fxsplit's B then W per microbatch",
        "inductor": stats(acc["inductor"], "inductor", "accumulate"),
        "fxsplit+split": stats(acc["fxsplit+split"], "fxsplit+split", "accumulate"),
    }
    target = timing_target(
        "accumulate_vs_inductor", 1.00,
        acc_section["fxsplit+split"]["median_ms"] / acc_section["inductor"]["median_ms"],
        paired_ratios(acc["fxsplit+split"], acc["inductor"]), higher_is_better=False,
        modes={"fxsplit+split": acc["fxsplit+split"], "inductor": acc["inductor"]})
    return acc_section, target
