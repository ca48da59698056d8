"""fxsplit's logging as docs/troubleshooting.md describes it, and the split's graphs in TORCH_LOGS and the structured trace.

Logging configuration (handlers, levels, ``TORCH_LOGS``, ``TORCH_TRACE``) is
process-global and partly read when torch and fxsplit are imported, so the
cases run in fresh interpreters: one runs the in-program configurations one
after the other (each on a new compiled region, output split by markers), one
runs with the environment variables set.
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

# For each scenario in argv[1] (comma-separated): configure logging, compile a
# new region (eager inner compiler: the same split, no codegen), run B then W,
# undo the configuration. Both streams get a "=== scenario" marker first;
# stdout also gets the region's name and its split graphs, to compare with
# what the logs print.
SCRIPT = r'''
import json, logging, sys
import torch, fxsplit

def step():
    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    c = torch.compile(m, backend=fxsplit.backend(compiler="eager", fallback="error"))
    x = torch.randn(2, 4, requires_grad=True)
    out = c(x)
    _, work = fxsplit.stage_backward_input([out], [torch.ones_like(out)], [x], m.parameters())
    fxsplit.stage_backward_weight(m.parameters(), work)
    region = fxsplit.compiled_regions()[-1]
    kw = dict(print_output=False, include_stride=True, include_device=True)
    codes = [region.split.di_graph.print_readable(**kw), region.split.dw_graph.print_readable(**kw)]
    print("REGION " + json.dumps([region.name, *codes]), flush=True)

for scenario in sys.argv[1].split(","):
    print(f"=== {scenario}", flush=True)
    print(f"=== {scenario}", file=sys.stderr, flush=True)
    log = logging.getLogger("fxsplit")
    if scenario == "level":
        log.setLevel(logging.DEBUG)
    elif scenario == "basic-config":
        logging.basicConfig(stream=sys.stdout, format="USER %(name)s: %(message)s", force=True)
        log.setLevel(logging.DEBUG)
    elif scenario == "set-logs":
        torch._logging.set_logs(modules={"fxsplit": logging.DEBUG, "fxsplit_graphs": True})
    step()
    log.setLevel(logging.NOTSET)
    for h in list(logging.getLogger().handlers):
        logging.getLogger().removeHandler(h)
'''

IN_PROGRAM = ("none", "level", "basic-config", "set-logs")  # set-logs last: torch then manages the log


def _run(scenarios: str, **env: str) -> dict[str, tuple[str, str, list[str]]]:
    """{scenario: (stdout, stderr, [region name, dI code, dW code])} of SCRIPT."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_LOGS", "TORCH_TRACE"))}
    full_env.update(env)
    run = subprocess.run([sys.executable, "-c", SCRIPT, scenarios], capture_output=True, text=True, timeout=600,
                         cwd=REPO, env=full_env)
    assert run.returncode == 0, run.stderr[-3000:]
    names = scenarios.split(",")
    outs = re.split(r"^=== \S+\n", run.stdout, flags=re.M)[1:]
    errs = re.split(r"^=== \S+\n", run.stderr, flags=re.M)[1:]
    assert len(outs) == len(errs) == len(names), (run.stdout, run.stderr)
    result = {}
    for name, out, err in zip(names, outs, errs):
        region_line = next(l for l in out.splitlines() if l.startswith("REGION "))
        out = "\n".join(l for l in out.splitlines() if not l.startswith("REGION "))
        result[name] = (out, err, json.loads(region_line[len("REGION "):]))
    return result


@pytest.fixture(scope="module")
def in_program() -> dict[str, tuple[str, str, list[str]]]:
    return _run(",".join(IN_PROGRAM))


@pytest.fixture(scope="module")
def from_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[str, str, list[str]], pathlib.Path]:
    trace_dir = tmp_path_factory.mktemp("trace")
    runs = _run("env", TORCH_LOGS="+fxsplit,fxsplit_graphs", TORCH_TRACE=str(trace_dir))
    return runs["env"], trace_dir


