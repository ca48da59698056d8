"""Public split-backward API: a drop-in for ``torch.distributed.pipelining._backward``.

``stage_backward_input`` (B) computes the gradients of the stage inputs and
does no weight-gradient work; ``stage_backward_weight`` (W) does that work
later and accumulates into ``.grad``; ``stage_backward`` is the full
backward. fxsplit-compiled regions are split by their compiled dI/dW
graphs; everything else by the eager reverse closure (:mod:`fxsplit.stage_plan`).

Misuse (W without B, W twice, B twice, gradients that do not match the
outputs, another module's weights, double backward, compiled autograd)
raises before any work is done, so every ``.grad`` and all pending W work
stay as they were. W itself is transactional (:mod:`fxsplit.pending`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import operator
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from fxsplit import _torch_internals as ti
from fxsplit import config
from fxsplit.stage_plan import EagerWeightPlan, gradient_edge, plan_stage, prepare_regions
from fxsplit.pending import PendingWeightGrads
from fxsplit.runtime import DeferredGrad, InputCall, registered, run_directly

log = logging.getLogger("fxsplit")
# B and W ask log.isEnabledFor(logging.DEBUG) on every call. The answers it keeps
# (logging.Logger._cache: emptied, never replaced, when any level changes): where
# they hold "DEBUG is off", one dict read answers instead of a call.
_LEVELS: dict[int, bool] = getattr(log, "_cache", {})

__all__ = [
    "MissingOutputGradError",
    "PendingWeightGrads",
    "explain",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
]

Output = torch.Tensor | GradientEdge
Weights = Iterable[torch.Tensor] | Iterator[torch.nn.Parameter]


def explain(param_groups: PendingWeightGrads) -> str:
    """Which path each part of a stage's backward took (B) and will take (W).

    ``param_groups`` is what :func:`stage_backward_input` returned.
    """
    if not isinstance(param_groups, PendingWeightGrads):
        raise TypeError(f"fxsplit.explain needs a PendingWeightGrads, got {type(param_groups).__name__}")
    return param_groups.explain()


class MissingOutputGradError(ValueError, AssertionError):
    """A ``GradientEdge`` stage output was given no gradient.

    A ``ValueError`` like fxsplit's other argument errors, and also an
    ``AssertionError``, which is what upstream's ``stage_backward_input``
    raises for this case.
    """


# B marks what it ran on (B twice on one microbatch's outputs is an error):
# the autograd node of each non-leaf output (its ``metadata``), and the output
# tensor itself, which B detaches in place (then it has no node to mark). An
# attribute, not a WeakSet: set membership would compare tensors with ==.
# Leaves (a parameter returned as an output) are never marked: they are the
# same tensor in every microbatch. A marked tensor that has a node again is a
# new forward's output: Inductor's cudagraph trees (mode="reduce-overhead")
# return the same tensor object from every replay of a forward.
_B_DONE = "_fxsplit_b_done"
_GRAD_OF = ti.grad_of
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SEQUENCES = (list, tuple)
_GRAD_FN = operator.attrgetter("grad_fn")
_METADATA = operator.attrgetter("metadata")
_B_MARK = operator.methodcaller("get", _B_DONE)
_META = operator.attrgetter("shape", "dtype", "device")
_TENSOR_HOOKS = operator.attrgetter("_backward_hooks")
_RETAINS_GRAD = operator.attrgetter("retains_grad")
_OUTPUT_NR = operator.attrgetter("output_nr")
_NONES = itertools.repeat(None)


def _b_ran_on(o: torch.Tensor) -> bool:
    """Whether B already ran on this output of this forward: detached by B, or
    (a view B could not detach) still on the node B ran from."""
    node = o.grad_fn
    if node is None:
        return getattr(o, _B_DONE, False)
    return bool(node.metadata.get(_B_DONE, False))


def _refuse_create_graph() -> None:
    """Raise for ``create_graph=True`` (each caller checks the flag itself: B and W do on every call)."""
    raise NotImplementedError(
        "fxsplit: create_graph=True (double backward) is not supported through a split backward; "
        "use torch.autograd.grad(..., create_graph=True) on the unsplit graph instead"
    )


def _refuse_compiled_autograd(what: str, regions: int) -> None:
    """Compiled autograd traces every node's backward into one graph, inlining a
    compiled region's whole backward instead of calling its runtime, so the
    split cannot happen there (B would record no W work). Stages without
    fxsplit regions split correctly under it and are let through. Called
    where compiled autograd is enabled."""
    if regions:
        raise RuntimeError(
            f"fxsplit: {what} cannot split the backward of {regions} fxsplit-compiled region(s) under "
            "compiled autograd (torch._dynamo.compiled_autograd): it inlines each region's whole backward "
            "into its own graph. Call stage_backward_input/stage_backward_weight outside compiled "
            "autograd; ordinary backward and fxsplit.stage_backward may use it"
        )


def _flatten_outputs(outputs: Any, grads: Any) -> tuple[list[Output], list[Any]]:
    """Pair every tensor (or GradientEdge) in a nested output with its gradient.

    ``grads`` is ``None`` (all gradients implicit) or has the same structure
    as ``outputs``. Outputs that do not require grad are dropped. Raises
    ``RuntimeError`` for an output a split backward already ran on.
    """
    if isinstance(outputs, (torch.Tensor, GradientEdge)):
        outputs = [outputs]
        if isinstance(grads, torch.Tensor):
            grads = [grads]
    outs: list[Output] = []
    gs: list[Any] = []
    _visit_output(outputs, grads, "stage output", outs, gs)
    return outs, gs


def _plain_pairs(outputs: Any, grads: Any) -> list[Node] | None:
    """The outputs' autograd nodes where ``outputs`` and ``grads`` are flat
    sequences of one length of plain tensors, each output requiring grad with
    an autograd node B has not run from, each gradient of its output's shape,
    dtype and device and not requiring grad: the common case, all of
    :func:`_flatten_outputs` and :func:`_check_grads` decided in C-level
    passes; else ``None``."""
    if type(outputs) not in _SEQUENCES or type(grads) not in _SEQUENCES or len(grads) != len(outputs):
        return None
    if not ti.all_plain([*outputs, *grads]) or any(map(_REQUIRES_GRAD, grads)):
        return None
    nodes = list(map(_GRAD_FN, outputs))
    if None in nodes or any(map(_B_MARK, map(_METADATA, nodes))):
        return None  # (a leaf, a detached output, or one B ran from: checked one by one)
    return nodes if list(map(_META, grads)) == list(map(_META, outputs)) else None


# A module-level function, not a recursive closure: a closure that refers to
# itself is a reference cycle that would keep the stage outputs alive until
# the garbage collector runs (the "ref cycle" note in upstream's _backward.py).
def _visit_output(o: Any, g: Any, path: str, outs: list[Output], gs: list[Any]) -> None:
    if isinstance(o, GradientEdge):
        outs.append(o)
        gs.append(g)
    elif isinstance(o, torch.Tensor):
        if _b_ran_on(o):
            raise RuntimeError(
                f"fxsplit: stage_backward_input already ran on {path}; B runs once per microbatch "
                "(the pending W work of that B is unchanged)"
            )
        if not o.requires_grad and o.grad_fn is None:
            return
        if g is not None and not isinstance(g, torch.Tensor):
            raise TypeError(f"fxsplit: the gradient for {path} must be a Tensor or None, got {type(g).__name__}")
        outs.append(o)
        gs.append(g)
    elif isinstance(o, (list, tuple)):
        if g is not None and (not isinstance(g, (list, tuple)) or len(g) != len(o)):
            got = f"{type(g).__name__} of length {len(g)}" if isinstance(g, (list, tuple)) else type(g).__name__
            raise ValueError(f"fxsplit: output_grads for {path} must be a sequence of length {len(o)}, got {got}")
        for k, item in enumerate(o):
            _visit_output(item, None if g is None else g[k], f"{path}[{k}]", outs, gs)
    elif isinstance(o, dict):
        if g is not None and (not isinstance(g, dict) or set(g) != set(o)):
            raise ValueError(f"fxsplit: output_grads for {path} must be a dict with keys {sorted(map(str, o))}")
        for k, item in o.items():
            _visit_output(item, None if g is None else g[k], f"{path}[{k!r}]", outs, gs)
    # anything else (ints, strings, None) carries no gradient


def _check_grads(outs: Sequence[Output], grads: list[Any]) -> list[torch.Tensor]:
    """Validate gradients against outputs; fill implicit ones for scalars. Raises before any work."""
    checked: list[torch.Tensor] = []
    for k, (o, g) in enumerate(zip(outs, grads)):
        if isinstance(o, GradientEdge):
            if g is None:
                raise MissingOutputGradError(
                    f"fxsplit: stage output {k} is a GradientEdge ({o.node.name()}) and requires output "
                    "gradients: pass its gradient in output_grads (a GradientEdge has no shape to make an "
                    "implicit one from)"
                )
            checked.append(g)
            continue
        if g is None:
            if o.numel() != 1:
                raise ValueError(
                    f"fxsplit: no gradient given for stage output {k} of shape {tuple(o.shape)}; "
                    "an implicit gradient exists only for scalar outputs (a loss)"
                )
            g = torch.ones_like(o)
        if g.shape != o.shape:
            raise ValueError(
                f"fxsplit: output gradient {k} has shape {tuple(g.shape)} but the stage output has shape "
                f"{tuple(o.shape)}"
            )
        if g.dtype != o.dtype:
            raise ValueError(
                f"fxsplit: output gradient {k} has dtype {g.dtype} but the stage output has dtype {o.dtype}"
            )
        if g.device != o.device:  # (autograd's engine checks it too; B may call a region's node itself)
            raise ValueError(
                f"fxsplit: output gradient {k} is on {g.device} but the stage output is on {o.device}"
            )
        if g.requires_grad:
            raise NotImplementedError(
                f"fxsplit: output gradient {k} requires grad: double backward (create_graph=True) is not "
                "supported through a split backward"
            )
        checked.append(g)
    return checked


def _light_edge(o: Output) -> Output:
    """The edge a stage output's gradient flows into, without the ownership
    token ``get_gradient_edge`` makes for a Python autograd node (a view op):
    only for B's own use, while the output keeps its graph alive."""
    if isinstance(o, torch.Tensor) and o.grad_fn is not None:
        return GradientEdge(o.grad_fn, o.output_nr)
    return gradient_edge(o)


