"""A zero-bubble schedule generated from measured per-stage costs.

:func:`generate_schedule` builds action orders with a greedy list scheduler in
the spirit of the zero-bubble paper's automatic ZB-1p/ZB-2p scheduler (Qi et
al., 2024, section 3), replays them with :func:`~fxsplit.schedules.simulate`
as ``_PipelineScheduleRuntime`` will run them (lowered with their sends and
receives), and returns the fastest that stays within the memory limit. (Each
order is first replayed without its sends and receives, a lower bound of its
replay as run; only orders that can still win are lowered.)

The greedy runs the pipeline in simulated time. Whenever a rank is free it
runs, in this order of preference:

1. an ``I`` whose gradient has arrived (the input gradient is on the critical
   path: the previous stage waits for it);
2. an ``F`` whose input has arrived, if the rank's memory after it stays within
   the limit and, for a microbatch new to the rank, fewer than ``max_in_flight``
   microbatches are on the rank, room is left to move one of them on to the
   rank's next stage, and no work on a microbatch already on the rank (an
   ``I``, a deeper stage's ``F``) can start within ``f_gap`` times the ``F``
   (the deepest stage first: it reaches the loss, where the backward starts,
   soonest);
3. a pending ``W`` (oldest first), if the time until the next ``I`` or ``F``
   can start is at least ``w_gap`` times the ``W`` (so that it fills a bubble
   rather than delaying the critical path), or memory blocks every ``F``, or
   the rank has no ``F`` or ``I`` left;
4. otherwise it waits for the next arrival.

The search varies the placement (``"v"``, ``"interleaved"``, ``"contiguous"``),
``max_in_flight``, ``w_gap`` and ``f_gap``. The orders of every upstream schedule
class that runs the same number of stages per rank on one of those placements are
candidates too (``Schedule1F1B`` over consecutive stages, the interleaved classes,
ZB-V and DualPipeV where there are two stages per rank), replayed exactly as
:func:`~fxsplit.schedules.upstream_order` gives them and as anyone comparing
against them replays them, so the result is never slower in simulation than any
of them within the limit; :attr:`GeneratedSchedule.upstream` lists each with its
step and whether the limit left it out. The fastest greedy orders and the upstream ones are also
tried with :func:`merge_where_free`: an ``I`` and the ``W`` right after it
become one full backward ``B`` (fxsplit's fused graph, cheaper than ``I`` +
``W`` by the split's overhead) wherever the gradient still arrives in time;
:attr:`GeneratedSchedule.source` says which candidate won and
:attr:`GeneratedSchedule.candidates` lists them all.
"""

from __future__ import annotations

import csv
import dataclasses
import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fxsplit import _torch_internals as ti
from fxsplit.schedules.costs import PipelineCosts
from fxsplit.schedules.orders import (
    PLACEMENTS, UPSTREAM_SCHEDULES, action, lower, primitive_actions, stage_to_rank, upstream_order,
    upstream_stage_to_rank,
)
from fxsplit.schedules.simulate import ScheduleError, Simulation, simulate

__all__ = ["Candidate", "GeneratedSchedule", "generate_schedule", "greedy_order", "merge_where_free"]

# w_gap values searched: W whenever idle, when it fits the gap, only when forced.
W_GAPS = (0.0, 1.0, math.inf)
# f_gap values searched: start a new microbatch whenever possible, or only if it delays no work already here.
F_GAPS = (0.0, 1.0)
# How many of the greedy orders (the fastest in the compute-only replay) are also tried with I + W merged.
_MERGED_FINALISTS = 4


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One order the search replayed: where it came from, its simulated step time as run
    (lowered) and peak memory (highest over ranks), and whether that peak is within the
    limit. ``step_time`` is ``None`` for an order not replayed as run: over the limit,
    or already slower without its sends and receives than the best order as run."""

    source: str
    placement: str
    step_time: float | None
    peak_bytes: int
    fits: bool

    @property
    def is_upstream(self) -> bool:
        """An upstream schedule class's own order (``source`` is its class name)."""
        return self.source in UPSTREAM_SCHEDULES


