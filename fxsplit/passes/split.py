"""Split a backward graph into an input-gradient (dI) graph and a weight-gradient (dW) graph.

This is the symbolic counterpart of the autograd-graph ``reverse_closure`` in
``torch.distributed.pipelining._backward``: instead of hooking autograd nodes at
run time, we partition AOTAutograd's backward FX graph ahead of time.

* The dI graph is the reverse closure (all ancestors) of the input-gradient
  outputs. It keeps the backward graph's placeholders unchanged, so it is
  called exactly like the fused backward, and it additionally returns the
  *live-ins*: the values the dW graph needs.
* The dW graph holds every node that only weight-gradient outputs need. Its
  placeholders are the live-ins, in order.

Live-ins are backward inputs (saved activations, tangents, SymInts) and
intermediates computed in dI (e.g. the gradient flowing into a Linear) that
dW consumes. Nothing else crosses, so everything only dI needs can be freed
when dI ends.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.fx as fx

__all__ = ["LiveIn", "SplitError", "SplitResult", "split_backward"]


class SplitError(ValueError):
    """The backward graph does not have the shape the split expects."""


@dataclasses.dataclass(frozen=True)
class LiveIn:
    """One value that crosses from the dI graph to the dW graph.

    ``source`` is ``"input"`` for a backward-graph placeholder (a saved
    activation, a tangent or a SymInt) and ``"dI"`` for a value computed by
    the dI graph.
    """

    name: str
    source: str
    kind: str  # "tensor", "symint" or "other"

    def __str__(self) -> str:
        return f"{self.name} ({self.source}, {self.kind})"


@dataclasses.dataclass(frozen=True)
class SplitResult:
    """The two graphs a backward graph is split into, and how they connect.

    Contract, with ``bw`` the original backward graph taking ``args`` and
    returning ``outs`` (length ``num_outputs``):

    * ``di_graph(*args) -> (*[outs[i] for i in di_outputs], *live_ins)``
    * ``dw_graph(*live_ins) -> tuple(outs[i] for i in dw_outputs)``
    * every other output of ``bw`` is ``None``.

    ``di_outputs`` and ``dw_outputs`` are disjoint sorted indices into the
    backward graph's outputs. ``live_ins`` names, in order, the values the dI
    graph returns after its own outputs and the dW graph takes as placeholders.
    The graphs are fresh ``GraphModule``s; the input graph is not modified.
    """

    di_graph: fx.GraphModule
    dw_graph: fx.GraphModule
    di_outputs: tuple[int, ...]
    dw_outputs: tuple[int, ...]
    live_ins: tuple[LiveIn, ...]
    num_outputs: int

    @property
    def num_live_ins(self) -> int:
        return len(self.live_ins)

    def describe(self) -> str:
        """A short human-readable summary (for logs and ``fxsplit.explain``)."""
        lines = [
            f"dI outputs: {list(self.di_outputs)}",
            f"dW outputs: {list(self.dw_outputs)}",
            f"live-ins ({len(self.live_ins)}): " + ", ".join(map(str, self.live_ins)),
        ]
        return "\n".join(lines)


def _kind(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "tensor"
    if isinstance(val, (torch.SymInt, int)):
        return "symint"
    return "other"


def _ancestors(roots: Sequence[fx.Node]) -> set[fx.Node]:
    """All nodes reachable backwards (through args) from ``roots``, roots included."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _output_nodes(gm: fx.GraphModule) -> tuple[fx.Node, list[Any]]:
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    if len(outputs) != 1:
        raise SplitError(f"expected exactly one output node, found {len(outputs)}")
    out = outputs[0]
    (ret,) = out.args
    if not isinstance(ret, (tuple, list)):
        raise SplitError(
            f"expected the backward graph to return a tuple of gradients, found {type(ret).__name__}"
        )
    return out, list(ret)


def _copy_nodes(
    src_nodes: Sequence[fx.Node],
    graph: fx.Graph,
    env: dict[fx.Node, fx.Node],
) -> None:
    """Copy ``src_nodes`` (in topological order) into ``graph``, mapping args through ``env``."""
    for n in src_nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])


