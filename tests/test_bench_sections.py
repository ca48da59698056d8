"""The benchmark's newer sections, without a full run: host time from
``PendingWeightGrads.timings``, microbatch accumulation, and the memory
targets' verdicts (pure functions over recorded figures)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fxsplit
from fxsplit.bench import accumulate, allocator, host_time, modes, report, timing
from fxsplit.bench.memory import memory_targets
from fxsplit.bench.models import ModelConfig, Stage
from zoo import GeluResidual


def _inductor(samples_ms: list[float]) -> dict:
    return {"timing": {"total_backward": {"samples_ms": samples_ms}}}


def test_host_time_is_total_minus_graph_time_per_repetition() -> None:
    host = [
        {"b_ns": 3_000_000, "b_graph_ns": 2_500_000, "w_ns": 2_000_000, "w_graph_ns": 1_900_000, "w_commit_ns": 50_000},
        {"b_ns": 4_000_000, "b_graph_ns": 3_000_000, "w_ns": 2_000_000, "w_graph_ns": 1_800_000, "w_commit_ns": 70_000},
    ]
    section = host_time.host_section(host, _inductor([10.0, 20.0]))
    assert section["available"] is True
    assert section["samples"]["b_host_ms"] == pytest.approx([0.5, 1.0])
    assert section["samples"]["w_host_ms"] == pytest.approx([0.1, 0.2])
    assert section["samples"]["w_commit_ms"] == pytest.approx([0.05, 0.07])
    assert section["host_fraction_of_inductor_backward"] == pytest.approx([0.06, 0.06])
    t = host_time.host_target(section)
    assert t["measured"] == pytest.approx(0.06) and t["pass"] is False and t["verdict"].startswith("MISS")


def test_host_time_added_by_the_split_subtracts_the_ordinary_backwards_host_time() -> None:
    host = [
        {"b_ns": 3_000_000, "b_graph_ns": 2_500_000, "w_ns": 2_000_000, "w_graph_ns": 1_900_000},
        {"b_ns": 4_000_000, "b_graph_ns": 3_000_000, "w_ns": 2_000_000, "w_graph_ns": 1_800_000},
    ]
    section = host_time.host_section(host, _inductor([10.0, 20.0]), [0.0004, 0.0011])
    assert section["samples"]["ordinary_host_ms"] == pytest.approx([0.4, 1.1])
    assert section["added_fraction_of_inductor_backward"] == pytest.approx([0.02, 0.005])
    t = host_time.host_added_target(section)
    assert t["measured"] == pytest.approx(0.0125) and t["pass"] is True
    # without the ordinary backward's figures the target is not measured, never guessed
    assert host_time.host_added_target(host_time.host_section(host, _inductor([10.0, 20.0]), [None, 0.001]))["verdict"] == "n/a"


def test_ordinary_backward_host_time_is_backward_minus_fused_graph_time() -> None:
    """The timed step reads the regions' fused graph time around fxsplit's ordinary backward."""
    torch.manual_seed(0)
    module = torch.compile(GeluResidual(), backend=fxsplit.backend(compiler="eager"))
    x = torch.randn(4, 8)
    stage = Stage(module, lambda: x.clone().requires_grad_(True), ModelConfig(name="mlp"), "tiny")
    grad = torch.randn(4, 8)
    mode = modes.Mode("fxsplit", "fxsplit, ordinary backward", module, None, compiled="fxsplit")
    timing.timed_step(mode, stage, grad, torch.device("cpu"))  # compile
    before = timing._fused_graph_ns()
    got: list = []
    times = timing.timed_step(mode, stage, grad, torch.device("cpu"), ordinary_host=got)
    spent = (timing._fused_graph_ns() - before) / 1e9
    assert spent > 0 and len(got) == 1 and got[0] == pytest.approx(times["backward"] - spent)


@pytest.mark.parametrize("host", [[None, None], []])
def test_host_time_without_timings_is_na(host: list) -> None:
    section = host_time.host_section(host, _inductor([1.0, 1.0]))
    assert section["available"] is False and "n/a" in section["why"]
    t = host_time.host_target(section)
    assert t["verdict"] == "n/a" and t["pass"] is None
    assert report._verdict_line("host_time", t).startswith("target n/a:")


def test_accumulation_step_accumulates_like_four_ordinary_backwards() -> None:
    """B then W per microbatch, four times, leaves the same .grad as four ordinary backward calls."""
    torch.manual_seed(0)
    model = GeluResidual()
    ref = copy.deepcopy(model)
    xs = [torch.randn(4, 8) for _ in range(accumulate.ACCUMULATE_MICROBATCHES)]
    it = iter(xs)
    stage = Stage(model, lambda: next(it).clone().requires_grad_(True), ModelConfig(name="mlp"), "tiny")
    grad = torch.randn(4, 8)
    compiled = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback="error"))
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # set to None first: this must not survive
    mode = modes.Mode("fxsplit+split", "fxsplit split", compiled, "fxsplit")
    seconds = accumulate._accumulate_step(mode, stage, grad, torch.device("cpu"))
    assert math.isfinite(seconds) and seconds > 0
    for x in xs:
        ref(x.clone().requires_grad_(True)).backward(grad)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _row(layout: str, alive: int, declared: int, live: int | None, crossing: int | None) -> dict:
    return {"layout": layout, "variant": "fxsplit", "alive_bytes": alive, "declared_bytes": declared,
            "live_in_bytes": live, "all_crossing_bytes": crossing}


def test_memory_targets_verdicts() -> None:
    section = {
        "rows": [_row("middle", 100, 100, 80, 100), _row("last", 130, 100, 80, 80), _row("first", 50, 50, None, None),
                 {**_row("middle", 10**9, 1, 1, 1), "variant": "upstream"}],  # upstream is not judged
        "flops": {"first": {"B": 0, "W": 30}, "middle": {"B": 20, "W": 10}},
    }
    t = memory_targets(section)
    assert t["alive_between_b_and_w"]["pass"] is False and t["alive_between_b_and_w"]["measured"] == pytest.approx(1.3)
    assert "worst layout: last" in t["alive_between_b_and_w"]["detail"]
    assert t["live_in_vs_all_crossing"]["pass"] is True and t["live_in_vs_all_crossing"]["measured"] == 1.0
    assert "strictly lower on: middle" in t["live_in_vs_all_crossing"]["detail"]
    assert "no compiled region split at B" in t["live_in_vs_all_crossing"]["detail"]
    assert t["first_stage_w_flops"]["pass"] is False and t["first_stage_w_flops"]["measured"] == 3.0
    section["flops"]["first"] = {"B": 20, "W": 10}
    section["rows"][1]["alive_bytes"] = 105
    t = memory_targets(section)
    assert t["first_stage_w_flops"]["pass"] is True and t["alive_between_b_and_w"]["pass"] is True
    for name, v in t.items():
        assert report._verdict_line(name, v).startswith(f"target {v['verdict']}:")


def test_region_compile_seconds_are_summed_per_kind_or_none() -> None:
    from types import SimpleNamespace

    from fxsplit.bench.compile_time import _region_seconds

    regions = [SimpleNamespace(compile_seconds={"fused": 1.0, "dI": None}),
               SimpleNamespace(compile_seconds={"fused": 0.5, "dI": 2.0, "dW": 3.0}), SimpleNamespace()]
    assert _region_seconds(regions) == {"fused": 1.5, "dI": 2.0, "dW": 3.0}
    assert _region_seconds([SimpleNamespace(), SimpleNamespace(stats={})]) is None
    assert _region_seconds([]) is None


def test_w_time_includes_freeing_the_live_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """``timings['w_ns']`` covers W up to and including the release of the live-ins
    (on CPU, freeing them can hand memory back to the OS): a clock that jumps when
    a live-in is freed shows the jump in ``w_ns`` and not in the graph time."""
    import types
    import weakref

    from fxsplit import pending as pending_mod

    torch.manual_seed(0)
    model = GeluResidual()
    compiled = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback="error"))
    params = list(model.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    out = compiled(x)
    _, work = fxsplit.stage_backward_input([out], [torch.ones_like(out)], [x], params)
    del out
    live = [v for record in work.compiled for v in record._live_ins if isinstance(v, torch.Tensor)]
    assert live, "the dW graph of this block reads live-ins"
    clock = {"ns": 0}
    jump = 10**12
    freed: list[int] = []

    def on_free() -> None:
        freed.append(1)
        clock["ns"] += jump

    for v in live:  # some live-ins are also saved by the forward; the dI-made ones die with W
        weakref.finalize(v, on_free)
    del live, v
    monkeypatch.setattr(pending_mod, "time", types.SimpleNamespace(perf_counter_ns=lambda: clock["ns"]))
    w_before = work.timings["w_ns"]
    fxsplit.stage_backward_weight(params, work)
    assert freed, "W frees the live-ins it alone holds"
    assert work.timings["w_ns"] - w_before >= jump * len(freed)
    assert work.timings["w_graph_ns"] < jump


def test_timed_step_counts_the_page_faults_of_the_backward_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault count runs from the end of the forward to the end of W: faults
    taken in the forward are not counted, those in B and W are."""
    torch.manual_seed(0)
    module = torch.compile(GeluResidual(), backend=fxsplit.backend(compiler="eager", fallback="error"))
    x = torch.randn(4, 8)
    stage = Stage(module, lambda: x.clone().requires_grad_(True), ModelConfig(name="mlp"), "tiny")
    grad = torch.randn(4, 8)
    mode = modes.Mode("fxsplit+split", "fxsplit split", module, "fxsplit", compiled="fxsplit")
    timing.timed_step(mode, stage, grad, torch.device("cpu"))  # compile
    counter = {"n": 0}
    monkeypatch.setattr(allocator, "minor_faults", lambda: counter["n"])
    forward = module.forward

    def forward_taking_faults(*args: object) -> object:
        counter["n"] += 1000  # in the forward: not counted
        return forward(*args)

    monkeypatch.setattr(module, "forward", forward_taking_faults)
    weight = fxsplit.stage_backward_weight

    def weight_taking_faults(*args: object, **kwargs: object) -> object:
        counter["n"] += 7
        return weight(*args, **kwargs)

    monkeypatch.setattr(fxsplit, "stage_backward_weight", weight_taking_faults)
    got: list = []
    timing.timed_step(mode, stage, grad, torch.device("cpu"), faults=got)
    assert got == [7]
    assert timing.fault_summary([7, 9, 8]) == {"minor_faults_backward": 8, "minor_faults_samples": [7, 9, 8]}
    assert timing.fault_summary([7, None])["minor_faults_backward"] is None


