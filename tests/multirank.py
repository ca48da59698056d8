"""The suite's one multi-rank driver: a checked pipeline run against a single-process reference.

Every multi-rank world of the suite (plain pipelines, DP x PP, TP x PP, EP x
PP; and, through :mod:`fxsplit.bench.world`, ``fxsplit bench --pipeline``)
starts its ranks with :func:`run_world` and, in each rank, describes what it
runs as a :class:`Run` (the stage modules, what the pipeline stages wrap, the
schedule, how one step's data and reference are made, how a gradient is
compared); :func:`drive` then does what every world does: wrap the stages in
fxsplit's ``PipelineStage`` with the run's observers, build the schedule,
pair an SGD optimizer with the reference's, and for every step compare each
microbatch loss and every parameter gradient of the stages the rank holds.
What is special to a world (a device mesh, a wrapper, a reference that spans
replicas, an extra counter) is the case module's: :mod:`pipeline_harness`,
:mod:`dp_harness`, :mod:`tp_pp_harness`, :mod:`ep_harness`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from fxsplit.bench import world as W

# What a rank imports before it runs anything: loaded once, by the fork server.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.pipelining", "torch._dynamo",
           "torch._inductor.compile_fx", "fxsplit", "fxsplit.pipelining", "fxsplit.bench.world", __name__]

SCHEDULES = (
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
WorldFailed = W.WorldFailed


def upstream_schedule_failure(schedule: str) -> str | None:
    """Why torch's own ``schedule`` cannot run on this torch with gloo (None if it can).

    torch 2.11: the V-shaped schedules (two stages per rank, the first and the
    last) fail in ``_initialize_stages`` before any backward, with upstream's own
    ``PipelineStage`` too: the shape-inference p2p batch ends in gloo's "Pair is
    not connected" (``fxsplit._torch_internals.v_schedules_fail_with_gloo``, which
    ``fxsplit bench --pipeline`` asks too).
    """
    from fxsplit import _torch_internals

    if schedule in W.V_SCHEDULES and _torch_internals.v_schedules_fail_with_gloo():
        return (f"torch {torch.__version__}: upstream {schedule} fails in _initialize_stages with gloo "
                "('Pair is not connected'), also with torch's own PipelineStage; torch 2.13 to 2.15 run it")
    return None


RUNNABLE_SCHEDULES = tuple(s for s in SCHEDULES if upstream_schedule_failure(s) is None)


def _run_cases(payload: tuple[Callable[[Any, int, int], Any], list[Any]], rank: int, ranks: int) -> list[Any]:
    import torch._inductor.config

    # Each rank compiles in its own process: Inductor would otherwise start a pool of compile
    # subprocesses per rank (one per core) and use it only once it has started, which on a
    # small machine running 4 or 8 ranks makes where a kernel compiles depend on timing.
    torch._inductor.config.compile_threads = 1
    runner, cases = payload
    return [runner(case, rank, ranks) for case in cases]


def run_world(cases: list[Any], world: int, runner: Callable[[Any, int, int], Any],
              timeout_s: float = 240.0) -> list[list[Any]]:
    """``runner(case, rank, world)`` for every case, in each of ``world`` gloo ranks (one
    intra-op thread each); each rank's results, by rank. A failing rank raises
    :class:`~fxsplit.bench.world.WorldFailed` with its traceback."""
    return W.run_world(_run_cases, (runner, cases), world, timeout_s=timeout_s,
                       preload=PRELOAD + [runner.__module__])


# ---------------------------------------------------------------------------------------------
def full_grad(g: torch.Tensor | None) -> torch.Tensor | None:
    """``g`` whole: a DTensor's ``full_tensor()`` (a collective: call it in the same
    order on every rank), a plain tensor as it is."""
    return g.full_tensor() if hasattr(g, "full_tensor") else g


TIGHT = {"rtol": 1e-4, "atol": 1e-5}


@dataclasses.dataclass
class Run:
    """What one rank runs, as a case module builds it (see :func:`drive`).

    ``modules``: the stage modules this rank holds (stage index -> module; the
    optimizer's parameters); ``wrapped``: what each ``PipelineStage`` wraps
    (DDP or FSDP modules; default ``modules``); ``reference``: the reference
    modules (their parameters, deduplicated, get the reference optimizer).
    ``step_data(step)`` runs the reference's backward for ``step`` and returns
    this rank's ``(inputs, targets, expected microbatch losses)``.
    ``expected_grads(stage, module)`` yields ``(name, parameter, expected
    gradient)``: default, the parameters of ``modules[stage]`` against those of
    ``reference[stage]`` in order. ``grad_tol(name)``: tolerances for
    ``assert_close``. ``observers``: per action (:func:`fxsplit.bench.world.observed_stage_class`);
    ``profile_last``: run the last step under the profiler and give each action
    the collectives it issued (``collectives``) and those of its microbatch's
    forward (``forward_collectives``). ``keep_grads``: return every full gradient
    of the last step as lists of floats.
    """

    name: str
    schedule: str
    stage_ids: list[int]
    n_stages: int
    modules: dict[int, nn.Module]
    reference: list[nn.Module]
    step_data: Callable[[int], tuple[torch.Tensor, torch.Tensor, list[float]]]
    loss_fn: Callable[..., torch.Tensor]
    microbatches: int
    steps: int
    lr: float
    wrapped: dict[int, nn.Module] | None = None
    group: Any = None
    generated: Any = None
    expected_grads: Callable[[int, nn.Module], Iterable[tuple[str, torch.Tensor, torch.Tensor]]] | None = None
    grad_tol: Callable[[str], dict[str, float]] = lambda name: TIGHT
    loss_tol: dict[str, float] = dataclasses.field(default_factory=lambda: {"rtol": 1e-5, "atol": 1e-6})
    observers: list[Any] = dataclasses.field(
        default_factory=lambda: [W.RegionRuns.observer, W.MatmulCounter.observer()])
    profile_last: bool = False
    keep_grads: bool = False


def _default_grads(run: Run) -> Callable[[int, nn.Module], Iterable[tuple[str, torch.Tensor, torch.Tensor]]]:
    def grads(s: int, m: nn.Module) -> Iterable[tuple[str, torch.Tensor, torch.Tensor]]:
        for (name, p), (_, rp) in zip(m.named_parameters(), run.reference[s].named_parameters(), strict=True):
            yield name, p, rp.grad

    return grads


def build_stages(run: Run) -> tuple[list[Any], Any]:
    """fxsplit ``PipelineStage`` s (observed) over ``run.wrapped`` and the schedule over them."""
    from fxsplit.pipelining import PipelineStage

    cls = W.observed_stage_class(PipelineStage)
    wrapped = run.wrapped or run.modules
    kwargs = {} if run.group is None else {"group": run.group}
    stages = [cls(wrapped[s], s, run.n_stages, torch.device("cpu"), **kwargs) for s in run.stage_ids]
    for st in stages:
        st.observers = list(run.observers)
        if run.profile_last:
            st.observers.insert(0, W.label_observer)
    schedule = W.build_schedule(run.schedule, stages, run.microbatches, run.loss_fn, run.generated)
    return stages, schedule


def drive(run: Run) -> dict[str, Any]:
    """Run ``run.steps`` optimizer steps of the schedule, checking in-rank every
    microbatch loss (the last stage's holders) and every parameter gradient against
    the reference; returns ``losses`` (per step), ``grads_checked``, the last step's
    ``actions`` (and, with ``profile_last``, its ``collectives``) and, with
    ``keep_grads``, ``grads`` (stage -> every full gradient as a list of floats)."""
    stages, schedule = build_stages(run)
    ref_params = list({id(p): p for m in run.reference for p in m.parameters()}.values())
    ref_opt = torch.optim.SGD(ref_params, lr=run.lr)
    opt = torch.optim.SGD([p for m in run.modules.values() for p in m.parameters()], lr=run.lr)
    has_first, has_last = 0 in run.stage_ids, run.n_stages - 1 in run.stage_ids
    expected_grads = run.expected_grads or _default_grads(run)
    out: dict[str, Any] = {"losses": [], "grads_checked": 0, "collectives": [], "grads": {}}
    for step in range(run.steps):
        x, y, expected = run.step_data(step)
        for st in stages:
            st.actions.clear()
        losses: list[torch.Tensor] = []
        args = (x,) if has_first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if has_last else {}
        last = step == run.steps - 1
        if last and run.profile_last:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                schedule.step(*args, **kwargs)
            out["collectives"] = W.collectives(prof)
        else:
            schedule.step(*args, **kwargs)
        where = f"{run.name} step {step}"
        if has_last:
            got = [float(v.detach()) for v in losses]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **run.loss_tol,
                                       msg=lambda m: f"{where}: microbatch losses differ: {m}")
            out["losses"].append(got)
        for s, m in run.modules.items():
            kept = out["grads"][s] = []
            for name, p, want in expected_grads(s, m):
                got_grad = full_grad(p.grad)  # may be a collective: the same order on every rank
                assert got_grad is not None and want is not None, f"{where}: stage {s} {name}: no gradient"
                torch.testing.assert_close(got_grad.float(), want.float(), **run.grad_tol(name),
                                           msg=lambda msg, s=s, name=name: f"{where}: stage {s} {name}.grad: {msg}")
                out["grads_checked"] += 1
                if run.keep_grads:
                    kept.append(got_grad.detach().flatten().tolist())  # plain floats: exact, picklable
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    actions = [a for st in stages for a in st.actions]
    if run.profile_last:
        for a in actions:
            a["collectives"] = W.collective_counts(out["collectives"], f"{a['stage']}:{a['kind']}{a['mb']}")
            a["forward_collectives"] = W.collective_counts(out["collectives"], f"{a['stage']}:F{a['mb']}")
    out["actions"] = actions
    if not run.keep_grads:
        del out["grads"]
    return out


def deep_copies(reference: list[nn.Module], stage_ids: list[int]) -> dict[int, nn.Module]:
    """This rank's stage modules: copies of the reference's."""
    return {s: copy.deepcopy(reference[s]) for s in stage_ids}
