"""Where a split backward's time goes: compiled graphs vs. everything around them.

Runs one benchmark model compiled with fxsplit, alternating ordinary
backward (the fused graph) and B + W (the dI and dW graphs), and times both
the whole call and the compiled graphs inside it. The difference is host-side
work (autograd engine, AOTAutograd wrappers, fxsplit's bookkeeping).

    python -m benchmarks.graph_times --model gpt --layers 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import fxsplit
from fxsplit.bench.models import MODELS, ModelConfig, build


def _timed(acc: list[float], fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    def run(args: list[Any]) -> Any:
        t0 = time.perf_counter()
        out = fn(args)
        acc.append(time.perf_counter() - t0)
        return out

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args(argv)
    stage = build(ModelConfig(name=a.model, layers=a.layers, batch=a.batch, seq=a.seq))
    module = stage.module
    compiled = torch.compile(module, backend="fxsplit")

    def fused() -> None:
        out = compiled(stage.make_input())
        out.backward(torch.ones_like(out))

    def split() -> None:
        x = stage.make_input()
        out = compiled(x)
        _, work = fxsplit.stage_backward_input([out], [torch.ones_like(out)], [x], module.parameters())
        fxsplit.stage_backward_weight(module.parameters(), work)

    print(f"compiling {a.model} with backend='fxsplit' (forward, dI, dW and fused backward) ...", file=sys.stderr,
          flush=True)
    fused()  # compile
    print(f"timing {a.reps} + 5 warm-up rounds of ordinary and split steps ...", file=sys.stderr, flush=True)
    region = fxsplit.compiled_regions()[-1]
    graph: dict[str, list[float]] = {"fused": [], "dI": [], "dW": []}
    region._run_fused = _timed(graph["fused"], region._run_fused)
    region._run_di = _timed(graph["dI"], region._run_di)
    region._run_dw = _timed(graph["dW"], region._run_dw)
    wall: dict[str, list[float]] = {"fused": [], "split": []}
    for rep in range(a.reps + 5):
        for name, fn in (("fused", fused), ("split", split)):
            t0 = time.perf_counter()
            fn()
            if rep >= 5:
                wall[name].append(time.perf_counter() - t0)
    for v in graph.values():
        del v[:5]
    med = {k: statistics.median(v) * 1e3 for k, v in {**{f"wall_{k}": v for k, v in wall.items()},
                                                     **{f"graph_{k}": v for k, v in graph.items()}}.items()}
    split_graphs = med["graph_dI"] + med["graph_dW"]
    print(f"{a.model}, {a.layers} layers, torch {torch.__version__}, medians of {a.reps} (ms; walls include the forward)")
    print(f"  ordinary backward: fused graph {med['graph_fused']:.2f}")
    print(f"  B + W:             dI graph {med['graph_dI']:.2f} + dW graph {med['graph_dW']:.2f} = {split_graphs:.2f}"
          f"  ({split_graphs / med['graph_fused']:.3f} x fused graph)")
    print(f"  whole step (forward + backward): ordinary {med['wall_fused']:.2f}, split {med['wall_split']:.2f}"
          f"  (host-side difference beyond the graphs: "
          f"{(med['wall_split'] - split_graphs) - (med['wall_fused'] - med['graph_fused']):.2f})")
    return med


if __name__ == "__main__":
    main()