def _weights_list(weights: Weights) -> list[torch.Tensor]:
    result = list(weights)
    # Parameters are leaf tensors: the common case is checked in one pass.
    if all(map(isinstance, result, itertools.repeat(torch.nn.Parameter))):
        return result
    for w in result:
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"fxsplit: weights must be tensors, got {type(w).__name__}")
        if w.requires_grad and w.grad_fn is not None:
            raise ValueError(
                f"fxsplit: weights must be leaf tensors (parameters); got a non-leaf tensor of shape "
                f"{tuple(w.shape)} produced by {w.grad_fn.name()}"
            )
    return result


def stage_backward_input(
    stage_outputs_or_loss: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    weights: Weights,
    *,
    create_graph: bool = False,
) -> tuple[tuple[torch.Tensor | None, ...], PendingWeightGrads]:
    """B: gradients of the stage inputs, with no weight-gradient work.

    Same signature and ``.grad`` effects as
    ``torch.distributed.pipelining._backward.stage_backward_input``: returns
    ``(dinputs, param_groups)`` with ``dinputs[i]`` the gradient of
    ``input_values[i]`` (``None`` for non-tensors and inputs that need no
    gradient), accumulates each dinput into its input's ``.grad``, leaves every
    weight's ``.grad`` untouched (no weight hook fires), and detaches the
    (non-view, non-leaf) stage outputs in place, as upstream does; where eager
    code that W re-runs saved an output itself (a linear holding a weight
    consumed it), that saved reference is kept valid through the detach, so W
    works wherever ordinary backward would. ``param_groups`` is a
    :class:`PendingWeightGrads` to pass to :func:`stage_backward_weight`
    (once, or again after a W that raised).

    A first stage (no input needs a gradient) still does its share at B: every compiled region
    runs its dI graph (the activation-gradient chain through the region) and the eager code
    above the regions runs up to them, so W is left with the weight-gradient work; eager code
    below the regions, and a stage with no region, run at W (see :mod:`fxsplit.stage_plan`).

    Only this call's autograd call is split (the regions it runs are registered
    on their nodes while it runs): other backward calls stay ordinary.

    ``stage_outputs_or_loss`` may be a tensor, a ``GradientEdge``, or a nested
    list/tuple/dict of them; ``output_grads`` is ``None`` (scalar losses) or has
    the same structure (required for ``GradientEdge`` outputs). Before doing
    any work, raises ``ValueError``/``TypeError`` if the gradients do not match
    the outputs or the weights are not the stage's
    (:class:`MissingOutputGradError` for a ``GradientEdge`` without gradient),
    ``RuntimeError`` if B already ran on these outputs, another split call runs
    through the same graph, or compiled autograd is on and the stage has
    fxsplit regions, and ``NotImplementedError`` for ``create_graph=True``.
    """
    t0 = time.perf_counter_ns()
    outs, grads, weights, nodes = _checked_call(stage_outputs_or_loss, output_grads, weights, create_graph)
    needed = _needs_gradient(input_values)
    xs = list(itertools.compress(input_values, needed))
    plan = plan_stage(outs, nodes if nodes is not None else [_light_edge(o).node for o in outs], xs, weights)
    if xs or plan.captures:
        if ti.compiled_autograd_enabled():
            _refuse_compiled_autograd("stage_backward_input", len(plan.split_regions))
        if not plan.prepared:
            prepare_regions(plan.split_regions)
    call, saved, results = _run_b(plan, outs, nodes, grads, xs, weights)
    dinputs = _into_inputs(needed, xs, results)
    del results
    work = _record_b(plan, call, saved, outs, grads)
    work.timings["b_ns"] = time.perf_counter_ns() - t0
    return dinputs, work


