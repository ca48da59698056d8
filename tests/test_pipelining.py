"""fxsplit stages on torch.distributed.pipelining schedules: real 2-rank gloo runs on CPU.

One spawned world runs every schedule with the ``"eager"`` inner compiler on
the ``"float"`` layout, and the zero-bubble schedules on the ``"lm"`` layout
(token ids through an eager embedding on stage 0, an eager head and
cross-entropy over the last stage's compiled body); :mod:`pipeline_harness`
does the in-rank numerics against a non-pipelined eager reference and records
every backward action. One more world runs ZB-V with Inductor.

Every stage's ``I`` runs its compiled dI graph and ``W`` its dW graph, stage 0
included (upstream's stage skips stage 0's ``I`` and runs a full backward at
its ``W``; fxsplit's balances it): ``W`` does exactly the weight-gradient
matmuls, ``I`` the rest of ordinary backward.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

import pytest
import torch

import fxsplit

sys.path.insert(0, os.path.dirname(__file__))
import pipeline_harness as harness  # noqa: E402

ZERO_BUBBLE = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
LM_SCHEDULES = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")
FN_SCHEDULES = ("ScheduleZBVZeroBubble",)
TOKENS = harness.MB_BATCH * harness.SEQ


def _skip_where_upstream_fails(schedule: str) -> None:
    why = harness.upstream_schedule_failure(schedule)
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def eager_world() -> dict[str, list[dict[str, Any]]]:
    """case key (schedule name, or ``"<schedule>:lm"``) -> per-rank results, from one
    2-rank world running every case this torch can run."""
    cases = [harness.Case(name) for name in harness.RUNNABLE_SCHEDULES]
    cases += [harness.Case(name, layout="lm") for name in LM_SCHEDULES if name in harness.RUNNABLE_SCHEDULES]
    cases += [harness.Case(name, layout="fn") for name in FN_SCHEDULES if name in harness.RUNNABLE_SCHEDULES]
    per_rank = harness.run_world(cases, timeout_s=300)
    by_key: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for rank_results in per_rank:
        for result in rank_results:
            by_key[result["key"]].append(result)
    return by_key


def _check_losses_and_grads(results: list[dict[str, Any]]) -> None:
    # Numerics were compared in-rank (assert_close per microbatch loss and per .grad,
    # a mismatch fails the world); here: that every stage and step was compared.
    n_stages = results[0]["n_stages"]
    held = sorted(s for r in results for s in r["stages"])
    assert held == list(range(n_stages))
    last = [r for r in results if n_stages - 1 in r["stages"]]
    assert len(last) == 1
    assert len(last[0]["losses"]) == harness.N_STEPS
    assert all(len(step) == harness.N_MICROBATCHES for step in last[0]["losses"])
    assert last[0]["losses"][0] != last[0]["losses"][1], "the optimizer step between steps had no effect"
    layout = results[0].get("layout", "float")  # test_data_parallel's results carry none
    n_params = sum(len(list(m.parameters())) for m in harness.build_reference(n_stages, layout))
    assert sum(r["grads_checked"] for r in results) == n_params * harness.N_STEPS


def first_stage_w_flops(result: dict[str, Any]) -> int:
    """What stage 0's W computes: the weight-gradient matmuls, and in the "float"
    layout (a float input needing no gradient, straight into a compiled block) also
    the first qkv projection's dX, which only ln1's weight gradient needs: the
    first-stage split puts work that only weights need in W."""
    extra = 2 * TOKENS * harness.D_MODEL * 3 * harness.D_MODEL if result["layout"] == "float" else 0
    return result["weight_grad_flops"][0] + extra


def _check_backward_actions(schedule: str, results: list[dict[str, Any]]) -> dict[str, int]:
    """Every (stage, microbatch) got exactly one full backward or one I and one W; I/W did only
    their half (counters and FLOPs), on stage 0 as on every other; returns counter totals over
    all ranks."""
    n_stages = results[0]["n_stages"]
    seen: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
    totals = collections.Counter()
    for r in results:
        for a in r["actions"]:
            s, kind = a["stage"], a["kind"]
            seen[(s, a["mb"])].append(kind)
            totals.update({k: a[k] for k in ("di_runs", "dw_runs", "fused_runs")})
            input_only, full = r["reference_flops"][s]
            where = f"{schedule}: stage {s} {kind}{a['mb']}: {a}"
            if kind == "B":
                assert (a["fused_runs"], a["di_runs"], a["dw_runs"]) == (1, 0, 0), where
                assert a["flops"] == full, where
            elif kind == "I" and s == 0:
                # first stage: the activation-gradient chain (dI graph), everything but W's part
                assert (a["fused_runs"], a["di_runs"], a["dw_runs"]) == (0, 1, 0), where
                assert a["flops"] == full - first_stage_w_flops(r) > 0, where
            elif kind == "I":
                assert (a["fused_runs"], a["di_runs"], a["dw_runs"]) == (0, 1, 0), where
                # exactly the FLOPs of an eager input-gradient-only backward: no weight-gradient matmul
                assert a["flops"] == input_only, where
            elif kind == "W" and s == 0:
                # first stage: the dW graph only (and an eager embedding's backward, no FLOPs)
                assert (a["fused_runs"], a["di_runs"], a["dw_runs"]) == (0, 0, 1), where
                assert a["flops"] == first_stage_w_flops(r), where
            elif kind == "W":
                assert (a["fused_runs"], a["di_runs"], a["dw_runs"]) == (0, 0, 1), where
                assert a["flops"] == r["weight_grad_flops"][s] == full - input_only, where
            else:
                raise AssertionError(f"unexpected action {where}")
    expected_keys = {(s, mb) for s in range(n_stages) for mb in range(harness.N_MICROBATCHES)}
    assert set(seen) == expected_keys
    for key, kinds in seen.items():
        assert sorted(kinds) in (["B"], ["I", "W"]), f"{schedule}: stage/microbatch {key} ran {kinds}"
    return dict(totals)


@pytest.mark.parametrize("schedule", harness.SCHEDULES)
def test_schedule_matches_reference(eager_world: dict[str, list[dict[str, Any]]], schedule: str) -> None:
    _skip_where_upstream_fails(schedule)
    _check_losses_and_grads(eager_world[schedule])


@pytest.mark.parametrize("key", [f"{s}:lm" for s in LM_SCHEDULES])
def test_lm_layout_matches_reference(eager_world: dict[str, list[dict[str, Any]]], key: str) -> None:
    _skip_where_upstream_fails(key.split(":")[0])
    _check_losses_and_grads(eager_world[key])


def _check_totals(schedule: str, results: list[dict[str, Any]]) -> None:
    totals = _check_backward_actions(schedule, results)
    n_stages = results[0]["n_stages"]
    mbs = harness.N_MICROBATCHES
    if schedule in ("Schedule1F1B", "ScheduleInterleaved1F1B"):
        assert totals == {"di_runs": 0, "dw_runs": 0, "fused_runs": n_stages * mbs}
    elif schedule in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"):
        # every stage, the first included, ran its dI graph at I and its dW graph at W, once per microbatch
        assert totals == {"di_runs": n_stages * mbs, "dw_runs": n_stages * mbs, "fused_runs": 0}
    else:  # DualPipeV mixes full backwards (overlapped with forwards) and I/W pairs
        assert totals["dw_runs"] == totals["di_runs"] > 0


@pytest.mark.parametrize("schedule", harness.SCHEDULES)
def test_backward_actions_split(eager_world: dict[str, list[dict[str, Any]]], schedule: str) -> None:
    _skip_where_upstream_fails(schedule)
    _check_totals(schedule, eager_world[schedule])


@pytest.mark.parametrize("schedule", LM_SCHEDULES)
def test_lm_layout_backward_actions_split(eager_world: dict[str, list[dict[str, Any]]], schedule: str) -> None:
    """Stage 0 (token ids through an eager embedding): I runs the body's dI graph, whose
    input gradient W hands to the embedding's backward; the last stage (eager head and
    cross-entropy over the compiled body): I the head's input gradient and the dI graph,
    W the head's weight gradient and the dW graph."""
    _skip_where_upstream_fails(schedule)
    results = eager_world[f"{schedule}:lm"]
    assert {r["layout"] for r in results} == {"lm"}
    _check_totals(schedule, results)


