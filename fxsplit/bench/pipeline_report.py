"""The printed tables and the charts of ``fxsplit bench --pipeline``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["draw_charts", "format_table", "markdown_tables"]


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _sim(row: dict[str, Any], width: int = 0, digits: int = 2) -> str:
    """A simulated step, ``*`` where the generator's memory limit leaves that schedule out."""
    if row.get("simulated_step_ms") is None:
        return f"{'-':>{width}}"
    return f"{row['simulated_step_ms']:.{digits}f}{'*' if row.get('over_memory_limit') else ''}".rjust(width)


def _pct(v: float | None, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:+{width - 1}.1f}%"


def _limit_note(result: dict[str, Any]) -> str:
    g = result["generated"]
    return (f"sim: the generator's own replay of each schedule on the costs it generated from (one cost table for "
            f"every row, so the generated row is never slower than an upstream row without '*'); '*': over the "
            f"generator's memory limit ({_mib(g['memory_limit_bytes'])} MiB per rank), not a candidate; own err: "
            f"fxsplit.schedules.simulate with the row's own median action times, against the measured step")


def format_table(result: dict[str, Any]) -> str:
    """Measured rows (with the simulated step and its error), the ratios to the
    reference, the costs, the generated schedule and the simulated scaling table."""
    s = result["settings"]
    lines = [
        f"pipeline step time: {s['ranks']} ranks, {result['model']['stages']} stages (two per rank; Schedule1F1B: one "
        f"per rank), {s['microbatches']} microbatches, {result['model']['description']}; {result['dtype']} on "
        f"{result['device']['name']} ({result['device']['type']}, {result['device']['torch_threads_per_rank']} "
        f"thread(s) per rank); torch {result['torch_version']}; compiler {s['compiler']}"
        + ("; --quick: a smoke test, not a benchmark" if s["quick"] else ""),
        "",
        f"{'schedule':<30} {'backend':<9} {'step ms':>9} {'IQR':>7} {'/ ref':>6} {'(q1-q3)':>13} {'bubble':>7} "
        f"{'peak MiB':>8} {'sim ms':>9} {'sim err':>8} {'own err':>8}",
    ]
    for row in result["rows"]:
        r = result["ratios"][row["key"]]
        lines.append(
            f"{row['schedule']:<30} {row['backend']:<9} {row['step_ms']:9.2f} {row['step_iqr_ms']:7.2f} "
            f"{r['median']:6.3f} {'(' + format(r['q1'], '.3f') + '-' + format(r['q3'], '.3f') + ')':>13} "
            f"{row['bubble']:7.1%} {_mib(row['peak_bytes']):>8} {_sim(row, 9)} "
            f"{_pct(row['simulated_error_pct'], 8)} {_pct(row.get('own_simulated_error_pct'), 8)}"
        )
    lines += ["", f"'/ ref': step time over {result['reference']}'s in the same round (median and quartiles); "
                  "bubble: idle share of the step per rank, mean over ranks; " + _limit_note(result), "",
              "costs per stage (ms; bytes per microbatch):",
              f"{'stage':>5} {'F':>8} {'B (I)':>8} {'W':>8} {'full bwd':>9} {'comm':>7} {'act MiB':>8} {'live-in MiB':>11}"]
    for c in result["costs"]:
        lines.append(f"{c['stage']:>5} {c['f_ms']:8.3f} {c['b_ms']:8.3f} {c['w_ms']:8.3f} {c['full_backward_ms']:9.3f} "
                     f"{c['comm_ms']:7.3f} {_mib(c['activation_bytes']):>8} {_mib(c['live_in_bytes']):>11}")
    g = result["generated"]
    lines += ["", f"generated schedule: {g.get('summary', g['source'])}; memory limit "
                  f"{_mib(g['memory_limit_bytes'])} MiB per rank; {len(g['candidates'])} candidates tried"]
    scaling = result["scaling"]["rows"]
    if scaling:
        names = list(dict.fromkeys(r["schedule"] for r in scaling))
        short = {n: n.replace("Schedule", "") for n in names}
        lines += ["", "SIMULATED from the measured costs (step ms; bubble; '*': over the generator's memory limit):",
                  f"{'stages':>6} {'mbs':>4} " + " ".join(f"{short[n]:>22}" for n in names)]
        by = {(r["stages"], r["microbatches"], r["schedule"]): r for r in scaling}
        for st in sorted({r["stages"] for r in scaling}):
            for mb in sorted({r["microbatches"] for r in scaling}):
                cells = []
                for n in names:
                    r = by[(st, mb, n)]
                    star = "*" if r.get("over_memory_limit") else " "
                    cells.append(f"{'refused':>22}" if r["step_ms"] is None
                                 else f"{r['step_ms']:12.1f}{star} ({r['bubble']:5.1%})")
                lines.append(f"{st:>6} {mb:>4} " + " ".join(cells))
    return "\n".join(lines)