def _needs_gradient(values: Sequence[Any]) -> list[bool]:
    """Which of the stage's input values are tensors that need a gradient."""
    if ti.all_plain(values):
        return list(map(_REQUIRES_GRAD, values))
    return [isinstance(v, torch.Tensor) and v.requires_grad for v in values]


def _into_inputs(
    needed: list[bool], xs: list[torch.Tensor], results: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor | None, ...]:
    """B's ``dinputs``, one per input value (``needed``: whether it needs a
    gradient; ``xs``: those that do, ``results`` their gradients), each
    accumulated into its input's ``.grad`` as upstream does."""
    for x, g in zip(xs, results):
        if g is not None:
            if x.grad is None:
                x.grad = g
            else:
                x.grad += g
    if len(results) == len(needed):  # (every input needs one)
        return tuple(results)
    dinputs = [None] * len(needed)  # (results: one per input that needs one; none where B had nothing to run)
    collections.deque(map(dinputs.__setitem__, itertools.compress(itertools.count(), needed), results), maxlen=0)
    return tuple(dinputs)


def _checked_call(
    outputs: Any, output_grads: Any, weights: Weights, create_graph: bool
) -> tuple[list[Output], list[torch.Tensor], list[torch.Tensor], list[Node] | None]:
    """B's arguments as flat lists of outputs, their gradients (checked, implicit
    ones made) and weights, and the outputs' autograd nodes where every output
    is a plain tensor (:func:`_plain_pairs`; else ``None``); raises, naming the
    problem, before any work."""
    if create_graph:
        _refuse_create_graph()
    if config.direct_b is not True and config.direct_b is not False and config.direct_b != "auto":
        config.current("direct_b")  # raises ValueError, naming the option
    if config.skip_aot_wrapper is not True and config.skip_aot_wrapper is not False:
        config.current("skip_aot_wrapper")
    weights = _weights_list(weights)
    nodes = _plain_pairs(outputs, output_grads)
    if nodes is not None:
        return list(outputs), list(output_grads), weights, nodes
    outs, grads = _flatten_outputs(outputs, output_grads)
    return outs, _check_grads(outs, grads), weights, None