def test_zbv_with_inductor() -> None:
    _skip_where_upstream_fails("ScheduleZBVZeroBubble")
    (rank0, rank1) = (r[0] for r in harness.run_world([harness.Case("ScheduleZBVZeroBubble", compiler="inductor")],
                                                      timeout_s=300))
    results = [rank0, rank1]
    _check_losses_and_grads(results)
    n_stages, mbs = rank0["n_stages"], harness.N_MICROBATCHES
    totals = collections.Counter()
    for r in results:
        for a in r["actions"]:
            totals.update({k: a[k] for k in ("di_runs", "dw_runs", "fused_runs")})
            if a["kind"] == "W":
                assert (a["dw_runs"], a["di_runs"], a["fused_runs"]) == (1, 0, 0), a
            if a["kind"] == "I":
                assert (a["dw_runs"], a["di_runs"], a["fused_runs"]) == (0, 1, 0), a
    assert dict(totals) == {"di_runs": n_stages * mbs, "dw_runs": n_stages * mbs, "fused_runs": 0}


def test_in_place_compile_is_not_an_optimized_module() -> None:
    # What the zero-bubble schedules check (schedules._check_torch_compile_compatibility).
    from torch._dynamo import OptimizedModule

    module = harness.stage_module(1, last=False)
    module.compile(backend="fxsplit")
    assert not any(isinstance(m, OptimizedModule) for m in module.modules())
    wrapped = torch.compile(harness.stage_module(1, last=False), backend="fxsplit")
    assert any(isinstance(m, OptimizedModule) for m in wrapped.modules())


