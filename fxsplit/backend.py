"""The ``fxsplit`` torch.compile backend.

Dynamo graph -> Inductor's pipeline (pre-grad passes, decompositions,
AOTAutograd, min-cut partitioner) -> the forward is compiled by the inner
compiler exactly as ``backend="inductor"`` does; the backward graph is split
by :func:`fxsplit.passes.split_backward` into a dI and a dW graph, each compiled by
the inner compiler, and wrapped in a :class:`~fxsplit.runtime.CompiledSplitBackward`.

Never silent: a region that cannot be compiled or split either raises
:class:`FxsplitCompileError` or runs eagerly after one short warning; each
such fallback is recorded (:func:`fallbacks`) with the graph that failed.
Exceptions Dynamo raises through a backend to steer compilation (restarts,
graph breaks) are not failures and pass through untouched.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxsplit import _logging, config
from fxsplit import _torch_internals as ti
from fxsplit.passes import SplitResult, split_backward
from fxsplit.runtime import CompiledSplitBackward
from fxsplit.rules import trace_split_rule

log = logging.getLogger("fxsplit")

__all__ = [
    "BackendOptions",
    "FallbackRecord",
    "FxsplitCompileError",
    "backend",
    "compiled_regions",
    "fallbacks",
    "fxsplit_backend",
]

_COMPILERS = ("inductor", "eager")
_region_ids = itertools.count()
_region_serials = itertools.count()


class FxsplitCompileError(RuntimeError):
    """Compiling or splitting a region failed and ``fallback="error"`` was set.

    ``region`` names the region, ``graph`` the step that failed (see
    :class:`FallbackRecord`); the original exception is the ``__cause__``.
    """

    def __init__(self, message: str, region: str | None = None, graph: str | None = None) -> None:
        super().__init__(message)
        self.region = region
        self.graph = graph


_GRAPHS = {
    "aot": "tracing the region (Dynamo graph -> AOTAutograd forward/backward)",
    "forward": "compiling the forward graph",
    "split": "splitting the backward graph",
    "dI": "compiling the dI graph",
    "dW": "compiling the dW graph",
    "fused": "compiling the fused backward graph",
}


@dataclasses.dataclass(frozen=True)
class FallbackRecord:
    """A region that fell back to eager execution.

    ``graph`` is the step that failed: ``"aot"`` (AOTAutograd tracing and
    partitioning, before any graph of ours), ``"forward"``, ``"split"`` (the
    split pass), ``"dI"``, ``"dW"`` or ``"fused"`` (compiling that graph).
    ``message`` is the first line of the exception; ``compile_id`` is Dynamo's
    id of the frame compile (``"0/1"``), as its logs print it.
    """

    region: str
    graph: str
    exception: str
    message: str
    compile_id: str | None = None

    def __str__(self) -> str:
        where = f"{self.region} (Dynamo compile {self.compile_id})" if self.compile_id else self.region
        return f"{where}: {_GRAPHS.get(self.graph, self.graph)} failed ({self.exception}: {self.message})"


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """Options of the fxsplit backend.

    compiler: ``"inductor"`` (default; Triton on CUDA, C++ on CPU) or
        ``"eager"`` (run the split FX graphs without Inductor: for debugging
        and fast tests).
    fused_backward: also compile the unsplit backward and use it for ordinary
        ``.backward()`` so that it matches ``backend="inductor"`` kernel for
        kernel. With ``False`` ordinary backward runs dI then dW back to back
        and compiles one graph less.
    fallback: ``"eager"``: if a region cannot be compiled or split, log one
        warning, record it (:func:`fallbacks`) and run it eagerly, where the
        eager split still applies; ``"error"``: raise
        :class:`FxsplitCompileError`. ``None`` (default): ``fxsplit.config.fallback``
        when the region compiles (``"eager"`` unless changed).
    inductor_config: Inductor config patches (as ``torch.compile(options=...)``).
    defer: what the dW graph defers. ``"matmuls"``: every weight-gradient
        matmul (and convolution, grouped matmul), while cheap weight reductions
        (bias gradients, LayerNorm/RMSNorm weight gradients) run in dI, fused
        with the kernels that produce their inputs, and only their small
        results wait for W; ``"all"``: every weight-gradient computation runs
        in dW, so B does none. ``None`` (default): ``fxsplit.config.defer``
        when the region compiles (``"matmuls"`` unless changed).
    """

    compiler: str = "inductor"
    fused_backward: bool = True
    fallback: str | None = None
    inductor_config: dict[str, Any] | None = None
    defer: str | None = None

    def __post_init__(self) -> None:
        if self.compiler not in _COMPILERS:
            raise ValueError(f"fxsplit: compiler must be one of {_COMPILERS}, got {self.compiler!r}")
        if self.fallback is not None and self.fallback not in config.FALLBACKS:
            raise ValueError(f"fxsplit: fallback must be one of {config.FALLBACKS} or None, got {self.fallback!r}")
        if self.defer is not None and self.defer not in config.DEFERS:
            raise ValueError(f"fxsplit: defer must be one of {config.DEFERS} or None, got {self.defer!r}")

    def resolved_fallback(self) -> str:
        """The fallback mode in force now: this option, else ``fxsplit.config.fallback``."""
        return self.fallback if self.fallback is not None else config.current_fallback()

    def resolved_defer(self) -> str:
        """The placement policy in force now: this option, else ``fxsplit.config.defer``."""
        return self.defer if self.defer is not None else config.current_defer()


# Every live region compiled in this process, for inspection, oldest first.
# Weak: a region lives exactly as long as the compiled code that calls it
# (AOTAutograd's CompiledFunction holds it; pending W work holds the regions
# it will run), so recompiles and dropped modules do not accumulate here.
_REGIONS: weakref.WeakValueDictionary[int, CompiledSplitBackward] = weakref.WeakValueDictionary()


def compiled_regions() -> list[CompiledSplitBackward]:
    """The live split backward regions of this process, oldest first.

    A region disappears once nothing uses it any more (its module and
    Dynamo's cache entries are gone, e.g. after ``torch._dynamo.reset()``,
    and no pending W work refers to it), so compare by identity rather than
    by index across calls.
    """
    return [r for _, r in sorted(_REGIONS.items())]


_FALLBACKS: list[FallbackRecord] = []
_REPORTED_OPS: set[str] = set()
_REPORT_LOCK = threading.Lock()


def fallbacks() -> list[FallbackRecord]:
    """Every region that fell back to eager execution in this process (oldest first)."""
    with _REPORT_LOCK:
        return list(_FALLBACKS)


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _report_weight_work_in_di(name: str, split: SplitResult) -> None:
    """Say once per operator (per process) that it keeps weight work in B."""
    for shared in split.weight_work_in_di:
        with _REPORT_LOCK:
            first = shared.op not in _REPORTED_OPS
            _REPORTED_OPS.add(shared.op)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "fxsplit: %s: %s returns input and weight gradients from one call and has no split "
            "rule; it runs whole in dI, so B does its weight-gradient work (outputs %s). "
            "Declare one with fxsplit.register_split_rule(%r, ...).",
            name, shared.op, list(shared.dw_outputs), shared.op,
        )


@dataclasses.dataclass
class _RegionBuild:
    """What is being compiled for one region, so a failure can name it."""

    name: str
    graph: str = "aot"


def _inner_compile_for(opts: BackendOptions) -> Callable[..., ti.BoxedCallable]:
    if opts.compiler == "eager":
        # gm.forward, not gm: calling the GraphModule would run global nn.Module
        # hooks (e.g. FlopCounterMode's module tracker) on every backward graph.
        return lambda gm, example_inputs, **kw: ti.boxed(gm.forward)

    def inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], **kw: Any) -> ti.BoxedCallable:
        if opts.inductor_config:
            from torch._inductor import config as inductor_config

            with inductor_config.patch(opts.inductor_config):
                return ti.inductor_compile_graph(gm, example_inputs, **kw)
        return ti.inductor_compile_graph(gm, example_inputs, **kw)

    return inductor


def _weight_outputs(bw: fx.GraphModule, is_param: Sequence[bool]) -> list[int]:
    """Backward outputs that are gradients of ``nn.Parameter`` inputs of the Dynamo graph."""
    grad_of = ti.backward_output_input_indices(bw)
    if grad_of is None:
        raise FxsplitCompileError(
            "fxsplit: the backward graph carries no AOTAutograd descriptors; cannot tell "
            "weight gradients from input gradients"
        )
    return [i for i, idx in enumerate(grad_of) if idx is not None and idx < len(is_param) and is_param[idx]]


def _compile_split_backward(
    bw: fx.GraphModule,
    example_inputs: Sequence[Any],
    kwargs: dict[str, Any],
    is_param: Sequence[bool],
    is_tensor: Sequence[bool],
    opts: BackendOptions,
    build: _RegionBuild,
) -> CompiledSplitBackward:
    name = build.name
    inner = _inner_compile_for(opts)
    build.graph = "split"
    split = split_backward(bw, _weight_outputs(bw, is_param), rule=trace_split_rule, defer=opts.resolved_defer())
    ti.declare_no_donated_buffers()
    log.debug("fxsplit: %s split:\n%s", name, split.describe())
    _report_weight_work_in_di(name, split)
    _logging.publish_split(name, split)  # fxsplit_graphs artifact and structured trace

    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    static = set(kwargs.get("static_input_idxs") or ())
    split_kwargs = dict(kwargs)
    if opts.compiler == "inductor":
        split_kwargs["cudagraphs"] = ti.no_cudagraphs()

    build.graph = "dI"
    di_gm = split.di_graph
    ti.mark_user_visible_outputs(di_gm, range(len(split.di_outputs)))
    run_di = inner(di_gm, list(example_inputs), **{**split_kwargs, "static_input_idxs": sorted(static)})

    build.graph = "dW"
    di_strides = ti.compiled_output_strides(run_di) if opts.compiler == "inductor" else None
    index_of = {p.name: k for k, p in enumerate(placeholders)}
    dw_placeholders = split.dw_graph.graph.find_nodes(op="placeholder")
    dw_examples: list[Any] = []
    dw_static: list[int] = []
    for k, live in enumerate(split.live_ins):
        if live.source == "input":
            dw_examples.append(example_inputs[index_of[live.name]])
            if index_of[live.name] in static:
                dw_static.append(k)
        else:
            # dW receives this live-in as compiled dI lays it out (Inductor may
            # pick e.g. channels-last for a conv gradient), not as traced. A
            # SymInt live-in is its traced value: an expression of the same
            # shape environment, bound by the SymInt live-ins beside it.
            stride = di_strides[len(split.di_outputs) + k] if di_strides else None
            dw_examples.append(ti.with_strides(dw_placeholders[k].meta["val"], stride))
    dw_gm = split.dw_graph
    ti.mark_user_visible_outputs(dw_gm, range(len(split.dw_outputs)))
    run_dw = inner(dw_gm, dw_examples, **{**split_kwargs, "static_input_idxs": dw_static})

    build.graph = "fused"
    run_fused = inner(bw, list(example_inputs), **kwargs) if opts.fused_backward else None
    region = CompiledSplitBackward(split, run_di, run_dw, run_fused, name=name, input_is_tensor=is_tensor)
    _REGIONS[next(_region_serials)] = region
    log.info(
        "fxsplit: compiled %s with %s: %d input grads in dI, %d weight grads in dW, %d live-ins "
        "holding %s bytes%s",
        name, opts.compiler, len(split.di_outputs), len(split.dw_outputs), len(split.live_ins),
        split.live_in_bytes_expr,
        " (first stage: dI runs the activation-gradient chain)" if split.mode == "first_stage" else "",
    )
    build.graph = "aot"  # what remains is AOTAutograd's wrapping
    return region


def _compile_region(
    gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, build: _RegionBuild
) -> Callable[..., Any]:
    is_param = [isinstance(e, torch.nn.Parameter) for e in example_inputs]
    is_tensor = [isinstance(e, torch.Tensor) for e in example_inputs]
    inner = _inner_compile_for(opts)

    def inner_compile(g: fx.GraphModule, ex: Sequence[Any], **kw: Any) -> ti.BoxedCallable:
        if kw.get("is_backward"):
            return _compile_split_backward(g, ex, kw, is_param, is_tensor, opts, build)
        build.graph = "forward"
        compiled = inner(g, ex, **kw)
        build.graph = "aot"
        return compiled

    with ti.aot_config_for_split():
        return ti.compile_fx(gm, example_inputs, inner_compile)


def _fall_back(build: _RegionBuild, e: Exception, mode: str) -> None:
    """Raise :class:`FxsplitCompileError` (``mode == "error"``) or record the
    fallback and log one short warning; the full traceback goes to DEBUG."""
    record = FallbackRecord(build.name, build.graph, type(e).__name__, _first_line(e), ti.dynamo_compile_id())
    if mode == "error":
        raise FxsplitCompileError(
            f"fxsplit: {record}. fallback='eager' would run the region eagerly instead",
            region=build.name,
            graph=build.graph,
        ) from e
    with _REPORT_LOCK:
        _FALLBACKS.append(record)
    log.warning(
        "fxsplit: %s; running the region eagerly, where the eager split applies. "
        "See fxsplit.fallbacks(); the full traceback is logged at DEBUG level on the 'fxsplit' "
        "logger; fallback='error' raises instead.",
        record,
    )
    log.debug("fxsplit: %s failed", build.name, exc_info=e)


def backend(**options: Any) -> Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]:
    """A configured fxsplit backend: ``torch.compile(m, backend=fxsplit.backend(compiler="eager"))``.

    See :class:`BackendOptions` for the options.
    """
    opts = BackendOptions(**options)

    def fxsplit_backend_configured(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        mode = opts.resolved_fallback()
        # compile_fx may rewrite gm in place; keep a pristine graph to fall back on.
        pristine = fx.GraphModule(gm, copy.deepcopy(gm.graph)) if mode == "eager" else gm
        build = _RegionBuild(f"region{next(_region_ids)}")
        try:
            return _compile_region(gm, example_inputs, opts, build)
        except ti.dynamo_control_flow_exceptions():
            raise  # Dynamo steering its own compilation (restart, graph break): not a failure
        except Exception as e:
            _fall_back(build, e, mode)
            return pristine.forward

    fxsplit_backend_configured.options = opts  # type: ignore[attr-defined]
    return fxsplit_backend_configured


fxsplit_backend = backend()
"""The default backend, registered as ``backend="fxsplit"`` through the
``torch_dynamo_backends`` entry point; its fallback mode is ``fxsplit.config.fallback``."""
