"""Every private PyTorch API fxsplit relies on, in one place.

AOTAutograd, Inductor and autograd-engine internals change between releases.
Each helper below names what it relies on, so supporting a new torch release
means reading (and, if needed, changing) this file only. Tested on CPU:
torch 2.13.0 (CI; the whole suite, 579 passed), 2.11.0 (the whole suite,
543 passed, 36 skipped: goldens pinned to 2.13.0, and upstream failures,
pytorch/pytorch#166577 and the V-shaped schedules with gloo) and 2.15.0
(docs/development.md, "Torch versions", has the commands and counts). Differences
between releases handled here are feature-detected:
:func:`function_nodes_outlive_their_graph` (torch 2.11),
:func:`_fsdp_state_param_groups` (torch 2.11),
:func:`fsdp_has_manual_backward_finalization` (torch 2.15),
:func:`keep_saved_through_detach` (``SavedTensor.data``/``unpack_hook``/``unpack``: not on torch 2.11),
:func:`subclass_regions_supported` (DTensor regions: not on torch 2.11).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import operator
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch._dynamo.compiled_autograd as _compiled_autograd
import torch.fx as fx

BoxedCallable = Callable[[list[Any]], Any]


@contextlib.contextmanager
def aot_config_for_split() -> Iterator[None]:
    """AOTAutograd settings the split needs while a region is compiled.

    * ``force_non_lazy_backward_lowering``: the backward is compiled (and so
      split) at forward-compile time, inside the tracing context, and the
      autograd node carries our runtime from the first call on
      (``CompiledFunction.compiled_bw``).
    * ``donated_buffer=True`` (AOTAutograd's default), so that AOTAutograd
      computes the region's donated-buffer list, which
      :func:`declare_no_donated_buffers` then empties: fxsplit's graphs
      donate nothing (see there).
    * ``enable_autograd_cache=False``: the AOTAutograd cache would store and
      replay Inductor's fused backward without our split.
    """
    import torch._functorch.config as functorch_config

    with functorch_config.patch(
        force_non_lazy_backward_lowering=True,
        donated_buffer=True,
        enable_autograd_cache=False,
    ):
        yield


def declare_no_donated_buffers() -> None:
    """Make the region being compiled donate no buffers to its backward.

    A donated buffer is a saved activation whose storage Inductor may reuse
    inside the backward. fxsplit's dI graph must not clobber a value the dW
    graph still reads, and B runs with ``retain_graph=True`` when eager code
    needs it, which AOTAutograd's runtime check refuses when buffers were
    donated (``runtime_wrappers.py``, ``_backward_impl``:
    ``config.donated_buffer and not saved_tensors_use_once and
    fw_metadata.bw_donated_idxs != []``).

    Empties, in place, the list AOTAutograd computed for the region
    (``_categorize_saved_tensors_for_backward`` in ``graph_compile.py``,
    under ``donated_buffer=True``: :func:`aot_config_for_split`). Relies on
    ``TracingContext.fw_metadata.bw_donated_idxs`` being what Inductor reads
    when it compiles our graphs (``torch._inductor.utils.get_donated_idxs``)
    and the same list object as the one the runtime check reads: for a plain
    region ``TracingContext.fw_metadata`` is that metadata; for a region with
    tensor-subclass inputs (DTensor weights) it is the inner graph's, which
    AOTAutograd gives the outer metadata's list (``inner_meta.bw_donated_idxs
    = fw_metadata.bw_donated_idxs``). So ordinary backward with
    ``retain_graph=True`` works through every fxsplit region.
    """
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    if meta is None:
        return
    donated = getattr(meta, "bw_donated_idxs", None)
    if isinstance(donated, list):
        donated.clear()  # in place: the outer metadata of a subclass region holds this list too
    else:
        meta.bw_donated_idxs = []


def compile_fx(gm: fx.GraphModule, example_inputs: Sequence[Any], inner_compile: Callable[..., Any]) -> Any:
    """Inductor's whole pipeline (pre-grad passes, decompositions, AOTAutograd,
    min-cut partitioner) with our ``inner_compile`` called once for the forward
    and once, with ``is_backward=True``, for the backward graph.
    Relies on: ``torch._inductor.compile_fx.compile_fx(inner_compile=...)``."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    return _compile_fx(gm, example_inputs, inner_compile=inner_compile)


def inductor_compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> BoxedCallable:
    """Compile one post-partition graph with Inductor (Triton on CUDA, C++ on CPU).
    Relies on: ``torch._inductor.compile_fx.compile_fx_inner`` and its keyword
    arguments (``static_input_idxs``, ``cudagraphs``, ``is_backward``, ...)."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, **kwargs)


def generated_call(compiled: Any) -> BoxedCallable | None:
    """The code Inductor generated for a compiled graph, called without the
    ``CompiledFxGraph`` around it, or ``None`` where ``compiled`` is not an
    Inductor graph (the eager compiler's, a test's replacement). Relies on
    ``CompiledFxGraph.current_callable`` (``output_code.py``: what its
    ``__call__`` calls, a CUDA-graph replay where Inductor added one), and on
    that ``__call__`` doing nothing else a later call needs: on torch 2.11-2.15
    the rest is the profiler's record of the call and the execution-order
    debug record (both checked by :func:`graph_calls_observed` before each
    call), runtime metrics and the autotune-cache bundle, which the first call
    (always made through ``__call__``) completes. ``tests/test_layouts.py``
    checks the profiler sees every call."""
    global _INDUCTOR_DEBUG
    from torch._inductor.output_code import CompiledFxGraph

    if type(compiled) is not CompiledFxGraph:
        return None
    from torch._inductor import debug

    inner = getattr(compiled, "current_callable", None)
    _INDUCTOR_DEBUG = debug  # (read by graph_calls_observed before any inner call)
    return inner if callable(inner) else None


_INDUCTOR_DEBUG: Any = None  # torch._inductor.debug, once generated_call has handed out a graph


def graph_calls_observed() -> bool:
    """Whether something records each compiled graph call: the autograd
    profiler (``torch.autograd.profiler._is_profiler_enabled``, checked by
    ``CompiledFxGraph.__call__`` for its ``## Call CompiledFxGraph`` event)
    or Inductor's execution-order record (``torch._inductor.debug.
    RECORD_GRAPH_EXECUTION``). Then graphs are called through
    ``CompiledFxGraph.__call__`` (:func:`generated_call`)."""
    return bool(torch.autograd.profiler._is_profiler_enabled or getattr(_INDUCTOR_DEBUG, "RECORD_GRAPH_EXECUTION", False))


def inductor_patches(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """The Inductor config ``torch.compile(backend="inductor", mode=mode, options=options)``
    compiles under: ``list_mode_options(mode)``, then ``options``, each name
    normalized (``-`` to ``_``) and checked against Inductor's config (names
    and value types), as ``torch._TorchCompileInductorWrapper.apply_options``
    checks them. Raises ``ValueError`` (unknown mode or option) or
    ``TypeError`` (a value of the wrong type).
    Relies on: ``torch._inductor.list_mode_options``, ``config.get_config_copy``,
    ``config.get_type``."""
    from typing import get_origin

    from torch._inductor import config, list_mode_options

    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        try:
            patches.update(list_mode_options(mode))
        except RuntimeError as e:
            raise ValueError(f"fxsplit: {e}") from None
    if not options:
        return patches
    known = config.get_config_copy()
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ValueError(
                f"fxsplit: unknown Inductor option {key!r} (options are torch._inductor.config's names, "
                "as for torch.compile(options=...))"
            )
        expected = config.get_type(name)  # type: ignore[attr-defined]
        if get_origin(expected) is None and isinstance(expected, type) and not isinstance(value, expected):
            raise TypeError(
                f"fxsplit: Inductor option {key!r} takes a {type(known[name]).__name__}, got {type(value).__name__}"
            )
        patches[name] = value
    return patches


def inductor_config_patched(patches: dict[str, Any]) -> Any:
    """Inductor's config patched with ``patches`` for a block (nothing when empty)."""
    if not patches:
        return contextlib.nullcontext()
    from torch._inductor import config

    return config.patch(patches)


def cudagraph_trees_notice(compile_kwargs: dict[str, Any]) -> Callable[[], None] | None:
    """What a backward that runs outside Inductor's cudagraph trees must call
    each time it runs, when its forward replays through them, or ``None``.

    The trees free the outputs of earlier forwards when a new "generation"
    starts, unless forwards are waiting for their backward; a backward
    compiled without CUDA graphs tells them it runs, as Inductor's own does
    (``output_code.maybe_handle_backward_generation``:
    ``get_manager(boxed_forward_device_index.value).set_to_running_backward()``).
    Relies on: ``boxed_forward_device_index`` in the backward's compile
    kwargs (set when the forward was cudagraphified),
    ``torch._inductor.cudagraph_trees.get_manager``."""
    box = compile_kwargs.get("boxed_forward_device_index")
    index = getattr(box, "value", None)
    if index is None:
        return None
    from torch._inductor import config

    if not config.triton.cudagraph_trees:
        return None
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(index, create_if_none_exists=False)
    return None if manager is None else manager.set_to_running_backward


