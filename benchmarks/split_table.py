"""B + W against the fused backward, with and without CUDA graphs, over stage sizes.

For each stage size: Inductor's ordinary backward, fxsplit's
B then W, and the same two compiled with ``mode="reduce-overhead"`` (CUDA
graphs: Inductor's cudagraph trees; fxsplit's slots for dI and dW), timed side
by side in interleaved rounds (each round starts with another mode), warm-ups
dropped. Per repetition: device time of the backward (CUDA events around it;
``time.perf_counter`` with a synchronize on CPU) and host time (the same calls
timed without waiting for the device). Ratios are medians of the per-round
ratios, with their interquartile range. ``.grad`` is set to ``None`` before
every backward, so W starts from an empty ``.grad`` each time (the first
microbatch of a step). The two pairs are timed apart (Inductor and fxsplit
without CUDA graphs, then both with), each pair interleaved; the
reduce-overhead modes mark a new step before every forward
(``torch.compiler.cudagraph_mark_step_begin``), as Inductor asks of a loop
that interleaves several CUDA-graphed modules.

    python -m benchmarks.split_table --device cuda --out benchmarks/results/cuda-split-table.json
    python -m benchmarks.split_table --device cpu --configs tiny     # host-bound, on any machine

Gradients of each fxsplit mode are checked against its Inductor twin once per
size (as close as Inductor is to eager) before timing.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import fxsplit
from fxsplit.bench.models import ModelConfig, build
from fxsplit.bench.settings import provenance
from fxsplit.bench.stats import spread

# name -> (model config, what the issue measured it for)
CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("gpt", batch=2, seq=64, layers=2, dim=128, heads=4),
    "gpt-w256-4x128": ModelConfig("gpt", batch=4, seq=128, layers=2, dim=256, heads=4),
    "gpt-w1024-4x512": ModelConfig("gpt", batch=4, seq=512, layers=2, dim=1024, heads=8),
    "gpt-w2048-1x256": ModelConfig("gpt", batch=1, seq=256, layers=2, dim=2048, heads=16),
    "llama-w1024-2x1024": ModelConfig("llama", batch=2, seq=1024, layers=2, dim=1024, heads=8),
    "moe-w1024-4x1024": ModelConfig("moe", batch=4, seq=1024, layers=2, dim=1024, heads=8),
    "gpt-w2048-4x1024": ModelConfig("gpt", batch=4, seq=1024, layers=2, dim=2048, heads=16),
    "llama-w4096-1x4096": ModelConfig("llama", batch=1, seq=4096, layers=2, dim=4096, heads=32),
    "moe-w2048-2x4096": ModelConfig("moe", batch=2, seq=4096, layers=2, dim=2048, heads=16),
}
MODES = ("inductor", "fxsplit", "inductor-ro", "fxsplit-ro")


class _Timer:
    """Device time between two marks (CUDA events, or a synchronized host clock)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def _spread(values: list[float]) -> dict[str, float | int]:
    return spread(values).as_dict()


