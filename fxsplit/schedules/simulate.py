"""Replay an action order with per-stage costs: the step time, each rank's bubble and memory.

The model, which is what ``_PipelineScheduleRuntime`` does on each rank:

* every rank runs its actions one after the other, in order, from time 0;
  ``OVERLAP_F_B`` runs its forward then its backward; ``UNSHARD``, ``RESHARD``,
  ``REDUCE_GRAD`` and the posting of a send or receive take no time;
* an action starts when its rank is free and its inputs are there:
  ``F(s, m)`` needs stage ``s - 1``'s output of microbatch ``m``; ``I(s, m)``
  and ``B(s, m)`` need ``F(s, m)`` and the gradient from ``I``/``B(s + 1, m)``
  (the last stage needs only its forward); ``W(s, m)`` needs ``I(s, m)``;
* between stages on one rank the hand-over is free (upstream's V-schedule
  special case); between ranks it takes ``comm`` of the sending side's
  boundary (:class:`~fxsplit.schedules.costs.StageCosts`). In a lowered order
  the transfer starts when both the ``SEND`` and the matching ``RECV`` are
  posted (gloo and NCCL match a send with a posted receive); in a compute-only
  order the receive is taken as posted in time; ``WAIT_SEND_F``/``WAIT_SEND_B``
  (torch 2.15's lowering adds them, 2.13's does not) hold the sending rank
  until its transfer has arrived; ``WAIT_REDUCE_GRAD`` takes no time;
* memory: ``F`` holds the stage's ``activation_bytes`` from its start, ``I``
  trades them for ``live_in_bytes`` when it ends, ``W`` frees those when it
  ends, and a ``B`` frees the activations when it ends.

What it leaves out: time between actions (the runtime's bookkeeping, the loss),
contention between ranks sharing cores, and a send's cost to its sender.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fxsplit.schedules.costs import PipelineCosts
from fxsplit.schedules.orders import as_actions, primitive_actions

__all__ = ["ScheduleError", "Simulation", "TimedAction", "simulate"]

_COMPUTE = ("F", "I", "W", "B")
_COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_WAITS = ("WAIT_SEND_F", "WAIT_SEND_B")  # the sender waits for its transfer (torch 2.15 lowers them)
_FREE = ("UNSHARD", "RESHARD", "REDUCE_GRAD", "WAIT_REDUCE_GRAD")


class ScheduleError(ValueError):
    """An action order that cannot run: a stage on two ranks, a microbatch missing or
    done twice, an action whose input never comes (a deadlock), a lowered order with a
    compute action whose receive is missing."""


@dataclasses.dataclass(frozen=True)
class TimedAction:
    """One compute action of the replay (``kind`` is ``F``, ``I``, ``W`` or ``B``)."""

    rank: int
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Simulation:
    """A replayed step. ``step_time``: when the last rank finishes (all start at 0);
    per rank: ``busy`` (time in compute actions), ``bubble`` (``1 - busy /
    step_time``), ``peak_bytes`` (highest memory held by in-flight microbatches);
    ``timeline``: every compute action with its start and end."""

    step_time: float
    busy: tuple[float, ...]
    peak_bytes: tuple[int, ...]
    timeline: tuple[TimedAction, ...]
    lowered: bool

    @property
    def bubble(self) -> tuple[float, ...]:
        return tuple(1.0 - b / self.step_time if self.step_time > 0 else 0.0 for b in self.busy)

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.bubble)


Op = tuple[str, int, int]  # (kind, stage, microbatch)


def _flatten(order: Mapping[int, Sequence[Any]]) -> tuple[dict[int, list[Op]], bool]:
    ranks = sorted(order)
    if ranks != list(range(len(ranks))):
        raise ScheduleError(f"the order's ranks must be 0..{len(ranks) - 1}, got {ranks}")
    ops: dict[int, list[Op]] = {r: [] for r in ranks}
    lowered = False
    for r, acts in as_actions(order).items():
        for a in acts:
            if a is None:
                continue
            for stage, kind, mb in primitive_actions(a):
                if kind in _FREE:
                    continue
                if kind not in _COMPUTE + _COMMS + _WAITS:
                    raise ScheduleError(f"rank {r}: action {a} ({kind}) is not one the simulator knows")
                if mb is None:
                    raise ScheduleError(f"rank {r}: action {a} has no microbatch")
                lowered |= kind in _COMMS + _WAITS
                ops[r].append((kind, stage, mb))
    return ops, lowered


def _check(ops: dict[int, list[Op]], n_stages: int, lowered: bool) -> tuple[dict[int, int], list[int]]:
    """The stage -> rank placement and the microbatches, after checking that every
    stage's microbatches each run one forward and one backward (B, or I then W)."""
    placement: dict[int, int] = {}
    seen: dict[tuple[str, int, int], int] = {}
    for r, rank_ops in ops.items():
        for kind, stage, mb in rank_ops:
            if kind not in _COMPUTE:
                continue
            if not 0 <= stage < n_stages:
                raise ScheduleError(f"rank {r}: stage {stage} is outside the costs' {n_stages} stages")
            if placement.setdefault(stage, r) != r:
                raise ScheduleError(f"stage {stage} has actions on rank {placement[stage]} and on rank {r}")
            if (kind, stage, mb) in seen:
                raise ScheduleError(f"rank {r}: {stage}{kind}{mb} appears twice")
            seen[(kind, stage, mb)] = r
    missing = sorted(set(range(n_stages)) - set(placement))
    if missing:
        raise ScheduleError(f"stages {missing} have no actions (the costs have {n_stages} stages)")
    mbs = sorted({mb for (kind, stage, mb) in seen if kind == "F" and stage == 0})
    for stage in range(n_stages):
        for mb in mbs:
            if ("F", stage, mb) not in seen:
                raise ScheduleError(f"stage {stage} never runs F for microbatch {mb}")
            b, i, w = (("B", stage, mb) in seen), (("I", stage, mb) in seen), (("W", stage, mb) in seen)
            if not (b and not i and not w) and not (i and w and not b):
                raise ScheduleError(f"stage {stage}, microbatch {mb}: needs one B, or one I and one W; has "
                                    f"{'B ' * b}{'I ' * i}{'W ' * w}".rstrip())
    extra = sorted({mb for (_, _, mb) in seen} - set(mbs))
    if extra:
        raise ScheduleError(f"microbatches {extra} have backward actions but stage 0 never runs their forward")
    if lowered:  # each cross-rank input must be received on the consumer's rank, before it is used
        for r, rank_ops in ops.items():
            posted: set[tuple[str, int, int]] = set()
            for kind, stage, mb in rank_ops:
                if kind in ("RECV_F", "RECV_B"):
                    posted.add((kind, stage, mb))
                elif kind == "F" and stage > 0 and placement[stage - 1] != r and ("RECV_F", stage, mb) not in posted:
                    raise ScheduleError(f"rank {r}: {stage}F{mb} comes before its {stage}RECV_F{mb}")
                elif (kind in ("I", "B") and stage < n_stages - 1 and placement[stage + 1] != r
                      and ("RECV_B", stage, mb) not in posted):
                    raise ScheduleError(f"rank {r}: {stage}{kind}{mb} comes before its {stage}RECV_B{mb}")
    return placement, mbs