def tangent_positions(gm: fx.GraphModule) -> list[int]:
    """Positions of a backward graph's inputs that are output gradients.
    Relies on AOTAutograd naming them ``tangents_<n>`` (the saved activations
    and symbols have other names)."""
    return [k for k, p in enumerate(gm.graph.find_nodes(op="placeholder")) if p.name.startswith("tangents")]


def no_cudagraphs() -> Any:
    """A ``cudagraphs`` argument for ``compile_fx_inner`` that turns them off.
    Split graphs exchange live-ins and must not be captured in CUDA graphs."""
    from torch._inductor.utils import BoxedBool

    return BoxedBool(False)


def boxed(fn: Callable[..., Any]) -> BoxedCallable:
    """Mark ``fn(*args)`` as taking one list argument, AOTAutograd's "boxed" convention.
    Relies on: ``functorch.compile.make_boxed_func``."""
    from functorch.compile import make_boxed_func

    return make_boxed_func(fn)


@dataclasses.dataclass(frozen=True)
class GradientPart:
    """What one backward output is: (part of) the gradient of forward input
    ``input_index``, or ``None`` there when the descriptor names a gradient
    whose input fxsplit cannot tell (see :func:`backward_output_parts`).

    ``part`` is ``""`` for a plain tensor's gradient; for a tensor subclass
    (a DTensor parameter), whose gradient AOTAutograd returns flattened, the
    attribute path of this piece: ``"._local_tensor"``, ``".device_mesh"``,
    ``".size(0)"``. ``desc`` is AOTAutograd's expression for it, for messages.
    """

    input_index: int | None
    part: str
    desc: str


def backward_output_parts(bw: fx.GraphModule) -> list[GradientPart | None] | None:
    """For each backward output, which forward input's gradient it is (part of).

    Relies on AOTAutograd's descriptors (``_aot_autograd/descriptors.py``):
    ``output_node.meta["desc"]`` holds one descriptor per output. A plain
    gradient is ``GradAOTOutput(grad_of=PlainAOTInput(idx))``; a subclass
    gradient (a DTensor weight's) is flattened into one output per attribute
    (and symbolic size or stride), each described as
    ``SubclassGetAttrAOTOutput`` / ``SubclassSizeAOTOutput`` /
    ``SubclassStrideAOTOutput`` around such a ``GradAOTOutput`` (nested for
    nested subclasses). ``idx`` counts the compiled region's (Dynamo graph's)
    inputs.

    Returns ``None`` if the graph carries no descriptors. An entry is ``None``
    for an output that is no gradient (a ``None`` output, an effect token); a
    :class:`GradientPart` with ``input_index=None`` for a gradient whose input
    cannot be told (a view or synthetic base standing for several inputs, or a
    descriptor this torch added); otherwise its input and part.
    """
    from torch._functorch._aot_autograd import descriptors as d

    out = bw.graph.output_node()
    descs = out.meta.get("desc")
    rets = out.args[0] if out.args else ()
    if not isinstance(descs, (list, tuple)) or not isinstance(rets, (list, tuple)) or len(descs) != len(rets):
        return None
    wrappers = (d.SubclassGetAttrAOTOutput, d.SubclassSizeAOTOutput, d.SubclassStrideAOTOutput)
    result: list[GradientPart | None] = []
    for desc, ret in zip(descs, rets):
        if desc is None:
            # No descriptor for a value the graph returns: nothing says what it is.
            result.append(None if ret is None else GradientPart(None, "", "an output without descriptor"))
            continue
        base, part = desc, ""
        while isinstance(base, wrappers):
            if isinstance(base, d.SubclassGetAttrAOTOutput):
                part = f".{base.attr}{part}"
            else:
                kind = "size" if isinstance(base, d.SubclassSizeAOTOutput) else "stride"
                part = f".{kind}({base.idx}){part}"
            base = base.base
        if not isinstance(base, d.GradAOTOutput):
            result.append(None)  # not a gradient (effect tokens, RNG offsets)
            continue
        grad_of = base.grad_of
        index = grad_of.idx if type(grad_of) is d.PlainAOTInput and isinstance(grad_of.idx, int) else None
        result.append(GradientPart(index, part, desc.expr()))
    return result


# -- tensor-subclass (DTensor) gradients of a compiled region (used by fxsplit.runtime) -----------
# A region with tensor-subclass inputs or outputs (DTensor parameters under
# tensor parallelism) runs its backward graph on the subclasses' inner
# tensors: AOTAutograd's autograd node unwraps the output gradients before
# calling the compiled backward and wraps the flat outputs it returns into
# one gradient per forward input after (``_codegen_backward_epilogue`` in
# ``runtime_wrappers.py``, from ``SubclassMeta.grad_input_metas``: one
# ``PlainTensorMeta`` or ``SubclassCreationMeta`` per forward input).
_TOLERANT_EPILOGUE = "_fxsplit_tolerates_missing_gradients"


def _subclass_grad_metas(node: Any) -> list[Any] | None:
    cls = getattr(node, "_forward_cls", None)
    meta = getattr(cls, "maybe_subclass_metadata", None)
    return None if meta is None else list(meta.grad_input_metas or ())


class SubclassGradients:
    """Builds the gradient of a forward input from a region's flat backward
    outputs, as AOTAutograd's epilogue does: a subclass gradient from its
    pieces (``SubclassCreationMeta.creation_fn(flat, is_runtime=True)``, what
    ``wrap_tensor_subclasses`` calls: a DTensor with the placements, shape and
    stride ordinary backward gives it, e.g. ``Partial`` for a sequence-parallel
    norm weight), a plain one as it is. Relies on the node's
    ``_forward_cls.maybe_subclass_metadata.grad_input_metas``."""

    __slots__ = ("_metas",)

    def __init__(self, metas: Sequence[Any]) -> None:
        self._metas = tuple(metas)

    @classmethod
    def of(cls, node: Any) -> SubclassGradients | None:
        """The builder for region ``node``'s gradients; ``None`` for a region without subclass gradients."""
        metas = _subclass_grad_metas(node)
        return None if metas is None else cls(metas)

    def gradient(self, input_index: int, flat: Sequence[Any]) -> Any:
        """The gradient of forward input ``input_index`` from ``flat``, the
        backward's outputs at their positions (``None`` where a piece is
        missing: then the gradient is ``None``)."""
        meta = self._metas[input_index]
        if type(meta).__name__ != "SubclassCreationMeta":
            return flat[meta.unwrapped_idx]
        start, count = meta.flat_tensor_start_idx, meta.arg_count
        if any(v is None for v in flat[start:start + count]):
            return None
        return meta.creation_fn(flat, is_runtime=True)


def subclass_regions_supported() -> bool:
    """Whether this torch can run split regions with tensor-subclass (DTensor)
    gradients: AOTAutograd's ``CompiledFunction`` must read its backward epilogue
    from the class (``_bw_epilogue_fn``, built by
    ``runtime_wrappers._codegen_backward_epilogue``: torch 2.13 and 2.15 have it,
    2.11 does not), so that :func:`let_backward_leave_subclass_gradients_out`
    can replace it for one region."""
    from torch._functorch._aot_autograd import runtime_wrappers

    return hasattr(runtime_wrappers, "_codegen_backward_epilogue")


_ROUTED = "_fxsplit_routed"


def route_backward_of(node: Any, route: Callable[..., Any]) -> None:
    """Make autograd run region ``node``'s nodes (its class's) through
    ``route(node, grads, wrapped, args)``, ``wrapped(node, *args)`` being the
    call autograd makes now: ``BackwardCFunction.apply`` (a direct call, and
    the engine where grads are not boxed) and ``apply_boxed`` (the engine on
    a torch whose AOTAutograd takes its gradients boxed, as one list).
    Installed once per region class, before the first split backward
    through it. Relies on the engine looking the node's ``apply`` /
    ``apply_boxed`` up on the node object."""
    cls = type(node)
    if cls.__dict__.get(_ROUTED, False):
        return
    apply = cls.apply

    def routed_apply(self: Any, *grads: Any) -> Any:
        return route(self, grads, apply, grads)

    functools.update_wrapper(routed_apply, apply)
    cls.apply = routed_apply
    boxed = getattr(cls, "apply_boxed", None)
    if boxed is not None:

        def routed_apply_boxed(self: Any, *args: Any) -> Any:
            return route(self, args[0], boxed, args)

        functools.update_wrapper(routed_apply_boxed, boxed)
        cls.apply_boxed = routed_apply_boxed
    setattr(cls, _ROUTED, True)


