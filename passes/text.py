"""Stable text form of FX graphs, for golden tests and logs."""

from __future__ import annotations

import re

import torch.fx as fx

__all__ = ["normalized_graph_code"]


def _target_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_function":
        name = getattr(t, "__name__", None) or str(t)
        overload = getattr(t, "_overloadname", None)
        packet = getattr(getattr(t, "overloadpacket", None), "__name__", None)
        if packet is not None and overload is not None:
            return f"aten.{packet}.{overload}" if str(t).startswith("aten.") else str(t)
        return name
    return str(t)


def normalized_graph_code(gm: fx.GraphModule | fx.Graph) -> str:
    """Render a graph as one line per node, with names renumbered by position.

    The text depends only on the graph's structure (ops, argument wiring,
    constant arguments), not on node names that tracing happened to choose,
    so it is stable enough to compare against golden strings.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    names: dict[fx.Node, str] = {}
    counts: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            prefix = "in"
        elif n.op == "output":
            continue
        else:
            prefix = "v"
        k = counts.get(prefix, 0)
        counts[prefix] = k + 1
        names[n] = f"{prefix}{k}"

    def fmt(a: object) -> str:
        if isinstance(a, fx.Node):
            return names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k}={fmt(v)}" for k, v in a.items()) + "}"
        s = repr(a)
        return re.sub(r" at 0x[0-9a-f]+", "", s)

    lines = []
    for n in graph.nodes:
        if n.op == "placeholder":
            lines.append(f"{names[n]} = input()")
        elif n.op == "output":
            lines.append(f"return {fmt(n.args[0])}")
        else:
            args = [fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items()]
            lines.append(f"{names[n]} = {_target_name(n)}({', '.join(args)})")
    return "\n".join(lines) + "\n"
