"""Compile time per way of using a compiled stage (split only, ordinary backward only).

Three users of the same stage, each compiled from scratch (a fresh
``torch._dynamo.reset()`` and, unless the caches are meant to be warm, a
fresh Inductor cache):

* ``inductor``: ``backend="inductor"``, first forward + ordinary backward;
* ``fxsplit-split``: ``backend=fxsplit.backend()``, first forward + B + W (a
  pipeline stage under a zero-bubble schedule never calls ordinary backward);
* ``fxsplit-fused``: ``backend=fxsplit.backend()``, first forward + ordinary
  backward (a user who never splits).

The wall time of that first step is what a user waits for. Where fxsplit's
regions record their own compile times (``region.compile_seconds``, a dict per
graph kind, from the lazy-compilation runtime), those are summed per kind
and stored too; without that attribute the field is ``None``.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import fxsplit

__all__ = ["COMPILE_USERS", "measure_compile_times"]

COMPILE_USERS = ("inductor", "fxsplit-split", "fxsplit-fused")


def _reset_dynamo() -> None:
    """``torch._dynamo.reset()``: forget every compiled frame, so the next call compiles from scratch."""
    torch._dynamo.reset()


def _fresh_cache() -> contextlib.AbstractContextManager[None]:
    """``torch._inductor.utils.fresh_cache``: a temporary Inductor cache dir and cleared in-process caches."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache()


def _region_seconds(regions: list[Any]) -> dict[str, float] | None:
    """``compile_seconds`` of ``regions`` summed per graph kind; ``None`` when regions do not record it."""
    total: dict[str, float] = {}
    found = False
    for r in regions:
        secs = getattr(r, "compile_seconds", None)
        if secs is None:
            continue
        found = True
        for kind, s in secs.items():
            if s is not None:
                total[kind] = total.get(kind, 0.0) + float(s)
    return total if found else None


def measure_compile_times(
    base: torch.nn.Module,
    make_input: Callable[[], torch.Tensor],
    grad: torch.Tensor,
    reps: int,
    warm_cache: bool,
    sync: Callable[[], None] = lambda: None,
    say: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
    """``reps`` rounds, the three users interleaved in each; returns the JSON section ``compile``.

    Resets Dynamo: modules compiled before this call recompile on their next call.
    """
    samples: dict[str, list[float]] = {u: [] for u in COMPILE_USERS}
    regions: dict[str, list[dict[str, float] | None]] = {u: [] for u in COMPILE_USERS}
    for r in range(reps):
        for user in COMPILE_USERS:
            say(f"compile time: {user} (round {r + 1}/{reps})")
            _reset_dynamo()
            module = copy.deepcopy(base)
            params = list(module.parameters())
            backend = "inductor" if user == "inductor" else fxsplit.backend()
            compiled = torch.compile(module, backend=backend)
            before = {id(x) for x in fxsplit.compiled_regions()}
            x = make_input()
            with contextlib.nullcontext() if warm_cache else _fresh_cache():
                sync()
                t0 = time.perf_counter()
                out = compiled(x)
                if user == "fxsplit-split":
                    _, pending = fxsplit.stage_backward_input([out], [grad], [x], params)
                    del out
                    fxsplit.stage_backward_weight(params, pending)
                else:
                    torch.autograd.backward([out], [grad])
                    del out
                sync()
                samples[user].append(time.perf_counter() - t0)
            regions[user].append(_region_seconds([g for g in fxsplit.compiled_regions() if id(g) not in before]))
            del compiled, module
    _reset_dynamo()
    return {
        "users": {
            "inductor": "backend='inductor': first forward + ordinary backward",
            "fxsplit-split": "backend=fxsplit.backend(): first forward + B + W",
            "fxsplit-fused": "backend=fxsplit.backend(): first forward + ordinary backward",
        },
        "method": "wall time of the first step after torch._dynamo.reset(), "
        + ("warm Inductor caches (--warm-cache / --quick)" if warm_cache else "each in a fresh Inductor cache"),
        "samples_s": samples,
        "median_s": {u: statistics.median(v) for u, v in samples.items()},
        "region_compile_seconds": regions if any(x is not None for v in regions.values() for x in v) else None,
    }
