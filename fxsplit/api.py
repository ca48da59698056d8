"""Public split-backward API: a drop-in for ``torch.distributed.pipelining._backward``.

``stage_backward_input`` (B) computes the gradients of the stage inputs and
does no weight-gradient work; ``stage_backward_weight`` (W) does that work
later and accumulates into ``.grad``; ``stage_backward`` is the full
backward. fxsplit-compiled regions are split by their compiled dI/dW
graphs; everything else by the eager reverse closure (:mod:`fxsplit.fallback`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from fxsplit.fallback import EagerWeightPlan, gradient_edge, plan_eager_weight_work
from fxsplit.runtime import CompiledWeightWork, InputPhase, WeightPhase, active_phase

log = logging.getLogger("fxsplit")

__all__ = ["PendingWeightGrads", "stage_backward", "stage_backward_input", "stage_backward_weight"]

Output = torch.Tensor | GradientEdge


class PendingWeightGrads:
    """The W work B leaves for one microbatch of one stage.

    Returned by :func:`stage_backward_input` in the place of upstream's
    ``param_groups`` and consumed, exactly once, by :func:`stage_backward_weight`.
    It holds only what W needs: the live-ins of each compiled region, and for
    eager code the gradients saved at the intermediates (and the autograd
    nodes below them).
    """

    def __init__(
        self,
        weights: Sequence[torch.Tensor],
        compiled: list[CompiledWeightWork],
        plan: EagerWeightPlan,
        saved_grads: list[tuple[torch.Tensor | None, ...] | None],
        root_edges: list[GradientEdge],
        root_grads: list[torch.Tensor],
    ) -> None:
        self._weights = tuple(weights)
        self.compiled = compiled
        self.plan = plan
        self.saved_grads = saved_grads
        self.root_edges = root_edges
        self.root_grads = root_grads
        self.done = False

    # upstream's param_groups is a list; keep len() meaningful for callers that check it
    def __len__(self) -> int:
        return len(self.compiled) + len(self.plan.intermediates) + len(self.root_edges)

    @property
    def pending(self) -> bool:
        return not self.done

    @property
    def live_in_bytes(self) -> int:
        """Bytes held for W: compiled live-ins plus saved eager gradients."""
        total = sum(r.live_in_bytes for r in self.compiled)
        for grads in list(self.saved_grads) + [tuple(self.root_grads)]:
            for g in grads or ():
                if isinstance(g, torch.Tensor):
                    total += g.numel() * g.element_size()
        return total

    def summary(self) -> str:
        """Which path each part of this stage takes: a line for logs and debugging."""
        regions = ", ".join(sorted({r.region for r in self.compiled})) or "none"
        return (
            f"compiled W work: {len(self.compiled)} region call(s) ({regions}); "
            f"eager W work: {len(self.plan.eager_weights)} weight(s) via "
            f"{len(self.plan.intermediates)} intermediate node(s) and {len(self.root_edges)} output edge(s); "
            f"held for W: {self.live_in_bytes} bytes"
            + ("" if not self.done else " [done]")
        )

    def __repr__(self) -> str:
        return f"PendingWeightGrads({self.summary()})"

    def _release(self) -> None:
        self.done = True
        self.compiled = []
        self.plan = EagerWeightPlan([], [], [])
        self.saved_grads = []
        self.root_edges = []
        self.root_grads = []


# Outputs B has already run on (B twice on them is an error). Weak: no lifetime extension.
_b_done: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()


def _flatten_outputs(outputs: Any, grads: Any, where: str = "stage output") -> tuple[list[Output], list[Any]]:
    """Pair every tensor (or GradientEdge) in a nested output with its gradient.

    ``grads`` is ``None`` (all gradients implicit) or has the same structure
    as ``outputs``. Outputs that do not require grad are dropped.
    """
    outs: list[Output] = []
    gs: list[Any] = []

    def visit(o: Any, g: Any, path: str) -> None:
        if isinstance(o, GradientEdge):
            outs.append(o)
            gs.append(g)
        elif isinstance(o, torch.Tensor):
            if not o.requires_grad and o.grad_fn is None:
                return
            if g is not None and not isinstance(g, torch.Tensor):
                raise TypeError(f"fxsplit: gradient for {path} must be a Tensor or None, got {type(g).__name__}")
            outs.append(o)
            gs.append(g)
        elif isinstance(o, (list, tuple)):
            if g is not None and (not isinstance(g, (list, tuple)) or len(g) != len(o)):
                got = f"{type(g).__name__} of length {len(g)}" if isinstance(g, (list, tuple)) else type(g).__name__
                raise ValueError(f"fxsplit: output_grads for {path} must be a sequence of length {len(o)}, got {got}")
            for k, item in enumerate(o):
                visit(item, None if g is None else g[k], f"{path}[{k}]")
        elif isinstance(o, dict):
            if g is not None and (not isinstance(g, dict) or set(g) != set(o)):
                raise ValueError(f"fxsplit: output_grads for {path} must be a dict with keys {sorted(map(str, o))}")
            for k, item in o.items():
                visit(item, None if g is None else g[k], f"{path}[{k!r}]")
        # anything else (ints, strings, None) carries no gradient

    visit(outputs, grads, where)
    return outs, gs


def _check_grads(outs: Sequence[Output], grads: list[Any]) -> list[torch.Tensor]:
    """Validate gradients against outputs; fill implicit ones for scalars. Raises before any work."""
    checked: list[torch.Tensor] = []
    for k, (o, g) in enumerate(zip(outs, grads)):
        if isinstance(o, GradientEdge):
            if g is None:
                raise ValueError(
                    f"fxsplit: stage output {k} is a GradientEdge; an explicit output gradient is required for it"
                )
            checked.append(g)
            continue
        if g is None:
            if o.numel() != 1:
                raise ValueError(
                    f"fxsplit: no gradient given for stage output {k} of shape {tuple(o.shape)}; "
                    "an implicit gradient exists only for scalar outputs (a loss)"
                )
            g = torch.ones_like(o)
        if g.shape != o.shape:
            raise ValueError(
                f"fxsplit: output gradient {k} has shape {tuple(g.shape)} but the stage output has shape "
                f"{tuple(o.shape)}"
            )
        if g.dtype != o.dtype:
            raise ValueError(
                f"fxsplit: output gradient {k} has dtype {g.dtype} but the stage output has dtype {o.dtype}"
            )
        if g.requires_grad:
            raise NotImplementedError(
                "fxsplit: output gradients that require grad (create_graph=True / double backward) "
                "are not supported through a split backward"
            )
        checked.append(g)
    return checked


def _as_output_list(stage_outputs_or_loss: Any) -> Any:
    if isinstance(stage_outputs_or_loss, (torch.Tensor, GradientEdge)):
        return [stage_outputs_or_loss]
    return stage_outputs_or_loss


def stage_backward_input(
    stage_outputs_or_loss: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    weights: Iterable[torch.Tensor] | Iterator[torch.nn.Parameter],
) -> tuple[tuple[torch.Tensor | None, ...], PendingWeightGrads]:
    """B: gradients of the stage inputs, with no weight-gradient work.

    Same signature and ``.grad`` effects as
    ``torch.distributed.pipelining._backward.stage_backward_input``: returns
    ``(dinputs, param_groups)`` with ``dinputs[i]`` the gradient of
    ``input_values[i]`` (``None`` for non-tensors and inputs that need no
    gradient), accumulates each dinput into its input's ``.grad``, leaves every
    weight's ``.grad`` untouched, and detaches the (non-view) stage outputs.
    ``param_groups`` is a :class:`PendingWeightGrads` to pass to
    :func:`stage_backward_weight` exactly once.

    ``stage_outputs_or_loss`` may be a tensor, a ``GradientEdge``, or a nested
    list/tuple/dict of them; ``output_grads`` is ``None`` (scalar losses) or has
    the same structure. Raises ``ValueError``/``TypeError`` before doing any
    work if the gradients do not match the outputs, and ``RuntimeError`` if B
    already ran on these outputs.
    """
    weights = list(weights)
    for w in weights:
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"fxsplit: weights must be tensors, got {type(w).__name__}")
    outs_raw = _as_output_list(stage_outputs_or_loss)
    outs, grads_raw = _flatten_outputs(outs_raw, output_grads)
    grads = _check_grads(outs, grads_raw)
    for o in outs:
        if isinstance(o, torch.Tensor) and o in _b_done:
            raise RuntimeError(
                "fxsplit: stage_backward_input already ran on this stage output; B runs once per microbatch"
            )

    out_edges = [gradient_edge(o) for o in outs]
    grad_inputs = [
        (k, v) for k, v in enumerate(input_values) if isinstance(v, torch.Tensor) and v.requires_grad
    ]
    input_nodes = [gradient_edge(v).node for _, v in grad_inputs] if outs else []
    plan = plan_eager_weight_work(out_edges, input_nodes, weights)

    saved: list[tuple[torch.Tensor | None, ...] | None] = [None] * len(plan.intermediates)
    handles = []
    for k, node in enumerate(plan.intermediates):

        def save(grad_outputs: tuple[torch.Tensor | None, ...], k: int = k) -> None:
            saved[k] = tuple(grad_outputs)

        handles.append(node.register_prehook(save))

    phase = InputPhase()
    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
    try:
        if grad_inputs and outs:
            with active_phase(phase):
                results = torch.autograd.grad(
                    [o for o in outs],
                    [v for _, v in grad_inputs],
                    grad_outputs=grads,
                    retain_graph=bool(plan.intermediates),
                    allow_unused=True,
                )
            for (k, _), g in zip(grad_inputs, results):
                dinputs[k] = g
    except Exception as e:
        raise RuntimeError(f"fxsplit: stage_backward_input failed: {e}") from e
    finally:
        for h in handles:
            h.remove()

    for v, g in zip(input_values, dinputs):
        if g is not None:
            if v.grad is None:
                v.grad = g
            else:
                v.grad += g

    work = PendingWeightGrads(
        weights,
        phase.records,
        plan,
        saved,
        [out_edges[k] for k in plan.w_roots],
        [grads[k] for k in plan.w_roots],
    )
    for o in outs:
        if isinstance(o, torch.Tensor):
            _b_done.add(o)
            if not o._is_view() and o.grad_fn is not None:
                o.detach_()
    log.debug("fxsplit: B done: %s", work.summary())
    return tuple(dinputs), work


def stage_backward_weight(
    weights: Iterable[torch.Tensor] | Iterator[torch.nn.Parameter],
    param_groups: PendingWeightGrads,
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """W: weight gradients for the microbatch ``param_groups`` came from, accumulated into ``.grad``.

    ``weights`` must be the weights given to the matching
    :func:`stage_backward_input`. Compiled regions run their dW graphs on the
    saved live-ins; eager code runs autograd from the saved intermediate
    gradients (``retain_graph`` is passed to that autograd call). All
    gradients are computed before any ``.grad`` is touched. Returns the
    weights' ``.grad`` after accumulation.

    Raises ``TypeError`` if ``param_groups`` did not come from
    :func:`stage_backward_input`, ``RuntimeError`` if W already ran for it, and
    ``ValueError`` if ``weights`` differ from B's; in each case nothing changes.
    """
    weights = list(weights)
    if not isinstance(param_groups, PendingWeightGrads):
        raise TypeError(
            "fxsplit: stage_backward_weight needs the param_groups returned by fxsplit.stage_backward_input "
            f"for the same microbatch (W with no matching B); got {type(param_groups).__name__}"
        )
    work = param_groups
    if work.done:
        raise RuntimeError("fxsplit: stage_backward_weight already ran for these param_groups; W runs once per B")
    given = {id(w) for w in weights}
    expected = {id(w) for w in work._weights}
    if given != expected:
        extra = sum(1 for w in weights if id(w) not in expected)
        missing = sum(1 for w in work._weights if id(w) not in given)
        raise ValueError(
            "fxsplit: stage_backward_weight got weights that differ from those given to stage_backward_input "
            f"({extra} not part of the stage's B, {missing} missing); pass the same weights to B and W"
        )

    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    plan = work.plan
    if plan.eager_weights:
        edges: list[GradientEdge] = []
        edge_grads: list[torch.Tensor] = []
        for node, grads in zip(plan.intermediates, work.saved_grads):
            for i, g in enumerate(grads or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    edge_grads.append(g)
        edges.extend(work.root_edges)
        edge_grads.extend(work.root_grads)
        # Pin each intermediate's incoming gradient to what B saved, so a path
        # from one intermediate through another is not counted twice.
        handles = [
            node.register_prehook(lambda _g, sg=grads: sg)
            for node, grads in zip(plan.intermediates, work.saved_grads)
            if grads is not None
        ]
        try:
            if edges:
                with active_phase(WeightPhase()):
                    dws = torch.autograd.grad(
                        edges, plan.eager_weights, grad_outputs=edge_grads,
                        retain_graph=retain_graph, allow_unused=True,
                    )
                pairs.extend((w, g) for w, g in zip(plan.eager_weights, dws) if g is not None)
        finally:
            for h in handles:
                h.remove()
    for record in work.compiled:
        pairs.extend(record.run())

    work._release()
    _accumulate(pairs)
    return tuple(w.grad for w in weights)


def _accumulate(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``.grad`` += g for each pair, never letting two ``.grad``s (or a ``.grad``
    and a tensor someone else holds) share storage."""
    seen: set[int] = set()
    for p, g in pairs:
        if p.grad is None:
            if id(g) in seen or g._base is not None:
                g = g.clone()
            seen.add(id(g))
            p.grad = g
        else:
            p.grad += g


def stage_backward(
    stage_output: Any,
    output_grads: Any,
    input_values: Sequence[Any],
    outputs_with_grads_idxs: list[int] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Full backward of a stage (B and W together), as upstream's ``stage_backward``.

    Accumulates into every weight's ``.grad`` and returns the gradients of
    ``input_values`` (``None`` for non-tensors), clearing the inputs' ``.grad``
    as upstream does. fxsplit-compiled regions run their fused backward.
    """
    if outputs_with_grads_idxs is not None:
        stage_output = [stage_output[i] for i in outputs_with_grads_idxs]
        output_grads = [output_grads[i] for i in outputs_with_grads_idxs]
    outs, grads_raw = _flatten_outputs(stage_output, output_grads)
    grads = _check_grads(outs, grads_raw) if outs else []
    if outs:
        torch.autograd.backward([o for o in outs], grad_tensors=grads)
    result: list[torch.Tensor | None] = []
    for v in input_values:
        if isinstance(v, torch.Tensor):
            result.append(v.grad)
            v.grad = None
        else:
            result.append(None)
    return tuple(result)
