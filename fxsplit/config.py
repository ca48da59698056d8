"""Process-wide defaults of the fxsplit backend, in the style of ``torch._inductor.config``.

* ``fallback``: what a region that cannot be compiled or split does when its
  backend was not given ``fallback=`` explicitly (this includes the plain
  ``backend="fxsplit"`` string): ``"eager"`` (log one warning, run the region
  eagerly, where the eager split applies) or ``"error"`` (raise
  :class:`fxsplit.FxsplitCompileError`). Starts from the environment variable
  ``FXSPLIT_FALLBACK`` (``eager`` when unset), so child processes (torchrun,
  multiprocessing) inherit it.

Read at compile time, so a change applies to regions compiled afterwards::

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

__all__ = ["DEFERS", "FALLBACKS", "defer", "fallback", "patch"]

FALLBACKS = ("eager", "error")
DEFERS = DEFER_MODES

fallback: str = os.environ.get("FXSPLIT_FALLBACK", "eager")
defer: str = os.environ.get("FXSPLIT_DEFER", "matmuls")

_CHOICES = {"fallback": FALLBACKS, "defer": DEFERS}


def _check(name: str, value: Any) -> None:
    choices = _CHOICES.get(name)
    if choices is None:
        raise AttributeError(f"fxsplit.config has no option {name!r} (options: {', '.join(_CHOICES)})")
    if value not in choices:
        raise ValueError(f"fxsplit.config.{name} must be one of {choices}, got {value!r}")


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
