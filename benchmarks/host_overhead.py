"""Host time outside the compiled graphs: B + W against the fused backward.

On a host-bound stage the split's cost is what runs around its graphs:
autograd's engine, AOTAutograd's wrappers and fxsplit's own Python (plans,
checks, commits). This measures it on one fxsplit-compiled stage, alternating
ordinary backward (the region's fused graph) and B then W (its dI and dW
graphs) in every round, ``.grad`` empty before each: the time of each backward
minus the time inside its compiled graphs (``region.graph_ns``), and the
graphs' own ratio. Medians of the per-round ratios, with their quartiles.

    python -m benchmarks.host_overhead                 # width 128, 2 x 64 tokens, 1 thread
    python -m benchmarks.host_overhead --threads 2 --reps 500
    python -m benchmarks.host_overhead --lines         # also: lines of Python each backward runs
    python -m benchmarks.host_overhead --unused-parameter   # the stage also holds a parameter it never uses
    python -m benchmarks.host_overhead --frozen-and-shared  # and a frozen Linear, and a Linear used twice

``--lines`` counts, once after the timed rounds, the lines of Python that an
ordinary backward, a B and a W execute outside the compiled graphs' own code
(``sys.settrace``), in all and distinct. Unlike the times, the counts do not
move with the machine: on a host-bound CPU stage, where each graph call leaves
the caches cold for the Python after it, the distinct lines follow the host
time more closely than the total.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

import fxsplit
from benchmarks.split_table import CONFIGS
from fxsplit.bench.stats import spread


def _q(values: list[float]) -> str:
    return spread(values).format(3)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--compiler", default="inductor", choices=("inductor", "eager"),
                   help="the graphs' compiler (eager: FX graphs run as they are; for a quick check)")
    p.add_argument("--lines", action="store_true",
                   help="also count the lines of Python run outside the graphs per ordinary backward, B and W")
    p.add_argument("--unused-parameter", action="store_true",
                   help="give the stage a parameter its forward never uses (a middle stage's token embedding)")
    p.add_argument("--frozen-and-shared", action="store_true",
                   help="follow the stage with a frozen Linear and a Linear applied twice (a tied weight)")
    args = p.parse_args(argv)
    if args.reps < 1 or args.threads < 1:
        p.error("--reps and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    from fxsplit.bench.models import build

    stage = build(CONFIGS[args.config])
    module = copy.deepcopy(stage.module)
    if args.unused_parameter:
        module = _WithUnused(module)
    if args.frozen_and_shared:
        module = _FrozenAndShared(module, stage.make_input().shape[-1])
    before = fxsplit.compiled_regions()
    model = torch.compile(module, backend=fxsplit.backend(compiler=args.compiler))
    x = stage.make_input().detach().requires_grad_()
    params = list(model.parameters())
    g = torch.randn_like(model(x))
    (region,) = [r for r in fxsplit.compiled_regions() if r not in before]

    def clear() -> None:
        for w in params:
            w.grad = None
        x.grad = None

    rows: list[tuple[int, int, int, int]] = []  # fused total, fused graph, split total, split graphs
    for k in range(args.reps + 10):
        clear()
        a = dict(region.graph_ns)
        out = model(x)
        t0 = time.perf_counter_ns()
        out.backward(g)
        fused = time.perf_counter_ns() - t0
        b = dict(region.graph_ns)
        clear()
        out = model(x)
        t0 = time.perf_counter_ns()
        _, work = fxsplit.stage_backward_input([out], [g], [x], params)
        fxsplit.stage_backward_weight(params, work)
        split = time.perf_counter_ns() - t0
        c = dict(region.graph_ns)
        if k >= 10:  # warm-up dropped
            rows.append((fused, b["fused"] - a["fused"], split, c["dI"] - b["dI"] + c["dW"] - b["dW"]))
    outside = [(s - sg) / (f - fg) for f, fg, s, sg in rows]
    graphs = [sg / fg for _, fg, _, sg in rows]
    total = [s / f for f, _, s, _ in rows]
    extra = (" + an unused parameter" if args.unused_parameter else "") + (
        " + a frozen and a shared Linear" if args.frozen_and_shared else "")
    print(f"{args.config}{extra}, {args.compiler}, {args.threads} thread(s), torch {torch.__version__}, {args.reps} rounds; "
          "medians (quartiles) of per-round ratios, B + W over the fused backward:")
    print(f"  host time outside the graphs: {_q(outside)}  "
          f"(fused {statistics.median(f - fg for f, fg, _, _ in rows) / 1e3:.0f} us, "
          f"B + W {statistics.median(s - sg for _, _, s, sg in rows) / 1e3:.0f} us)")
    print(f"  time inside the graphs:       {_q(graphs)}")
    print(f"  whole backward:               {_q(total)}")
    result = {
        "outside_graphs_ratio": statistics.median(outside),
        "graphs_ratio": statistics.median(graphs),
        "backward_ratio": statistics.median(total),
    }
    if args.lines:
        clear()
        out = model(x)
        fused_lines, _ = _lines_run(lambda: out.backward(g))
        clear()
        out = model(x)
        b_lines, (_, work) = _lines_run(lambda: fxsplit.stage_backward_input([out], [g], [x], params))
        w_lines, _ = _lines_run(lambda: fxsplit.stage_backward_weight(params, work))
        print("  lines of Python outside the graphs, in all (distinct): "
              f"fused backward {fused_lines[0]} ({fused_lines[1]}), B {b_lines[0]} ({b_lines[1]}), "
              f"W {w_lines[0]} ({w_lines[1]})")
        result.update(fused_lines=fused_lines[0], b_lines=b_lines[0], w_lines=w_lines[0],
                      fused_distinct_lines=fused_lines[1], b_distinct_lines=b_lines[1], w_distinct_lines=w_lines[1])
    return result


class _WithUnused(torch.nn.Module):
    """A stage and a parameter its forward never uses (given to B and W with
    the others, as a pipeline stage gives every parameter)."""

    def __init__(self, stage: torch.nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.unused = torch.nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x)


class _FrozenAndShared(torch.nn.Module):
    """A stage followed by a frozen Linear (a weight that needs no gradient,
    given to B and W with the others) and a Linear applied twice (one weight,
    two uses in one region)."""

    def __init__(self, stage: torch.nn.Module, width: int) -> None:
        super().__init__()
        self.stage = stage
        self.frozen = torch.nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.shared = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.stage(x))
        return h + self.shared(torch.tanh(self.shared(h)))


def _graph_code() -> Callable[[str], bool]:
    """Whether code in a file is a compiled graph's own: a module Inductor
    wrote into its cache, or an FX graph module's ``forward``."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        inductor = os.path.realpath(cache_dir())
    except Exception:  # another layout of Inductor's cache: its default folder name
        inductor = "torchinductor"
    return lambda filename: filename.startswith("<eval_with_key>") or inductor in filename


def _lines_run(fn: Callable[[], Any]) -> tuple[tuple[int, int], Any]:
    """``((lines executed, distinct lines), fn())``, counting lines outside
    the compiled graphs' code."""
    generated = _graph_code()
    seen: dict[tuple[str, int], int] = {}

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if generated(frame.f_code.co_filename):
            return None
        if event == "line":
            key = (frame.f_code.co_filename, frame.f_lineno)
            seen[key] = seen.get(key, 0) + 1
        return trace

    sys.settrace(trace)
    try:
        value = fn()
    finally:
        sys.settrace(None)
    return (sum(seen.values()), len(seen)), value


if __name__ == "__main__":
    main()
    sys.exit(0)
