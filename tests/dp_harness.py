"""Multi-process harness for data parallelism x pipeline parallelism (CPU, gloo, 4 ranks).

The 4 ranks form a 2 x 2 device mesh (``dp`` x ``pp``): ranks 0 and 1 are
one pipeline (replica 0), ranks 2 and 3 the other (replica 1); ranks 0 and 2
hold the same stages and synchronise their gradients over the ``dp`` group.
Processes are spawned by :func:`pipeline_harness.run_world` with
:func:`run_dp_case` as the runner.

Each case builds the transformer of :mod:`pipeline_harness` (the benchmark's
``Block``) in every rank from the same seed, compiles each stage module with
fxsplit (whole stage or per block, in place), wraps it in DDP or shards it
with FSDP2 over the ``dp`` mesh dimension, and runs two optimizer steps of an
upstream schedule over fxsplit :class:`~fxsplit.pipelining.PipelineStage` s.
In-rank it compares, against a single-process eager reference run on the
full (global) batch: every microbatch loss, and every parameter's full
gradient (FSDP2: ``grad.full_tensor()``). It returns, per action of the last
step, the fxsplit region counters, FLOPs and the collectives issued, so the
parent can check where gradient synchronisation happened.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

import pipeline_harness as ph

DP = 2
PP = 2
WORLD = DP * PP
DP_COLLECTIVES = ("allreduce_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_scatter_",
                  "_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_")


@dataclasses.dataclass
class DPCase:
    """One dp x pp run: ``wrapper`` is ``"ddp"`` or ``"fsdp"``; ``compile`` is
    ``"stage"`` (``stage_module.compile``) or ``"blocks"`` (``block.compile`` per block)."""

    schedule: str
    wrapper: str
    compile: str = "stage"
    reshard_after_forward: bool = True  # FSDP2 only
    compiler: str = "eager"

    @property
    def name(self) -> str:
        extra = f"-raf{int(self.reshard_after_forward)}" if self.wrapper == "fsdp" else ""
        return f"{self.schedule}-{self.wrapper}{extra}-{self.compile}-{self.compiler}"


# ---------------------------------------------------------------------------------------------
# collectives: read from the profiler, which records every c10d op (also those DDP's reducer
# issues from C++) with the action it ran in. A TorchDispatchMode would see them too, but
# while one is active Dynamo runs the compiled frames eagerly, which would defeat the test.
_LABEL = "dp_harness:"


def _labelled(label: str) -> Any:
    return torch.profiler.record_function(_LABEL + label)


def step_collecting(schedule: Any, last: bool, *args: Any, **kwargs: Any) -> list[tuple[str, str]] | None:
    """``schedule.step(*args, **kwargs)``; on the ``last`` step under the profiler,
    returning :func:`collectives_in` of it (``None`` otherwise). Earlier steps run
    unprofiled: the first one compiles every region, and reading the profiler's
    events of a compiling step costs seconds per rank."""
    if not last:
        schedule.step(*args, **kwargs)
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        schedule.step(*args, **kwargs)
    return collectives_in(prof)


def collectives_in(prof: Any) -> list[tuple[str, str]]:
    """``(op, action)`` for every outermost ``c10d::`` op the profiler saw, in
    order; ``action`` is the innermost label of :func:`_labelled` around it
    (``"schedule"`` for ops the schedule issues itself: p2p, FSDP ``UNSHARD``)."""
    found: list[tuple[int, str, str]] = []
    for evt in prof.events():
        if not evt.name.startswith("c10d::"):
            continue
        label, parent, nested = "schedule", evt.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("c10d::"):
                nested = True
                break
            if parent.name.startswith(_LABEL) and label == "schedule":
                label = parent.name[len(_LABEL):]
            parent = parent.cpu_parent
        if not nested:
            found.append((evt.time_range.start, evt.name[len("c10d::"):], label))
    return [(op, label) for _, op, label in sorted(found)]


def label_actions(actions: list[dict[str, Any]], collectives: list[tuple[str, str]]) -> None:
    """Give each backward action (``stage``, ``kind``, ``mb``) the collectives it
    issued (``"collectives"``) and those of its microbatch's forward on that
    stage (``"forward_collectives"``), as ``{op: count}``."""
    by_label: dict[str, dict[str, int]] = {}
    for op, label in collectives:
        counts = by_label.setdefault(label, {})
        counts[op] = counts.get(op, 0) + 1
    for a in actions:
        a["collectives"] = by_label.get(f"{a['stage']}:{a['kind']}{a['mb']}", {})
        a["forward_collectives"] = by_label.get(f"{a['stage']}:F{a['mb']}", {})


def make_dp_stage_class() -> type:
    base = ph.make_recording_stage_class()

    class DPStage(base):  # type: ignore[misc, valid-type]
        """RecordingStage that also labels the collectives of each action (and REDUCE_GRAD)."""

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            with _labelled(f"{self.stage_index}:F{fwd_chunk_id}"):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> None:
            kind = "B" if full_backward else "I"
            with _labelled(f"{self.stage_index}:{kind}{bwd_chunk_id}"):
                super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                           last_backward=last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
            with _labelled(f"{self.stage_index}:W{bwd_chunk_id}"):
                super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

        def perform_reduce_grad(self, grad_scale_factor: int) -> None:
            with _labelled(f"{self.stage_index}:REDUCE_GRAD"):
                super().perform_reduce_grad(grad_scale_factor)

        # torch >= 2.15: multi-stage schedules run REDUCE_GRAD for FSDP stages as these two
        # (the reduce-scatters start in the first), not as perform_reduce_grad; never called before
        def start_gradient_reduction(self) -> None:
            with _labelled(f"{self.stage_index}:REDUCE_GRAD"):
                super().start_gradient_reduction()

        def wait_for_gradient_reduction(self, grad_scale_factor: int) -> None:
            with _labelled(f"{self.stage_index}:WAIT_REDUCE_GRAD"):
                super().wait_for_gradient_reduction(grad_scale_factor)

    return DPStage


# ---------------------------------------------------------------------------------------------
def make_global_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: DP replicas x N_MICROBATCHES microbatches."""
    g = torch.Generator().manual_seed(200 + step)
    n = DP * ph.MB_BATCH * ph.N_MICROBATCHES
    return torch.randn(n, ph.SEQ, ph.D_MODEL, generator=g), torch.randn(n, ph.SEQ, ph.D_MODEL, generator=g)