def _run_b(
    plan: EagerWeightPlan, outs: list[Output], nodes: list[Node] | None, grads: list[torch.Tensor],
    xs: list[torch.Tensor], weights: list[torch.Tensor],
) -> tuple[PendingWeightGrads, list[tuple[torch.Tensor | None, ...] | None], Sequence[torch.Tensor | None]]:
    """B's autograd call, as ``plan`` says: the regions it runs record their W
    work in the returned call (the W work, to complete: :func:`_record_b`),
    the gradients flowing into the intermediates are saved for W, and the
    input gradients (one per ``xs``) are returned.
    ``nodes``: the outputs' nodes where all are plain tensors (else ``None``)."""
    retain = bool(plan.intermediates)  # W re-runs eager nodes: only then is the graph kept
    call = PendingWeightGrads(weights, plan, retain)
    try:
        if not outs or not (xs or plan.captures):  # (nothing for B to run: W runs the eager groups)
            return call, [None] * len(plan.intermediates), ()
        direct = None if retain else _direct_call(plan, outs, nodes, grads, xs)
        if direct is not None:  # (the node is registered for its call only)
            call.release_first = call.direct = True
            return call, [], _run_direct(*direct, xs, call)
        saved, results = _run_through_engine(plan, call, outs, grads, xs)
        return call, saved, results
    except NotImplementedError:
        raise
    except Exception as e:
        raise RuntimeError(f"fxsplit: stage_backward_input failed: {e}") from e


