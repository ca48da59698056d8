"""Multi-process harness for the pipelining tests (CPU, gloo, world size 2).

The parent (pytest) calls :func:`run_world`: it starts ``world_size``
processes (forked from a server that imported torch once), each of which runs every case in ``cases`` under one gloo process
group and reports back through a queue. Exceptions in a rank come back as
their traceback and are raised in the parent; a rank that neither reports
nor exits in time is killed and the parent fails with a timeout (no hangs).

Each case builds the same small transformer in every rank (same seed), in
one of two layouts (``Case.layout``): ``"float"``, every stage compiled as a
whole in place, float inputs and an MSE loss; ``"lm"``, a language model:
stage 0 takes token ids through an eager ``nn.Embedding`` (its inputs need
no gradient), every stage's blocks are compiled in place, and the last
stage has an eager head (LayerNorm, Linear to the vocabulary) under a
cross-entropy loss. It runs
two optimizer steps of an upstream schedule over fxsplit
:class:`~fxsplit.pipelining.PipelineStage` s, and checks in-rank, against a
single-process non-pipelined eager reference, every microbatch loss and
every parameter gradient of the stages the rank holds. It returns, per
backward action, the fxsplit region counters and FLOPs measured around it.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from fxsplit.bench.models import Block  # the benchmark's pre-LN transformer block

D_MODEL = 16
N_HEADS = 2
N_BLOCKS = 4
MB_BATCH = 2  # samples per microbatch
SEQ = 6  # tokens per sample; MB_BATCH * SEQ = 12 differs from every weight dimension
N_MICROBATCHES = 4
N_STEPS = 2
LR = 0.1
VOCAB = 24  # "lm" layout

SCHEDULES = (
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def upstream_schedule_failure(schedule: str) -> str | None:
    """Why torch's own ``schedule`` cannot run on this torch with gloo (None if it can).

    torch 2.11: the V-shaped schedules (two stages per rank, the first and the
    last) fail in ``_initialize_stages`` before any backward, with upstream's own
    ``PipelineStage`` too: the shape-inference p2p batch ends in gloo's "Pair is
    not connected" (``fxsplit._torch_internals.v_schedules_fail_with_gloo``, which
    ``fxsplit bench --pipeline`` asks too).
    """
    from fxsplit import _torch_internals

    if schedule in V_SCHEDULES and _torch_internals.v_schedules_fail_with_gloo():
        return (f"torch {torch.__version__}: upstream {schedule} fails in _initialize_stages with gloo "
                "('Pair is not connected'), also with torch's own PipelineStage; torch 2.13 to 2.15 run it")
    return None


RUNNABLE_SCHEDULES = tuple(s for s in SCHEDULES if upstream_schedule_failure(s) is None)


# ---------------------------------------------------------------------------------------------
# model
class StageModule(nn.Module):
    """A run of blocks; the last stage also has the final LayerNorm and output head."""

    def __init__(self, n_blocks: int, last: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(D_MODEL, N_HEADS) for _ in range(n_blocks))
        self.head = nn.Sequential(nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, D_MODEL)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


class Body(nn.Module):
    """A run of blocks, compiled in place as one module in the ``"lm"`` layout."""

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(D_MODEL, N_HEADS) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class LMStageModule(nn.Module):
    """A stage of the ``"lm"`` layout: an eager embedding (stage 0), the compiled
    body, an eager head (last stage). Only ``body`` is compiled."""

    def __init__(self, n_blocks: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL) if first else None
        self.body = Body(n_blocks)
        self.head = nn.Sequential(nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.body(x)
        return self.head(x) if self.head is not None else x


def build_reference(n_stages: int, layout: str = "float") -> list[nn.Module]:
    torch.manual_seed(0)
    per = N_BLOCKS // n_stages
    if layout == "lm":
        return [LMStageModule(per, first=(s == 0), last=(s == n_stages - 1)) for s in range(n_stages)]
    return [StageModule(per, last=(s == n_stages - 1)) for s in range(n_stages)]


def compile_stage(module: nn.Module, layout: str, backend: Any) -> None:
    """In place (the schedules refuse OptimizedModule): the whole stage, or (``"lm"``) its body."""
    (module.body if layout == "lm" else module).compile(backend=backend)


def make_data(step: int, layout: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = MB_BATCH * N_MICROBATCHES
    if layout == "lm":
        return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return torch.randn(n, SEQ, D_MODEL, generator=g), torch.randn(n, SEQ, D_MODEL, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def lm_loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def loss_for(layout: str) -> Any:
    return lm_loss_fn if layout == "lm" else loss_fn


def weight_grad_flops(module: nn.Module) -> int:
    """FLOPs of the weight-gradient matmuls of every Linear for one microbatch (2*T*in*out each)."""
    tokens = MB_BATCH * SEQ
    return sum(2 * tokens * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def stage_ids_for(schedule: str, rank: int, world: int) -> tuple[list[int], int]:
    """Stage indices held by ``rank`` and the total number of stages."""
    if schedule == "Schedule1F1B":
        return [rank], world
    if schedule in V_SCHEDULES:
        return [rank, 2 * world - 1 - rank], 2 * world
    return [rank, rank + world], 2 * world  # looped placement


# ---------------------------------------------------------------------------------------------
# in-rank instrumentation: counters and FLOPs around every backward action
class RegionRuns:
    """Runs of every compiled region's graphs (``stats``) since construction.

    Holds the regions it saw, so none of them is freed (and its counts lost)
    while it counts: ``compiled_regions()`` is weak, so a difference of totals
    could go negative when an earlier test's region is collected.
    """

    KEYS = ("di_runs", "dw_runs", "fused_runs")

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
                totals[k] += region.stats[k] - before.get(k, 0)
        return totals


class MatmulFlops:
    """Counts matmul/attention FLOPs of every op dispatched while active (torch's FLOP formulas).

    ``total``: every op torch has a formula for; ``attention``: the part from
    ``scaled_dot_product`` ops, which depends on the torch version (2.15's
    registry counts the CPU flash-attention backward, 2.13's does not).
    A plain dispatch mode: ``FlopCounterMode`` also tracks modules with
    multi-grad hooks, which cannot run inside ``torch.autograd.grad``.
    """

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                formula = flop_registry.get(func._overloadpacket)
                if formula is not None:
                    n = int(formula(*args, **kwargs, out_val=out))
                    counter.total += n
                    if "scaled_dot_product" in func._overloadpacket.__name__:
                        counter.attention += n
                return out

        self.total = self.attention = 0
        self._mode = _Mode()

    def __enter__(self) -> MatmulFlops:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def make_recording_stage_class() -> type:
    from fxsplit.pipelining import PipelineStage

    class RecordingStage(PipelineStage):
        """Records, per backward action: kind, microbatch, counter deltas, FLOPs."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.actions: list[dict[str, Any]] = []

        def _record(self, kind: str, mb: int, fn: Any) -> None:
            runs = RegionRuns()
            with MatmulFlops() as counter:
                fn()
            rec = runs.delta()
            rec.update(stage=self.stage_index, kind=kind, mb=mb, flops=counter.total, attention_flops=counter.attention)
            self.actions.append(rec)

        def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> None:
            self._record("B" if full_backward else "I", bwd_chunk_id,
                         lambda: super(RecordingStage, self).backward_one_chunk(
                             bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward))

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
            self._record("W", bwd_chunk_id,
                         lambda: super(RecordingStage, self).backward_weight_one_chunk(
                             bwd_chunk_id, last_backward=last_backward))

    return RecordingStage


# ---------------------------------------------------------------------------------------------
# one case in one rank
@dataclasses.dataclass
class Case:
    schedule: str
    compiler: str = "eager"
    fused_backward: bool = True
    layout: str = "float"  # or "lm" (see the module docs)
    # schedule "generated": a fxsplit.schedules.GeneratedSchedule, run by its build()
    generated: Any = None

    @property
    def key(self) -> str:
        return self.schedule if self.layout == "float" else f"{self.schedule}:{self.layout}"


def _reference_step(stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor, layout: str = "float") -> list[float]:
    """Non-pipelined eager reference: per-microbatch losses, grads scaled as the schedule does."""
    losses = []
    for xm, ym in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)):
        h = xm
        for s in stages:
            h = s(h)
        loss = loss_for(layout)(h, ym)
        loss.backward()
        losses.append(loss.detach())
    for s in stages:
        for p in s.parameters():
            p.grad.div_(N_MICROBATCHES)
    return [float(v) for v in losses]


