"""Compiled-vs-eager benchmark of the split backward: the README's main job.

One run measures six ways of running the backward of one pipeline stage,
side by side, on the same weights and inputs:

1. ``eager``: eager module, ordinary backward;
2. ``eager+upstream``: eager module, upstream eager split
   (``torch.distributed.pipelining._backward.stage_backward_input`` then
   ``stage_backward_weight``);
3. ``inductor``: ``torch.compile(backend="inductor")``, ordinary backward
   (the reference the other modes are compared with);
4. ``inductor+upstream``: the same compiled module with the upstream split.
   With AOTAutograd's default ``donated_buffer=True`` it fails (the error is
   recorded); it is measured on a module compiled and run with
   ``torch._functorch.config.donated_buffer=False`` (the config is read when
   the backward is compiled and again when it runs, so every call of this
   mode is made under the patch);
5. ``fxsplit``: ``backend=fxsplit.backend()``, ordinary backward;
6. ``fxsplit+split``: the same module with ``fxsplit.stage_backward_input``
   then ``fxsplit.stage_backward_weight``.

Then, on the same stage: the graph time and host time of mode 6 (from
``PendingWeightGrads.timings`` where fxsplit records them), 4 microbatches
accumulating into ``.grad`` (Inductor's ordinary backward against fxsplit's
B + W), memory between B and W for a middle, a last and a first stage layout
(:mod:`fxsplit.bench.memory`) and compile time per kind of user
(:mod:`fxsplit.bench.compile_time`, last: it resets Dynamo). Every target is
printed as a verdict with the spread it rests on and stored under ``targets``.

How each figure is taken (also stored in the JSON under ``methods``):

* times: each repetition runs forward, then B and W (split modes) or the
  ordinary backward, with a clock read between phases: ``time.perf_counter``
  on CPU (what ``torch.utils.benchmark.Timer`` uses), CUDA events on CUDA.
  B and W cannot be timed by ``Timer`` on their own since each needs a fresh
  forward. Repetitions of the six modes are interleaved round-robin (each
  round starting one mode later, so no mode always follows the same one), so
  background load hits all modes alike; warm-up repetitions are dropped and
  medians (and IQRs) come from ``torch.utils.benchmark.Measurement``.
* FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over B, W and the
  ordinary backward, with :mod:`fxsplit.bench.flops`' formulas for the ops it
  counts as 0 (``_grouped_mm``, CPU flash attention). A dispatch mode cannot see inside a fused Inductor
  kernel, so for the compiled modes FLOPs are counted on the very FX graphs
  Inductor compiles (Inductor's decompositions and partitioner, run op by op
  via ``fxsplit.backend(compiler="eager")``); what the counter observes in
  the real compiled run is stored too (``flops_observed``).
* held between B and W: the allocator-level growth of live memory from
  before the forward to after B, with the stage output, the returned input
  gradients and the input's ``.grad`` dropped (parameters' ``.grad`` already
  exist, so W allocates nothing lasting). On CUDA from
  ``torch.cuda.memory_allocated``; on CPU from the CPU allocator's
  allocation and free events recorded by ``torch.profiler`` with
  ``profile_memory=True``. The declared figure is stored next to it:
  ``PendingWeightGrads.live_in_bytes`` (fxsplit) or the bytes of the
  gradients saved in upstream's ``param_groups``; the measured one also
  counts the activations autograd keeps alive for W.
* peak: highest live memory above the pre-forward level during one
  forward + backward (B + W); ``torch.cuda.max_memory_allocated`` on CUDA,
  the same profiler allocation events on CPU.
* compile: wall time of the first forward + backward of a compiled module
  (Dynamo, AOTAutograd, Inductor codegen and C/C++ or Triton compile), in a
  fresh Inductor cache of its own unless ``--warm-cache``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from torch.utils.benchmark import Measurement
from torch.utils.benchmark.utils.common import TaskSpec

import fxsplit
from fxsplit.bench import allocator
from fxsplit.cli import OneLineErrorParser
from fxsplit.bench.compile_time import COMPILE_USERS, measure_compile_times
from fxsplit.bench.flops import flop_counter
from fxsplit.bench.memory import MEMORY_TARGETS, MemoryMeter as _MemoryMeter, measure_memory_layouts, memory_targets
from fxsplit.bench.models import MODELS, ModelConfig, Stage, build

log = logging.getLogger("fxsplit")

__all__ = ["BenchSettings", "MODE_KEYS", "build_parser", "main", "run", "format_table"]

# 2: FLOPs include grouped_mm and CPU flash attention; host, accumulate, memory and compile sections.
SCHEMA_VERSION = 2
MODE_KEYS = ("eager", "eager+upstream", "inductor", "inductor+upstream", "fxsplit", "fxsplit+split")
REFERENCE = "inductor"
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


# -- private torch APIs the benchmark compares against, in one place ---------
def _upstream() -> Any:
    """``torch.distributed.pipelining._backward``: the eager split that pipelining schedules use today."""
    from torch.distributed.pipelining import _backward

    return _backward


class _ProbeFunction(torch.autograd.Function):
    """``x @ w`` as a custom autograd Function: compiled regions reach autograd the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


def upstream_split_failure() -> str | None:
    """Why upstream's split cannot run on a compiled module with this torch (None if it can).

    Probes ``stage_backward_input`` then ``stage_backward_weight`` on one custom
    autograd Function (microseconds, no compile): a compiled region is such a
    Function (``CompiledFunctionBackward``). torch 2.11's
    ``stage_backward_weight`` fails there: it starts ``autograd.grad`` from
    ``GradientEdge``s to Function nodes whose graph ``stage_backward_input``
    already released (its ``detach_()`` of the stage outputs), and reading such
    a node's ``_input_metadata`` raises (pytorch/pytorch#166577, #161904);
    torch 2.13 and later run it. Feature-detected, not version-compared.
    """
    w = torch.nn.Parameter(torch.ones(2, 2))
    x = torch.ones(1, 2, requires_grad=True)
    out = _ProbeFunction.apply(x, w)
    try:
        _, pending = _upstream().stage_backward_input([out], [torch.ones_like(out)], [x], [w])
        _upstream().stage_backward_weight([w], pending)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"upstream's split (torch.distributed.pipelining._backward) fails on compiled modules with torch "
                f"{torch.__version__} (pytorch/pytorch#166577: {first[:90]}...), so the inductor+upstream baseline "
                "cannot be measured; torch 2.13 to 2.15 run it")
    return None


