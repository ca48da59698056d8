"""fxsplit's logging as README describes it, and the split's graphs in TORCH_LOGS and the structured trace.

Each case runs in a fresh interpreter: logging configuration (handlers,
levels, ``TORCH_LOGS``, ``TORCH_TRACE``) is process-global and is read when
torch and fxsplit are imported.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# One compiled region (eager inner compiler: the same split, no codegen), one
# B and one W. argv[1] picks how logging is configured before anything runs;
# stdout gets the split's graphs as the region holds them, to compare with
# what the logs print.
SCRIPT = r'''
import logging, sys
mode = sys.argv[1]
import torch, fxsplit
if mode == "level":
    logging.getLogger("fxsplit").setLevel(logging.DEBUG)
elif mode == "basic-config":
    logging.basicConfig(stream=sys.stdout, format="USER %(name)s: %(message)s")
    logging.getLogger("fxsplit").setLevel(logging.DEBUG)
elif mode == "set-logs":
    torch._logging.set_logs(modules={"fxsplit": logging.DEBUG, "fxsplit_graphs": True})
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
c = torch.compile(m, backend=fxsplit.backend(compiler="eager", fallback="error"))
x = torch.randn(2, 4, requires_grad=True)
out = c(x)
_, work = fxsplit.stage_backward_input([out], [torch.ones_like(out)], [x], m.parameters())
fxsplit.stage_backward_weight(m.parameters(), work)
split = fxsplit.compiled_regions()[-1].split
kw = dict(print_output=False, include_stride=True, include_device=True)
print("GRAPHS " + __import__("json").dumps([split.di_graph.print_readable(**kw), split.dw_graph.print_readable(**kw)]))
'''

B_LINE = "fxsplit: B: dI ran compiled in region0"
W_LINE = "fxsplit: W: compiled dW in region0"
SPLIT_LINE = "fxsplit: region0 split:"


def _run(mode: str, **env: str) -> tuple[str, str, list[str]]:
    """(stdout without the GRAPHS line, stderr, [dI code, dW code]) of SCRIPT run with ``mode``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_LOGS", "TORCH_TRACE"))}
    full_env.update(env)
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env=full_env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    graphs = json.loads(next(l for l in lines if l.startswith("GRAPHS "))[len("GRAPHS "):])
    return "\n".join(l for l in lines if not l.startswith("GRAPHS ")), run.stderr, graphs


def _check_b_w_and_split_lines(text: str) -> None:
    for line in (B_LINE, W_LINE, SPLIT_LINE):
        assert text.count(line) == 1, (line, text)


def test_debug_level_alone_prints_one_line_per_b_and_w() -> None:
    """README: ``logging.getLogger("fxsplit").setLevel(logging.DEBUG)`` alone prints."""
    out, err, _ = _run("level")
    assert out == ""
    _check_b_w_and_split_lines(err)
    assert "dW graph:" not in err  # the graphs artifact is off unless named


def test_torch_logs_plus_fxsplit() -> None:
    _, err, _ = _run("none", TORCH_LOGS="+fxsplit")
    _check_b_w_and_split_lines(err)
    assert "dW graph:" not in err


def test_user_configured_logging_prints_each_record_once_through_the_users_handler() -> None:
    out, err, _ = _run("basic-config")
    assert "fxsplit" not in err
    _check_b_w_and_split_lines(out)
    for line in (B_LINE, W_LINE, SPLIT_LINE):
        assert f"USER fxsplit: {line}" in out


def _logged_text(err: str) -> str:
    """Messages of torch-formatted log lines, prefixes stripped."""
    return "\n".join(re.sub(r"^[A-Z]\d{4} [\d:.]+ \d+ \S+:\d+\] (\[[^\]]*\] )*", "", l) for l in err.splitlines())


def _check_graphs_text(err: str, di_code: str, dw_code: str) -> None:
    text = _logged_text(err)
    assert text.count("fxsplit split of region0 (compile id 0/0)") == 1, text
    assert "4 live-ins hold 192 bytes from B to W" in text  # f32: 2x4 + 2x8 + 2x4 + 2x8 elements
    assert "mul_9 (dI, tensor) float32[2, 8] 64 bytes" in text
    assert di_code.strip() in text and dw_code.strip() in text


def test_set_logs_enables_the_log_and_the_graphs_artifact() -> None:
    _, err, (di_code, dw_code) = _run("set-logs")
    _check_b_w_and_split_lines(err)
    _check_graphs_text(err, di_code, dw_code)


def test_torch_logs_graphs_artifact_prints_the_split() -> None:
    _, err, (di_code, dw_code) = _run("none", TORCH_LOGS="fxsplit,fxsplit_graphs")
    assert B_LINE not in err  # "fxsplit" at INFO: no debug lines
    _check_graphs_text(err, di_code, dw_code)


def test_structured_trace_has_the_split_per_compile_id(tmp_path: pathlib.Path) -> None:
    """TORCH_TRACE alone: the split goes to the trace (tlparse lists it under compile 0/0), nothing is printed."""
    out, err, (di_code, dw_code) = _run("none", TORCH_TRACE=str(tmp_path))
    assert "fxsplit" not in out + err
    (trace,) = tmp_path.glob("*.log")
    entries: dict[str, tuple[dict, str]] = {}
    lines = trace.read_text().splitlines()
    for k, line in enumerate(lines):
        m = re.search(r"\] (\{.*\})$", line)
        if not m or '"artifact"' not in m.group(1):
            continue
        meta = json.loads(m.group(1))
        if not meta["artifact"]["name"].startswith("fxsplit_"):
            continue
        payload = []
        for follow in lines[k + 1:]:  # payload lines are tab-indented after the entry
            if not follow.startswith("\t"):
                break
            payload.append(follow[1:])
        entries[meta["artifact"]["name"]] = (meta, "\n".join(payload))
    assert set(entries) == {"fxsplit_region0_split", "fxsplit_region0_dI_graph", "fxsplit_region0_dW_graph"}
    for meta, _ in entries.values():
        assert (meta["frame_id"], meta["frame_compile_id"]) == (0, 0)  # attached to the region's compile id
    assert entries["fxsplit_region0_dI_graph"][1].strip() == di_code.strip()
    assert entries["fxsplit_region0_dW_graph"][1].strip() == dw_code.strip()
    report = json.loads(entries["fxsplit_region0_split"][1])
    assert report["compile_id"] == "0/0" and report["live_in_bytes"] == 192
    assert [l["name"] for l in report["live_ins"]] == ["primals_3", "mul_2", "tangents_1", "mul_9"]
    assert report["di_outputs"] == [2] and report["dw_outputs"] == [0, 1, 3, 4]
