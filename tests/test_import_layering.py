"""The package's layering, read off the source: no two modules import each other (directly
or through others), the pure passes import nothing else from fxsplit, and the benchmark
never imports the command line that drives it.

Imports are read with ``ast`` (module level and inside functions alike: a lazy import is
still a dependency), so nothing is imported or run.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

REPO = pathlib.Path(__file__).resolve().parents[1]
# Source folders and the package each is installed as (pyproject.toml's package-dir mapping).
SOURCES = {"fxsplit": "fxsplit", "passes": "fxsplit.passes"}


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package, by dotted name (a package by its ``__init__``)."""
    mods = {}
    for folder, package in SOURCES.items():
        for f in sorted((REPO / folder).rglob("*.py")):
            parts = f.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1], *([] if parts[-1] == "__init__" else [parts[-1]])))
            mods[name] = f
    return mods


def _import_graph() -> nx.DiGraph:
    """module -> every package module it imports. ``from pkg import name`` is an edge to the
    module ``pkg.name`` where that is a module, else to ``pkg``."""
    mods = _modules()
    graph = nx.DiGraph()
    for name, path in mods.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            else:
                assert not isinstance(node, ast.ImportFrom) or node.level == 0, f"{path}: relative import"
                continue
            graph.add_edges_from((name, t) for t in targets if t in mods and t != name)
    return graph


def test_every_module_is_seen() -> None:
    mods = _modules()
    assert {"fxsplit", "fxsplit.cli", "fxsplit.bench.run", "fxsplit.passes", "fxsplit.passes.split"} <= set(mods)


def test_no_import_cycles() -> None:
    cycles = [sorted(c) for c in nx.strongly_connected_components(_import_graph()) if len(c) > 1]
    assert cycles == [], f"modules that import each other (directly or through others): {cycles}"


def test_passes_import_nothing_else_from_fxsplit() -> None:
    graph = _import_graph()
    outside = {(m, t) for m, t in graph.edges if m.startswith("fxsplit.passes") and not t.startswith("fxsplit.passes")}
    assert outside == set()


def test_the_benchmark_does_not_import_the_command_line() -> None:
    graph = _import_graph()
    assert not [m for m in graph.predecessors("fxsplit.cli") if m.startswith("fxsplit.bench")]