def _donated_buffer(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """``torch._functorch.config.donated_buffer``: read when AOTAutograd compiles the backward and when it runs."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(donated_buffer=enabled)


def _fresh_inductor_cache() -> contextlib.AbstractContextManager[None]:
    """``torch._inductor.utils.fresh_cache``: a temporary cache dir and cleared in-process caches."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache()


# -- settings ------------------------------------------------------------------
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


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_SIZES = {
    "gpt": dict(batch=4, seq=128, layers=2, dim=256, heads=4),
    "mlp": dict(batch=8, seq=64, layers=4, dim=256),
    "conv": dict(batch=4, seq=16, layers=3, dim=32),
    "llama": dict(batch=4, seq=128, layers=2, dim=256, heads=4),
    "moe": dict(batch=4, seq=128, layers=2, dim=256, heads=4),
}
# Tiny sizes for --quick on a model this table does not list (a model added to MODELS).
_GENERIC_QUICK = dict(batch=1, seq=16, layers=1, dim=32, heads=2)
_QUICK_SIZES = {
    "gpt": dict(batch=1, seq=16, layers=1, dim=32, heads=2),
    "mlp": dict(batch=1, seq=16, layers=1, dim=32),
    "conv": dict(batch=1, seq=8, layers=1, dim=8),
    "llama": dict(batch=1, seq=16, layers=1, dim=32, heads=2),
    "moe": dict(batch=1, seq=16, layers=1, dim=32, heads=2),
}


def build_parser(prog: str = "fxsplit bench") -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog=prog,
        description="Time, count FLOPs and measure memory of the backward of one pipeline stage in six modes: "
        "eager / Inductor / fxsplit, each with an ordinary backward and with a B/W split; then graph vs host time, "
        "4 microbatches accumulating into .grad, memory between B and W on a middle, last and first stage, and "
        "compile time per kind of user. Progress goes to stderr; the table to stdout.",
    )
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="default: bfloat16 on CUDA (float16 where the GPU lacks bf16), float32 on CPU")
    p.add_argument("--model", default="gpt", choices=sorted(MODELS), help="default: gpt (a GPT-style middle stage)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None, help="sequence length (gpt, mlp) or image side (conv)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dim", type=int, default=None, help="model width (channels for conv)")
    p.add_argument("--embedding", action="store_true",
                   help="gpt only: a first stage (embeddings + blocks) fed token ids; B then has no input "
                   "gradient to compute")
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
    p.add_argument("--malloc", default="default", choices=allocator.CHOICES,
                   help="CPU only: 'retain' tells glibc's malloc to keep freed memory for reuse (mmap threshold "
                   "32 MiB, no trimming) instead of handing it back to the OS and faulting it in again, as CUDA's "
                   "caching allocator does; results go to <name>-malloc-retain.json. Default: the allocator as found")
    return p


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
        build(cfg, "meta", _DTYPES[dtype])
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


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> BenchSettings:
    """Validate the options (each bad one is a one-line error, exit status 2, before anything is
    compiled) and turn them into :class:`BenchSettings`."""
    parser = parser or build_parser()
    device = _check_device(parser, args.device) if args.device else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else
                           "float16" if device.type == "cuda" else "float32")
    _check_dtype(parser, dtype, device)
    sizes = dict((_QUICK_SIZES if args.quick else _DEFAULT_SIZES).get(args.model, _GENERIC_QUICK if args.quick else {}))
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
    out = args.out or default_out_path(device, cfg, quick=args.quick, malloc=args.malloc)
    _check_out(parser, out, args.quick)
    return BenchSettings(
        model=cfg, device=str(device), dtype=dtype, warm_cache=args.warm_cache or args.quick, quick=args.quick,
        out=out, chart=not args.no_chart, malloc=args.malloc, **timing,
    )


# -- modes -----------------------------------------------------------------
@dataclasses.dataclass
class Mode:
    """One way of running a stage: a module and how its backward is run."""

    key: str
    label: str
    module: torch.nn.Module
    split: str | None  # None (ordinary backward), "upstream" or "fxsplit"
    context: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    compiled: str | None = None  # name of the compiled module this mode shares
    flops_module: torch.nn.Module | None = None  # runs the same graphs op by op (compiled modes)


@dataclasses.dataclass
class StepResult:
    times: dict[str, float]  # seconds per phase: forward and B, W or backward
    held: Any = None  # PendingWeightGrads / param_groups, only while measuring memory


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


def _params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(module.parameters())


def _backward_phases(
    mode: Mode, module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor,
    between: Callable[[str], None] = lambda phase: None,
    on_pending: Callable[[Any], None] = lambda pending: None,
) -> None:
    """Forward then backward of ``module`` as ``mode`` runs it, calling
    ``between(phase)`` after each phase ("forward", "B", "W" or "backward").
    Returns nothing held: everything B left for W has been consumed."""
    inputs = [x]
    with mode.context():
        out = module(x)
        between("forward")
        if mode.split is None:
            torch.autograd.backward([out], [grad])
            del out
            between("backward")
            return None
        params = _params(module)
        if mode.split == "upstream":
            up = _upstream()
            dinputs, pending = up.stage_backward_input([out], [grad], inputs, iter(params))
        else:
            dinputs, pending = fxsplit.stage_backward_input([out], [grad], inputs, params)
        del out, dinputs
        x.grad = None
        on_pending(pending)
        between("B")
        if mode.split == "upstream":
            _upstream().stage_backward_weight(iter(params), pending)
        else:
            fxsplit.stage_backward_weight(params, pending)
        del pending
        between("W")
    return None


HOST_KEYS = ("b_ns", "b_graph_ns", "w_ns", "w_graph_ns", "w_commit_ns")


def _fault_summary(counts: Sequence[int | None]) -> dict[str, Any]:
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