def _check_b_w_and_split_lines(text: str, region: str) -> None:
    for line in (f"fxsplit: B: dI ran compiled in {region}", f"fxsplit: W: compiled dW in {region}",
                 f"fxsplit: {region} split:"):
        assert text.count(line) == 1, (line, text)


def test_nothing_printed_by_default(in_program: dict[str, tuple[str, str, list[str]]]) -> None:
    out, err, _ = in_program["none"]
    assert "fxsplit" not in out + err


def test_debug_level_alone_prints_one_line_per_b_and_w(in_program: dict[str, tuple[str, str, list[str]]]) -> None:
    """docs/troubleshooting.md: ``logging.getLogger("fxsplit").setLevel(logging.DEBUG)`` alone prints."""
    out, err, (region, _, _) = in_program["level"]
    assert out == ""
    _check_b_w_and_split_lines(err, region)
    assert "dW graph:" not in err  # the graphs artifact is off unless named


def test_user_configured_logging_prints_each_record_once_through_the_users_handler(
    in_program: dict[str, tuple[str, str, list[str]]],
) -> None:
    out, err, (region, _, _) = in_program["basic-config"]
    assert "fxsplit" not in err
    _check_b_w_and_split_lines(out, region)
    assert f"USER fxsplit: fxsplit: B: dI ran compiled in {region}" in out


def _logged_text(err: str) -> str:
    """Messages of torch-formatted log lines, prefixes stripped."""
    return "\n".join(re.sub(r"^[A-Z]\d{4} [\d:.]+ \d+ \S+:\d+\] (\[[^\]]*\] )*", "", l) for l in err.splitlines())


def _check_graphs_text(err: str, region: str, di_code: str, dw_code: str) -> None:
    text = _logged_text(err)
    assert len(re.findall(rf"^fxsplit split of {region} \(compile id \d+/\d+\)", text, flags=re.M)) == 1, text
    assert "4 live-ins hold 192 bytes from B to W" in text  # f32: 2x4 + 2x8 + 2x4 + 2x8 elements
    assert "mul_9 (dI, tensor) float32[2, 8] 64 bytes" in text
    assert di_code.strip() in text and dw_code.strip() in text


def test_set_logs_enables_the_log_and_the_graphs_artifact(in_program: dict[str, tuple[str, str, list[str]]]) -> None:
    _, err, (region, di_code, dw_code) = in_program["set-logs"]
    _check_b_w_and_split_lines(err, region)
    _check_graphs_text(err, region, di_code, dw_code)


def test_torch_logs_enables_the_log_and_the_graphs_artifact(
    from_env: tuple[tuple[str, str, list[str]], pathlib.Path],
) -> None:
    (_, err, (region, di_code, dw_code)), _ = from_env
    _check_b_w_and_split_lines(err, region)
    _check_graphs_text(err, region, di_code, dw_code)


def test_structured_trace_has_the_split_per_compile_id(
    from_env: tuple[tuple[str, str, list[str]], pathlib.Path],
) -> None:
    """TORCH_TRACE: the split goes to the trace, where tlparse lists it under the region's compile id."""
    (_, _, (region, di_code, dw_code)), trace_dir = from_env
    (trace,) = trace_dir.glob("*.log")
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
    assert set(entries) == {f"fxsplit_{region}_split", f"fxsplit_{region}_dI_graph", f"fxsplit_{region}_dW_graph"}
    for meta, _ in entries.values():
        assert (meta["frame_id"], meta["frame_compile_id"]) == (0, 0)  # attached to the region's compile id
    assert entries[f"fxsplit_{region}_dI_graph"][1].strip() == di_code.strip()
    assert entries[f"fxsplit_{region}_dW_graph"][1].strip() == dw_code.strip()
    report = json.loads(entries[f"fxsplit_{region}_split"][1])
    assert report["compile_id"] == "0/0" and report["live_in_bytes"] == 192
    assert [l["name"] for l in report["live_ins"]] == ["primals_3", "mul_2", "tangents_1", "mul_9"]
    assert report["di_outputs"] == [2] and report["dw_outputs"] == [0, 1, 3, 4]
