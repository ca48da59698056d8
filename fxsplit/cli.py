"""Command line: ``fxsplit bench [options]`` (also ``python -m fxsplit bench``).

``bench`` runs the compiled-vs-eager benchmark of the split backward
(:mod:`fxsplit.bench`); ``fxsplit bench --help`` lists its options. The
command line owns its parsers (:func:`build_bench_parser`) and the command's
steps (check the options, run, print, write); the benchmark's modules never
import this one.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from fxsplit._argparse import OneLineErrorParser, add_device_options

__all__ = ["OneLineErrorParser", "build_bench_parser", "main"]


_COMMANDS = {"bench": "time, FLOPs and memory of the backward in six modes (eager / inductor / fxsplit, "
                      "ordinary and split), accumulation, memory per stage layout, compile time"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fxsplit <command> ...``; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineErrorParser(prog="fxsplit", description="fxsplit command line")
    parser.add_argument("command", choices=sorted(_COMMANDS),
                        help="; ".join(f"{k}: {v}" for k, v in _COMMANDS.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options of the command (see fxsplit <command> -h)")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    ns = parser.parse_args(argv[:1])
    if ns.command == "bench":
        return bench(argv[1:], prog="fxsplit bench")
    raise AssertionError(ns.command)  # argparse rejected anything else


# -- fxsplit bench ---------------------------------------------------------------
def build_bench_parser(prog: str = "fxsplit bench") -> argparse.ArgumentParser:
    """The options of ``fxsplit bench``; :func:`fxsplit.bench.settings.settings_from_args` checks their values."""
    # imported here: the benchmark pulls in torch.distributed.pipelining and the models
    from fxsplit.bench import allocator

    p = OneLineErrorParser(
        prog=prog,
        description="Time, count FLOPs and measure memory of the backward of one pipeline stage in six modes: "
        "eager / Inductor / fxsplit, each with an ordinary backward and with a B/W split; then graph vs host time, "
        "4 microbatches accumulating into .grad, memory between B and W on a middle, last and first stage, and "
        "compile time per kind of user. Progress goes to stderr; the table to stdout.",
    )
    add_device_options(p, device_help="cpu or cuda[:N] (default: cuda if available, else cpu)",
                       model_help="default: gpt (a GPT-style middle stage)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None, help="sequence length (gpt, mlp) or image side (conv)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dim", type=int, default=None, help="model width (channels for conv)")
    p.add_argument("--embedding", action="store_true",
                   help="gpt only: a first stage (embeddings + blocks) fed token ids; B then has no input "
                   "gradient to compute")
    p.add_argument("--host-bound", action="store_true",
                   help="host-bound sizes (width 128, 2 x 64 tokens, 2 layers): the host (autograd, Python around "
                   "the graphs, kernel launches) costs as much as the graphs, as with a zero-bubble schedule's small "
                   "microbatches on a GPU; written to <device>[-<model>]-host-bound.json")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, 3 repetitions and shared Inductor caches: a smoke test, not a benchmark "
                   "(its verdicts are marked unreliable); written to <device>[-<model>]-quick.json, never over a "
                   "full run's results")
    p.add_argument("--reps", type=int, default=None, help="most timed repetitions per mode (default 30; 3 with --quick)")
    p.add_argument("--compile-reps", type=int, default=None,
                   help="rounds of the compile-time comparison (inductor, fxsplit split-only, fxsplit fused-only, "
                   "each compiled from scratch; default 3, 1 with --quick)")
    p.add_argument("--warm-cache", action="store_true",
                   help="use the normal Inductor caches (compile times then include cache hits)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: benchmarks/results/<device>[-<model>][-quick].json); the chart goes "
                   "next to it as .png")
    p.add_argument("--no-chart", action="store_true", help="do not draw the PNG chart")
    p.add_argument("--pipeline", action="store_true",
                   help="time whole pipeline training steps on several ranks instead (schedules with Inductor, "
                   "fxsplit and eager stages, simulated next to measured, a generated schedule); its options: "
                   "fxsplit bench --pipeline --help")
    p.add_argument("--malloc", default="default", choices=allocator.CHOICES,
                   help="CPU only: 'retain' tells glibc's malloc to keep freed memory for reuse (mmap threshold "
                   "32 MiB, no trimming) instead of handing it back to the OS and faulting it in again, as CUDA's "
                   "caching allocator does; results go to <name>-malloc-retain.json. Default: the allocator as found")
    return p


def bench(argv: Sequence[str] | None = None, prog: str = "fxsplit bench") -> int:
    """``fxsplit bench``: check the options, run, print the table, write JSON (and a PNG chart).

    Bad options exit with status 2 and a one-line message before anything is
    built or compiled. On a torch whose upstream split cannot run on a compiled
    module (:func:`fxsplit.bench.baselines.upstream_split_failure`), that
    baseline is reported "not measurable" with the reason (table, verdicts,
    JSON) and everything else is measured. Progress goes to stderr, the table
    to stdout.
    """
    from fxsplit.bench import chart, report
    from fxsplit.bench import run as bench_run
    from fxsplit.bench.settings import provenance, settings_from_args

    argv = list(sys.argv[2:] if argv is None else argv)
    if "--pipeline" in (argv or ()):  # the multi-rank benchmark has options of its own
        from fxsplit import cli_pipeline

        return cli_pipeline.bench_pipeline([a for a in argv if a != "--pipeline"], prog=f"{prog} --pipeline")
    parser = build_bench_parser(prog)
    settings = settings_from_args(parser.parse_args(argv), parser)
    origin = provenance(" ".join([prog, *argv]))  # before the run: the code it measures
    result = bench_run.run(settings)
    result.update(origin)
    print()
    print(report.format_table(result))
    out = settings.out
    assert out is not None  # settings_from_args always sets it
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")
    if settings.chart and chart.draw_chart(result, out.with_suffix(".png")):
        print(f"wrote {out.with_suffix('.png')}")
    print(f"wall time {result['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
