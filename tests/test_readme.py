"""README's example (compile, B, W) runs and prints the output README shows.

The example compiles with the real Inductor (``backend="fxsplit"``).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks_after(heading: str) -> list[str]:
    text = README.read_text()
    section = text[text.index(heading):]
    return re.findall(r"```(?:python|)\n(.*?)```", section, flags=re.S)[:2]


@pytest.mark.inductor
def test_readme_example_prints_what_readme_shows() -> None:
    code, shown = _blocks_after("## Example: compile, B, W")
    assert len(code.strip().splitlines()) == 10
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines() == shown.strip().splitlines()


def _section(heading: str) -> str:
    text = README.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end != -1 else None]


def test_supported_torch_range_matches_pyproject() -> None:
    pyproject = (README.parent / "pyproject.toml").read_text()
    m = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', pyproject)
    assert m, "pyproject.toml: no torch>=X.Y,<X.Z requirement"
    low, newest = f"{m[1]}.{m[2]}", f"{m[3]}.{int(m[4]) - 1}"
    assert f"Supported: torch {low} to {newest} " in README.read_text()


def test_benchmark_section_lists_every_bench_option() -> None:
    from fxsplit.cli import build_bench_parser as build_parser

    section = _section("## Benchmark")
    options = [s for a in build_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    missing = [o for o in options if f"`{o}" not in section]
    assert missing == [], f"README's Benchmark section does not describe {missing}"
