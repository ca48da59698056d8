"""The W work B leaves for one microbatch, and W's commit through autograd.

:class:`PendingWeightGrads` holds exactly what W needs (compiled regions'
live-ins, the gradients B saved at eager intermediates, the dI values B
handed over, the output gradients of outputs whose backward is all weight
work); :meth:`PendingWeightGrads.run` is W. Before any graph runs,
:func:`plan_commits` decides, from the two statements of autograd's rules
(:func:`accumulates_like_autograd`, :func:`takes_gradient_like_autograd`),
what W does with each compiled gradient (a :class:`CommitPlan`, kept per
state of the weights for a stage B replays); one executor runs any plan:

1. **compute**: every dW graph that does not accumulate runs on its
   live-ins. Pure: on an exception everything is still held.
2. **accumulate in the graph**: a dW variant adds the gradients of weights
   :func:`accumulates_like_autograd` allows into their ``.grad`` in place;
   running it is their commit. Its writes are bracketed by
   ``fxsplit::accumulation_begins`` / ``_ends``, so if it raises each weight
   is known to be written (committed), untouched (pending) or, between the
   two, unknown: the exception names those, and W refuses to run again.
3. **take**: an empty ``.grad`` that :func:`takes_gradient_like_autograd`
   allows is set to the gradient itself, with no engine call.
4. **commit**: everything else goes through :func:`commit_weight_grads`,
   one autograd engine call per eager weight group and one for the weights
   only compiled regions reach, so hooks, layout, ``grad_dtype`` and aliasing
   are autograd's own.

If a step raises (a hook, out of memory, ``KeyboardInterrupt``), the weights
already committed are recorded and everything else stays pending: the same
object passed to W again finishes exactly the rest (the eager graph is kept
until W completes).
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
from fxsplit.runtime import SPLIT_DONE, CompiledWeightWork, Gradients, InputCall, registered

__all__ = [
    "CommitPlan", "EagerGroup", "PendingWeightGrads", "WeightCommit", "accumulates_like_autograd",
    "commit_weight_grads", "plan_commits", "takes_gradient_like_autograd",
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
    grad, not an autograd view, a plain weight, ``grad_dtype`` unset or
    equal, and a storage not in ``avoid`` (the live-ins and other gradients
    of the same W: a tensor someone else holds, which autograd would copy).

    :func:`plan_commits` decides the weight's part before the gradient
    exists (:func:`_takes_on_weight`), W the gradient's once it does
    (:func:`_takes_as_is`)."""
    return weight.grad is None and _takes_on_weight(weight) and _takes_as_is(weight, grad, ti.storage_ptr(grad), avoid)


def _takes_on_weight(weight: torch.Tensor) -> bool:
    """The part of :func:`takes_gradient_like_autograd` the weight decides
    alone: a plain weight, no hooks, ``grad_dtype`` unset or the weight's
    dtype (which the gradient must have)."""
    return (
        type(weight) in (torch.nn.Parameter, torch.Tensor)
        and not weight._backward_hooks
        and not getattr(weight, "_post_accumulate_grad_hooks", None)
        and getattr(weight, "grad_dtype", None) in (None, weight.dtype)
    )


def _in_weight_layout(weight: torch.Tensor, grad: Any) -> bool:
    """The part of :func:`takes_gradient_like_autograd` that is metadata of
    the two tensors only (what :func:`_laid_out` decides once per metadata)."""
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


def _takes_as_is(weight: torch.Tensor, grad: Any, ptr: int | None, avoid: Any) -> bool:
    """The part of :func:`takes_gradient_like_autograd` the gradient decides
    (``ptr``: its storage): the weight's layout, not an autograd view (its
    base is held too: autograd would copy it), a storage nobody else holds."""
    return _in_weight_layout(weight, grad) and grad._base is None and ptr not in avoid


# On each region's runtime, under this name: (how many weights, a guard that
# passes exactly the weights and gradients with the metadata of those of an
# earlier W, which of those gradients had their weight's layout): one C call
# instead of a Python check per weight; a dW graph returns the same layouts
# every call. Whether a gradient has its weight's layout (_in_weight_layout)
# is a function of that metadata only, so the guard needs not know which
# weights it was made on.
_LAYOUT_GUARD = "_fxsplit_layout_guard"