def let_backward_leave_subclass_gradients_out(node: Any) -> None:
    """Make the autograd node of region ``node`` accept ``None`` for a
    subclass gradient's pieces (its gradient is then ``None``), as it accepts
    ``None`` for a plain gradient.

    B returns ``None`` for every weight gradient; AOTAutograd's epilogue
    would rebuild a DTensor gradient from a ``None`` local tensor and fail.
    Installed once per region (its ``CompiledFunction`` class), before the
    first split backward through it: the epilogue is read from the class when
    the engine calls the node's backward. When every piece is present it
    calls AOTAutograd's own epilogue, so ordinary backward is unchanged.
    Relies on ``CompiledFunction._bw_epilogue_fn`` (called as
    ``_epilogue_(out)``, ``out`` the compiled backward's outputs), its
    ``metadata`` (``num_backward_tokens``, ``is_rng_op_functionalized``: the
    epilogue strips those outputs first; fxsplit refuses such regions) and
    ``grad_input_metas`` (:class:`SubclassGradients`).
    """
    cls = getattr(node, "_forward_cls", None)
    metas = _subclass_grad_metas(node)
    if cls is None or metas is None or cls.__dict__.get(_TOLERANT_EPILOGUE, False):
        return
    meta = cls.metadata
    if meta.num_backward_tokens or meta.is_rng_op_functionalized:
        raise RuntimeError(
            "fxsplit: a compiled region with tensor-subclass gradients and effect tokens or functionalized RNG "
            "in its backward cannot be split (its backward outputs carry extra values); compile it with "
            "backend='inductor' and use the eager split"
        )
    builder = SubclassGradients(metas)
    spans = [
        range(m.flat_tensor_start_idx, m.flat_tensor_start_idx + m.arg_count)
        for m in metas
        if type(m).__name__ == "SubclassCreationMeta"
    ]
    original = cls._bw_epilogue_fn

    def epilogue(out: Sequence[Any], make_subclass_override: Any = None) -> Any:
        if make_subclass_override is None and any(out[i] is None for span in spans for i in span):
            return tuple(builder.gradient(k, out) for k in range(len(metas)))
        if make_subclass_override is not None:
            return original(out, make_subclass_override)
        return original(out)

    cls._bw_epilogue_fn = epilogue
    setattr(cls, _TOLERANT_EPILOGUE, True)


def mark_user_visible_outputs(gm: fx.GraphModule, visible: Sequence[int]) -> None:
    """Inductor's backward compile reads ``output.meta["user_visible_output_idxs"]``
    (set by ``compile_fx_backward``) to decide which output strides it must keep."""
    gm.graph.output_node().meta["user_visible_output_idxs"] = list(visible)


# Hooks on an autograd node (``grad_fn.register_hook`` / ``register_prehook``)
# are held in C++ with no Python-visible query; the engine runs them. B may
# call a region's node itself (``fxsplit.config.direct_b``), which would not:
# so the registration of either on a custom-Function node (an AOTAutograd
# region's node is one) marks the node, and B takes the engine for a marked
# node. Installed on ``BackwardCFunction`` when the first fxsplit region is
# compiled, before any region's node exists; the methods still register the
# hook as before and return its handle.
_HOOKED = "_fxsplit_node_hooked"


def watch_node_hooks() -> None:
    """Make every custom-Function node record that a hook was registered on it
    (:func:`node_has_hooks`). Idempotent."""
    cls = torch.autograd.function.BackwardCFunction
    if _HOOKED in cls.__dict__:
        return
    base_hook, base_prehook = cls.register_hook, cls.register_prehook

    def register_hook(self: Any, fn: Callable[..., Any]) -> Any:
        setattr(self, _HOOKED, True)
        return base_hook(self, fn)

    def register_prehook(self: Any, fn: Callable[..., Any]) -> Any:
        setattr(self, _HOOKED, True)
        return base_prehook(self, fn)

    functools.update_wrapper(register_hook, base_hook)
    functools.update_wrapper(register_prehook, base_prehook)
    cls.register_hook, cls.register_prehook = register_hook, register_prehook
    setattr(cls, _HOOKED, False)


# node_has_hooks(node): whether a hook was ever registered on ``node``, a custom-Function
# node (a split region's; :func:`watch_node_hooks` ran before any existed); a removed hook
# still counts. A C-level read: B asks on every call.
node_has_hooks: Callable[[Any], bool] = operator.attrgetter(_HOOKED)


def aot_saved_args(node: Any) -> list[Any]:
    """What AOTAutograd's backward wrapper puts before the incoming gradients
    in its compiled backward's arguments, read from a region's node (its
    ``ctx``): ``[*ctx.symints, *ctx.saved_tensors, *ctx.opaque_objects]``
    (``runtime_wrappers._backward_prologue``; ``opaque_objects`` from torch
    2.13). Reading ``saved_tensors`` unpacks them, with autograd's check that
    none was modified in place. :class:`fxsplit.runtime.AotCall` checks this
    reading against the wrapper's own before relying on it."""
    return [*node.symints, *node.saved_tensors, *getattr(node, "opaque_objects", ())]


def aot_saved_parts(node: Any) -> tuple[list[Any], int, list[Any]] | None:
    """:func:`aot_saved_args` without unpacking the saved tensors (an unpack
    may run a saved-tensor hook that allows one, as non-reentrant
    checkpointing's does): the symbolic sizes, how many tensors were saved
    (``ctx._raw_saved_tensors``), the opaque objects; ``None`` where the node
    has not these attributes (a torch whose AOTAutograd keeps them otherwise)."""
    try:
        return list(node.symints), len(node._raw_saved_tensors), list(getattr(node, "opaque_objects", ()))
    except (AttributeError, RuntimeError):  # (RuntimeError: the saved tensors were freed)
        return None


def aot_backward_state() -> tuple[bool, bool, bool, bool]:
    """What AOTAutograd's backward wrapper reads from the thread to decide how
    to call the compiled backward: whether autocast is on anywhere (it turns
    it off for graphs compiled under it), whether deterministic algorithms
    are on (it refuses graphs compiled without), whether a functorch
    transform is active (it refuses any), whether grad mode is on (double
    backward). B asks on every call: the four readers are bound once."""
    return (_autocast_on(), _deterministic(), _functorch_stack() is not None, _grad_on())


_autocast_on = torch._C._is_any_autocast_enabled
_deterministic = torch._C._get_deterministic_algorithms
_functorch_stack = torch._C._functorch.peek_interpreter_stack
_grad_on = torch._C.is_grad_enabled


def current_autograd_node() -> Any:
    """The autograd node the engine is running on this thread (the AOTAutograd
    ``ctx`` when called from a compiled backward). Relies on
    ``torch._C._current_autograd_node``."""
    return torch._C._current_autograd_node()


def engine_will_execute(node: Any) -> bool:
    """Whether the running backward will execute ``node``.

    Relies on ``torch._C._will_engine_execute_node``, which refuses leaf nodes
    under ``torch.autograd.grad``; leaves are reported as not executed, which
    is what ``autograd.grad`` does with leaves it does not capture.
    """
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def run_node_outside_engine(node: Any, grads: dict[int, torch.Tensor]) -> Any:
    """Run an ``autograd.Function`` node's backward (an AOTAutograd region) on
    the gradients ``grads`` flowing into its inputs, outside the engine.

    Does what the engine's ``PyNode::apply`` does for the call itself: inputs
    with no gradient get zeros (``materialize_grads``, AOTAutograd's default)
    of the shape, dtype and device in the node's ``_input_metadata``, and it
    runs with grad mode off. It does not run the node's hooks, set the
    engine's current node (callers that need it register the node themselves)
    or free the saved tensors. Relies on ``Node._input_metadata`` and
    ``BackwardCFunction.apply`` (``torch/autograd/function.py``).
    """
    args = []
    for k, meta in enumerate(node._input_metadata):
        g = grads.get(k)
        args.append(g if g is not None else torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device))
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # what torch.no_grad() does, without its Python frames
    try:
        return node.apply(*args)
    finally:
        torch._C._set_grad_enabled(enabled)


def compiled_backward_of(node: Any) -> Any:
    """The compiled backward callable behind an AOTAutograd autograd node, or None.
    Relies on ``CompiledFunction.compiled_bw`` (``runtime_wrappers.py``), reached
    through the node's ``_forward_cls``, and unwraps the ``torch._dynamo.disable``
    wrapper AOTAutograd puts around it (``__wrapped__``)."""
    cls = getattr(node, "_forward_cls", None)
    fn = getattr(cls, "compiled_bw", None) if cls is not None else None
    for _ in range(8):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return fn


