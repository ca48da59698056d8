"""Where a split backward's time goes: compiled graphs vs. everything around them.

Runs one benchmark model (the sizes ``fxsplit bench`` uses by default)
compiled with fxsplit, in steady state (``.grad`` allocated, so W
accumulates inside its dW graph as it does from the second microbatch on),
and reports, as medians over alternating repetitions:

1. In place: each ordinary backward and each B + W, the whole call and the
   time inside the compiled graphs (the regions' ``graph_ns``); the rest is
   host work (autograd engine, AOTAutograd wrappers, fxsplit's bookkeeping).
2. Isolated (``--isolate``): the fused graph, and the dI graph then the dW
   graph, called directly on the arguments one real step gave them, back to
   back with nothing else in between, so that what differs is the graphs
   themselves and the memory they touch. The matmuls Inductor leaves to ATen
   (``extern_kernels.mm``) are timed one by one and summed per shape in each
   graph: the same matmul can cost more in dI than in the fused graph when
   its output goes to a buffer that dI must keep for W (a live-in), where the
   fused graph reuses a buffer it has just freed.

``--malloc retain`` first tells glibc to keep freed memory for reuse (see
``fxsplit.bench.allocator``), as the benchmark's option of the same name.

    python -m benchmarks.graph_times --model gpt --isolate
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import fxsplit
from fxsplit import runtime
from fxsplit.bench import allocator
from benchmarks._common import fxsplit_stage
from fxsplit.bench.models import MODELS
from fxsplit.bench.stats import spread

KINDS = ("fused", "dI", "dW")


def _graph_ns() -> dict[str, int]:
    regions = fxsplit.compiled_regions()
    return {k: sum(r.graph_ns.get(k, 0) for r in regions) for k in KINDS}


def _spread(values: list[float]) -> str:
    return spread(values).format(3)


@contextmanager
def _captured_graph_calls(found: dict[str, tuple[Any, list[Any]]]) -> Iterator[None]:
    """While active, record for each kind of graph the compiled callable and a
    copy of the argument list of its last call (fxsplit's runtime internals)."""
    cls = runtime.CompiledSplitBackward
    full, di, dw = cls._full, cls._di_and_live, cls.run_dw

    def _full(self: Any, args: list[Any]) -> Any:
        found["fused"] = (self._run_fused, list(args))
        return full(self, args)

    def _di(self: Any, args: list[Any], timings: Any = None) -> Any:
        found["dI"] = (self._run_di, list(args))
        return di(self, args, timings)

    def _dw(self: Any, args: list[Any], timings: Any = None, slot: Any = None, graph: Any = None,
            positions: tuple[int, ...] = ()) -> Any:
        found["dW"] = (self._run_dw if graph is None else graph, list(args))
        return dw(self, args, timings, slot, graph, positions)

    cls._full, cls._di_and_live, cls.run_dw = _full, _di, _dw  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls._full, cls._di_and_live, cls.run_dw = full, di, dw  # type: ignore[method-assign]


@contextmanager
def _timed_extern_mm(record: Callable[[tuple[tuple[int, ...], ...], int], None]) -> Iterator[None]:
    from torch._inductor.select_algorithm import extern_kernels

    mm = extern_kernels.mm

    def timed(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        r = mm(a, b, out=out)
        record((tuple(a.shape), tuple(b.shape)), time.perf_counter_ns() - t0)
        return r

    extern_kernels.mm = timed
    try:
        yield
    finally:
        extern_kernels.mm = mm


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=sorted(MODELS))
    p.add_argument("--reps", type=int, default=30, help="timed repetitions of each (default 30)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--isolate", action="store_true", help="also call the graphs directly, matmuls timed one by one")
    p.add_argument("--malloc", default="default", choices=allocator.CHOICES)
    a = p.parse_args(argv)
    if a.reps < 1:
        p.error(f"--reps must be at least 1, got {a.reps}")
    if a.malloc == "retain":
        try:
            allocator.retain_freed_memory()
        except RuntimeError as e:
            p.error(str(e))
    stage, module, params = fxsplit_stage(a.model)
    grad = torch.randn_like(module(stage.make_input()))

    def ordinary() -> None:
        out = module(stage.make_input())
        out.backward(grad)

    def split() -> None:
        x = stage.make_input()
        out = module(x)
        dinputs, work = fxsplit.stage_backward_input([out], [grad], [x], params)
        del out, dinputs
        fxsplit.stage_backward_weight(params, work)

    print(f"{stage.description}; torch {torch.__version__}; malloc {a.malloc}; compiling and warming up ...",
          file=sys.stderr, flush=True)
    for _ in range(a.warmup):
        ordinary()
        split()
    # 1. in place: the forward runs first, then the backward is timed with the graphs inside it
    wall: dict[str, list[float]] = {"ordinary": [], "split": []}
    inside: dict[str, list[float]] = {"ordinary": [], "split": []}
    for rep in range(a.reps):
        for name in ("ordinary", "split")[:: 1 if rep % 2 == 0 else -1]:
            x = stage.make_input()
            out = module(x)
            g0 = _graph_ns()
            t0 = time.perf_counter_ns()
            if name == "ordinary":
                out.backward(grad)
                del out
            else:
                dinputs, work = fxsplit.stage_backward_input([out], [grad], [x], params)
                del out, dinputs
                fxsplit.stage_backward_weight(params, work)
                del work
            dt = time.perf_counter_ns() - t0
            g1 = _graph_ns()
            wall[name].append(dt / 1e6)
            inside[name].append(sum(g1[k] - g0[k] for k in KINDS) / 1e6)
    med = {f"{k}_ms": statistics.median(v) for k, v in wall.items()}
    med.update({f"{k}_graphs_ms": statistics.median(v) for k, v in inside.items()})
    host = {k: [w - g for w, g in zip(wall[k], inside[k])] for k in wall}
    print(f"{stage.description}; torch {torch.__version__}; malloc {a.malloc}; {a.reps} repetitions, medians (ms)")
    print(f"  in place, ordinary backward: {med['ordinary_ms']:.2f}, of which fused graph "
          f"{med['ordinary_graphs_ms']:.2f}, host {statistics.median(host['ordinary']):.2f}")
    print(f"  in place, B + W:             {med['split_ms']:.2f}, of which dI + dW graphs "
          f"{med['split_graphs_ms']:.2f}, host {statistics.median(host['split']):.2f}")
    print(f"  per repetition: B + W / ordinary {_spread([s / o for s, o in zip(wall['split'], wall['ordinary'])])}; "
          f"graphs / fused graph {_spread([s / o for s, o in zip(inside['split'], inside['ordinary'])])}")
    if a.isolate:
        med.update(_isolated(ordinary, split, a.reps))
    return med


def _isolated(ordinary: Callable[[], None], split: Callable[[], None], reps: int) -> dict[str, float]:
    found: dict[str, tuple[Any, list[Any]]] = {}
    with _captured_graph_calls(found):
        ordinary()
        split()
    if set(found) != set(KINDS):
        raise SystemExit(f"graph_times: --isolate found the graphs {sorted(found)} (one region in steady state, "
                         "with W accumulating inside its dW graph, is what it handles)")
    times: dict[str, list[float]] = {"fused": [], "dI+dW": []}
    mm: dict[str, dict[tuple[tuple[int, ...], ...], list[int]]] = {k: collections.defaultdict(list) for k in KINDS}
    current = ["fused"]

    def run(kind: str) -> int:
        graph, args = found[kind]
        current[0] = kind
        t0 = time.perf_counter_ns()
        graph(list(args))
        return time.perf_counter_ns() - t0

    with torch.no_grad(), _timed_extern_mm(lambda shapes, ns: mm[current[0]][shapes].append(ns)):
        for rep in range(reps + 3):
            order = ("fused", "split") if rep % 2 == 0 else ("split", "fused")
            got = {}
            for what in order:
                got[what] = run("fused") if what == "fused" else run("dI") + run("dW")
            if rep >= 3:
                times["fused"].append(got["fused"] / 1e6)
                times["dI+dW"].append(got["split"] / 1e6)
    n = reps + 3
    print(f"  isolated (graphs called directly, {reps} repetitions): fused graph "
          f"{statistics.median(times['fused']):.2f}, dI + dW graphs {statistics.median(times['dI+dW']):.2f}; "
          f"per repetition {_spread([s / f for s, f in zip(times['dI+dW'], times['fused'])])}")
    print("  extern matmuls, ms per call of the graph (summed over calls of one shape): fused / dI / dW")
    for shapes in sorted(set(mm["fused"]) | set(mm["dI"]) | set(mm["dW"])):
        cells = [sum(mm[k][shapes]) / n / 1e6 if shapes in mm[k] else None for k in KINDS]
        print("    " + " / ".join("-" if c is None else f"{c:.2f}" for c in cells)
              + f"   {' x '.join(str(list(s)) for s in shapes)}")
    return {"isolated_fused_ms": statistics.median(times["fused"]),
            "isolated_split_ms": statistics.median(times["dI+dW"])}


if __name__ == "__main__":
    main(sys.argv[1:])