def _laid_out(owner: Any, weights: list[torch.Tensor], grads: list[Any]) -> tuple[bool, ...]:
    """:func:`_in_weight_layout` for each pair of ``weights`` and ``grads``,
    decided once per region (``owner``) and metadata of the pairs, then read
    behind the guard kept for ``owner`` (:data:`_LAYOUT_GUARD`). Where a
    gradient's layout is not its weight's (an expert's, transposed by its
    grouped matmul) the decision is kept as well, so a W whose every call has
    such a gradient does not check every pair again."""
    cached = getattr(owner, _LAYOUT_GUARD, None)
    if cached is not None and cached[0] == len(weights) and cached[1](*weights, *grads):
        return cached[2]  # type: ignore[no-any-return]
    laid_out = tuple(_in_weight_layout(w, g) for w, g in zip(weights, grads))
    guard = ti.metadata_guard([*weights, *grads]) if weights else None
    if guard is not None:
        setattr(owner, _LAYOUT_GUARD, (len(weights), guard, laid_out))
    return laid_out


def _taken(
    record: CompiledWeightWork, weights: list[torch.Tensor], grads: list[Any], ptrs: list[int | None], shared: set[Any]
) -> list[bool]:
    """:func:`_takes_as_is` for each pair of ``record``'s (``ptrs``: the
    gradients' storages; ``shared``: storages other gradients of this W have
    too). The layouts are read behind a guard (:func:`_laid_out`); where every
    gradient has its weight's and none is a view or anyone else's, every pair
    is decided at once (C-level passes, the live-ins read only as far as that
    needs)."""
    laid_out = _laid_out(record.owner, weights, grads)
    if all(laid_out) and all(map(operator.is_, map(_base_of, grads), _NONES)) and shared.isdisjoint(ptrs) and (
        None not in ptrs and record.holds_none_of(set(ptrs))
    ):
        return [True] * len(weights)
    avoid = shared | record.held_elsewhere
    return [ok and g._base is None and p not in avoid for ok, g, p in zip(laid_out, grads, ptrs)]


