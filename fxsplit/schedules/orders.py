"""Action orders in upstream's schedule IR: reading them, building them, placing stages.

An *action order* maps each pipeline rank to the list of actions it runs, in
``torch.distributed.pipelining``'s own IR (``schedules._Action``: ``"0F1"`` is
stage 0's forward of microbatch 1; ``I``, ``W`` and ``B`` are the input-gradient,
weight-gradient and full backward). A *compute-only* order holds ``F``/``I``/
``W``/``B`` (and ``OVERLAP_F_B``) actions, as a schedule's ``pipeline_order``
does; a *lowered* order is what ``_PipelineScheduleRuntime`` executes
(``pipeline_order_with_comms``): the same with ``SEND_*``/``RECV_*``,
``UNSHARD``/``RESHARD`` and ``REDUCE_GRAD`` actions. Private torch APIs are
reached through :mod:`fxsplit._torch_internals`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from fxsplit import _torch_internals as ti

__all__ = [
    "PLACEMENTS", "RUNTIME_SCHEDULES", "UPSTREAM_SCHEDULES", "Order", "action", "as_actions", "lower",
    "one_f_one_b_order", "primitive_actions", "stage_to_rank", "upstream_order", "upstream_stage_to_rank",
]

Order = Mapping[int, Sequence[Any]]

PLACEMENTS = ("v", "interleaved", "contiguous")
# Upstream schedule classes this module builds orders for, with the stages each rank holds when the
# class is built as upstream builds it (upstream_order's stages_per_rank says which other counts each takes).
UPSTREAM_SCHEDULES = {
    "Schedule1F1B": 1,
    "ScheduleInterleaved1F1B": 2,
    "ScheduleInterleavedZeroBubble": 2,
    "ScheduleZBVZeroBubble": 2,
    "ScheduleDualPipeV": 2,
}
RUNTIME_SCHEDULES = tuple(n for n, k in UPSTREAM_SCHEDULES.items() if k > 1)  # run by _PipelineScheduleRuntime
# Classes whose stage count per rank is fixed (a V needs two stages per rank); the others take any count:
# the interleaved ones hold that many stages, Schedule1F1B runs that many consecutive stages as one.
_FIXED_STAGES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@functools.lru_cache(maxsize=1 << 16)
def action(stage: int, kind: str, microbatch: int | None = None) -> Any:
    """One upstream action: ``action(0, "F", 1)`` is ``0F1`` (immutable, so shared)."""
    return ti.make_action(stage, kind, microbatch)


def as_actions(order: Mapping[int, Sequence[Any]]) -> dict[int, list[Any]]:
    """``order`` with every string (``"0F1"``, ``"(0F3;3B1)OVERLAP_F_B"``) parsed into an
    upstream action and ``None`` / ``""`` kept as ``None``."""
    return {r: [ti.parse_action(a) if isinstance(a, str) else a for a in actions] for r, actions in order.items()}


@functools.lru_cache(maxsize=1 << 16)
def primitive_actions(act: Any) -> tuple[tuple[int, str, int | None], ...]:
    """``(stage, kind, microbatch)`` of an action, or of each of its sub-actions
    (``OVERLAP_F_B``: its forward and its backward, which the runtime runs in turn)."""
    stage, kind, mb, subs = ti.action_parts(act)
    if subs is not None:
        return tuple(p for sub in subs for p in primitive_actions(sub))
    return ((stage, kind, mb),)


def stage_to_rank(placement: str, n_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """The rank of every stage: ``"interleaved"`` (looped: stage ``s`` on rank
    ``s % n_ranks``, as ``ScheduleInterleaved1F1B`` places them), ``"v"`` (the
    stages zig-zag over the ranks: rank ``r`` holds ``r`` and ``2 * n_ranks - 1 - r``
    for two stages per rank, as ``ScheduleZBVZeroBubble`` places them) or
    ``"contiguous"`` (rank ``r`` holds the consecutive stages ``r * stages_per_rank``
    onwards: a one-stage-per-rank schedule such as ``Schedule1F1B`` run over a finer
    cut of the same model). With one stage per rank all three are the same."""
    if n_ranks < 1 or stages_per_rank < 1:
        raise ValueError(f"need at least one rank and one stage per rank, got {n_ranks} and {stages_per_rank}")
    n = n_ranks * stages_per_rank
    if placement == "interleaved":
        return tuple(s % n_ranks for s in range(n))
    if placement == "v":
        return tuple(s % n_ranks if (s // n_ranks) % 2 == 0 else n_ranks - 1 - s % n_ranks for s in range(n))
    if placement == "contiguous":
        return tuple(s // stages_per_rank for s in range(n))
    raise ValueError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}")


def one_f_one_b_order(n_stages: int, n_microbatches: int) -> dict[int, list[Any]]:
    """The order ``Schedule1F1B`` runs (one stage per rank), as its ``_step_microbatches``
    runs it: stage ``s`` does ``min(n_microbatches, n_stages - s)`` forwards, then
    alternates a full backward and a forward, then the remaining backwards.

    Written here rather than read from ``Schedule1F1B.pipeline_order``: on torch
    2.13 that table (``_get_pipeline_order``) is off by one on the last stage (it
    starts at ``F1`` and ends at ``F{n_microbatches}``), while the runtime runs
    the order above."""
    order: dict[int, list[Any]] = {}
    for s in range(n_stages):
        warmup = min(n_microbatches, n_stages - s)
        acts = [action(s, "F", m) for m in range(warmup)]
        f, b = warmup, 0
        while True:
            acts.append(action(s, "B", b))
            b += 1
            if f == n_microbatches:
                break
            acts.append(action(s, "F", f))
            f += 1
        acts += [action(s, "B", m) for m in range(b, n_microbatches)]
        order[s] = acts
    return order


@functools.lru_cache(maxsize=64)
def _upstream(name: str, n_ranks: int, n_microbatches: int, per: int) -> tuple[Any, Any, tuple[int, ...]]:
    """(compute-only order, lowered order, placement), frozen for the cache."""
    freeze = lambda o: tuple((r, tuple(o[r])) for r in sorted(o))  # noqa: E731
    if name == "Schedule1F1B":
        compute = _one_f_one_b_over(n_ranks, n_microbatches, per)
        lowered = lower(compute, n_ranks, n_microbatches)
        return freeze(compute), freeze(lowered), stage_to_rank("contiguous", n_ranks, per)
    compute, low, mapping = ti.upstream_schedule_orders(name, n_ranks, n_microbatches, per)
    return freeze(compute), freeze(low), tuple(mapping[s] for s in range(n_ranks * per))


def _one_f_one_b_over(n_ranks: int, n_microbatches: int, per: int) -> dict[int, list[Any]]:
    """:func:`one_f_one_b_order` with each rank's one stage run as ``per`` consecutive
    stages: its forward as their forwards in order, its backward as their backwards
    in reverse. Replayed with the fine stages' costs this is ``Schedule1F1B`` on the
    coarse cut (:meth:`PipelineCosts.merged`): the hand-over inside a rank is free."""
    order: dict[int, list[Any]] = {}
    for r, acts in one_f_one_b_order(n_ranks, n_microbatches).items():
        fine: list[Any] = []
        for a in acts:
            ((_, kind, mb),) = primitive_actions(a)
            stages = range(r * per, (r + 1) * per)
            fine += [action(s, kind, mb) for s in (stages if kind == "F" else reversed(stages))]
        order[r] = fine
    return order


def _stages_per_rank(name: str, stages_per_rank: int | None) -> int:
    if name not in UPSTREAM_SCHEDULES:
        raise ValueError(f"no action order for {name!r}; choose one of {sorted(UPSTREAM_SCHEDULES)}")
    per = UPSTREAM_SCHEDULES[name] if stages_per_rank is None else stages_per_rank
    if per < 1 or (name in _FIXED_STAGES and per != UPSTREAM_SCHEDULES[name]):
        raise ValueError(f"{name} cannot run {per} stages per rank")
    return per


def upstream_order(name: str, n_ranks: int, n_microbatches: int, lowered: bool = True,
                   stages_per_rank: int | None = None) -> dict[int, list[Any]]:
    """The action order of upstream's schedule class ``name`` (a key of
    :data:`UPSTREAM_SCHEDULES`) for ``n_ranks`` ranks, computed by the class itself:
    the lowered order its runtime executes, or (``lowered=False``) its compute-only
    ``pipeline_order``.

    ``stages_per_rank`` (default: the class's own count) builds the interleaved
    classes with that many stages per rank, and runs ``Schedule1F1B`` over that
    many consecutive stages per rank (``"contiguous"`` placement; see
    :func:`_one_f_one_b_over`). ``Schedule1F1B`` has no runtime IR: its
    compute-only order is :func:`one_f_one_b_order`, and its lowered order is that
    order lowered as ``_PipelineScheduleRuntime`` lowers a loaded schedule (each
    receive posted just before the action that needs it, as ``Schedule1F1B``'s own
    loop posts them). Raises ``ValueError`` for a name not listed or sizes the class
    refuses."""
    per = _stages_per_rank(name, stages_per_rank)
    try:
        compute, low, _ = _upstream(name, n_ranks, n_microbatches, per)
    except AssertionError as e:  # upstream's validation refusing the sizes
        raise ValueError(f"{name} refuses {n_ranks} ranks x {per} stages, {n_microbatches} microbatches: {e}") from e
    chosen = low if lowered else compute
    return {r: list(a) for r, a in chosen}


def upstream_stage_to_rank(name: str, n_ranks: int, n_microbatches: int,
                           stages_per_rank: int | None = None) -> tuple[int, ...]:
    """Where upstream's ``name`` places each stage (its ``stage_index_to_group_rank``)."""
    return _upstream(name, n_ranks, n_microbatches, _stages_per_rank(name, stages_per_rank))[2]


def lower(order: Order, n_ranks: int, n_microbatches: int) -> dict[int, list[Any]]:
    """A compute-only ``order`` lowered by upstream's ``_PipelineScheduleRuntime`` exactly as
    it lowers a loaded schedule (``_prepare_schedule_with_comms``); raises
    ``AssertionError`` (upstream's ``_validate_schedule`` / ``_add_send_recv``) for a
    malformed order."""
    actions = as_actions(order)
    n_stages = 1 + max(stage for acts in actions.values() for a in acts if a is not None
                       for stage, _, _ in primitive_actions(a))
    lowered, _ = ti.lower_schedule(actions, n_ranks, n_stages, n_microbatches)
    return lowered
