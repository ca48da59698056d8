"""The ``fxsplit`` torch.compile backend.

Dynamo graph -> Inductor's pipeline (pre-grad passes, decompositions,
AOTAutograd, min-cut partitioner) -> the forward is compiled by the inner
compiler exactly as ``backend="inductor"`` does; the backward graph is split
by :func:`fxsplit.passes.split_backward` into a dI and a dW graph, each compiled by
the inner compiler, and wrapped in a :class:`~fxsplit.runtime.CompiledSplitBackward`.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fxsplit import _torch_internals as ti
from fxsplit.runtime import CompiledSplitBackward
from fxsplit.passes import split_backward

log = logging.getLogger("fxsplit")

__all__ = ["BackendOptions", "FxsplitCompileError", "backend", "fxsplit_backend", "compiled_regions"]

_COMPILERS = ("inductor", "eager")
_region_ids = itertools.count()
_region_serials = itertools.count()


class FxsplitCompileError(RuntimeError):
    """Compiling or splitting a region failed and ``fallback="error"`` was set."""


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
    fallback: ``"eager"`` (default): if a region cannot be compiled or split,
        log one warning and run it eagerly, where the eager split still
        applies; ``"error"``: raise :class:`FxsplitCompileError`.
    inductor_config: Inductor config patches (as ``torch.compile(options=...)``).
    """

    compiler: str = "inductor"
    fused_backward: bool = True
    fallback: str = "eager"
    inductor_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.compiler not in _COMPILERS:
            raise ValueError(f"fxsplit: compiler must be one of {_COMPILERS}, got {self.compiler!r}")
        if self.fallback not in ("eager", "error"):
            raise ValueError(f"fxsplit: fallback must be 'eager' or 'error', got {self.fallback!r}")


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
    name: str,
) -> CompiledSplitBackward:
    inner = _inner_compile_for(opts)
    split = split_backward(bw, _weight_outputs(bw, is_param))
    ti.declare_no_donated_buffers()
    log.debug("fxsplit: %s split:\n%s", name, split.describe())

    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    static = set(kwargs.get("static_input_idxs") or ())
    split_kwargs = dict(kwargs)
    if opts.compiler == "inductor":
        split_kwargs["cudagraphs"] = ti.no_cudagraphs()

    di_gm = split.di_graph
    ti.mark_user_visible_outputs(di_gm, range(len(split.di_outputs)))
    run_di = inner(di_gm, list(example_inputs), **{**split_kwargs, "static_input_idxs": sorted(static)})

    di_strides = ti.compiled_output_strides(run_di) if opts.compiler == "inductor" else None
    index_of = {p.name: k for k, p in enumerate(placeholders)}
    dw_examples: list[Any] = []
    dw_static: list[int] = []
    for k, live in enumerate(split.live_ins):
        if live.source == "input":
            dw_examples.append(example_inputs[index_of[live.name]])
            if index_of[live.name] in static:
                dw_static.append(k)
        else:
            node = next(n for n in bw.graph.nodes if n.name == live.name)
            # dW receives this live-in as compiled dI lays it out (Inductor may
            # pick e.g. channels-last for a conv gradient), not as traced.
            stride = di_strides[len(split.di_outputs) + k] if di_strides else None
            dw_examples.append(ti.with_strides(node.meta["val"], stride))
    dw_gm = split.dw_graph
    ti.mark_user_visible_outputs(dw_gm, range(len(split.dw_outputs)))
    run_dw = inner(dw_gm, dw_examples, **{**split_kwargs, "static_input_idxs": dw_static})

    run_fused = inner(bw, list(example_inputs), **kwargs) if opts.fused_backward else None
    region = CompiledSplitBackward(split, run_di, run_dw, run_fused, name=name, input_is_tensor=is_tensor)
    _REGIONS[next(_region_serials)] = region
    log.info(
        "fxsplit: compiled %s with %s: %d input grads in dI, %d weight grads in dW, %d live-ins",
        name, opts.compiler, len(split.di_outputs), len(split.dw_outputs), len(split.live_ins),
    )
    return region


def _compile_region(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions) -> Callable[..., Any]:
    name = f"region{next(_region_ids)}"
    is_param = [isinstance(e, torch.nn.Parameter) for e in example_inputs]
    is_tensor = [isinstance(e, torch.Tensor) for e in example_inputs]
    inner = _inner_compile_for(opts)

    def inner_compile(g: fx.GraphModule, ex: Sequence[Any], **kw: Any) -> ti.BoxedCallable:
        if kw.get("is_backward"):
            return _compile_split_backward(g, ex, kw, is_param, is_tensor, opts, name)
        return inner(g, ex, **kw)

    with ti.aot_config_for_split():
        return ti.compile_fx(gm, example_inputs, inner_compile)


def backend(**options: Any) -> Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]:
    """A configured fxsplit backend: ``torch.compile(m, backend=fxsplit.backend(compiler="eager"))``.

    See :class:`BackendOptions` for the options.
    """
    opts = BackendOptions(**options)

    def fxsplit_backend_configured(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        # compile_fx may rewrite gm in place; keep a pristine graph to fall back on.
        pristine = fx.GraphModule(gm, copy.deepcopy(gm.graph)) if opts.fallback == "eager" else gm
        try:
            return _compile_region(gm, example_inputs, opts)
        except Exception as e:
            if opts.fallback == "error":
                raise FxsplitCompileError(f"fxsplit: could not compile or split a region: {e}") from e
            log.warning(
                "fxsplit: could not compile or split a region (%s: %s); running it eagerly, "
                "where the eager split applies",
                type(e).__name__, e,
            )
            return pristine.forward

    fxsplit_backend_configured.options = opts  # type: ignore[attr-defined]
    return fxsplit_backend_configured


fxsplit_backend = backend()
"""The default backend, registered as ``backend="fxsplit"`` through the
``torch_dynamo_backends`` entry point."""