@dataclasses.dataclass(frozen=True)
class GeneratedSchedule:
    """A generated schedule and what it is expected to do.

    * ``order``: the compute-only action order (rank -> upstream actions), what
      ``_PipelineScheduleRuntime`` loads (:meth:`to_csv`, :meth:`build`);
    * ``stage_to_rank``: where each stage lives (build each rank's stages from
      :meth:`stages_of`);
    * ``simulation``: the lowered order replayed with the costs it was made for;
    * ``source``: the candidate that won (``"greedy(...)"`` with its parameters,
      or an upstream schedule's class name); ``candidates``: every one tried.
    """

    order: dict[int, list[Any]]
    stage_to_rank: tuple[int, ...]
    n_microbatches: int
    placement: str
    source: str
    simulation: Simulation
    memory_limit: int | None
    candidates: tuple[Candidate, ...]

    @property
    def n_ranks(self) -> int:
        return len(self.order)

    @property
    def step_time(self) -> float:
        """The simulated step time of the winner, as run (lowered)."""
        return self.simulation.step_time

    @property
    def runner_up(self) -> Candidate | None:
        """The fastest candidate within the limit, replayed as run, other than the winner
        (``None`` if there is none)."""
        others = [c for c in self.candidates if c.fits and c.step_time is not None and c.source != self.source]
        return min(others, key=lambda c: c.step_time or 0.0, default=None)

    @property
    def upstream(self) -> dict[str, Candidate]:
        """Every upstream schedule class tried, by class name, with its simulated step as
        run on the same costs, whether or not it fits the memory limit (``fits``)."""
        return {c.source: c for c in self.candidates if c.is_upstream}

    def summary(self) -> str:
        """One line: which candidate won, its simulated step, by how much it beats the
        runner-up, and the upstream schedules the memory limit left out."""
        line = f"{self.source} ({self.placement} placement): simulated {self.step_time:.4g}"
        up = self.runner_up
        if up is not None and up.step_time:
            line += f", {100 * (1 - self.step_time / up.step_time):.1f} % faster than the runner-up {up.source} " \
                    f"({up.step_time:.4g})"
        over = [c for c in self.upstream.values() if not c.fits]
        if over:
            line += "; over the memory limit: " + ", ".join(
                f"{c.source} ({c.step_time:.4g}, peak {c.peak_bytes} bytes)" for c in over)
        return line

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in increasing order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def lowered(self) -> dict[int, list[Any]]:
        """The order as ``_PipelineScheduleRuntime`` runs it (with sends and receives)."""
        return lower(self.order, self.n_ranks, self.n_microbatches)

    def to_csv(self, path: str | Path) -> None:
        """Write the compute-only order in upstream's CSV format (one row per rank, one
        action per cell), which ``_PipelineScheduleRuntime._load_csv`` reads."""
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            for r in range(self.n_ranks):
                writer.writerow(["" if a is None else str(a) for a in self.order[r]])

    def build(self, stages: Sequence[Any], **kwargs: Any) -> Any:
        """A ``torch.distributed.pipelining`` ``_PipelineScheduleRuntime`` running this
        order over this rank's ``stages`` (``stages_of(rank)``, in that order), set up
        as its ``_load_csv`` sets up a loaded schedule. ``kwargs`` go to its
        constructor (``loss_fn``, ``scale_grads``, ...). Call ``step`` on it as on any
        upstream schedule."""
        held = sorted(st.stage_index for st in stages)
        if not stages or held != self.stages_of(stages[0].group_rank):
            rank = stages[0].group_rank if stages else "?"
            raise ValueError(f"GeneratedSchedule.build: rank {rank} must pass the stages "
                             f"{self.stages_of(stages[0].group_rank) if stages else '...'}, got {held}")
        return ti.runtime_schedule(stages, self.n_microbatches, self.order, **kwargs)


