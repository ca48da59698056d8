"""A change's effect on B's and W's host time, measured call by call in one process.

On a host-bound stage the effect of one change to the Python around the graphs
is a few percent, less than separate runs of this machine differ by. This
alternates two versions of fxsplit in one process, switching every call: the
code as it is and the code with the patches of a variant file applied, and
reports the medians of B's and W's time outside the compiled graphs and of the
whole backward, each version, and the median (quartiles) of the per-call
differences (as-is minus variant: positive when the variant is faster).

A variant file is Python that defines ``PATCHES``, a dict from
``"module:attribute.path"`` to the object that replaces it while the variant
runs, for instance::

    # variant.py
    import fxsplit.runtime as rt
    def run_dw(self, live_ins, timings=None, slot=None): ...
    PATCHES = {"fxsplit.runtime:CompiledSplitBackward.run_dw": run_dw}

    python -m benchmarks.paired variant.py --threads 2 --reps 1000
    python -m benchmarks.paired variant.py --accumulate   # W adding into .grad, as after a step's first microbatch
"""

from __future__ import annotations

import argparse
import copy
import importlib
import runpy
import statistics
import sys
import time
from typing import Any

import torch

import fxsplit
from benchmarks.split_table import CONFIGS
from fxsplit.bench.stats import spread


def _resolve(target: str) -> tuple[Any, str]:
    """The object holding ``target``'s last attribute, and that attribute's name."""
    module, _, path = target.partition(":")
    if not module or not path:
        raise ValueError(f"a patch target is 'module:attribute.path', got {target!r}")
    owner: Any = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    if not hasattr(owner, name):
        raise ValueError(f"{target!r}: {owner!r} has no attribute {name!r}")
    return owner, name


def _q(values: list[float]) -> str:
    return spread(values).format(1)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant", help="a Python file defining PATCHES (see the module docstring)")
    p.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=1000, help="pairs of B + W calls measured (after 50 warm-up pairs)")
    p.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    p.add_argument("--accumulate", action="store_true",
                   help="keep the weights' .grad between calls, as a step's later microbatches do: W adds into "
                        "it (inside the dW graph where fxsplit may); default: .grad emptied before each B")
    args = p.parse_args(argv)
    if args.reps < 1 or args.threads < 1:
        p.error("--reps and --threads must be at least 1")
    patches = runpy.run_path(args.variant).get("PATCHES")
    if not isinstance(patches, dict) or not patches:
        p.error(f"{args.variant} defines no PATCHES dict")
    try:
        swaps = [(*_resolve(target), new) for target, new in patches.items()]
    except (ValueError, ImportError, AttributeError) as e:
        p.error(str(e))
    originals = [getattr(owner, name) for owner, name, _ in swaps]
    torch.set_num_threads(args.threads)
    from fxsplit.bench.models import build

    stage = build(CONFIGS[args.config])
    model = torch.compile(copy.deepcopy(stage.module), backend=fxsplit.backend(compiler=args.compiler))
    x = stage.make_input().detach().requires_grad_()
    params = list(model.parameters())
    g = torch.randn_like(model(x))

    def use(variant: bool) -> None:
        for (owner, name, new), old in zip(swaps, originals):
            setattr(owner, name, new if variant else old)

    def step() -> tuple[int, int, int]:
        if not args.accumulate:
            for w in params:
                w.grad = None
        x.grad = None
        out = model(x)
        t0 = time.perf_counter_ns()
        _, work = fxsplit.stage_backward_input([out], [g], [x], params)
        t1 = time.perf_counter_ns()
        fxsplit.stage_backward_weight(params, work)
        t2 = time.perf_counter_ns()
        t = work.timings
        return t1 - t0 - t["b_graph_ns"], t2 - t1 - t["w_graph_ns"], t2 - t0

    rows: dict[bool, list[tuple[int, int, int]]] = {False: [], True: []}
    try:
        for k in range(args.reps + 50):
            for variant in (False, True) if k % 2 else (True, False):
                use(variant)
                row = step()
                if k >= 50:
                    rows[variant].append(row)
    finally:
        use(False)
    names = ("B outside the graphs", "W outside the graphs", "whole B + W")
    print(f"{args.config}, {args.compiler}, {args.threads} thread(s), torch {torch.__version__}, {args.reps} pairs, "
          f"{'.grad kept (W accumulates)' if args.accumulate else '.grad emptied'}, "
          f"variant {args.variant}; us, medians (quartiles); difference = as-is minus variant:")
    result: dict[str, float] = {}
    for i, name in enumerate(names):
        base = [r[i] / 1e3 for r in rows[False]]
        var = [r[i] / 1e3 for r in rows[True]]
        diff = [a - b for a, b in zip(base, var)]
        print(f"  {name:22s} as-is {statistics.median(base):9.1f}  variant {statistics.median(var):9.1f}  "
              f"difference {_q(diff)}")
        key = ("b", "w", "whole")[i]
        result[f"{key}_as_is_us"] = statistics.median(base)
        result[f"{key}_variant_us"] = statistics.median(var)
        result[f"{key}_difference_us"] = statistics.median(diff)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
