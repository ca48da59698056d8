"""Command line: ``fxsplit bench --pipeline [options]``, the multi-rank pipeline benchmark.

:func:`fxsplit.cli.bench` hands every ``fxsplit bench`` command line holding
``--pipeline`` to :func:`bench_pipeline`. Like ``fxsplit bench``: a bad option
is a one-line error (exit status 2) before anything is built or spawned,
progress goes to stderr, the tables to stdout, ``--quick`` writes a file of its
own, and the chart is drawn when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fxsplit._argparse import OneLineErrorParser, add_device_options

__all__ = ["PIPELINE_SIZES", "QUICK_SIZES", "bench_pipeline", "build_pipeline_parser", "default_out_path",
           "settings_from_args"]

# One stage of the two-stages-per-rank cut (Schedule1F1B's stages hold two of them).
PIPELINE_SIZES = dict(batch=2, seq=128, layers=2, dim=256, heads=4)
QUICK_SIZES = dict(batch=1, seq=16, layers=1, dim=32, heads=2)


def build_pipeline_parser(prog: str = "fxsplit bench --pipeline") -> argparse.ArgumentParser:
    """The options of ``fxsplit bench --pipeline``; :func:`settings_from_args` checks their values."""
    p = OneLineErrorParser(
        prog=prog,
        description="Time whole pipeline training steps (schedule.step()) on several ranks (gloo on CPU, NCCL on "
        "CUDA) for Schedule1F1B and ScheduleInterleaved1F1B with Inductor, ScheduleZBVZeroBubble, "
        "ScheduleInterleavedZeroBubble and ScheduleDualPipeV with fxsplit, ScheduleZBVZeroBubble on eager stages "
        "(upstream's split), and a schedule generated from the measured costs with fxsplit; print each step time "
        "next to what fxsplit.schedules.simulate predicts, then a simulated table for 8 to 64 stages. Progress goes "
        "to stderr; the tables to stdout.",
    )
    add_device_options(p, device_help="cpu or cuda (default: cuda if available, else cpu)",
                       model_help="the blocks each stage holds (default: gpt)")
    p.add_argument("--ranks", type=int, default=None, help="pipeline ranks (default 2; two stages per rank)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="per step (default 8; 4 with --quick); at least twice the ranks and a multiple of them")
    p.add_argument("--batch", type=int, default=None, help=f"samples per microbatch (default {PIPELINE_SIZES['batch']})")
    p.add_argument("--seq", type=int, default=None, help=f"sequence length (default {PIPELINE_SIZES['seq']})")
    p.add_argument("--layers", type=int, default=None,
                   help=f"blocks per stage (default {PIPELINE_SIZES['layers']}; Schedule1F1B's stages hold twice that)")
    p.add_argument("--dim", type=int, default=None, help=f"model width (default {PIPELINE_SIZES['dim']})")
    p.add_argument("--reps", type=int, default=None, help="timed rounds, each one step of every configuration "
                   "(default 30; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="steps per configuration before timing (default 2; the "
                   "first compiles)")
    p.add_argument("--compiler", default="inductor", choices=("inductor", "eager"),
                   help="'eager': fxsplit's eager inner compiler and aot_eager for the Inductor rows, to test the "
                   "harness quickly; its times are not Inductor's")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, 4 microbatches, 3 rounds, a small scaling table: a smoke test, not a benchmark; "
                   "written to <device>-pipeline[-<model>]-quick.json, never over a full run's results")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: benchmarks/results/<device>-pipeline[-<model>][-quick].json); the charts "
                   "go next to it as .png and -timeline.png")
    p.add_argument("--no-chart", action="store_true", help="do not draw the PNG charts")
    return p


def default_out_path(device: torch.device, model: str, quick: bool) -> Path:
    """``benchmarks/results/<device>-pipeline[-<model>][-quick].json`` (the model only when it is not gpt)."""
    from fxsplit.bench.models import ModelConfig
    from fxsplit.bench.settings import default_out_path as stage_out_path

    stem = stage_out_path(device, ModelConfig()).stem + "-pipeline"
    if model != "gpt":
        stem += f"-{model}"
    if quick:
        stem += "-quick"
    return stage_out_path(device, ModelConfig()).parent / f"{stem}.json"


def _positive(parser: argparse.ArgumentParser, name: str, value: int | None) -> None:
    if value is not None and value < 1:
        parser.error(f"--{name} must be at least 1, got {value}")


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, Path]:
    """Check the options (each bad one a one-line error through ``parser.error``, exit
    status 2, before anything is built) and return the settings and the JSON path."""
    from fxsplit.bench.models import ModelConfig, build
    from fxsplit.bench.pipeline import PipelineSettings
    from fxsplit.bench.settings import DTYPES

    if args.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            parser.error(f"--device {args.device!r} is not a device; use cpu or cuda")
        if device.type not in ("cpu", "cuda") or device.index is not None:
            parser.error(f"--device {args.device}: use cpu or cuda (each rank takes its own GPU)")
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device cuda: CUDA is not available (torch {torch.__version__})")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else
                           "float16" if device.type == "cuda" else "float32")
    for name in ("ranks", "microbatches", "batch", "seq", "layers", "dim", "reps", "warmup"):
        _positive(parser, name, getattr(args, name))
    ranks = args.ranks or 2
    if ranks < 2:
        parser.error(f"--ranks must be at least 2 (a pipeline), got {ranks}")
    if device.type == "cuda" and ranks > torch.cuda.device_count():
        parser.error(f"--ranks {ranks}: only {torch.cuda.device_count()} CUDA device(s), one per rank")
    microbatches = args.microbatches or (4 if args.quick else 8)
    if microbatches < 2 * ranks or microbatches % ranks:
        parser.error(f"--microbatches {microbatches}: needs at least {2 * ranks} (ScheduleDualPipeV: as many as the "
                     f"{2 * ranks} stages) and a multiple of --ranks {ranks} (the interleaved schedules' rounds)")
    sizes = dict(QUICK_SIZES if args.quick else PIPELINE_SIZES)
    for k in ("batch", "seq", "layers", "dim"):
        if getattr(args, k) is not None:
            sizes[k] = getattr(args, k)
    cfg = ModelConfig(name=args.model, **sizes)
    try:
        build(cfg, "meta", DTYPES[dtype])
    except (ValueError, RuntimeError) as e:
        parser.error(f"--model {cfg.name} cannot be built with --batch {cfg.batch}, --seq {cfg.seq}, --layers "
                     f"{cfg.layers}, --dim {cfg.dim}: {str(e).splitlines()[0]}")
    out = args.out or default_out_path(device, args.model, args.quick)
    if out.is_dir():
        parser.error(f"--out {out} is a directory; give the JSON file's path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {out}: cannot create {out.parent} ({e.strerror})")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        parser.error(f"--out {out}: not writable")
    if args.quick and out.is_file():
        try:
            previous = json.loads(out.read_text())
        except (OSError, ValueError):
            previous = None
        if isinstance(previous, dict) and previous.get("settings", {}).get("quick") is False:
            parser.error(f"--out {out} holds the results of a full run; --quick will not overwrite them")
    from fxsplit import _torch_internals

    # last, so that every option is checked on every torch
    if device.type == "cpu" and _torch_internals.v_schedules_fail_with_gloo():
        parser.error(f"torch {torch.__version__}: upstream's V-shaped schedules fail with gloo in _initialize_stages "
                     "('Pair is not connected'); --pipeline on CPU needs a newer torch (2.13 to 2.15 run it)")
    settings = PipelineSettings(
        model=cfg.as_dict(), device=device.type, dtype=dtype, ranks=ranks, microbatches=microbatches,
        warmup=args.warmup or (1 if args.quick else 2), reps=args.reps or (3 if args.quick else 30),
        compiler=args.compiler, quick=args.quick, timeout_s=1800.0 if args.quick else 3600.0,
        scaling_ranks=(4,) if args.quick else None, scaling_microbatches=(16,) if args.quick else None,
    )
    return settings, out


def bench_pipeline(argv: Sequence[str], prog: str = "fxsplit bench --pipeline") -> int:
    """``fxsplit bench --pipeline``: check the options, run, print the tables, write JSON and charts."""
    from fxsplit.bench import pipeline, pipeline_report
    from fxsplit.bench.settings import provenance

    parser = build_pipeline_parser(prog)
    args = parser.parse_args(argv)
    settings, out = settings_from_args(args, parser)
    origin = provenance(" ".join([prog, *argv]))  # before the run: the code it measures
    result = pipeline.run(settings)
    result.update(origin)
    print()
    print(pipeline_report.format_table(result))
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")
    if not args.no_chart:
        for path in pipeline_report.draw_charts(result, out.with_suffix(".png")):
            print(f"wrote {path}")
    print(f"wall time {result['wall_s']:.1f} s")
    return 0
