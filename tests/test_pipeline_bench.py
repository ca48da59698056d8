"""The pipeline step time: a generated schedule run for real on 2 gloo ranks, and
``fxsplit bench --pipeline``: its option errors and a ``--quick`` smoke run.

The real run goes through tests/pipeline_harness.py: every rank compares each microbatch loss
and each parameter gradient with a single-process eager reference, over two optimizer steps.
The smoke run uses ``--compiler eager`` (fxsplit's eager inner compiler, aot_eager for the
Inductor rows): it checks the harness and the JSON, not Inductor's speed.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import math
import os
import pathlib
import sys
from typing import Any

import pytest
import torch

from fxsplit import cli
from fxsplit.bench import pipeline, pipeline_report
from fxsplit.bench.pipeline_rank import CONFIGS
from fxsplit.schedules import PipelineCosts, StageCosts, generate_schedule, simulate, upstream_order
from fxsplit.schedules.orders import primitive_actions

sys.path.insert(0, os.path.dirname(__file__))
import pipeline_harness as harness  # noqa: E402

# F = I = 1, W = 2, a fused backward cheaper than I + W, a slow hand-over: the greedy defers W
# behind other work and merges some I + W pairs into B (see tests/test_schedules.py).
COSTS = PipelineCosts.uniform(4, 1, 1, 2, b=2.7, comm=0.3, activation_bytes=10, live_in_bytes=4)


def _generated(placement: str) -> Any:
    return generate_schedule(COSTS, 2, harness.N_MICROBATCHES, placements=(placement,), memory_limit=40,
                             include_upstream=False)


def test_generated_schedule_runs_on_two_ranks() -> None:
    """Three generated schedules (V, interleaved and contiguous placement, the greedy's own orders) run by
    upstream's _PipelineScheduleRuntime over fxsplit stages: losses and gradients match the
    reference (checked in-rank), and every stage and microbatch ran B or I then W as ordered."""
    if harness.upstream_schedule_failure("ScheduleZBVZeroBubble") is not None:
        pytest.skip(harness.upstream_schedule_failure("ScheduleZBVZeroBubble"))
    gens = {p: _generated(p) for p in ("v", "interleaved", "contiguous")}
    for gen in gens.values():
        assert gen.source.startswith("greedy(")
    kinds = {p: collections.Counter(k for acts in g.order.values() for a in acts if a for _, k, _ in primitive_actions(a))
             for p, g in gens.items()}
    assert kinds["v"]["B"] > 0 and kinds["v"]["I"] > 0 and kinds["v"]["W"] == kinds["v"]["I"]
    cases = [harness.Case("generated", generated=gen) for gen in gens.values()]
    per_rank = harness.run_world(cases, timeout_s=300)
    for k, (placement, gen) in enumerate(gens.items()):
        results = [per_rank[r][k] for r in range(2)]
        assert sorted(s for r in results for s in r["stages"]) == [0, 1, 2, 3]
        for r, res in enumerate(results):
            assert res["stages"] == gen.stages_of(r)
        (last,) = [r for r in results if 3 in r["stages"]]
        assert len(last["losses"]) == harness.N_STEPS and last["losses"][0] != last["losses"][1]
        n_params = sum(len(list(m.parameters())) for m in harness.build_reference(4))
        assert sum(r["grads_checked"] for r in results) == n_params * harness.N_STEPS
        ran = collections.defaultdict(list)
        for res in results:
            for a in res["actions"]:
                ran[(a["stage"], a["mb"])].append(a["kind"])
        ordered = collections.defaultdict(list)
        for acts in gen.order.values():
            for stage, kind, mb in (p for a in acts if a is not None for p in primitive_actions(a)):
                if kind in "IWB":
                    ordered[(stage, mb)].append(kind)
        assert {k: sorted(v) for k, v in ran.items()} == {k: sorted(v) for k, v in ordered.items()}, placement


# -- fxsplit bench --pipeline: options ---------------------------------------------------------
@pytest.fixture
def _nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark started although an option was bad")

    monkeypatch.setattr(pipeline, "run", refuse)


@pytest.mark.usefixtures("_nothing_runs")
@pytest.mark.parametrize(("argv", "names"), [
    (["--ranks", "1"], "--ranks must be at least 2"),
    (["--ranks", "0"], "--ranks must be at least 1"),
    (["--microbatches", "3"], "--microbatches 3: needs at least 4"),
    (["--ranks", "4", "--microbatches", "10"], "a multiple of --ranks 4"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--warmup", "0"], "--warmup must be at least 1"),
    (["--device", "tpu"], "--device 'tpu' is not a device"),
    (["--device", "cuda:1"], "each rank takes its own GPU"),
    (["--model", "resnet"], "--model"),
    (["--dim", "30"], "dim (30) must be a multiple of heads (4)"),
    (["--compiler", "tvm"], "--compiler"),
    (["--embedding"], "unrecognized arguments: --embedding"),
])
def test_bad_option_is_one_line_error(argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--pipeline", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("fxsplit bench --pipeline: error: ") and names in line, line


@pytest.mark.usefixtures("_nothing_runs")
def test_quick_never_overwrites_a_full_run(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "full.json"
    full.write_text(json.dumps({"settings": {"quick": False}, "rows": []}))
    with pytest.raises(SystemExit):
        cli.main(["bench", "--pipeline", "--quick", "--out", str(full)])
    assert "holds the results of a full run" in capsys.readouterr().err
    assert json.loads(full.read_text()) == {"settings": {"quick": False}, "rows": []}


@pytest.mark.usefixtures("_nothing_runs")
def test_a_torch_whose_v_schedules_fail_on_gloo_is_one_line_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """torch 2.11 (upstream's V-shaped schedules fail with gloo before any backward): the CPU
    run is refused in one line, after every option was checked."""
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--pipeline", "--device", "cpu", "--dim", "30"])
    (line,) = capsys.readouterr().err.splitlines()
    assert exc.value.code == 2 and "dim (30)" in line, line  # the bad option first
    with pytest.raises(SystemExit):
        cli.main(["bench", "--pipeline", "--device", "cpu", "--quick"])
    (line,) = capsys.readouterr().err.splitlines()
    assert "torch 2.11.0: upstream's V-shaped schedules fail with gloo" in line, line


def test_default_files() -> None:
    from fxsplit.cli_pipeline import default_out_path

    cpu = torch.device("cpu")
    full, quick = default_out_path(cpu, "gpt", False), default_out_path(cpu, "gpt", True)
    assert full.name.endswith("-pipeline.json") and full.name.startswith("cpu-")
    assert quick.name == full.stem + "-quick.json" and quick.parent == full.parent
    assert default_out_path(cpu, "llama", True).name == full.stem + "-llama-quick.json"


# -- fxsplit bench --pipeline --quick ----------------------------------------------------------
def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, pathlib.Path]:
    why = harness.upstream_schedule_failure("ScheduleZBVZeroBubble")
    if why is not None:  # the benchmark refuses such a torch (tested above)
        pytest.skip(why)
    out = tmp_path_factory.mktemp("pipeline") / "quick.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = cli.main(["bench", "--pipeline", "--quick", "--compiler", "eager", "--reps", "2", "--out", str(out),
                       "--no-chart"])
    assert rc == 0
    assert not out.with_suffix(".png").exists()
    return json.loads(out.read_text()), stdout.getvalue() + stderr.getvalue(), out


def test_quick_json(quick_run: tuple[dict[str, Any], str, pathlib.Path]) -> None:
    r, _, _ = quick_run
    assert r["device"]["type"] == "cpu" and r["device"]["name"] and r["device"]["ranks"] == 2
    assert r["dtype"] == "float32" and r["torch_version"] == torch.__version__
    assert r["settings"]["quick"] is True and r["settings"]["compiler"] == "eager"
    assert [(row["schedule"], row["backend"]) for row in r["rows"]] == [(c.schedule, c.backend) for c in CONFIGS]
    for row in r["rows"]:
        for field in ("step_ms", "step_iqr_ms", "bubble", "peak_bytes", "simulated_step_ms"):
            assert _finite(row[field]), (row["key"], field)
        assert row["step_ms"] > 0 and row["simulated_step_ms"] > 0 and 0 <= row["bubble"] < 1
        assert len(row["step_samples_ms"]) == 2 and len(row["bubble_per_rank"]) == 2
        runs = row["region_runs"]
        if row["backend"] != "fxsplit":
            assert runs == {"di_runs": 0, "dw_runs": 0, "fused_runs": 0}, row["key"]
        else:  # every I ran a dI graph and every W a dW graph; B (DualPipeV, a merged pair) the fused one
            assert runs["di_runs"] == runs["dw_runs"], row["key"]
            assert runs["di_runs"] > 0 or row["schedule"] == "generated", row["key"]  # it may choose all B
            assert runs["di_runs"] + runs["fused_runs"] == 2 * 4 * 4, row["key"]  # steps x stages x microbatches
    assert r["ratios"][r["reference"]]["median"] == 1.0
    assert [c["stage"] for c in r["costs"]] == [0, 1, 2, 3]
    for c in r["costs"]:
        for field in ("f_ms", "b_ms", "w_ms", "full_backward_ms", "comm_ms"):
            assert _finite(c[field]) and c[field] > 0, (c, field)
        assert c["activation_bytes"] > 0 and c["live_in_bytes"] > 0
    g = r["generated"]
    assert sorted(g["stage_to_rank"]) == [0, 0, 1, 1] and g["candidates"]
    # every row's simulated step is one replay of one cost table, the generator's: the generated row is
    # never slower than an upstream row within its memory limit
    probe = PipelineCosts(tuple(StageCosts(**c) for c in g["probe_costs"]))
    mbs = r["settings"]["microbatches"]
    generated_row = next(row for row in r["rows"] if row["schedule"] == "generated")
    assert generated_row["simulated_step_ms"] == pytest.approx(g["simulated_step_ms_at_generation"])
    for row in r["rows"]:
        if row["schedule"] == "generated":
            continue
        replay = simulate(upstream_order(row["schedule"], 2, mbs, lowered=True, stages_per_rank=2), probe)
        assert row["simulated_step_ms"] == pytest.approx(replay.step_time), row["key"]
        assert row["over_memory_limit"] == (max(replay.peak_bytes) > g["memory_limit_bytes"]), row["key"]
        if not row["over_memory_limit"]:
            assert generated_row["simulated_step_ms"] <= row["simulated_step_ms"] + 1e-9, row["key"]
    for row in r["scaling"]["rows"]:
        same = [x for x in r["scaling"]["rows"] if x["stages"] == row["stages"]
                and x["microbatches"] == row["microbatches"] and x["schedule"] == "generated"]
        if row["step_ms"] is not None and not row["over_memory_limit"]:
            assert same[0]["step_ms"] <= row["step_ms"] + 1e-9, row
    assert r["scaling"]["rows"] and {row["stages"] for row in r["scaling"]["rows"]} == {8}
    assert all(_finite(row["step_ms"]) for row in r["scaling"]["rows"])
    assert set(r["timeline"]) == {c.key for c in CONFIGS}


def test_quick_prints_progress_and_tables(quick_run: tuple[dict[str, Any], str, pathlib.Path]) -> None:
    _, text, out = quick_run
    assert "[fxsplit bench] spawning 2 ranks (gloo)" in text
    assert "SIMULATED from the measured costs" in text and f"wrote {out}" in text
    assert "generated schedule: " + quick_run[0]["generated"]["summary"] in text


def test_charts(quick_run: tuple[dict[str, Any], str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    written = pipeline_report.draw_charts(quick_run[0], tmp_path / "chart.png")
    assert [p.name for p in written] == ["chart.png", "chart-timeline.png"]
    assert all(p.stat().st_size > 0 for p in written)


def test_benchmark_page_lists_every_pipeline_option() -> None:
    from fxsplit.cli_pipeline import build_pipeline_parser

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmark.md").read_text()
    section = page[page.index("## Pipeline step time"):]
    options = [s for a in build_pipeline_parser()._actions for s in a.option_strings
               if s.startswith("--") and s != "--help"]
    assert [o for o in options if f"`{o}" not in section] == []
