"""Op by op: fxsplit's fused backward against its B + W, under torch.profiler.

Runs one benchmark model (the sizes ``fxsplit bench`` uses by default)
compiled with fxsplit, in steady state (``.grad`` already allocated, so W
accumulates as it does from the second microbatch on), and profiles the
ordinary backward (the fused graph) and B then W (the dI and dW graphs)
alternately. Prints self CPU time per op and input shapes, summed over the
profiled steps and divided by their number, for the ops where the two differ
most, and the totals. A dispatch-level profiler sees the ATen calls Inductor
leaves to ATen (matmuls, attention) and each compiled graph's own kernels as
one "Call CompiledFxGraph" entry.

    python -m benchmarks.kernel_profile --model gpt --steps 5
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import fxsplit
from benchmarks._common import fxsplit_stage
from fxsplit.bench.models import MODELS

Key = tuple[str, str]


def _profiled(fn: Callable[[], None]) -> tuple[collections.Counter[Key], collections.Counter[Key]]:
    """Self CPU microseconds and call counts per (op, input shapes) of one call of ``fn``."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    us: collections.Counter[Key] = collections.Counter()
    calls: collections.Counter[Key] = collections.Counter()
    for e in prof.key_averages(group_by_input_shape=True):
        key = (e.key, str(e.input_shapes))
        us[key] += e.self_cpu_time_total
        calls[key] += e.count
    return us, calls


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=5, help="profiled steps of each kind (default 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", type=int, default=25, help="ops shown (default 25)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    stage, module, params = fxsplit_stage(args.model)

    def backward_of(kind: str) -> Callable[[], None]:
        """Runs a forward now and returns its backward of ``kind`` (only that is profiled)."""
        x = stage.make_input()
        out = module(x)
        grad = torch.ones_like(out)

        def run() -> None:
            if kind == "fused":
                out.backward(grad)
                return
            dinputs, work = fxsplit.stage_backward_input([out], [grad], [x], params)
            del dinputs
            fxsplit.stage_backward_weight(params, work)

        return run

    kinds = ("fused", "B+W")
    for _ in range(args.warmup):
        for kind in kinds:
            backward_of(kind)()
    totals = {kind: (collections.Counter(), collections.Counter()) for kind in kinds}
    for _ in range(args.steps):
        for kind in kinds:
            us, calls = _profiled(backward_of(kind))
            totals[kind][0].update(us)
            totals[kind][1].update(calls)
    n = args.steps
    (fu, fc), (su, sc) = totals["fused"], totals["B+W"]
    keys = sorted(set(fu) | set(su), key=lambda k: -abs(fu[k] - su[k]))[: args.rows]
    print(f"{stage.description}; torch {torch.__version__}; {n} profiled steps of each, self CPU ms per step")
    print(f"{'fused':>8} {'B+W':>8} {'calls':>11}  op  [input shapes]")
    for k in keys:
        print(f"{fu[k] / n / 1e3:8.2f} {su[k] / n / 1e3:8.2f} {fc[k] // n:5d}/{sc[k] // n:<5d}  {k[0][:48]}  {k[1][:100]}")
    result = {"fused_ms": sum(fu.values()) / n / 1e3, "split_ms": sum(su.values()) / n / 1e3}
    print(f"total self CPU ms per step: fused {result['fused_ms']:.2f}, B+W {result['split_ms']:.2f} "
          f"({result['split_ms'] / result['fused_ms']:.3f}x)")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