def simulate(order: Mapping[int, Sequence[Any]], costs: PipelineCosts) -> Simulation:
    """Replay ``order`` (rank -> actions: upstream ``_Action`` s or their strings,
    compute-only or lowered, ``None`` entries skipped) with ``costs`` (one entry per
    stage; the order must use exactly those stages). Raises :class:`ScheduleError`
    for an order that cannot run, naming the first action each blocked rank waits at."""
    ops, lowered = _flatten(order)
    n_stages = len(costs)
    placement, _ = _check(ops, n_stages, lowered)
    ranks = sorted(ops)
    end: dict[tuple[str, int, int], float] = {}  # F, I (also set by B), W, B
    posted: dict[tuple[str, int, int], float] = {}  # SEND_*/RECV_* -> when posted
    clock = dict.fromkeys(ranks, 0.0)
    busy = dict.fromkeys(ranks, 0.0)
    mem = dict.fromkeys(ranks, 0)
    peak = dict.fromkeys(ranks, 0)
    ptr = dict.fromkeys(ranks, 0)
    timeline: list[TimedAction] = []

    def transferred(direction: str, consumer: int, producer: int, mb: int) -> float | None:
        """When a lowered order's transfer of ``producer``'s output (F) or gradient (B)
        to ``consumer`` has arrived: both sides posted, then the hop."""
        sent = posted.get((f"SEND_{direction}", producer, mb))
        received = posted.get((f"RECV_{direction}", consumer, mb))
        if sent is None or received is None:
            return None
        return max(sent, received) + costs[min(producer, consumer)].comm

    def arrival(direction: str, consumer: int, producer: int, mb: int, r: int) -> float | None:
        """When stage ``producer``'s output (F) or gradient (B) for ``consumer`` is on rank ``r``."""
        produced_key = ("F", producer, mb) if direction == "F" else ("I", producer, mb)
        if placement[producer] == r:
            return end.get(produced_key)
        if not lowered:
            t = end.get(produced_key)
            return None if t is None else t + costs[min(producer, consumer)].comm
        return transferred(direction, consumer, producer, mb)

    def ready_at(kind: str, stage: int, mb: int, r: int) -> float | None:
        if kind == "F":
            return 0.0 if stage == 0 else arrival("F", stage, stage - 1, mb, r)
        if kind in ("I", "B"):
            fwd = end.get(("F", stage, mb))
            if fwd is None:
                return None
            if stage == n_stages - 1:
                return fwd
            grad = arrival("B", stage, stage + 1, mb, r)
            return None if grad is None else max(fwd, grad)
        if kind == "W":
            return end.get(("I", stage, mb))
        if kind == "SEND_F":
            return end.get(("F", stage, mb))
        if kind == "SEND_B":
            return end.get(("I", stage, mb))
        if kind == "WAIT_SEND_F":
            return transferred("F", stage + 1, stage, mb)
        if kind == "WAIT_SEND_B":
            return transferred("B", stage - 1, stage, mb)
        return 0.0  # RECV_*: posting a receive waits for nothing

    progress = True
    while progress:
        progress = False
        for r in ranks:
            rank_ops = ops[r]
            while ptr[r] < len(rank_ops):
                kind, stage, mb = rank_ops[ptr[r]]
                ready = ready_at(kind, stage, mb, r)
                if ready is None:
                    break
                start = max(clock[r], ready)
                c = costs[stage]
                if kind in _COMMS + _WAITS:
                    if kind in _COMMS:
                        posted[(kind, stage, mb)] = start
                    clock[r] = start
                else:
                    if kind == "F":
                        mem[r] += c.activation_bytes
                        peak[r] = max(peak[r], mem[r])
                    duration = {"F": c.f, "I": c.i, "W": c.w, "B": c.full_backward}[kind]
                    finish = start + duration
                    end[(kind, stage, mb)] = finish
                    if kind == "B":
                        end[("I", stage, mb)] = finish
                        mem[r] -= c.activation_bytes
                    elif kind == "I":
                        mem[r] += c.live_in_bytes - c.activation_bytes
                        peak[r] = max(peak[r], mem[r])
                    elif kind == "W":
                        mem[r] -= c.live_in_bytes
                    busy[r] += duration
                    clock[r] = finish
                    timeline.append(TimedAction(r, stage, kind, mb, start, finish))
                ptr[r] += 1
                progress = True
    blocked = {r: ops[r][ptr[r]] for r in ranks if ptr[r] < len(ops[r])}
    if blocked:
        waits = "; ".join(f"rank {r} waits at {s}{k}{m}" for r, (k, s, m) in blocked.items())
        raise ScheduleError(f"the order deadlocks: {waits}")
    return Simulation(
        step_time=max(clock.values()), busy=tuple(busy[r] for r in ranks), peak_bytes=tuple(peak[r] for r in ranks),
        timeline=tuple(timeline), lowered=lowered,
    )