def _hooks(weights: Sequence[torch.Tensor]) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Which weights have tensor hooks, and which post-accumulate-grad hooks."""
    return tuple(map(bool, map(_tensor_hooks_of, weights))), tuple(map(bool, map(_post_hooks_of, weights)))


def _repeated(ptrs: list[int | None]) -> set[int | None]:
    """The storages more than one gradient has (someone else's too, for each)."""
    seen: set[int | None] = set()
    twice: set[int | None] = set()
    for p in ptrs:
        (twice if p in seen else seen).add(p)
    return twice


# Readers for C-level iteration over weights, gradients and (weight, ..., gradient) tuples.
_NONE: Gradients = ((), (), ())  # no gradient to commit
_NONES = itertools.repeat(None)  # (endless: map stops at its other argument's end)
_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_third = operator.itemgetter(2)
_requires_grad = operator.attrgetter("requires_grad")
_grad_of = ti.grad_of
_base_of = operator.attrgetter("_base")
_tensor_hooks_of = operator.attrgetter("_backward_hooks")
_post_hooks_of = operator.attrgetter("_post_accumulate_grad_hooks")
_grad_dtype_of = operator.attrgetter("grad_dtype")
_dtype_of = operator.attrgetter("dtype")

# Every torch fxsplit supports has both on every tensor (None when unset);
# where one lacks them, W plans on every call instead of keeping plans.
_GUARDABLE = all(hasattr(torch.Tensor, a) for a in ("_post_accumulate_grad_hooks", "grad_dtype"))


def _allowed(owner: Any, switch: bool | None, default: bool) -> bool:
    """Whether W may commit a region's gradients itself (in its dW graph, or
    into an empty ``.grad``) rather than through autograd's engine: never
    where ``stage_backward_weight`` was told not to (``switch``), else as the
    region's own option says, else ``default`` (``fxsplit.config``)."""
    return switch is not False and (owner.fused_accumulation if owner.fused_accumulation is not None else default)


@dataclasses.dataclass(frozen=True, eq=False)
class CommitPlan:
    """What W does with each compiled gradient of the weights it commits,
    decided by :func:`plan_commits` before any graph runs.

    ``accumulate``: per record (index among the compiled regions' W work), the
    positions in its ``params`` whose gradient its dW graph adds into
    ``.grad`` in place (:func:`accumulates_like_autograd`; W leaves to the
    engine a ``.grad`` that shares storage with that record's live-ins, which
    the graph reads). ``take``: the weights (by ``id``) whose empty ``.grad``
    W sets to their gradient, where the gradient turns out as
    :func:`takes_gradient_like_autograd` asks (else the engine takes it).
    ``take_every``: the records all of whose wanted weights are in ``take``
    (W decides their gradients at once). Every other gradient, and every
    eager group's work, goes to autograd's engine (:func:`commit_weight_grads`).
    ``compute``: the records with a gradient W commits. ``wanted``: the
    weights W commits (requiring a gradient, not committed yet), by ``id``;
    ``select``: the same for the regions' ``compute``, ``None`` where that is
    all their weights; ``position``: each weight's (first) position in W's weights.
    """

    accumulate: Mapping[int, tuple[int, ...]]
    take: frozenset[int]
    take_every: frozenset[int]
    compute: tuple[int, ...]
    wanted: frozenset[int]
    select: frozenset[int] | None
    position: Mapping[int, int]
    # Per record of ``accumulate``: its dW output positions and accumulating
    # variant (``CompiledSplitBackward.accumulating_key``), filled on first use.
    variants: dict[int, tuple[tuple[int, ...], Any]] = dataclasses.field(default_factory=dict)


def plan_commits(
    compiled: Sequence[CompiledWeightWork],
    groups: Sequence[EagerGroup],
    weights: Sequence[torch.Tensor],
    committed: set[int],
    switch: bool | None,
    default: bool,
) -> CommitPlan:
    """W's :class:`CommitPlan` for the regions' W work ``compiled``, the eager
    groups ``groups`` and B's ``weights``, of which those in ``committed``
    (by ``id``) are done. Pure: reads the weights and their ``.grad``, changes
    nothing. ``switch`` and ``default``: see :func:`_allowed`.

    A weight W may commit itself has its gradient from one record only (no
    other region or eager group adds to it: the engine sums those), and
    passes :func:`accumulates_like_autograd` (``.grad`` set) or the weight's
    part of :func:`takes_gradient_like_autograd` (``.grad`` empty)."""
    wanted = frozenset(id(w) for w in weights if w.requires_grad) - committed
    sources = collections.Counter(id(p) for r in compiled for p in r.params if p is not None)
    sources.update(id(w) for g in groups for w in g.weights)
    accumulate: dict[int, tuple[int, ...]] = {}
    take: set[int] = set()
    mine = [[p for p in r.params if p is not None and id(p) in wanted] for r in compiled]
    for i, record in enumerate(compiled):
        if not mine[i] or not _allowed(record.owner, switch, default):
            continue
        dtypes = record.owner.weight_grad_dtypes
        positions = []
        for k, p in enumerate(record.params):
            if p is None or id(p) not in wanted or sources[id(p)] > 1:
                continue
            if p.grad is None:
                if _takes_on_weight(p):
                    take.add(id(p))
            elif accumulates_like_autograd(p, dtypes[k] if k < len(dtypes) else None):
                positions.append(k)
        if positions:
            accumulate[i] = tuple(positions)
    every = all(id(p) in wanted for r in compiled for p in r.params if p is not None)
    take_every = frozenset(i for i, ws in enumerate(mine) if ws and take.issuperset(map(id, ws)))
    position: dict[int, int] = {}
    for k, w in enumerate(weights):
        position.setdefault(id(w), k)
    return CommitPlan(accumulate, frozenset(take), take_every, tuple(i for i, ws in enumerate(mine) if ws), wanted,
                      None if every else wanted, position)


MAX_COMMIT_PLANS = 8
"""Commit plans kept per stage shape (each ``.grad``/hook state a stage's
weights come in: a step's first microbatch, later ones, a hooked weight)."""


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


class PendingWeightGrads(InputCall, Sequence[ParamGroup]):
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
    # Regions B ran dI for: W's eager calls may pass through them and must
    # not run them again. Weak: W only needs the ones its graph still holds.
    _split_regions: Sequence[Any] = ()
    # Positions (in ``weights``) of weights an interrupted accumulating
    # graph may or may not have written: W cannot be repeated.
    _unknown: Sequence[int] = ()
    # What keeps the graph W re-runs alive on torch 2.11 (anchor).
    _anchors: Sequence[Any] = ()
    # The nodes W's eager calls run again (set by hand_over: a plan with eager groups).
    _rerun: Sequence[Node] = ()
    # The eager groups (see hand_over); what accumulated_in_graph and
    # handed_over list.
    groups: Sequence[EagerGroup] = ()
    _accumulated_at: tuple[int, ...] = ()
    _handed_over_at: tuple[int, ...] = ()
    done = False

    def __init__(self, weights: Sequence[torch.Tensor], plan: EagerWeightPlan, retains_graph: bool = False) -> None:
        """Made by B as its call starts (an :class:`~fxsplit.runtime.InputCall`:
        the regions it runs record their W work here), completed by
        :meth:`hand_over` where the plan has eager groups."""
        self._weights = tuple(weights)
        self.plan = plan  # (B's; dropped by hand_over, with the nodes it holds)
        self.compiled = []
        self.deferred = []
        # The stage's kept commit plans (see _commit_plan; None: plan every W).
        self._kept: list[tuple[Any, Any, CommitPlan]] | None = plan.commit_plans
        self.unreached = plan.unreached
        self._committed: set[int] = set()
        self._lock = threading.Lock()
        # Nanoseconds, for the benchmark: B's total and the part inside the
        # compiled dI graphs (set by stage_backward_input); W's total, the
        # part inside dW graphs and the part in the commit's autograd calls.
        # Time outside the graphs = total - graph.
        self.timings = {"b_ns": 0, "b_graph_ns": 0, "w_ns": 0, "w_graph_ns": 0, "w_commit_ns": 0}
        if retains_graph:
            self.retains_graph = self.release_first = True

    def hand_over(
        self,
        saved: Sequence[tuple[torch.Tensor | None, ...] | None],
        out_edges: Sequence[GradientEdge],
        out_grads: Sequence[torch.Tensor],
    ) -> None:
        """B's end where the plan has eager groups: the groups made from what B
        saved and handed over (values that no given weight needs are dropped
        here), and the plan let go of. (A stage of compiled regions only has
        no group: B lets go of its plan itself.)"""
        plan, self.plan = self.plan, None
        # The B-set nodes W's eager calls run again: their saved tensors are
        # held for W (every other node B ran has freed its own).
        self._rerun = plan.rerun
        region_index = {n: k for k, n in enumerate(plan.region_starts)}
        handed: dict[int, list[tuple[GradientEdge, torch.Tensor]]] = {}
        for d in self.deferred:
            k = region_index.get(d.region_node)
            if k is not None and d.node in plan.w_side:
                handed.setdefault(k, []).append((GradientEdge(d.node, d.input_nr), d.value))
        self.deferred = []
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
        self.groups = groups
        self._split_regions = [weakref.ref(n) for n in plan.split_regions]

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
    def accumulated_in_graph(self) -> list[int]:
        """Positions (in ``weights``) of the weights W accumulated into ``.grad``
        inside a dW graph rather than through autograd."""
        return list(self._accumulated_at)

    @property
    def handed_over(self) -> list[int]:
        """Positions (in ``weights``) of the weights whose empty ``.grad`` W set
        to the dW graph's gradient itself, as autograd would, without an engine call."""
        return list(self._handed_over_at)

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
        """How many weights an interrupted W already committed into ``.grad`` (accumulated, or set to
        their gradient where ``.grad`` was empty; 0 before W, and after a complete W)."""
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
            lines.append(f"an interrupted W already committed {len(self._committed)} weight(s); W finishes the rest")
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
            if self.done or self._unknown:
                self._refuse_again()
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

    def _refuse_again(self) -> None:
        if self.done:
            raise RuntimeError("fxsplit: stage_backward_weight already ran for these param_groups; W runs once per B")
        raise RuntimeError(
            "fxsplit: W cannot be repeated for these param_groups: an earlier W was interrupted "
            f"while adding the gradients of {self._describe(self._unknown)} into .grad inside a "
            "compiled dW graph, at a point where fxsplit cannot tell whether they were added; "
            "those .grad tensors are unreliable: zero them (or restore them) and redo the step"
        )

    def _describe(self, positions: Sequence[int]) -> str:
        shown = ", ".join(f"weights[{k}] (shape {list(self._weights[k].shape)})" for k in positions[:8])
        return shown + (f" and {len(positions) - 8} more" if len(positions) > 8 else "")

    def _interrupted_note(self) -> str:
        done = f"fxsplit: W was interrupted after committing {len(self._committed)} of {len(self._weights)} weight(s)"
        if self._unknown:
            return (
                f"{done}; whether the gradients of {self._describe(self._unknown)} were added into .grad "
                "cannot be known (the exception came while a compiled dW graph was writing them): those "
                ".grad tensors are unreliable, and W for these param_groups raises if called again"
            )
        return f"{done}; the rest is still pending: pass the same param_groups to stage_backward_weight again to finish it"

    def _settle_interrupted(self, fused: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                            ledger: ti.AccumulationLedger, position: Mapping[int, int]) -> None:
        """After an accumulating dW graph raised: each of its weights is
        committed (its write ran), still pending (untouched) or unknown."""
        written = []
        for p, g in zip(fused, grads):
            state = ledger.state(g)
            if state == "written":
                self._committed.add(id(p))
                self._accumulated_at += (position[id(p)],)
                written.append(g)
            elif state == "unknown":
                self._unknown = [*self._unknown, position[id(p)]]
        # What a completed accumulating graph's caller does (CompiledWeightWork.accumulate).
        torch.autograd.graph.increment_version(written)

    def _commit_plan(self, switch: bool | None) -> CommitPlan:
        """This W's :class:`CommitPlan`: one the stage kept whose guard passes,
        else a new one from :func:`plan_commits` (kept where the stage keeps
        plans: B replayed or made its :class:`~fxsplit.stage_plan.StageShape`).

        The guard: the same ``switch`` and configured default; the same
        weights (B's plan guarantees them) with the same metadata
        (``requires_grad`` and dtype included), the same of them with a
        ``.grad``, each ``.grad`` with the same metadata (dtype, device, shape,
        strides, type), the same of them with tensor hooks and with
        post-accumulate-grad hooks, the same ``grad_dtype``. That is all
        :func:`plan_commits` reads of a stage whose regions and eager groups
        B's plan fixed; what depends on this microbatch's tensors (live-in
        and gradient storages, the gradients' layouts) W checks when it runs.
        A plan is not kept after an interrupted W (it depends on what was
        committed)."""
        default = True if config.fused_accumulation is True else config.current("fused_accumulation")
        kept, weights = self._kept, self._weights
        if kept is None or self._committed or not _GUARDABLE:
            return plan_commits(self.compiled, self.groups, weights, self._committed, switch, default)
        # The common states read in C-level passes that stop early: no .grad, no hook, no grad_dtype.
        grads = list(map(_grad_of, weights))
        present = None if all(map(operator.is_, grads, _NONES)) else tuple(map(operator.is_not, grads, _NONES))
        hooks = _hooks(weights) if any(map(_tensor_hooks_of, weights)) or any(map(_post_hooks_of, weights)) else None
        dtyped = not all(map(operator.is_, map(_grad_dtype_of, weights), map(_dtype_of, weights)))  # (a leaf's default)
        key = (switch, default, present, hooks, tuple(map(_grad_dtype_of, weights)) if dtyped else None)
        # What plan_commits reads of the tensors: with no .grad and every grad_dtype the
        # weight's dtype, nothing (requires_grad is B's plan's guard); else every weight's
        # and .grad's metadata.
        tensors = [*weights, *itertools.compress(grads, present or ())] if present or dtyped else None
        for k, guard, plan in kept:
            if k == key and (guard is None or guard(*tensors)):
                return plan
        plan = plan_commits(self.compiled, self.groups, weights, self._committed, switch, default)
        guard = None if tensors is None else ti.metadata_guard(tensors)
        if tensors is None or guard is not None:
            if len(kept) >= MAX_COMMIT_PLANS:
                del kept[0]
            kept.append((key, guard, plan))
        return plan

    def _compute_and_commit(self, fused_accumulation: bool | None = None) -> None:
        plan = self._commit_plan(fused_accumulation)
        # The commits are built in their own frame: once it returns, the
        # commits hold the only references to W's gradients (see _HandOver).
        commits, (weights, grads) = self._compute(plan)
        if weights:
            self._take(weights, grads, plan.position)
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

    def _compute(
        self, plan: CommitPlan
    ) -> tuple[list[WeightCommit], tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Steps 1 and 2 of W (module docstring) as ``plan`` says (the
        accumulating graphs last: running one is a commit), then what steps 4
        and 3 are given: the engine commits, and the weights whose empty
        ``.grad`` takes its gradient as it is, with those gradients."""
        records, select = self.compiled, plan.select
        # The accumulating dW graphs, compiled on first use: a compile error here changes nothing.
        accumulating = self._accumulating_graphs(plan) if plan.accumulate else {}
        # Compute: pure, so an exception here changes nothing.
        results: list[Gradients] = [_NONE] * len(records)  # (each replaced, never changed)
        for i in plan.compute:
            if i not in accumulating:
                results[i] = records[i].compute(select, self.timings)
        # Accumulate inside the dW graphs: each graph's run is the commit of
        # its fused weights, and computes the rest. Interrupted, the brackets
        # it ran tell which of its weights were written.
        for i, (graph, positions, grads) in accumulating.items():
            record = records[i]
            fused = list(map(record.params.__getitem__, positions))
            with ti.recording_accumulation() as ledger:
                try:
                    results[i] = record.accumulate(graph, positions, grads, select, self.timings)
                except BaseException:
                    self._settle_interrupted(fused, grads, ledger, plan.position)
                    raise
            self._committed.update(map(id, fused))
            self._accumulated_at += tuple(map(plan.position.__getitem__, map(id, fused)))
        direct = self._takes(plan, results) if plan.take else ([], [])
        return (self._engine_commits(results, plan.wanted) if self.groups or any(map(_third, results)) else []), direct

    def _accumulating_graphs(
        self, plan: CommitPlan
    ) -> dict[int, tuple[ti.BoxedCallable, tuple[int, ...], list[torch.Tensor]]]:
        """Per record of ``plan.accumulate``, the dW graph adding the gradients
        at its positions (in the record's ``params``) into their ``.grad``,
        those positions and those ``.grad`` tensors (which W passes on rather
        than read again), leaving out any ``.grad`` that shares storage with
        the live-ins the graph reads; none where none is left or the graph cannot
        be built (the record is computed and its gradients committed by the
        engine). Which graph variant it is, the plan keeps (its guard holds
        the ``.grad`` tensors' metadata, which decides it)."""
        found = {}
        for i, positions in plan.accumulate.items():
            record = self.compiled[i]
            owner = record.owner
            grads = list(map(_grad_of, map(record.params.__getitem__, positions)))
            variant = plan.variants.get(i)
            if not record.live_in_storages().isdisjoint(ti.storage_ptrs(grads)):
                kept = [(k, g) for k, g in zip(positions, grads) if ti.storage_ptr(g) not in record.live_in_storages()]
                positions, grads, variant = tuple(map(_first, kept)), list(map(_second, kept)), None
                if not positions:
                    continue
            elif variant is None:
                dw = owner.dw_positions(positions)
                variant = plan.variants[i] = (dw, owner.accumulating_key(dw, grads))
            dw, key = variant if variant is not None else (owner.dw_positions(positions), None)
            graph = owner.accumulating_graph(dw, grads, key)
            if graph is not None:
                found[i] = (graph, positions, grads)
        return found

    def _takes(
        self, plan: CommitPlan, results: list[Gradients]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Take out of ``results`` the gradients of ``plan.take`` that an empty
        ``.grad`` takes as they are (:func:`_takes_as_is`). A storage two
        gradients share, or that others hold (the backward's own inputs, the
        input gradients B returned), is someone else's too: autograd would
        copy it. Autograd's engine would otherwise make exactly this
        assignment, at the cost of an engine call."""
        ptrs = ti.storage_ptr_list(list(itertools.chain.from_iterable(map(_third, results))))
        shared = set() if len(set(ptrs)) == len(ptrs) else _repeated(ptrs)  # (the common case, without a call)
        taken_weights: list[torch.Tensor] = []
        taken_grads: list[torch.Tensor] = []
        end = 0
        for i, (weights, accumulators, grads) in enumerate(results):
            start, end = end, end + len(weights)
            mine = ptrs[start:end]
            if i in plan.take_every:
                ok = _taken(self.compiled[i], weights, grads, mine, shared)
                if all(ok):  # every gradient of the region (the common case)
                    taken_weights += weights
                    taken_grads += grads
                    results[i] = _NONE
                    continue
            else:
                picked = list(map(plan.take.__contains__, map(id, weights)))
                if not any(picked):
                    continue
                chosen = iter(_taken(self.compiled[i], list(itertools.compress(weights, picked)),
                                     list(itertools.compress(grads, picked)), list(itertools.compress(mine, picked)), shared))
                ok = [p and next(chosen) for p in picked]  # (the picked weights' answers, in place)
            rest = list(map(operator.not_, ok))
            taken_weights += itertools.compress(weights, ok)
            taken_grads += itertools.compress(grads, ok)
            results[i] = (list(itertools.compress(weights, rest)), list(itertools.compress(accumulators, rest)),
                          list(itertools.compress(grads, rest)))
        return taken_weights, taken_grads

    def _engine_commits(
        self, results: list[Gradients], wanted: frozenset[int]
    ) -> list[WeightCommit]:
        """One commit per eager group (with the compiled gradients of its
        weights), then one for the weights only compiled regions reach; a
        weight with gradients from several places gets them all (the engine
        sums them)."""
        by_weight: dict[int, tuple[torch.Tensor, Node, list[torch.Tensor]]] = {}
        for p, acc, g in itertools.chain.from_iterable(itertools.starmap(zip, results)):
            entry = by_weight.setdefault(id(p), (p, acc, []))
            entry[2].append(g)
        commits: list[WeightCommit] = []
        for group in self.groups:
            chosen = [(w, acc) for w, acc in zip(group.weights, group.accumulators) if id(w) in wanted]
            if not chosen:
                continue
            roots, values = group.starts()
            for w, acc in chosen:
                for g in by_weight.pop(id(w), (None, None, ()))[2]:
                    roots.append(GradientEdge(acc, 0))
                    values.append(g)
            if roots:
                weights, accumulators = [w for w, _ in chosen], [a for _, a in chosen]
                commits.append(WeightCommit(roots, values, weights, accumulators, group.pins()))
        if by_weight:
            commits.append(_engine_commit(list(by_weight.values())))
        return commits

    def _take(self, weights: list[torch.Tensor], grads: list[torch.Tensor], position: Mapping[int, int]) -> None:
        """Commit each weight by ``weight.grad = gradient`` (plain weights: the
        assignment stores the gradient itself). Interrupted, what happened is
        read off ``.grad``, so every weight is either committed (and recorded
        so) or untouched."""
        try:
            collections.deque(map(setattr, weights, itertools.repeat("grad"), grads), maxlen=0)
        except BaseException:  # interrupted: the weights it set are committed
            weights = [w for w, g in zip(weights, grads) if w.grad is g]
            raise
        finally:
            grads.clear()  # (W keeps no reference to a gradient it handed over)
            self._committed.update(map(id, weights))
            self._handed_over_at += tuple(map(position.__getitem__, map(id, weights)))

    def _release(self) -> None:
        for record in self.compiled:
            record.release()
        self.done = True
        self.compiled = []
        self.groups = ()
        self._split_regions = self._rerun = self._anchors = ()
        self._committed = set()  # (``committed`` reads 0 after a complete W)
