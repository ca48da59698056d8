"""torchtitan's config functions, each returning its config with fxsplit's pipeline stages.

torchtitan's ``ConfigManager`` loads ``<--module>.config_registry`` and calls the
function ``--config`` names; with ``--module fxsplit.integrations.torchtitan``
it loads this module. Every config function of torchtitan's model registries
(``torchtitan.models.<model>.config_registry``: ``llama3_debugmodel``,
``qwen3_debugmodel``, ``deepseekv3_debugmodel``, ...) is available here under
its own name; the config it returns goes through
:func:`fxsplit.integrations.torchtitan.use_fxsplit` (fxsplit's
``pipelining_fn``; compile backend ``fxsplit`` unless the config names another).
Command-line options apply after, as with torchtitan's own registries.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from fxsplit.integrations.torchtitan import _torchtitan, use_fxsplit


@functools.cache
def _registries() -> dict[str, Callable[[], Any]]:
    """Config function name -> torchtitan's function, over torchtitan's model registries."""
    models = _torchtitan("torchtitan.models")
    found: dict[str, Callable[[], Any]] = {}
    for info in sorted(pkgutil.iter_modules(models.__path__), key=lambda i: i.name):
        try:
            registry = importlib.import_module(f"torchtitan.models.{info.name}.config_registry")
        except ImportError:
            continue
        for name, fn in vars(registry).items():
            if callable(fn) and getattr(fn, "__module__", None) == registry.__name__ and not name.startswith("_"):
                found.setdefault(name, fn)
    return found


def __getattr__(name: str) -> Callable[[], Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    fn = _registries().get(name)
    if fn is None:
        raise AttributeError(f"{__name__}: torchtitan has no config function {name!r}")

    @functools.wraps(fn)
    def config() -> Any:
        return use_fxsplit(fn())

    return config


def __dir__() -> list[str]:
    return sorted(_registries())