def draw_charts(result: dict[str, Any], path: Path) -> list[Path]:
    """``path``: step time per configuration (median, IQR, simulated); next to it,
    ``<stem>-timeline.png``: the median step of each configuration, one row per rank.
    Returns the files written; none when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = result["rows"]
    labels = [f"{r['schedule'].replace('Schedule', '')}\n{r['backend']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(rows))
    ax.bar(xs, [r["step_ms"] for r in rows], yerr=[r["step_iqr_ms"] / 2 for r in rows], color="tab:blue",
           alpha=0.8, label="measured (median, IQR)")
    ax.scatter(xs, [r["simulated_step_ms"] or float("nan") for r in rows], color="tab:orange", zorder=3,
               label="simulated (the generator's costs)")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("step time (ms)")
    s = result["settings"]
    ax.set_title(f"pipeline step: {s['ranks']} ranks, {s['microbatches']} microbatches, {result['device']['name']}, "
                 f"torch {result['torch_version']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

    timeline_path = path.with_name(path.stem + "-timeline.png")
    n = len(rows)
    ranks = s["ranks"]
    fig, axes = plt.subplots(n, 1, figsize=(11, 1.0 + 0.55 * ranks * n), sharex=True)
    colors = {"F": "tab:blue", "I": "tab:orange", "B": "tab:red", "W": "tab:green"}
    for ax, row in zip(axes if n > 1 else [axes], rows):
        for r, acts in enumerate(result["timeline"][row["key"]]):
            for stage, kind, mb, a, b in acts:
                ax.barh(r, b - a, left=a, color=colors.get(kind, "gray"), edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{row['schedule']} + {row['backend']}: {row['step_ms']:.1f} ms", fontsize=8, loc="left")
    (axes[-1] if n > 1 else axes).set_xlabel("ms from the step's start (F blue, I orange, B red, W green)")
    fig.tight_layout()
    fig.savefig(timeline_path, dpi=100)
    plt.close(fig)
    return [path, timeline_path]


def markdown_tables(result: dict[str, Any]) -> str:
    """The docs' tables from a result JSON: measured (with ratios to the reference and the
    simulated step), and the simulated scaling table, each headed by where it comes from."""
    s, d = result["settings"], result["device"]
    head = (f"{d['name']} ({d['type']}, {d['ranks']} ranks, {d['torch_threads_per_rank']} thread(s) each), "
            f"{result['dtype']}, torch {result['torch_version']}, {result['model']['description']}, "
            f"{result['model']['stages']} stages, {s['microbatches']} microbatches, {s['reps']} rounds")
    lines = [f"Measured: {head}.", "",
             "| schedule | backend | step ms (IQR) | / 1F1B + Inductor (q1-q3) | bubble | peak MiB | simulated ms "
             "(error) |", "|---|---|---|---|---|---|---|"]
    over = False
    for row in result["rows"]:
        r = result["ratios"][row["key"]]
        lines.append(f"| {row['schedule']} | {row['backend']} | {row['step_ms']:.1f} ({row['step_iqr_ms']:.1f}) | "
                     f"{r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) | {row['bubble']:.1%} | "
                     f"{_mib(row['peak_bytes'])} | {_sim(row, digits=1)} "
                     f"({_pct(row['simulated_error_pct'], 6).strip()}) |")
        over |= bool(row.get("over_memory_limit"))
    lines += ["", "Simulated: the generator's own replay of each schedule on the costs it generated from"
              + ("; '*': over its memory limit, not a candidate." if over else ".")]
    lines += ["", "| stage | F ms | B (I) ms | W ms | full backward ms | hand-over ms |", "|---|---|---|---|---|---|"]
    for c in result["costs"]:
        lines.append(f"| {c['stage']} | {c['f_ms']:.2f} | {c['b_ms']:.2f} | {c['w_ms']:.2f} | "
                     f"{c['full_backward_ms']:.2f} | {c['comm_ms']:.3f} |")
    g = result["generated"]
    lines += ["", f"Generated: {g.get('summary', g['source'])} ({len(g['candidates'])} candidates)."]
    scaling = result["scaling"]["rows"]
    if scaling:
        names = list(dict.fromkeys(r["schedule"] for r in scaling))
        by = {(r["stages"], r["microbatches"], r["schedule"]): r for r in scaling}
        lines += ["", f"SIMULATED from the costs above (step ms, bubble in brackets; {result['scaling']['note']}):", "",
                  "| stages | microbatches | " + " | ".join(n.replace("Schedule", "") for n in names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for st in sorted({r["stages"] for r in scaling}):
            for mb in sorted({r["microbatches"] for r in scaling}):
                cells = ["refused" if by[(st, mb, n)]["step_ms"] is None else
                         f"{by[(st, mb, n)]['step_ms']:.0f}{'*' if by[(st, mb, n)].get('over_memory_limit') else ''} "
                         f"({by[(st, mb, n)]['bubble']:.1%})" for n in names]
                lines.append(f"| {st} | {mb} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m fxsplit.bench.pipeline_report RESULT.json: the docs' tables
    import json
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m fxsplit.bench.pipeline_report benchmarks/results/<device>-pipeline.json")
    print(markdown_tables(json.loads(Path(sys.argv[1]).read_text())))
