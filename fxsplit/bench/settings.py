"""What one ``fxsplit bench`` run measures: :class:`BenchSettings`, built from the
command line's options by :func:`settings_from_args`, which checks each of them
(a bad one is a one-line error, exit status 2, before anything is built or
compiled), and where the results go (:func:`default_out_path`).

The options themselves are declared with the command line, in :mod:`fxsplit.cli`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from fxsplit.bench import allocator
from fxsplit.bench.models import ModelConfig, build

__all__ = ["BenchSettings", "DTYPES", "default_out_path", "device_name", "results_dir", "settings_from_args"]


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """What to run. ``reps`` is a cap; ``min_time_s`` is the time per mode the
    repetition count aims for (within ``min_reps`` .. ``reps``)."""

    model: ModelConfig
    device: str = "cpu"
    dtype: str = "float32"
    warmup: int = 2
    min_reps: int = 5
    reps: int = 30
    min_time_s: float = 2.0
    warm_cache: bool = False
    quick: bool = False
    compile_reps: int = 3
    out: Path | None = None
    chart: bool = True
    malloc: str = "default"  # or "retain" (CPU, glibc): see fxsplit.bench.allocator
    host_bound: bool = False  # the host-bound sizes (_HOST_BOUND_SIZES)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_SIZES = {
    "gpt": dict(batch=4, seq=128, layers=2, dim=256, heads=4),
    "mlp": dict(batch=8, seq=64, layers=4, dim=256),
    "conv": dict(batch=4, seq=16, layers=3, dim=32),
    "llama": dict(batch=4, seq=128, layers=2, dim=256, heads=4),
    "moe": dict(batch=4, seq=128, layers=2, dim=256, heads=4),
}
# --host-bound: a stage small enough that the host (autograd, Python around the graphs, kernel
# launches) costs as much as the graphs: the regime of a zero-bubble schedule's small microbatches
# on a GPU, and of any tiny stage on a CPU. Width 128, 2 x 64 tokens, 2 layers.
_HOST_BOUND_SIZES = dict(batch=2, seq=64, layers=2, dim=128)
# Tiny sizes for --quick on a model this table does not list (a model added to MODELS).
_GENERIC_QUICK = dict(batch=1, seq=16, layers=1, dim=32, heads=2)
_QUICK_SIZES = {
    "gpt": dict(batch=1, seq=16, layers=1, dim=32, heads=2),
    "mlp": dict(batch=1, seq=16, layers=1, dim=32),
    "conv": dict(batch=1, seq=8, layers=1, dim=8),
    "llama": dict(batch=1, seq=16, layers=1, dim=32, heads=2),
    "moe": dict(batch=1, seq=16, layers=1, dim=32, heads=2),
}


def _check_device(parser: argparse.ArgumentParser, spec: str) -> torch.device:
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        parser.error(f"--device {spec!r} is not a device; use cpu or cuda[:N]")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {spec}: the benchmark runs on cpu or cuda[:N] only")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            parser.error(f"--device {spec}: CUDA is not available ({why}, torch {torch.__version__})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"--device {spec}: there are {torch.cuda.device_count()} CUDA device(s)")
    return device


def _check_dtype(parser: argparse.ArgumentParser, dtype: str, device: torch.device) -> None:
    if device.type == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        parser.error(f"--dtype bfloat16: {torch.cuda.get_device_name(device)} does not support it; "
                     "use float16 or float32")


def _check_model(parser: argparse.ArgumentParser, cfg: ModelConfig, dtype: str) -> None:
    """Build the model on the meta device (no memory, no compile) so that a size the model refuses
    (e.g. a width not divisible by the attention heads) is reported as an option error."""
    try:
        build(cfg, "meta", DTYPES[dtype])
    except (ValueError, RuntimeError) as e:
        sizes = ", ".join(f"--{k} {getattr(cfg, k)}" for k in ("batch", "seq", "layers", "dim"))
        parser.error(f"--model {cfg.name} cannot be built with {sizes}: {str(e).splitlines()[0]}")


def _check_out(parser: argparse.ArgumentParser, out: Path, quick: bool) -> None:
    if out.is_dir():
        parser.error(f"--out {out} is a directory; give the JSON file's path")
    try:  # the results are written after minutes of work: find out now whether they can be
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {out}: cannot create {out.parent} ({e.strerror})")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        parser.error(f"--out {out}: not writable")
    if quick and out.is_file():
        try:
            previous = json.loads(out.read_text())
        except (OSError, ValueError):
            return
        if isinstance(previous, dict) and previous.get("settings", {}).get("quick") is False:
            parser.error(f"--out {out} holds the results of a full run; --quick will not overwrite them")


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchSettings:
    """Validate the options ``parser`` parsed (:func:`fxsplit.cli.build_bench_parser`; each bad one
    is a one-line error through ``parser.error``, exit status 2, before anything is compiled) and
    turn them into :class:`BenchSettings`."""
    device = _check_device(parser, args.device) if args.device else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else
                           "float16" if device.type == "cuda" else "float32")
    _check_dtype(parser, dtype, device)
    sizes = dict((_QUICK_SIZES if args.quick else _DEFAULT_SIZES).get(args.model, _GENERIC_QUICK if args.quick else {}))
    host_bound = getattr(args, "host_bound", False)
    if host_bound:
        if args.quick:
            parser.error("--host-bound and --quick choose sizes both: give one")
        if args.model == "conv":
            parser.error("--host-bound applies to the transformer and MLP models (gpt, llama, moe, mlp)")
        sizes.update(_HOST_BOUND_SIZES)
    for k in ("batch", "seq", "layers", "dim"):
        v = getattr(args, k)
        if v is not None:
            if v <= 0:
                parser.error(f"--{k} must be at least 1, got {v}")
            sizes[k] = v
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.embedding and args.model != "gpt":
        parser.error("--embedding applies to --model gpt only")
    cfg = ModelConfig(name=args.model, embedding=args.embedding, **sizes)
    _check_model(parser, cfg, dtype)
    timing: dict[str, Any] = dict(warmup=1, min_reps=3, reps=3, min_time_s=0.0, compile_reps=1) if args.quick else {}
    if args.compile_reps is not None:
        if args.compile_reps < 1:
            parser.error(f"--compile-reps must be at least 1, got {args.compile_reps}")
        timing["compile_reps"] = args.compile_reps
    if args.reps is not None:
        timing.update(reps=args.reps, min_reps=min(args.reps, timing.get("min_reps", 5)))
    if args.malloc != "default":
        if device.type != "cpu":
            parser.error(f"--malloc {args.malloc} applies to --device cpu only (CUDA memory has its own allocator)")
        problem = allocator.glibc_problem()
        if problem is not None:
            parser.error(f"--malloc {args.malloc}: {problem}")
    out = args.out or default_out_path(device, cfg, quick=args.quick, malloc=args.malloc, host_bound=host_bound)
    _check_out(parser, out, args.quick)
    return BenchSettings(
        model=cfg, device=str(device), dtype=dtype, warm_cache=args.warm_cache or args.quick, quick=args.quick,
        out=out, chart=not args.no_chart, malloc=args.malloc, host_bound=host_bound, **timing,
    )


def provenance(command: str) -> dict[str, str]:
    """What every results file records about where it came from: ``command`` (as run),
    ``code_revision`` (the checkout's commit, ``+dirty`` when tracked files differ from
    it; ``fxsplit <version>`` for an installed copy outside a checkout), ``torch_version``."""
    import subprocess

    import fxsplit

    here = Path(__file__).resolve().parent
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, check=True,
                                  timeout=10).stdout.strip()

        revision = git("rev-parse", "--short=7", "HEAD")
        if git("status", "--porcelain", "--untracked-files=no"):
            revision += "+dirty"
    except (OSError, subprocess.SubprocessError):
        revision = f"fxsplit {fxsplit.__version__}"
    return {"command": command, "code_revision": revision, "torch_version": torch.__version__}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine() or "cpu"


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$", " ", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:60] or "unknown"


def default_out_path(device: torch.device, model: ModelConfig, quick: bool = False, malloc: str = "default",
                     host_bound: bool = False) -> Path:
    """``benchmarks/results/<device>[-<model>][-host-bound][-malloc-<choice>][-quick].json`` (the model
    only when it is not the default gpt, the allocator only when it is not the default). A ``--quick``
    run has a file of its own, so it never replaces a full run's results."""
    stem = f"{device.type}-{_slug(device_name(device))}"
    if model.name != "gpt" or model.embedding:
        stem += f"-{model.name}" + ("-embedding" if model.embedding else "")
    if host_bound:
        stem += "-host-bound"
    if malloc != "default":
        stem += f"-malloc-{malloc}"
    if quick:
        stem += "-quick"
    return results_dir() / f"{stem}.json"


def results_dir() -> Path:
    """The repository's ``benchmarks/results`` when run from a checkout, else ``./benchmarks/results``."""
    repo = Path(__file__).resolve().parents[2]
    if (repo / "benchmarks" / "results").is_dir():
        return repo / "benchmarks" / "results"
    return Path.cwd() / "benchmarks" / "results"

