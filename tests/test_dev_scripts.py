"""The developer scripts docs/benchmark.md quotes figures from run and report what they say."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import fxsplit.api

from benchmarks import direct_b, graph_times, host_overhead, kernel_profile, paired, stage_shapes


@pytest.mark.inductor
def test_kernel_profile_reports_both_backwards(capsys: pytest.CaptureFixture[str]) -> None:
    result = kernel_profile.main(["--model", "mlp", "--steps", "1", "--warmup", "1", "--rows", "3"])
    out = capsys.readouterr().out
    assert result["fused_ms"] > 0 and result["split_ms"] > 0
    assert "total self CPU ms per step" in out and "1 profiled steps" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "[input shapes]" in line)
    total = next(i for i, line in enumerate(lines) if line.startswith("total self CPU ms"))
    assert total - header - 1 == 3  # --rows


def test_kernel_profile_refuses_zero_steps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        kernel_profile.main(["--steps", "0"])
    assert e.value.code == 2 and "--steps must be at least 1" in capsys.readouterr().err


@pytest.mark.inductor
def test_graph_times_reports_graphs_in_place_and_isolated(capsys: pytest.CaptureFixture[str]) -> None:
    result = graph_times.main(["--model", "mlp", "--reps", "2", "--warmup", "1", "--isolate"])
    out = capsys.readouterr().out
    for key in ("ordinary_ms", "split_ms", "ordinary_graphs_ms", "split_graphs_ms", "isolated_fused_ms",
                "isolated_split_ms"):
        assert result[key] > 0, key
    # the graphs run inside the calls that contain them
    assert result["ordinary_graphs_ms"] < result["ordinary_ms"] and result["split_graphs_ms"] < result["split_ms"]
    assert "in place, B + W" in out and "isolated (graphs called directly, 2 repetitions)" in out
    # one row per matmul shape: its time in the fused graph, in dI and in dW ('-' where it does not occur)
    rows = [line.strip().split("   ")[0].split(" / ") for line in out.splitlines() if line.startswith("    ")]
    assert rows and all(len(r) == 3 for r in rows)


def test_graph_times_refuses_zero_reps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        graph_times.main(["--reps", "0"])
    assert e.value.code == 2 and "--reps must be at least 1" in capsys.readouterr().err


def test_host_overhead_reports_time_outside_and_inside_the_graphs(capsys: pytest.CaptureFixture[str]) -> None:
    result = host_overhead.main(["--reps", "2", "--compiler", "eager"])
    out = capsys.readouterr().out
    assert set(result) == {"outside_graphs_ratio", "graphs_ratio", "backward_ratio"}
    assert all(v > 0 for v in result.values()), result
    assert "host time outside the graphs" in out and "time inside the graphs" in out and "2 rounds" in out


def test_host_overhead_counts_the_lines_of_python_around_the_graphs(capsys: pytest.CaptureFixture[str]) -> None:
    result = host_overhead.main(["--reps", "1", "--compiler", "eager", "--lines"])
    out = capsys.readouterr().out
    for kind in ("fused", "b", "w"):
        total, distinct = result[f"{kind}_lines"], result[f"{kind}_distinct_lines"]
        assert 0 < distinct <= total, (kind, result)
    assert "lines of Python outside the graphs" in out
    # The graphs' own code is not counted: an FX graph module's generated forward (the eager
    # compiler's graphs here) and the modules Inductor writes into its cache; everything else is.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    generated = host_overhead._graph_code()
    assert generated("<eval_with_key>.7") and generated(os.path.join(cache_dir(), "ab", "cabcdef.py"))
    assert not generated(fxsplit.api.__file__) and not generated(torch.autograd.graph.__file__)


def test_host_overhead_with_an_unused_parameter_runs_as_many_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """A parameter the stage never uses, given to B and W with the others,
    keeps B on its one-walk plan and W on its one-region path: about as many
    lines of Python as without it (3.6x as many in B, 2x in W, before
    3623782 and 9b5e14c). Line counts, not times: they do not move with the machine."""
    plain = host_overhead.main(["--reps", "1", "--compiler", "eager", "--lines"])
    unused = host_overhead.main(["--reps", "1", "--compiler", "eager", "--lines", "--unused-parameter"])
    assert "tiny + an unused parameter" in capsys.readouterr().out
    for kind in ("b", "w"):
        assert unused[f"{kind}_lines"] <= 1.1 * plain[f"{kind}_lines"], (kind, plain, unused)


def test_host_overhead_refuses_zero_reps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        host_overhead.main(["--reps", "0"])
    assert e.value.code == 2 and "--reps and --threads must be at least 1" in capsys.readouterr().err


def test_paired_measures_a_variant_against_the_code_as_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A variant that makes W's dW call 3 ms slower shows as W's difference,
    and nothing of it in B's; the code is restored afterwards."""
    import fxsplit.runtime as rt

    real = rt.CompiledSplitBackward.run_dw
    variant = tmp_path / "slower_w.py"
    variant.write_text(
        "import time\n"
        "import fxsplit.runtime as rt\n"
        "real = rt.CompiledSplitBackward.run_dw\n"
        "def run_dw(self, *args, **kwargs):\n"
        "    time.sleep(0.003)\n"
        "    return real(self, *args, **kwargs)\n"
        "PATCHES = {'fxsplit.runtime:CompiledSplitBackward.run_dw': run_dw}\n"
    )
    result = paired.main([str(variant), "--reps", "10", "--compiler", "eager"])
    assert rt.CompiledSplitBackward.run_dw is real
    assert result["w_difference_us"] < -2000, result  # as-is minus variant: the variant is slower
    assert abs(result["b_difference_us"]) < 1000, result
    assert "W outside the graphs" in capsys.readouterr().out


