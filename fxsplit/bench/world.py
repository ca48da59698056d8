"""Multi-rank worlds: the one driver behind ``fxsplit bench --pipeline`` and the multi-rank tests.

A *world* is ``ranks`` processes under one process group (gloo on CPU, NCCL on
CUDA), each running the same function on the same payload. This module holds
everything such a world repeats, once:

* :func:`run_world` starts the ranks, collects what each returns, forwards rank
  0's :func:`progress` messages, and raises :class:`WorldFailed` (with the
  rank's traceback) when a rank fails, exits without reporting or runs past
  the timeout; every rank is ended either way;
* :func:`stage_ids` and :func:`build_schedule`: which stages a rank holds
  under an upstream schedule class (or a generated schedule), and the schedule
  object over them (``Schedule1F1B`` takes one stage, the others a list);
* :func:`observed_stage_class`: a pipeline stage class whose ``F``/``I``/``B``/``W``
  actions (and gradient reductions) run under *observers*, each a context
  manager that may add fields to the action's record (``stage.actions``);
* the observers and counters the worlds use: :class:`RegionRuns` (runs of the
  fxsplit regions' dI/dW/fused graphs), :class:`MatmulCounter` (FLOPs of the ops
  torch has a formula for, and a count of the ops a predicate selects),
  :func:`collectives` (every outermost ``c10d::`` op the profiler saw, with the
  action it ran in) and :class:`Clock` (action start and end times).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "Clock", "MatmulCounter", "RegionRuns", "V_SCHEDULES", "WorldFailed", "build_schedule", "collective_counts",
    "collectives", "free_port", "label", "observed_stage_class", "progress", "run_world", "stage_ids",
]

V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
BACKWARD = ("B", "I", "W")  # the backward actions: what the counters observe
REGION_COUNTERS = ("di_runs", "dw_runs", "fused_runs")


class WorldFailed(RuntimeError):
    """A rank failed (its traceback is the message), exited without reporting, or timed out."""


# ---------------------------------------------------------------------------------------------
# processes
_progress: Callable[[str], None] | None = None


def progress(message: str) -> None:
    """Inside a rank: hand ``message`` to :func:`run_world`'s ``on_progress`` (rank 0 only;
    the other ranks' messages are dropped). Outside a world: nothing."""
    if _progress is not None:
        _progress(message)


def _worker(rank: int, ranks: int, port: int, fn: Callable[[Any, int, int], Any], payload: Any, results: Any,
            timeout_s: float, device: str, threads: int) -> None:
    import torch.distributed as dist

    global _progress
    try:
        if rank == 0:
            _progress = lambda message: results.put(("progress", rank, message))  # noqa: E731
        torch.set_num_threads(threads)
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=ranks,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # Every rank connected before any can tear the group down: a rank whose fn returns at
        # once would otherwise close its side while a slower rank still connects to it, and
        # that rank would fail in init with "Connection closed by peer" instead of running fn.
        dist.barrier()
        try:
            out = fn(payload, rank, ranks)
        finally:
            dist.destroy_process_group()
        results.put(("ok", rank, out))
    except BaseException as e:  # everything goes back to the parent, assertion failures included
        results.put(("error", rank, (_root_cause(e), traceback.format_exc())))


def _root_cause(e: BaseException) -> str:
    """``e``'s innermost cause as ``"Type: first line of its message"``: what a reader of a
    long, chained traceback (a schedule re-raising a stage's error) needs first."""
    seen = {id(e)}
    while (inner := e.__cause__ or (None if e.__suppress_context__ else e.__context__)) is not None \
            and id(inner) not in seen:  # (a chain may loop back)
        e = inner
        seen.add(id(e))
    first = next(iter(str(e).strip().splitlines()), "")
    return f"{type(e).__name__}: {first}"[:300] if first else type(e).__name__