def _run_through_engine(
    plan: EagerWeightPlan, call: PendingWeightGrads, outs: list[Output], grads: list[torch.Tensor],
    xs: list[torch.Tensor],
) -> tuple[list[tuple[torch.Tensor | None, ...] | None], Sequence[torch.Tensor | None]]:
    """:func:`_run_b` through autograd's engine, with ``plan``'s regions
    registered for ``call``: the gradients saved for W (one per intermediate)
    and those of ``xs``. The graph is kept where ``call.retains_graph`` (the
    plan has intermediates, whose nodes W runs again)."""
    # B saves the gradient flowing into each eager intermediate for W. Each
    # hook writes into a plain list slot (no closure over the hook handle or
    # the node), and the hooks are removed before B returns.
    saved: list[tuple[torch.Tensor | None, ...] | None] = []
    handles: list[Any] = []
    if call.retains_graph or plan.once:  # (general plans only: a stage of compiled regions has neither)
        saved = [None] * len(plan.intermediates)
        handles = [node.register_prehook(functools.partial(_save_into, saved, k))
                   for k, node in enumerate(plan.intermediates)]
        _keep_outputs(plan.once, call.deferred, handles)
    captures, bottom = _captures(plan)
    try:
        with registered(plan.split_regions, call):
            results = _reach_targets(outs, grads, [*xs, *captures], call.retains_graph)
            if bottom:
                _run_bottom_regions(captures, bottom, call, results[len(xs):])
        # The graph is retained for the nodes W re-runs; free what the
        # nodes below the intermediates that only B needed saved.
        for node in plan.release:
            ti.release_saved_tensors(node)
    finally:
        for h in handles:
            h.remove()
    return saved, results[:len(xs)]