def test_dw_builder_is_refused() -> None:
    from fxsplit.pipelining import PipelineStage

    with pytest.raises(ValueError, match="dw_builder"):
        PipelineStage(torch.nn.Linear(2, 2), 0, 2, torch.device("cpu"), dw_builder=lambda: (lambda: None))


def test_dw_builder_is_refused_positionally() -> None:
    import inspect

    from torch.distributed.pipelining.stage import PipelineStage as UpstreamStage

    from fxsplit.pipelining import PipelineStage

    # dw_builder's position differs between releases (torch 2.11 has no output_grads/input_grads)
    names = list(inspect.signature(UpstreamStage.__init__).parameters)[2:]  # after self, submodule
    args: list[object] = [0, 2, torch.device("cpu")]
    args += [None] * (names.index("dw_builder") - len(args)) + [lambda: (lambda: None)]
    with pytest.raises(ValueError, match="dw_builder"):
        PipelineStage(torch.nn.Linear(2, 2), *args)


def test_builtin_module_compiled_in_place_is_reported() -> None:
    """nn.Sequential(...).compile() stays eager (Dynamo skips torch.nn root frames): the stage says so."""
    from fxsplit.pipelining import _builtin_modules_compiled_in_place

    seq = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert _builtin_modules_compiled_in_place(seq) == []
    seq.compile(backend=fxsplit.backend(compiler="eager"))
    assert _builtin_modules_compiled_in_place(seq) == ["Sequential"]


@pytest.mark.parametrize("schedule", FN_SCHEDULES)
def test_custom_functions_run_once_per_microbatch(eager_world: dict[str, list[dict[str, Any]]], schedule: str) -> None:
    """Uncompiled stages of custom autograd Functions (each computes its input and
    weight gradients in one call): losses and gradients equal the single-process
    run (checked in-rank), and per stage and microbatch I and W together do exactly
    the FLOPs of one ordinary backward of the stage: no Function runs twice."""
    _skip_where_upstream_fails(schedule)
    results = eager_world[f"{schedule}:fn"]
    _check_losses_and_grads(results)
    for r in results:
        flops: dict[tuple[int, int], int] = collections.Counter()
        for a in r["actions"]:
            assert a["kind"] in ("I", "W"), a
            flops[(a["stage"], a["mb"])] += a["flops"]
        for (s, mb), total in flops.items():
            full = r["reference_flops"][s][1]
            assert total == full > 0, f"stage {s} microbatch {mb}: I + W = {total} FLOPs, ordinary backward {full}"
        assert {s for s, _ in flops} == set(r["stages"])