class _AnchorProbe(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


@functools.cache
def function_nodes_outlive_their_graph() -> bool:
    """Whether holding the Python object of a custom Function's backward node
    (``BackwardCFunction``: custom Functions and AOTAutograd's compiled
    regions) keeps the node alive once nothing else refers to it.

    torch 2.13 and later: yes, as for C++ nodes. torch 2.11: no, the object
    holds the node weakly; once the graph above it is freed (the stage output
    detached or dropped) every method of it raises "Attribute ... is invalid
    for this instance of _C._FunctionBase" (pytorch/pytorch#166577 is the same
    failure in upstream's split). Probed once on a throwaway Function.
    """
    x = torch.ones(1, requires_grad=True)
    with torch.enable_grad():
        y = _AnchorProbe.apply(x)
    node = y.grad_fn
    del y
    try:
        node.name()
    except RuntimeError:
        return False
    return True


def graph_anchor(t: torch.Tensor) -> Any:
    """An object that keeps ``t``'s autograd graph (``t.grad_fn`` and every node
    below it) alive after ``t`` is detached or dropped, without keeping ``t``'s
    memory; ``None`` where nothing is needed (no graph, or a torch on which
    fxsplit's references to the nodes keep them alive:
    :func:`function_nodes_outlive_their_graph`).

    A C++ node's Python object owns the node, so it is its own anchor; a
    custom Function's node (torch 2.11) is anchored through a C++ view node
    made for it: a zero-element view of ``t`` (``unsqueeze(0).narrow(0, 0, 0)``),
    whose ``SliceBackward0`` holds an edge to ``t``'s node and saves sizes only.
    """
    node = t.grad_fn
    if node is None or function_nodes_outlive_their_graph():
        return None
    if not isinstance(node, torch.autograd.function.BackwardCFunction):
        return node
    with torch.enable_grad():
        return t.unsqueeze(0).narrow(0, 0, 0).grad_fn


def is_accumulate_grad(node: Any) -> bool:
    return type(node).__name__ == "AccumulateGrad"


@functools.cache
def accumulate_grad_type() -> type:
    """The Python type of a weight's grad accumulator node (``AccumulateGrad``)."""
    leaf = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        node = leaf.view_as(leaf).grad_fn.next_functions[0][0]
    assert is_accumulate_grad(node), type(node)
    return type(node)


def storage_ptr(t: torch.Tensor) -> int:
    """``t.untyped_storage().data_ptr()``; for a plain strided tensor without
    making a storage object (which costs more than the rest of a check)."""
    if type(t) is torch.Tensor and t.layout == torch.strided:
        ptr = t.data_ptr()
        offset = t.storage_offset()
        return ptr - offset * t.element_size() if offset else ptr
    return t.untyped_storage().data_ptr()


def storage_ptr_list(values: Sequence[Any]) -> list[int | None]:
    """:func:`storage_ptr` of each value, in order, ``None`` for anything but a
    plain tensor (a DTensor's local storage is not its own to compare)."""
    if all_plain(values):
        return _plain_storage_ptrs(values)  # type: ignore[return-value]
    return [storage_ptr(t) if type(t) is _PLAIN else None for t in values]


def storage_ptrs(values: Sequence[Any]) -> set[int]:
    """The storages of the plain tensors among ``values`` (:func:`storage_ptr_list`)."""
    return set(_plain_storage_ptrs(list(itertools.compress(values, map(operator.is_, map(type, values), _PLAINS)))))


def _plain_storage_ptrs(tensors: Sequence[torch.Tensor]) -> list[int]:
    """:func:`storage_ptr` of each plain tensor; where all start their storage,
    read in bulk (a tensor's data pointer is then its storage's)."""
    try:
        if not any(map(_storage_offset, tensors)):
            return list(map(_data_ptr, tensors))
    except RuntimeError:  # a layout without strided storage: storage_ptr decides
        pass
    return list(map(storage_ptr, tensors))


def all_plain(values: Sequence[Any]) -> bool:
    """Whether every value is a plain ``torch.Tensor`` (no subclass, no other
    object), decided in one C-level pass."""
    return all(map(operator.is_, map(type, values), _PLAINS))


_PLAIN = torch.Tensor
_PLAINS = itertools.repeat(_PLAIN)  # (endless: each map stops at its values' end)
_storage_offset = torch.Tensor.storage_offset

# A reader for C-level passes over tensors (map(grad_of, weights)), shared by
# the runtime, W's decisions and the public API.
grad_of: Callable[[Any], Any] = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr


class StorageUse:
    """Whether a storage has gained holders since it was watched.

    Relies on two private pieces that Inductor's cudagraph trees rely on for
    the same question (is a static output still referenced?):
    ``torch.multiprocessing.reductions.StorageWeakRef`` (a weak reference to
    a storage, which does not count as a holder) and
    ``torch._C._storage_Use_Count`` (the storage's strong reference count:
    one per tensor that views it, including ``.detach()`` aliases and views of
    views, plus the storage's Python object, whether or not torch preserves
    that object on its own). tests/test_cudagraphs.py's
    ``test_storage_use_counts_every_tensor_that_views_a_storage`` fails if
    either changes meaning. The watched storage's Python object is held here,
    so that its share of the count cannot change while it is watched (the
    caller holds the tensor anyway: no lifetime changes).
    """

    __slots__ = ("_storage", "_ref", "_base")

    def __init__(self, t: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._storage = t.untyped_storage()
        self._ref = StorageWeakRef(self._storage)
        self._base = torch._C._storage_Use_Count(self._ref.cdata)

    def gained_holders(self) -> bool:
        """Whether more tensors (or storage objects) hold the storage now than
        when it was watched."""
        return torch._C._storage_Use_Count(self._ref.cdata) > self._base

    @staticmethod
    def any_gained(uses: Sequence[StorageUse]) -> Callable[[], bool]:
        """A check, built once, of whether any of ``uses`` gained holders:
        ``any(u.gained_holders() for u in uses)`` in one C-level pass (no
        Python frame per storage). The caller keeps ``uses`` alive."""
        cdatas = [u._ref.cdata for u in uses]
        bases = [u._base for u in uses]
        count = torch._C._storage_Use_Count
        gt = operator.gt
        return lambda: any(map(gt, map(count, cdatas), bases))


@functools.cache
def _tensor_guards_class() -> Any:
    """Dynamo's ``TensorGuards``, where this torch has one that rejects what
    :func:`metadata_guard` promises to reject (checked once, on small tensors)."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    cls = getattr(guards, "TensorGuards", None)
    if cls is None:
        return None
    try:
        a = torch.zeros(2, 3)
        guard = cls(a, dynamic_dims_sizes=[[2, 3]], dynamic_dims_strides=[[3, 1]])
        if not guard.check(torch.zeros(2, 3)):
            return None
        others = [
            torch.zeros(3, 2).mT,  # other strides
            torch.zeros(2, 4),  # other sizes
            torch.zeros(2, 3, dtype=torch.float64),
            torch.zeros(2, 3, requires_grad=True),
            torch.nn.Parameter(torch.zeros(2, 3)),  # another type
        ]
        if any(guard.check(t) for t in others):
            return None
    except Exception:  # noqa: BLE001 - a private class: anything unexpected means "not available"
        return None
    return cls


def items_getter(positions: Sequence[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """A function returning ``[seq[k] for k in positions]`` in one C-level call."""
    if not positions:
        return lambda seq: []
    get = operator.itemgetter(*positions)
    if len(positions) == 1:
        return lambda seq: [get(seq)]
    return lambda seq: list(get(seq))


def metadata_guard(tensors: Sequence[torch.Tensor]) -> Callable[..., bool] | None:
    """A check, in one C call, that tensors have exactly the metadata of
    ``tensors`` (Python type, dispatch keys, dtype, device, ``requires_grad``,
    sizes, strides; not the storage offset or whether it is a view), as
    Dynamo's tensor guards check a frame's inputs (``TensorGuards``), or
    ``None`` where this torch has no such class or refuses these tensors.
    A tensor given at several positions must be the same object there again."""
    cls = _tensor_guards_class()
    if cls is None:
        return None
    first: dict[int, int] = {}
    repeats = [(first.setdefault(id(t), k), k) for k, t in enumerate(tensors) if first.setdefault(id(t), k) != k]
    if repeats:
        # Dynamo's guard refuses a tensor given twice: guard each distinct one
        # and require the repeats to be the same objects again.
        kept = sorted(first.values())
        inner = metadata_guard([tensors[k] for k in kept])
        if inner is None:
            return None
        pick = items_getter(kept)

        def check_with_repeats(*ts: torch.Tensor) -> bool:
            return all(ts[j] is ts[k] for j, k in repeats) and inner(*pick(ts))

        return check_with_repeats
    try:
        guard = cls(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
        if not guard.check(*tensors):  # a torch whose guard means something else
            return None
    except Exception:  # noqa: BLE001 - a private class: anything unexpected means "not available"
        return None
    return guard.check


# Grad mode set directly, as ``torch.no_grad`` does underneath (``torch._C.
# _set_grad_enabled``): W's dW call restores it in a ``finally``. The Python
# context manager's own frames cost W a measurable part of its host time on a
# host-bound stage (about 25 us of 300 on this project's CPU, paired runs).
set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled


# ``with autocast_disabled():`` turns autocast off, as AOTAutograd does around
# compiled graphs that were traced with autocast on (a C context manager: no Python frame).
autocast_disabled: Callable[[], Any] = torch._C._DisableAutocast


def compiled_output_strides(compiled: Any) -> list[tuple[int, ...] | None] | None:
    """The strides Inductor chose for each output of a compiled graph (None where
    unknown or symbolic). Relies on ``CompiledFxGraph.output_strides`` (one tuple
    of stride expressions printed as strings per output, or None)."""
    strides = getattr(compiled, "output_strides", None)
    if not isinstance(strides, (list, tuple)):
        return None
    result: list[tuple[int, ...] | None] = []
    for s in strides:
        try:
            result.append(tuple(int(e) for e in s) if s is not None else None)
        except (TypeError, ValueError):
            result.append(None)
    return result


def with_strides(example: Any, stride: tuple[int, ...] | None) -> Any:
    """``example`` as a tensor of the same shape and dtype laid out with ``stride``
    (itself when no stride is given or it already has it)."""
    if stride is None or not isinstance(example, torch.Tensor) or tuple(example.stride()) == stride:
        return example
    # Allocate in the example's fake mode (a traced value): no real memory at compile time.
    mode = getattr(example, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty_strided(tuple(example.shape), stride, dtype=example.dtype, device=example.device)


def trace_on_values(fn: Callable[..., Any], values: Sequence[Any]) -> fx.GraphModule:
    """Trace ``fn(*values)`` into an ATen-level FX graph whose nodes carry ``meta["val"]``.

    ``values`` are the ``meta["val"]`` of graph nodes: fake tensors and SymInts
    of one ``FakeTensorMode`` (AOTAutograd's graphs) or real tensors
    (hand-built graphs). Tracing runs in that fake mode with the Python
    dispatcher on, as AOTAutograd traces, so symbolic sizes stay symbolic and
    new sizes are expressions of the same shape environment. It decomposes
    with Inductor's decomposition table, as ``compile_fx`` does for the
    backward graph: Inductor refuses graphs holding ops it expects decomposed
    (e.g. ``aten.transpose.int``). Relies on ``torch._guards.detect_fake_mode``,
    ``torch._dispatch.python.enable_python_dispatcher``,
    ``torch._inductor.decomposition.select_decomp_table`` and ``make_fx``
    (default "real" tracing mode on already-fake values).
    """
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = detect_fake_mode(list(values))
    with mode if mode is not None else contextlib.nullcontext(), enable_python_dispatcher():
        return make_fx(fn, decomposition_table=select_decomp_table())(*values)


def dynamo_control_flow_exceptions() -> tuple[type[BaseException], ...]:
    """Exceptions a backend must let through to Dynamo untouched.

    Dynamo raises these through the backend call to steer compilation, not to
    report a failure: ``RestartAnalysis`` and its subclasses (e.g.
    ``TensorifyScalarRestartAnalysis``: trace again with some scalars
    specialized), ``SkipFrame`` (skip this frame), ``Unsupported`` (a graph
    break), ``ShortenTraceback`` (an error already reported by a nested
    compile, e.g. ``BackendCompilerFailed``), and the fake-tensor exceptions
    Dynamo turns into a graph break when a backend raises them
    (``exceptions_allowed_to_be_fallback``). Mirrors what
    ``OutputGraph.call_user_compiler`` re-raises or handles itself
    (``torch/_dynamo/output_graph.py``); relies on the classes in
    ``torch/_dynamo/exc.py``.
    """
    from torch._dynamo import exc

    return (
        exc.RestartAnalysis,
        exc.SkipFrame,
        exc.Unsupported,
        exc.ShortenTraceback,
        *exc.exceptions_allowed_to_be_fallback,
    )


def dynamo_compile_id() -> str | None:
    """The id Dynamo gives the frame compile in progress (``"0/1"``: frame 0,
    second compile), as its logs (``TORCH_LOGS=recompiles,graph_breaks``) print
    it; ``None`` outside a Dynamo compile. Relies on
    ``torch._guards.CompileContext.current_compile_id``."""
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    return str(cid) if cid is not None else None


def compiled_autograd_enabled() -> bool:
    """Whether compiled autograd (``torch._dynamo.compiled_autograd._enable``) is on
    for backward calls made now. Relies on the module flag
    ``torch._dynamo.compiled_autograd.compiled_autograd_enabled``, which
    ``_enable`` sets and ``_disable`` clears (the module is imported with
    ``torch._dynamo``, which fxsplit imports)."""
    return bool(getattr(_compiled_autograd, "compiled_autograd_enabled", False))


def engine_backward(roots: Sequence[Any], grads: Sequence[torch.Tensor], inputs: Sequence[Any]) -> None:
    """``torch.autograd.backward(roots, grads, inputs=inputs, retain_graph=True)``
    without its Python-side argument normalisation (``_make_grads``: about half
    the cost of committing a small weight's gradient). The caller passes
    ``GradientEdge`` or tensor roots, ``GradientEdge`` inputs and one defined
    tensor per root; the engine still validates each gradient against its edge
    (shape, dtype cast to ``grad_dtype``, device) in C++. Relies on
    ``torch.autograd.graph._engine_run_backward(outputs, grad_outputs,
    keep_graph, create_graph, inputs, allow_unreachable=, accumulate_grad=)``,
    which ``torch.autograd.backward`` calls the same way."""
    torch.autograd.graph._engine_run_backward(
        tuple(roots), tuple(grads), True, False, tuple(inputs), allow_unreachable=True, accumulate_grad=True
    )


def engine_grad(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[Any], retain_graph: bool
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph=retain_graph,
    allow_unused=True)`` without its Python-side argument normalisation, for
    a caller that has checked each gradient against its output (same shape and
    dtype, defined) and passes plain tensors (no ``__torch_function__`` to
    honour). The engine validates each gradient against its edge in C++, as
    always. Relies on ``torch.autograd.graph._engine_run_backward``, which
    ``torch.autograd.grad`` calls the same way (see :func:`engine_backward`)."""
    return torch.autograd.graph._engine_run_backward(
        tuple(outputs), tuple(grads), retain_graph, False, tuple(inputs), allow_unreachable=True, accumulate_grad=False
    )


# -- data-parallel wrappers (used by fxsplit.pipelining) ----------------------------------------
def ddp_expect_gradients(ddp: Any, outputs: Any) -> None:
    """Arm a ``DistributedDataParallel`` reducer for the backward that comes next,
    so its hooks on the grad accumulators all-reduce the gradients (what DDP's
    forward does when it is not in ``no_sync``). Upstream's pipeline stage does
    the same before the last backward of a step. Relies on
    ``DistributedDataParallel.reducer.prepare_for_backward`` and
    ``torch.nn.parallel.distributed._find_tensors``."""
    from torch.nn.parallel.distributed import _find_tensors

    ddp.reducer.prepare_for_backward(list(_find_tensors(outputs)))


def stage_backward_state(stage: Any, chunk: int, pop: bool = False) -> tuple[Any, Any, Any, Any] | None:
    """What a pipeline stage's ``I`` stored for its ``W`` of microbatch ``chunk``:
    ``(input_values, param_groups, stage_output, output_grads)``, or ``None``.
    Relies on ``_PipelineStageBase.backward_state`` and the layout of its
    entries (``torch/distributed/pipelining/stage.py``, ``backward_one_chunk``)."""
    state = stage.backward_state.pop(chunk, None) if pop else stage.backward_state.get(chunk)
    return None if state is None else tuple(state)  # type: ignore[return-value]


def set_stage_param_groups(stage: Any, chunk: int, param_groups: Any) -> None:
    """Replace the ``param_groups`` a stage's ``I`` stored for microbatch ``chunk``
    (see :func:`stage_backward_state`)."""
    input_values, _, stage_output, output_grads = stage.backward_state[chunk]
    stage.backward_state[chunk] = (input_values, param_groups, stage_output, output_grads)


def fsdp_unsharded_parameters(module: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """For every parameter FSDP2 (``fully_shard``) manages in ``module``'s tree: the
    id of its sharded and of its unsharded parameter, mapped to the unsharded one.

    Autograd records the *unsharded* parameters (FSDP2 swaps them onto the
    modules for forward and backward, and back to the sharded DTensors when it
    reshards), so their grad accumulators are the ones weight gradients must
    reach; which of the two ``module.parameters()`` returns depends on when it
    is called. Relies on the state's parameter groups (:func:`_fsdp_state_param_groups`)
    and ``FSDPParam.sharded_param`` / ``_unsharded_param`` (created by the first
    all-gather and reused afterwards); parameters not yet all-gathered are left out.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mapping: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = fully_shard.state(sub)  # type: ignore[attr-defined]
        for group in _fsdp_state_param_groups(state):
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is None:
                    continue
                mapping[id(fsdp_param.sharded_param)] = unsharded
                mapping[id(unsharded)] = unsharded
    return mapping


def _fsdp_state_param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup`` objects of one ``fully_shard`` state (empty when the
    module owns no parameters of its own).

    What changed between releases: torch 2.11 keeps one optional group,
    ``FSDPState._fsdp_param_group``; from 2.13 a state holds a list,
    ``_fsdp_param_groups``, and ``_fsdp_param_group`` becomes a property that
    raises when there is more than one. Detected by attribute, plural first.
    Raises ``RuntimeError`` if neither exists (a torch that moved them again):
    without the groups, B and W would be handed the sharded parameters, which
    autograd never recorded.
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if hasattr(state, "_fsdp_param_group"):  # torch 2.11
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise RuntimeError(
        "fxsplit: this torch's FSDPState has neither _fsdp_param_groups nor _fsdp_param_group; "
        "fxsplit cannot find FSDP2's unsharded parameters (update fxsplit/_torch_internals.py)"
    )


def fsdp_has_manual_backward_finalization() -> bool:
    """Whether FSDP2 has manual backward finalization
    (``FSDPModule.set_manual_backward_finalization`` / ``finalize_backward``).

    What changed between releases: up to torch 2.13, upstream's
    ``PipelineStage.perform_reduce_grad`` (the schedule's ``REDUCE_GRAD``) reaches
    into FSDP's private state and runs ``FSDPParamGroup.post_backward`` for every
    group, then ``FSDPState._root_post_backward_final_callback``, whatever the
    stage had done before. From torch 2.15, FSDP has a public protocol for this:
    the stage enables manual finalization before forward (upstream's
    ``forward_one_chunk``, only when ``has_backward``), every backward leaves its
    groups ``_post_backward_pending``, and ``REDUCE_GRAD`` calls
    ``finalize_backward(async_op=True)`` (``start_gradient_reduction``, which
    multi-stage schedules call instead of ``perform_reduce_grad``, and
    ``wait_for_gradient_reduction`` at ``WAIT_REDUCE_GRAD``); without manual
    finalization enabled before forward, ``perform_reduce_grad`` reduces nothing.
    Public API, detected by attribute, not by version.
    """
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "finalize_backward") and hasattr(FSDPModule, "set_manual_backward_finalization")


def is_fsdp_replicate_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` was wrapped by the FSDP-based ``replicate`` (an ``FSDPModule``
    whose state is not ``fully_shard``'s). Relies on
    ``torch.distributed._composable.replicate_with_fsdp.ReplicateModule``."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
    except ImportError:  # pragma: no cover - older torch
        return False
    return isinstance(module, ReplicateModule)


# -- saved tensors of autograd nodes (used by fxsplit.api / fxsplit.runtime) ----------------------
# Attribute names under which each node type exposes its SavedTensor objects
# (``_raw_saved_self``, ``_raw_saved_mat1``, ... for C++ nodes,
# ``_raw_saved_tensors`` for custom Functions and AOTAutograd's ctx), per type.
# By node type, weakly: an AOTAutograd region's node type is a class of its own,
# which reaches the region's compiled backward (a strong key would keep it alive).
_RAW_SAVED_NAMES: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _raw_saved_names(node: Any) -> tuple[str, ...]:
    names = _RAW_SAVED_NAMES.get(type(node))
    if names is None:
        names = tuple(a for a in dir(type(node)) if a.startswith("_raw_saved_"))
        _RAW_SAVED_NAMES[type(node)] = names
    return names


def _saved_was_freed(_packed: Any) -> torch.Tensor:
    raise RuntimeError(
        "Trying to backward through the graph a second time (or directly access saved tensors after they "
        "have already been freed). fxsplit.stage_backward_input ran this node's backward and freed the "
        "tensors it saved, as an ordinary backward without retain_graph=True does; W does not need them."
    )


def release_saved_tensors(node: Any) -> int:
    """Free the tensors ``node`` saved for its backward, now, although the
    graph is retained; returns how many were released.

    The autograd engine frees a node's saved tensors after running it only
    when the whole call has ``retain_graph=False``; AOTAutograd's
    ``ctx.maybe_clear_saved_tensors()`` likewise does nothing under a graph
    task that keeps the graph (``torch._C._autograd._get_current_graph_task_keep_graph``).
    B retains the graph when W re-runs eager nodes, so the nodes W does not
    run are released one by one here: registering a pair of saved-tensor
    hooks on a saved tensor calls the pack hook at once and drops the
    tensor the node held (the documented per-tensor form of
    ``saved_tensors_hooks``, "Hooks for saved tensors" in the autograd
    mechanics notes: ``grad_fn._raw_saved_<name>.register_hooks(pack, unpack)``;
    ``ctx._raw_saved_tensors`` for custom Functions and AOTAutograd's
    compiled regions). The pack hook keeps nothing (``id``), and the unpack hook
    raises the engine's "backward through the graph a second time" error,
    so a later backward through the node fails as it would after ordinary
    backward. Saved tensors that are ``None``, already freed, or already
    carry hooks (``saved_tensors_hooks`` in the forward, e.g. non-reentrant
    checkpointing, whose saved objects are small holders) are left as they are.
    """
    released = 0
    for name in _raw_saved_names(node):
        try:
            saved = getattr(node, name)
        except RuntimeError:  # the node's buffers were freed already
            continue
        items = list(filter(_IS_SAVED, saved if isinstance(saved, (list, tuple)) else (saved,)))
        try:  # all at once, C-level (a compiled region saves dozens; B may release one per microbatch)
            collections.deque(map(_RELEASE, items), maxlen=0)
            released += len(items)
            continue
        except RuntimeError:
            pass  # one of them was freed already or has hooks: one by one (those released stay so)
        for item in items:
            try:
                _RELEASE(item)
            except RuntimeError:
                continue  # already freed or released, or hooks already set: nothing we may release
            released += 1
    return released


def release_region_saved(node: Any) -> None:
    """:func:`release_saved_tensors` for a compiled region's node (AOTAutograd's
    ``ctx``, whose saved tensors are ``_raw_saved_tensors``), in one C-level
    pass where none of them is freed or hooked yet."""
    try:
        collections.deque(map(_RELEASE, filter(_IS_SAVED, node._raw_saved_tensors)), maxlen=0)
    except (AttributeError, RuntimeError):
        release_saved_tensors(node)


# The pack hook runs at once, on each tensor: ``id`` keeps nothing of it, in C.
_RELEASE = operator.methodcaller("register_hooks", id, _saved_was_freed)
_IS_SAVED = functools.partial(operator.is_not, None)


class _DetachedAlias:
    """What a saved tensor holds once :func:`keep_saved_through_detach` re-packed
    it: an out-of-place detached alias of the tensor (same storage and version
    counter) and the version the tensor was at then."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = tensor._version


def _unpack_alias(packed: _DetachedAlias) -> torch.Tensor:
    # Autograd checks the version of a tensor saved without hooks; one saved
    # with hooks is not checked, so the check is made here, with its message.
    t = packed.tensor
    if t._version != packed.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {packed.version} "
            "instead. (fxsplit: a stage output that W's autograd nodes saved was modified in place between "
            "stage_backward_input and stage_backward_weight.)"
        )
    return t


def can_keep_saved_through_detach() -> bool:
    """Whether this torch's ``SavedTensor`` has what :func:`keep_saved_through_detach`
    needs (``data``, ``unpack_hook``, ``unpack``: torch 2.13 and 2.15; 2.11 lacks ``unpack``)."""
    saved_tensor_type = torch._C._autograd.SavedTensor
    return all(hasattr(saved_tensor_type, a) for a in ("data", "unpack_hook", "unpack"))


def keep_saved_through_detach(nodes: Sequence[Any], t: torch.Tensor) -> bool:
    """Make the references ``nodes`` saved to ``t`` itself survive ``t.detach_()``;
    ``False`` if that cannot be ensured (then ``t`` must stay attached).

    A node that saved one of its forward's inputs holds that very tensor, and
    unpacking it after an in-place detach raises "Trying to use a saved tensor
    that has been detached in-place". Each such saved tensor is re-packed: a
    pair of hooks is registered on it (``_raw_saved_<name>.register_hooks``,
    the documented per-tensor form of saved-tensor hooks, as
    :func:`release_saved_tensors` uses), which makes autograd record the
    tensor's ``grad_fn`` in the saved variable at once and store what the
    pack hook returns, an out-of-place detached alias. Unpacking then gives the
    same values with the same autograd edge, whatever happens to ``t``'s own
    autograd metadata; the unpack hook keeps autograd's version check.

    Relies on ``SavedTensor.data`` (the saved object: the tensor itself when
    saved without hooks) and ``SavedTensor.unpack_hook`` (``None`` without
    hooks), to find ``t`` without unpacking anything, and on
    ``SavedTensor.unpack`` to run autograd's version check before re-packing
    (torch 2.11 has no ``unpack``: re-packed unchecked, a tensor modified in
    place after it was saved would pass W's check and give a wrong gradient,
    so ``t`` stays attached there). Saved tensors that carry hooks already
    (e.g. checkpointing) hold their ``grad_fn`` and are left alone. ``False``
    when this torch lacks these attributes, or ``t`` was modified in place
    after a node saved it (left attached, autograd's own error is raised where
    the node runs, as in ordinary backward).
    """
    if not can_keep_saved_through_detach():
        return False
    for node in nodes:
        for name in _raw_saved_names(node):
            try:
                saved = getattr(node, name)
            except RuntimeError:
                continue
            for item in saved if isinstance(saved, (list, tuple)) else (saved,):
                if item is None:
                    continue
                try:
                    if item.unpack_hook is not None or item.data is not t:
                        continue
                    item.unpack()  # autograd's version check
                except RuntimeError:
                    return False
                item.register_hooks(_DetachedAlias, _unpack_alias)
    return True


def saved_tensors_of(node: Any) -> list[torch.Tensor]:
    """The tensors ``node`` holds for its backward (unpacked: a tensor saved
    with ``saved_tensors_hooks`` runs its unpack hook). Tensors already freed
    are skipped. Relies on the ``_saved_<name>`` attributes of C++ nodes and
    ``saved_tensors`` of custom Functions (``_raw_saved_<name>`` minus ``raw``)."""
    found: list[torch.Tensor] = []
    for name in _raw_saved_names(node):
        plain = "saved_tensors" if name == "_raw_saved_tensors" else "_saved_" + name[len("_raw_saved_"):]
        try:
            value = getattr(node, plain)
        except RuntimeError:
            continue
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor):
                found.append(item)
    return found


# -- compiling a region's graphs after the frame compile (used by fxsplit.backend) ---------------
class CompileContextSnapshot:
    """What a compile of one of a region's graphs reads from its surroundings,
    captured while Dynamo compiles the frame: the ``TracingContext`` (fake
    mode, shape environment, forward metadata), the ``CompileContext``
    (compile id, for logs and the structured trace), whether autocast was on
    (the graphs are autocast-lowered already; AOTAutograd compiles a lazy
    backward with autocast disabled then) and Inductor's config."""

    __slots__ = ("tracing", "compile", "autocast", "inductor_config")

    def __init__(self) -> None:
        from torch._guards import CompileContext, TracingContext
        from torch._inductor import config as inductor_config

        self.tracing = TracingContext.try_get()
        self.compile = CompileContext.try_get()
        self.autocast = torch._C._is_any_autocast_enabled()
        self.inductor_config = inductor_config.get_config_copy()


def capture_compile_context() -> CompileContextSnapshot:
    return CompileContextSnapshot()


@contextlib.contextmanager
def restored_compile_context(snapshot: CompileContextSnapshot | None) -> Iterator[None]:
    """Compile as at the time of ``snapshot``, as AOTAutograd's lazy backward
    compile does (``_AutogradBackwardCompiler.get_or_compile`` in
    ``runtime_wrappers.py``: ``tracing(saved_context)``,
    ``compile_context(saved_compile_context)``, ``_DisableAutocast``), plus
    Inductor's config as it was (``config.get_config_copy`` / ``config.patch``)
    and the AOTAutograd settings of the split. ``None``: nothing to restore
    (graphs run op by op)."""
    if snapshot is None:
        yield
        return
    from torch._guards import compile_context, tracing
    from torch._inductor import config as inductor_config

    with contextlib.ExitStack() as stack:
        stack.enter_context(tracing(snapshot.tracing))
        stack.enter_context(compile_context(snapshot.compile))
        if snapshot.autocast:
            stack.enter_context(torch._C._DisableAutocast())
        stack.enter_context(inductor_config.patch(snapshot.inductor_config))
        stack.enter_context(aot_config_for_split())
        yield


def shape_guard_count() -> int | None:
    """How many guards the shape environment of the current tracing context
    holds (``ShapeEnv.guards``), or ``None`` without one."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    mode = getattr(ctx, "fake_mode", None) if ctx is not None else None
    env = getattr(mode, "shape_env", None) if mode is not None else None
    return None if env is None else len(env.guards)


def is_symbolic(value: Any) -> bool:
    """Whether a traced value (a graph input's example) has symbolic sizes:
    a SymInt/SymFloat/SymBool, or a tensor with a symbolic size, stride or offset."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return any(
            isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset())
        )
    return False


def fake_like(tensor: torch.Tensor, examples: Sequence[Any]) -> Any:
    """An example input laid out as the real ``tensor`` (shape, strides, dtype,
    device), in the fake mode of ``examples`` (the traced inputs of the graph
    it joins); ``tensor`` itself when they are real. Relies on
    ``torch._guards.detect_fake_mode``."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(list(examples))
    if mode is None:
        return tensor
    with mode:
        return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device=tensor.device)


class AccumulationLedger:
    """Which ``.grad`` tensors an accumulating dW graph has begun and finished
    writing, by data pointer, as its :data:`ACCUMULATION_BEGINS` /
    :data:`ACCUMULATION_ENDS` brackets ran, and :data:`ADDMM_INTO` (one write:
    finished, or not begun) (see :func:`recording_accumulation`)."""

    __slots__ = ("begun", "ended")

    def __init__(self) -> None:
        self.begun: set[int] = set()
        self.ended: set[int] = set()

    def state(self, grad: torch.Tensor) -> str:
        """``"written"``, ``"untouched"`` or ``"unknown"`` (begun, not ended)."""
        ptr = grad.data_ptr()
        if ptr in self.ended:
            return "written"
        return "unknown" if ptr in self.begun else "untouched"


class _Sink(collections.deque):  # type: ignore[type-arg]
    """A set that keeps nothing, in C calls: ``add`` and ``discard``."""

    add = discard = collections.deque.append


class _NoLedger:
    """Where the brackets record when no :func:`recording_accumulation` is
    active (they run on every in-graph accumulation: C calls only)."""

    __slots__ = ()
    begun = ended = _Sink(maxlen=0)


_NO_LEDGER = _NoLedger()


class _Ledgers(threading.local):
    current: AccumulationLedger | _NoLedger = _NO_LEDGER


_LEDGERS = _Ledgers()


def current_ledger() -> AccumulationLedger | None:
    """The ledger :func:`recording_accumulation` set in this thread, if any."""
    ledger = _LEDGERS.current
    return None if ledger is _NO_LEDGER else ledger  # type: ignore[return-value]


class recording_accumulation:  # (lower case: used as a function, ``with recording_accumulation() as ledger:``)
    """Record, in this thread, the brackets the accumulating graphs run inside
    the block. A class, not a generator-based context manager: W enters one
    per accumulating graph, and its frames are lines W runs on every call."""

    __slots__ = ("_previous",)

    def __enter__(self) -> AccumulationLedger:
        self._previous = _LEDGERS.current
        ledger = _LEDGERS.current = AccumulationLedger()
        return ledger

    def __exit__(self, *exc: object) -> None:
        _LEDGERS.current = self._previous


def _define_accumulating_matmul() -> tuple[Any, Any]:
    """``fxsplit::addmm_into(grad, a, b)``: ``grad += a @ b`` in place (ATen's
    ``addmm_``, one GEMM with beta = 1), as an operator of our own.

    Why not ``aten.addmm_`` itself: Inductor runs an ATen op it has no
    lowering for as an implicit fallback, and in a backward graph it makes
    every input of such an op contiguous first (``GraphLowering.call_function``,
    pytorch issue 140452), which copies the transposed activation gradient
    of every weight-gradient GEMM. An operator outside ``aten`` tagged
    ``flexible_layout`` gets its inputs as they are (``tag_to_layout_constraint``),
    and ``addmm_`` handles transposed operands itself. Defined with
    ``torch.library.Library`` and one ``CompositeExplicitAutograd`` kernel
    (which also serves fake tensors) rather than ``torch.library.custom_op``:
    W always runs it under no_grad, and custom_op's autograd and
    ADInplaceOrView layers cost ~10x the GEMM's own dispatch on small weights.
    Public APIs only; what relies on Inductor is the tag's meaning.
    """
    from torch.utils import flop_counter

    lib = torch.library.Library("fxsplit", "FRAGMENT")
    lib.define("addmm_into(Tensor(a!) grad, Tensor a, Tensor b) -> ()", tags=(torch.Tag.flexible_layout,))

    def addmm_into(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        # addmm_ raises before it writes (it checks and allocates first) or
        # writes all of grad and returns it: one write, recorded once done
        # (AccumulationLedger; outside recording_accumulation, a sink that keeps nothing).
        _LEDGERS.current.ended.add(grad.addmm_(a, b).data_ptr())

    lib.impl("addmm_into", addmm_into, "CompositeExplicitAutograd")
    lib.impl("addmm_into", lambda grad, a, b: None, "Meta")  # (fake tensors have no data pointer)
    # FlopCounterMode counts it as the GEMM it is.
    flop_counter.register_flop_formula(torch.ops.fxsplit.addmm_into)(
        lambda grad_shape, a_shape, b_shape, out_shape=None, **kwargs: flop_counter.mm_flop(a_shape, b_shape)
    )
    return lib, torch.ops.fxsplit.addmm_into.default


# The library object owns the registration: kept for the life of the process.
_ADDMM_INTO_LIB, ADDMM_INTO = _define_accumulating_matmul()


def _define_accumulation_brackets() -> tuple[Any, Any, Any]:
    """``fxsplit::accumulation_begins(grad)`` / ``fxsplit::accumulation_ends(grad)``:
    operators that do nothing to ``grad`` but declare that they mutate it, so
    that Inductor keeps them (no dead-code elimination) and orders them before
    and after the kernel that adds into ``grad`` (writes to one buffer run in
    program order). Their CPU kernel records the data pointer in the current
    :class:`AccumulationLedger`, if any. Compiled kernels write ``.grad`` without
    telling anyone; these brackets are how W learns, after an exception,
    which weights' accumulation happened. Tagged ``flexible_layout`` as
    ``addmm_into`` is, so that Inductor hands them ``grad`` itself, never a
    contiguous copy."""
    lib = torch.library.Library("fxsplit", "FRAGMENT")
    for name, field in (("accumulation_begins", "begun"), ("accumulation_ends", "ended")):
        lib.define(f"{name}(Tensor(a!) grad) -> ()", tags=(torch.Tag.flexible_layout,))

        def kernel(grad: torch.Tensor, field: str = field) -> None:
            getattr(_LEDGERS.current, field).add(grad.data_ptr())

        lib.impl(name, kernel, "CompositeExplicitAutograd")
        lib.impl(name, lambda grad: None, "Meta")
    return lib, torch.ops.fxsplit.accumulation_begins.default, torch.ops.fxsplit.accumulation_ends.default


_BRACKETS_LIB, ACCUMULATION_BEGINS, ACCUMULATION_ENDS = _define_accumulation_brackets()


# -- torch.distributed.pipelining's schedule IR (used by fxsplit.schedules) ------------------
# A schedule's action order is upstream's private IR: ``schedules._Action`` (stage, computation
# type, microbatch, sub-actions) in per-rank lists (``pipeline_order``), lowered by
# ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` (validation, UNSHARD/RESHARD,
# REDUCE_GRAD, SEND/RECV) into ``pipeline_order_with_comms``, the list its runtime executes.
# Everything fxsplit.schedules reads or builds of it goes through the helpers below.


@functools.cache
def _pipelining_schedules() -> Any:
    import torch.distributed.pipelining.schedules as schedules

    return schedules


def make_action(stage: int, kind: str, microbatch: int | None = None, sub_actions: tuple[Any, ...] | None = None) -> Any:
    """An upstream schedule action (``schedules._Action``): ``kind`` is the
    computation type's string (``"F"``, ``"I"``, ``"W"``, ``"B"``, ``"SEND_F"``, ...,
    ``"OVERLAP_F_B"``). Relies on ``_Action`` being the named tuple
    ``(stage_index, computation_type, microbatch_index, sub_actions)`` and
    ``_ComputationType.from_str``."""
    s = _pipelining_schedules()
    return s._Action(stage, s._ComputationType.from_str(kind), microbatch, sub_actions)


def action_parts(action: Any) -> tuple[int, str, int | None, tuple[Any, ...] | None]:
    """``(stage, kind, microbatch, sub_actions)`` of an upstream action; ``kind`` as
    in :func:`make_action`. Relies on the ``_Action`` fields named there and on
    ``_ComputationType`` being a ``str`` enum whose value is the short name."""
    kind = action.computation_type
    return action.stage_index, str(getattr(kind, "value", kind)), action.microbatch_index, action.sub_actions


def v_schedules_fail_with_gloo() -> bool:
    """Whether upstream's V-shaped schedules (``ScheduleZBVZeroBubble``,
    ``ScheduleDualPipeV``) fail with gloo on this torch: on 2.11 they fail in
    ``_initialize_stages`` before any backward ("Pair is not connected"), with
    upstream's own ``PipelineStage`` too; 2.13 and 2.15 run them, 2.12 was not
    tried. A version check: a probe would need a two-process world of its own."""
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__) < (2, 12)


def parse_action(text: str) -> Any:
    """``_Action.from_str``: ``"2F0"``, ``"1SEND_B3"``, ``"(0F3;3B1)OVERLAP_F_B"``; ``None`` for ``""``."""
    return _pipelining_schedules()._Action.from_str(text)


class _ShapelessStage:
    """What upstream schedules read of their stages while they compute their action
    order (``num_stages``, ``group_size``, ``group_rank``, ``submod``, ``stage_index``);
    no module, no process group."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = torch.nn.Module()
        self.stage_index_to_group_rank: dict[int, int] = {}