def greedy_order(costs: PipelineCosts, n_ranks: int, n_microbatches: int, placement: str = "v",
                 memory_limit: int | None = None, max_in_flight: int | Sequence[int] | None = None,
                 w_gap: float = 1.0, f_gap: float = 0.0) -> dict[int, list[Any]]:
    """One greedy compute-only order (the module's docstring has the rules). Stages per
    rank: ``len(costs) // n_ranks``. ``max_in_flight``: how many microbatches each
    rank may have started (forward on its first stage) and not finished (input
    gradient of its first stage), one number for all ranks or one per rank; ``None``:
    only memory limits it. Raises :class:`ScheduleError` if the greedy stalls (a
    memory limit or cap that leaves a rank unable to pass a microbatch on)."""
    n_stages = len(costs)
    if n_stages % n_ranks:
        raise ValueError(f"{n_stages} stages do not divide over {n_ranks} ranks")
    rank_of = stage_to_rank(placement, n_ranks, n_stages // n_ranks)
    caps: Sequence[float]
    if max_in_flight is None:
        caps = [math.inf] * n_ranks
    elif isinstance(max_in_flight, int):
        caps = [max_in_flight] * n_ranks
    else:
        caps = list(max_in_flight)
    return _Greedy(costs, rank_of, n_microbatches, memory_limit, caps, w_gap, f_gap).run()


class _Greedy:
    """The list scheduler of :func:`greedy_order`, as an event loop over ranks in time order."""

    def __init__(self, costs: PipelineCosts, rank_of: tuple[int, ...], n_mb: int, limit: int | None,
                 caps: Sequence[float], w_gap: float, f_gap: float) -> None:
        self.costs, self.rank_of, self.n_mb = costs.stages, rank_of, n_mb
        self.limit = math.inf if limit is None else limit
        self.caps = caps
        self.w_gap, self.f_gap = w_gap, f_gap
        self.n_stages = len(costs)
        self.n_ranks = max(rank_of) + 1
        # the hand-over between stage s and s + 1 (either way): free on one rank
        self.hop = [0.0 if rank_of[s] == rank_of[s + 1] else costs[s].comm for s in range(self.n_stages - 1)]
        self.local = [[s for s in range(self.n_stages) if rank_of[s] == r] for r in range(self.n_ranks)]
        self.f_end: list[list[float | None]] = [[None] * n_mb for _ in range(self.n_stages)]
        self.i_end: list[list[float | None]] = [[None] * n_mb for _ in range(self.n_stages)]
        self.next_f = [0] * self.n_stages
        self.next_i = [0] * self.n_stages
        self.pending: list[deque[tuple[int, int]]] = [deque() for _ in range(self.n_ranks)]
        self.mem = [0] * self.n_ranks
        self.in_flight = [0] * self.n_ranks
        self.free = [0.0] * self.n_ranks
        self.order: dict[int, list[Any]] = {r: [] for r in range(self.n_ranks)}
        # the ranks whose actions feed this rank's stages
        self.feeders = [
            sorted({rank_of[n] for s in self.local[r] for n in (s - 1, s + 1) if 0 <= n < self.n_stages} - {r})
            for r in range(self.n_ranks)
        ]
        self.fed = [[n for n in range(self.n_ranks) if r in self.feeders[n]] for r in range(self.n_ranks)]
        self.reserve = [max((costs[s].activation_bytes for s in self.local[r][1:]), default=0)
                        for r in range(self.n_ranks)]
        for r in range(self.n_ranks):
            need = costs[self.local[r][0]].activation_bytes + self.reserve[r]
            if need > self.limit:
                raise ScheduleError(f"memory limit {limit} bytes is below one microbatch's activations "
                                    f"({need} bytes) on rank {r}")

    def _f_input(self, s: int, m: int) -> float | None:
        if s == 0:
            return 0.0
        t = self.f_end[s - 1][m]
        return None if t is None else t + self.hop[s - 1]

    def _i_input(self, s: int, m: int) -> float | None:
        fwd = self.f_end[s][m]
        if fwd is None:
            return None
        if s == self.n_stages - 1:
            return fwd
        t = self.i_end[s + 1][m]
        return None if t is None else max(fwd, t + self.hop[s])

    def _lower_bound(self, producer: int, duration: float, hop: float, now: float) -> float:
        """Earliest arrival of an output whose producing action has not been scheduled yet."""
        return max(now, self.free[self.rank_of[producer]]) + duration + hop

    def _f_allowed(self, r: int, s: int) -> bool:
        need = self.mem[r] + self.costs[s].activation_bytes
        if s == self.local[r][0]:  # a new microbatch for this rank (a deeper stage only moves one on)
            if self.in_flight[r] >= self.caps[r]:
                return False
            # keep room to move the oldest one on, or the rank could fill up and stall
            need += self.reserve[r]
        return need <= self.limit

    def _emit(self, r: int, kind: str, s: int, m: int, start: float) -> float:
        c = self.costs[s]
        duration = {"F": c.f, "I": c.i, "W": c.w}[kind]
        finish = start + duration
        if kind == "F":
            self.f_end[s][m] = finish
            self.next_f[s] += 1
            self.mem[r] += c.activation_bytes
            self.in_flight[r] += s == self.local[r][0]
        elif kind == "I":
            self.i_end[s][m] = finish
            self.next_i[s] += 1
            self.mem[r] += c.live_in_bytes - c.activation_bytes
            self.in_flight[r] -= s == self.local[r][0]
            self.pending[r].append((s, m))
        else:
            self.mem[r] -= c.live_in_bytes
        self.order[r].append(action(s, kind, m))
        self.free[r] = finish
        return finish

    def _decide(self, r: int, now: float) -> tuple[str, int, int] | float | None:
        """The action rank ``r`` runs at ``now``, or the time to look again (``None``:
        when a feeding rank schedules something)."""
        ready_i: list[tuple[int, int, int]] = []
        ready_f: list[tuple[int, int, int]] = []
        soonest = math.inf  # earliest time an I or allowed F can start (known or bounded)
        urgent = math.inf  # the same for an I or a deeper stage's F of a microbatch already here
        wake = math.inf  # earliest known arrival after now
        mem_blocked = False
        work_left = False
        first = self.local[r][0]
        for s in self.local[r]:
            m = self.next_i[s]
            if m < self.n_mb:
                work_left = True
                t = self._i_input(s, m)
                if t is None and self.f_end[s][m] is not None:  # waiting for the gradient of stage s + 1
                    bound = self._lower_bound(s + 1, self.costs[s + 1].i, self.hop[s], now)
                    soonest, urgent = min(soonest, bound), min(urgent, bound)
                elif t is not None and t <= now:
                    ready_i.append((m, -s, s))
                elif t is not None:
                    soonest, urgent, wake = min(soonest, t), min(urgent, t), min(wake, t)
            m = self.next_f[s]
            if m < self.n_mb:
                work_left = True
                if not self._f_allowed(r, s):
                    mem_blocked = True
                    continue
                t = self._f_input(s, m)
                moves_on = s != first and m < self.next_f[first]
                if t is not None and t <= now:
                    ready_f.append((-s, m, s))
                    continue
                bound = t if t is not None else self._lower_bound(s - 1, self.costs[s - 1].f, self.hop[s - 1], now)
                soonest = min(soonest, bound)
                if moves_on:
                    urgent = min(urgent, bound)
                if t is not None:
                    wake = min(wake, t)
        if ready_i:
            m, _, s = min(ready_i)
            return "I", s, m
        if ready_f:
            _, m, s = min(ready_f)
            # a new microbatch only if it does not hold up work already here by more than f_gap of it
            if s != first or urgent - now >= self.f_gap * self.costs[s].f:
                return "F", s, m
        if self.pending[r]:
            s, m = self.pending[r][0]
            if not work_left or mem_blocked or soonest - now >= self.w_gap * self.costs[s].w:
                return "W", s, m
        return wake if wake < math.inf else None

    def run(self) -> dict[int, list[Any]]:
        heap = [(0.0, r) for r in range(self.n_ranks)]
        remaining = [3 * self.n_mb * len(self.local[r]) for r in range(self.n_ranks)]
        sleeping = [False] * self.n_ranks
        while heap:
            now, r = heapq.heappop(heap)
            if now < self.free[r] or remaining[r] == 0:
                continue  # a stale look: the rank is busy until later, or done
            choice = self._decide(r, now)
            if isinstance(choice, tuple):
                kind, s, m = choice
                if kind == "W":
                    self.pending[r].popleft()
                finish = self._emit(r, kind, s, m, now)
                remaining[r] -= 1
                sleeping[r] = False
                heapq.heappush(heap, (finish, r))
                if kind != "W":  # its output may let a sleeping neighbour go
                    for n in self.fed[r]:
                        if sleeping[n]:
                            sleeping[n] = False
                            heapq.heappush(heap, (max(finish, self.free[n]), n))
            else:
                # wait: a feeding rank's next action may bring an input sooner than any known arrival
                sleeping[r] = True
                if choice is not None:
                    heapq.heappush(heap, (choice, r))
        stuck = [r for r in range(self.n_ranks) if remaining[r]]
        if stuck:
            raise ScheduleError(f"the greedy scheduler stalled on ranks {stuck} (a memory limit too small "
                                "for the pipeline's depth?)")
        return self.order


def merge_where_free(order: dict[int, list[Any]], costs: PipelineCosts, rounds: int = 3) -> dict[int, list[Any]]:
    """``order`` with ``I`` then ``W`` of one stage and microbatch, back to back on a
    rank, merged into one full backward ``B`` wherever that is cheaper
    (``StageCosts.b < i + w``) and the gradient ``I`` sends still reaches the
    previous stage before that stage starts its backward in the compute-only
    replay (stage 0 has nobody waiting). Repeated up to ``rounds`` times on the new
    replay; a round that makes the replay slower is dropped."""
    current = order
    best = simulate(current, costs).step_time
    for _ in range(rounds):
        sim = simulate(current, costs)
        start = {(a.kind, a.stage, a.microbatch): a.start for a in sim.timeline}
        end = {(a.kind, a.stage, a.microbatch): a.end for a in sim.timeline}
        rank_of = {a.stage: a.rank for a in sim.timeline}
        merged_any = False
        out: dict[int, list[Any]] = {}
        for r, acts in current.items():
            kept: list[Any] = []
            for a in acts:
                if a is None:  # an idle slot of a table (the runtime skips it)
                    kept.append(a)
                    continue
                parts = primitive_actions(a)
                if (len(parts) == 1 and parts[0][1] == "W" and kept and kept[-1] is not None
                        and len(primitive_actions(kept[-1])) == 1):
                    s, _, m = parts[0]
                    if primitive_actions(kept[-1])[0] == (s, "I", m):
                        c = costs[s]
                        delay = c.full_backward - c.i  # how much later the gradient leaves
                        if c.full_backward < c.i + c.w:
                            if s == 0:
                                slack = math.inf
                            else:
                                consumer = start.get(("I", s - 1, m), start.get(("B", s - 1, m), math.inf))
                                hop = 0.0 if rank_of[s - 1] == r else costs[s - 1].comm
                                slack = consumer - (end[("I", s, m)] + hop)
                            if slack >= delay:
                                kept[-1] = action(s, "B", m)
                                merged_any = True
                                continue
                kept.append(a)
            out[r] = kept
        if not merged_any:
            break
        t = simulate(out, costs).step_time
        if t > best:
            break
        current, best = out, t
    return current


def _flight_caps(n_ranks: int) -> list[tuple[int, ...] | None]:
    """The ``max_in_flight`` values searched: about the pipeline's round trip (``2 *
    n_ranks - 1``, what rank 0 needs to stay busy until its first gradient returns),
    more, and less on later ranks (as ZB-V and 1F1B warm up), and no cap."""
    caps: list[tuple[int, ...] | None] = []
    for base, slope in ((2 * n_ranks - 1, 0), (2 * n_ranks - 1, 1), (2 * n_ranks, 1), (3 * n_ranks, 0)):
        cap = tuple(max(1, base - slope * r) for r in range(n_ranks))
        if cap not in caps:
            caps.append(cap)
    return caps + [None]


def _upstream_seeds(costs: PipelineCosts, n_ranks: int, n_microbatches: int,
                    placements: Sequence[str]) -> list[tuple[str, str, dict[int, list[Any]], Simulation]]:
    """Every upstream schedule class that runs ``len(costs) // n_ranks`` stages per rank on
    one of ``placements``, for these sizes: ``(class name, placement, compute-only order,
    the replay of the lowered order its runtime runs)``. Classes that refuse the sizes are
    left out (e.g. ``ScheduleDualPipeV`` with fewer microbatches than it needs)."""
    per = len(costs) // n_ranks
    seeds = []
    for name in UPSTREAM_SCHEDULES:
        try:
            order = upstream_order(name, n_ranks, n_microbatches, lowered=False, stages_per_rank=per)
            run = upstream_order(name, n_ranks, n_microbatches, lowered=True, stages_per_rank=per)
            mapping = upstream_stage_to_rank(name, n_ranks, n_microbatches, stages_per_rank=per)
        except (ValueError, AssertionError):
            continue
        placement = next((p for p in placements if stage_to_rank(p, n_ranks, per) == mapping), None)
        if placement is not None:
            seeds.append((name, placement, order, simulate(run, costs)))
    return seeds


def generate_schedule(
    costs: PipelineCosts,
    n_ranks: int,
    n_microbatches: int,
    *,
    placements: Sequence[str] = PLACEMENTS,
    memory_limit: int | None = None,
    include_upstream: bool = True,
) -> GeneratedSchedule:
    """The fastest order in simulation for ``costs`` (one entry per stage;
    ``len(costs) // n_ranks`` stages per rank) and ``n_microbatches``, with every
    rank's memory (:class:`~fxsplit.schedules.costs.StageCosts` ``activation_bytes``
    and ``live_in_bytes``) within ``memory_limit`` bytes.

    ``memory_limit=None``: the highest peak (over ranks) of the upstream
    zero-bubble schedules tried as candidates (``ScheduleZBVZeroBubble`` for the V
    placement, ``ScheduleInterleavedZeroBubble`` for the interleaved one), so that
    each of them is a candidate and the result is never slower than either in
    simulation, holding no more than the hungrier one would; unbounded if none
    applies. Pass ZB-V's own peak to hold no more than ZB-V.
    ``include_upstream=False`` leaves the upstream orders out of the candidates
    (the greedy alone). Raises ``ValueError`` for sizes that do not fit together,
    :class:`ScheduleError` if no candidate fits the limit.
    """
    n_stages = len(costs)
    if n_ranks < 1 or n_stages % n_ranks:
        raise ValueError(f"{n_stages} stages do not divide over {n_ranks} ranks")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be at least 1, got {n_microbatches}")
    for p in placements:
        if p not in PLACEMENTS:
            raise ValueError(f"unknown placement {p!r}; choose from {PLACEMENTS}")
    per = n_stages // n_ranks
    # one placement (the last named) per distinct stage -> rank mapping: with one stage per rank all are one
    mappings = {stage_to_rank(p, n_ranks, per): p for p in placements}
    placements = [p for p in placements if mappings.get(stage_to_rank(p, n_ranks, per)) == p]

    seeds = _upstream_seeds(costs, n_ranks, n_microbatches, placements) if include_upstream else []
    limit = memory_limit
    if limit is None:
        zero_bubble = [max(sim.peak_bytes) for name, _, _, sim in seeds if "ZeroBubble" in name]
        limit = max(zero_bubble) if zero_bubble else None

    # every candidate order with its compute-only replay: a lower bound of its replay as run (a
    # receive posted late can only delay an input), and the same memory (the same order per rank)
    variants: list[tuple[str, str, dict[int, list[Any]], Simulation]] = []
    seen: set[Any] = set()
    for p in placements:
        for cap in _flight_caps(n_ranks):
            for gap, f_gap in itertools.product(W_GAPS, F_GAPS):
                try:
                    order = greedy_order(costs, n_ranks, n_microbatches, p, limit, cap, gap, f_gap)
                except ScheduleError:
                    continue
                fingerprint = tuple(tuple(a) for _, a in sorted(order.items()))
                if fingerprint in seen:
                    continue  # other parameters, same order
                seen.add(fingerprint)
                shown = None if cap is None else cap[0] if len(set(cap)) == 1 else f"{cap[0]}-r"
                name = f"greedy({p}, max_in_flight={shown}, w_gap={gap}, f_gap={f_gap})"
                variants.append((name, p, order, simulate(order, costs)))
    fitting = [v for v in variants if limit is None or max(v[3].peak_bytes) <= limit]
    fastest = sorted(fitting, key=lambda v: v[3].step_time)[:_MERGED_FINALISTS]
    # the fastest greedy orders and the upstream ones, also with I + W merged where free
    for name, p, o in [v[:3] for v in fastest] + [v[:3] for v in seeds]:
        merged = merge_where_free(o, costs)
        if merged != o:
            variants.append((f"{name} + I/W merged where free", p, merged, simulate(merged, costs)))

    candidates: list[Candidate] = []
    best: tuple[float, str, str, dict[int, list[Any]], Simulation] | None = None
    for name, p, o, run in seeds:  # their lowered orders are upstream's own
        fits = limit is None or max(run.peak_bytes) <= limit
        candidates.append(Candidate(name, p, run.step_time, max(run.peak_bytes), fits))
        if fits and (best is None or run.step_time < best[0]):
            best = (run.step_time, name, p, o, run)
    # the others lowered and replayed as run, fastest compute-only first, while they can still win
    for name, p, o, compute in sorted(variants, key=lambda v: v[3].step_time):
        peak = max(compute.peak_bytes)
        fits = limit is None or peak <= limit
        if not fits or (best is not None and compute.step_time >= best[0]):
            candidates.append(Candidate(name, p, None, peak, fits))
            continue
        run = simulate(lower(o, n_ranks, n_microbatches), costs)
        candidates.append(Candidate(name, p, run.step_time, peak, fits))
        if best is None or run.step_time < best[0]:
            best = (run.step_time, name, p, o, run)
    if best is None:
        raise ScheduleError(f"no order fits the memory limit of {limit} bytes per rank")
    _, source, placement, order, sim = best
    return GeneratedSchedule(
        order=order, stage_to_rank=stage_to_rank(placement, n_ranks, per), n_microbatches=n_microbatches,
        placement=placement, source=source, simulation=sim, memory_limit=limit, candidates=tuple(candidates),
    )