def reference_step(stages: list[ph.StageModule], x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Single process, full batch: the mean of the per-microbatch losses (microbatches
    of all replicas, replica-major), one backward. Returns every microbatch's loss."""
    h = x
    for s in stages:
        h = s(h)
    n = DP * ph.N_MICROBATCHES
    losses = [ph.loss_fn(o, t) for o, t in zip(h.chunk(n), y.chunk(n))]
    torch.stack(losses).mean().backward()
    return [float(v) for v in losses]


def _wrap(case: DPCase, module: ph.StageModule, mesh: Any) -> torch.nn.Module:
    if case.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=mesh["dp"].get_group())
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=case.reshard_after_forward)
    return fully_shard(module, mesh=mesh["dp"], reshard_after_forward=case.reshard_after_forward)


def _full_grad(p: torch.Tensor) -> torch.Tensor | None:
    g = p.grad
    if g is None:
        return None
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def run_dp_case(case: DPCase, rank: int, world: int) -> dict[str, Any]:
    """One case in one rank (see the module docstring); returns what the parent checks."""
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.device_mesh import init_device_mesh

    import fxsplit

    assert world == WORLD, f"the dp x pp harness needs {WORLD} ranks, got {world}"
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    stage_ids, n_stages = ph.stage_ids_for(case.schedule, pp_rank, PP)
    reference = ph.build_reference(n_stages)
    modules = {s: copy.deepcopy(reference[s]) for s in stage_ids}
    backend = fxsplit.backend(compiler=case.compiler, fallback="error")
    for m in modules.values():
        if case.compile == "stage":
            m.compile(backend=backend)
        else:
            for block in m.blocks:
                block.compile(backend=backend)
    wrapped = {s: _wrap(case, m, mesh) for s, m in modules.items()}

    stage_cls = make_dp_stage_class()
    stages = [stage_cls(wrapped[s], s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for s in stage_ids]
    schedule_cls = getattr(schedules, case.schedule)
    if case.schedule == "Schedule1F1B":
        schedule = schedule_cls(stages[0], ph.N_MICROBATCHES, loss_fn=ph.loss_fn)
    else:
        schedule = schedule_cls(stages, ph.N_MICROBATCHES, loss_fn=ph.loss_fn)

    ref_opt = torch.optim.SGD([p for m in reference for p in m.parameters()], lr=ph.LR)
    opt = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=ph.LR)
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids
    local = ph.MB_BATCH * ph.N_MICROBATCHES
    step_losses: list[list[float]] = []
    grads_checked = 0
    collectives: list[tuple[str, str]] = []
    grads_out: dict[int, list[list[float]]] = {}
    for step in range(ph.N_STEPS):
        x, y = make_global_data(step)
        ref_losses = reference_step(reference, x, y)
        mine = slice(dp_rank * local, (dp_rank + 1) * local)
        for st in stages:
            st.actions.clear()
        losses: list[torch.Tensor] = []
        args = (x[mine],) if has_first else ()
        kwargs: dict[str, Any] = {"target": y[mine], "losses": losses} if has_last else {}
        collectives = step_collecting(schedule, step == ph.N_STEPS - 1, *args, **kwargs) or []
        where = f"{case.name} rank {rank} step {step}"
        if has_last:
            got = [float(v.detach()) for v in losses]
            expected = ref_losses[dp_rank * ph.N_MICROBATCHES:(dp_rank + 1) * ph.N_MICROBATCHES]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{where}: microbatch losses differ: {m}")
            step_losses.append(got)
        for s, m in modules.items():
            grads_out[s] = []
            for (name, p), (_, rp) in zip(m.named_parameters(), reference[s].named_parameters(), strict=True):
                grads_checked += 1
                full = _full_grad(p)  # FSDP2: a collective over dp, same order on both replicas
                assert full is not None, f"{where}: stage {s} {name}: no gradient"
                torch.testing.assert_close(full, rp.grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda msg, s=s, name=name: f"{where}: stage {s} {name}.grad: {msg}")
                grads_out[s].append(full.detach().flatten().tolist())  # plain floats: exact, picklable
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    return {
        "case": case.name,
        "wrapper": case.wrapper,
        "schedule": case.schedule,
        "rank": rank,
        "dp_rank": dp_rank,
        "pp_rank": pp_rank,
        "stages": stage_ids,
        "n_stages": n_stages,
        "losses": step_losses,
        "grads_checked": grads_checked,
        # last step only (the first step also compiles and infers shapes)
        "actions": [a for st in stages for a in st.actions],
        "collectives": collectives,
        "grads": grads_out,
        "n_fsdp_groups": {s: _n_fsdp_param_groups(w) for s, w in wrapped.items()},
        "weight_grad_flops": {s: ph.weight_grad_flops(m) for s, m in modules.items()},
        "reference_flops": {s: ph.reference_backward_flops(reference[s], s == 0, s == n_stages - 1)
                            for s in stage_ids},
    }


def _n_fsdp_param_groups(module: torch.nn.Module) -> int:
    """FSDP modules that own parameters (each reduce-scatters once per step)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(1 for m in module.modules() if isinstance(m, FSDPModule) and _owns_params(m))


def _owns_params(m: torch.nn.Module) -> bool:
    """Whether ``m`` (an FSDP module) owns parameters not owned by a nested FSDP module."""
    from torch.distributed.fsdp import FSDPModule

    owned_elsewhere = {id(p) for sub in m.modules() if sub is not m and isinstance(sub, FSDPModule)
                       for p in sub.parameters()}
    return any(id(p) not in owned_elsewhere for p in m.parameters())

