"""The W work B leaves for one microbatch, and W's commit through autograd.

:class:`PendingWeightGrads` holds exactly what W needs (compiled regions'
live-ins, the gradients B saved at eager intermediates, the dI values B
handed over, the output gradients of outputs whose backward is all weight
work). :meth:`PendingWeightGrads.run` is W:

1. **compute**: every compiled dW graph that does not accumulate into
   ``.grad`` runs on its live-ins. Pure: nothing a user can observe changes,
   and on an exception everything is still held.
1b. **accumulate in the graph** (fused accumulation): for a region whose
   weights already have a ``.grad`` that nothing observes being accumulated
   (:func:`accumulates_like_autograd`), a dW variant adds their gradients into
   ``.grad`` in place. Running it is the commit of those weights. Each write
   is bracketed by two operators the graph runs before and after it
   (``fxsplit::accumulation_begins`` / ``_ends``), recorded while the graph
   runs, so if it raises, each of its weights is known to be accumulated
   (both ran: it counts as committed), untouched (neither: still pending,
   computed again by the next W) or, where the exception fell between the
   two, unknown: the exception says so, naming the weights, and W refuses to
   run again rather than add a gradient twice or not at all.
1c. **into an empty ``.grad``**: where a weight's ``.grad`` is ``None`` and
   nothing observes its accumulation (the same conditions as 1b, and
   :func:`takes_gradient_like_autograd`), W sets ``.grad`` to the dW graph's
   gradient itself, as ``AccumulateGrad`` does when it takes a gradient
   nobody else holds: no engine call (``handed_over`` lists them).
2. **commit**: :func:`commit_weight_grads`, the one place where W changes
   ``.grad`` through autograd. Each call is one autograd engine call, as
   ``torch.autograd.backward(roots, grads, inputs=weights)`` makes: the roots
   are the eager W starts plus, for each weight with compiled gradients, an
   edge to its ``AccumulateGrad`` carrying them. So
   accumulation is autograd's own: tensor hooks and post-accumulate-grad
   hooks fire once per weight, ``.grad`` gets the parameter's layout and
   ``grad_dtype``, accumulates in place, and never aliases a tensor someone
   else holds. The compiled gradients reach the accumulators through one
   :class:`_HandOver` node that keeps no reference to them, so an empty
   ``.grad`` takes W's gradient without a copy, as after ordinary backward.
   One call per eager weight group (a call would otherwise re-run
   input-gradient work between groups) and one for the weights only compiled
   regions reach; a stage without eager weights commits in one call.
3. If a commit raises (a hook, out of memory, ``KeyboardInterrupt``), the
   weights that were accumulated are recorded as committed and
   everything else stays pending: the same object passed to W again finishes
   exactly the rest. The eager graph is run with ``retain_graph=True`` for
   that reason, and dropped when W completes.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from fxsplit import _torch_internals as ti
from fxsplit import config
from fxsplit.stage_plan import EagerWeightPlan
from fxsplit.runtime import SPLIT_DONE, CompiledWeightWork, DeferredGrad, registered

__all__ = [
    "EagerGroup", "PendingWeightGrads", "WeightCommit", "accumulates_like_autograd", "commit_weight_grads",
    "takes_gradient_like_autograd",
]


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@dataclasses.dataclass
class EagerGroup:
    """The eager part of W for a group of weights: one autograd call.

    W starts at ``intermediates`` (eager nodes B ran, re-run from the
    gradients ``grads`` B saved flowing into them; their input is pinned to
    those, so nothing reaching them from another start is counted twice) and
    at ``edges`` with ``edge_grads`` (dI values compiled regions computed in B
    for an eager weight, gradients a node that ran once in B produced for the
    weight side, and stage outputs whose backward is all weight work).
    ``edge_kinds`` says which (``"region"``, ``"once:<node name>"``, ``"output"``),
    for :meth:`PendingWeightGrads.explain`.
    """

    weights: tuple[torch.Tensor, ...]
    accumulators: tuple[Node, ...]
    intermediates: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None]
    edges: list[GradientEdge]
    edge_grads: list[torch.Tensor]
    edge_kinds: list[str]

    def starts(self) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        roots: list[GradientEdge] = []
        values: list[torch.Tensor] = []
        for node, grads in zip(self.intermediates, self.grads):
            for i, g in enumerate(grads or ()):
                if g is not None:
                    roots.append(GradientEdge(node, i))
                    values.append(g)
        return roots + list(self.edges), values + list(self.edge_grads)

    def pins(self) -> list[tuple[Node, tuple[torch.Tensor | None, ...]]]:
        return [(n, tuple(g)) for n, g in zip(self.intermediates, self.grads) if g is not None]

    def held_tensors(self) -> list[torch.Tensor]:
        held = [g for grads in self.grads for g in grads or () if isinstance(g, torch.Tensor)]
        return held + list(self.edge_grads)


@dataclasses.dataclass
class WeightCommit:
    """One autograd call of W's commit: ``roots`` with ``grads`` accumulate into
    ``weights`` through their grad ``accumulators`` (``inputs=``); ``pins``
    fix the gradient flowing into a node."""

    roots: list[GradientEdge]
    grads: list[torch.Tensor]
    weights: list[torch.Tensor]
    accumulators: list[Node]
    pins: list[tuple[Node, tuple[torch.Tensor | None, ...]]] = dataclasses.field(default_factory=list)


def _engine_commit(gradients: Sequence[tuple[torch.Tensor, Node, Sequence[torch.Tensor]]]) -> WeightCommit:
    """One autograd call committing ``(weight, accumulator, its gradients)``:
    a weight with gradients from several regions gets several roots on the
    same edge, which the engine sums (casting each to ``grad_dtype`` first)."""
    roots = [GradientEdge(acc, 0) for _, acc, gs in gradients for _ in gs]
    values = [g for _, _, gs in gradients for g in gs]
    return WeightCommit(roots, values, [w for w, _, _ in gradients], [acc for _, acc, _ in gradients])


class _HandOver(torch.autograd.Function):
    """An autograd node whose backward returns W's gradients for leaf weights
    and keeps no reference to them.

    A gradient given to the engine as a root is also referenced by the caller,
    and ``AccumulateGrad`` copies a gradient that someone else references into
    an empty ``.grad`` (so that ``.grad`` never aliases a tensor somebody
    holds). Handed over by this node, W's gradient is referenced by the engine
    only, so ``AccumulateGrad`` takes it as it takes the compiled backward's
    output after ordinary backward: the first microbatch's W does not copy
    every weight gradient. A gradient anyone else still references is copied,
    as autograd always does."""

    @staticmethod
    def forward(ctx: Any, holder: list[torch.Tensor], *weights: torch.Tensor) -> torch.Tensor:
        ctx.holder = holder
        return torch.empty(())

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        holder = ctx.holder
        del ctx.holder
        grads = tuple(holder)
        holder.clear()
        return (None, *grads)


def _hand_over(commit: WeightCommit) -> tuple[list[GradientEdge | torch.Tensor], list[torch.Tensor]]:
    """The roots and gradients of ``commit``'s engine call, with every
    gradient that is the only one for a plain leaf weight moved out of
    ``commit`` into one :class:`_HandOver` root (see there). Gradients of
    weights with several roots (the engine sums them) and eager starts stay
    roots as they are."""
    weight_of = {acc: w for w, acc in zip(commit.weights, commit.accumulators)}
    count: dict[Node, int] = {}
    for edge in commit.roots:
        count[edge.node] = count.get(edge.node, 0) + 1
    chosen = [
        k
        for k, (edge, g) in enumerate(zip(commit.roots, commit.grads))
        if count[edge.node] == 1
        and (w := weight_of.get(edge.node)) is not None
        and w.is_leaf
        and type(w) in (torch.nn.Parameter, torch.Tensor)
        and type(g) is torch.Tensor
    ]
    if not chosen or ti.compiled_autograd_enabled():  # it traces backward with a stand-in ctx
        return commit.roots, commit.grads
    weights = [weight_of[commit.roots[k].node] for k in chosen]
    holder = [commit.grads[k] for k in chosen]
    with torch.enable_grad():
        out = _HandOver.apply(holder, *weights)
    node = out.grad_fn
    if node is None or any(node.next_functions[i][0] is not commit.roots[k].node for i, k in enumerate(chosen)):
        holder.clear()  # not the accumulators W commits to: keep the plain roots
        return commit.roots, commit.grads
    picked = set(chosen)
    # Drop commit's own references (in place: callers may hold these lists).
    commit.roots[:] = [e for k, e in enumerate(commit.roots) if k not in picked]
    commit.grads[:] = [g for k, g in enumerate(commit.grads) if k not in picked]
    # The root is ``out`` itself, not an edge to its node: ``out`` owns the
    # node, and the Python object ``grad_fn`` returns only refers to it weakly
    # on some torch releases (2.11), so an edge alone would outlive the node.
    return [out, *commit.roots], [torch.ones(()), *commit.grads]


def commit_weight_grads(commit: WeightCommit, committed: set[int]) -> None:
    """Accumulate into ``.grad`` through autograd: the only place W changes ``.grad``.

    Adds to ``committed`` the ``id`` of every weight whose accumulation
    happened, also when the call raises: that weight then has its gradient
    and its remaining hooks are autograd's business, as in ordinary backward.
    The autograd graph is retained so that a failed call can be repeated for
    the weights not in ``committed``.

    Which weights accumulated is read off ``.grad`` (another tensor, or the
    same one at a new version). A post-accumulate-grad hook may put ``.grad``
    back as it was (an optimizer step in backward that sets it to ``None``),
    so for weights with such hooks a node pre-hook on the grad accumulator
    marks the start of accumulation instead: it runs after every tensor hook
    of the weight (engine order), right before accumulation.
    """
    before: list[tuple[int, torch.Tensor | None, int]] = []
    marked: list[int] = []
    handles = []
    try:
        for w, acc in zip(commit.weights, commit.accumulators):
            if getattr(w, "_post_accumulate_grad_hooks", None):
                handles.append(acc.register_prehook(lambda _grads, k=id(w): marked.append(k)))
            else:
                g = w.grad
                before.append((id(w), g, -1 if g is None else g._version))
        for node, saved in commit.pins:
            handles.append(node.register_prehook(lambda _grads, saved=saved: saved))
        roots, grads = _hand_over(commit)
        # inputs= as edges to the accumulators: the same as the weights, without
        # looking each accumulator up again.
        ti.engine_backward(roots, grads, [GradientEdge(acc, 0) for acc in commit.accumulators])
    finally:
        for h in handles:
            h.remove()
        committed.update(marked)
        by_id = {id(w): w for w in commit.weights}
        for k, g, version in before:
            now = by_id[k].grad
            if now is not g or (g is not None and g._version != version):
                committed.add(k)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory exactly once (no overlap, no
    gaps) in some order of its dimensions, as a transposed ``.grad`` does and
    an expanded one does not."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def accumulates_like_autograd(
    weight: torch.Tensor, grad_dtype: torch.dtype | None, avoid: set[int] = frozenset()  # type: ignore[assignment]
) -> bool:
    """Whether adding a gradient of dtype ``grad_dtype`` into ``weight.grad``
    in place, inside a compiled graph, is what autograd's accumulation would
    do, with nothing else to observe.

    Autograd adds into an existing dense ``.grad`` in place (no grad mode).
    What it does besides, and fused accumulation would skip, is visible from
    Python for: tensor hooks and post-accumulate-grad hooks (then no), a
    ``grad_dtype`` cast, a ``.grad`` of another dtype, device, shape or
    layout, a sparse, subclass, grad-requiring or overlapping (expanded)
    ``.grad``, a subclass weight. ``avoid``: storages (by data pointer) the compiled graph also
    reads, which ``.grad`` must not share. Hooks on the weight's grad
    accumulator node are invisible here (see ``fxsplit.config.fused_accumulation``).
    """
    g = weight.grad
    return (
        g is not None
        and grad_dtype is not None
        and type(g) is torch.Tensor
        and type(weight) in (torch.nn.Parameter, torch.Tensor)
        and g.layout == torch.strided
        and not g.requires_grad
        and g.dtype == grad_dtype
        and g.device == weight.device
        and g.shape == weight.shape
        and _dense(g)
        and not weight._backward_hooks
        and not getattr(weight, "_post_accumulate_grad_hooks", None)
        and getattr(weight, "grad_dtype", None) in (None, g.dtype)
        and ti.storage_ptr(g) not in avoid
    )


def takes_gradient_like_autograd(
    weight: torch.Tensor, grad: torch.Tensor, avoid: set[int] = frozenset()  # type: ignore[assignment]
) -> bool:
    """Whether setting ``weight.grad = grad`` (``weight.grad`` being ``None``)
    is what autograd's accumulation would do, with nothing else to observe.

    Into an empty ``.grad``, ``AccumulateGrad`` takes the gradient itself, no
    copy, when nobody else holds it and it has the weight's layout (the
    layout contract: the weight's strides where the weight is dense, else
    contiguous); it casts to ``grad_dtype`` and runs the weight's hooks. So:
    no tensor or post-accumulate-grad hooks, a plain strided gradient of the
    weight's dtype, device and shape in the weight's layout, not requiring
    grad, a plain weight, ``grad_dtype`` unset or equal, and a storage not in
    ``avoid`` (the live-ins and other gradients of the same W: a tensor
    someone else holds, which autograd would copy)."""
    return (
        weight.grad is None
        and _in_weight_layout(weight, grad)
        and _taken_unobserved(weight, grad, ti.storage_ptr(grad), avoid)
    )


def _in_weight_layout(weight: torch.Tensor, grad: Any) -> bool:
    """The part of :func:`takes_gradient_like_autograd` that is metadata of
    the two tensors only (what :func:`_direct_takes` guards at once)."""
    return (
        type(grad) is torch.Tensor
        and type(weight) in (torch.nn.Parameter, torch.Tensor)
        and grad.layout == torch.strided
        and not grad.requires_grad
        and grad.dtype == weight.dtype
        and grad.device == weight.device
        and grad.shape == weight.shape
        and (grad.stride() == weight.stride() if _dense(weight) else grad.is_contiguous())
    )


def _taken_unobserved(weight: torch.Tensor, grad: torch.Tensor, ptr: int, avoid: set[int]) -> bool:
    """The rest of :func:`takes_gradient_like_autograd`: what can change
    without any tensor's metadata changing (hooks, ``grad_dtype``, who else
    holds the gradient, whose storage is at ``ptr``). :func:`_all_taken`
    reads the same conditions over a whole region at once: keep the two in step."""
    return (
        not weight._backward_hooks
        and not getattr(weight, "_post_accumulate_grad_hooks", None)
        and getattr(weight, "grad_dtype", None) in (None, grad.dtype)
        and grad._base is None  # an autograd view: its base is held too (autograd would copy it)
        and ptr not in avoid
    )


# Per region (its runtime, weakly): a guard that passes exactly the weights
# and gradients with the metadata of those of an earlier W whose gradients all
# had their weight's layout (one C call instead of a Python check per weight;
# a dW graph returns the same layouts every call). Whether a gradient has its
# weight's layout (_in_weight_layout) is a function of that metadata only, so
# the guard needs not know which weights it was made on.
_DIRECT_GUARDS: weakref.WeakKeyDictionary[Any, tuple[int, Any]] = weakref.WeakKeyDictionary()


def _direct_takes(
    owner: Any, weights: list[torch.Tensor], grads: list[torch.Tensor], ptrs: list[int], avoid: set[int]
) -> list[bool]:
    """:func:`takes_gradient_like_autograd` for each pair (``.grad`` known to
    be ``None``; ``ptrs``: the gradients' storages), the metadata part decided
    once per region and set of weights, then guarded
    (:func:`fxsplit._torch_internals.metadata_guard`)."""
    if _guarded(owner, weights, grads):
        return [_taken_unobserved(w, g, ptr, avoid) for w, g, ptr in zip(weights, grads, ptrs)]
    laid_out = [_in_weight_layout(w, g) for w, g in zip(weights, grads)]
    if weights and all(laid_out):
        _remember_layout(owner, weights, grads)
    return [ok and _taken_unobserved(w, g, ptr, avoid) for ok, w, g, ptr in zip(laid_out, weights, grads, ptrs)]


def _guarded(owner: Any, weights: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
    """Whether the guard :func:`_remember_layout` kept for ``owner`` passes
    ``weights`` and ``grads``: then every pair is in its weight's layout
    (:func:`_in_weight_layout`)."""
    cached = _DIRECT_GUARDS.get(owner)
    return cached is not None and cached[0] == len(weights) and cached[1](*weights, *grads)


def _remember_layout(owner: Any, weights: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Keep a guard for ``owner`` that passes exactly weights and gradients
    with the metadata these have now (all in their weight's layout)."""
    guard = ti.metadata_guard([*weights, *grads])
    if guard is not None:
        _DIRECT_GUARDS[owner] = (len(weights), guard)


# Readers for C-level iteration over weights, gradients and (weight, ..., gradient) tuples.
_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_third = operator.itemgetter(2)
_requires_grad = operator.attrgetter("requires_grad")
_grad_of = ti.grad_of
_base_of = operator.attrgetter("_base")
_dtype_of = operator.attrgetter("dtype")
_tensor_hooks_of = operator.attrgetter("_backward_hooks")
_post_hooks_of = operator.attrgetter("_post_accumulate_grad_hooks")
_grad_dtype_of = operator.attrgetter("grad_dtype")
_deref = ti.deref


def _wanted_and_empty(weights: Sequence[torch.Tensor]) -> bool:
    """Every weight requires a gradient and has no ``.grad`` (C-level passes)."""
    return all(map(_requires_grad, weights)) and all(map(operator.is_, map(_grad_of, weights), itertools.repeat(None)))


def _grad_or_none(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.grad


# Every torch fxsplit supports has both on every tensor (None when unset);
# where one lacks them, the per-weight path below decides instead.
_BULK_ATTRIBUTES = all(hasattr(torch.Tensor, a) for a in ("_post_accumulate_grad_hooks", "grad_dtype"))


def _all_taken(
    record: CompiledWeightWork,
    weights: list[torch.Tensor],
    grads: list[torch.Tensor],
    distinct: bool = False,
    empty: bool = False,
) -> bool:
    """Whether :func:`takes_gradient_like_autograd` holds for every pair, all
    weights distinct, decided over the lists at once (C-level iteration, no
    per-weight Python): the guard where graphs meet (:func:`_guarded`), every
    ``.grad`` empty, no hooks, ``grad_dtype`` each gradient's dtype, no
    gradient a view, and each gradient alone at the start of its own storage,
    none of them held elsewhere (``record.holds_none_of``, asked last).
    ``distinct``: the caller knows the weights are distinct tensors;
    ``empty``: it knows every weight's ``.grad`` is ``None``.
    ``False`` says only that the per-weight check must decide (it is
    stricter than that check where a gradient sits at an offset in its
    storage or ``grad_dtype`` is unset)."""
    n = len(weights)
    if not n or not _BULK_ATTRIBUTES or not _guarded(record.owner, weights, grads):
        return False
    if not distinct and len(set(map(id, weights))) != n:
        return False
    if not empty and not all(map(operator.is_, map(_grad_of, weights), itertools.repeat(None, n))):
        return False
    if any(map(_tensor_hooks_of, weights)) or any(map(_post_hooks_of, weights)):
        return False
    if not all(map(operator.is_, map(_grad_dtype_of, weights), map(_dtype_of, grads))):
        return False
    if not all(map(operator.is_, map(_base_of, grads), itertools.repeat(None, n))):
        return False
    # At offset 0 a data pointer is its storage's (ti.storage_ptr): n distinct
    # pointers are n storages.
    if any(map(torch.Tensor.storage_offset, grads)):
        return False
    ptrs = set(map(torch.Tensor.data_ptr, grads))
    return len(ptrs) == n and record.holds_none_of(ptrs)


class _AccumulationCheck:
    """The outcome of :func:`accumulates_like_autograd` for one region's
    weights, kept for the weights and ``.grad`` tensors it was decided on
    (weakly), with each ``.grad``'s storage and dtype.

    What the check reads of a ``.grad`` tensor (its dtype, device, shape,
    layout, density, type, whether it requires grad) stays as long as it is
    the same tensor, so W decides once per set of ``.grad`` tensors; what can
    change on the weight without replacing ``.grad`` (hooks, ``grad_dtype``)
    is read again every time."""

    __slots__ = ("params", "grads", "positions", "storages", "dtypes", "layout")

    def __init__(self, params: tuple[Any, ...], grads: tuple[Any, ...], positions: tuple[int, ...],
                 storages: dict[int, int], dtypes: dict[int, torch.dtype], layout: Any = None) -> None:
        self.params = params
        self.grads = grads
        self.positions = positions
        self.storages = storages
        self.dtypes = dtypes
        # Where every position is a weight with a .grad: a check that passes
        # exactly weights and .grad tensors with the metadata of these
        # (ti.metadata_guard), all accumulates_like_autograd reads of them but
        # hooks, grad_dtype and storages, which are read again every W. A step's
        # new .grad tensors (zero_grad(set_to_none=True)) then keep the decision.
        self.layout = layout


_ACCUMULATION_CHECKS: weakref.WeakKeyDictionary[Any, _AccumulationCheck] = weakref.WeakKeyDictionary()


def _accumulating_like_autograd(record: CompiledWeightWork, wanted: set[int], multi: set[int]) -> tuple[int, ...]:
    """Positions (in ``record.params``) of the wanted weights, with a gradient
    from this record only, whose ``.grad`` W may add into in place inside the
    dW graph (:func:`accumulates_like_autograd`, and a ``.grad`` that shares
    no storage with the record's live-ins, which that graph reads)."""
    params = record.params
    owner = record.owner
    check = _ACCUMULATION_CHECKS.get(owner)
    if check is None or not _same(check, params):
        none = itertools.repeat(None)
        grads = list(map(_grad_or_none if any(map(operator.is_, params, none)) else _grad_of, params))
        if all(map(operator.is_, grads, none)):
            return ()  # nothing to add into (the first microbatch of a step)
        if check is not None and check.layout is not None and not any(map(operator.is_, grads, none)) and (
            check.layout(*params, *grads)
        ):  # other .grad tensors (a new step's) laid out as those decided on: the same decision
            check = _renewed(owner, check, params, grads)
        else:
            check = _decide(owner, params)
    if not check.positions:
        return ()
    chosen = list(map(params.__getitem__, check.positions))
    ids = list(map(id, chosen))
    if (
        _BULK_ATTRIBUTES
        and wanted.issuperset(ids)
        and multi.isdisjoint(ids)
        and not any(map(_tensor_hooks_of, chosen))
        and not any(map(_post_hooks_of, chosen))
        and all(map(operator.is_, map(_grad_dtype_of, chosen), map(check.dtypes.__getitem__, check.positions)))
    ):  # every weight the check allows: wanted, single-sourced, unhooked, grad_dtype its .grad's dtype
        live = record.live_in_storages()
        if live.isdisjoint(check.storages.values()):
            return check.positions
        return tuple(k for k in check.positions if check.storages[k] not in live)
    positions = []
    for k in check.positions:
        p = params[k]
        if (
            id(p) in wanted
            and id(p) not in multi
            and not p._backward_hooks
            and not getattr(p, "_post_accumulate_grad_hooks", None)
            and getattr(p, "grad_dtype", None) in (None, check.dtypes[k])
        ):
            positions.append(k)
    if positions:
        live = record.live_in_storages()
        positions = [k for k in positions if check.storages[k] not in live]
    return tuple(positions)


def _same(check: _AccumulationCheck, params: Sequence[Any]) -> bool:
    """Whether ``params`` and their ``.grad`` tensors are those ``check`` decided on."""
    if len(check.params) != len(params):
        return False
    none = itertools.repeat(None)
    if not any(map(operator.is_, check.params, none)) and not any(map(operator.is_, params, none)):
        # Every position a weight (the common case), decided in C-level passes: the
        # weights alive and the same, each .grad present (a dead reference reads None)
        # and the same.
        grads = list(map(_grad_of, params))
        return (
            not any(map(operator.is_, grads, none))
            and not any(map(operator.is_, check.grads, none))
            and all(map(operator.is_, map(_deref, check.params), params))
            and all(map(operator.is_, map(_deref, check.grads), grads))
        )
    for r, g, p in zip(check.params, check.grads, params):
        if p is None:
            if r is not None:
                return False
        else:
            grad = p.grad
            if r is None or g is None or grad is None or r() is not p or g() is not grad:
                return False
    return True


def _decide(owner: Any, params: Sequence[Any]) -> _AccumulationCheck:
    dtypes = owner.weight_grad_dtypes
    positions = tuple(
        k for k, p in enumerate(params)
        if p is not None and accumulates_like_autograd(p, dtypes[k] if k < len(dtypes) else None)
    )
    check = _AccumulationCheck(
        tuple(None if p is None else weakref.ref(p) for p in params),
        tuple(None if p is None or p.grad is None else weakref.ref(p.grad) for p in params),
        positions,
        {k: ti.storage_ptr(params[k].grad) for k in positions},
        {k: params[k].grad.dtype for k in positions},
    )
    if all(g is not None for g, p in zip(check.grads, params) if p is not None):  # every .grad exists
        if all(p is not None for p in params):
            check.layout = ti.metadata_guard([*params, *(p.grad for p in params)])
        _ACCUMULATION_CHECKS[owner] = check
    return check


def _renewed(owner: Any, check: _AccumulationCheck, params: Sequence[Any], grads: list[torch.Tensor]) -> _AccumulationCheck:
    """``check``'s decision for ``params`` and their ``.grad`` tensors ``grads``,
    which ``check.layout`` passed: kept for these tensors, with their storages."""
    storages = {k: ti.storage_ptr(grads[k]) for k in check.positions}  # (once per step: no need for speed)
    renewed = _AccumulationCheck(tuple(map(weakref.ref, params)), tuple(map(weakref.ref, grads)), check.positions,
                                 storages, check.dtypes, check.layout)
    _ACCUMULATION_CHECKS[owner] = renewed
    return renewed


class ParamGroup(Mapping[str, Any]):
    """One group of ``param_groups`` as upstream's ``stage_backward_input`` returns it:
    ``"params"`` (the weights' grad-accumulator nodes), ``"intermediates"``
    (nodes W re-runs) and ``"grads"`` (the gradients B saved flowing into them).

    A compiled region's W work is a group with no intermediates (its dW graph
    runs on live-ins). ``group["grads"] = [...]`` replaces the saved
    gradients of an eager group, as upstream allows; anything else is refused.
    """

    def __init__(self, accumulators: Sequence[Node], eager: EagerGroup | None) -> None:
        self._accumulators = tuple(accumulators)
        self._eager = eager

    def __getitem__(self, key: str) -> Any:
        if key == "params":
            return set(self._accumulators)
        if key == "intermediates":
            return list(self._eager.intermediates) if self._eager else []
        if key == "grads":
            return list(self._eager.grads) if self._eager else []
        raise KeyError(key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key != "grads" or self._eager is None:
            raise TypeError(
                f"fxsplit: param_groups[...][{key!r}] cannot be set"
                + ("" if key != "grads" else ": this group is a compiled region's dW graph, which has no intermediates")
            )
        value = list(value)
        once = [k[5:] for k in self._eager.edge_kinds if k.startswith("once:")]
        if once and not self._eager.intermediates:
            raise TypeError(
                f"fxsplit: param_groups[...]['grads'] cannot be set on this group: its gradients were computed at B "
                f"by {', '.join(sorted(set(once)))}, which ran once (fxsplit.config.whole_nodes='once') and has no "
                "gradient left to replace; with fxsplit.config.whole_nodes='again' such a node is an intermediate "
                "whose saved gradients can be replaced, as upstream's"
            )
        if len(value) != len(self._eager.intermediates):
            raise ValueError(
                f"fxsplit: grads must have one entry per intermediate ({len(self._eager.intermediates)}), "
                f"got {len(value)}"
            )
        for g in value:
            if g is not None and not all(t is None or isinstance(t, torch.Tensor) for t in g):
                raise TypeError("fxsplit: each entry of grads must be None or a tuple of tensors/None")
        self._eager.grads = [None if g is None else tuple(g) for g in value]

    def __iter__(self) -> Iterator[str]:
        return iter(("params", "intermediates", "grads"))

    def __len__(self) -> int:
        return 3

    def __repr__(self) -> str:
        kind = "eager" if self._eager else "compiled"
        return f"ParamGroup({kind}, {len(self._accumulators)} weight(s))"


class PendingWeightGrads(Sequence[ParamGroup]):
    """The W work B leaves for one microbatch of one stage.

    Returned by :func:`fxsplit.stage_backward_input` in the place of
    upstream's ``param_groups`` and consumed by :func:`fxsplit.stage_backward_weight`,
    once unless a W raised (then again, finishing what the failed W did not).
    Iterating it yields upstream-style groups (:class:`ParamGroup`).
    It holds only what W needs: the live-ins of each compiled region
    (``compiled``) and, per eager group, the saved gradients and hand-over
    values (``groups``). W drops all of it.

    Inspection: ``timings`` holds nanoseconds of host clock
    (``time.perf_counter_ns``) summed over B and every W call: ``b_ns`` B in
    all, ``b_graph_ns`` the part inside compiled dI graphs; ``w_ns`` W in all
    (freeing the live-ins included), ``w_graph_ns`` the part inside dW graphs
    (accumulating ones included), ``w_commit_ns`` the part in autograd's commit calls (eager W work and
    accumulation). Host time outside the graphs is ``b_ns - b_graph_ns`` and
    ``w_ns - w_graph_ns``. ``accumulated_in_graph`` lists the positions (in
    ``weights``) of the weights W accumulated inside a dW graph.
    """

    # Defaults, replaced (never mutated) where an instance differs:
    # W's one-pass cases (see __init__).
    _single: CompiledWeightWork | None = None
    _many: list[CompiledWeightWork] | None = None
    _order: tuple[int, ...] | None = None
    # Regions B ran dI for: W's eager calls may pass through them and must
    # not run them again. Weak: W only needs the ones its graph still holds.
    _split_regions: Sequence[Any] = ()
    # B-set nodes W's eager calls run again: their saved tensors are held
    # for W (every other node B ran has freed its own).
    _rerun: Sequence[Node] = ()
    # Positions (in ``weights``) of weights an interrupted accumulating
    # graph may or may not have written: W cannot be repeated.
    _unknown: Sequence[int] = ()
    # What keeps the graph W re-runs alive on torch 2.11 (anchor).
    _anchors: Sequence[Any] = ()
    unreached = 0
    done = False

    def __init__(
        self,
        weights: Sequence[torch.Tensor],
        compiled: list[CompiledWeightWork],
        groups: list[EagerGroup],
        split_regions: Sequence[Any] = (),
        unreached: int = 0,
        rerun: Sequence[Node] = (),
        weights_distinct: bool = False,
    ) -> None:
        self._weights = tuple(weights)
        self.compiled = compiled
        self.groups = groups
        # The common case, which W decides without its general steps
        # (_compute_one): one compiled region and no eager code, the region's
        # weights B's (all of them, or all but some no region reaches: an
        # unused parameter), all distinct (``weights_distinct``: B's plan
        # found them so; else counted here), in B's order or another: the
        # region's order is the forward's order of use (Dynamo's), which a
        # model's parameters() need not follow (Hugging Face decoder layers
        # register their norms after the blocks that use them). ``_order``:
        # the position in ``weights`` of each of the region's weights, where
        # the orders differ or some of B's are not the region's (``None``
        # where they are the same list).
        # Several regions (graph breaks), each weight in one region only, are
        # decided likewise, region by region (``_many``; ``_order``: the
        # regions' weights, one after the other).
        n = len(self._weights)
        if compiled and not groups and (weights_distinct or len(set(map(id, self._weights))) == n):
            theirs = compiled[0].params if len(compiled) == 1 else [p for r in compiled for p in r.params]
            order: tuple[int | None, ...] | None = None
            if len(theirs) != n or not all(map(operator.is_, theirs, self._weights)):
                position = dict(zip(map(id, self._weights), itertools.count()))
                order = tuple(map(position.get, map(id, theirs)))
            # B's weights, or some of them, in any order, none in two regions (or missing: None)
            if order is None or (None not in order and len(set(order)) == len(order)):
                if len(compiled) == 1:
                    self._single = compiled[0]
                else:
                    self._many = list(compiled)
                self._order = order  # type: ignore[assignment]
        if groups:
            self._split_regions = [weakref.ref(n) for n in split_regions]
        if rerun:
            self._rerun = list(rerun)
        if unreached:
            self.unreached = unreached
        self._committed: set[int] = set()
        self._lock = threading.Lock()
        # Nanoseconds, for the benchmark: B's total and the part inside the
        # compiled dI graphs (set by stage_backward_input); W's total, the
        # part inside dW graphs and the part in the commit's autograd calls.
        # Time outside the graphs = total - graph.
        self.timings = {"b_ns": 0, "b_graph_ns": 0, "w_ns": 0, "w_graph_ns": 0, "w_commit_ns": 0}
        # Positions (in ``weights``) of the weights W accumulated into .grad
        # inside a dW graph rather than through autograd (for inspection).
        self.accumulated_in_graph: list[int] = []
        # Positions of the weights whose empty .grad W set to the dW graph's
        # gradient itself, as autograd would, without an engine call.
        self.handed_over: list[int] = []

    @classmethod
    def from_b(
        cls,
        weights: Sequence[torch.Tensor],
        plan: EagerWeightPlan,
        saved: Sequence[tuple[torch.Tensor | None, ...] | None],
        records: list[CompiledWeightWork],
        deferred: Sequence[DeferredGrad],
        out_edges: Sequence[GradientEdge],
        out_grads: Sequence[torch.Tensor],
    ) -> PendingWeightGrads:
        """Assemble B's results. Hand-over values that no given weight needs are dropped here."""
        if not plan.groups:  # no eager W work (a stage of compiled regions only): nothing handed over is needed
            return cls(weights, records, [], plan.split_regions, plan.unreached, plan.rerun,
                       weights_distinct=plan.weights_distinct)
        region_index = {n: k for k, n in enumerate(plan.region_starts)}
        handed: dict[int, list[tuple[GradientEdge, torch.Tensor]]] = {}
        for d in deferred:
            k = region_index.get(d.region_node)
            if k is not None and d.node in plan.w_side:
                handed.setdefault(k, []).append((GradientEdge(d.node, d.input_nr), d.value))
        groups = []
        once = set(plan.once)
        for g in plan.groups:
            edges = [e for k in g.regions for e in handed.get(k, ())]
            kinds = [f"once:{plan.region_starts[k].name()}" if plan.region_starts[k] in once else "region"
                     for k in g.regions for _ in handed.get(k, ())]
            edges += [(out_edges[j], out_grads[j]) for j in g.roots]
            kinds += ["output"] * len(g.roots)
            groups.append(
                EagerGroup(
                    weights=g.weights,
                    accumulators=g.accumulators,
                    intermediates=[plan.intermediates[k] for k in g.intermediates],
                    grads=[saved[k] for k in g.intermediates],
                    edges=[e for e, _ in edges],
                    edge_grads=[v for _, v in edges],
                    edge_kinds=kinds,
                )
            )
        return cls(weights, records, groups, plan.split_regions, plan.unreached, list(plan.rerun),
                   weights_distinct=plan.weights_distinct)

    def anchor(self, anchors: Iterable[Any]) -> None:
        """Keep these objects (``_torch_internals.graph_anchor``: what keeps the
        autograd graph W re-runs alive on torch 2.11) until W completes."""
        self._anchors = [*self._anchors, *(a for a in anchors if a is not None)]

    # -- upstream-style view ---------------------------------------------------
    def _views(self) -> list[ParamGroup]:
        views = [ParamGroup(g.accumulators, g) for g in self.groups]
        return views + [ParamGroup([a for a in r.accumulators if a is not None], None) for r in self.compiled]

    def __len__(self) -> int:
        return len(self.groups) + len(self.compiled)

    def __getitem__(self, index: Any) -> Any:
        return self._views()[index]

    def __iter__(self) -> Iterator[ParamGroup]:
        return iter(self._views())

    # -- inspection ----------------------------------------------------------------
    @property
    def pending(self) -> bool:
        return not self.done

    @property
    def weights(self) -> tuple[torch.Tensor, ...]:
        """The weights given to B (W must be given the same)."""
        return self._weights

    @property
    def eager_weights(self) -> list[torch.Tensor]:
        """Weights whose gradient (or part of it) W computes by eager autograd."""
        return [w for g in self.groups for w in g.weights]

    @property
    def regions_passed_through(self) -> int:
        """Compiled regions B ran dI for that W's eager autograd calls may pass through."""
        return sum(r() is not None for r in self._split_regions)

    @property
    def committed(self) -> int:
        """How many weights an interrupted W already accumulated (0 before W, and after a complete W)."""
        return len(self._committed)

    def _held_tensors(self) -> list[torch.Tensor]:
        held = [v for r in self.compiled for v in r._live_ins or () if isinstance(v, torch.Tensor)]
        return held + [t for g in self.groups for t in g.held_tensors()]

    @property
    def live_in_bytes(self) -> int:
        """Bytes held for W: compiled live-ins plus saved eager gradients and hand-over values."""
        return _nbytes(self._held_tensors())

    @property
    def eager_saved_bytes(self) -> int:
        """Bytes of the activations saved by the autograd nodes W re-runs (eager
        intermediates, and compiled regions W's eager calls pass through), by
        storage: counted once each, leaving out the weights' storages and those
        of :attr:`live_in_bytes`. Unpacks them (a tensor saved under
        ``saved_tensors_hooks`` runs its unpack hook): for inspection, not for
        the hot path."""
        skip = {t.untyped_storage().data_ptr() for t in self._held_tensors()}
        skip.update(w.untyped_storage().data_ptr() for w in self._weights)
        total = 0
        for node in self._rerun:
            for t in ti.saved_tensors_of(node):
                storage = t.untyped_storage()
                if storage.data_ptr() not in skip:
                    skip.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    @property
    def held_bytes(self) -> int:
        """Everything this microbatch keeps alive from B to W: :attr:`live_in_bytes`
        plus :attr:`eager_saved_bytes`. Every other tensor the backward needed
        is freed when B returns (compiled regions' saved activations included)."""
        return self.live_in_bytes + self.eager_saved_bytes

    def summary(self) -> str:
        """Which path each part of this stage's W takes, on one line (for logs)."""
        regions = ", ".join(sorted({r.region for r in self.compiled})) or "none"
        n_inter = sum(len(g.intermediates) for g in self.groups)
        n_edges = sum(len(g.edges) for g in self.groups)
        once = sorted({k[5:] for g in self.groups for k in g.edge_kinds if k.startswith("once:")})
        return (
            f"compiled W work: {len(self.compiled)} region call(s) ({regions}); "
            f"eager W work: {len(self.eager_weights)} weight(s) via "
            f"{n_inter} intermediate node(s) and {n_edges} edge(s); "
            + (f"ran once in B, their weight-side gradients held: {', '.join(once)}; " if once else "")
            + f"held for W: {self.live_in_bytes} bytes"
            + ("" if not self.done else " [done]")
        )

    def explain(self) -> str:
        """A multi-line account of what B did and what W will do, part by part."""
        if self.done:
            return "W already ran for this microbatch; nothing is held."
        lines = []
        for r in self.compiled:
            lines.append(
                f"compiled  {r.region}: dI graph ran in B; dW graph pending for {len(r.weights)} weight(s), "
                f"holding {r.live_in_bytes} bytes of live-ins"
            )
        for g in self.groups:
            for node, grads in zip(g.intermediates, g.grads):
                lines.append(
                    f"eager     {node.name()}: ran in B; W resumes autograd here from {_nbytes(grads or ())} "
                    "saved bytes"
                )
            for edge, value, kind in zip(g.edges, g.edge_grads, g.edge_kinds):
                if kind.startswith("once:"):
                    lines.append(
                        f"once      {kind[5:]} ran once, in B (one call computes all its edges' gradients); "
                        f"W starts autograd at {edge.node.name()} from the {_nbytes([value])} bytes it produced"
                    )
                elif kind == "region":
                    lines.append(
                        f"eager     {edge.node.name()}: its input gradient came from a compiled dI graph in B; "
                        f"W starts autograd here from {_nbytes([value])} held bytes"
                    )
                else:
                    lines.append(
                        f"eager     output {edge.node.name()}: no input gradient flows through it; W runs its "
                        "whole backward (compiled regions there run their fused backward)"
                    )
        lines.append(
            f"weights: {len(self.eager_weights)} by eager autograd in W, "
            f"{sum(len(r.weights) for r in self.compiled)} by compiled dW graphs, "
            f"{self.unreached} with no gradient from these outputs"
        )
        if self._committed:
            lines.append(f"an interrupted W already accumulated {len(self._committed)} weight(s); W finishes the rest")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"PendingWeightGrads({self.summary()})"

    # -- W -------------------------------------------------------------------------
    def run(self, fused_accumulation: bool | None = None) -> None:
        """W: compute every gradient, then commit (see the module docstring).

        ``fused_accumulation``: ``False`` commits every gradient through
        autograd; ``None`` lets each region's option, else
        ``fxsplit.config.fused_accumulation``, decide.

        Raises ``RuntimeError`` if W already completed or is running in
        another thread. Any exception from the dW graphs or the commit leaves
        the rest of the work pending (the exception carries a note saying so).
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("fxsplit: stage_backward_weight is already running for these param_groups")
        try:
            if self.done:
                raise RuntimeError(
                    "fxsplit: stage_backward_weight already ran for these param_groups; W runs once per B"
                )
            if self._unknown:
                raise RuntimeError(
                    "fxsplit: W cannot be repeated for these param_groups: an earlier W was interrupted "
                    f"while adding the gradients of {self._describe(self._unknown)} into .grad inside a "
                    "compiled dW graph, at a point where fxsplit cannot tell whether they were added; "
                    "those .grad tensors are unreliable: zero them (or restore them) and redo the step"
                )
            t0 = time.perf_counter_ns()
            try:
                self._compute_and_commit(fused_accumulation)
                # Freeing the live-ins is part of W's cost (on CPU, glibc may
                # hand large blocks back to the OS here): it counts in w_ns.
                self._release()
            except BaseException as e:
                if hasattr(e, "add_note"):
                    e.add_note(self._interrupted_note())
                raise
            finally:
                self.timings["w_ns"] += time.perf_counter_ns() - t0
        finally:
            self._lock.release()

    def _describe(self, positions: Sequence[int]) -> str:
        shown = ", ".join(f"weights[{k}] (shape {list(self._weights[k].shape)})" for k in positions[:8])
        return shown + (f" and {len(positions) - 8} more" if len(positions) > 8 else "")

    def _interrupted_note(self) -> str:
        done = f"fxsplit: W was interrupted after accumulating {len(self._committed)} of {len(self._weights)} weight(s)"
        if self._unknown:
            return (
                f"{done}; whether the gradients of {self._describe(self._unknown)} were added into .grad "
                "cannot be known (the exception came while a compiled dW graph was writing them): those "
                ".grad tensors are unreliable, and W for these param_groups raises if called again"
            )
        return f"{done}; the rest is still pending: pass the same param_groups to stage_backward_weight again to finish it"

    def _settle_interrupted(self, fused: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                            ledger: ti.AccumulationLedger) -> None:
        """After an accumulating dW graph raised: each of its weights is
        committed (its write ran), still pending (untouched) or unknown."""
        position = {id(w): k for k, w in enumerate(self._weights)}
        written = []
        for p, g in zip(fused, grads):
            state = ledger.state(g)
            if state == "written":
                self._committed.add(id(p))
                self.accumulated_in_graph.append(position[id(p)])
                written.append(g)
            elif state == "unknown":
                self._unknown = [*self._unknown, position[id(p)]]
        # What a completed accumulating graph's caller does (CompiledWeightWork.accumulate).
        torch.autograd.graph.increment_version(written)

    def _fusable(self, wanted: set[int], switch: bool | None) -> dict[int, tuple[int, ...]]:
        """For each compiled record (by index), the weights (positions in its
        ``params``) whose gradient W may add into ``.grad`` inside the dW graph: where the
        region allows it, the weight's gradient comes from that record only,
        and accumulating in place cannot differ from autograd's accumulation
        (:func:`accumulates_like_autograd`)."""
        if switch is False or not self.compiled:
            return {}
        multi = self._multi_source()
        result: dict[int, tuple[int, ...]] = {}
        for i, record in enumerate(self.compiled):
            if self._fusion_allowed(record, switch):
                positions = _accumulating_like_autograd(record, wanted, multi)
                if positions:
                    result[i] = positions
        return result

    @staticmethod
    def _fusion_allowed(record: CompiledWeightWork, switch: bool | None) -> bool:
        """Whether W may commit ``record``'s gradients itself (in the graph, or
        into an empty ``.grad``) rather than through autograd's engine."""
        if switch is False:
            return False
        allowed = record.owner.fused_accumulation
        if allowed is False:
            return False
        # config.current validates the option; the default itself needs no check.
        if allowed is True or switch is True or config.fused_accumulation is True:
            return True
        return config.current("fused_accumulation")

    def _multi_source(self) -> set[int]:
        """The weights (by id) whose gradient comes from more than one record or eager group."""
        if len(self.compiled) + len(self.groups) < 2:
            return set()
        seen: set[int] = set()
        multi: set[int] = set()
        for ws in [r.weights for r in self.compiled] + [g.weights for g in self.groups]:
            for w in ws:
                (multi if id(w) in seen else seen).add(id(w))
        return multi

    def _compute_and_commit(self, fused_accumulation: bool | None = None) -> None:
        # The commits are built in their own frame: once it returns, the
        # commits hold the only references to W's gradients (see _HandOver).
        one = self._compute_one(fused_accumulation)
        commits, direct = one if one is not None else self._compute(fused_accumulation)
        if direct:
            self._take(direct)
        if not commits:
            return
        blocked = [n for n in (r() for r in self._split_regions) if n is not None]
        t0 = time.perf_counter_ns()
        try:
            with registered(blocked, SPLIT_DONE):
                while commits:
                    commit_weight_grads(commits.pop(0), self._committed)
        finally:
            self.timings["w_commit_ns"] += time.perf_counter_ns() - t0

    def _take(self, direct: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Commit each ``(weight, gradient)`` by ``weight.grad = gradient``. What
        happened is read off ``.grad`` afterwards, also after an interruption,
        so every weight is either committed (and recorded so) or untouched."""
        weights = list(map(_first, direct))
        grads = list(map(_second, direct))
        direct.clear()
        try:
            collections.deque(map(setattr, weights, itertools.repeat("grad"), grads), maxlen=0)
        finally:
            mine = self._weights
            # The order W computed them in: the single region's (see _order), else B's.
            order = self._order if self._order is not None else range(len(mine))
            if len(weights) == len(order) and all(map(operator.is_, weights, map(mine.__getitem__, order))) and all(
                map(operator.is_, map(_grad_of, weights), grads)
            ):  # all of them, in that order (the common case)
                self._committed.update(map(id, weights))
                self.handed_over.extend(order)
            else:
                position = {id(w): k for k, w in enumerate(mine)}
                for weight, grad in zip(weights, grads):
                    if weight.grad is grad:
                        self._committed.add(id(weight))
                        self.handed_over.append(position[id(weight)])

    def _compute_one(
        self, fused_accumulation: bool | None
    ) -> tuple[list[WeightCommit], list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """What :meth:`_compute` returns, in the common case, without its
        general steps: one region whose weights are B's, in any order, but for
        any that no region reaches (``_single``: unused, or frozen), or several
        regions none of whose weights is another's (``_many``),
        nothing committed yet, every weight of the region requiring a gradient and its
        ``.grad`` empty (so nothing accumulates inside the graph, step 0): run
        the dW graph and decide every commit in one pass (:meth:`_direct_one`,
        which returns ``None`` only for a weight given twice, which
        ``_single`` excludes). ``None`` where the case does not hold, before
        anything has run."""
        record = self._single
        if record is not None:
            # The region's weights (B's others, unreached or frozen, W leaves as they are).
            if self._committed or not _wanted_and_empty(record.params):
                return None
            return self._direct_one(record, record.compute(None, self.timings), fused_accumulation, empty=True)
        records = self._many
        if records is None or self._committed or not all(_wanted_and_empty(r.params) for r in records):
            return None
        # Every region's dW graph first (pure: an exception here changes nothing), then the decisions.
        # (a region with no weight, such as a loss after a graph break, has no dW graph to run)
        computed = [(r, r.compute(None, self.timings)) for r in records if r.params]
        commits: list[WeightCommit] = []
        direct: list[tuple[torch.Tensor, torch.Tensor]] = []
        for r, triples in computed:
            one = self._direct_one(r, triples, fused_accumulation, empty=True, distinct=True)
            if one is None:
                return None  # (the general steps compute again: compute is pure)
            commits.extend(one[0])
            direct.extend(one[1])
        # A storage that gradients of two regions share would be someone else's too
        # (autograd would copy it): the general steps decide that.
        if len(ti.storage_ptrs(list(map(_second, direct)))) != len(direct):  # (plain tensors only, all of them)
            return None
        return commits, direct

    def _compute(
        self, fused_accumulation: bool | None
    ) -> tuple[list[WeightCommit], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Steps 0-2 of W (module docstring): the in-graph accumulation, and
        the commits that remain: through autograd's engine, and ``(weight,
        gradient)`` pairs an empty ``.grad`` takes as they are
        (:func:`takes_gradient_like_autograd`)."""
        wanted = set(map(id, filter(_requires_grad, self._weights)))
        if self._committed:
            wanted -= self._committed
        # 0. the dW graphs that accumulate into .grad, compiled on first use:
        # a compile error here changes nothing.
        accumulating: dict[int, tuple[ti.BoxedCallable, tuple[int, ...]]] = {}
        for i, positions in self._fusable(wanted, fused_accumulation).items():
            record = self.compiled[i]
            graph = record.owner.accumulating_graph(
                record.owner.dw_positions(positions), list(map(_grad_of, map(record.params.__getitem__, positions)))
            )
            if graph is not None:
                accumulating[i] = (graph, positions)
        # 1. compute: pure, so an exception here changes nothing.
        compiled: dict[int, list[torch.Tensor]] = {}
        by_id: dict[int, tuple[torch.Tensor, Node]] = {}
        origin: dict[int, int] = {}  # the record a weight's (last) gradient came from
        for i, record in enumerate(self.compiled):
            if i not in accumulating and any(p is not None and id(p) in wanted for p in record.params):
                triples = record.compute(wanted, self.timings)
                if len(self.compiled) == 1 and not self.groups:
                    # The common case (one region, no eager code): steps 2-3 in one pass.
                    one = self._direct_one(record, triples, fused_accumulation)
                    if one is not None:
                        return one
                for p, acc, g in triples:
                    compiled.setdefault(id(p), []).append(g)
                    by_id[id(p)] = (p, acc)
                    origin[id(p)] = i
        # 2. accumulate inside the dW graphs: each graph's run is the commit of
        # its fused weights, and computes the rest. Interrupted, the brackets
        # it ran tell which of its weights were written.
        for i, (graph, positions) in accumulating.items():
            record = self.compiled[i]
            fused = list(map(record.params.__getitem__, positions))
            fused_ids = set(map(id, fused))
            grads = list(map(_grad_of, fused))
            with ti.recording_accumulation() as ledger:
                try:
                    rest = record.accumulate(graph, positions, wanted - fused_ids, self.timings)
                except BaseException:
                    self._settle_interrupted(fused, grads, ledger)
                    raise
            self._committed.update(fused_ids)
            self.accumulated_in_graph.extend(
                itertools.compress(range(len(self._weights)), map(fused_ids.__contains__, map(id, self._weights)))
            )
            for p, acc, g in rest:
                compiled.setdefault(id(p), []).append(g)
                by_id[id(p)] = (p, acc)
                origin[id(p)] = i
        direct = self._direct(compiled, by_id, origin, fused_accumulation)
        # 3. one commit per eager group (with the compiled gradients of its
        # weights), then one for the weights only compiled regions reach.
        commits: list[WeightCommit] = []
        for group in self.groups:
            chosen = [(w, acc) for w, acc in zip(group.weights, group.accumulators) if id(w) in wanted]
            if not chosen:
                continue
            roots, values = group.starts()
            for w, acc in chosen:
                for g in compiled.pop(id(w), ()):
                    roots.append(GradientEdge(acc, 0))
                    values.append(g)
            if roots:
                commits.append(
                    WeightCommit(roots, values, [w for w, _ in chosen], [a for _, a in chosen], group.pins())
                )
        if compiled:
            commits.append(_engine_commit([(*by_id[k], gs) for k, gs in compiled.items()]))
            compiled.clear()
        return commits, direct

    def _direct_one(
        self,
        record: CompiledWeightWork,
        triples: list[tuple[torch.Tensor, Any, torch.Tensor]],
        switch: bool | None,
        empty: bool = False,
        distinct: bool | None = None,
    ) -> tuple[list[WeightCommit], list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """What :meth:`_direct` and step 3 of :meth:`_compute` decide, for the
        gradients of one record when no other record shares a weight with it
        and there is no eager group, in one pass over its weights: the commit
        through autograd's engine of what an empty ``.grad`` does not take as
        it is, and the ``(weight, gradient)`` pairs it does. ``None`` where a
        weight has two gradients (the general path sums them). ``empty``: the
        caller found every ``.grad`` of the record's weights ``None`` (no user
        code ran since). ``distinct``: the record's weights are known distinct
        (default: it is ``_single``)."""
        allowed = self._fusion_allowed(record, switch)
        if allowed:
            weights = list(map(_first, triples))
            grads = list(map(_third, triples))
            # The single record's weights are B's, found distinct at B (_single):
            # so is any selection of them.
            known = record is self._single if distinct is None else distinct
            if _all_taken(record, weights, grads, distinct=known, empty=empty):
                return [], list(zip(weights, grads))  # the common case, decided without a per-weight loop
        plain = torch.Tensor
        storage_ptr = ti.storage_ptr
        ids: set[int] = set()
        seen: set[int] = set()
        shared: set[int] = set()
        candidates: list[int] = []  # indices into triples
        ptrs: list[int] = []
        for n, (p, _, g) in enumerate(triples):
            key = id(p)
            if key in ids:
                return None
            ids.add(key)
            if type(g) is plain:  # a DTensor's local storage is not its own to compare
                ptr = storage_ptr(g)
                (shared if ptr in seen else seen).add(ptr)
                if allowed and p.grad is None:
                    candidates.append(n)
                    ptrs.append(ptr)
        direct: list[tuple[torch.Tensor, torch.Tensor]] = []
        rest = triples
        if candidates:
            weights = [triples[n][0] for n in candidates]
            grads = [triples[n][2] for n in candidates]
            takes = _direct_takes(record.owner, weights, grads, ptrs, shared | record.held_elsewhere)
            taken: set[int] = set()
            for n, weight, grad, ok in zip(candidates, weights, grads, takes):
                if ok:
                    direct.append((weight, grad))
                    taken.add(n)
            if taken:
                rest = [t for n, t in enumerate(triples) if n not in taken]
        return ([_engine_commit([(p, acc, (g,)) for p, acc, g in rest])] if rest else []), direct

    def _direct(
        self,
        compiled: dict[int, list[torch.Tensor]],
        by_id: dict[int, tuple[torch.Tensor, Node]],
        origin: dict[int, int],
        switch: bool | None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Take out of ``compiled`` the gradients an empty ``.grad`` takes as
        they are: one gradient, from a record whose weights W may commit
        itself (:meth:`_fusion_allowed`), for a weight no eager group
        reaches, and :func:`takes_gradient_like_autograd`. Autograd's engine
        call would do exactly that assignment, at the cost of an engine call."""
        if not compiled:  # (every gradient accumulated in its dW graph)
            return []
        eager = {id(w) for g in self.groups for w in g.weights} if self.groups else ()
        allowed: dict[int, bool] = {}  # per record: decided once, not per weight
        storage_ptr = ti.storage_ptr
        plain = torch.Tensor
        # A storage two gradients share, or that others hold (the backward's own
        # inputs, the input gradients B returned), is someone else's too: autograd
        # would copy it. A live-in dI computed is W's alone (dropped when W ends).
        seen: set[int] = set()
        shared: set[int] = set()
        # per record: the candidates' keys, weights, gradients and storages
        per_record: dict[int, tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[int]]] = {}
        for k, gs in compiled.items():
            for g in gs:
                if type(g) is plain:  # a DTensor's local storage is not its own to compare
                    ptr = storage_ptr(g)
                    (shared if ptr in seen else seen).add(ptr)
            if len(gs) != 1 or type(gs[0]) is not plain or k in eager:
                continue
            weight = by_id[k][0]
            if weight.grad is not None:
                continue
            i = origin[k]
            ok = allowed.get(i)
            if ok is None:
                ok = allowed[i] = self._fusion_allowed(self.compiled[i], switch)
                if ok:
                    per_record[i] = ([], [], [], [])
            if ok:
                keys, weights, grads, ptrs = per_record[i]
                keys.append(k)
                weights.append(weight)
                grads.append(gs[0])
                ptrs.append(ptr)
        direct = []
        for i, (keys, weights, grads, ptrs) in per_record.items():
            takes = _direct_takes(self.compiled[i].owner, weights, grads, ptrs, shared | self.compiled[i].held_elsewhere)
            for k, weight, grad, ok in zip(keys, weights, grads, takes):
                if ok:
                    direct.append((weight, grad))
                    del compiled[k]
        return direct

    def _release(self) -> None:
        for record in self.compiled:
            record.release()
        self.done = True
        self.compiled = []
        self.groups = []
        self._split_regions = self._rerun = self._anchors = ()
        self._committed = set()
