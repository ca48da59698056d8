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

import contextlib
import copy
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxsplit import _logging, config
from fxsplit import _torch_internals as ti
from fxsplit.gradient_layout import GradientLayout, UnidentifiedGradients
from fxsplit.passes import SplitResult, split_backward
from fxsplit.passes.accumulate import accumulate_into
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
    "dW+accumulate": "compiling the dW graph that accumulates into .grad",
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
    mode: ``torch.compile``'s ``mode`` (``"default"``, ``"reduce-overhead"``,
        ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``), meaning what it
        means for ``backend="inductor"``: the Inductor options
        ``torch._inductor.list_mode_options(mode)`` names, under
        ``inductor_config``. ``torch.compile(m, backend="fxsplit", mode=...)``
        passes it here. CUDA graphs (``triton.cudagraphs``, which
        ``"reduce-overhead"`` and ``"max-autotune"`` turn on) apply to the
        forward and the fused backward as Inductor applies them, and to the
        dI and dW graphs through fxsplit's own capture
        (:mod:`fxsplit.cudagraphs`).
    inductor_config: Inductor config patches (``torch.compile(options=...)``,
        also accepted here as ``options=``): names and value types are
        checked as ``backend="inductor"`` checks them; they apply to every
        graph of the region (the pipeline's decompositions and partitioner
        included). With ``compiler="eager"`` no Inductor runs: options other
        than ``triton.cudagraphs`` have no effect there, which is said once.
    defer: what the dW graph defers. ``"matmuls"``: every weight-gradient
        matmul (and convolution, grouped matmul), while cheap weight reductions
        (bias gradients, LayerNorm/RMSNorm weight gradients) run in dI, fused
        with the kernels that produce their inputs, and only their small
        results wait for W; ``"all"``: every weight-gradient computation runs
        in dW, so B does none. ``None`` (default): ``fxsplit.config.defer``
        when the region compiles (``"matmuls"`` unless changed).
    lazy_compile: compile each backward graph when first used: the fused
        graph on the first ordinary backward, the dI/dW pair on the first
        split backward (B). ``False`` compiles all of them with the forward.
        Regions with symbolic sizes compile them with the forward under
        Inductor either way (it may add shape guards, which only the frame
        compile can install). ``None`` (default): ``fxsplit.config.lazy_compile``
        when the region compiles (``True`` unless changed).
    fused_accumulation: where a weight already has a ``.grad``, W adds its
        gradient into it inside the dW graph (the GEMM accumulates) rather
        than through autograd's accumulation, where nothing observable differs
        (see ``fxsplit.config.fused_accumulation``). ``False``: never, for this
        region's weights. ``None`` (default): ``fxsplit.config.fused_accumulation``
        when W runs.
    """

    compiler: str = "inductor"
    fused_backward: bool = True
    fallback: str | None = None
    inductor_config: dict[str, Any] | None = None
    mode: str | None = None
    defer: str | None = None
    lazy_compile: bool | None = None
    fused_accumulation: bool | None = None

    def __post_init__(self) -> None:
        if self.compiler not in _COMPILERS:
            raise ValueError(f"fxsplit: compiler must be one of {_COMPILERS}, got {self.compiler!r}")
        if self.fallback is not None and self.fallback not in config.FALLBACKS:
            raise ValueError(f"fxsplit: fallback must be one of {config.FALLBACKS} or None, got {self.fallback!r}")
        if self.defer is not None and self.defer not in config.DEFERS:
            raise ValueError(f"fxsplit: defer must be one of {config.DEFERS} or None, got {self.defer!r}")
        for name in ("lazy_compile", "fused_accumulation"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"fxsplit: {name} must be True, False or None, got {getattr(self, name)!r}")
        if self.inductor_config is not None and not isinstance(self.inductor_config, dict):
            raise TypeError(
                f"fxsplit: options (inductor_config) must be a dict of Inductor options, "
                f"got {type(self.inductor_config).__name__}"
            )
        self.inductor_patches()  # unknown modes and options raise here, before any compile

    def inductor_patches(self) -> dict[str, Any]:
        """The Inductor config this region compiles under: the mode's options,
        then ``inductor_config``, with names normalized (``-`` as ``_``).
        Raises ``ValueError`` for an unknown mode or option and ``TypeError``
        for a value of the wrong type, as ``backend="inductor"`` would."""
        return ti.inductor_patches(self.mode, self.inductor_config)

    @property
    def cudagraphs(self) -> bool:
        """Whether the region's graphs replay as CUDA graphs (``triton.cudagraphs``
        after the mode and the options), where they can."""
        return bool(self.inductor_patches().get("triton.cudagraphs", False))

    def resolved_fallback(self) -> str:
        """The fallback mode in force now: this option, else ``fxsplit.config.fallback``."""
        return self.fallback if self.fallback is not None else config.current_fallback()

    def resolved_defer(self) -> str:
        """The placement policy in force now: this option, else ``fxsplit.config.defer``."""
        return self.defer if self.defer is not None else config.current_defer()

    def resolved_lazy_compile(self) -> bool:
        """Whether graphs compile on first use: this option, else ``fxsplit.config.lazy_compile``."""
        return self.lazy_compile if self.lazy_compile is not None else config.current("lazy_compile")


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
_REPORTED_OPS: set[tuple[str, str]] = set()  # (how, op) said at WARNING
_REPORT_LOCK = threading.Lock()


def fallbacks() -> list[FallbackRecord]:
    """Every region that fell back to eager execution in this process (oldest first)."""
    with _REPORT_LOCK:
        return list(_FALLBACKS)


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _report_shared(name: str, split: SplitResult) -> None:
    """Say once per operator (per process) that it keeps weight work in B, and
    once per operator that its split rule computes other strides than it."""
    for shared in split.shared:
        if shared.how == "unsplit":
            message = (
                "fxsplit: %s: %s returns input and weight gradients from one call and has no split rule; it runs "
                "whole in dI, so B does its weight-gradient work (outputs %s). Declare one with "
                "fxsplit.register_split_rule(%r, ...)."
            )
            args = (name, shared.op, list(shared.dw_outputs), shared.op)
        elif shared.other_strides:
            message = (
                "fxsplit: %s: the split rule for %s computes its outputs %s in other strides than the op; a weight "
                "gradient out of its weight's layout is copied by autograd at W. A rule's outputs should have the "
                "op's strides (fxsplit.rules)."
            )
            args = (name, shared.op, list(shared.other_strides))
        else:
            continue
        with _REPORT_LOCK:
            first = (shared.how, shared.op) not in _REPORTED_OPS
            _REPORTED_OPS.add((shared.how, shared.op))
        log.log(logging.WARNING if first else logging.DEBUG, message, *args)


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

    patches = opts.inductor_patches()

    def inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], **kw: Any) -> ti.BoxedCallable:
        if patches:
            from torch._inductor import config as inductor_config

            with inductor_config.patch(patches):
                return ti.inductor_compile_graph(gm, example_inputs, **kw)
        return ti.inductor_compile_graph(gm, example_inputs, **kw)

    return inductor


def _gradient_layout(bw: fx.GraphModule, is_tensor: Sequence[bool]) -> GradientLayout:
    """Which forward input each backward output is (part of) the gradient of,
    from AOTAutograd's descriptors. Raises :class:`FxsplitCompileError` when
    the graph has none, or names a gradient whose input cannot be told: then
    weight gradients cannot be told from input gradients, and a split could
    leave weight-gradient work in B."""
    parts = ti.backward_output_parts(bw)
    if parts is None:
        raise FxsplitCompileError(
            "fxsplit: the backward graph carries no AOTAutograd descriptors; cannot tell "
            "weight gradients from input gradients"
        )
    try:
        return GradientLayout.from_parts(parts, is_tensor)
    except UnidentifiedGradients as e:
        raise FxsplitCompileError(f"fxsplit: {e}") from None


def _check_no_weight_matmul_in_di(split: SplitResult) -> None:
    """Refuse a split whose dI graph would run a weight-gradient matmul (B must
    do none): raised as a compile failure, so the region falls back (one
    warning) or, under ``fallback="error"``, raises at compile time."""
    found = split.weight_contractions_in_di
    if found:
        raise FxsplitCompileError(
            f"fxsplit: the split would leave {len(found)} weight-gradient matmul(s) in dI "
            f"({', '.join(found[:4])}{' ...' if len(found) > 4 else ''}): B would do weight-gradient work"
        )


class _RegionGraphs:
    """The dI, dW, fused and accumulating dW graphs of one region, compiled on
    demand (:class:`fxsplit.runtime.RegionGraphs`).

    A deferred compile runs in the context the region's other graphs were
    compiled in, captured while Dynamo compiled the frame, as AOTAutograd's
    own lazy backward compile does (``_AutogradBackwardCompiler.get_or_compile``):
    the ``TracingContext`` (fake mode, shape environment), the
    ``CompileContext`` (compile id), autocast off if the region was traced
    under autocast, the AOTAutograd settings of the split, and a snapshot of
    Inductor's config, so the result is the compile that would have happened
    then. A compile that would add shape guards cannot have them checked any
    more (Dynamo installed the frame's guards already): it is refused like a
    failed compile. Such regions (symbolic sizes under Inductor) are therefore
    compiled when the frame compiles (see ``_compile_split_backward``).

    A failed compile raises :class:`FxsplitCompileError` (``fallback="error"``)
    or, after one warning, runs that graph uncompiled, op by op: the region
    stays split, so B and W are still correct.
    """

    def __init__(
        self,
        name: str,
        opts: BackendOptions,
        mode: str,
        bw: fx.GraphModule,
        split: SplitResult,
        example_inputs: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> None:
        self.name = name
        self.compile_seconds: dict[str, float] = {}
        self._opts = opts
        self._mode = mode
        self._inner = _inner_compile_for(opts)
        self._bw = bw
        self._split = split
        self._examples = list(example_inputs)
        self._kwargs = kwargs
        self._static = set(kwargs.get("static_input_idxs") or ())
        self._split_kwargs = dict(kwargs)
        if opts.compiler == "inductor":
            self._split_kwargs["cudagraphs"] = ti.no_cudagraphs()
        self._context = ti.capture_compile_context() if opts.compiler == "inductor" else None
        self._run_di: ti.BoxedCallable | None = None
        self._dw_examples: list[Any] | None = None
        self._dw_static: list[int] = []
        # Set while the frame compiles: a failure then is the whole region's
        # (it runs eagerly), not one graph's.
        self.frame_build: _RegionBuild | None = None

    @property
    def dynamic(self) -> bool:
        """Whether the backward has symbolic sizes (its inputs carry SymInts)."""
        return any(ti.is_symbolic(e) for e in self._examples)

    @contextlib.contextmanager
    def _compiling(self) -> Iterator[None]:
        """The context of a compile: the frame compile's own while it runs,
        else the one captured then. Refuses a later compile that adds shape
        guards (Dynamo could no longer check them)."""
        if self.frame_build is not None or self._context is None:
            yield
            return
        with ti.restored_compile_context(self._context):
            before = ti.shape_guard_count()
            yield
            added = ti.shape_guard_count()
            if before is not None and added is not None and added > before:
                raise RuntimeError(
                    f"compiling it after the frame compile added {added - before} shape guard(s) Dynamo cannot "
                    "check any more; compile with lazy_compile=False"
                )

    def compile(self, kind: str) -> ti.BoxedCallable:
        frame = self.frame_build
        if frame is not None:
            frame.graph = kind  # a failure during the frame compile is the region's (see _compile_region)
        try:
            with self._compiling():
                t0 = time.perf_counter()
                fn = {"dI": self._compile_di, "dW": self._compile_dw, "fused": self._compile_fused}[kind]()
                self.compile_seconds[kind] = time.perf_counter() - t0
            return fn
        except Exception as e:
            if frame is not None:
                raise
            _fall_back(_RegionBuild(self.name, kind), e, self._mode, consequence="graph")
            gm = {"dI": self._split.di_graph, "dW": self._split.dw_graph, "fused": self._bw}[kind]
            return ti.boxed(gm.forward)

    def _compile_di(self) -> ti.BoxedCallable:
        di_gm = self._split.di_graph
        ti.mark_user_visible_outputs(di_gm, range(len(self._split.di_outputs)))
        self._run_di = self._inner(
            di_gm, list(self._examples), **{**self._split_kwargs, "static_input_idxs": sorted(self._static)}
        )
        return self._run_di

    def forward_cudagraphs_notice(self) -> Callable[[], None] | None:
        """What B must call each time dI runs when the forward replays through
        Inductor's cudagraph trees (:func:`fxsplit._torch_internals.cudagraph_trees_notice`), or ``None``."""
        return ti.cudagraph_trees_notice(self._kwargs) if self._opts.compiler == "inductor" else None

    def _dw_inputs(self) -> tuple[list[Any], list[int]]:
        """Example inputs of the dW graph (as compiled dI lays its live-ins out) and its static inputs."""
        if self._dw_examples is None:
            split = self._split
            placeholders = [n for n in self._bw.graph.nodes if n.op == "placeholder"]
            di_strides = (
                ti.compiled_output_strides(self._run_di)
                if self._opts.compiler == "inductor" and self._run_di is not None
                else None
            )
            index_of = {p.name: k for k, p in enumerate(placeholders)}
            dw_placeholders = split.dw_graph.graph.find_nodes(op="placeholder")
            examples: list[Any] = []
            static: list[int] = []
            for k, live in enumerate(split.live_ins):
                if live.source == "input":
                    examples.append(self._examples[index_of[live.name]])
                    if index_of[live.name] in self._static:
                        static.append(k)
                else:
                    # dW receives this live-in as compiled dI lays it out (Inductor may
                    # pick e.g. channels-last for a conv gradient), not as traced. A
                    # SymInt live-in is its traced value: an expression of the same
                    # shape environment, bound by the SymInt live-ins beside it.
                    stride = di_strides[len(split.di_outputs) + k] if di_strides else None
                    examples.append(ti.with_strides(dw_placeholders[k].meta["val"], stride))
            self._dw_examples, self._dw_static = examples, static
        return self._dw_examples, self._dw_static

    def di_boundary(self) -> tuple[list[Any], list[str], list[bool]]:
        """What the consumers of the compiled dI graph's outputs were compiled
        for, position by position (:class:`fxsplit.layouts.BoundaryGuard`):
        autograd takes the input gradients (their shape and dtype matter), the
        dW graph the live-ins, as :meth:`_dw_inputs` laid them out (strides too)."""
        split = self._split
        outs = self._bw.graph.output_node().args[0]
        expected: list[Any] = [
            outs[i].meta.get("val") if isinstance(outs[i], fx.Node) else None for i in split.di_outputs
        ]
        names = [f"the gradient of input {i}" for i in split.di_outputs]
        strides = [False] * len(expected)
        examples, _ = self._dw_inputs()
        # A live-in that is one of the backward's inputs passes through dI
        # untouched: it is what dW was compiled for already. A symbolic size
        # among them is not checked: it tells the guard its symbol's value.
        expected += [e if live.source == "dI" or not isinstance(e, torch.Tensor) else None
                     for e, live in zip(examples, split.live_ins)]
        names += [f"live-in {live.name}" for live in split.live_ins]
        strides += [True] * len(examples)
        return expected, names, strides

    def _compile_dw(self) -> ti.BoxedCallable:
        examples, static = self._dw_inputs()
        dw_gm = self._split.dw_graph
        ti.mark_user_visible_outputs(dw_gm, range(len(self._split.dw_outputs)))
        return self._inner(dw_gm, list(examples), **{**self._split_kwargs, "static_input_idxs": static})

    def _compile_fused(self) -> ti.BoxedCallable:
        return self._inner(self._bw, list(self._examples), **self._kwargs)

    def compile_accumulating(
        self, positions: tuple[int, ...], grads: Sequence[torch.Tensor]
    ) -> ti.BoxedCallable | None:
        if self._opts.compiler == "inductor" and self.dynamic:
            return None  # its shape guards could not be installed any more (see the class docstring)
        build = _RegionBuild(self.name, "dW+accumulate")
        try:
            with self._compiling():
                t0 = time.perf_counter()
                gm = accumulate_into(self._split.dw_graph, positions, matmul_into=ti.ADDMM_INTO,
                                    brackets=(ti.ACCUMULATION_BEGINS, ti.ACCUMULATION_ENDS))
                examples, static = self._dw_inputs()
                examples = list(examples) + [ti.fake_like(g, examples) for g in grads]
                outs = self._split.dw_outputs
                ti.mark_user_visible_outputs(gm, [k for k in range(len(outs)) if k not in positions])
                fn = self._inner(gm, examples, **{**self._split_kwargs, "static_input_idxs": static})
                self.compile_seconds["dW+accumulate"] = (
                    self.compile_seconds.get("dW+accumulate", 0.0) + time.perf_counter() - t0
                )
            return fn
        except Exception as e:
            _fall_back(build, e, self._mode, consequence="accumulate")
            return None


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
    build.graph = "split"
    layout = _gradient_layout(bw, is_tensor)
    if layout.subclass_inputs and not ti.subclass_regions_supported():
        raise FxsplitCompileError(
            f"fxsplit: the region has tensor-subclass (DTensor) inputs, which split regions support from "
            f"torch 2.13 (AOTAutograd's per-class backward epilogue); this is torch {torch.__version__}"
        )
    split = split_backward(bw, layout.weight_outputs(is_param), rule=trace_split_rule, defer=opts.resolved_defer())
    _check_no_weight_matmul_in_di(split)
    ti.declare_no_donated_buffers()
    log.debug("fxsplit: %s split:\n%s", name, split.describe())
    _report_shared(name, split)
    _logging.publish_split(name, split)  # fxsplit_graphs artifact and structured trace

    graphs = _RegionGraphs(name, opts, opts.resolved_fallback(), bw, split, example_inputs, kwargs)
    region = CompiledSplitBackward(
        split,
        graphs,
        name=name,
        layout=layout,
        fused_backward=opts.fused_backward,
        fused_accumulation=opts.fused_accumulation,
        cudagraphs=opts.cudagraphs,
    )
    # Compile every graph now when a later compile could not be trusted:
    # Inductor may add shape guards while compiling a graph with symbolic
    # sizes, and only a compile inside the frame's compile gets them installed
    # (AOTAutograd compiles such backwards eagerly for the same reason).
    eager = not opts.resolved_lazy_compile() or (opts.compiler == "inductor" and graphs.dynamic)
    if eager:
        graphs.frame_build = build
        try:
            region.compile("dI", "dW", *(("fused",) if opts.fused_backward else ()))
        finally:
            graphs.frame_build = None
    _REGIONS[next(_region_serials)] = region
    log.info(
        "fxsplit: compiled %s with %s: %d input grads in dI, %d weight grads in dW%s, %d live-ins "
        "holding %s bytes%s%s",
        name, opts.compiler, len(split.di_outputs), len(region.weight_grads),
        f" ({sum(g.subclass for g in region.weight_grads)} of them DTensors or other tensor subclasses; "
        f"{len(split.dw_outputs)} outputs)" if any(g.subclass for g in region.weight_grads) else "",
        len(split.live_ins), split.live_in_bytes_expr,
        " (first stage: dI runs the activation-gradient chain)" if split.mode == "first_stage" else "",
        "" if eager else "; its backward graphs compile on first use",
    )
    build.graph = "aot"  # what remains is AOTAutograd's wrapping
    return region


def _compile_region(
    gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, build: _RegionBuild
) -> Callable[..., Any]:
    is_param = [isinstance(e, torch.nn.Parameter) for e in example_inputs]
    is_tensor = [isinstance(e, torch.Tensor) for e in example_inputs]
    inner = _inner_compile_for(opts)
    ti.watch_node_hooks()  # before the region's first node exists (see fxsplit.api._direct_call)

    def inner_compile(g: fx.GraphModule, ex: Sequence[Any], **kw: Any) -> ti.BoxedCallable:
        if kw.get("is_backward"):
            return _compile_split_backward(g, ex, kw, is_param, is_tensor, opts, build)
        build.graph = "forward"
        compiled = inner(g, ex, **kw)
        build.graph = "aot"
        return compiled

    with ti.aot_config_for_split(), ti.inductor_config_patched(opts.inductor_patches()):
        return ti.compile_fx(gm, example_inputs, inner_compile)


# What a fallback does, by what failed: the whole region at frame compile, one
# graph compiled on first use, or the dW graph that accumulates into .grad.
_CONSEQUENCES = {
    "region": "running the region eagerly, where the eager split applies",
    "graph": "running that graph uncompiled, op by op (the region is still split)",
    "accumulate": "accumulating those gradients through autograd",
}


def _fall_back(build: _RegionBuild, e: Exception, mode: str, consequence: str = "region") -> None:
    """Raise :class:`FxsplitCompileError` (``mode == "error"``) or record the
    fallback and log one short warning; the full traceback goes to DEBUG."""
    record = FallbackRecord(build.name, build.graph, type(e).__name__, _first_line(e), ti.dynamo_compile_id())
    what = _CONSEQUENCES[consequence]
    if mode == "error":
        raise FxsplitCompileError(
            f"fxsplit: {record}. fallback='eager' would be {what} instead",
            region=build.name,
            graph=build.graph,
        ) from e
    with _REPORT_LOCK:
        _FALLBACKS.append(record)
    log.warning(
        "fxsplit: %s; %s. "
        "See fxsplit.fallbacks(); the full traceback is logged at DEBUG level on the 'fxsplit' "
        "logger; fallback='error' raises instead.",
        record, what,
    )
    log.debug("fxsplit: %s failed", build.name, exc_info=e)


_WARNED_EAGER_OPTIONS: set[tuple[Any, ...]] = set()


def _with_compile_arguments(opts: BackendOptions, mode: str | None, options: dict[str, Any] | None) -> BackendOptions:
    """``opts`` with ``torch.compile``'s ``mode=`` / ``options=`` applied
    (``options`` over the backend's own ``inductor_config``)."""
    if mode in (None, "default") and not options:
        return opts
    merged = {**(opts.inductor_config or {}), **(options or {})} if options else opts.inductor_config
    return dataclasses.replace(opts, mode=mode if mode not in (None, "default") else opts.mode, inductor_config=merged)


def _say_ineffective_options(opts: BackendOptions) -> None:
    """compiler="eager" runs no Inductor: say once which options do nothing."""
    if opts.compiler != "eager":
        return
    ignored = sorted(k for k in opts.inductor_patches() if k != "triton.cudagraphs")
    key = (opts.mode, tuple(ignored))
    if ignored and key not in _WARNED_EAGER_OPTIONS:
        _WARNED_EAGER_OPTIONS.add(key)
        log.warning(
            "fxsplit: compiler='eager' runs the split graphs without Inductor: the Inductor options %s%s "
            "have no effect", ", ".join(ignored), f" (from mode={opts.mode!r})" if opts.mode else "",
        )


def backend(**options: Any) -> Callable[..., Callable[..., Any]]:
    """A configured fxsplit backend: ``torch.compile(m, backend=fxsplit.backend(compiler="eager"))``.

    See :class:`BackendOptions` for the options; ``options=`` is accepted as
    another name for ``inductor_config`` (as ``torch.compile`` names it). The
    backend also takes ``torch.compile``'s ``mode=`` and ``options=`` when
    Dynamo passes them (``torch.compile(m, backend="fxsplit", mode="reduce-overhead")``),
    applied over its own.
    """
    if "options" in options:
        if options.get("inductor_config") is not None:
            raise ValueError("fxsplit: give Inductor options once, as options= or as inductor_config=, not both")
        options["inductor_config"] = options.pop("options")
    base = BackendOptions(**options)

    def fxsplit_backend_configured(
        gm: fx.GraphModule, example_inputs: list[Any], *, mode: str | None = None, options: dict[str, Any] | None = None
    ) -> Callable[..., Any]:
        # torch.compile's mode=/options=: a bad one is the caller's error, raised
        # as such (not a fallback).
        opts = _with_compile_arguments(base, mode, options)
        _say_ineffective_options(opts)
        fallback = opts.resolved_fallback()
        # compile_fx may rewrite gm in place; keep a pristine graph to fall back on.
        pristine = fx.GraphModule(gm, copy.deepcopy(gm.graph)) if fallback == "eager" else gm
        build = _RegionBuild(f"region{next(_region_ids)}")
        try:
            return _compile_region(gm, example_inputs, opts, build)
        except ti.dynamo_control_flow_exceptions():
            raise  # Dynamo steering its own compilation (restart, graph break): not a failure
        except Exception as e:
            _fall_back(build, e, fallback)
            return pristine.forward

    fxsplit_backend_configured.options = base  # type: ignore[attr-defined]
    return fxsplit_backend_configured


fxsplit_backend = backend()
"""The default backend, registered as ``backend="fxsplit"`` through the
``torch_dynamo_backends`` entry point; its fallback mode is ``fxsplit.config.fallback``."""
