"""The benchmark (README's main job) in --quick mode: JSON structure and finite figures.

No timing thresholds: only that every mode produced a number where it should.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from fxsplit.bench import run as bench
from fxsplit import cli

SPLIT_MODES = {"eager+upstream", "inductor+upstream", "fxsplit+split"}
COMPILED_MODES = {"inductor", "inductor+upstream", "fxsplit", "fxsplit+split"}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    # through the console-script entry point, as `fxsplit bench --quick` runs it
    rc = cli.main(["bench", "--quick", "--device", "cpu", "--out", str(out), "--no-chart"])
    assert rc == 0
    assert not out.with_suffix(".png").exists(), "--no-chart must not draw a chart"
    return json.loads(out.read_text()), str(out)


def test_json_top_level(quick_result: tuple[dict[str, Any], str]) -> None:
    r, _ = quick_result
    for key in ("schema", "device", "dtype", "torch_version", "fxsplit_version", "model", "settings", "modes",
                "targets", "methods", "mode4_default_config_error", "wall_s"):
        assert key in r, key
    assert r["device"]["type"] == "cpu" and r["device"]["name"]
    assert r["dtype"] == "float32"
    assert r["model"]["name"] == "gpt" and r["model"]["parameters"] > 0
    assert r["settings"]["quick"] is True
    assert [m["key"] for m in r["modes"]] == list(bench.MODE_KEYS)
    assert set(r["targets"]) == set(bench.TARGETS)
    for t in r["targets"].values():
        assert _finite(t["measured"]) and isinstance(t["pass"], bool)


def test_every_mode_has_finite_figures(quick_result: tuple[dict[str, Any], str]) -> None:
    r, _ = quick_result
    for m in r["modes"]:
        key = m["key"]
        for field in ("forward_ms", "backward_ms", "ratio_to_inductor", "duplicated_flops_pct", "peak_bytes"):
            assert _finite(m[field]), (key, field, m[field])
        assert m["backward_ms"] > 0 and m["forward_ms"] > 0, key
        assert _finite(m["flops"]["backward"]) and m["flops"]["backward"] > 0, key
        if key in SPLIT_MODES:
            for field in ("b_ms", "w_ms", "held_bytes", "held_bytes_declared"):
                assert _finite(m[field]), (key, field, m[field])
            assert _finite(m["flops"]["B"]) and _finite(m["flops"]["W"]), key
            assert m["flops"]["B"] + m["flops"]["W"] == m["flops"]["backward"], key
            assert m["timing"]["B"]["n"] == m["timing"]["W"]["n"] >= 1, key
        else:
            assert m["b_ms"] is None and m["w_ms"] is None and m["held_bytes"] is None, key
        if key in COMPILED_MODES:
            assert _finite(m["compile_s"]) and m["compile_s"] > 0, key
            assert m["flops_observed"] is not None and _finite(m["flops_observed"]["backward"]), key
        else:
            assert m["compile_s"] is None, key
    ref = next(m for m in r["modes"] if m["key"] == "inductor")
    assert ref["ratio_to_inductor"] == 1.0 and ref["duplicated_flops_pct"] == 0.0


def test_mode4_default_config_failure_is_recorded(quick_result: tuple[dict[str, Any], str]) -> None:
    r, _ = quick_result
    err = r["mode4_default_config_error"]
    assert isinstance(err, str) and "donated buffer" in err
    mode4 = next(m for m in r["modes"] if m["key"] == "inductor+upstream")
    assert mode4["default_config_error"] == err
    assert _finite(mode4["backward_ms"]) and _finite(mode4["b_ms"]) and _finite(mode4["w_ms"])


def test_split_flops_account_for_the_whole_backward(quick_result: tuple[dict[str, Any], str]) -> None:
    """FLOP counts are deterministic: fxsplit's B + W is the fused backward; upstream over Inductor reruns it."""
    r, _ = quick_result
    by = {m["key"]: m for m in r["modes"]}
    fused = by["inductor"]["flops"]["backward"]
    assert by["fxsplit+split"]["flops"]["backward"] == fused
    assert by["fxsplit+split"]["flops"]["W"] > 0 and by["fxsplit+split"]["flops"]["B"] > 0
    assert by["inductor+upstream"]["flops"]["B"] == fused  # B runs the whole compiled backward
    assert r["targets"]["duplicated_flops"]["pass"] is True


def test_table_and_default_path(quick_result: tuple[dict[str, Any], str]) -> None:
    r, _ = quick_result
    table = bench.format_table(r)
    for key in bench.MODE_KEYS:
        assert key in table
    assert table.count("target ") == 3 and ("PASS" in table or "MISS" in table)
    import torch

    path = bench.default_out_path(torch.device("cpu"), bench.ModelConfig())
    assert path.parent == Path(bench.__file__).resolve().parents[2] / "benchmarks" / "results"
    assert path.name.startswith("cpu-") and path.suffix == ".json"


def test_cli_rejects_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])
    assert cli.main([]) == 2
