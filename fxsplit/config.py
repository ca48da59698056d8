"""Process-wide defaults of the fxsplit backend, in the style of ``torch._inductor.config``.

* ``fallback``: what a region that cannot be compiled or split does when its
  backend was not given ``fallback=`` explicitly (this includes the plain
  ``backend="fxsplit"`` string): ``"eager"`` (log one warning, run the region
  eagerly, where the eager split applies) or ``"error"`` (raise
  :class:`fxsplit.FxsplitCompileError`). Starts from the environment variable
  ``FXSPLIT_FALLBACK`` (``eager`` when unset), so child processes (torchrun,
  multiprocessing) inherit it.

* ``lazy_compile``: compile each backward graph of a region when it is first
  used (the fused graph on the first ordinary backward, the dI/dW pair on the
  first B) rather than all with the forward. Read when a region compiles;
  ``FXSPLIT_LAZY_COMPILE=0`` turns it off. Default ``True``.
* ``fused_accumulation``: where a weight already has a ``.grad``, W adds the
  gradient into it inside the compiled dW graph (one GEMM that accumulates)
  instead of handing it to autograd's accumulation. Only for weights where
  nothing observable differs: no tensor hooks or post-accumulate-grad hooks,
  ``.grad`` a plain dense tensor of the gradient's dtype, device and the
  layout the graph was compiled for, not requiring grad, ``grad_dtype`` unset
  or equal, and the weight's gradient coming from that one region only.
  Hooks registered on a weight's grad *accumulator node* (C++ post hooks such
  as DDP's reducer, or ``node.register_hook`` in Python) cannot be seen from
  Python: turn this off for such weights (``fxsplit.pipelining.PipelineStage``
  does so for DDP-wrapped stages). The same conditions let W set an empty
  ``.grad`` to the dW graph's gradient itself, as ``AccumulateGrad`` would,
  without an autograd engine call. Read when W runs;
  ``FXSPLIT_FUSED_ACCUMULATION=0`` turns it off. Default ``True``.
* ``direct_b``: B of a stage that is one compiled region (its outputs that
  region's, its inputs entering it directly) calls the region's backward
  itself instead of through autograd's engine, which on a GPU hands every
  backward to a device thread and back: on an H200 that hand-over cost more
  host time than the rest of B (docs/benchmark.md). Taken only where nothing
  the engine would do differs: no tensor hooks or ``retain_grad`` on the
  outputs or inputs, no hook on the region's node, anomaly mode off, no
  symbolic sizes, on CUDA the current stream the device's default stream.
  What cannot be checked: the forward must have run on the stream B runs
  on, or been synchronized with it (upstream's pipeline stage runs both on
  the current stream).
  ``"auto"`` (the default): for tensors on any device but the CPU, where the
  engine runs in the calling thread and calling the region saves nothing
  (freeing its saved tensors from Python costs a little more there), and for
  a first stage of one region on every device (an engine call would only
  hand B the output gradients);
  ``True``: on every device; ``False``: never. Read when B runs;
  ``FXSPLIT_DIRECT_B`` (``auto``, ``1``, ``0``) sets it.

* ``skip_aot_wrapper``: B runs a split region's compiled backward without
  AOTAutograd's backward wrapper once one call through it showed the wrapper
  passing the node's saved values and the gradients on unchanged, while that
  still holds (``fxsplit.runtime.AotCall``). ``False``: B always goes
  through the wrapper. Read when B runs; ``FXSPLIT_SKIP_AOT_WRAPPER=0`` turns
  it off. Default ``True``.

* ``whole_nodes``: what B and W do with an autograd node whose one backward call
  computes the gradients of all its edges (a custom ``torch.autograd.Function``,
  a region compiled by another backend) and whose gradients feed both B and a
  weight W computes by eager autograd. ``"once"`` (the default): it runs at B
  only; B keeps the gradients it produced for the weight side (counted in
  ``PendingWeightGrads.held_bytes``, up to a weight's size each) and W commits
  them through autograd. ``"again"``: B keeps the gradients flowing into it
  instead and W runs it again (its backward's FLOPs twice, nothing
  weight-sized held between B and W). Read when B runs; ``FXSPLIT_WHOLE_NODES``
  sets it.

``fallback``, ``defer`` and ``lazy_compile`` are read when a region compiles, so a change
applies to regions compiled afterwards::

    fxsplit.config.fallback = "error"           # from now on
    with fxsplit.config.patch(fallback="error"):  # for a block
        ...
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from fxsplit.passes.placement import DEFER_MODES

__all__ = [
    "DEFERS", "FALLBACKS", "current", "defer", "direct_b", "fallback", "fused_accumulation", "lazy_compile", "patch",
    "skip_aot_wrapper", "whole_nodes",
]

FALLBACKS = ("eager", "error")
DEFERS = DEFER_MODES


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "off", "")


fallback: str = os.environ.get("FXSPLIT_FALLBACK", "eager")
defer: str = os.environ.get("FXSPLIT_DEFER", "matmuls")
lazy_compile: bool = _env_flag("FXSPLIT_LAZY_COMPILE", True)
fused_accumulation: bool = _env_flag("FXSPLIT_FUSED_ACCUMULATION", True)
direct_b: bool | str = (
    "auto" if os.environ.get("FXSPLIT_DIRECT_B", "auto").strip().lower() == "auto"
    else _env_flag("FXSPLIT_DIRECT_B", True)
)
skip_aot_wrapper: bool = _env_flag("FXSPLIT_SKIP_AOT_WRAPPER", True)
whole_nodes: str = os.environ.get("FXSPLIT_WHOLE_NODES", "once").strip().lower()

_CHOICES: dict[str, tuple[Any, ...]] = {
    "fallback": FALLBACKS,
    "defer": DEFERS,
    "lazy_compile": (True, False),
    "fused_accumulation": (True, False),
    "direct_b": ("auto", True, False),
    "skip_aot_wrapper": (True, False),
    "whole_nodes": ("once", "again"),
}


def _check(name: str, value: Any) -> None:
    choices = _CHOICES.get(name)
    if choices is None:
        raise AttributeError(f"fxsplit.config has no option {name!r} (options: {', '.join(_CHOICES)})")
    for c in choices:
        if value is c:
            return  # the common case: one of the choices itself
    if not any(value is c or (isinstance(c, str) and value == c) for c in choices):
        raise ValueError(f"fxsplit.config.{name} must be one of {choices}, got {value!r}")


def current(name: str) -> Any:
    """The value of option ``name`` now, validated (it may come from the
    environment or a plain assignment)."""
    value = getattr(sys.modules[__name__], name) if name in _CHOICES else None
    _check(name, value)
    return value


def current_fallback() -> str:
    """``fallback``, validated (it may come from the environment or a plain assignment)."""
    _check("fallback", fallback)
    return fallback


def current_defer() -> str:
    """``defer``, validated (it may come from the environment or a plain assignment)."""
    _check("defer", defer)
    return defer


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[None]:
    """Set options for the duration of a ``with`` block, restoring them after.
    Unknown options and bad values raise before anything changes."""
    for name, value in changes.items():
        _check(name, value)
    module = sys.modules[__name__]
    saved = {name: getattr(module, name) for name in changes}
    for name, value in changes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
