"""fxsplit stages on torch.distributed.pipelining schedules: real 2-rank gloo runs on CPU.

One spawned world runs every schedule with the ``"eager"`` inner compiler
(:mod:`pipeline_harness` does the in-rank numerics against a non-pipelined
eager reference and records every backward action); one more world runs
ZB-V with Inductor.
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


def _skip_where_upstream_fails(schedule: str) -> None:
    why = harness.upstream_schedule_failure(schedule)
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def eager_world() -> dict[str, list[dict[str, Any]]]:
    """schedule name -> per-rank results, from one 2-rank world running all schedules."""
    per_rank = harness.run_world([harness.Case(name) for name in harness.RUNNABLE_SCHEDULES], timeout_s=240)
    by_schedule: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for rank_results in per_rank:
        for result in rank_results:
            by_schedule[result["schedule"]].append(result)
    return by_schedule


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
    n_params = sum(len(list(m.parameters())) for m in harness.build_reference(n_stages))
    assert sum(r["grads_checked"] for r in results) == n_params * harness.N_STEPS


def _check_backward_actions(schedule: str, results: list[dict[str, Any]]) -> dict[str, int]:
    """Every (stage, microbatch) got exactly one full backward or one I and one W; I/W did only
    their half (counters and FLOPs); returns counter totals over all ranks."""
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
                # first stage: nothing upstream needs an input gradient, B does no work
                assert (a["fused_runs"], a["di_runs"], a["dw_runs"], a["flops"]) == (0, 0, 0, 0), where
            elif kind == "I":
                assert (a["fused_runs"], a["di_runs"], a["dw_runs"]) == (0, 1, 0), where
                # exactly the FLOPs of an eager input-gradient-only backward: no weight-gradient matmul
                assert a["flops"] == input_only, where
            elif kind == "W" and s == 0:
                # first stage: the whole backward runs here, once (the fused compiled backward)
                assert (a["fused_runs"], a["di_runs"], a["dw_runs"]) == (1, 0, 0), where
                assert a["flops"] == full, where
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


@pytest.mark.parametrize("schedule", harness.SCHEDULES)
def test_backward_actions_split(eager_world: dict[str, list[dict[str, Any]]], schedule: str) -> None:
    _skip_where_upstream_fails(schedule)
    results = eager_world[schedule]
    totals = _check_backward_actions(schedule, results)
    n_stages = results[0]["n_stages"]
    mbs = harness.N_MICROBATCHES
    if schedule in ("Schedule1F1B", "ScheduleInterleaved1F1B"):
        assert totals == {"di_runs": 0, "dw_runs": 0, "fused_runs": n_stages * mbs}
    elif schedule in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"):
        # every non-first stage's W ran its compiled dW graph, once per microbatch
        assert totals == {"di_runs": (n_stages - 1) * mbs, "dw_runs": (n_stages - 1) * mbs, "fused_runs": mbs}
    else:  # DualPipeV mixes full backwards (overlapped with forwards) and I/W pairs
        assert totals["dw_runs"] == totals["di_runs"] > 0


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
            if a["kind"] == "W" and a["stage"] != 0:
                assert (a["dw_runs"], a["di_runs"], a["fused_runs"]) == (1, 0, 0), a
            if a["kind"] == "I" and a["stage"] != 0:
                assert (a["dw_runs"], a["di_runs"], a["fused_runs"]) == (0, 1, 0), a
    assert dict(totals) == {"di_runs": (n_stages - 1) * mbs, "dw_runs": (n_stages - 1) * mbs, "fused_runs": mbs}


def test_in_place_compile_is_not_an_optimized_module() -> None:
    # What the zero-bubble schedules check (schedules._check_torch_compile_compatibility).
    from torch._dynamo import OptimizedModule

    module = harness.StageModule(1, last=False)
    module.compile(backend="fxsplit")
    assert not any(isinstance(m, OptimizedModule) for m in module.modules())
    wrapped = torch.compile(harness.StageModule(1, last=False), backend="fxsplit")
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