def reference_backward_flops(module: nn.Module, first: bool, last: bool, layout: str = "float") -> tuple[int, int]:
    """(input-gradient-only, full) backward FLOPs of one microbatch through the eager ``module``.

    Eager ``autograd.grad`` w.r.t. the input alone skips every weight-gradient
    matmul, so the first number is what B may cost and no more (0 for the
    first stage, whose input needs no gradient).
    """
    if layout == "lm" and first:
        x = torch.randint(0, VOCAB, (MB_BATCH, SEQ))
    else:
        x = torch.randn(MB_BATCH, SEQ, D_MODEL, requires_grad=not first)
    params = list(module.parameters())

    def outputs() -> tuple[torch.Tensor, torch.Tensor | None]:
        out = module(x)
        if last and layout == "lm":
            return lm_loss_fn(out, torch.zeros(out.shape[:-1], dtype=torch.long)), None
        if last:
            return loss_fn(out, torch.zeros_like(out)), None
        return out, torch.ones_like(out)

    input_only = 0
    if not first:
        out, g = outputs()
        with MatmulFlops() as c:
            torch.autograd.grad(out, [x], g)
        input_only = c.total
    out, g = outputs()
    with MatmulFlops() as c:
        torch.autograd.grad(out, ([] if first else [x]) + params, g)
    return input_only, c.total


