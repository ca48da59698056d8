"""README and the docs pages: README's example runs and prints the output README shows, its
set-up commands are the ones CI runs, and every relative link, anchor and repository path that
README or a page names exists.

The example compiles with the real Inductor (``backend="fxsplit"``).
"""

from __future__ import annotations

import itertools
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = ("semantics", "parallelism", "benchmark", "how-the-split-works", "troubleshooting", "development")


def _documents() -> list[pathlib.Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _blocks_after(heading: str) -> list[str]:
    text = README.read_text()
    section = text[text.index(heading):]
    return re.findall(r"```(?:python|)\n(.*?)```", section, flags=re.S)[:2]


@pytest.mark.inductor
def test_readme_example_prints_what_readme_shows() -> None:
    code, shown = _blocks_after("## Quick start: compile, B, W")
    assert len(code.strip().splitlines()) == 10
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines() == shown.strip().splitlines()


def test_supported_torch_range_matches_pyproject() -> None:
    pyproject = (README.parent / "pyproject.toml").read_text()
    m = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', pyproject)
    assert m, "pyproject.toml: no torch>=X.Y,<X.Z requirement"
    low, newest = f"{m[1]}.{m[2]}", f"{m[3]}.{int(m[4]) - 1}"
    assert f"Supported: torch {low} to {newest} " in README.read_text()


def test_benchmark_page_lists_every_bench_option() -> None:
    from fxsplit.cli import build_bench_parser

    page = (DOCS / "benchmark.md").read_text()
    options = [s for a in build_bench_parser()._actions for s in a.option_strings
               if s.startswith("--") and s != "--help"]
    missing = [o for o in options if f"`{o}" not in page]
    assert missing == [], f"docs/benchmark.md does not describe {missing}"


def _command_after(marker: str) -> str:
    """The command in the ```bash block that follows ``<!-- marker -->`` (what ``.ci/run`` reads)."""
    lines = README.read_text().splitlines()
    i = lines.index(f"<!-- {marker} -->")
    assert lines[i + 1] == "```bash", f"README: no bash block right after the {marker} marker"
    return lines[i + 2]


def test_readme_commands_are_the_ones_ci_runs() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    m = re.search(r"^test_cmd='(.*)'$", ci, flags=re.M)
    assert m, ".ci/run: no test_cmd='...' line"
    test_cmd = _command_after("readme:test-command")
    assert test_cmd == m[1]
    # the main command sets up the same way (same torch pin), with the plot extra, and runs the bench
    main_cmd = _command_after("readme:main-command")
    assert main_cmd == test_cmd.replace('".[test]"', '".[plot]"').replace(
        ".venv/bin/python -m pytest -q", ".venv/bin/fxsplit bench")


def test_readme_is_a_front_door_that_links_every_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 250
    for page in PAGES:
        assert (DOCS / f"{page}.md").is_file(), page
        assert f"](docs/{page}.md" in text, f"README does not link docs/{page}.md"


def _without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-',
    a repeated heading numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.*)$", _without_code(path.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: p.name)
def test_every_relative_link_resolves(doc: pathlib.Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            broken.append(target)
        elif anchor and (resolved.suffix != ".md" or anchor not in _anchors(resolved)):
            broken.append(target)
    assert broken == [], f"{doc.relative_to(REPO)}: links that lead nowhere: {broken}"


# A path into the repository, as pages name them: `fxsplit/bench/memory.py`, tests/test_cut.py,
# benchmarks/results/cpu-amd-epyc{,-llama}.json (brace alternatives are expanded). Templates
# (`<device>`) and globs are not paths.
_PATH = re.compile(r"(?<![\w/.-])((?:fxsplit|passes|tests|benchmarks|examples|docs|\.ci)/[\w./{},<>*\[\]-]*)")


def _expand(path: str) -> list[str]:
    parts = re.split(r"\{([^{}]*)\}", path)
    options = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*options)]


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: p.name)
def test_every_named_repository_path_exists(doc: pathlib.Path) -> None:
    named = {m.rstrip(".,") for m in _PATH.findall(doc.read_text())}
    assert named, f"{doc.name} names no repository path (the pattern no longer matches?)"
    missing = [p for name in sorted(named) if not re.search(r"[<>*\[\]]", name)
               for p in _expand(name) if not (REPO / p).exists()]
    assert missing == [], f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


# Words that narrate how the project got here rather than what it is (the docs are reference; git
# and CHANGELOG.md hold the history). benchmarks/cuda_session.sh is a file name, not a narrative.
NARRATION = re.compile(r"session|next time|this time|scratch script|later that day|an hour later|next gpu",
                       re.IGNORECASE)


@pytest.mark.parametrize("doc", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_docs_are_reference_not_history(doc: pathlib.Path) -> None:
    found = [line for line in doc.read_text().splitlines()
             if NARRATION.search(line.replace("cuda_session.sh", ""))]
    assert not found, f"{doc.name} narrates work: {found[:3]}"
