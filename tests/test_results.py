"""The committed results a reader is pointed to: every results file says where it came from, every
file is cited by the docs, and every file the docs cite exists (benchmarks/results/README.md)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"benchmarks/results/([A-Za-z0-9_.{},<>\[\]|-]+\.json)")


def _expand(pattern: str) -> list[str]:
    """``cpu-amd-epyc{,-llama}.json`` -> both names (shell-style braces, as the docs write them)."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _citations() -> dict[str, list[str]]:
    """Results file name -> the pages citing it (placeholders such as ``<name>`` are commands, not citations)."""
    cited: dict[str, list[str]] = {}
    for page in PAGES:
        for pattern in CITED.findall(page.read_text()):
            if "<" in pattern or "[" in pattern:
                continue
            for name in _expand(pattern):
                cited.setdefault(name, []).append(page.name)
    return cited


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_results_file_says_where_it_came_from(path: Path) -> None:
    data = json.loads(path.read_text())
    for field in ("command", "code_revision", "torch_version", "device"):
        assert data.get(field), f"{path.name} has no {field!r}"


def test_every_cited_results_file_exists_and_every_file_is_cited() -> None:
    cited = _citations()
    files = {p.name for p in RESULTS.glob("*.json")}
    missing = {name: pages for name, pages in cited.items() if name not in files}
    assert not missing, f"pages cite results files that do not exist: {missing}"
    uncited = files - set(cited)
    assert not uncited, f"results files no page of README.md or docs/ cites: {sorted(uncited)}"
    listed = (RESULTS / "README.md").read_text()
    assert not [f for f in files if f"`{f}`" not in listed], "benchmarks/results/README.md must list every file"