def _timed_step(mode: Mode, stage: Stage, grad: torch.Tensor, device: torch.device,
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
    _backward_phases(mode, mode.module, x, grad, between, on_pending=held.append)
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


ACCUMULATE_MICROBATCHES = 4


def _accumulate_step(mode: Mode, stage: Stage, grad: torch.Tensor, device: torch.device) -> float:
    """Seconds of backward (B + W, or the ordinary backward) summed over
    :data:`ACCUMULATE_MICROBATCHES` microbatches accumulating into ``.grad``,
    which starts as ``None`` (as after ``zero_grad(set_to_none=True)``): the
    first microbatch allocates ``.grad``, the others add to it. Forwards are
    not counted."""
    for p in _params(mode.module):
        p.grad = None
    total = 0.0
    for _ in range(ACCUMULATE_MICROBATCHES):
        t = _timed_step(mode, stage, grad, device)
        total += sum(v for k, v in t.items() if k != "forward")
    return total


def _held_declared(mode: Mode, pending: Any) -> int:
    if mode.split == "fxsplit":
        return int(pending.live_in_bytes)
    total = 0
    for group in pending:
        for grads in group.get("grads") or ():
            for g in grads or ():
                if isinstance(g, torch.Tensor):
                    total += g.numel() * g.element_size()
    return total


# -- memory ----------------------------------------------------------------
def _measure_memory(mode: Mode, stage: Stage, grad: torch.Tensor, device: torch.device) -> dict[str, int | None]:
    """Peak over forward + backward; for split modes also what is held between B and W."""
    meter = _MemoryMeter(device)
    x = stage.make_input()
    declared: list[int] = []

    def between(phase: str) -> None:
        if phase == "B":
            meter.mark("B")

    with meter.window():
        _backward_phases(mode, mode.module, x, grad, between, on_pending=lambda p: declared.append(_held_declared(mode, p)))
    if mode.split is None:
        return {"peak_bytes": meter.peak, "held_bytes": None, "held_bytes_declared": None}
    return {"peak_bytes": meter.peak, "held_bytes": meter.levels["B"], "held_bytes_declared": declared[0]}


# -- FLOPs -----------------------------------------------------------------
def _count_flops(mode: Mode, module: torch.nn.Module, stage: Stage, grad: torch.Tensor) -> dict[str, int | None]:
    """FLOPs of B, W (split modes) and of the whole backward, as FlopCounterMode sees them."""
    counts: dict[str, int | None] = {"B": None, "W": None}
    x = stage.make_input()
    params = _params(module)
    with mode.context():
        out = module(x)
        if mode.split is None:
            with flop_counter() as fc:
                torch.autograd.backward([out], [grad])
            counts["backward"] = fc.get_total_flops()
            return counts
        with flop_counter() as fb:
            if mode.split == "upstream":
                _, pending = _upstream().stage_backward_input([out], [grad], [x], iter(params))
            else:
                _, pending = fxsplit.stage_backward_input([out], [grad], [x], params)
        del out
        with flop_counter() as fw:
            if mode.split == "upstream":
                _upstream().stage_backward_weight(iter(params), pending)
            else:
                fxsplit.stage_backward_weight(params, pending)
    counts["B"], counts["W"] = fb.get_total_flops(), fw.get_total_flops()
    counts["backward"] = counts["B"] + counts["W"]
    return counts


# -- the run ---------------------------------------------------------------
def _device_name(device: torch.device) -> str:
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


def default_out_path(device: torch.device, model: ModelConfig, quick: bool = False, malloc: str = "default") -> Path:
    """``benchmarks/results/<device>[-<model>][-malloc-<choice>][-quick].json`` (the model only when it
    is not the default gpt, the allocator only when it is not the default). A ``--quick`` run has a
    file of its own, so it never replaces a full run's results."""
    stem = f"{device.type}-{_slug(_device_name(device))}"
    if model.name != "gpt" or model.embedding:
        stem += f"-{model.name}" + ("-embedding" if model.embedding else "")
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


def _first_step(mode: Mode, stage: Stage, grad: torch.Tensor, device: torch.device, fresh: bool) -> float:
    """Compile (on first call) and run one step; returns its wall time in seconds."""
    ctx = contextlib.nullcontext() if not fresh else _fresh_inductor_cache()
    with ctx:
        _sync(device)
        t0 = time.perf_counter()
        _backward_phases(mode, mode.module, stage.make_input(), grad)
        _sync(device)
        return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _default_config_failure(module: torch.nn.Module, stage: Stage, grad: torch.Tensor) -> str | None:
    """Run the upstream split on a module compiled with AOTAutograd's default
    config; return the error message (None if it did not fail)."""
    x = stage.make_input()
    out = module(x)
    try:
        dinputs, pending = _upstream().stage_backward_input([out], [grad], [x], module.parameters())
        _upstream().stage_backward_weight(module.parameters(), pending)
    except Exception as e:  # the failure is the result
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        return f"{type(root).__name__}: {str(root).strip()}"
    return None


def _stats(times: list[float], key: str, phase: str) -> dict[str, float]:
    m = Measurement(
        number_per_run=1, raw_times=times,
        task_spec=TaskSpec(stmt=phase, setup="", label="fxsplit bench", sub_label=key, description=phase),
    )
    return {"median_ms": m.median * 1e3, "iqr_ms": m.iqr * 1e3, "n": len(times)}


class Progress:
    """Progress of the long phases, on stderr (stdout keeps the table).

    A line when a phase starts and when it ends (with its duration); while a
    phase runs, a line every ``heartbeat_s`` (a compile is one long call with
    nothing to count); while timing, the rounds done, at most every
    ``every_s``.
    """

    def __init__(self, stream: TextIO | None = None, heartbeat_s: float = 15.0, every_s: float = 5.0) -> None:
        self.stream = stream
        self.heartbeat_s = heartbeat_s
        self.every_s = every_s
        self._last = 0.0

    def say(self, message: str) -> None:
        stream = self.stream or sys.stderr
        print(f"[fxsplit bench] {message}", file=stream, flush=True)

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        self.say(f"{what} ...")
        t0 = time.perf_counter()
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(self.heartbeat_s):
                self.say(f"{what}: still running, {time.perf_counter() - t0:.0f} s")

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        try:
            yield
        finally:
            done.set()
            beat.join()
        self.say(f"{what}: done in {time.perf_counter() - t0:.1f} s")

    def count(self, what: str, done: int, total: int, t0: float) -> None:
        now = time.perf_counter()
        if done == total or now - self._last >= self.every_s:
            self._last = now
            self.say(f"{what}: {done}/{total}, {now - t0:.0f} s")


def run(settings: BenchSettings, progress: Progress | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the result dict that is written as JSON.

    ``settings`` are taken as valid (:func:`settings_from_args` checks them).
    """
    progress = progress or Progress()
    wall0 = time.perf_counter()
    if settings.malloc == "retain":
        allocator.retain_freed_memory()
    device = torch.device(settings.device)
    dtype = _DTYPES[settings.dtype]
    stage = build(settings.model, device, dtype)
    base = stage.module
    with torch.no_grad():
        probe = base(stage.make_input())
    grad = torch.randn_like(probe)
    del probe
    n_params = sum(p.numel() for p in base.parameters())
    progress.say(f"{stage.description}; {n_params / 1e6:.2f} M parameters; {settings.model.as_dict()}; "
                 f"{settings.dtype} on {_device_name(device)} ({device.type}); torch {torch.__version__}")

    def copy_of() -> torch.nn.Module:
        return copy.deepcopy(base)

    inductor = torch.compile(copy_of(), backend="inductor")
    # Dynamo shares compiled code between torch.compile calls whose backends
    # compare equal, and two backend="inductor" calls with the same options do:
    # a (default-valued) option keeps this module's compile its own.
    with _donated_buffer(False):
        inductor_nodonate = torch.compile(copy_of(), backend="inductor", options={"trace.enabled": False})
    fx = torch.compile(copy_of(), backend=fxsplit.backend())
    fx_graphs = torch.compile(copy_of(), backend=fxsplit.backend(compiler="eager"))
    nodonate = lambda: _donated_buffer(False)  # noqa: E731
    modes = [
        Mode("eager", "eager, ordinary backward", base, None),
        Mode("eager+upstream", "eager + upstream split", copy_of(), "upstream"),
        Mode("inductor", "inductor, ordinary backward", inductor, None, compiled="inductor", flops_module=fx_graphs),
        Mode("inductor+upstream", "inductor + upstream split (donated_buffer=False)", inductor_nodonate, "upstream",
             context=nodonate, compiled="inductor (donated_buffer=False)", flops_module=fx_graphs),
        Mode("fxsplit", "fxsplit, ordinary backward", fx, None, compiled="fxsplit", flops_module=fx_graphs),
        Mode("fxsplit+split", "fxsplit split (B, then W)", fx, "fxsplit", compiled="fxsplit", flops_module=fx_graphs),
    ]
    assert tuple(m.key for m in modes) == MODE_KEYS

    # 1. compile (first call) and warm up
    compile_s: dict[str, float] = {}
    n_compiled = len({m.compiled for m in modes if m.compiled is not None})
    for mode in modes:
        if mode.compiled is not None and mode.compiled not in compile_s:
            with progress.phase(f"compiling {mode.compiled} ({len(compile_s) + 1}/{n_compiled}, first forward + "
                                "backward)"):
                compile_s[mode.compiled] = _first_step(mode, stage, grad, device, fresh=not settings.warm_cache)
    with progress.phase("running the upstream split on the default-config inductor module"):
        default_error = _default_config_failure(inductor, stage, grad)
    if default_error is None:
        progress.say("note: the upstream split on the default-config inductor module did NOT fail")
    with progress.phase(f"tracing the FLOP-counting twin and {settings.warmup} warm-up step(s) per mode"):
        # the FLOP-counting twin runs eagerly; its compile is not reported
        _backward_phases(modes[2], fx_graphs, stage.make_input(), grad)
        step_s: dict[str, float] = {}
        for mode in modes:
            for _ in range(settings.warmup):
                t = _timed_step(mode, stage, grad, device)
            step_s[mode.key] = sum(t.values()) if settings.warmup else 0.0

    # 2. timed repetitions, interleaved round-robin
    want = {
        k: max(settings.min_reps, min(settings.reps, math.ceil(settings.min_time_s / max(s, 1e-6))))
        for k, s in step_s.items()
    }
    rounds = max(want.values())
    progress.say(f"timing {rounds} round(s), the six modes interleaved (each round starting one mode later): "
                 f"{', '.join(f'{k} x{n}' for k, n in want.items())}")
    samples: dict[str, dict[str, list[float]]] = {m.key: {} for m in modes}
    host: list[dict[str, int] | None] = []
    ordinary_host: list[float | None] = []
    faults: dict[str, list[int | None]] = {m.key: [] for m in modes}
    t0 = time.perf_counter()
    for r in range(rounds):
        # Each round starts one mode later, so that no mode always follows the same one (a mode that
        # frees a lot of memory would otherwise always hand its allocator state to the same next mode).
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            if r < want[mode.key]:
                for phase, t in _timed_step(mode, stage, grad, device, host, ordinary_host,
                                            faults[mode.key]).items():
                    samples[mode.key].setdefault(phase, []).append(t)
        progress.count("timing, rounds done", r + 1, rounds, t0)

    # 2b. microbatch accumulation: inductor's ordinary backward vs fxsplit's B + W, 4 microbatches into .grad
    acc_rounds = max(settings.min_reps, min(settings.reps, math.ceil(
        settings.min_time_s / max(ACCUMULATE_MICROBATCHES * (step_s["inductor"] + step_s["fxsplit+split"]), 1e-6))))
    acc: dict[str, list[float]] = {"inductor": [], "fxsplit+split": []}
    by_key = {m.key: m for m in modes}
    t0 = time.perf_counter()
    for r in range(settings.warmup + acc_rounds):
        for key in list(acc)[::-1] if r % 2 else list(acc):  # each goes first every other round
            t = _accumulate_step(by_key[key], stage, grad, device)
            if r >= settings.warmup:
                acc[key].append(t)
        progress.count(f"accumulating {ACCUMULATE_MICROBATCHES} microbatches into .grad, rounds done", r + 1,
                       settings.warmup + acc_rounds, t0)

    # 3. memory and FLOPs (untimed)
    results = []
    t0 = time.perf_counter()
    for k, mode in enumerate(modes, 1):
        progress.count("measuring memory and counting FLOPs, modes done", k - 1, len(modes), t0)
        s = samples[mode.key]
        timing = {ph: _stats(v, mode.key, ph) for ph, v in s.items()}
        bwd = [b + w for b, w in zip(s["B"], s["W"])] if mode.split else s["backward"]
        timing["total_backward"] = _stats(bwd, mode.key, "B+W" if mode.split else "backward")
        # per repetition, in round order: rep k of every mode ran in the same round
        timing["total_backward"]["samples_ms"] = [v * 1e3 for v in bwd]
        mem = _measure_memory(mode, stage, grad, device)
        flops = _count_flops(mode, mode.module if mode.flops_module is None else mode.flops_module, stage, grad)
        observed = _count_flops(mode, mode.module, stage, grad) if mode.flops_module is not None else None
        results.append({
            "key": mode.key,
            "label": mode.label,
            "split": mode.split,
            "forward_ms": timing["forward"]["median_ms"],
            "b_ms": timing["B"]["median_ms"] if mode.split else None,
            "w_ms": timing["W"]["median_ms"] if mode.split else None,
            "backward_ms": timing["total_backward"]["median_ms"],
            "timing": timing,
            "flops": flops,
            "flops_observed": observed,
            "flops_method": "op by op on the Inductor-input FX graphs (fxsplit compiler='eager')"
            if mode.flops_module is not None else "FlopCounterMode over the eager run",
            **mem,
            "compile_s": compile_s.get(mode.compiled) if mode.compiled else None,
            "compiled_module": mode.compiled,
            **_fault_summary(faults[mode.key]),
        })

    progress.count("measuring memory and counting FLOPs, modes done", len(modes), len(modes), t0)
    ref = next(r for r in results if r["key"] == REFERENCE)
    for r in results:
        r["ratio_to_inductor"] = r["backward_ms"] / ref["backward_ms"]
        r["duplicated_flops_pct"] = 100.0 * (r["flops"]["backward"] - ref["flops"]["backward"]) / ref["flops"]["backward"]
    by = {r["key"]: r for r in results}
    by["inductor+upstream"]["default_config_error"] = default_error
    targets = _targets(by)

    # 4. graph vs host time of the split, accumulation, memory per stage layout, compile time per user
    host_section = _host_section(host, by["inductor"], ordinary_host)
    targets["host_time"] = _host_target(host_section)
    targets["host_time_added"] = _host_added_target(host_section)
    acc_section = {
        "microbatches": ACCUMULATE_MICROBATCHES,
        "what": f"backward time summed over {ACCUMULATE_MICROBATCHES} microbatches accumulating into .grad "
        "(set to None first): inductor's ordinary backward vs fxsplit's B then W per microbatch",
        "inductor": _stats(acc["inductor"], "inductor", "accumulate"),
        "fxsplit+split": _stats(acc["fxsplit+split"], "fxsplit+split", "accumulate"),
    }
    ratios = [a / b for a, b in zip(acc["fxsplit+split"], acc["inductor"])]
    targets["accumulate_vs_inductor"] = _timing_target(
        "accumulate_vs_inductor", 1.00,
        acc_section["fxsplit+split"]["median_ms"] / acc_section["inductor"]["median_ms"], ratios,
        higher_is_better=False)
    memory_section: dict[str, Any] | None = None
    if settings.model.name == "conv" or settings.model.embedding:
        why = "the memory layouts wrap a body taking hidden states (batch, ..., dim); this model does not"
        memory_section = {"skipped": why}
        for name in MEMORY_TARGETS:
            targets[name] = _not_measured(name, why)
    else:
        with progress.phase("memory between B and W: middle, last and first stage layouts"):
            memory_section = measure_memory_layouts(base, stage.make_input, settings.model.dim, settings.model.vocab,
                                                    device, settings.quick, say=progress.say)
        targets.update(memory_targets(memory_section))
    with progress.phase(f"compile time per user ({settings.compile_reps} round(s); resets Dynamo)"):
        compile_section = measure_compile_times(base, stage.make_input, grad, settings.compile_reps,
                                                settings.warm_cache, sync=lambda: _sync(device), say=progress.say)
    cs = compile_section["samples_s"]
    targets["compile_split_vs_inductor"] = _timing_target(
        "compile_split_vs_inductor", 1.1,
        compile_section["median_s"]["fxsplit-split"] / compile_section["median_s"]["inductor"],
        [a / b for a, b in zip(cs["fxsplit-split"], cs["inductor"])], higher_is_better=False,
        min_reps=COMPILE_RELIABLE_MIN_REPS)

    result = {
        "schema": SCHEMA_VERSION,
        "device": {"type": device.type, "name": _device_name(device), "torch_threads": torch.get_num_threads(),
                   "cpu_count": os.cpu_count()},
        "dtype": settings.dtype,
        "torch_version": torch.__version__,
        "fxsplit_version": fxsplit.__version__,
        "python": platform.python_version(),
        "model": {**settings.model.as_dict(), "description": stage.description, "parameters": n_params},
        "settings": {"warmup": settings.warmup, "min_reps": settings.min_reps, "reps": settings.reps,
                     "min_time_s": settings.min_time_s, "warm_cache": settings.warm_cache, "quick": settings.quick,
                     "malloc": settings.malloc},
        "allocator": allocator.describe(settings.malloc) if device.type == "cpu" else "CUDA caching allocator",
        "reference": REFERENCE,
        "modes": results,
        "mode4_default_config_error": default_error,
        "host": host_section,
        "accumulate": acc_section,
        "memory": memory_section,
        "compile": compile_section,
        "targets": targets,
        "methods": _methods(device),
    }
    result["wall_s"] = time.perf_counter() - wall0
    return result


# A timing verdict needs at least this many paired repetitions to be called reliable.
RELIABLE_MIN_REPS = 5
# Compiles take tens of seconds each and vary less, relative to their length, than a step does.
COMPILE_RELIABLE_MIN_REPS = 3


def _spread(values: Sequence[float]) -> dict[str, float | int]:
    """Median, quartiles and range of ``values`` (per-repetition ratios)."""
    v = sorted(values)
    q25, med, q75 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0],) * 3
    return {"n": len(v), "median": med, "q25": q25, "q75": q75, "min": v[0], "max": v[-1]}


def _timing_target(what: str, target: float, measured: float, ratios: Sequence[float],
                   higher_is_better: bool, min_reps: int = RELIABLE_MIN_REPS) -> dict[str, Any]:
    """A timing target's verdict with the spread of the per-repetition ratios it rests on.

    ``measured`` is the ratio of the two modes' median times. Unreliable when
    fewer than :data:`RELIABLE_MIN_REPS` repetitions pair up, when the target
    lies inside the interquartile range of the per-repetition ratios (the
    spread is wider than the margin to the target: the verdict flips within
    the middle half of the repetitions), or when the median per-repetition
    ratio falls on the other side of the target than ``measured`` (the two
    summaries of the same repetitions disagree).
    """
    ok = measured >= target if higher_is_better else measured <= target
    sp = _spread(ratios)
    per_rep_ok = sp["median"] >= target if higher_is_better else sp["median"] <= target
    why = None
    if sp["n"] < min_reps:
        why = f"only {sp['n']} paired repetitions"
    elif sp["q25"] <= target <= sp["q75"]:
        why = f"the target {target:g} lies inside the interquartile range {sp['q25']:.3f}-{sp['q75']:.3f}"
    elif per_rep_ok != ok:
        why = (f"the median per-repetition ratio {sp['median']:.3f} and the ratio of the medians "
               f"{measured:.3f} fall on opposite sides of the target {target:g}")
    return {
        "target": (">= " if higher_is_better else "<= ") + f"{target:g}", "measured": measured, "pass": ok,
        "what": TARGETS[what], "spread": sp, "reliable": why is None, "unreliable_because": why,
        "verdict": ("PASS" if ok else "MISS") + ("" if why is None else " (unreliable)"),
    }


def _paired(num: dict[str, Any], den: dict[str, Any]) -> list[float]:
    """Per-round ratios of two modes' total backward times (round k of both ran back to back)."""
    a, b = num["timing"]["total_backward"]["samples_ms"], den["timing"]["total_backward"]["samples_ms"]
    return [x / y for x, y in zip(a, b)]


def _targets(by: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    split, ref, up = by["fxsplit+split"], by["inductor"], by["inductor+upstream"]
    dup = split["duplicated_flops_pct"]
    return {
        "split_backward_vs_inductor": _timing_target(
            "split_backward_vs_inductor", 1.02, split["backward_ms"] / ref["backward_ms"], _paired(split, ref),
            higher_is_better=False),
        "duplicated_flops": {"target": "0 %", "measured": dup, "pass": abs(dup) < 1e-9,
                             "what": TARGETS["duplicated_flops"], "reliable": True, "unreliable_because": None,
                             "verdict": "PASS" if abs(dup) < 1e-9 else "MISS"},  # FLOP counts are exact
        "speedup_vs_inductor_upstream": _timing_target(
            "speedup_vs_inductor_upstream", 1.5, up["backward_ms"] / split["backward_ms"], _paired(up, split),
            higher_is_better=True),
    }


def _host_section(host: Sequence[dict[str, int] | None], inductor: dict[str, Any],
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
        **{k: _spread(v) for k, v in per_rep.items()},
        "host_ms": _spread(host_ms),
        "host_fraction_of_inductor_backward": [h / f for h, f in zip(host_ms, fused)],
        "samples": per_rep,
    }
    ordinary = [None if s is None else s * 1e3 for s in ordinary_host_s]
    if ordinary and all(o is not None for o in ordinary):
        added = [h - o for h, o in zip(host_ms, ordinary)]  # type: ignore[operator]
        section.update({
            "ordinary_host_ms": _spread(ordinary),  # type: ignore[arg-type]
            "added_ms": _spread(added),
            "added_fraction_of_inductor_backward": [a / f for a, f in zip(added, fused)],
        })
        per_rep["ordinary_host_ms"] = ordinary  # type: ignore[assignment]
    return section


def _host_target(section: dict[str, Any]) -> dict[str, Any]:
    if not section["available"]:
        return _not_measured("host_time", section["why"])
    ratios = section["host_fraction_of_inductor_backward"]
    return _timing_target("host_time", 0.02, statistics.median(ratios), ratios, higher_is_better=False)


def _host_added_target(section: dict[str, Any]) -> dict[str, Any]:
    if not section["available"] or "added_fraction_of_inductor_backward" not in section:
        return _not_measured("host_time_added", section.get("why") or "n/a: fxsplit records no fused graph time")
    ratios = section["added_fraction_of_inductor_backward"]
    return _timing_target("host_time_added", 0.02, statistics.median(ratios), ratios, higher_is_better=False)


def _not_measured(name: str, why: str) -> dict[str, Any]:
    """A target this run could not measure: verdict "n/a" and the reason."""
    return {"target": None, "measured": None, "pass": None, "what": TARGETS[name], "reliable": False,
            "unreliable_because": why, "verdict": "n/a"}


def _methods(device: torch.device) -> dict[str, str]:
    cpu = device.type != "cuda"
    return {
        "timing": ("time.perf_counter between phases" if cpu else "CUDA events between phases")
        + "; repetitions of all modes interleaved round-robin, each round starting one mode later; warm-up "
        "excluded; median via "
        "torch.utils.benchmark.Measurement",
        "flops": "FlopCounterMode; compiled modes counted op by op on the FX graphs Inductor compiles "
        "(fxsplit.backend(compiler='eager'): same decompositions and partitioner); flops_observed is what "
        "the counter sees in the real compiled run (only kernels Inductor leaves to ATen, e.g. mm on CPU)",
        "duplicated_flops_pct": "100 * (backward FLOPs of the mode - inductor's ordinary backward FLOPs) / inductor's",
        "held_bytes": ("CPU allocator events from torch.profiler(profile_memory=True)" if cpu
                       else "torch.cuda.memory_allocated")
        + ": live bytes after B minus before the forward, with the stage output, returned input grads and the "
        "input's .grad dropped (parameters' .grad already allocated)",
        "held_bytes_declared": "fxsplit: PendingWeightGrads.live_in_bytes; upstream: bytes of the gradients "
        "saved in param_groups (the activations autograd keeps for W are not in it)",
        "peak_bytes": ("CPU allocator events from torch.profiler(profile_memory=True)" if cpu
                       else "torch.cuda.max_memory_allocated")
        + ": highest live bytes above the pre-forward level during forward + backward",
        "compile_s": "wall time of the first forward + backward (Dynamo + AOTAutograd + Inductor), each compiled "
        "module in a fresh Inductor cache unless --warm-cache; what fxsplit compiles on that first ordinary "
        "backward depends on its runtime (all graphs, or only the fused one with lazy compilation)",
        "host": "PendingWeightGrads.timings of every timed fxsplit+split repetition (ns): host time of B = b_ns - "
        "b_graph_ns, of W = w_ns - w_graph_ns; target: their sum / inductor's ordinary backward of the same round; "
        "ordinary_host_ms: fxsplit's ordinary backward minus its regions' fused graph time (graph_ns) in the same "
        "round; added_ms: the split's host time minus that (target host_time_added)",
        "minor_faults_backward": "getrusage ru_minflt from the end of each timed forward to the end of its B + W "
        "(or backward), median over the timed repetitions (pages the allocator had handed back to the OS and "
        "maps again; see fxsplit.bench.allocator)",
        "accumulate": f"{ACCUMULATE_MICROBATCHES} microbatches, .grad set to None first; backward phases timed "
        "(forwards not counted); inductor and fxsplit+split interleaved per round, each first every other round; "
        "warm-up rounds dropped",
        "memory": "fxsplit.bench.memory: per stage layout (middle / last / first) and split (upstream, fxsplit, "
        "fxsplit defer='all'): allocator bytes alive after F+B, declared bytes, SplitResult live-in and all-crossing "
        "bytes evaluated at the microbatch's sizes, peak over a ZB-V-like sequence of 4 microbatches",
        "compile": "fxsplit.bench.compile_time: first step after torch._dynamo.reset() for backend='inductor', "
        "fxsplit used only split (F, B, W) and fxsplit used only fused (F, backward); rounds interleaved",
    }


# -- output ----------------------------------------------------------------
def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _verdict_line(name: str, t: dict[str, Any]) -> str:
    """``target PASS|MISS[ (unreliable)]: what: measured (spread)`` for one target."""
    verdict = t.get("verdict") or ("PASS" if t["pass"] else "MISS")  # results written before spreads were kept
    if name == "duplicated_flops":
        return f"target {verdict}: {t['what']} (measured {t['measured']:.3f} %, exact FLOP counts)"
    if verdict == "n/a":
        return f"target n/a: {t['what']} ({t['unreliable_because']})"
    if "detail" in t:  # exact figures (memory, FLOPs): no spread
        return f"target {verdict}: {t['what']} (measured {t['measured']:.3f}, target {t['target']}; {t['detail']})"
    line = f"target {verdict}: {t['what']} (measured {t['measured']:.3f} x"
    sp = t.get("spread")
    if sp:
        line += (f"; per-repetition ratio over {sp['n']} paired repetitions: median {sp['median']:.3f}, "
                 f"IQR {sp['q25']:.3f}-{sp['q75']:.3f}, min-max {sp['min']:.3f}-{sp['max']:.3f}")
    else:
        line += "; no spread recorded: results written by an older fxsplit bench, reliability unknown"
    line += ")"
    if t.get("unreliable_because"):
        more = "--compile-reps" if name.startswith("compile") else "--reps"
        line += f"\n    unreliable: {t['unreliable_because']}; rerun with more {more} on an idle machine"
    return line


def _section_lines(result: dict[str, Any]) -> list[str]:
    """Host time, accumulation, memory per stage layout and compile time, where the result has them."""
    out: list[str] = []
    host = result.get("host")
    if host is not None:
        if not host["available"]:
            out.append(f"host time (fxsplit split, outside the compiled graphs): {host['why']}")
        else:
            med = lambda k: host[k]["median"]  # noqa: E731
            out.append(
                f"fxsplit split, median ms: B graphs {med('b_graph_ms'):.3f} + host {med('b_host_ms'):.3f}; "
                f"W graphs {med('w_graph_ms'):.3f} + host {med('w_host_ms'):.3f}"
                + (f" (commit {med('w_commit_ms'):.3f})" if "w_commit_ms" in host else "")
                + f"; host B+W {med('host_ms'):.3f} (IQR {host['host_ms']['q25']:.3f}-{host['host_ms']['q75']:.3f})")
            if "added_ms" in host:
                out.append(
                    f"fxsplit ordinary backward, median ms outside its fused graphs: {med('ordinary_host_ms'):.3f}; "
                    f"the split adds {med('added_ms'):.3f} (IQR {host['added_ms']['q25']:.3f}-"
                    f"{host['added_ms']['q75']:.3f})")
    modes = result.get("modes") or []
    if modes and all(r.get("minor_faults_backward") is not None for r in modes):
        out.append("minor page faults per backward (median; memory the allocator maps afresh): " + ", ".join(
            f"{r['key']} {r['minor_faults_backward']:.0f}" for r in modes)
            + (f" [{result['allocator']}]" if result.get("allocator") else ""))
    acc = result.get("accumulate")
    if acc is not None:
        i, f = acc["inductor"], acc["fxsplit+split"]
        out.append(f"{acc['microbatches']} microbatches into .grad, backward ms (median, IQR): inductor "
                   f"{i['median_ms']:.2f} ({i['iqr_ms']:.2f}), fxsplit B+W {f['median_ms']:.2f} ({f['iqr_ms']:.2f}), "
                   f"n={f['n']}")
    mem = result.get("memory")
    if mem and "rows" in mem:
        kib = lambda v: "-" if v is None else f"{v / 1024:.1f}"  # noqa: E731
        out.append(f"memory between B and W (KiB; {mem['microbatches']} microbatches in the ZB-V-like order "
                   f"{mem['zbv_sequence']}; {mem['compiler']}):")
        head = ("stage", "split", "alive B->W", "declared", "live-in", "all-crossing", "live-in B/token", "ZB-V peak")
        rows = [(r["layout"], r["variant"], kib(r["alive_bytes"]), kib(r["declared_bytes"]), kib(r["live_in_bytes"]),
                 kib(r["all_crossing_bytes"]),
                 "-" if r["live_in_bytes_per_token"] is None else f"{r['live_in_bytes_per_token']:.0f}",
                 kib(r["zbv_peak_bytes"])) for r in mem["rows"]]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        for cells in (head, *rows):
            out.append("  " + "  ".join(c.ljust(w) if k < 2 else c.rjust(w)
                                        for k, (c, w) in enumerate(zip(cells, widths))))
        fl = mem["flops"]
        out.append(f"  FLOPs (compiler='eager' twins): first stage B {fl['first']['B']:,} W {fl['first']['W']:,}; "
                   f"middle stage B {fl['middle']['B']:,} W {fl['middle']['W']:,}")
        out.append(f"  fxsplit row: {mem['variants']['fxsplit']}")
    elif mem:
        out.append(f"memory between B and W: skipped ({mem['skipped']})")
    comp = result.get("compile")
    if comp is not None:
        med = comp["median_s"]
        out.append("compile time, first step from scratch (median s): "
                   + ", ".join(f"{u} {med[u]:.1f}" for u in COMPILE_USERS)
                   + f" ({len(comp['samples_s']['inductor'])} round(s); {comp['method']})")
        regions = comp.get("region_compile_seconds")
        if regions:
            for u in COMPILE_USERS:
                last = next((x for x in reversed(regions[u]) if x), None)
                if last:
                    out.append(f"  {u}: fxsplit regions' compile_seconds " + ", ".join(
                        f"{k} {v:.1f}" for k, v in sorted(last.items())))
    return out


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table printed on stdout."""
    head = ("mode", "fwd ms", "B ms", "W ms", "bwd ms", "x ind", "B GFLOP", "W GFLOP", "bwd GFLOP", "dup %",
            "held MiB", "peak MiB", "compile s")
    rows = []
    for k, r in enumerate(result["modes"], 1):
        f = r["flops"]
        g = lambda v: None if v is None else v / 1e9  # noqa: E731
        mb = lambda v: None if v is None else v / 2**20  # noqa: E731
        rows.append((
            f"{k} {r['key']}", _fmt(r["forward_ms"], ".2f"), _fmt(r["b_ms"], ".2f"), _fmt(r["w_ms"], ".2f"),
            _fmt(r["backward_ms"], ".2f"), _fmt(r["ratio_to_inductor"], ".2f"), _fmt(g(f["B"]), ".3f"),
            _fmt(g(f["W"]), ".3f"), _fmt(g(f["backward"]), ".3f"), _fmt(r["duplicated_flops_pct"], ".1f"),
            _fmt(mb(r["held_bytes"]), ".2f"), _fmt(mb(r["peak_bytes"]), ".2f"), _fmt(r["compile_s"], ".1f"),
        ))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    m = result["model"]
    out = [
        f"device: {result['device']['name']} ({result['device']['type']}, {result['device']['torch_threads']} "
        f"threads)  dtype: {result['dtype']}  torch {result['torch_version']}"
        + ("  malloc: " + result["settings"]["malloc"] if result["settings"].get("malloc", "default") != "default"
           else ""),
        f"model: {m['name']} ({m['description']}), batch={m['batch']} seq={m['seq']} layers={m['layers']} "
        f"dim={m['dim']}, {m['parameters'] / 1e6:.2f} M params",
        line(head), line(["-" * w for w in widths]), *map(line, rows),
        "",
        "x ind: total backward time / inductor's ordinary backward (mode 3). dup %: backward FLOPs above mode 3's.",
        "held MiB: live memory kept from the end of B until W; peak MiB: highest live memory above the "
        "pre-forward level (MiB = 2**20 bytes). Compiled modes' FLOPs: counted on the graphs Inductor compiles.",
    ]
    err = result["mode4_default_config_error"]
    out.append("mode 4 with AOTAutograd defaults: " + (f"FAILS: {err}" if err else "did not fail")
               + "; measured above with donated_buffer=False.")
    out += _section_lines(result)
    for name, t in result["targets"].items():
        out.append(_verdict_line(name, t))
    if m.get("embedding"):
        out.append("note: a first stage's input needs no gradient, so upstream's split finds no intermediates and "
                   "its W computes no weight gradients (modes 2 and 4 do less work than a full backward).")
    if result["device"]["type"] == "cpu":
        out.append("CPU timings depend on load from other processes; rerun on an idle machine for final figures.")
    return "\n".join(out)


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
    for y, t in zip(ys, totals):
        ax1.text(t, y, f" {t:.1f} ms", va="center", fontsize=8)
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
    ax2.bar_label(b1, labels=[f" {v:{spec}}" for v in peak], fontsize=8)
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


def main(argv: Sequence[str] | None = None, prog: str = "fxsplit bench") -> int:
    """Entry point of ``fxsplit bench``: check the options, run, print the table, write JSON (and a PNG chart).

    Bad options exit with status 2 and a one-line message before anything is
    built or compiled, and so does a torch whose upstream split cannot run on a
    compiled module (:func:`upstream_split_failure`). Progress goes to stderr,
    the table to stdout.
    """
    parser = build_parser(prog)
    settings = settings_from_args(parser.parse_args(argv), parser)
    why = upstream_split_failure()
    if why is not None:  # before any compile: every mode's baseline would be missing
        parser.error(why)
    result = run(settings)
    print()
    print(format_table(result))
    out = settings.out
    assert out is not None  # settings_from_args always sets it
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")
    if settings.chart and draw_chart(result, out.with_suffix(".png")):
        print(f"wrote {out.with_suffix('.png')}")
    print(f"wall time {result['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m fxsplit.bench.run"))
