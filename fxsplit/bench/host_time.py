"""Graph time and host time of the split (the benchmark's ``host`` section).

Read from ``PendingWeightGrads.timings`` of every timed ``fxsplit+split``
repetition; next to it, in the same rounds, the time fxsplit's ordinary
backward spends outside its fused graph (what every compiled backward pays),
so that what the split itself adds can be told apart.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from fxsplit.bench.targets import not_measured, spread, timing_target
from fxsplit.bench.timing import HOST_KEYS

__all__ = ["host_added_target", "host_section", "host_target"]


def host_section(host: Sequence[dict[str, int] | None], inductor: dict[str, Any],
                  ordinary_host_s: Sequence[float | None] = ()) -> dict[str, Any]:
    """Graph time and host time of the fxsplit split per repetition, from ``PendingWeightGrads.timings``.

    Host time of B = ``b_ns - b_graph_ns``, of W = ``w_ns - w_graph_ns``
    (the autograd walk, recording, the commit's engine call, Python around the
    graphs). ``available`` is False (figures "n/a") where this fxsplit does
    not record timings.

    ``ordinary_host_s``: seconds outside the fused graph of fxsplit's
    ordinary backward per repetition (what any compiled backward spends in the
    autograd engine, AOTAutograd's wrappers and AccumulateGrad). Where given,
    the section also has ``added_ms``: the split's host time minus that, per
    round, and its fraction of Inductor's ordinary backward.
    """
    if not host or any(h is None or not set(HOST_KEYS[:4]) <= set(h) for h in host):
        return {"available": False, "why": "n/a: this fxsplit's PendingWeightGrads has no timings",
                "keys": list(HOST_KEYS)}
    ms = lambda ns: ns / 1e6  # noqa: E731
    per_rep = {
        "b_graph_ms": [ms(h["b_graph_ns"]) for h in host],  # type: ignore[index]
        "b_host_ms": [ms(h["b_ns"] - h["b_graph_ns"]) for h in host],  # type: ignore[index]
        "w_graph_ms": [ms(h["w_graph_ns"]) for h in host],  # type: ignore[index]
        "w_host_ms": [ms(h["w_ns"] - h["w_graph_ns"]) for h in host],  # type: ignore[index]
    }
    if all("w_commit_ns" in h for h in host):  # type: ignore[operator]
        per_rep["w_commit_ms"] = [ms(h["w_commit_ns"]) for h in host]  # type: ignore[index]
    host_ms = [b + w for b, w in zip(per_rep["b_host_ms"], per_rep["w_host_ms"])]
    fused = inductor["timing"]["total_backward"]["samples_ms"]
    section = {
        "available": True,
        "what": "fxsplit split, per timed repetition: time inside the compiled dI/dW graphs and outside them "
        "(host: B = b_ns - b_graph_ns, W = w_ns - w_graph_ns), from PendingWeightGrads.timings",
        **{k: spread(v) for k, v in per_rep.items()},
        "host_ms": spread(host_ms),
        "host_fraction_of_inductor_backward": [h / f for h, f in zip(host_ms, fused)],
        "samples": per_rep,
    }
    ordinary = [None if s is None else s * 1e3 for s in ordinary_host_s]
    if ordinary and all(o is not None for o in ordinary):
        added = [h - o for h, o in zip(host_ms, ordinary)]  # type: ignore[operator]
        section.update({
            "ordinary_host_ms": spread(ordinary),  # type: ignore[arg-type]
            "added_ms": spread(added),
            "added_fraction_of_inductor_backward": [a / f for a, f in zip(added, fused)],
        })
        per_rep["ordinary_host_ms"] = ordinary  # type: ignore[assignment]
    return section


def host_target(section: dict[str, Any]) -> dict[str, Any]:
    if not section["available"]:
        return not_measured("host_time", section["why"])
    ratios = section["host_fraction_of_inductor_backward"]
    return timing_target("host_time", 0.02, statistics.median(ratios), ratios, higher_is_better=False)


def host_added_target(section: dict[str, Any]) -> dict[str, Any]:
    if not section["available"] or "added_fraction_of_inductor_backward" not in section:
        return not_measured("host_time_added", section.get("why") or "n/a: fxsplit records no fused graph time")
    ratios = section["added_fraction_of_inductor_backward"]
    return timing_target("host_time_added", 0.02, statistics.median(ratios), ratios, higher_is_better=False)
