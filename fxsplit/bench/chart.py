"""The benchmark's chart: time per phase and memory per mode, as a PNG next to the JSON (needs matplotlib)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["chart_figure", "draw_chart"]


def draw_chart(result: dict[str, Any], path: Path) -> bool:
    """Save :func:`chart_figure` as a PNG; False (with a note on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'fxsplit[plot]'); skipping the chart", file=sys.stderr)
        return False
    fig = chart_figure(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def _label_spec(values: Sequence[float]) -> str:
    """Format of the value labels: three significant digits for the largest value, at least one decimal."""
    top = max(values, default=0.0)
    return ".1f" if top >= 10 else ".2f" if top >= 1 else ".3f"


def chart_figure(result: dict[str, Any]) -> Any:
    """A matplotlib figure of the per-phase times and the memory figures (needs matplotlib).

    Values are written on the bars, legends sit below the axes (never over a
    bar), and memory is in MiB as in the table.
    """
    import matplotlib.pyplot as plt

    modes = result["modes"]
    names = [f"{k}. {r['key']}" for k, r in enumerate(modes, 1)]
    ys = list(range(len(modes)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.2))

    totals = [0.0] * len(modes)
    for phase, color in (("forward", "#9aa5b1"), ("B", "#3b82f6"), ("W", "#f59e0b"), ("backward", "#10b981")):
        vals = [r["timing"].get(phase, {}).get("median_ms", 0.0) for r in modes]
        if not any(vals):
            continue
        bars = ax1.barh(ys, vals, left=totals, color=color, label=phase)
        # a segment's value inside it where it fits (at least 12 % of the widest bar)
        widest = max(t + v for t, v in zip(totals, vals))
        ax1.bar_label(bars, labels=[f"{v:.1f}" if v >= 0.12 * widest else "" for v in vals], label_type="center",
                      fontsize=8, color="white")
        totals = [t + v for t, v in zip(totals, vals)]
    for y, t, r in zip(ys, totals, modes):  # (a mode that did not run, e.g. a refused baseline: no figure)
        ax1.text(t, y, f" {t:.1f} ms" if r["timing"] else " not measured", va="center", fontsize=8)
    ax1.set_yticks(ys, names)
    ax1.invert_yaxis()
    ax1.set_xlim(0, max(totals) * 1.22)
    ax1.set_xlabel("median ms per step (forward + backward phases)")
    ax1.set_title("time per phase")
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, frameon=False)

    mib = lambda v: (v or 0) / 2**20  # noqa: E731
    peak = [mib(r["peak_bytes"]) for r in modes]
    held = [mib(r["held_bytes"]) for r in modes]
    b1 = ax2.barh([y - 0.2 for y in ys], peak, height=0.4, color="#6366f1", label="peak during forward + backward")
    b2 = ax2.barh([y + 0.2 for y in ys], held, height=0.4, color="#ef4444", label="held from B to W (split modes)")
    spec = _label_spec(peak + held)
    ax2.bar_label(b1, labels=[f" {v:{spec}}" if r["peak_bytes"] is not None else " -" for v, r in zip(peak, modes)],
                  fontsize=8)
    ax2.bar_label(b2, labels=[f" {v:{spec}}" if r["held_bytes"] is not None else " -" for v, r in zip(held, modes)],
                  fontsize=8)
    ax2.set_yticks(ys, names)
    ax2.invert_yaxis()
    ax2.set_xlim(0, max(peak + held + [1e-9]) * 1.18)
    ax2.set_xlabel("MiB above the pre-forward level")
    ax2.set_title("memory (MiB)")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)

    fig.suptitle(f"fxsplit bench: {result['model']['name']}, {result['dtype']}, {result['device']['name']}, "
                 f"torch {result['torch_version']}" + (" (--quick: a smoke test, not a benchmark)"
                                                        if result["settings"].get("quick") else ""), fontsize=10)
    fig.tight_layout()
    return fig
