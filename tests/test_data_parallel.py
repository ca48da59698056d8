"""Data parallelism x pipeline parallelism: DDP- and FSDP2-wrapped fxsplit stages.

Real 4-rank gloo runs on CPU (:mod:`dp_harness`: a 2 x 2 mesh, two pipeline
replicas of two ranks each) of ``ScheduleZBVZeroBubble``,
``ScheduleInterleavedZeroBubble`` and ``Schedule1F1B`` (the control: full
backwards only), with stage modules compiled by fxsplit in place and wrapped
in DDP or sharded with FSDP2. In-rank, every microbatch loss and every full
gradient is compared with a single-process reference on the global batch;
here the results are checked for coverage, for the split (I ran the dI
graphs only, W the dW graphs), and for where gradient synchronisation
happened (once per step, after the stage's last W). In-process single-rank
tests cover the constructor's errors and the W -> DDP hook path directly.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fxsplit

sys.path.insert(0, os.path.dirname(__file__))
import dp_harness as dh  # noqa: E402
import pipeline_harness as ph  # noqa: E402
from fxsplit.bench import world as W  # noqa: E402
from test_pipelining import _check_losses_and_grads  # noqa: E402

DPCase = dh.DPCase
CASES = [
    DPCase("ScheduleZBVZeroBubble", "ddp", compile="stage"),
    DPCase("ScheduleZBVZeroBubble", "fsdp", compile="blocks", reshard_after_forward=True),
    DPCase("ScheduleZBVZeroBubble", "fsdp", compile="stage", reshard_after_forward=False),
    DPCase("ScheduleInterleavedZeroBubble", "ddp", compile="blocks"),
    DPCase("ScheduleInterleavedZeroBubble", "fsdp", compile="blocks", reshard_after_forward=False),
    DPCase("Schedule1F1B", "ddp", compile="stage"),
    DPCase("Schedule1F1B", "fsdp", compile="blocks", reshard_after_forward=True),
]
IDS = [c.name for c in CASES]
RUNNABLE = [c for c in CASES if ph.upstream_schedule_failure(c.schedule) is None]


def _skip_where_upstream_fails(case: DPCase) -> None:
    why = ph.upstream_schedule_failure(case.schedule)
    if why is not None:
        pytest.skip(why)
SPLIT_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble")


@pytest.fixture(scope="module")
def dp_world() -> dict[str, list[dict[str, Any]]]:
    """case name -> the four ranks' results, from one 4-rank world running every case."""
    per_rank = ph.run_world(RUNNABLE, world=dh.WORLD, timeout_s=600, runner=dh.run_dp_case)
    by_case: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for rank_results in per_rank:
        for result in rank_results:
            by_case[result["case"]].append(result)
    return by_case