def _mask_position(node: fx.Node) -> int | None:
    """Position of the ``output_mask`` argument of a multi-output backward op
    (``convolution_backward`` and friends), or ``None``."""
    if node.op != "call_function":
        return None
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for k, arg in enumerate(schema.arguments):
        if arg.name == "output_mask":
            return k
    return None


def _get_mask(node: fx.Node, pos: int) -> list[bool] | None:
    mask = node.args[pos] if pos < len(node.args) else node.kwargs.get("output_mask")
    if isinstance(mask, (list, tuple)) and all(isinstance(m, bool) for m in mask):
        return list(mask)
    return None


def _with_mask(node: fx.Node, pos: int, mask: list[bool]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if pos < len(node.args):
        args = list(node.args)
        args[pos] = mask
        return tuple(args), dict(node.kwargs)
    return tuple(node.args), {**node.kwargs, "output_mask": mask}


def _masked_nodes_to_split(graph: fx.Graph, di_nodes: set[fx.Node]) -> list[tuple[fx.Node, set[int]]]:
    """Multi-output backward ops (one node computing e.g. the input *and* the
    weight gradient of a convolution) that dI needs but whose other outputs
    only dW reads. Returns each with the output indices dI needs."""
    found = []
    for n in graph.nodes:
        if n not in di_nodes:
            continue
        pos = _mask_position(n)
        if pos is None or _get_mask(n, pos) is None:
            continue
        users = list(n.users)
        if not users or any(u.target is not operator.getitem or not isinstance(u.args[1], int) for u in users):
            continue
        di_idx = {u.args[1] for u in users if u in di_nodes}
        dw_idx = {u.args[1] for u in users if u not in di_nodes}
        if di_idx and dw_idx:
            found.append((n, di_idx))
    return found


def _split_masked_node(graph: fx.Graph, node: fx.Node, di_idx: set[int]) -> None:
    """Replace ``node`` by two nodes of the same op: one computing the outputs
    in ``di_idx``, one the rest (via ``output_mask``), and rewire its getitems."""
    pos = _mask_position(node)
    assert pos is not None
    mask = _get_mask(node, pos)
    assert mask is not None
    parts = {}
    for side, keep in (("di", lambda i: i in di_idx), ("dw", lambda i: i not in di_idx)):
        new_mask = [m and keep(i) for i, m in enumerate(mask)]
        args, kwargs = _with_mask(node, pos, new_mask)
        with graph.inserting_after(node):
            new = graph.call_function(node.target, args, kwargs)
        new.meta = dict(node.meta)
        parts[side] = new
    for u in list(node.users):
        u.replace_input_with(node, parts["di"] if u.args[1] in di_idx else parts["dw"])
    graph.erase_node(node)


def _di_closure(graph: fx.Graph, rets: Sequence[Any], di_outputs: Sequence[int]) -> set[fx.Node]:
    """Nodes dI runs: ancestors of the input gradients, plus side-effecting
    nodes (they must run exactly once, and dI always runs)."""
    impure = [n for n in graph.nodes if n.op == "call_function" and n.is_impure() and not n.users]
    return _ancestors([rets[i] for i in di_outputs] + impure)


def _copy_graph(graph: fx.Graph, rets: Sequence[Any]) -> tuple[fx.Graph, list[Any]]:
    """A copy of ``graph`` (same node names and meta) and ``rets`` mapped into it."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        if n.op != "output":
            env[n] = new.node_copy(n, lambda a: env[a])
    new_rets = [env[r] if isinstance(r, fx.Node) else r for r in rets]
    new.output(tuple(new_rets))
    return new, new_rets


def split_backward(
    bw: fx.GraphModule,
    weight_outputs: Collection[int],
) -> SplitResult:
    """Split ``bw`` so that outputs in ``weight_outputs`` are computed by a separate dW graph.

    ``weight_outputs`` are indices into the tuple ``bw`` returns (the gradients
    of weights); every other non-``None`` output is an input gradient and is
    computed by the dI graph. Raises :class:`SplitError` if an index is out of
    range or the graph does not return a flat tuple.
    """
    out_node, rets = _output_nodes(bw)
    num_outputs = len(rets)
    bad = [i for i in weight_outputs if not 0 <= i < num_outputs]
    if bad:
        raise SplitError(
            f"weight output indices {sorted(bad)} are out of range for a backward graph "
            f"with {num_outputs} outputs"
        )
    for i, r in enumerate(rets):
        if r is not None and not isinstance(r, fx.Node):
            raise SplitError(f"backward output {i} is a constant ({r!r}); expected a node or None")

    weight_set = set(weight_outputs)
    dw_outputs = tuple(i for i, r in enumerate(rets) if i in weight_set and r is not None)
    di_outputs = tuple(i for i, r in enumerate(rets) if i not in weight_set and r is not None)

    graph = bw.graph
    di_nodes = _di_closure(graph, rets, di_outputs)
    to_split = _masked_nodes_to_split(graph, di_nodes)
    if to_split:
        # One node computes both an input and a weight gradient (e.g.
        # convolution_backward): on a private copy of the graph, give dI a node
        # computing only what dI needs, so the weight-gradient work moves to dW.
        graph, rets = _copy_graph(bw.graph, rets)
        env_nodes = {n.name: n for n in graph.nodes}
        for n, di_idx in to_split:
            _split_masked_node(graph, env_nodes[n.name], di_idx)
        di_nodes = _di_closure(graph, rets, di_outputs)
    dw_needed = _ancestors([rets[i] for i in dw_outputs])
    dw_nodes = dw_needed - di_nodes

    # Live-ins: values owned by dI (its nodes or placeholders) that dW reads,
    # or that are themselves weight-gradient outputs.
    crossing: set[fx.Node] = set()
    for n in dw_nodes:
        for a in n.all_input_nodes:
            if a not in dw_nodes:
                crossing.add(a)
    for i in dw_outputs:
        if rets[i] not in dw_nodes:
            crossing.add(rets[i])
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # Placeholders only dW reads are in dw_nodes; move them to the crossing set.
    for p in placeholders:
        if p in dw_nodes:
            dw_nodes.discard(p)
            crossing.add(p)
    order = {n: k for k, n in enumerate(graph.nodes)}
    live_nodes = sorted(crossing, key=order.__getitem__)

    # ---- dI graph: same placeholders as bw, returns dI outputs + live-ins.
    di = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in placeholders:
        env[p] = di.node_copy(p)
    body = [n for n in graph.nodes if n in di_nodes and n.op not in ("placeholder", "output")]
    _copy_nodes(body, di, env)
    di_ret = [env[rets[i]] for i in di_outputs] + [env[n] for n in live_nodes]
    di.output(tuple(di_ret))

    # ---- dW graph: live-ins as placeholders, returns dW outputs.
    dw = fx.Graph()
    wenv: dict[fx.Node, fx.Node] = {}
    for n in live_nodes:
        ph = dw.placeholder(n.name)
        ph.meta = dict(n.meta)
        wenv[n] = ph
    wbody = [n for n in graph.nodes if n in dw_nodes and n.op not in ("placeholder", "output")]
    _copy_nodes(wbody, dw, wenv)
    dw.output(tuple(wenv[rets[i]] for i in dw_outputs))

    for g, src in ((di, out_node), (dw, out_node)):
        g.output_node().meta.update({k: v for k, v in src.meta.items() if k == "desc"})
    # The 'desc' list describes the full output tuple; narrow it to each graph.
    descs = out_node.meta.get("desc")
    if isinstance(descs, (list, tuple)) and len(descs) == num_outputs:
        di.output_node().meta["desc"] = [descs[i] for i in di_outputs] + [None] * len(live_nodes)
        dw.output_node().meta["desc"] = [descs[i] for i in dw_outputs]
    else:
        di.output_node().meta.pop("desc", None)
        dw.output_node().meta.pop("desc", None)

    live_ins = tuple(
        LiveIn(name=n.name, source="input" if n.op == "placeholder" else "dI", kind=_kind(n))
        for n in live_nodes
    )
    di.lint()
    dw.lint()
    return SplitResult(
        di_graph=fx.GraphModule(bw, di, class_name="DIGraph"),
        dw_graph=fx.GraphModule(bw, dw, class_name="DWGraph"),
        di_outputs=di_outputs,
        dw_outputs=dw_outputs,
        live_ins=live_ins,
        num_outputs=num_outputs,
    )
