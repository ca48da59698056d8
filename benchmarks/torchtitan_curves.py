"""Loss curves: torchtitan's Llama 3 debug model trained under 1F1B + Inductor (torchtitan's own
stages) and under ZB-V and DualPipeV + fxsplit, on the Python standard library's sources.

    python benchmarks/torchtitan_curves.py [--steps 120] [--out benchmarks/results/cpu-torchtitan-curves.json]

Every run starts from the same weights (a seeded whole model's) and sees the same batches
(byte windows of the standard library's ``.py`` files, :func:`fxsplit.bench.titan.stdlib_text`);
each is torchtitan's config, module split, ``parallelize_fn``, schedule builder, AdamW, LR
schedule and gradient clipping, on 2 gloo CPU ranks (:mod:`fxsplit.bench.titan`). Writes the
per-step losses, their relative difference to the 1F1B + Inductor run, the command, torch
version and code revision to ``--out``, and the figure next to it (``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from fxsplit.bench import titan

RUNS = {
    "1F1B + Inductor (torchtitan's stages)": {"schedule": "1F1B", "backend": "inductor", "registry": "torchtitan"},
    "ZBVZeroBubble + fxsplit": {"schedule": "ZBVZeroBubble", "backend": "fxsplit"},
    "DualPipeV + fxsplit": {"schedule": "DualPipeV", "backend": "fxsplit"},
}
BASELINE = next(iter(RUNS))


def _revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
        # the code the figures depend on: fxsplit's package, its passes, this script
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ":/fxsplit", ":/passes", ":/benchmarks/*.py"],
                               capture_output=True,
                               text=True, cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[2, 1])
    for name, losses in result["losses"].items():
        top.plot(range(1, len(losses) + 1), losses, label=name, lw=1.2)
    top.set_ylabel("training loss")
    top.set_yscale("log")
    top.legend()
    top.set_title(f"torchtitan llama3_debugmodel ({result['layers']} layers), stdlib bytes, 2 gloo CPU ranks\n"
                  f"torch {result['torch_version']}, torchtitan {result['torchtitan_version']}, "
                  f"fxsplit {result['code_revision']}",
                  fontsize=9)
    for name, diff in result["relative_difference"].items():
        bottom.plot(range(1, len(diff) + 1), diff, label=name, lw=1.0)
    bottom.axhline(0, color="0.6", lw=0.6)
    bottom.set_ylabel(f"relative difference\nto {BASELINE.split(' (')[0]}")
    bottom.set_xlabel("optimizer step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/cpu-torchtitan-curves.json")
    args = parser.parse_args(argv)
    common = {"steps": args.steps, "seq_len": args.seq_len, "data": "stdlib", "check": False}
    runs = tuple(titan.TitanRun(**common, **spec) for spec in RUNS.values())
    start = time.perf_counter()
    by_rank = titan.run(runs, ranks=2, timeout_s=3600, on_progress=lambda m: print(m, file=sys.stderr))
    losses = {}
    for name, i in zip(RUNS, range(len(runs))):
        last = [rank[i] for rank in by_rank if "loss" in rank[i]["steps"][0]]
        losses[name] = [s["loss"] for s in last[0]["steps"]]
    base = torch.tensor(losses[BASELINE], dtype=torch.float64)
    relative = {name: ((torch.tensor(v, dtype=torch.float64) - base) / base).tolist()
                for name, v in losses.items() if name != BASELINE}
    import torchtitan

    result = {
        "command": " ".join(["python benchmarks/torchtitan_curves.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": "cpu, 2 gloo ranks, 1 thread each",
        "torch_version": torch.__version__, "torchtitan_version": getattr(torchtitan, "__version__", "?"),
        "code_revision": _revision(), "wall_s": round(time.perf_counter() - start, 1),
        "runs": {name: dict(spec) for name, spec in RUNS.items()},
        "config": runs[0].config, "layers": by_rank[0][0]["layers"], "seq_len": args.seq_len,
        "local_batch": runs[0].local_batch, "microbatch": runs[0].microbatch, "steps": args.steps,
        "losses": losses, "relative_difference": relative,
        "max_abs_relative_difference": {n: max(abs(x) for x in v) for n, v in relative.items()},
        "first_last_loss": {n: [v[0], v[-1]] for n, v in losses.items()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    plot(result, os.path.splitext(args.out)[0] + ".png")
    for name, v in losses.items():
        extra = "" if name == BASELINE else f"  max |relative difference| {result['max_abs_relative_difference'][name]:.2e}"
        print(f"{name:40s} loss {v[0]:.4f} -> {v[-1]:.4f}{extra}")
    print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.png ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