def _context(preload: Sequence[str] | None) -> Any:
    """``spawn``, or (``preload`` given, POSIX) a fork server that imported ``preload``
    once: a rank then costs a fork instead of a fresh interpreter's imports (seconds
    of CPU each, on a small machine running up to 8 ranks). The server is made on
    the first world and reused by the next, with this process's environment."""
    import torch.multiprocessing as mp

    if preload is None:
        return mp.get_context("spawn")
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(fn: Callable[[Any, int, int], Any], payload: Any, ranks: int, *, timeout_s: float,
              device: str = "cpu", threads: int = 1, preload: Sequence[str] | None = None,
              on_progress: Callable[[str], None] | None = None) -> list[Any]:
    """Run ``fn(payload, rank, ranks)`` in ``ranks`` processes; return what each returned, by rank.

    ``fn`` and ``payload`` cross a process boundary: ``fn`` must be a module-level
    function and ``payload`` picklable. Each rank runs with ``threads`` intra-op
    threads, on ``cuda:rank`` when ``device`` is ``"cuda"``. Raises
    :class:`WorldFailed` if a rank raises (its traceback is the message, followed by any
    other rank's that fails within a few seconds), exits
    without reporting, or the world runs past ``timeout_s``; every process is
    joined or killed before this returns or raises.
    """
    ctx = _context(preload)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, fn, payload, results, timeout_s, device, threads),
                         daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < ranks:
            try:
                status, rank, out = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead:
                    try:  # a rank may have reported just before exiting
                        status, rank, out = results.get(timeout=5.0)
                    except queue.Empty:
                        raise WorldFailed(f"rank(s) {dead} exited (exit codes {[procs[r].exitcode for r in dead]}) "
                                          "without reporting a result") from None
                elif time.monotonic() > deadline:
                    raise WorldFailed(f"timed out after {timeout_s:.0f} s waiting for ranks "
                                      f"{sorted(set(range(ranks)) - set(got))}") from None
                else:
                    continue
            if status == "progress":
                if on_progress is not None:
                    on_progress(out)
            elif status == "error":
                raise WorldFailed(_failures(rank, out, results, set(range(ranks)) - set(got) - {rank}))
            else:
                got[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [got[r] for r in range(ranks)]


def _failures(rank: int, out: str, results: Any, others: set[int], grace_s: float = 3.0) -> str:
    """One line naming each failed rank's root cause, then ``rank``'s traceback (``out`` is
    (root cause, traceback)), then those of any of ``others`` that fail within ``grace_s``
    seconds: the first error the parent hears may be a rank that only saw its peer go away
    (gloo's "Connection closed by peer"), the cause another's."""
    errors = [(rank, out)]
    end = time.monotonic() + grace_s
    while others and (left := end - time.monotonic()) > 0:
        try:
            status, r, o = results.get(timeout=left)
        except queue.Empty:
            break
        if status == "error":
            errors.append((r, o))
        if status != "progress":
            others.discard(r)
    causes = "; ".join(f"rank {r}: {cause}" for r, (cause, _) in errors)
    return f"{causes}\n\n" + "\n\n".join(
        f"rank {r} failed{' too' if k else ''}:\n{tb}" for k, (r, (_, tb)) in enumerate(errors))


# ---------------------------------------------------------------------------------------------
# placement and schedule
def stage_ids(schedule: str, rank: int, ranks: int, generated: Any = None) -> tuple[list[int], int]:
    """(the stage indices ``rank`` holds, the number of stages) under ``schedule``:
    ``Schedule1F1B`` one stage per rank; the V schedules ``rank`` and its mirror;
    the other multi-stage classes the looped placement; ``"generated"`` (with
    ``generated``, a :class:`~fxsplit.schedules.GeneratedSchedule`) its own."""
    if generated is not None:
        return list(generated.stages_of(rank)), len(generated.stage_to_rank)
    if schedule == "Schedule1F1B":
        return [rank], ranks
    if schedule in V_SCHEDULES:
        return [rank, 2 * ranks - 1 - rank], 2 * ranks
    return [rank, rank + ranks], 2 * ranks


def build_schedule(schedule: str, stages: list[Any], microbatches: int, loss_fn: Callable[..., Any],
                   generated: Any = None) -> Any:
    """The schedule object over ``stages`` (this rank's, in :func:`stage_ids` order)."""
    import torch.distributed.pipelining.schedules as schedules

    if generated is not None:
        return generated.build(stages, loss_fn=loss_fn)
    cls = getattr(schedules, schedule)
    if schedule == "Schedule1F1B":
        return cls(stages[0], microbatches, loss_fn=loss_fn)
    return cls(stages, microbatches, loss_fn=loss_fn)


# ---------------------------------------------------------------------------------------------
# observed stages
Observer = Callable[[Any, str, int, dict[str, Any]], contextlib.AbstractContextManager[Any]]


def observed_stage_class(base: type) -> type:
    """A subclass of the pipeline stage class ``base`` whose actions run under observers.

    Instances have ``observers`` (a list; each is called as ``observer(stage,
    kind, mb, record)`` and returns a context manager entered around the action),
    ``recorded`` (the kinds appended to ``actions``, default the backward ones
    ``"B"``, ``"I"``, ``"W"``) and ``actions`` (one dict per recorded action:
    ``stage``, ``kind``, ``mb`` and whatever the observers added). Kinds:
    ``F`` (forward), ``B`` (full backward), ``I`` (input gradients), ``W``
    (weight gradients), ``REDUCE_GRAD`` / ``WAIT_REDUCE_GRAD`` (data-parallel
    gradient reduction; ``mb`` is -1).
    """

    class ObservedStage(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.observers: list[Observer] = []
            self.recorded: tuple[str, ...] = ("B", "I", "W")
            self.actions: list[dict[str, Any]] = []

        def _observed(self, kind: str, mb: int, fn: Callable[[], Any]) -> Any:
            record: dict[str, Any] = {"stage": self.stage_index, "kind": kind, "mb": mb}
            with contextlib.ExitStack() as stack:
                for observer in self.observers:
                    stack.enter_context(observer(self, kind, mb, record))
                out = fn()
            if kind in self.recorded:
                self.actions.append(record)
            return out

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self._observed("F", fwd_chunk_id,
                                  lambda: super(ObservedStage, self).forward_one_chunk(fwd_chunk_id, *args, **kwargs))

        def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> None:
            self._observed("B" if full_backward else "I", bwd_chunk_id,
                           lambda: super(ObservedStage, self).backward_one_chunk(
                               bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward))

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
            self._observed("W", bwd_chunk_id,
                           lambda: super(ObservedStage, self).backward_weight_one_chunk(
                               bwd_chunk_id, last_backward=last_backward))

        def perform_reduce_grad(self, grad_scale_factor: int) -> None:
            self._observed("REDUCE_GRAD", -1,
                           lambda: super(ObservedStage, self).perform_reduce_grad(grad_scale_factor))

        # torch >= 2.15: multi-stage schedules run REDUCE_GRAD for FSDP stages as these two
        # (the reduce-scatters start in the first); absent before
        def start_gradient_reduction(self) -> None:
            self._observed("REDUCE_GRAD", -1, lambda: super(ObservedStage, self).start_gradient_reduction())

        def wait_for_gradient_reduction(self, grad_scale_factor: int) -> None:
            self._observed("WAIT_REDUCE_GRAD", -1,
                           lambda: super(ObservedStage, self).wait_for_gradient_reduction(grad_scale_factor))

    return ObservedStage


# ---------------------------------------------------------------------------------------------
# counters
class RegionRuns:
    """Runs of every compiled fxsplit region's graphs (``CompiledRegion.stats``) since construction.

    Holds the regions it saw, so none of them is freed (and its counts lost)
    while it counts: ``fxsplit.compiled_regions()`` is weak, so a difference of
    totals could go negative when an earlier region is collected.
    """

    KEYS = REGION_COUNTERS

    def __init__(self) -> None:
        import fxsplit

        self._start = [(r, dict(r.stats)) for r in fxsplit.compiled_regions()]

    def delta(self) -> dict[str, int]:
        import fxsplit

        start = {id(r): stats for r, stats in self._start}
        totals = dict.fromkeys(self.KEYS, 0)
        for region in fxsplit.compiled_regions():
            before = start.get(id(region), {})
            for k in self.KEYS:
                totals[k] += region.stats.get(k, 0) - before.get(k, 0)
        return totals

    @staticmethod
    def observer(stage: Any, kind: str, mb: int, record: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        """Adds ``di_runs``, ``dw_runs`` and ``fused_runs`` of each backward action to its record."""
        return _region_runs_into(record) if kind in BACKWARD else contextlib.nullcontext()


@contextlib.contextmanager
def _region_runs_into(record: dict[str, Any]) -> Iterator[None]:
    runs = RegionRuns()
    yield
    record.update(runs.delta())


class MatmulCounter:
    """A dispatch mode that counts, while active, the FLOPs of every op torch has a
    formula for (``total``; ``attention``, the part from ``scaled_dot_product`` ops,
    whose count depends on the torch version) and how many ops ``select(name, args,
    out)`` accepts (``selected``; ``name`` is the op's overload packet name).
    ``flops=False`` counts no FLOPs (for ops whose formula cannot take their arguments).

    A plain dispatch mode: ``FlopCounterMode`` also tracks modules with multi-grad
    hooks, which cannot run inside ``torch.autograd.grad``. Under it Dynamo runs
    compiled frames eagerly, and eager DTensor code can fail (a redistribute's
    backward gets a plain tensor): use it around actions, not around a whole step.
    """

    def __init__(self, select: Callable[[str, tuple[Any, ...], Any], bool] | None = None,
                 flops: bool = True) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                packet = func._overloadpacket
                formula = flop_registry.get(packet) if flops else None
                if formula is not None:
                    n = int(formula(*args, **kwargs, out_val=out))
                    counter.total += n
                    if "scaled_dot_product" in packet.__name__:
                        counter.attention += n
                if select is not None and select(packet.__name__, args, out):
                    counter.selected += 1
                return out

        self.total = self.attention = self.selected = 0
        self._mode = _Mode()

    def __enter__(self) -> MatmulCounter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    @staticmethod
    def observer(select: Callable[[str, tuple[Any, ...], Any], bool] | None = None,
                 selected_as: str = "selected", flops: bool = True) -> Observer:
        """An observer adding ``flops`` and ``attention_flops`` (with ``flops``) and, with
        ``select``, ``selected_as`` of each backward action to its record. Forwards run
        unobserved: under a dispatch mode Dynamo would run their compiled frames eagerly."""

        @contextlib.contextmanager
        def observe(stage: Any, kind: str, mb: int, record: dict[str, Any]) -> Iterator[None]:
            if kind not in BACKWARD:
                yield
                return
            with MatmulCounter(select, flops) as counter:
                yield
            if flops:
                record.update(flops=counter.total, attention_flops=counter.attention)
            if select is not None:
                record[selected_as] = counter.selected

        return observe


_LABEL = "fxsplit.world:"


def label(name: str) -> contextlib.AbstractContextManager[Any]:
    """A profiler range that :func:`collectives` attributes the collectives inside it to."""
    return torch.profiler.record_function(_LABEL + name)


def label_observer(stage: Any, kind: str, mb: int, record: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """Labels each action ``"{stage}:{kind}{mb}"`` (``"{stage}:{kind}"`` for reductions) for :func:`collectives`."""
    return label(f"{stage.stage_index}:{kind}{mb if mb >= 0 else ''}")


def collectives(prof: Any) -> list[tuple[str, str]]:
    """``(op, label)`` for every outermost ``c10d::`` op the profiler ``prof`` saw, in
    order; ``label`` is the innermost :func:`label` around it (``"schedule"`` outside
    every label: p2p and FSDP unshards the schedule issues itself)."""
    found: list[tuple[int, str, str]] = []
    for evt in prof.events():
        if not evt.name.startswith("c10d::"):
            continue
        where, parent, nested = "schedule", evt.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("c10d::"):
                nested = True
                break
            if parent.name.startswith(_LABEL) and where == "schedule":
                where = parent.name[len(_LABEL):]
            parent = parent.cpu_parent
        if not nested:
            found.append((evt.time_range.start, evt.name[len("c10d::"):], where))
    return [(op, where) for _, op, where in sorted(found)]


def collective_counts(found: list[tuple[str, str]], where: str | None = None) -> dict[str, int]:
    """``{op: count}`` of :func:`collectives`' result, all of it or under one label."""
    counts: dict[str, int] = {}
    for op, at in found:
        if where is None or at == where:
            counts[op] = counts.get(op, 0) + 1
    return counts


@dataclasses.dataclass
class Clock:
    """Timestamps of one step: ``time.perf_counter`` on CPU, CUDA events on CUDA
    (resolved after the step), in milliseconds from :meth:`start`."""

    cuda: bool
    origin: Any = None

    def now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self.origin = self.now()

    def ms(self, mark: Any) -> float:
        if self.cuda:
            mark.synchronize()
            return self.origin.elapsed_time(mark)
        return (mark - self.origin) * 1e3

    def observer(self, stage: Any, kind: str, mb: int, record: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        """Adds ``start`` and ``end`` (marks for :meth:`ms`) to each action's record."""
        return self._timed(record)

    @contextlib.contextmanager
    def _timed(self, record: dict[str, Any]) -> Iterator[None]:
        record["start"] = self.now()
        yield
        record["end"] = self.now()