def _replicas(results: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return [[r for r in results if r["dp_rank"] == d] for d in range(dh.DP)]


def _last_backward_labels(r: dict[str, Any]) -> dict[int, str]:
    """Per stage the rank holds: the label of its last B or W of the step (where DDP syncs)."""
    last: dict[int, str] = {}
    for a in r["actions"]:  # per stage, in execution order
        if a["kind"] in ("B", "W"):
            last[a["stage"]] = f"{a['stage']}:{a['kind']}{a['mb']}"
    return last


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_single_process_reference(dp_world: dict[str, list[dict[str, Any]]], case: DPCase) -> None:
    _skip_where_upstream_fails(case)
    results = dp_world[case.name]
    assert sorted(r["rank"] for r in results) == list(range(dh.WORLD))
    # Numerics were compared in-rank against the full-batch reference (a mismatch fails the
    # world); here: each replica held every stage and compared every gradient, both steps.
    for replica in _replicas(results):
        _check_losses_and_grads(replica)
    losses = [r["losses"] for r in results if r["n_stages"] - 1 in r["stages"]]
    assert len(losses) == dh.DP and losses[0] != losses[1], "both replicas saw the same data"


def _regions_per_stage(case: DPCase, n_stages: int) -> int:
    """Compiled regions one microbatch runs through in one stage: one per block when the
    blocks are compiled, and under FSDP2 (its hooks run between the blocks, breaking the
    graph there); one for a whole stage compiled under DDP."""
    return ph.N_BLOCKS // n_stages if case.compile == "blocks" or case.wrapper == "fsdp" else 1


def _check_split_actions(case: DPCase, replica: list[dict[str, Any]]) -> collections.Counter:
    """Every (stage, microbatch) of one replica got one full backward, or one I and one W;
    I ran only dI graphs and exactly the FLOPs of an input-gradient-only backward, W only
    dW graphs; returns the counter totals. (``test_pipelining``'s check, with several
    regions per stage.)"""
    n_stages = replica[0]["n_stages"]
    k = _regions_per_stage(case, n_stages)
    seen: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
    totals: collections.Counter = collections.Counter()
    for r in replica:
        for a in r["actions"]:
            s, kind = a["stage"], a["kind"]
            seen[(s, a["mb"])].append(kind)
            totals.update({key: a[key] for key in ("di_runs", "dw_runs", "fused_runs")})
            input_only, full = r["reference_flops"][s]
            runs = (a["fused_runs"], a["di_runs"], a["dw_runs"])
            where = f"{case.name}: stage {s} {kind}{a['mb']}: {a}"
            # stage 0's W: the weight matmuls and the first qkv's dX, which only ln1's weight
            # gradient needs (test_pipelining.first_stage_w_flops); its I the rest
            first_w = r["weight_grad_flops"][s] + 2 * ph.MB_BATCH * ph.SEQ * ph.D_MODEL * 3 * ph.D_MODEL
            if kind == "B":  # full backward: the fused compiled backward
                assert runs == (k, 0, 0) and a["flops"] == full, where
            elif kind == "I" and s == 0:  # first stage: the activation-gradient chain
                assert runs == (0, k, 0) and a["flops"] == full - first_w, where
            elif kind == "W" and s == 0:
                assert runs == (0, 0, k) and a["flops"] == first_w, where
            elif kind == "I":
                assert runs == (0, k, 0) and a["flops"] == input_only, where
            elif kind == "W":
                assert runs == (0, 0, k) and a["flops"] == r["weight_grad_flops"][s] == full - input_only, where
            else:
                raise AssertionError(f"unexpected action {where}")
    assert set(seen) == {(s, mb) for s in range(n_stages) for mb in range(ph.N_MICROBATCHES)}
    for key, kinds in seen.items():
        assert sorted(kinds) in (["B"], ["I", "W"]), f"{case.name}: stage/microbatch {key} ran {kinds}"
    return totals


def _check_split_totals(case: DPCase, replica: list[dict[str, Any]]) -> None:
    totals = _check_split_actions(case, replica)
    n_stages, mbs = replica[0]["n_stages"], ph.N_MICROBATCHES
    k = _regions_per_stage(case, n_stages)
    if case.schedule in SPLIT_SCHEDULES:
        # every stage, the first included, ran its dI graphs at I and its dW graphs at W
        expected = {"di_runs": n_stages * mbs * k, "dw_runs": n_stages * mbs * k, "fused_runs": 0}
    else:
        expected = {"di_runs": 0, "dw_runs": 0, "fused_runs": n_stages * mbs * k}
    assert dict(totals) == expected, case.name


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_actions_split(dp_world: dict[str, list[dict[str, Any]]], case: DPCase) -> None:
    """Exactly as without data parallelism: I runs only the dI graphs (no weight-gradient
    FLOPs), W the compiled dW graphs; 1F1B runs the fused compiled backward."""
    _skip_where_upstream_fails(case)
    for replica in _replicas(dp_world[case.name]):
        _check_split_totals(case, replica)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradient_sync_once_per_step(dp_world: dict[str, list[dict[str, Any]]], case: DPCase) -> None:
    """The collectives of the second step, per rank, and the action each ran in."""
    _skip_where_upstream_fails(case)
    for r in dp_world[case.name]:
        ops = r["collectives"]
        where = f"{case.name} rank {r['rank']}: {ops}"
        counts = collections.Counter(op for op, _ in ops)
        assert set(counts) <= {"send", "recv_", "broadcast_", "allreduce_", "_allgather_base_",
                               "_reduce_scatter_base_"}, where
        labels = {op: [label for o, label in ops if o == op] for op in counts}
        if case.wrapper == "ddp":
            # one all-reduce per stage (its parameters fit one bucket), inside its last B/W
            assert sorted(labels.get("allreduce_", [])) == sorted(_last_backward_labels(r).values()), where
            assert "_reduce_scatter_base_" not in counts and "_allgather_base_" not in counts, where
            # DDP rebuilds its buckets once, at the first forward after its first sync (this step)
            assert all(":F" in label for label in labels.get("broadcast_", [])), where
        else:
            # one reduce-scatter per FSDP parameter group, all at REDUCE_GRAD (after the last W/B)
            expected = collections.Counter({f"{s}:REDUCE_GRAD": n for s, n in r["n_fsdp_groups"].items()})
            assert collections.Counter(labels.get("_reduce_scatter_base_", [])) == expected, where
            assert "allreduce_" not in counts and "broadcast_" not in counts, where
            gathers = labels.get("_allgather_base_", [])
            assert not any("REDUCE_GRAD" in label for label in gathers), where
            # no W does FSDP work (stage 0's included, now that its I runs the chain): no hook runs there
            assert not any(":W" in label for label in gathers), where
            n_groups = sum(r["n_fsdp_groups"].values())
            if case.reshard_after_forward:
                assert len(gathers) > n_groups, where  # resharded after each forward, gathered again
            else:
                assert len(gathers) == n_groups, where  # gathered once, kept for the step


@pytest.mark.parametrize("case", [c for c in CASES if c.wrapper == "ddp"], ids=lambda c: c.name)
def test_ddp_gradients_identical_across_replicas(dp_world: dict[str, list[dict[str, Any]]],
                                                 case: DPCase) -> None:
    _skip_where_upstream_fails(case)
    by_pp = collections.defaultdict(list)
    for r in dp_world[case.name]:
        by_pp[r["pp_rank"]].append(r)
    for pp_rank, (a, b) in by_pp.items():
        assert a["grads"].keys() == b["grads"].keys() and a["grads"]
        for s in a["grads"]:
            for k, (ga, gb) in enumerate(zip(a["grads"][s], b["grads"][s], strict=True)):
                assert ga == gb, f"{case.name}: stage {s} parameter {k} differs between the dp replicas"


@pytest.mark.inductor
def test_fsdp_zbv_with_inductor() -> None:
    case = DPCase("ScheduleZBVZeroBubble", "fsdp", compile="blocks", reshard_after_forward=True,
                  compiler="inductor")
    _skip_where_upstream_fails(case)
    results = [r[0] for r in ph.run_world([case], world=dh.WORLD, timeout_s=600, runner=dh.run_dp_case)]
    for replica in _replicas(results):
        _check_losses_and_grads(replica)
        _check_split_totals(case, replica)
    for r in results:
        rs = [label for op, label in r["collectives"] if op == "_reduce_scatter_base_"]
        assert collections.Counter(rs) == collections.Counter(
            {f"{s}:REDUCE_GRAD": n for s, n in r["n_fsdp_groups"].items()})


# ---------------------------------------------------------------------------------------------
# in-process, one rank: the constructor's checks and the W -> wrapper hook path
@pytest.fixture
def one_rank() -> Any:
    """A one-rank gloo process group in this process (DDP and fully_shard need one)."""
    if dist.is_initialized():  # pragma: no cover - another test leaked a group
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _stage_module(n_blocks: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return ph.stage_module(n_blocks, last=False)


def test_ddp_inside_the_stage_module_is_refused(one_rank: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from fxsplit.pipelining import PipelineStage

    module = _stage_module()
    module.blocks[0] = DistributedDataParallel(module.blocks[0])
    with pytest.raises(ValueError, match=r"DistributedDataParallel is applied to submodule\(s\) blocks.0"):
        PipelineStage(module, 0, 1, torch.device("cpu"))


def test_a_module_set_after_construction_is_checked_and_followed(one_rank: Any) -> None:
    """torchtitan builds the stages first and sets ``stage.submod`` to the parallelized
    module afterwards: the stage then drives that module's wrapper, and a wrapping it
    cannot drive raises there, leaving the stage as it was."""
    from torch.nn.parallel import DistributedDataParallel

    from fxsplit.pipelining import PipelineStage

    module = _stage_module()
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    assert stage.submod is module and stage._data_parallel is None
    wrapped = DistributedDataParallel(module)
    stage.submod = wrapped
    assert stage.submod is wrapped and stage._data_parallel == "ddp"
    bad = _stage_module()
    bad.blocks[0] = DistributedDataParallel(bad.blocks[0])
    with pytest.raises(ValueError, match=r"DistributedDataParallel is applied to submodule\(s\) blocks.0"):
        stage.submod = bad
    assert stage.submod is wrapped and stage._data_parallel == "ddp"


def test_fsdp_on_blocks_only_is_refused(one_rank: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    from fxsplit.pipelining import PipelineStage

    module = _stage_module()
    for block in module.blocks:
        fully_shard(block)
    with pytest.raises(ValueError, match=r"fully_shard was applied to submodule\(s\) blocks.0, blocks.1 but not"):
        PipelineStage(module, 0, 1, torch.device("cpu"))


def test_ddp_around_ddp_is_refused(one_rank: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from fxsplit.pipelining import PipelineStage

    module = _stage_module()
    module.blocks[1] = DistributedDataParallel(module.blocks[1])
    with pytest.raises(ValueError, match="DistributedDataParallel around another data-parallel wrapper"):
        PipelineStage(DistributedDataParallel(module), 0, 1, torch.device("cpu"))


def test_fsdp_replicate_is_refused(one_rank: Any) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    from fxsplit.pipelining import PipelineStage

    module = _stage_module()
    replicate(module)
    with pytest.raises(ValueError, match=r"FSDP-based replicate\(\)"):
        PipelineStage(module, 0, 1, torch.device("cpu"))


def test_ddp_static_graph_is_refused(one_rank: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from fxsplit.pipelining import PipelineStage

    with pytest.raises(ValueError, match=r"static_graph=True\) is not supported"):
        PipelineStage(DistributedDataParallel(_stage_module(), static_graph=True), 0, 1, torch.device("cpu"))


def test_ddp_find_unused_parameters_is_refused_at_the_first_i(one_rank: Any) -> None:
    """Allowed for full backwards (upstream's behaviour); refused, before it runs, by the
    first I of a split schedule."""
    from torch.nn.parallel import DistributedDataParallel

    from fxsplit.pipelining import PipelineStage

    ddp = DistributedDataParallel(_stage_module(1), find_unused_parameters=True)
    stage = PipelineStage(ddp, 0, 1, torch.device("cpu"))
    x = torch.randn(ph.MB_BATCH, ph.SEQ, ph.D_MODEL, requires_grad=True)
    out = stage.forward_maybe_with_nosync(x)
    kwargs = {"stage_output": (out,), "output_grads": (torch.ones_like(out),), "input_values": [x]}
    with pytest.raises(ValueError, match=r"find_unused_parameters=True\) cannot be used with a schedule that splits"):
        stage.backward_maybe_with_nosync("input", kwargs)
    assert x.grad is None and all(p.grad is None for p in ddp.parameters())
    stage.backward_maybe_with_nosync("full", kwargs, last_backward=True)  # a full backward works
    assert all(p.grad is not None for p in ddp.parameters())


def _one_rank_split_step(stage: Any, module: torch.nn.Module, n_mb: int = 2) -> list[torch.Tensor]:
    """Drive ``stage``'s backward like a zero-bubble schedule for ``n_mb`` microbatches:
    forward all, I all, then W in reverse order, the last W with ``last_backward``.
    Returns the inputs (to rebuild the reference)."""
    xs = [torch.randn(ph.MB_BATCH, ph.SEQ, ph.D_MODEL, requires_grad=True) for _ in range(n_mb)]
    outs = [stage.forward_maybe_with_nosync(x) for x in xs]
    pending = []
    for x, out in zip(xs, outs):
        kwargs = {"stage_output": (out,), "output_grads": (torch.ones_like(out),), "input_values": [x]}
        _, work = stage.backward_maybe_with_nosync("input", kwargs)
        pending.append(work)
    for k in reversed(range(n_mb)):  # what upstream's stage passes to a W
        kwargs = {"stage_output": (outs[k],), "param_groups": pending[k]}
        stage.backward_maybe_with_nosync("weight", kwargs, last_backward=(k == 0))
    return xs


def test_ddp_hooks_fire_at_the_last_w(one_rank: Any) -> None:
    """W commits through the grad accumulators, so the DDP reducer's hooks run there:
    one all-reduce, in the last W; none in I or in the W that ran under no_sync."""
    import copy

    from torch.nn.parallel import DistributedDataParallel

    from fxsplit.pipelining import PipelineStage

    reference = _stage_module()
    module = copy.deepcopy(reference)
    module.compile(backend=fxsplit.backend(compiler="eager", fallback="error"))
    ddp = DistributedDataParallel(module)
    stage = PipelineStage(ddp, 0, 1, torch.device("cpu"))
    runs = W.RegionRuns()  # regions of earlier tests may still be listed: count the difference
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        xs = _one_rank_split_step(stage, ddp)
    ops = [op for op, _ in W.collectives(prof)]
    assert ops.count("allreduce_") == 1, ops
    stage.perform_reduce_grad(1)
    for x in xs:
        reference(x.detach()).backward(torch.ones(ph.MB_BATCH, ph.SEQ, ph.D_MODEL))
    for (name, p), rp in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    # the whole stage is one compiled region: one dI and one dW run per microbatch, none fused
    assert runs.delta() == {"di_runs": len(xs), "dw_runs": len(xs), "fused_runs": 0}


def test_fsdp_unsharded_parameters_cover_every_parameter(one_rank: Any) -> None:
    """After a forward, every sharded parameter maps to the unsharded one autograd recorded
    (on this torch's FSDPState layout), whichever of the two the module shows."""
    from torch.distributed.fsdp import fully_shard

    from fxsplit import _torch_internals as ti

    module = _stage_module()
    for block in module.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(module, reshard_after_forward=True)
    out = module(torch.randn(ph.MB_BATCH, ph.SEQ, ph.D_MODEL))
    recorded, seen, todo = set(), set(), [out.grad_fn]
    while todo:  # the parameters autograd recorded: the variables of the graph's AccumulateGrad nodes
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            recorded.add(id(node.variable))
        todo.extend(n for n, _ in node.next_functions)
    params = list(module.parameters())
    assert all(isinstance(p, DTensor) for p in params)  # resharded after forward: the sharded ones
    mapping = ti.fsdp_unsharded_parameters(module)
    assert {id(mapping.get(id(p))) for p in params} == recorded


def test_fsdp_state_param_groups_on_both_layouts() -> None:
    """torch 2.11's FSDPState holds one optional group, 2.13 on a list; an unknown layout is
    an error, not an empty mapping (which would hand B and W the sharded parameters)."""
    from types import SimpleNamespace

    from fxsplit import _torch_internals as ti

    g1, g2 = object(), object()
    assert ti._fsdp_state_param_groups(SimpleNamespace(_fsdp_param_groups=[g1, g2])) == [g1, g2]
    assert ti._fsdp_state_param_groups(SimpleNamespace(_fsdp_param_group=g1)) == [g1]
    assert ti._fsdp_state_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
    with pytest.raises(RuntimeError, match="neither _fsdp_param_groups nor _fsdp_param_group"):
        ti._fsdp_state_param_groups(SimpleNamespace())


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp_split_reaches_unsharded_parameters(one_rank: Any, reshard_after_forward: bool) -> None:
    """B and W work on FSDP2's unsharded parameters (what autograd recorded), even when
    the module shows its sharded ones; nothing reaches the sharded gradients before
    REDUCE_GRAD (``perform_reduce_grad``), which reduces them once."""
    import copy

    from torch.distributed.fsdp import fully_shard

    from fxsplit.pipelining import PipelineStage

    reference = _stage_module()
    module = copy.deepcopy(reference)
    for block in module.blocks:
        block.compile(backend=fxsplit.backend(compiler="eager", fallback="error"))
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(module, reshard_after_forward=reshard_after_forward)
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    runs = W.RegionRuns()
    xs = _one_rank_split_step(stage, module)
    for block in module.blocks:  # as the schedule's RESHARD would: the module shows its sharded parameters
        block.reshard()
    assert all(isinstance(p, DTensor) and p.grad is None for p in module.parameters())
    stage.perform_reduce_grad(1)
    for x in xs:
        reference(x.detach()).backward(torch.ones(ph.MB_BATCH, ph.SEQ, ph.D_MODEL))
    for (name, p), rp in zip(module.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # one region per block (FSDP's hooks run between them): one dI and one dW run per block
    # and microbatch, none fused
    n = len(xs) * len(module.blocks)
    assert runs.delta() == {"di_runs": n, "dw_runs": n, "fused_runs": 0}
