"""The plan of a stage's B: which compiled regions it splits, the eager split over the
ordinary autograd nodes around them (the reverse-closure idea of
``torch.distributed.pipelining._backward``), and what it leaves to W. Every B is
planned here, by :func:`plan_stage` (:func:`plan_eager_weight_work`): a stage of
compiled regions only, whose plan has no eager part, is planned once and its plan
replayed on later microbatches behind a guard (:class:`StageShape`); any other
stage is planned on every call, as its plan holds that microbatch's eager nodes.

Terms used below, for one stage:

* *B set*: autograd nodes the input-gradient pass executes, i.e. the nodes
  from which a stage input's gradient node is reachable.
* *W side*: nodes outside the B set from which a given weight is reachable.
* *intermediates*: eager B-set nodes with an edge into the W side. B saves the
  gradients flowing into them; W re-runs them (autograd computes only the
  outputs W needs) and everything on the W side.
* *region starts*: fxsplit-compiled regions in the B set with an edge into
  the W side. Their dI graph computes, in B, the gradient flowing along that
  edge; B hands it over and W starts from the edge (the region is not re-run).
* *W roots*: stage-output nodes already on the W side (outputs no input
  gradient and no compiled region depends on). W starts there with the
  output gradients.
* *first stage* (no stage input needs a gradient): the *bottom regions*
  (split regions with no split region below them) take the place of the
  stage inputs. B's autograd call captures the gradients flowing into them
  (which runs every other region's dI graph and the eager code above), then
  B runs each bottom region's dI graph itself (``fxsplit.api._run_bottom_regions``,
  ``fxsplit.api._captures`` for a hooked one). So every compiled region runs
  its activation-gradient chain at B, whatever eager code surrounds it; eager
  code below the bottom regions (an eager embedding) and a stage with no
  compiled region run at W, as upstream runs every first stage.
* *re-run nodes*: the B-set nodes W's autograd calls execute again: the
  intermediates and the B-set nodes below them on a path to an eager weight
  (e.g. a compiled region whose parameter is also used by eager code).
  Their saved tensors must survive B; every other B-set node below an
  intermediate is *released* when B ends (B retains the graph for the
  re-run nodes only).
* *output users*: for each stage output, the nodes W executes (re-run
  nodes and W-side nodes) with an edge into the output's gradient node.
  Such a node may have saved the output itself (an input of its forward,
  e.g. ``addmm`` saves its input for the weight's gradient), which B's
  in-place detach of the output would invalidate
  (:func:`fxsplit._torch_internals.keep_saved_through_detach`).

fxsplit-compiled regions in the B set run their dI graph in B and record
their own dW work, so the edges from such a region to its parameters are
not followed here.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import operator
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from fxsplit import _torch_internals as ti
from fxsplit.runtime import CompiledSplitBackward, route_backward

log = logging.getLogger("fxsplit")

__all__ = [
    "MAX_PLANS_PER_REGION",
    "EagerWeightPlan",
    "StageShape",
    "WeightGroup",
    "gradient_edge",
    "plan_eager_weight_work",
    "plan_stage",
    "prepare_regions",
    "runs_whole",
]


def gradient_edge(t: torch.Tensor | GradientEdge) -> GradientEdge:
    """The autograd edge a tensor's gradient flows into (grad_fn, or the grad
    accumulator of a leaf)."""
    if isinstance(t, GradientEdge):
        return t
    return torch.autograd.graph.get_gradient_edge(t)


# Whether a region's autograd Function class runs an fxsplit split backward: asked
# for every node of every B, so answered once per class and kept on the class
# itself (AOTAutograd makes one class per compiled region), under this name.
_SPLIT_ATTR = "_fxsplit_split_region"


def is_split_region(node: Node) -> bool:
    cls = getattr(node, "_forward_cls", None)
    if cls is None:
        return False
    known = cls.__dict__.get(_SPLIT_ATTR)
    if known is None:
        known = isinstance(ti.compiled_backward_of(node), CompiledSplitBackward)
        setattr(cls, _SPLIT_ATTR, known)
    return known


# Whether a node is a Python autograd Function's (a custom ``torch.autograd.Function``, or
# a region another backend compiled through AOTAutograd) that is no fxsplit split
# region: its backward computes every edge's gradient in one call, whichever the
# engine needs. Kept on the class like _SPLIT_ATTR.
_WHOLE_ATTR = "_fxsplit_runs_whole"


def runs_whole(node: Node) -> bool:
    """Whether ``node``'s one backward call yields the gradients of all its edges
    (a Python ``torch.autograd.Function``'s node, a region compiled by another
    backend), not only those the engine asks for, as torch's own nodes do."""
    cls = getattr(node, "_forward_cls", None)
    if cls is None:
        return False
    known = cls.__dict__.get(_WHOLE_ATTR)
    if known is None:
        known = not is_split_region(node)
        setattr(cls, _WHOLE_ATTR, known)
    return known