def _save_into(saved: list[Any], k: int, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
    saved[k] = tuple(grad_outputs)


def _reach_targets(
    outs: list[Output], grads: list[torch.Tensor], targets: list[torch.Tensor | GradientEdge], retain: bool,
) -> Sequence[torch.Tensor | None]:
    """The gradients of ``targets`` (the inputs, then the edges B captures)
    through autograd's engine."""
    if ti.all_plain(outs) and ti.all_plain(targets):  # (gradients checked: _check_grads)
        return ti.engine_grad(outs, grads, targets, retain)
    return torch.autograd.grad(outs, targets, grad_outputs=grads, retain_graph=retain, allow_unused=True)


def _captures(plan: EagerWeightPlan) -> tuple[list[GradientEdge], list[Node]]:
    """Where B's engine call stops below a first stage's regions, and the bottom
    regions B then runs itself (:func:`_run_bottom_regions`): ``plan.captures``
    and ``plan.bottom_regions``, but for a bottom region with a hook on its
    node (:func:`fxsplit._torch_internals.node_has_hooks`), which the engine
    runs, with its hooks, as ordinary backward does: the call stops below it
    instead, at an edge where capturing runs nothing else (:func:`_quiet_edge`).
    A hooked region with no such edge is run by B itself, its node's hooks
    not run, which is said once."""
    bottom = plan.bottom_regions
    if not any(map(ti.node_has_hooks, bottom)):
        return plan.captures, bottom
    below = {n: _quiet_edge(n) for n in bottom if ti.node_has_hooks(n)}
    for node in (n for n, e in below.items() if e is None and type(n) not in _HOOKS_NOT_RUN):
        _HOOKS_NOT_RUN.add(type(node))
        log.warning(
            "fxsplit: B: the hooks on %s (a compiled region at the bottom of a first stage) do not run: every "
            "edge below it is a weight with a tensor hook, which capturing a gradient there would call", node.name(),
        )
    engine = [n for n in bottom if below.get(n) is not None]
    captures = [*(e for e in plan.captures if e.node not in engine), *map(below.__getitem__, engine)]
    return captures, [n for n in bottom if n not in engine]


# Region node classes whose hooks B said it cannot run (_captures); weakly, as regions come and go.
_HOOKS_NOT_RUN: weakref.WeakSet[type] = weakref.WeakSet()


def _quiet_edge(node: Node) -> GradientEdge | None:
    """An edge below ``node`` where an engine call can stop, capturing a gradient,
    with nothing a user sees run: the grad accumulator of a leaf with no tensor
    hook (the engine runs a captured leaf's tensor hooks, not its accumulator
    or the hooks after it). ``None`` where there is none."""
    accumulate_grad = ti.accumulate_grad_type()
    for child, nr in node.next_functions:
        if type(child) is accumulate_grad and not child.variable._backward_hooks:
            return GradientEdge(child, nr)
    return None


def _record_b(
    plan: EagerWeightPlan, work: PendingWeightGrads,
    saved: list[tuple[torch.Tensor | None, ...] | None], outs: list[Output],
    grads: list[torch.Tensor],
) -> PendingWeightGrads:
    """What B leaves for W (``work``, which B's call filled, completed), and the
    outputs marked as B's (detached in place where they may be)."""
    if plan.groups:
        # W starts autograd at some outputs: edges that keep their graph alive (read before B detaches them).
        work.hand_over(saved, [gradient_edge(o) for o in outs], grads)
    else:
        work.plan = None  # (nothing to hand over: the plan, and the nodes it holds, let go of)
    if work.retains_graph:  # torch 2.11: W's nodes would die with the outputs' graph (see graph_anchor)
        anchors = [a for a in (ti.graph_anchor(o) for o in outs if isinstance(o, torch.Tensor)) if a is not None]
        if anchors:
            # The anchors keep the graph above the intermediates alive too, which
            # detaching the outputs frees everywhere else: free what it saved.
            for node in plan.above:
                ti.release_saved_tensors(node)
        work.anchor(anchors)
    for o, users in zip(outs, plan.output_users):
        if isinstance(o, torch.Tensor) and o.grad_fn is not None:
            o.grad_fn.metadata[_B_DONE] = True
            setattr(o, _B_DONE, True)
            # Frees the graph above the outputs that nothing needs any more.
            # Views cannot be detached in place (upstream's fix: skip them).
            # A node W runs may have saved the output itself (eager code
            # holding a weight consumed it): its saved reference is made to
            # survive the detach, or the output stays attached.
            if not o._is_view() and (not users or ti.keep_saved_through_detach(users, o)):
                o.detach_()
    if _LEVELS.get(logging.DEBUG, True) and log.isEnabledFor(logging.DEBUG):  # (one dict read: see _LEVELS)
        log.debug(
            "fxsplit: B: dI ran compiled in %s, eager autograd for the rest; W pending: %s",
            ", ".join(sorted({r.region for r in work.compiled})) or "no region", work.summary(),
        )
    return work


def _keep_outputs(nodes: Sequence[Any], into: list[DeferredGrad], handles: list[Any]) -> None:
    """Hooks keeping, for W, what each of ``nodes`` produces along its edges when B
    runs it: nodes that compute every edge's gradient in one call run once
    (``EagerWeightPlan.once``); ``PendingWeightGrads.hand_over`` keeps the W-side ones."""
    for node in nodes:

        def keep(grads: tuple[torch.Tensor | None, ...], _: Any, node: Any = node) -> None:
            for (child, nr), g in zip(node.next_functions, grads):
                if g is not None and child is not None:
                    into.append(DeferredGrad(node, child, nr, g))

        handles.append(node.register_hook(keep))


def _direct_call(
    plan: EagerWeightPlan, outs: list[Any], nodes: list[Node] | None, grads: list[torch.Tensor],
    xs: list[torch.Tensor],
) -> tuple[Any, dict[int, torch.Tensor], list[int]] | None:
    """``(node, gradients by output, edge of each target)`` where B may call the
    stage's one region node itself instead of the engine
    (:data:`fxsplit.config.direct_b`; by default not for CPU tensors but in a
    first stage, where the engine would only hand B the output gradients), else
    ``None``: every output a plain tensor (``nodes``: their nodes, where
    :func:`_plain_pairs` read them) of the node's, each once, as is every target; every
    forward argument of the region a tensor (the node's results are then its
    edges'); each target entering the node by one edge of its own; no tensor
    hook or ``retain_grad`` on any of them, no hook on the node (the engine
    would run them: :func:`fxsplit._torch_internals.node_has_hooks`); anomaly
    mode off; on CUDA, the current stream the default one."""
    flag, edges = config.direct_b, plan.direct_edges
    # (every target plain, and every output: _plain_pairs checked them where it read their nodes)
    if edges is None or flag is False or torch.is_anomaly_enabled() or not ti.all_plain(xs if nodes else [*xs, *outs]):
        return None
    device = outs[0].device
    if device.type == "cpu" and flag is not True and edges:
        return None  # "auto": the engine runs a CPU backward in the calling thread; nothing to save
    (node,) = plan.split_regions
    if not all(map(operator.is_, nodes if nodes is not None else map(_GRAD_FN, outs), itertools.repeat(node))):
        return None
    ends = [*outs, *xs]  # (what the engine would run on the way into the node or out of it to a target)
    if any(map(_TENSOR_HOOKS, ends)) or any(map(_RETAINS_GRAD, ends)) or ti.node_has_hooks(node):
        return None
    by_output = dict(zip(map(_OUTPUT_NR, outs), grads))
    if len(by_output) != len(outs):
        return None  # (an output twice)
    if device.type == "cuda" and torch.cuda.current_stream(device) != torch.cuda.default_stream(device):
        return None
    return node, by_output, edges


def _run_direct(
    node: Any, grads: dict[int, torch.Tensor], edges: list[int], targets: list[torch.Tensor], call: InputCall
) -> tuple[torch.Tensor | None, ...]:
    """B's engine call, made by calling the region's node itself
    (:func:`_direct_call` says where): each target's gradient. The region's
    boundary guard (:class:`fxsplit.layouts.BoundaryGuard`) has made each the
    shape, dtype and device the region was compiled for, the input's, which
    the engine's ``validate_outputs`` checks; a target whose metadata changed
    since the forward raises ``RuntimeError``, naming it."""
    results = run_directly(node, grads, call)
    if not isinstance(results, (tuple, list)):
        results = (results,)
    picked = tuple(map(results.__getitem__, edges))
    if all(map(operator.is_not, picked, _NONES)) and list(map(_META, picked)) == list(map(_META, targets)):
        return picked  # (the common case: each as its target is, checked at once)
    for g, x in zip(picked, targets):
        if g is not None and _META(g) != _META(x):
            raise RuntimeError(
                f"fxsplit: the gradient of a stage input is {tuple(g.shape)} {g.dtype} on {g.device}, "
                f"the input {tuple(x.shape)} {x.dtype} on {x.device}: was it changed after the forward?"
            )
    return picked


def _run_bottom_regions(
    captures: list[GradientEdge], bottom: list[Node], call: PendingWeightGrads, captured: Sequence[torch.Tensor | None],
) -> None:
    """A first stage's B, second half: each ``bottom`` region's dI graph,
    called by B itself (``call`` registered), on the gradients B's autograd
    call captured flowing into it (``captured``, one per ``captures``).
    Unless W's eager calls pass through it, it frees
    the activations it saved before its dI graph runs, so that dI frees each
    after its last use, as AOTAutograd does under an engine call that keeps
    no graph (:attr:`fxsplit.runtime.InputCall.release_first`)."""
    grads: dict[Any, dict[int, torch.Tensor]] = {n: {} for n in bottom}
    for edge, g in zip(captures, captured):
        if g is not None and edge.node in grads:
            grads[edge.node][edge.output_nr] = g
    call.release_first = True
    for node in bottom:
        run_directly(node, grads.pop(node))


def _check_weight_call(weights: list[torch.Tensor], param_groups: Any) -> PendingWeightGrads:
    if not isinstance(param_groups, PendingWeightGrads):
        raise TypeError(
            "fxsplit: stage_backward_weight needs the param_groups returned by fxsplit.stage_backward_input "
            f"for the same microbatch (W with no matching B); got {type(param_groups).__name__}"
        )
    expected_weights = param_groups._weights
    if len(expected_weights) == len(weights) and all(map(operator.is_, expected_weights, weights)):
        return param_groups  # the same weights in the same order: the common case
    given = {id(w) for w in weights}
    expected = {id(w) for w in param_groups.weights}
    if given != expected:
        extra = sum(1 for w in weights if id(w) not in expected)
        missing = sum(1 for w in param_groups.weights if id(w) not in given)
        raise ValueError(
            "fxsplit: stage_backward_weight got weights that differ from those given to stage_backward_input "
            f"({extra} do not belong to the stage's B, {missing} missing); pass the same weights to B and W "
            "(the pending W work is unchanged)"
        )
    return param_groups


def stage_backward_weight(
    weights: Weights,
    param_groups: PendingWeightGrads,
    retain_graph: bool = False,
    *,
    create_graph: bool = False,
    fused_accumulation: bool | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """W: weight gradients for the microbatch ``param_groups`` came from, accumulated into ``.grad``.

    ``weights`` must be the weights given to the matching
    :func:`stage_backward_input`. Compiled regions run their dW graphs on the
    saved live-ins and eager code runs autograd from what B saved; every
    gradient is computed before any ``.grad`` is touched, then autograd
    accumulates them (hooks, layout, ``grad_dtype`` as in ordinary backward;
    see :mod:`fxsplit.pending`). Returns the weights' ``.grad`` after
    accumulation.

    ``retain_graph`` is accepted for upstream compatibility: W keeps the
    eager graph it runs until it completes (so that a failed W can be
    repeated) and then drops its references to it, whichever the value.

    ``fused_accumulation`` (keyword, fxsplit only): ``False`` hands every
    gradient to autograd's accumulation; ``None`` (default) lets a weight
    that already has a ``.grad`` and nothing observing its accumulation
    (see ``fxsplit.config.fused_accumulation``) accumulate inside its
    region's dW graph, unless the region's backend or
    ``fxsplit.config.fused_accumulation`` turned that off; ``True``
    ignores the config (a region's ``fused_accumulation=False`` still holds).
    ``param_groups.accumulated_in_graph`` says which weights took that path.
    Callers whose weights carry hooks on their grad accumulator node (DDP's
    reducer) pass ``False``.

    Raises, with nothing changed, ``TypeError`` if ``param_groups`` did not
    come from :func:`stage_backward_input`, ``RuntimeError`` if W already
    completed for it (or runs in another thread, or compiled autograd is
    enabled), ``ValueError`` if ``weights`` differ from B's, and
    ``NotImplementedError`` for ``create_graph=True``. An exception while W
    runs (a dW graph, a hook, out of memory, ``KeyboardInterrupt``) leaves the
    weights not yet accumulated pending: call W again with the same arguments.
    """
    if create_graph:
        _refuse_create_graph()
    weights = list(weights)
    if fused_accumulation not in (None, True, False):
        raise TypeError(f"fxsplit: fused_accumulation must be True, False or None, got {fused_accumulation!r}")
    work = _check_weight_call(weights, param_groups)
    if ti.compiled_autograd_enabled():
        _refuse_compiled_autograd("stage_backward_weight", work.regions_passed_through)
    message = _w_message(work) if _LEVELS.get(logging.DEBUG, True) and log.isEnabledFor(logging.DEBUG) else ""
    work.run(fused_accumulation)
    if message:
        log.debug("%s", message)
    return tuple(map(_GRAD_OF, weights))


def _w_message(work: PendingWeightGrads) -> str:
    return (
        "fxsplit: W: compiled dW in {}; eager autograd for {} weight(s) from {} intermediate(s) and {} edge(s); "
        "committed through autograd".format(
            ", ".join(sorted({r.region for r in work.compiled})) or "no region",
            len(work.eager_weights),
            sum(len(g.intermediates) for g in work.groups),
            sum(len(g.edges) for g in work.groups),
        )
    )


def stage_backward(
    stage_output: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    outputs_with_grads_idxs: list[int] | None = None,
    *,
    create_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Full backward of a stage (B and W together), as upstream's ``stage_backward``.

    Accumulates into every weight's ``.grad`` and returns the gradients of
    ``input_values`` (``None`` for non-tensors), clearing the inputs' ``.grad``
    as upstream does. fxsplit-compiled regions run their fused backward.
    Gradients are checked as in :func:`stage_backward_input`.
    """
    if create_graph:
        _refuse_create_graph()
    if outputs_with_grads_idxs is not None:
        stage_output = [stage_output[i] for i in outputs_with_grads_idxs]
        output_grads = [output_grads[i] for i in outputs_with_grads_idxs]
    outs, grads_raw = _flatten_outputs(stage_output, output_grads)
    grads = _check_grads(outs, grads_raw)
    if outs:
        torch.autograd.backward(outs, grad_tensors=grads)
    result: list[torch.Tensor | None] = []
    for v in input_values:
        if isinstance(v, torch.Tensor):
            result.append(v.grad)
            v.grad = None
        else:
            result.append(None)
    return tuple(result)
