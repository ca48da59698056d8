"""B with and without autograd's engine (``fxsplit.config.direct_b``), side by side.

B of a stage that is one compiled region calls the region's node itself
unless ``fxsplit.config.direct_b`` is off; on CUDA, autograd's engine runs a
backward on its device thread, and the hand-over there and back is host time
that a host-bound stage pays in full. This measures, on one stage, Inductor's
ordinary backward, fxsplit's B + W through the engine and B + W calling the
region directly, each with and without CUDA graphs (``mode="reduce-overhead"``;
on a CPU the same code runs uncaptured), interleaved round by round: B's host
time (without waiting for the device) and the device time of the whole
backward, medians with quartiles. It first checks that both ways give
bitwise the same gradients.

    python -m benchmarks.direct_b --device cuda                 # GPT width 256, 4 x 128, bf16
    python -m benchmarks.direct_b --device cpu --config tiny --reps 20
    python -m benchmarks.direct_b --device cpu --compiler eager --reps 2   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any

import torch

import fxsplit
from fxsplit.bench.settings import provenance
from benchmarks.split_table import CONFIGS
from fxsplit.bench.stats import spread


def _q(v: list[float]) -> dict[str, float | int]:
    return spread(v).as_dict()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--config", default=None, help="default: gpt-w256-4x128 on CUDA, tiny on CPU")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--compiler", default="inductor", choices=("inductor", "eager"),
                   help="the graphs' compiler (eager: FX graphs run as they are, against aot_eager; a quick check)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    if args.config is not None and args.config not in CONFIGS:
        p.error(f"unknown --config {args.config!r}; known: {', '.join(CONFIGS)}")
    from fxsplit.bench.models import build

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = args.config or ("gpt-w256-4x128" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    stage = build(CONFIGS[name], device, dtype)
    base, x = stage.module, stage.make_input()
    with torch.no_grad():
        g = torch.randn_like(base(x))
    modes = ("inductor", "inductor-ro", "fxsplit", "fxsplit-ro")
    mods = {m: copy.deepcopy(base) for m in modes}
    backends = {"inductor": "inductor", "fxsplit": "fxsplit"} if args.compiler == "inductor" else {
        "inductor": "aot_eager", "fxsplit": fxsplit.backend(compiler="eager")}
    fns = {
        m: torch.compile(mods[m], backend=backends[m.split("-")[0]],
                         **({"mode": "reduce-overhead"} if m.endswith("-ro") else {}))
        for m in modes
    }

    def mark() -> Any:
        if not cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def ms(a: Any, b: Any) -> float:
        if not cuda:
            return (b - a) * 1e3
        b.synchronize()
        return a.elapsed_time(b)

    def one(mode: str, direct: bool) -> tuple[float, float, list[torch.Tensor]]:
        params = list(mods[mode].parameters())
        for q in params:
            q.grad = None
        if mode.endswith("-ro"):
            torch.compiler.cudagraph_mark_step_begin()
        xi = x.detach().requires_grad_()
        out = fns[mode](xi)
        sync()
        t0, a = time.perf_counter(), mark()
        if mode.startswith("inductor"):
            out.backward(g)
            host = time.perf_counter() - t0
        else:
            with fxsplit.config.patch(direct_b=direct):
                _, work = fxsplit.stage_backward_input([out], [g], [xi], params)
            host = time.perf_counter() - t0
            del out
            fxsplit.stage_backward_weight(params, work)
        b = mark()
        return host * 1e3, ms(a, b), [q.grad.detach().clone() for q in params]

    runs = [(m, d) for m in modes for d in ((False, True) if m.startswith("fxsplit") else (False,))]
    for r in runs:
        for _ in range(5):
            one(*r)
    bitwise = {}
    for m in ("fxsplit", "fxsplit-ro"):
        engine, direct = one(m, False)[2], one(m, True)[2]
        bitwise[m] = all(torch.equal(a, b) for a, b in zip(engine, direct))
    samples: dict[tuple[str, bool], tuple[list[float], list[float]]] = {r: ([], []) for r in runs}
    for k in range(args.reps):
        for r in runs if k % 2 else runs[::-1]:
            host, dev, _ = one(*r)
            samples[r][0].append(host)
            samples[r][1].append(dev)
    label = {False: "engine", True: "direct"}
    result: dict[str, Any] = {
        "what": "B's host time (Inductor: the whole backward's) and the whole backward's device time, ms",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "config": name, "dtype": str(dtype),
        "torch_version": torch.__version__, "reps": args.reps, "gradients_bitwise_engine_vs_direct": bitwise,
        "rows": {}, **provenance(" ".join(["python -m benchmarks.direct_b", *sys.argv[1:]])),
    }
    print(f"{name} on {result['device']}, torch {torch.__version__}, {args.reps} interleaved rounds; "
          f"gradients bitwise engine vs direct: {bitwise}")
    for (m, d), (host, dev) in samples.items():
        key = m if m.startswith("inductor") else f"{m} {label[d]}"
        result["rows"][key] = {"b_host_ms": _q(host), "backward_ms": _q(dev)}
        print(f"  {key:20s} B host {statistics.median(host):.3f} ms   backward {statistics.median(dev):.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