def _check(name: str, got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for a, b in zip(got, want):
        if a is None or b is None:
            continue
        a64, b64 = a.double(), b.double()
        worst = max(worst, float((a64 - b64).norm() / b64.norm().clamp_min(1e-30)))
    return worst


def _one(module: torch.nn.Module, mode: str, x: torch.Tensor, g: torch.Tensor, timer: _Timer,
         sync: Any) -> dict[str, float]:
    """Forward, then the backward (ordinary, or B then W), timed."""
    params = list(module.parameters())
    for p in params:
        p.grad = None
    xi = x.detach().requires_grad_()
    if mode.endswith("-ro"):
        torch.compiler.cudagraph_mark_step_begin()
    out = module(xi)
    sync()
    if mode.startswith("inductor"):
        t0, a = time.perf_counter(), timer.mark()
        out.backward(g)
        host = time.perf_counter() - t0
        b = timer.mark()
        return {"backward_ms": timer.ms(a, b), "host_ms": host * 1e3}
    t0, a = time.perf_counter(), timer.mark()
    _, work = fxsplit.stage_backward_input([out], [g], [xi], params)
    tb = time.perf_counter()
    mid = timer.mark()
    del out
    tw = time.perf_counter()
    fxsplit.stage_backward_weight(params, work)
    host = (tb - t0) + (time.perf_counter() - tw)
    b = timer.mark()
    return {"backward_ms": timer.ms(a, b), "b_ms": timer.ms(a, mid), "w_ms": timer.ms(mid, b), "host_ms": host * 1e3}


def measure(name: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, reps: int, warmup: int,
            say: Any) -> dict[str, Any]:
    torch._dynamo.reset()
    stage = build(cfg, device, dtype)
    base = stage.module
    timer = _Timer(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    mods = {
        "inductor": torch.compile(copy.deepcopy(base), backend="inductor"),
        "fxsplit": torch.compile(copy.deepcopy(base), backend="fxsplit"),
        "inductor-ro": torch.compile(copy.deepcopy(base), backend="inductor", mode="reduce-overhead"),
        "fxsplit-ro": torch.compile(copy.deepcopy(base), backend="fxsplit", mode="reduce-overhead"),
    }
    x = stage.make_input()
    with torch.no_grad():
        g = torch.randn_like(base(x))
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    errors: dict[str, Any] = {}
    direct: dict[str, dict[str, int]] = {}
    for pair in (("inductor", "fxsplit"), ("inductor-ro", "fxsplit-ro")):
        before = set(fxsplit.compiled_regions())
        try:
            t0 = time.perf_counter()
            for _ in range(warmup):  # compiles, CUDA graph captures
                for mode in pair:
                    _one(mods[mode], mode, x, g, timer, sync)
            sync()
            say(f"{name}: {' and '.join(pair)} compiled and warmed up in {time.perf_counter() - t0:.1f} s")
            # gradients: fxsplit against its Inductor twin, after one more backward each,
            # copied at once (with CUDA graphs, .grad lives in memory the next step reuses)
            got: dict[str, list[torch.Tensor]] = {}
            for mode in pair:
                _one(mods[mode], mode, x, g, timer, sync)
                got[mode] = [p.grad.detach().clone() for p in mods[mode].parameters()]
            errors[pair[1]] = _check(pair[1], got[pair[1]], got[pair[0]])
            for r in range(reps):
                for mode in (pair if r % 2 == 0 else pair[::-1]):
                    samples[mode].append(_one(mods[mode], mode, x, g, timer, sync))
        except Exception as e:  # noqa: BLE001 - a pair that fails is a result; the other pair stands
            import traceback

            say(f"{name}: {' and '.join(pair)} FAILED:\n{traceback.format_exc()}")
            errors[pair[1]] = f"{type(e).__name__}: {e}"
            for mode in pair:
                samples[mode] = []
        # How B ran: the region node called directly (fxsplit.config.direct_b) or through the engine.
        regions = [r for r in fxsplit.compiled_regions() if r not in before]
        direct[pair[1]] = {"regions": len(regions), "b_runs": sum(r.stats["di_runs"] for r in regions),
                           "direct_b_runs": sum(r.direct_b_runs for r in regions)}
    row: dict[str, Any] = {"config": cfg.as_dict(), "relative_grad_error_vs_inductor_twin": errors,
                           "direct_b": direct}
    for mode in MODES:
        row[mode] = {k: _spread([s[k] for s in samples[mode]]) for k in samples[mode][0]} if samples[mode] else None

    def ratio(a: str, b: str, k: str = "backward_ms") -> dict[str, float] | None:
        if not samples[a] or not samples[b]:
            return None
        return _spread([x[k] / y[k] for x, y in zip(samples[a], samples[b])])

    row["ratios"] = {
        "fxsplit_B+W_over_inductor": ratio("fxsplit", "inductor"),
        "fxsplit-ro_B+W_over_inductor-ro": ratio("fxsplit-ro", "inductor-ro"),
        "fxsplit-ro_B+W_over_inductor": ratio("fxsplit-ro", "inductor"),
        "host_fxsplit_over_inductor": ratio("fxsplit", "inductor", "host_ms"),
    }
    regions = [r for r in fxsplit.compiled_regions() if r.capture is not None]
    row["fxsplit_ro_capture"] = [r.capture.describe() for r in regions]
    med = lambda m, k="backward_ms": float("nan") if row[m] is None else row[m][k]["median"]  # noqa: E731
    rat = lambda k: float("nan") if row["ratios"][k] is None else row["ratios"][k]["median"]  # noqa: E731
    say(f"{name}: backward ms inductor {med('inductor'):.3f} | fxsplit B+W {med('fxsplit'):.3f} "
        f"(B {med('fxsplit', 'b_ms'):.3f} W {med('fxsplit', 'w_ms'):.3f}) ratio "
        f"{rat('fxsplit_B+W_over_inductor'):.3f} | reduce-overhead: inductor "
        f"{med('inductor-ro'):.3f} fxsplit {med('fxsplit-ro'):.3f} ratio "
        f"{rat('fxsplit-ro_B+W_over_inductor-ro'):.3f} | host ms inductor "
        f"{med('inductor', 'host_ms'):.3f} fxsplit {med('fxsplit', 'host_ms'):.3f} | grad err {errors} | "
        f"direct B {direct}")
    del mods
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated names (default: every one but tiny); known: {', '.join(CONFIGS)}")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    names = args.configs.split(",") if args.configs else [n for n in CONFIGS if n != "tiny"]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}")
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result: dict[str, Any] = {
        "what": "B + W against the fused backward, with and without CUDA graphs (benchmarks/split_table.py)",
        "device": {"type": device.type, "name": name, "torch_threads": torch.get_num_threads()},
        "dtype": str(dtype).removeprefix("torch."), "torch_version": torch.__version__,
        "fxsplit_version": fxsplit.__version__, "reps": args.reps, "warmup": args.warmup, "rows": {},
    }
    result.update(provenance(" ".join(["python -m benchmarks.split_table", *sys.argv[1:]])))
    for n in names:
        try:
            result["rows"][n] = measure(n, CONFIGS[n], device, dtype, args.reps, args.warmup, say)
        except Exception as e:  # noqa: BLE001 - one size failing is a result; the others still run
            say(f"{n}: FAILED: {type(e).__name__}: {e}")
            result["rows"][n] = {"config": CONFIGS[n].as_dict(), "error": f"{type(e).__name__}: {e}"}
        if args.out:  # written after every size: a run cut short keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