def _reverse_edges(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """child -> parents (nodes whose backward feeds the child), for the graph below ``roots``."""
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    seen: set[Node] = set()
    queue = collections.deque(r for r in roots if r is not None)
    seen.update(queue)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _upward_closure(starts: Iterable[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    closure: set[Node] = set()
    queue = collections.deque(s for s in starts if s is not None)
    while queue:
        node = queue.popleft()
        if node in closure:
            continue
        closure.add(node)
        queue.extend(parents.get(node, ()))
    return closure


@dataclasses.dataclass(frozen=True)
class WeightGroup:
    """Weights W computes in one autograd call, and where that call starts.

    ``intermediates``, ``regions`` and ``roots`` index
    ``EagerWeightPlan.intermediates``, ``EagerWeightPlan.region_starts`` and
    the stage output edges. Weights share a group only when they share a
    start, so a call never runs another group's part of the graph.
    """

    intermediates: tuple[int, ...]
    roots: tuple[int, ...]
    weights: tuple[torch.Tensor, ...]
    regions: tuple[int, ...] = ()
    # The weights' grad accumulators (the nodes the graph already holds).
    accumulators: tuple[Node, ...] = ()


@dataclasses.dataclass
class EagerWeightPlan:
    """B's plan of a stage: what B runs and what it leaves to W's autograd
    calls (terms as in the module docstring).

    ``intermediates``: eager B-set nodes whose incoming gradients B saves.
    ``region_starts``: B-set split regions whose unused dI outputs start W,
    and the nodes of ``once``. ``once``: B-set nodes with an edge into the W
    side that compute every edge's gradient in one call (:func:`runs_whole`),
    run once at B, which keeps the gradients they produce along their W-side
    edges (``fxsplit.config.whole_nodes == "once"``; with ``"again"`` they
    are intermediates). ``w_roots``: indices of the stage output edges W
    starts from with the output gradients. ``groups``: one autograd call each
    in W. ``unreached``: how many given weights no output depends on.
    ``split_regions``: every split region in the B set (B runs their dI graph;
    W must not run them again). ``w_side``: the W-side nodes (needed while B
    runs only). ``rerun``: B-set nodes W runs again (their saved tensors stay).
    ``release``: eager B-set nodes below an intermediate that W does not run,
    whose saved tensors B frees as it ends (B retains the graph).
    ``above``: eager B-set nodes above every intermediate, which W never runs
    (B frees their saved tensors where an anchor keeps the outputs' graph
    alive, torch 2.11: ``_torch_internals.graph_anchor``).
    ``bottom_regions``, ``captures``: a first stage's bottom regions and the
    edges into them whose gradients B's autograd call captures.
    ``output_users``: per stage output edge, the nodes W executes with an
    edge into that output's gradient node (those that may have saved it).
    """

    intermediates: list[Node]
    w_roots: list[int]  # indices into the stage's output edges
    groups: list[WeightGroup] = dataclasses.field(default_factory=list)
    unreached: int = 0
    region_starts: list[Node] = dataclasses.field(default_factory=list)
    once: list[Node] = dataclasses.field(default_factory=list)
    split_regions: list[Node] = dataclasses.field(default_factory=list)
    w_side: set[Node] = dataclasses.field(default_factory=set)
    rerun: set[Node] = dataclasses.field(default_factory=set)
    release: list[Node] = dataclasses.field(default_factory=list)
    above: list[Node] = dataclasses.field(default_factory=list)
    bottom_regions: list[Node] = dataclasses.field(default_factory=list)
    captures: list[GradientEdge] = dataclasses.field(default_factory=list)
    output_users: list[list[Node]] = dataclasses.field(default_factory=list)
    # Compiled-only plans (_read_regions): per split region, the given parameter
    # behind each of its next_functions (None elsewhere), and the node of each.
    region_params: dict[Node, list[torch.Tensor | None]] = dataclasses.field(default_factory=dict)
    region_children: dict[Node, list[Node | None]] = dataclasses.field(default_factory=dict)
    # W's commit plans, shared by every replay of one StageShape (None: W plans every call).
    commit_plans: list[Any] | None = None
    # Compiled-only plans of one region: where each stage input enters the
    # region's node, by one edge of its own (None: not so; empty: a first
    # stage). B may then call the node itself (fxsplit.api._direct_call).
    direct_edges: tuple[int, ...] | None = None
    # The split regions' dI and dW graphs are compiled (else B compiles them first).
    prepared: bool = False


def _group_weights(
    starts: list[tuple[torch.Tensor, set[Node], set[int]]],
    index_of: dict[Node, int],
    region_index_of: dict[Node, int],
    node_of: dict[int, Node],
) -> list[WeightGroup]:
    """Merge weights whose W starts (intermediates, region starts or output edges) overlap."""
    groups: list[tuple[set[Node], set[int], list[torch.Tensor]]] = []
    for w, inter, roots in starts:
        merged = (set(inter), set(roots), [w])
        keep = []
        for g in groups:
            if g[0] & merged[0] or g[1] & merged[1]:
                merged = (g[0] | merged[0], g[1] | merged[1], g[2] + merged[2])
            else:
                keep.append(g)
        groups = keep + [merged]
    return [
        WeightGroup(
            tuple(sorted(index_of[n] for n in i if n in index_of)),
            tuple(sorted(r)),
            tuple(ws),
            tuple(sorted(region_index_of[n] for n in i if n in region_index_of)),
            tuple(node_of[id(w)] for w in ws),
        )
        for i, r, ws in groups
    ]


def _rerun_and_release(
    intermediates: Sequence[Node], groups: Sequence[WeightGroup], b_set: set[Node], parents: dict[Node, list[Node]]
) -> tuple[set[Node], list[Node], list[Node]]:
    """The B-set nodes whose saved tensors survive B, the eager ones below
    the intermediates that do not, and the eager ones above the intermediates
    (``EagerWeightPlan.above``).

    Each group's W call starts at its intermediates (and at W-side edges,
    outside the B set) and executes every node on a path from there to one
    of its weights. A compiled region is kept only if such a path of some
    group passes through it: a region between an eager head and an eager
    embedding is not (the head's call stops at the head's weights, the
    embedding's starts below the region) and frees its activations at B.
    An eager node is kept if it reaches any eager weight (a superset of what
    W runs), so that the graph B retains below an intermediate still serves
    another backward, as upstream's retained graph does. Nodes above the
    intermediates are returned apart: nothing holds them after B, unless the
    graph is anchored (torch 2.11).
    """
    weights = [n for g in groups for n in g.accumulators]
    reaches_any_weight = _upward_closure(weights, parents)
    below_any = _below_in(intermediates, b_set)
    passed: set[Node] = set()  # on a path some W call runs
    for g in groups:
        starts = [intermediates[k] for k in g.intermediates]
        if starts:
            reaches = _upward_closure(g.accumulators, parents)
            passed.update(n for n in _below_in(starts, b_set) if n in reaches)
    rerun = set(intermediates) | {
        n for n in below_any if n in (passed if is_split_region(n) else reaches_any_weight)
    }
    release = [n for n in below_any if n not in rerun and not is_split_region(n)]
    above = [n for n in b_set if n not in below_any and not is_split_region(n)]
    return rerun, release, above


def _below_in(starts: Sequence[Node], b_set: set[Node]) -> dict[Node, None]:
    """``starts`` and the B-set nodes below them, in discovery order."""
    below: dict[Node, None] = {}
    queue = collections.deque(starts)
    while queue:
        node = queue.popleft()
        if node in below:
            continue
        below[node] = None
        for child, _ in node.next_functions:
            if child is not None and child in b_set and child not in below:
                queue.append(child)
    return below


def _weight_nodes(
    parents: dict[Node, list[Node]], roots: Sequence[Node], weights: Sequence[torch.Tensor]
) -> tuple[dict[int, Node], list[torch.Tensor], int]:
    """Map each weight the outputs depend on to its autograd node.

    Returns ``(node_of, unreached, missing)``: ``node_of[id(w)]`` for the used
    weights, the given weights no output depends on, and the number of
    ``nn.Parameter`` leaves the outputs depend on that were not given. Leaf
    weights are found through the grad accumulators already in the graph, which
    avoids creating a view per weight to look them up.
    """
    reachable = set(parents) | {r for r in roots if r is not None}
    by_variable: dict[int, Node] = {}
    parameters: dict[int, None] = {}  # ids of the nn.Parameter leaves among them
    for node in reachable:
        if ti.is_accumulate_grad(node):
            variable = getattr(node, "variable", None)
            by_variable[id(variable)] = node
            if isinstance(variable, torch.nn.Parameter):
                parameters[id(variable)] = None
    given = {id(w) for w in weights}
    node_of: dict[int, Node] = {}
    unreached: list[torch.Tensor] = []
    for w in weights:
        if not w.requires_grad:
            continue
        node = by_variable.get(id(w)) if w.grad_fn is None else w.grad_fn
        if node is not None and node in reachable:
            node_of[id(w)] = node
        else:
            unreached.append(w)
    missing = sum(1 for k in parameters if k not in given)
    return node_of, unreached, missing


def _bottom_regions(
    parents: dict[Node, list[Node]], roots: Sequence[Node], output_edges: Sequence[GradientEdge]
) -> tuple[list[Node], list[GradientEdge]]:
    """A first stage's bottom regions (split regions with no split region below
    them) and the edges into them that carry a gradient (module docs)."""
    regions = [n for n in dict.fromkeys([*roots, *parents]) if n is not None and is_split_region(n)]
    above_a_region = _upward_closure(
        (p for r in regions for p in parents.get(r, ())), parents
    )
    bottom = [r for r in regions if r not in above_a_region]
    edges: dict[tuple[Node, int], None] = {}
    for r in bottom:
        for p in parents.get(r, ()):
            for child, nr in p.next_functions:
                if child is r:
                    edges[(r, nr)] = None
    for e in output_edges:
        if e.node in bottom:
            edges[(e.node, e.output_nr)] = None
    return bottom, [GradientEdge(n, nr) for n, nr in edges]


def _read_regions(plan: EagerWeightPlan, out_nodes: Sequence[Node], xs: Sequence[torch.Tensor],
                  weights: Sequence[torch.Tensor]) -> bool:
    """Complete ``plan`` with what a :class:`StageShape` replays, where the stage
    is fxsplit-compiled regions only (the common case: a stage compiled whole,
    or in pieces across graph breaks), and say whether it is.

    Such a stage's plan has no eager part (no group, node run once,
    intermediate or W root), every node below its outputs is a split region,
    a stage input's gradient node, or the grad accumulator of a stage input,
    of a given ``nn.Parameter`` (whose gradient a region's dW graph
    computes) or of a leaf not given (whose gradient nobody computes, as in
    upstream's B and W); a first stage (no ``xs``) is one region whose outputs are the
    stage's. Sets ``split_regions`` in the order of a walk from the outputs
    (each region after one above it), and per region its ``region_children``
    (the node of each of its ``next_functions``) and ``region_params`` (the
    given parameter behind each, ``None`` elsewhere); for one region with
    inputs, ``direct_edges`` (see there)."""
    if plan.groups or plan.once or plan.intermediates or plan.w_roots:
        return False
    accumulate_grad = ti.accumulate_grad_type()
    leaves = {id(x) for x in xs if x.grad_fn is None}
    input_nodes = {x.grad_fn for x in xs if x.grad_fn is not None}
    given = {id(w) for w in weights}
    regions = set(plan.split_regions)  # (the planner's split regions: the walk decides none again)
    children: dict[Node, list[Node | None]] = {}
    params: dict[Node, list[torch.Tensor | None]] = {}
    queue = list(out_nodes)
    while queue:
        node = queue.pop()
        if node in children or node in input_nodes:
            continue
        if node not in regions:  # (eager code: the plan has it in its B set, or W's)
            return False
        kids = children[node] = [c for c, _ in node.next_functions]
        row = params[node] = []
        for c in kids:
            if type(c) is accumulate_grad and id(c.variable) not in leaves:
                if id(c.variable) not in given:
                    row.append(None)  # a leaf no given weight: W computes no gradient for it
                    continue
                if not isinstance(c.variable, torch.nn.Parameter):
                    return False  # a plain-tensor weight: the general plan's
                row.append(c.variable)
                continue
            if c is not None and type(c) is not accumulate_grad:
                queue.append(c)
            row.append(None)
    nodes = list(children)
    if not nodes or not xs and (len(nodes) != 1 or any(n is not nodes[0] for n in out_nodes)):
        return False
    plan.split_regions, plan.region_children, plan.region_params = nodes, children, params
    if len(nodes) == 1:
        plan.direct_edges = _direct_edges(nodes[0], xs)
    return True


def _direct_edges(node: Node, xs: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """The position among ``node``'s next_functions where each of ``xs``
    enters it, each by one edge of its own, or ``None``: some input does not,
    or a forward argument of the region is no tensor (a symbolic size: the
    node's results are then not its edges')."""
    if len(node.needs_input_grad) != len(node.next_functions):
        return None
    accumulate_grad = ti.accumulate_grad_type()
    where: dict[Any, int] = {}
    for k, (c, nr) in enumerate(node.next_functions):
        key = id(c.variable) if type(c) is accumulate_grad else (id(c), nr)
        where[key] = -1 if key in where else k
    edges = [where.get(id(x) if x.grad_fn is None else (id(x.grad_fn), x.output_nr), -1) for x in xs]
    return None if -1 in edges else tuple(edges)


_first = operator.itemgetter(0)
_variable = operator.attrgetter("variable")
_requires_grad = operator.attrgetter("requires_grad")
_grad_fn = operator.attrgetter("grad_fn")
_output_nr = operator.attrgetter("output_nr")


def _once() -> bool:
    from fxsplit import config

    return config.current("whole_nodes") == "once"


def _weight_starts(
    weights: Sequence[torch.Tensor], node_of: dict[int, Node], roots: list[Node], parents: dict[Node, list[Node]],
    b_set: set[Node], split: set[Node],
) -> tuple[dict[Node, None], dict[int, None], set[Node], list[tuple[torch.Tensor, set[Node], set[int]]]]:
    """Where W starts for each weight (:func:`_walk_from_weight`), and over all
    of them: the intermediates, the stage outputs W starts from (by index), W's
    side of the graph, and per weight with any ``(weight, its intermediates, its outputs)``."""
    root_index: dict[Node, list[int]] = collections.defaultdict(list)
    for k, node in enumerate(roots):
        root_index[node].append(k)
    intermediates: dict[Node, None] = {}
    w_roots: dict[int, None] = {}
    w_side: set[Node] = set()
    starts: list[tuple[torch.Tensor, set[Node], set[int]]] = []
    for w in weights:
        w_node = node_of.get(id(w))
        if w_node is None:
            continue
        inter, outs, seen = _walk_from_weight(w_node, isinstance(w, torch.nn.Parameter), parents, b_set, split,
                                              root_index)
        if inter or outs:
            intermediates.update(inter)
            w_roots.update(dict.fromkeys(sorted(outs)))
            w_side.update(seen)
            starts.append((w, set(inter), outs))
    return intermediates, w_roots, w_side, starts


def _walk_from_weight(
    w_node: Node, parameter: bool, parents: dict[Node, list[Node]], b_set: set[Node], split: set[Node],
    root_index: dict[Node, list[int]],
) -> tuple[dict[Node, None], set[int], set[Node]]:
    """Up from a weight's gradient node to the B set: the B-set nodes its
    gradient flows out of (W's intermediates for it), the stage outputs it
    reaches without passing through the B set (by index), and the nodes seen
    (W's side). A ``parameter``'s gradient out of a split region directly is
    that region's dW graph's, not an intermediate's."""
    inter: dict[Node, None] = {}
    outs: set[int] = set()
    seen = {w_node}
    queue = collections.deque([w_node])
    while queue:
        node = queue.popleft()
        outs.update(root_index.get(node, ()))
        for p in parents.get(node, ()):
            if p in b_set:
                if node is w_node and parameter and p in split:
                    continue  # that region's dW graph computes this gradient
                inter[p] = None
            elif p not in seen:
                seen.add(p)
                queue.append(p)
    return inter, outs, seen


def plan_eager_weight_work(
    output_edges: Sequence[GradientEdge],
    input_nodes: Sequence[Node],
    weights: Sequence[torch.Tensor],
) -> EagerWeightPlan:
    """Find the intermediates and W roots that W needs for weights with an eager path.

    ``input_nodes`` are the gradient nodes of the stage inputs that need a
    gradient; none (with outputs) makes it a first stage, whose B targets
    are chosen here (``bottom_regions``, ``captures``).

    Raises ``ValueError`` when the weights look like another module's: some
    of them are not used by the stage outputs while parameters the outputs
    do use were not given.
    """
    roots = [e.node for e in output_edges]
    parents = _reverse_edges(roots)
    # Each node is asked once whether it is a split region (B and the per-weight walks ask often).
    split = {n for n in (*roots, *parents) if n is not None and is_split_region(n)}
    node_of, unreached, missing = _weight_nodes(parents, roots, weights)
    if unreached and missing:
        raise ValueError(
            f"fxsplit: {len(unreached)} of the weights given to stage_backward_input are not used by the "
            f"stage outputs, while {missing} parameter(s) the outputs depend on were not given: the weights "
            "do not belong to this stage (pass the stage module's parameters)"
        )
    bottom, captures = _bottom_regions(parents, roots, output_edges) if not input_nodes else ([], [])
    b_set = _upward_closure(list(input_nodes) or bottom, parents)
    intermediates, w_roots, w_side, starts = _weight_starts(weights, node_of, roots, parents, b_set, split)
    whole = [n for n in intermediates if n not in split and runs_whole(n)]
    once = dict.fromkeys(whole) if whole and _once() else {}
    eager = [n for n in intermediates if n not in split and n not in once]
    regions = [n for n in intermediates if n in split or n in once]
    groups = _group_weights(starts, {n: k for k, n in enumerate(eager)}, {n: k for k, n in enumerate(regions)}, node_of)
    rerun: set[Node] = set()
    release: list[Node] = []
    above: list[Node] = []
    if eager:  # B retains the graph only for these
        rerun, release, above = _rerun_and_release(eager, groups, b_set, parents)
    executed = rerun | w_side
    output_users = [[p for p in dict.fromkeys(parents.get(e.node, ())) if p in executed] for e in output_edges]
    return EagerWeightPlan(
        eager,
        list(w_roots),
        groups,
        unreached=len(unreached),
        region_starts=regions,
        once=list(once),
        split_regions=[n for n in b_set if n in split],
        w_side=w_side,
        rerun=rerun,
        release=release,
        above=above,
        bottom_regions=bottom,
        captures=captures,
        output_users=output_users,
    )


# -- decide once, guard, replay ------------------------------------------------------
# A stage's B is planned on its first microbatch; later microbatches replay that
# plan behind a guard. The plans are kept on the autograd node class of the
# stage's first output (one class per compiled region, and per compiled variant
# of it), at most this many per class: one per stage usually; a block compiled
# once and run by several stages (the same code, other weights) has one per stage.
MAX_PLANS_PER_REGION = 8
# A plan's fields that hold this microbatch's nodes or weights: StageShape.replay sets them.
_PER_CALL = frozenset({"split_regions", "region_params", "region_children", "bottom_regions", "captures"})
_PLANS_ATTR = "_fxsplit_b_plans"


@dataclasses.dataclass(frozen=True)
class _RegionShape:
    """One split region of a :class:`StageShape`: how to find its node in a new
    microbatch's graph and what must surround it there.

    ``parent``/``at``: the node is the ``at``-th stage output's node
    (``parent`` -1) or the ``at``-th child of region ``parent`` (an earlier one).
    ``kinds``: the type of each of its ``next_functions``' nodes. ``nodes_at``
    and ``accumulators_at`` are the positions, among those children, of the
    stage inputs' gradient nodes and of the grad accumulators (whose
    variables must be given tensors); ``expected`` the positions of what they
    must be in the call's pool ``[*weights, *inputs, *their gradient nodes]``
    (a leaf input is matched as itself, another by its gradient node). Children that are regions
    are :attr:`StageShape.region_children`; its parameters are :attr:`StageShape.params`.
    """

    cls: type
    parent: int
    at: int
    kinds: tuple[type, ...]
    nodes_at: tuple[int, ...]
    accumulators_at: tuple[int, ...]
    expected: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StageShape:
    """What a stage of split regions only looked like when B planned it, and the
    plan's stage-independent results: :meth:`replay` gives the plan of a new
    microbatch that looks the same, without planning it.

    The guard (:meth:`replay` returns ``None`` unless all hold): the same
    weights, the same objects in the same order, each with the same
    ``requires_grad``; as many stage outputs and inputs needing a gradient;
    every region's node found where it was, of the same class (a recompiled
    region, a new compiled variant, is another class); each region's children
    of the same types (a weight frozen or unfrozen turns an accumulator into
    ``None`` or back), its accumulators holding the same weights (a swapped
    weight is another object) or this call's leaf inputs, or, where they held
    a leaf neither, still neither; its other children the same regions or
    this call's inputs' gradient nodes (at the same output number where B may
    call the region's node itself); every output's node the region it was.
    That is everything the plan of a stage of compiled regions only depends
    on (:func:`_read_regions`: nothing but regions, inputs and the
    accumulators of leaves below the outputs), so planning again
    would return the same plan; what B and W decide per
    call (hooks, ``.grad``, layouts, anomaly mode, streams) is not in a plan.
    Holds the weights weakly (a plan does not keep a model alive).
    """

    weights: tuple[Any, ...]  # weak references
    requires: tuple[bool, ...]
    inputs: int
    outputs: int
    regions: tuple[_RegionShape, ...]
    output_regions: tuple[int, ...]  # each output's region, by position in the regions
    first: bool
    # The plan's fields that are the same on every replay (read-only, shared).
    fields: dict[str, Any]
    # (position among the one region's children, input index, output number)
    # for the non-leaf inputs of a plan with direct_edges
    input_numbers: tuple[tuple[int, int, int], ...]
    # (region, position among its children, region that child must be), by
    # position in the regions: checked once every region's node is found
    region_children: tuple[tuple[int, int, int], ...]
    # (region, position among its children) of the grad accumulators of
    # leaves that were neither a given weight nor an input (W computes no
    # gradient for them): each must still hold neither
    others: tuple[tuple[int, int], ...]
    # Each region's row of the plan's ``region_params``, as positions in
    # ``[*weights, None]``, by position in the regions
    params: tuple[tuple[int, ...], ...]

    def _misses_across(self, nodes: list[Any], children: list[list[Any]], pool: list[Any]) -> bool:
        """Whether, every region's node found, a child that must be another
        region is not, or an accumulator in :attr:`others` now holds a given
        weight or an input (a weight tied to a given one: W would leave out
        this region's share of its gradient)."""
        if any(children[i][k] is not nodes[j] for i, k, j in self.region_children):
            return True
        return bool(self.others) and not set(map(id, pool)).isdisjoint(id(children[i][k].variable) for i, k in self.others)

    def replay(
        self, outs: Sequence[torch.Tensor | GradientEdge], out_nodes: list[Any], xs: Sequence[torch.Tensor],
        weights: Sequence[torch.Tensor],
    ) -> EagerWeightPlan | None:
        if (
            len(weights) != len(self.weights) or len(xs) != self.inputs or len(out_nodes) != self.outputs
            or not all(map(operator.is_, map(operator.call, self.weights), weights))
            or tuple(map(_requires_grad, weights)) != self.requires
        ):
            return None
        nodes: list[Any] = []
        children: list[list[Any]] = []
        pool = [*weights, *xs, *map(_grad_fn, xs)]  # (a leaf input is matched as itself, another by its node)
        for r in self.regions:
            node = out_nodes[r.at] if r.parent < 0 else children[r.parent][r.at]
            if type(node) is not r.cls:
                return None
            kids = list(map(_first, node.next_functions))
            if tuple(map(type, kids)) != r.kinds:
                return None
            found = [*map(kids.__getitem__, r.nodes_at), *map(_variable, map(kids.__getitem__, r.accumulators_at))]
            if not all(map(operator.is_, found, map(pool.__getitem__, r.expected))):
                return None
            nodes.append(node)
            children.append(kids)
        if (self.region_children or self.others) and self._misses_across(nodes, children, pool):
            return None
        if not all(map(operator.is_, out_nodes, map(nodes.__getitem__, self.output_regions))):
            return None
        if self.input_numbers:
            edges = nodes[0].next_functions
            if any(edges[k][1] != nr or xs[i].output_nr != nr for k, i, nr in self.input_numbers):
                return None
        plan = object.__new__(EagerWeightPlan)  # (the fields every replay shares, then this call's)
        plan.__dict__.update(self.fields)
        plan.split_regions = nodes
        row = [*weights, None]  # (each region's params, positions in row, read in C-level passes)
        plan.region_params = dict(zip(nodes, map(list, map(map, itertools.repeat(row.__getitem__), self.params))))
        plan.region_children = dict(zip(nodes, children))
        if self.first:
            plan.bottom_regions = nodes
            plan.captures = list(itertools.starmap(GradientEdge, zip(out_nodes, map(_output_nr, outs))))  # (an edge: its own)
        return plan


def _stage_shape(
    plan: EagerWeightPlan, out_nodes: Sequence[Any], xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
) -> StageShape | None:
    """The :class:`StageShape` of a plan :func:`_read_regions` completed for
    this call, or ``None`` where it cannot say (a weight that cannot be
    referenced weakly; an output that is a stage input, not a region's)."""
    nodes = plan.split_regions
    index = {n: i for i, n in enumerate(nodes)}
    n_w, n_x = len(weights), len(xs)
    weight_at: dict[int, int] = {}
    for j, w in enumerate(weights):
        weight_at.setdefault(id(w), j)
    leaf_at = {id(x): i for i, x in enumerate(xs) if x.grad_fn is None}
    input_node_at = {x.grad_fn: i for i, x in enumerate(xs) if x.grad_fn is not None}
    accumulate_grad = ti.accumulate_grad_type()
    try:
        read = [_region_shape(plan, i, out_nodes, n_w, n_x, index, weight_at, leaf_at, input_node_at, accumulate_grad)
                for i in range(len(nodes))]
        refs = tuple(map(weakref.ref, weights))
        output_regions = tuple(index[n] for n in out_nodes)  # (KeyError: an output that is an input, no region's)
    except (KeyError, ValueError, TypeError, StopIteration) as e:  # (a child it cannot place; a weight with no weak reference)
        log.debug("fxsplit: B: this stage's plan is not kept (%s: %s); B plans it on every call", type(e).__name__, e)
        return None
    numbers = ()
    if plan.direct_edges is not None:
        numbers = tuple((k, i, x.output_nr) for i, (k, x) in enumerate(zip(plan.direct_edges, xs)) if x.grad_fn is not None)
    return StageShape(
        refs, tuple(map(_requires_grad, weights)), n_x, len(out_nodes), tuple(shape for shape, _, _, _ in read),
        output_regions, bool(plan.captures),
        {**{k: v for k, v in vars(plan).items() if k not in _PER_CALL}, "bottom_regions": [], "captures": [],
         "w_side": frozenset(), "rerun": frozenset(), "commit_plans": [], "prepared": True}, numbers,
        tuple((i, k, j) for i, (_, _, region_kids, _) in enumerate(read) for k, j in region_kids),
        tuple((i, k) for i, (_, _, _, others) in enumerate(read) for k in others),
        tuple(params for _, params, _, _ in read),
    )


def _region_shape(
    plan: EagerWeightPlan, i: int, out_nodes: Sequence[Any], n_w: int, n_x: int, index: dict[Any, int],
    weight_at: dict[int, int], leaf_at: dict[int, int], input_node_at: dict[Any, int], accumulate_grad: type,
) -> tuple[_RegionShape, tuple[int, ...], list[tuple[int, int]], list[int]]:
    """Region ``i`` of the plan as :class:`StageShape` keeps it, its row of
    :attr:`StageShape.params`, its children
    that are regions (position among its children, region index), and the
    positions of its grad accumulators of leaves that are neither a given
    weight nor an input (:attr:`StageShape.others`); KeyError:
    the plan has a child it could not have made."""
    nodes = plan.split_regions
    node = nodes[i]
    if node in out_nodes:
        parent, at = -1, list(out_nodes).index(node)
    else:
        parent, at = next((r, plan.region_children[nodes[r]].index(node)) for r in range(i)
                          if node in plan.region_children[nodes[r]])
    kids = plan.region_children[node]
    node_pos, node_exp, acc_pos, acc_exp, regions, others = [], [], [], [], [], []
    for k, c in enumerate(kids):
        if c is None:
            continue
        if type(c) is accumulate_grad:
            v = c.variable
            if id(v) not in leaf_at and id(v) not in weight_at:
                others.append(k)  # a leaf neither given nor an input: no part of the plan
                continue
            acc_pos.append(k)
            acc_exp.append(n_w + leaf_at[id(v)] if id(v) in leaf_at else weight_at[id(v)])
        elif c in index:
            regions.append((k, index[c]))
        else:
            node_pos.append(k)
            node_exp.append(n_w + n_x + input_node_at[c])
    params = [n_w if p is None else weight_at[id(p)] for p in plan.region_params[node]]
    return _RegionShape(type(node), parent, at, tuple(map(type, kids)), tuple(node_pos), tuple(acc_pos),
                        tuple(node_exp + acc_exp)), tuple(params), regions, others


def prepare_regions(nodes: Iterable[Node]) -> None:
    """Make split regions ready for B: their dI and dW graphs compiled (a
    compile error raises before anything has run), and their nodes accepting
    ``None`` for the gradients of tensor-subclass weights (B returns none);
    both once per region, so a replayed plan needs neither."""
    for node in nodes:
        ti.compiled_backward_of(node).prepare_split()
        ti.let_backward_leave_subclass_gradients_out(node)
        ti.route_backward_of(node, route_backward)


def plan_stage(
    outs: Sequence[torch.Tensor | GradientEdge],
    out_nodes: list[Node],
    xs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
) -> EagerWeightPlan:
    """B's plan for a stage with outputs ``outs`` (``out_nodes``: the node each
    one's gradient flows into), inputs needing a gradient ``xs`` and ``weights``.

    Planned by :func:`plan_eager_weight_work`. Where the plan has no eager part
    (a stage of fxsplit-compiled regions only, :func:`_read_regions`), it is
    kept with its :class:`StageShape` and replayed on later microbatches while
    that guard holds; a miss plans again (and keeps the new shape beside the
    old, up to :data:`MAX_PLANS_PER_REGION`), never answers wrongly. Any other
    stage is planned on every call, as its plan holds this microbatch's eager
    nodes. Every split region's graphs are compiled when the returned plan is
    ``prepared``; otherwise B compiles them.
    """
    shapes = type(out_nodes[0]).__dict__.get(_PLANS_ATTR) if out_nodes else None  # (only split regions' classes)
    if shapes:
        for shape in shapes:
            plan = shape.replay(outs, out_nodes, xs, weights)
            if plan is not None:
                return plan
    elif shapes is None and out_nodes and out_nodes[0] is not None and is_split_region(out_nodes[0]):
        shapes = []
        setattr(type(out_nodes[0]), _PLANS_ATTR, shapes)
    edges = [gradient_edge(o) for o in outs]
    plan = plan_eager_weight_work(edges, [gradient_edge(x).node for x in xs] if outs else [], weights)
    if shapes is None or not _read_regions(plan, out_nodes, xs, weights):
        return plan
    prepare_regions(plan.split_regions)
    plan.prepared = True
    shape = _stage_shape(plan, out_nodes, xs, weights)
    if shape is not None:
        plan.commit_plans = shape.fields["commit_plans"]
        if len(shapes) >= MAX_PLANS_PER_REGION:
            del shapes[0]
        shapes.append(shape)
    return plan