def upstream_schedule_orders(
    name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int
) -> tuple[dict[int, list[Any]], dict[int, list[Any]] | None, dict[int, int]]:
    """``(pipeline_order, pipeline_order_with_comms, stage_to_rank)`` of upstream's
    schedule class ``name`` for ``n_ranks`` ranks holding ``stages_per_rank``
    stages each, computed by the class itself on stand-in stages (no model, no
    process group). ``pipeline_order_with_comms`` is ``None`` for a
    single-stage schedule (it has no lowered order).

    Relies on: every schedule computing ``pipeline_order`` for all ranks in its
    constructor from ``stages[0].group_size`` / ``group_rank`` / ``num_stages``
    (``_check_torch_compile_compatibility`` reading ``submod``), the
    ``_PipelineScheduleRuntime`` subclasses also lowering it into
    ``pipeline_order_with_comms``, and ``stage_index_to_group_rank`` holding the
    placement. Raises ``ValueError`` where the class refuses the sizes.
    """
    s = _pipelining_schedules()
    cls = getattr(s, name)
    n_stages = n_ranks * stages_per_rank
    if issubclass(cls, s.PipelineScheduleSingle):
        if stages_per_rank != 1:
            raise ValueError(f"{name} holds one stage per rank, not {stages_per_rank}")
        schedule = cls(_ShapelessStage(0, n_stages, n_ranks, 0), n_microbatches)
        return dict(schedule.pipeline_order or {}), None, {r: r for r in range(n_ranks)}
    stages = [_ShapelessStage(i, n_stages, n_ranks, 0) for i in range(stages_per_rank)]
    schedule = cls(stages, n_microbatches)
    return (dict(schedule.pipeline_order), dict(schedule.pipeline_order_with_comms),
            dict(schedule.stage_index_to_group_rank))


