"""The benchmark's targets and their verdicts.

Every target is printed as a verdict (PASS / MISS, or n/a with the reason) and
stored in the JSON under ``targets``. A timed verdict carries the spread of the
per-repetition ratios it rests on and says when it is unreliable
(:func:`timing_target`); memory and FLOP verdicts are exact figures
(:func:`fxsplit.bench.memory.memory_targets`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fxsplit.bench.memory import MEMORY_TARGETS
from fxsplit.bench.stats import Spread, paired_ratios
from fxsplit.bench.stats import spread as _spread

__all__ = ["AGREEMENT", "COMPILE_RELIABLE_MIN_REPS", "RELIABLE_MIN_REPS", "WIDE_SPREAD", "TARGETS", "not_measured", "spread", "step_targets",
           "timing_target"]

TARGETS = {
    "split_backward_vs_inductor": "fxsplit B+W total <= 1.02 x inductor ordinary backward",
    "duplicated_flops": "fxsplit split duplicates 0% of the backward FLOPs",
    "speedup_vs_inductor_upstream": "fxsplit split backward >= 1.5 x faster than inductor + upstream split",
    "host_time": "fxsplit split: time outside the compiled graphs (B + W) <= 2 % of inductor's ordinary backward",
    "host_time_added": "fxsplit split: time outside the compiled graphs (B + W) minus that of fxsplit's ordinary "
    "backward (engine, AOTAutograd's wrappers, AccumulateGrad) <= 2 % of inductor's ordinary backward",
    "accumulate_vs_inductor": "4 microbatches into .grad: fxsplit B+W per microbatch <= 1.00 x inductor's ordinary "
    "backward doing the same",
    "compile_split_vs_inductor": "compile time of a split-only fxsplit user (first forward + B + W) <= 1.1 x "
    "backend='inductor' (first forward + backward)",
    **MEMORY_TARGETS,
}


# A timing verdict needs at least this many paired repetitions to be called reliable.
RELIABLE_MIN_REPS = 5
# Compiles take tens of seconds each and vary less, relative to their length, than a step does.
COMPILE_RELIABLE_MIN_REPS = 3
# The ratio of the medians and the median per-repetition ratio estimate the same ratio: past this
# relative difference the repetitions are too uneven for either to stand for the run.
AGREEMENT = 0.05
# A mode whose own repetitions spread wider than this share of their median (interquartile range)
# was disturbed while it ran.
WIDE_SPREAD = 0.25


def spread(values: Sequence[float]) -> dict[str, float | int]:
    """Median, quartiles and range of ``values`` (per-repetition ratios), as the JSON stores them."""
    return _spread(values).as_dict()


def timing_target(what: str, target: float, measured: float, ratios: Sequence[float],
                   higher_is_better: bool, min_reps: int = RELIABLE_MIN_REPS,
                   modes: Mapping[str, Sequence[float]] | None = None) -> dict[str, Any]:
    """A timing target's verdict with the spread of the per-repetition ratios it rests on.

    ``measured`` is the ratio of the two modes' median times. Unreliable when
    fewer than :data:`RELIABLE_MIN_REPS` repetitions pair up, when the target
    lies inside the interquartile range of the per-repetition ratios (the
    spread is wider than the margin to the target: the verdict flips within
    the middle half of the repetitions), when the median per-repetition
    ratio falls on the other side of the target than ``measured`` or differs
    from it by more than :data:`AGREEMENT` (the two summaries of the same
    repetitions disagree), or when one of ``modes`` (name -> its own
    repetition times) has an interquartile range wider than
    :data:`WIDE_SPREAD` of its median (something else ran meanwhile).
    """
    ok = measured >= target if higher_is_better else measured <= target
    sp = spread(ratios)
    per_rep_ok = sp["median"] >= target if higher_is_better else sp["median"] <= target
    own: dict[str, Spread] = {name: _spread(times) for name, times in (modes or {}).items() if times}
    wide = [(name, s.relative_iqr) for name, s in own.items() if s.relative_iqr > WIDE_SPREAD]
    why = None
    if sp["n"] < min_reps:
        why = f"only {sp['n']} paired repetitions"
    elif sp["q25"] <= target <= sp["q75"]:
        why = f"the target {target:g} lies inside the interquartile range {sp['q25']:.3f}-{sp['q75']:.3f}"
    elif per_rep_ok != ok:
        why = (f"the median per-repetition ratio {sp['median']:.3f} and the ratio of the medians "
               f"{measured:.3f} fall on opposite sides of the target {target:g}")
    elif abs(measured / sp["median"] - 1) > AGREEMENT:
        why = (f"the ratio of the medians {measured:.3f} and the median per-repetition ratio {sp['median']:.3f} "
               f"differ by {100 * abs(measured / sp['median'] - 1):.0f} % (over {100 * AGREEMENT:.0f} %): "
               "the repetitions are too uneven")
    elif wide:
        why = "; ".join(f"{name}'s own repetitions spread over {100 * r:.0f} % of their median (interquartile "
                        f"range; over {100 * WIDE_SPREAD:.0f} %)" for name, r in wide)
    return {
        "target": (">= " if higher_is_better else "<= ") + f"{target:g}", "measured": measured, "pass": ok,
        "what": TARGETS[what], "spread": sp, "reliable": why is None, "unreliable_because": why,
        "verdict": ("PASS" if ok else "MISS") + ("" if why is None else " (unreliable)"),
    }


def _samples(mode: dict[str, Any]) -> list[float]:
    return mode["timing"]["total_backward"]["samples_ms"]


def _paired(num: dict[str, Any], den: dict[str, Any]) -> list[float]:
    """Per-round ratios of two modes' total backward times (round k of both ran back to back)."""
    return paired_ratios(_samples(num), _samples(den))


def step_targets(by: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The verdicts read off the six modes' results (``by`` key): B + W against Inductor's fused
    backward, duplicated FLOPs, and the speed-up over Inductor with upstream's split."""
    split, ref, up = by["fxsplit+split"], by["inductor"], by["inductor+upstream"]
    dup = split["duplicated_flops_pct"]
    speedup = (
        not_measured("speedup_vs_inductor_upstream", f"not measurable: {up['not_measurable']}")
        if up.get("not_measurable")
        else timing_target("speedup_vs_inductor_upstream", 1.5, up["backward_ms"] / split["backward_ms"],
                           _paired(up, split), higher_is_better=True,
                           modes={"inductor+upstream": _samples(up), "fxsplit+split": _samples(split)})
    )
    return {
        "split_backward_vs_inductor": timing_target(
            "split_backward_vs_inductor", 1.02, split["backward_ms"] / ref["backward_ms"], _paired(split, ref),
            higher_is_better=False, modes={"fxsplit+split": _samples(split), "inductor": _samples(ref)}),
        "duplicated_flops": {"target": "0 %", "measured": dup, "pass": abs(dup) < 1e-9,
                             "what": TARGETS["duplicated_flops"], "reliable": True, "unreliable_because": None,
                             "verdict": "PASS" if abs(dup) < 1e-9 else "MISS"},  # FLOP counts are exact
        "speedup_vs_inductor_upstream": speedup,
    }


def not_measured(name: str, why: str) -> dict[str, Any]:
    """A target this run could not measure: verdict "n/a" and the reason."""
    return {"target": None, "measured": None, "pass": None, "what": TARGETS[name], "reliable": False,
            "unreliable_because": why, "verdict": "n/a"}