def test_malloc_retain_stops_refaulting_freed_memory() -> None:
    """In a fresh process whose glibc is first pinned to its initial mmap threshold
    (128 KiB, so that 8 MiB blocks are mapped afresh and their pages faulted in
    each time, whatever glibc's heuristics would have done in this environment),
    ``retain_freed_memory`` makes the same churn reuse the freed blocks without
    faults."""
    import subprocess
    import sys
    import textwrap

    if allocator.glibc_problem() is not None:
        pytest.skip(f"retain_freed_memory cannot run here: {allocator.glibc_problem()}")
    code = textwrap.dedent("""
        import ctypes, torch
        from fxsplit.bench import allocator
        M_MMAP_THRESHOLD = -3
        assert ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
        def faults_of_churn():
            start = allocator.minor_faults()
            for _ in range(20):
                blocks = [torch.ones(2 * 2**20) for _ in range(4)]  # 4 x 8 MiB, written
                del blocks
            return allocator.minor_faults() - start
        faults_of_churn()
        mapped = faults_of_churn()
        allocator.retain_freed_memory()
        faults_of_churn()
        print(mapped, faults_of_churn())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    mapped, retained = (int(v) for v in out.stdout.split())
    pages = 20 * 4 * 8 * 2**20 // 4096
    assert mapped > pages // 2, (mapped, retained)  # every block's pages faulted in again
    assert retained < pages // 20, (mapped, retained)