def _runtime_on_stand_ins(n_ranks: int, n_stages: int, n_microbatches: int) -> Any:
    return _pipelining_schedules()._PipelineScheduleRuntime(
        [_ShapelessStage(0, n_stages, n_ranks, 0)], n_microbatches)


def lower_schedule(
    order: dict[int, list[Any]], n_ranks: int, n_stages: int, n_microbatches: int
) -> tuple[dict[int, list[Any]], dict[int, int]]:
    """``(pipeline_order_with_comms, stage_to_rank)``: a compute-only action order
    lowered exactly as ``_PipelineScheduleRuntime`` lowers what it is given:
    ``_prepare_schedule_with_comms``, which first checks it with
    ``_validate_schedule`` (every stage on one rank, F before I/B before W per
    microbatch, all microbatches) and raises ``AssertionError`` on a malformed
    order (also when ``_add_send_recv`` cannot place the sends and receives)."""
    runtime = _runtime_on_stand_ins(n_ranks, n_stages, n_microbatches)
    runtime._prepare_schedule_with_comms({r: list(a) for r, a in order.items()})
    return dict(runtime.pipeline_order_with_comms), dict(runtime.stage_index_to_group_rank)


def schedule_from_csv(
    path: str, n_ranks: int, n_stages: int, n_microbatches: int
) -> tuple[dict[int, list[Any]], dict[int, list[Any]]]:
    """``(pipeline_order, pipeline_order_with_comms)`` as ``_PipelineScheduleRuntime._load_csv``
    reads a compute-only CSV (one row per rank, one action per cell)."""
    runtime = _runtime_on_stand_ins(n_ranks, n_stages, n_microbatches)
    runtime._load_csv(path)
    return dict(runtime.pipeline_order), dict(runtime.pipeline_order_with_comms)


def runtime_schedule(stages: Sequence[Any], n_microbatches: int, order: dict[int, list[Any]], **kwargs: Any) -> Any:
    """A ``_PipelineScheduleRuntime`` over this rank's ``stages`` running the
    compute-only action ``order`` (all ranks), set up as its ``_load_csv`` does:
    ``pipeline_order`` assigned, then ``_prepare_schedule_with_comms`` (which
    validates it, takes the stage placement from it and lowers it).
    ``kwargs`` go to the constructor (``loss_fn``, ``scale_grads``, ...)."""
    runtime = _pipelining_schedules()._PipelineScheduleRuntime(list(stages), n_microbatches, **kwargs)
    runtime.pipeline_order = {r: list(a) for r, a in order.items()}
    runtime._prepare_schedule_with_comms(runtime.pipeline_order)
    return runtime
