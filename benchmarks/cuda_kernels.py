"""Device time per kernel: Inductor's fused backward against fxsplit's B + W, on CUDA.

Profiles (``torch.profiler``, CUDA activity) a few backwards of one stage of
the split table, compiled once with ``backend="inductor"`` (ordinary backward)
and once with fxsplit (B then W), and prints each kernel's device time per
backward, the number of launches, and the totals by kind of kernel. Where
B + W takes longer than the fused backward between CUDA events but not in
kernels, the difference is host time (the device waiting for launches).
On a CPU it runs, but sees no kernels.

    python -m benchmarks.cuda_kernels gpt-w2048-4x1024
"""

from __future__ import annotations

import collections
import copy
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fxsplit
from benchmarks.split_table import CONFIGS

KINDS = ("gemm", "nvjet", "sm90", "cutlass", "flash", "attention", "fmha", "red_fused", "per_fused", "poi_fused",
         "memcpy", "memset", "copy", "elementwise")


def _kind(name: str) -> str:
    low = name.lower()
    return next((k for k in KINDS if k in low), "other")


def main(argv: list[str]) -> None:
    from fxsplit.bench.models import build

    name = argv[0] if argv else "gpt-w2048-4x1024"
    steps = int(argv[1]) if len(argv) > 1 else 5
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    stage = build(CONFIGS[name] if cuda else CONFIGS["tiny"], device, dtype)
    base, x = stage.module, stage.make_input()
    with torch.no_grad():
        g = torch.randn_like(base(x))
    mods = {m: copy.deepcopy(base) for m in ("inductor", "fxsplit")}
    fns = {m: torch.compile(mods[m], backend=m) for m in mods}

    def forward(m: str) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        params = list(mods[m].parameters())
        for p in params:
            p.grad = None
        xi = x.detach().requires_grad_()
        out = fns[m](xi)
        if cuda:
            torch.cuda.synchronize()
        return xi, out, params

    def backward(m: str, xi: torch.Tensor, out: torch.Tensor, params: list[torch.Tensor]) -> None:
        if m == "inductor":
            out.backward(g)
            return
        _, work = fxsplit.stage_backward_input([out], [g], [xi], params)
        del out
        fxsplit.stage_backward_weight(params, work)

    for m in mods:
        for _ in range(3):
            backward(m, *forward(m))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    totals = {}
    for m in mods:
        us: collections.Counter[str] = collections.Counter()
        calls: collections.Counter[str] = collections.Counter()
        for _ in range(steps):
            args = forward(m)
            with profile(activities=activities) as prof:
                backward(m, *args)
                if cuda:
                    torch.cuda.synchronize()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    us[e.name] += e.device_time
                    calls[e.name] += 1
        totals[m] = (us, calls)
        print(f"== {m}: {sum(us.values()) / steps:.1f} us of kernels per backward, "
              f"{sum(calls.values()) / steps:.0f} launches")
        for k, v in us.most_common(40):
            print(f"  {v / steps:9.1f} us  x{calls[k] // steps:3d}  {k[:150]}")
    print("== by kind, us per backward (launches): kind, inductor, fxsplit")
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0, 0])
    for i, m in enumerate(mods):
        us, calls = totals[m]
        for k, v in us.items():
            kinds[_kind(k)][i] += v / steps
            kinds[_kind(k)][2 + i] += calls[k] // steps
    for k, (a, b, na, nb) in sorted(kinds.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0])):
        print(f"  {k:12s} {a:9.1f} ({na:3.0f})  {b:9.1f} ({nb:3.0f})  diff {b - a:+8.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
