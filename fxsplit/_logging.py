"""fxsplit's place in torch's logging: the ``fxsplit`` log, the ``fxsplit_graphs`` artifact, the structured trace.

Policy:

* ``logging.getLogger("fxsplit")`` is registered with torch as the log
  ``fxsplit`` (so ``TORCH_LOGS=+fxsplit`` and
  ``torch._logging.set_logs(modules={"fxsplit": logging.DEBUG})`` work) and is
  an ordinary library logger otherwise: its level is yours, its records
  propagate to your handlers, and while no handler above it would receive a
  record (logging not configured) it prints the record on stderr itself,
  with torch's format. So ``logging.getLogger("fxsplit").setLevel(logging.DEBUG)``
  alone prints, and after ``logging.basicConfig(...)`` each record is printed
  once, by your handler.
* When ``TORCH_LOGS`` names ``fxsplit``, or after a ``torch._logging.set_logs``
  call made once fxsplit is imported (or one naming ``fxsplit``), torch
  manages the ``fxsplit`` log as it manages its own (``dynamo``,
  ``inductor``): torch's handler prints it on stderr (or to
  ``TORCH_LOGS_OUT``), it no longer propagates to the root logger, and its
  level is the one ``TORCH_LOGS``/``set_logs`` names (unnamed: the root
  logger's, WARNING by default).
* ``fxsplit_graphs`` is an artifact, off by default like Inductor's
  ``output_code``: when enabled it prints, per compiled region, the dI graph,
  the dW graph and the live-ins with the bytes they hold.
  ``torch._logging.set_logs(modules={"fxsplit_graphs": True})`` enables it,
  and so does ``TORCH_LOGS="fxsplit,fxsplit_graphs"``: torch parses
  ``TORCH_LOGS`` while it is imported, before any package can register a
  name, so the ``fxsplit`` entry must come first (it makes torch import
  fxsplit, which registers ``fxsplit_graphs``); ``TORCH_LOGS=fxsplit_graphs``
  alone fails at ``import torch`` with "Invalid log settings"
  (pytorch/pytorch#173759).
* The same graphs go to torch's structured trace (``TORCH_TRACE=dir``, read
  with tlparse) as ``artifact`` entries attached to the compile id of the
  region: ``fxsplit_<region>_dI_graph``, ``fxsplit_<region>_dW_graph`` (text)
  and ``fxsplit_<region>_split`` (JSON: outputs, live-ins, bytes).

This module is the one place fxsplit reaches ``torch._logging``'s internals
(``_internal.register_log``/``register_artifact``, torch's handler
bookkeeping); :func:`_register` says what it relies on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch._guards
import torch._logging
import torch.fx as fx

from fxsplit.passes import SplitResult

__all__ = ["GRAPHS_ARTIFACT", "LOG_NAME", "publish_split", "split_report"]

LOG_NAME = "fxsplit"
GRAPHS_ARTIFACT = "fxsplit_graphs"


class _StderrUnlessConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """A stderr handler that stays silent while a handler above the ``fxsplit``
    logger will receive the record: printing it here too would print it twice."""

    def emit(self, record: logging.LogRecord) -> None:
        log = logging.getLogger(LOG_NAME)
        node: logging.Logger | None = log.parent if log.propagate else None
        while node is not None:
            if node.handlers:
                return
            node = node.parent if node.propagate else None
        super().emit(record)


def _register() -> logging.Logger:
    """Register the ``fxsplit`` log and the ``fxsplit_graphs`` artifact with torch; returns the artifact logger.

    Relies on ``torch._logging._internal``: ``register_log(alias, qnames)`` and
    ``register_artifact(name, description, visible, off_by_default)`` (the
    calls ``torch/_logging/_registrations.py`` makes for torch's own logs);
    ``LOG_TRACE_HANDLER`` is set at the end of torch's first ``_init_logs``
    (so ``None`` means torch is still initialising its logging, e.g. importing
    fxsplit because ``TORCH_LOGS`` names it, and will attach its handler to
    every registered log itself); ``_track_handler``/``_is_torch_handler``
    mark the handlers that ``_init_logs`` removes and re-creates on every
    ``set_logs``; ``DEFAULT_FORMATTER`` is the format of torch's logs.
    """
    from torch._logging import _internal

    _internal.register_log(LOG_NAME, LOG_NAME)
    _internal.register_artifact(
        GRAPHS_ARTIFACT,
        "fxsplit: the dI graph, the dW graph and the live-ins (with their bytes) of every region split "
        "by the fxsplit backend",
        off_by_default=True,
    )
    log = logging.getLogger(LOG_NAME)
    if _internal.LOG_TRACE_HANDLER is None:
        # torch is importing fxsplit while it parses TORCH_LOGS; its
        # _init_logs then attaches its handler to every registered log, and
        # its logs never propagate (it set that before this log existed).
        log.propagate = False
    elif not any(_internal._is_torch_handler(h) for h in log.handlers):
        # Tracked as torch's: the next _init_logs (set_logs, TORCH_LOGS)
        # replaces it with torch's own handler rather than doubling it.
        handler = _internal._track_handler(_StderrUnlessConfigured())
        handler.setFormatter(_internal.DEFAULT_FORMATTER)
        handler.setLevel(logging.DEBUG)
        log.addHandler(handler)
    # A child of "fxsplit" (the artifact logger is named <module>.__<artifact>),
    # so once enabled its records reach the fxsplit log's handler.
    return torch._logging.getArtifactLogger(__name__, GRAPHS_ARTIFACT)


_graphs_log = _register()


def _nbytes(val: Any) -> int | str | None:
    """Bytes of a traced value: an int for static sizes, the size expression for symbolic ones."""
    if not isinstance(val, torch.Tensor):
        return None
    n = val.numel() * val.element_size()
    return int(n) if isinstance(n, int) else str(n)


def _placeholder_vals(gm: fx.GraphModule) -> list[Any]:
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def split_report(name: str, split: SplitResult) -> dict[str, Any]:
    """What :func:`publish_split` publishes about ``split``, as a JSON-able dict.

    ``live_ins`` lists each value that crosses from dI to dW with its source,
    kind, shape, dtype and bytes (an int, or the size expression when the
    shape is symbolic); ``live_in_bytes`` is their sum (an int only when every
    size is static).
    """
    lives = []
    for live, val in zip(split.live_ins, _placeholder_vals(split.dw_graph)):
        entry: dict[str, Any] = {"name": live.name, "source": live.source, "kind": live.kind}
        if isinstance(val, torch.Tensor):
            entry.update(shape=[str(s) for s in val.shape], dtype=str(val.dtype).removeprefix("torch."),
                         bytes=_nbytes(val))
        lives.append(entry)
    sizes = [e.get("bytes") for e in lives if e.get("bytes") is not None]
    total: int | str = sum(sizes) if all(isinstance(s, int) for s in sizes) else " + ".join(map(str, sizes))
    compile_id = torch._guards.CompileContext.current_compile_id()
    return {
        "region": name,
        "compile_id": None if compile_id is None else str(compile_id),
        "di_outputs": list(split.di_outputs),
        "dw_outputs": list(split.dw_outputs),
        "num_outputs": split.num_outputs,
        "live_ins": lives,
        "live_in_bytes": total,
    }


def _graph_code(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


def _graphs_text(report: dict[str, Any], split: SplitResult) -> str:
    cid = f" (compile id {report['compile_id']})" if report["compile_id"] else ""
    lines = [
        f"fxsplit split of {report['region']}{cid}: dI computes backward outputs {report['di_outputs']}, "
        f"dW computes {report['dw_outputs']} of {report['num_outputs']}; "
        f"{len(report['live_ins'])} live-ins hold {report['live_in_bytes']} bytes from B to W",
        "live-ins:",
    ]
    for e in report["live_ins"]:
        detail = f" {e['dtype']}[{', '.join(e['shape'])}] {e['bytes']} bytes" if "bytes" in e else ""
        lines.append(f"  {e['name']} ({e['source']}, {e['kind']}){detail}")
    lines += ["dI graph:", _graph_code(split.di_graph), "dW graph:", _graph_code(split.dw_graph)]
    return "\n".join(lines)


def _artifact(name: str, encoding: str, payload_fn: Callable[[], str]) -> None:
    # An "artifact" entry is tlparse's generic kind: listed under the compile
    # id that trace_structured reads from the current CompileContext.
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=payload_fn,
    )


def publish_split(name: str, split: SplitResult) -> None:
    """Publish the split of region ``name`` to the ``fxsplit_graphs`` artifact and to the structured trace.

    Called by the backend right after the split is computed, inside the
    region's compile. Cheap when neither is enabled: the text is built only
    for an enabled log or a trace handler that writes.
    """
    report = split_report(name, split)
    _graphs_log.debug("%s", torch._logging.LazyString(_graphs_text, report, split))
    _artifact(f"fxsplit_{name}_split", "json", lambda: json.dumps(report))
    _artifact(f"fxsplit_{name}_dI_graph", "string", lambda: _graph_code(split.di_graph))
    _artifact(f"fxsplit_{name}_dW_graph", "string", lambda: _graph_code(split.dw_graph))