def run_case(case: Case, rank: int, world: int) -> dict[str, Any]:
    import torch.distributed.pipelining.schedules as schedules

    import fxsplit

    torch._dynamo.reset()
    if case.generated is not None:
        stage_ids, n_stages = case.generated.stages_of(rank), len(case.generated.stage_to_rank)
    else:
        stage_ids, n_stages = stage_ids_for(case.schedule, rank, world)
    reference = build_reference(n_stages, case.layout)
    modules = {s: copy.deepcopy(reference[s]) for s in stage_ids}
    backend = fxsplit.backend(compiler=case.compiler, fused_backward=case.fused_backward)
    for m in modules.values():
        compile_stage(m, case.layout, backend)

    stage_cls = make_recording_stage_class()
    stages = [stage_cls(modules[s], s, n_stages, torch.device("cpu")) for s in stage_ids]
    stage_loss = loss_for(case.layout)
    if case.generated is not None:
        schedule = case.generated.build(stages, loss_fn=stage_loss)
    elif case.schedule == "Schedule1F1B":
        schedule_cls = getattr(schedules, case.schedule)
        schedule = schedule_cls(stages[0], N_MICROBATCHES, loss_fn=stage_loss)
    else:
        schedule = getattr(schedules, case.schedule)(stages, N_MICROBATCHES, loss_fn=stage_loss)

    ref_opt = torch.optim.SGD([p for m in reference for p in m.parameters()], lr=LR)
    opt = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=LR)
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids
    step_losses = []
    grads_checked = 0
    for step in range(N_STEPS):
        x, y = make_data(step, case.layout)
        ref_losses = _reference_step(reference, x, y, case.layout)
        for st in stages:
            st.actions.clear()
        losses: list[torch.Tensor] = []
        args = (x,) if has_first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if has_last else {}
        schedule.step(*args, **kwargs)
        if has_last:
            got = [float(v.detach()) for v in losses]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case.key} step {step}: microbatch losses differ: {m}")
            step_losses.append(got)
        for s, m in modules.items():
            for (name, p), (_, rp) in zip(m.named_parameters(), reference[s].named_parameters(), strict=True):
                grads_checked += 1
                assert p.grad is not None, f"{case.key} step {step}: stage {s} {name}: no gradient"
                torch.testing.assert_close(
                    p.grad, rp.grad, rtol=1e-4, atol=1e-5,
                    msg=lambda msg, s=s, name=name: f"{case.key} step {step}: stage {s} {name}.grad: {msg}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    return {
        "schedule": case.schedule,
        "layout": case.layout,
        "key": case.key,
        "rank": rank,
        "stages": stage_ids,
        "n_stages": n_stages,
        "losses": step_losses,
        "grads_checked": grads_checked,
        # actions of the last step only (the first step also compiles)
        "actions": [a for st in stages for a in st.actions],
        "weight_grad_flops": {s: weight_grad_flops(m) for s, m in modules.items()},
        "reference_flops": {
            s: reference_backward_flops(reference[s], s == 0, s == n_stages - 1, case.layout) for s in stage_ids
        },
    }


# ---------------------------------------------------------------------------------------------
# processes
def _worker(rank: int, world: int, port: int, cases: list[Any], results: Any, timeout_s: float,
            runner: Any = None) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            out = [(runner or run_case)(c, rank, world) for c in cases]
        finally:
            dist.destroy_process_group()
        results.put(("ok", rank, out))
    except BaseException:  # report everything, including assertion failures
        results.put(("error", rank, traceback.format_exc()))


# What a rank imports before it runs anything: loaded once, by the fork server.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.pipelining", "torch._dynamo",
            "torch._inductor.compile_fx", "fxsplit", "fxsplit.pipelining", __name__]


def _rank_context() -> Any:
    """Ranks start from a fork server that imported torch and fxsplit once
    (``forkserver`` with a preload, made on the first world and reused by the
    next): a rank then costs a fork instead of a fresh interpreter's imports
    (seconds of CPU each, on a 2-core machine running up to 8 ranks). The
    server is started from this process, with its environment (conftest's
    ``FXSPLIT_FALLBACK=error`` included) and ``sys.path``. Where there is no
    fork server (not POSIX), ranks are spawned."""
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorldFailed(AssertionError):
    pass


def run_world(cases: list[Any], world: int = 2, timeout_s: float = 240.0,
              runner: Any = None) -> list[list[dict[str, Any]]]:
    """Run ``cases`` on ``world`` spawned ranks; return each rank's results (indexed by rank).

    Each rank calls ``runner(case, rank, world)`` (default :func:`run_case`; another
    module's function, picklable by reference) for every case.

    Raises :class:`WorldFailed` with the rank's traceback if any rank fails,
    exits without reporting, or does not finish within ``timeout_s``.
    """
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cases, results, timeout_s, runner), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                status, rank, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead:
                    # give the queue a moment: a rank may have reported just before exiting
                    try:
                        status, rank, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        raise WorldFailed(
                            f"rank(s) {dead} exited (exit codes {[procs[r].exitcode for r in dead]}) "
                            "without reporting a result") from None
                elif time.monotonic() > deadline:
                    raise WorldFailed(f"timed out after {timeout_s:.0f}s waiting for ranks "
                                      f"{sorted(set(range(world)) - set(got))}") from None
                else:
                    continue
            if status == "error":
                raise WorldFailed(f"rank {rank} failed:\n{payload}")
            got[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [got[r] for r in range(world)]
