"""Expert parallelism x pipeline parallelism: a 2 x 2 (``pp`` x ``ep``) mesh on CPU
with gloo, MoE stages whose tokens reach their experts through torchtitan's all-to-all token
dispatcher, compiled in place with fxsplit (``fallback="error"``) and driven by upstream's
zero-bubble schedules for two steps (``tests/ep_harness.py`` has the setup).

In-rank (each rank raises on a mismatch): every microbatch loss and every gradient against a
single-process run with all experts local. Checked here, on what the ranks report for the last
step: the all-to-alls each action issued (three per forward, two per I, none in W), the expert
weight-gradient matmuls (none in I, all in W), no fallback, and the routing that starves an
expert.
"""

from __future__ import annotations

from typing import Any

import pytest

import ep_harness as eh
import pipeline_harness as ph

CASES = [
    eh.EPCase("ScheduleZBVZeroBubble", "loop"),
    eh.EPCase("ScheduleZBVZeroBubble", "grouped_mm"),
    eh.EPCase("ScheduleInterleavedZeroBubble", "loop"),
    eh.EPCase("ScheduleDualPipeV", "grouped_mm"),
    eh.EPCase("ScheduleZBVZeroBubble", "grouped_mm", compiler="inductor"),
]
RUNNABLE = [c for c in CASES if ph.upstream_schedule_failure(c.schedule) is None]


@pytest.fixture(scope="module")
def ep_world() -> dict[str, list[dict[str, Any]]]:
    """case name -> every rank's results, from one 4-rank world running every case."""
    if not RUNNABLE:
        pytest.skip(ph.upstream_schedule_failure(CASES[0].schedule) or "no runnable schedule")
    per_rank = ph.run_world(RUNNABLE, world=eh.WORLD, timeout_s=900, runner=eh.run_ep_case)
    by_case: dict[str, list[dict[str, Any]]] = {}
    for rank_results in per_rank:
        for r in rank_results:
            by_case.setdefault(r["case"], []).append(r)
    return by_case


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ep_stage_matches_single_process_and_splits_per_phase(case: eh.EPCase,
                                                              ep_world: dict[str, list[dict[str, Any]]]) -> None:
    why = ph.upstream_schedule_failure(case.schedule)
    if why is not None:
        pytest.skip(why)
    results = ep_world[case.name]
    assert len(results) == eh.WORLD
    for r in results:
        where = f"{case.name} rank {r['rank']}"
        # losses and gradients were compared in-rank (an assertion there fails the world)
        assert r["grads_checked"] == len(r["stages"]) * 5 * eh.N_STEPS, where
        if eh.N_STAGES - 1 in r["stages"]:
            assert len(r["losses"]) == eh.N_STEPS and all(len(x) == eh.N_MICROBATCHES for x in r["losses"]), where
        assert not r["fallbacks"], f"{where}: {r['fallbacks']}"
        # a stage is several compiled regions between .tolist() graph breaks, each split
        assert r["graph_breaks"] > 0 and r["regions"] >= len(r["stages"]) * 2, where
        kinds = {a["kind"] for a in r["actions"]}
        assert "W" in kinds or case.schedule == "ScheduleDualPipeV", where
        for a in r["actions"]:
            label = f"{where} stage {a['stage']} {a['kind']}{a['mb']}"
            assert a["forward_collectives"] == {"alltoall_base_": 3}, label  # counts, tokens, results
            if a["kind"] == "I":
                assert a["collectives"] == {"alltoall_base_": 2}, label  # the two token all-to-alls' backward
                assert a["expert_weight_matmuls"] == 0, f"{label}: expert weight-gradient matmuls in I"
                assert a["di_runs"] > 0 and a["dw_runs"] == 0, label
            elif a["kind"] == "W":
                assert a["collectives"] == {}, f"{label}: W issued {a['collectives']}"
                assert a["expert_weight_matmuls"] > 0 and a["di_runs"] == 0 and a["dw_runs"] > 0, label
            else:  # a full backward (DualPipeV runs some): both, ordinary backward's work
                assert a["collectives"] == {"alltoall_base_": 2}, label
    # ep rank 1's starved microbatch: no token picks expert STARVED in the first stage (both steps)
    routing = results[0]["first_stage_routing_ep1"]
    assert all(step[eh.STARVED_MB][eh.STARVED] == 0 for step in routing), routing
    assert any(len({tuple(mb) for mb in step}) > 1 for step in routing), "routings do not differ per microbatch"
