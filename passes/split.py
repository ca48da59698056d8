"""Split a backward graph into an input-gradient (dI) graph and a weight-gradient (dW) graph.

This is the symbolic counterpart of the autograd-graph ``reverse_closure`` in
``torch.distributed.pipelining._backward``: instead of hooking autograd nodes at
run time, we partition AOTAutograd's backward FX graph ahead of time.

* The dI graph is the reverse closure (all ancestors) of the input-gradient
  outputs, plus, by default, the cheap weight reductions (bias and norm-weight
  gradients) that fuse with its kernels. It keeps the backward graph's
  placeholders unchanged, so it is called exactly like the fused backward,
  and it additionally returns the *live-ins*: the values the dW graph needs.
* The dW graph holds every other node that only weight-gradient outputs
  need (every weight-gradient matmul among them), and the cheap pointwise ops
  and views it recomputes rather than receive. Its placeholders are the
  live-ins, in order.

Live-ins are backward inputs (saved activations, tangents, SymInts) and
intermediates computed in dI (e.g. the gradient flowing into a Linear) that
dW consumes. Nothing else crosses, so everything only dI needs can be freed
when dI ends. Every live-in is a tensor or a size scalar (a SymInt), never a
tuple: a multi-output node either is split (:mod:`fxsplit.passes.shared`) or
its outputs cross one by one. Sizes stay symbolic: dW also receives the SymInts
that define the sizes of its inputs (:mod:`fxsplit.passes.symbols`), and a
value dW reads only for its size crosses as that size.

The pass, step by step (each step its own module):

1. *what dI must compute*: the input gradients' ancestors, or, for a graph
   with no input gradients (a first stage), the activation-gradient chain
   (:mod:`fxsplit.passes.first_stage`);
2. *shared nodes* computing outputs for both sides are divided
   (:mod:`fxsplit.passes.shared`);
3. *placement by cost*: cheap weight reductions move into dI beside the
   kernels that produce their inputs (:mod:`fxsplit.passes.placement`);
4. *the cut*: which values cross, chosen to hold the fewest bytes, with dW
   recomputing cheap pointwise ops and views (:mod:`fxsplit.passes.cut`);
   the bytes held are a sympy expression (:mod:`fxsplit.passes.memory`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx

from fxsplit.passes.cut import Cut, choose_cut
from fxsplit.passes.first_stage import WeightLeaves, weight_leaves
from fxsplit.passes.memory import bindings_from_values, evaluate_bytes, storage_root, value_bytes
from fxsplit.passes.placement import DEFER_MODES, Placement, place_weight_work
from fxsplit.passes.shared import OutputSubset, SharedNode, find_shared_nodes, split_shared_node
from fxsplit.passes.symbols import is_symbolic_scalar, missing_bindings

__all__ = ["MODES", "LiveIn", "SplitError", "SplitResult", "split_backward"]

MODES = ("input_gradients", "first_stage")


class SplitError(ValueError):
    """The backward graph does not have the shape the split expects."""


@dataclasses.dataclass(frozen=True)
class LiveIn:
    """One value that crosses from the dI graph to the dW graph.

    ``source`` is ``"input"`` for a backward-graph placeholder (a saved
    activation, a tangent or a SymInt) and ``"dI"`` for a value computed by
    the dI graph. ``nbytes`` is the bytes of the storage it keeps alive (a
    view's base), in the graph's size symbols (0 for anything but a tensor).
    """

    name: str
    source: str
    kind: str  # "tensor", "symint", "symfloat", "symbool" or "other" (an opaque object)
    nbytes: sympy.Expr = sympy.Integer(0)

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
    graph returns after its own outputs and the dW graph takes as placeholders:
    tensors and size scalars only. The dW graph's placeholders bind every size
    symbol its inputs and nodes mention. ``shared`` lists the nodes that
    computed outputs for both graphs and what the split did with each (an
    ``"unsplit"`` one is weight-gradient work that runs in dI).
    The graphs are fresh ``GraphModule``s; the input graph is not modified.

    ``mode`` says what dI computes: ``"input_gradients"`` (the input-gradient
    outputs and what they need) or ``"first_stage"`` (the graph has no
    input-gradient outputs: dI computes the activation-gradient chain and
    returns only live-ins, dW only the weight-gradient leaves named in
    ``leaves``; :mod:`fxsplit.passes.first_stage`).

    Placement (``placement``, :mod:`fxsplit.passes.placement`): with the
    default ``defer="matmuls"``, cheap weight reductions (bias gradients,
    LayerNorm/RMSNorm weight gradients: a ``sum``/``mean`` and the pointwise
    ops feeding it, over tensors dI produces or reads, with a small result) run
    in dI, fused with the kernels that produce their inputs, and their small
    results cross; dW still does every weight-gradient matmul. With
    ``defer="all"`` dI does no weight-gradient work (except ``"unsplit"``
    shared nodes).

    The cut (``cut``, :mod:`fxsplit.passes.cut`): the live-ins are chosen to
    hold the fewest bytes; dW recomputes the pointwise ops and views named in
    ``cut.recomputed`` (never a matmul) instead of receiving them.
    ``live_in_bytes_expr`` is the bytes the tensor live-ins hold, a sympy
    expression in the graph's size symbols, and ``all_crossing_bytes_expr``
    what handing over every value dW reads that dI has would hold; views of
    one storage count once, at their base's size
    (:mod:`fxsplit.passes.memory`).
    """

    di_graph: fx.GraphModule
    dw_graph: fx.GraphModule
    di_outputs: tuple[int, ...]
    dw_outputs: tuple[int, ...]
    live_ins: tuple[LiveIn, ...]
    num_outputs: int
    shared: tuple[SharedNode, ...] = ()
    mode: str = "input_gradients"
    placement: Placement = Placement()
    cut: Cut = Cut()
    leaves: WeightLeaves | None = None

    @property
    def weight_work_in_di(self) -> tuple[SharedNode, ...]:
        """Shared nodes no rule could split: their weight-gradient work runs in dI."""
        return tuple(s for s in self.shared if s.how == "unsplit")

    @property
    def num_live_ins(self) -> int:
        return len(self.live_ins)

    @property
    def live_in_bytes_expr(self) -> sympy.Expr:
        """Bytes the tensor live-ins hold, in the graph's size symbols."""
        return self.cut.held_bytes_expr

    @property
    def all_crossing_bytes_expr(self) -> sympy.Expr:
        """Bytes the all-crossing cut (every value dW reads that dI has) would hold."""
        return self.cut.all_crossing_bytes_expr

    def live_in_bytes(self, bindings: Mapping[sympy.Symbol, int]) -> int:
        """``live_in_bytes_expr`` at the sizes in ``bindings`` (e.g. from
        :meth:`live_in_bindings`). Raises ``ValueError`` naming any unbound symbol."""
        return evaluate_bytes(self.live_in_bytes_expr, bindings)

    def all_crossing_bytes(self, bindings: Mapping[sympy.Symbol, int]) -> int:
        """``all_crossing_bytes_expr`` at the sizes in ``bindings``."""
        return evaluate_bytes(self.all_crossing_bytes_expr, bindings)

    def live_in_bindings(self, values: Sequence[Any]) -> dict[sympy.Symbol, int]:
        """The size symbols' values for one microbatch, read off its live-in
        ``values`` (what dI returned after its outputs, in ``live_ins`` order)."""
        traced = [n.meta.get("val") for n in self.dw_graph.graph.find_nodes(op="placeholder")]
        return bindings_from_values(traced, values)

    def describe(self, bindings: Mapping[sympy.Symbol, int] | None = None) -> str:
        """A short human-readable summary (for logs and ``fxsplit.explain``);
        with ``bindings``, the bytes held are also evaluated at those sizes."""
        lines = []
        if self.mode == "first_stage":
            leaves = self.leaves.leaves if self.leaves is not None else ()
            lines.append(
                f"mode: first stage (no input gradients): dI runs the activation-gradient chain, "
                f"dW {len(leaves)} weight-gradient leaves"
            )
        lines += [
            f"dI outputs: {list(self.di_outputs)}",
            f"dW outputs: {list(self.dw_outputs)}",
            f"live-ins ({len(self.live_ins)}): " + ", ".join(map(str, self.live_ins)),
            f"live-in bytes: {self.live_in_bytes_expr} (all-crossing cut: {self.all_crossing_bytes_expr})",
        ]
        if bindings is not None:
            sizes = ", ".join(f"{k}={v}" for k, v in sorted(bindings.items(), key=lambda kv: str(kv[0])))
            lines.append(
                f"  at {sizes or 'these sizes'}: {self.live_in_bytes(bindings)} bytes "
                f"(all-crossing: {self.all_crossing_bytes(bindings)})"
            )
        if self.cut.recomputed:
            lines.append(f"recomputed in dW: {', '.join(self.cut.recomputed)}")
        if self.placement.reductions:
            lines.append(f"placement: {self.placement}")
        lines += [f"weight work in dI: {s}" for s in self.shared if s.how == "unsplit"]
        lines += [f"shared: {s}" for s in self.shared if s.how != "unsplit"]
        return "\n".join(lines)


def _kind(node: fx.Node) -> str:
    """What a live-in is. Raises :class:`SplitError` for a tuple or list: that
    would be a multi-output node crossing whole instead of its ``getitem``
    leaves, which compiled graphs cannot return."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "tensor"
    if isinstance(val, (torch.SymBool, bool)):
        return "symbool"
    if isinstance(val, (torch.SymInt, int)):
        return "symint"
    if isinstance(val, (torch.SymFloat, float)):
        return "symfloat"
    if isinstance(val, (tuple, list)):
        raise SplitError(
            f"value {node.name} ({node.target}) would cross from dI to dW as a "
            f"{type(val).__name__}; only tensors and SymInts can cross"
        )
    return "other"  # an opaque object (e.g. a compiled-autograd BackwardState)


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


def _di_closure(graph: fx.Graph, roots: Sequence[fx.Node]) -> set[fx.Node]:
    """Nodes dI runs: ancestors of ``roots``, plus side-effecting nodes (they
    must run exactly once, and dI always runs)."""
    impure = [n for n in graph.nodes if n.op == "call_function" and n.is_impure() and not n.users]
    return _ancestors([*roots, *impure])


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


def _movable_to_di(node: fx.Node, dw_nodes: Collection[fx.Node]) -> bool:
    """Whether ``node``, needed only by dW, is better computed in dI and crossed:
    nothing of what it reads is computed in dW, and it is free to compute and
    cheaper to hold than its inputs. That is a ``getitem`` of a node dI runs
    (its tensor crosses, not the tuple), or a size scalar computed from values
    dI has (a SymInt crosses, not the tensor dW would read only for its size;
    reading a tensor's data, as ``.item()`` does, is not a size computation).
    """
    if node.op != "call_function" or any(a in dw_nodes for a in node.all_input_nodes):
        return False
    if node.target is operator.getitem:
        return True
    if not is_symbolic_scalar(node):
        return False
    reads_tensor = any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)
    return not reads_tensor or node.target in _SIZE_QUERIES


_SIZE_QUERIES = frozenset(
    {
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_storage_offset.default,
    }
)


def _split_shared_nodes(
    graph: fx.Graph,
    di_roots: Sequence[fx.Node],
    dw_roots: Sequence[fx.Node],
    rule: OutputSubset | None,
) -> tuple[SharedNode, ...]:
    """Split, in place, every node dI runs that also computes outputs only dW reads."""
    di_nodes = _di_closure(graph, di_roots)
    dw_needed = _ancestors(dw_roots)
    return tuple(
        split_shared_node(graph, node, di_idx, dw_idx, rule)
        for node, di_idx, dw_idx in find_shared_nodes(graph, di_nodes, dw_needed)
    )


def split_backward(
    bw: fx.GraphModule,
    weight_outputs: Collection[int],
    rule: OutputSubset | None = None,
    *,
    defer: str = "matmuls",
) -> SplitResult:
    """Split ``bw`` so that outputs in ``weight_outputs`` are computed by a separate dW graph.

    ``weight_outputs`` are indices into the tuple ``bw`` returns (the gradients
    of weights); every other non-``None`` output is an input gradient and is
    computed by the dI graph. When there is no input gradient but some weight
    gradient, the graph is split as a first stage (``mode="first_stage"``, see
    :class:`SplitResult`). ``rule`` splits multi-output nodes that have no
    ``output_mask`` (see :data:`fxsplit.passes.shared.OutputSubset`).
    ``defer`` is the placement policy: ``"matmuls"`` (cheap weight reductions
    run in dI) or ``"all"`` (see :mod:`fxsplit.passes.placement`). Raises
    :class:`SplitError` if an index is out of range or the graph does not
    return a flat tuple, ``ValueError`` for an unknown ``defer``; either before
    any work.
    """
    if defer not in DEFER_MODES:
        raise ValueError(f"defer must be one of {DEFER_MODES}, got {defer!r}")
    _, rets = _output_nodes(bw)
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
    mode = "first_stage" if dw_outputs and not di_outputs else "input_gradients"

    # Work on a private copy: splitting shared nodes rewrites the graph.
    graph, rets = _copy_graph(bw.graph, rets)

    # 1-2. What dI computes (its roots), then divide the nodes computing for both sides.
    def di_roots() -> tuple[list[fx.Node], WeightLeaves | None]:
        if mode == "first_stage":
            leaves, frontier, _ = weight_leaves(graph)
            return frontier, leaves
        return [rets[i] for i in di_outputs], None

    roots, _ = di_roots()
    shared = _split_shared_nodes(graph, roots, [rets[i] for i in dw_outputs], rule)
    _, rets = _output_nodes_of(graph)  # a rule may have replaced an output node
    roots, leaves = di_roots()  # on the rewritten graph

    # dI: what its roots need. dW: what only the weight gradients need.
    di_nodes = _di_closure(graph, roots)
    placeholders = list(graph.find_nodes(op="placeholder"))
    dw_nodes = _ancestors([rets[i] for i in dw_outputs]) - di_nodes - set(placeholders)
    for n in graph.nodes:  # topological order, so chains of such nodes move together
        if n in dw_nodes and _movable_to_di(n, dw_nodes):
            dw_nodes.discard(n)
            di_nodes.add(n)

    # 3. Placement by cost: cheap weight reductions join dI.
    placement, moved = place_weight_work(graph, di_nodes, dw_nodes, defer)
    di_nodes |= moved
    dw_nodes -= moved

    # 4. The cut. dW needs every value dI has (its nodes or the backward's
    # inputs) that dW reads or returns; it receives the cheapest set of values
    # they can be computed from, and the SymInts that bind the size symbols it mentions.
    needed: set[fx.Node] = set()
    for n in dw_nodes:
        needed.update(a for a in n.all_input_nodes if a not in dw_nodes)
    needed.update(rets[i] for i in dw_outputs if rets[i] not in dw_nodes)
    cut, crossing, recomputed = choose_cut(graph, di_nodes | set(placeholders), needed)
    order = {n: k for k, n in enumerate(graph.nodes)}
    dw_body = sorted(dw_nodes | set(recomputed), key=order.__getitem__)
    bindings = missing_bindings(graph, crossing, dw_body)
    live_nodes = sorted({*crossing, *bindings}, key=order.__getitem__)
    live_ins = tuple(
        LiveIn(
            name=n.name,
            source="input" if n.op == "placeholder" else "dI",
            kind=_kind(n),
            nbytes=value_bytes(storage_root(n)),
        )
        for n in live_nodes
    )
    # dI runs what its outputs and the live-ins need: the cut may have made
    # some of its nodes unnecessary (dW recomputes them), and a binding SymInt
    # may come from a node neither side needed yet (an unbacked size).
    di_nodes = _di_closure(
        graph, [*(rets[i] for i in di_outputs), *(n for n in live_nodes if n.op != "placeholder")]
    )

    di = _build_di_graph(graph, placeholders, di_nodes, [rets[i] for i in di_outputs], live_nodes)
    dw = _build_dw_graph(live_nodes, dw_body, [rets[i] for i in dw_outputs])
    _narrow_output_descs(bw, di, dw, di_outputs, dw_outputs, len(live_nodes))
    di.lint()
    dw.lint()
    return SplitResult(
        di_graph=fx.GraphModule(bw, di, class_name="DIGraph"),
        dw_graph=fx.GraphModule(bw, dw, class_name="DWGraph"),
        di_outputs=di_outputs,
        dw_outputs=dw_outputs,
        live_ins=live_ins,
        num_outputs=num_outputs,
        shared=shared,
        mode=mode,
        placement=placement,
        cut=cut,
        leaves=leaves,
    )


def _output_nodes_of(graph: fx.Graph) -> tuple[fx.Node, list[Any]]:
    out = graph.output_node()
    return out, list(out.args[0])


def _build_di_graph(
    graph: fx.Graph,
    placeholders: Sequence[fx.Node],
    di_nodes: Collection[fx.Node],
    outputs: Sequence[fx.Node],
    live_nodes: Sequence[fx.Node],
) -> fx.Graph:
    """The dI graph: the backward's placeholders, ``di_nodes``; returns ``outputs`` then the live-ins."""
    di = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in placeholders:
        env[p] = di.node_copy(p)
    body = [n for n in graph.nodes if n in di_nodes and n.op not in ("placeholder", "output")]
    _copy_nodes(body, di, env)
    di.output(tuple(env[n] for n in (*outputs, *live_nodes)))
    return di


def _build_dw_graph(live_nodes: Sequence[fx.Node], body: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> fx.Graph:
    """The dW graph: the live-ins as placeholders (same names and values), ``body``; returns ``outputs``."""
    dw = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in live_nodes:
        ph = dw.placeholder(n.name)
        ph.meta = dict(n.meta)
        env[n] = ph
    _copy_nodes(body, dw, env)
    dw.output(tuple(env[n] for n in outputs))
    return dw


def _narrow_output_descs(
    bw: fx.GraphModule, di: fx.Graph, dw: fx.Graph, di_outputs: Sequence[int], dw_outputs: Sequence[int], num_live: int
) -> None:
    """AOTAutograd's output descriptors (``meta["desc"]``, one per backward
    output) narrowed to each graph's outputs (live-ins have none)."""
    descs = bw.graph.output_node().meta.get("desc")
    if isinstance(descs, (list, tuple)) and len(descs) == len(bw.graph.output_node().args[0]):
        di.output_node().meta["desc"] = [descs[i] for i in di_outputs] + [None] * num_live
        dw.output_node().meta["desc"] = [descs[i] for i in dw_outputs]