def test_paired_accumulate_measures_w_adding_into_grad(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With ``--accumulate`` W adds into the kept ``.grad`` (the dW graph that
    accumulates runs, and a variant slowing it shows as W's difference);
    without it, that graph never runs (counted by the variant, not timed)."""
    variant = tmp_path / "slower_accumulating_w.py"
    runs = tmp_path / "accumulating_runs.txt"
    variant.write_text(
        "import time\n"
        "import fxsplit.runtime as rt\n"
        "real = rt.CompiledSplitBackward.run_dw\n"
        "def run_dw(self, live_ins, timings=None, slot=None, graph=None, positions=()):\n"
        "    if graph is not None:  # the dW graph that accumulates into .grad\n"
        f"        open({str(runs)!r}, 'a').write('run\\n')\n"
        "        time.sleep(0.003)\n"
        "    return real(self, live_ins, timings, slot, graph, positions)\n"
        "PATCHES = {'fxsplit.runtime:CompiledSplitBackward.run_dw': run_dw}\n"
    )
    result = paired.main([str(variant), "--reps", "8", "--compiler", "eager", "--accumulate"])
    assert result["w_difference_us"] < -2000, result
    assert ".grad kept (W accumulates)" in capsys.readouterr().out
    assert runs.exists() and runs.read_text().count("run") >= 8
    runs.unlink()
    paired.main([str(variant), "--reps", "8", "--compiler", "eager"])
    assert not runs.exists(), "without --accumulate the accumulating dW graph ran"


def test_paired_refuses_a_variant_without_patches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(SystemExit) as e:
        paired.main([str(empty)])
    assert e.value.code == 2 and "defines no PATCHES" in capsys.readouterr().err
    wrong = tmp_path / "wrong.py"
    wrong.write_text("PATCHES = {'fxsplit.runtime:NoSuchThing.run': None}\n")
    with pytest.raises(SystemExit) as e:
        paired.main([str(wrong)])
    assert e.value.code == 2 and "NoSuchThing" in capsys.readouterr().err


def test_direct_b_measures_both_ways_and_finds_them_bitwise_equal(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "direct_b.json"
    result = direct_b.main(["--device", "cpu", "--config", "tiny", "--reps", "1", "--compiler", "eager",
                            "--out", str(out_file)])
    assert result["gradients_bitwise_engine_vs_direct"] == {"fxsplit": True, "fxsplit-ro": True}
    assert set(result["rows"]) == {"inductor", "inductor-ro", "fxsplit engine", "fxsplit direct",
                                   "fxsplit-ro engine", "fxsplit-ro direct"}
    assert all(r["backward_ms"]["median"] > 0 for r in result["rows"].values())
    assert out_file.exists() and "fxsplit direct" in capsys.readouterr().out


def test_direct_b_refuses_zero_reps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        direct_b.main(["--reps", "0"])
    assert e.value.code == 2 and "--reps must be at least 1" in capsys.readouterr().err


def test_stage_shapes_finds_no_shape_off_b_fast_paths(capsys: pytest.CaptureFixture[str]) -> None:
    """An unused parameter, a frozen one and a first stage each cost B about
    as many lines of Python as the plain block (before this session's
    changes: 1.9x for the unused and the first stage), and the direct call is
    taken on each (a first stage's too). Line counts, not times."""
    result = stage_shapes.main(["--compiler", "eager", "--shapes", "base,unused,frozen,first_stage"])
    out = capsys.readouterr().out
    assert all(f"  {s} " in out for s in ("base", "unused", "frozen", "first_stage"))
    base = result["base"]["b_lines"]
    for shape in ("unused", "frozen", "first_stage"):
        assert result[shape]["b_lines"] <= 1.1 * base, (shape, result)
    runs = stage_shapes.WARM_UP + 1  # every microbatch's B, the counted one included
    assert [result[s]["direct_b_runs"] for s in ("base", "unused", "frozen", "first_stage")] == [runs] * 4
    for s in ("base", "unused", "frozen", "first_stage"):  # B + W against one ordinary backward, both counted
        assert result[s]["ordinary_lines"] > 0
        assert result[s]["b_plus_w_over_ordinary"] == round(
            (result[s]["b_lines"] + result[s]["w_lines"]) / result[s]["ordinary_lines"], 3)


def test_stage_shapes_counts_transformers_layers(capsys: pytest.CaptureFixture[str]) -> None:
    """Code fxsplit did not write: two Mistral decoder layers as a middle
    stage, ``.grad`` empty and accumulating, each against one ordinary
    backward through the same region (warmed up alike)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    result = stage_shapes.main(["--compiler", "eager", "--shapes", "none", "--transformers", "mistral"])
    assert set(result) == {"transformers:mistral", "transformers:mistral:accumulating"}
    assert "transformers:mistral:accumulating" in capsys.readouterr().out
    for r in result.values():
        assert r["b_lines"] > 0 and r["w_lines"] > 0 and r["ordinary_lines"] > 0 and r["weights"] == 20
        assert r["b_plus_w_over_ordinary"] == round((r["b_lines"] + r["w_lines"]) / r["ordinary_lines"], 3)
    # B never reads .grad: the same lines whether W will take the gradients or add them.
    assert result["transformers:mistral:accumulating"]["b_lines"] == result["transformers:mistral"]["b_lines"]
    with pytest.raises(SystemExit) as e:
        stage_shapes.main(["--shapes", "none", "--transformers", "mistral,nonsense"])
    assert e.value.code == 2 and "unknown transformers model(s) ['nonsense']" in capsys.readouterr().err


def test_stage_shapes_refuses_an_unknown_shape(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        stage_shapes.main(["--shapes", "base,nonsense"])
    assert e.value.code == 2 and "unknown shape(s) ['nonsense']" in capsys.readouterr().err
