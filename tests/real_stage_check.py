"""Check a pipeline stage at changing sequence lengths: B then W, ordinary
backward, eager autograd and FLOPs (issue 8, item 4).

:func:`check_stage` compiles a stage once with fxsplit (``fallback="error"``)
and runs it at the case's sequence lengths in a row, so Dynamo recompiles the
second with a dynamic sequence length (automatic dynamic shapes) and serves
the later ones from that. At every length:

* B then W (``fxsplit.stage_backward_input`` / ``stage_backward_weight``) and
  ordinary backward give the outputs, input gradients and every parameter's
  gradient of eager autograd on an identical copy (``assert_close``), and B
  leaves every ``.grad`` untouched;
* FLOPs(B) + FLOPs(W) == FLOPs(ordinary backward), per op, counted by
  ``FlopCounterMode`` with ``zoo.FLOP_FORMULAS`` for the ops it lacks;
* B does no weight-gradient matmul FLOPs (mm, addmm, bmm, grouped mm, the
  weight half of the custom expert op), W does all of them.

A case is anything with the attributes of :class:`zoo.StageCase`: ``name``,
``stage`` (``"middle"``: a tensor output fed a random gradient; ``"last"``: a
scalar loss), ``seqs``, ``make()``, ``inputs(seq)`` (the first input is the
activation requiring grad), ``context()`` and ``assert_close(got, want, msg)``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch._dynamo
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import fxsplit
import zoo
from zoo import clone_inputs

aten = torch.ops.aten


# ---------------------------------------------------------------- counting

Shapes = frozenset[tuple[int, ...]]
ATEN_MATMULS = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm)


@dataclasses.dataclass(frozen=True)
class Ops:
    """How to count a stage's ops: ``formulas`` for ``FlopCounterMode``'s
    ``custom_mapping``; ``custom_matmuls`` maps each custom matmul op to
    ``True`` when one call computes an input and a weight gradient together
    (half its FLOPs each), ``False`` for a forward-style op."""

    formulas: dict[Any, Any] = dataclasses.field(default_factory=lambda: dict(zoo.FLOP_FORMULAS))
    custom_matmuls: dict[Any, bool] = dataclasses.field(default_factory=lambda: dict(zoo.CUSTOM_MATMULS))

    def matmul_names(self) -> set[str]:
        return {str(p) for p in (*ATEN_MATMULS, *self.custom_matmuls)}

    def matmul_flops(self, func: Any, args: Sequence[Any], out: Any, weights: Shapes) -> tuple[int, int]:
        """(total, weight-gradient) FLOPs of one matmul call, (0, 0) for any other op.

        An ATen matmul is weight-gradient work when its result has one of the
        shapes in ``weights`` (see :func:`weight_shapes`): the stages' token
        counts equal no weight dimension, so no other matmul makes such a shape.
        """
        packet = func._overloadpacket
        if packet in self.custom_matmuls:
            total = self.formulas[packet](*(a.shape if isinstance(a, torch.Tensor) else a for a in args))
            return total, total // 2 if self.custom_matmuls[packet] else 0
        if packet is aten._grouped_mm:
            total = self.formulas[packet](args[0].shape, args[1].shape)
        elif packet in (aten.mm, aten.bmm):
            total = 2 * args[0].numel() * args[1].shape[-1]
        elif packet in (aten.addmm, aten.baddbmm):
            total = 2 * args[1].numel() * args[2].shape[-1]
        else:
            return 0, 0
        return total, total if tuple(out.shape) in weights else 0


def weight_shapes(module: nn.Module) -> Shapes:
    """The shapes of ``module``'s parameters, and with their last two dimensions
    swapped (a weight gradient may be computed transposed, and grouped expert
    weights may be stored as ``(experts, out, in)``)."""
    shapes = {tuple(p.shape) for p in module.parameters()}
    return frozenset(shapes | {s[:-2] + (s[-1], s[-2]) for s in shapes if len(s) >= 2})


class MatmulLedger(TorchDispatchMode):
    """Matmul FLOPs dispatched while active: ``total``, and the ``weight``-gradient part."""

    def __init__(self, ops: Ops, weights: Shapes) -> None:
        super().__init__()
        self.ops = ops
        self.weights = weights
        self.total = 0
        self.weight = 0
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        total, weight = self.ops.matmul_flops(func, args, out, self.weights)
        if total:
            self.total += total
            self.weight += weight
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            self.calls.append(f"{func}{shapes}: {total}{' (weight gradient)' if weight else ''}")
        return out


@dataclasses.dataclass
class Count:
    """What one backward phase dispatched: FLOPs per op, and its matmuls."""

    flops: collections.Counter
    matmul: MatmulLedger

    @property
    def total(self) -> int:
        return sum(self.flops.values())


@contextlib.contextmanager
def counting(ops: Ops, weights: Shapes) -> Iterator[Count]:
    """Count what the body dispatches. Only backward phases may run inside: a
    forward under a dispatch mode makes Dynamo run that frame eagerly from
    then on, which would take the compiled region out of the test."""
    counter = FlopCounterMode(display=False, custom_mapping=ops.formulas)
    ledger = MatmulLedger(ops, weights)
    result = Count(collections.Counter(), ledger)
    with counter, ledger:
        yield result
    result.flops.update({str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items() if n})


# ---------------------------------------------------------------- one step


class WeightWorkInB(AssertionError):
    """B did weight-gradient matmuls (a distinct failure, so an xfail can name it)."""



def _output_grad(c: Any, out: torch.Tensor, seq: int) -> torch.Tensor | None:
    """The gradient fed to the stage output: random for a middle stage, implicit for a loss."""
    if c.stage == "last":
        return None
    gen = torch.Generator().manual_seed(1000 + seq)
    return torch.randn(out.shape, generator=gen).to(out.dtype)


def _grads(module: nn.Module, inputs: Sequence[Any]) -> dict[str, torch.Tensor | None]:
    got: dict[str, torch.Tensor | None] = {
        f"input {k}": x.grad for k, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad
    }
    got.update({n: p.grad for n, p in module.named_parameters()})
    return got


def _assert_same(c: Any, what: str, got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert (g is None) == (w is None), f"{c.name} {what}: {name}.grad is {g is None=}, eager {w is None=}"
        if w is not None:
            c.assert_close(g, w, f"{c.name} {what}: {name}")


def _clear(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def _mark_seq_dynamic(inputs: Sequence[Any]) -> None:
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            torch._dynamo.mark_dynamic(x, 1)


def run_length(c: Any, ref: nn.Module, mod: nn.Module, cm: nn.Module, seq: int, ops: Ops, mark_dynamic: bool) -> None:
    """One sequence length: eager reference, B then W, ordinary backward, FLOPs."""
    inputs = c.inputs(seq)
    shapes = weight_shapes(mod)
    _clear(ref)
    _clear(mod)

    x_ref = clone_inputs(inputs)
    with c.context():
        out_ref = ref(*x_ref)
    grad = _output_grad(c, out_ref, seq)
    torch.autograd.backward(out_ref, grad)
    want = _grads(ref, x_ref)
    assert want["input 0"] is not None

    # B then W.
    x = clone_inputs(inputs)
    if mark_dynamic:
        _mark_seq_dynamic(x)
    with c.context():
        out = cm(*x)
    c.assert_close(out, out_ref, f"{c.name} output at seq {seq}")
    with counting(ops, shapes) as b:
        dinputs, work = fxsplit.stage_backward_input([out], None if grad is None else [grad], list(x), mod.parameters())
    written = [n for n, p in mod.named_parameters() if p.grad is not None]
    assert not written, f"B wrote .grad of {written}"
    with counting(ops, shapes) as w:
        fxsplit.stage_backward_weight(mod.parameters(), work)
    assert dinputs[0] is x[0].grad
    _assert_same(c, f"B+W at seq {seq}", _grads(mod, x), want)

    # Ordinary backward on the compiled module.
    _clear(mod)
    x = clone_inputs(inputs)
    if mark_dynamic:
        _mark_seq_dynamic(x)
    with c.context():
        out = cm(*x)
    with counting(ops, shapes) as fused:
        torch.autograd.backward(out, grad)
    _assert_same(c, f"ordinary backward at seq {seq}", _grads(mod, x), want)

    # No work duplicated, none of the weight-gradient matmuls in B.
    assert fused.total > 0 and fused.matmul.weight > 0, "the counters saw nothing; the test would be vacuous"
    assert b.flops + w.flops == fused.flops, f"seq {seq}: B={dict(b.flops)} W={dict(w.flops)} ordinary={dict(fused.flops)}"
    names = ops.matmul_names()
    for phase in (b, w, fused):
        counted = {op: n for op, n in phase.flops.items() if op in names}
        assert phase.matmul.total == sum(counted.values()), (
            f"the matmul ledger and FlopCounterMode disagree: {phase.matmul.calls} vs {counted}"
        )
    if b.matmul.weight:
        raise WeightWorkInB(f"seq {seq}: B did weight-gradient matmuls: {b.matmul.calls}")
    assert w.matmul.weight == fused.matmul.weight, f"seq {seq}: W={w.matmul.calls} ordinary={fused.matmul.calls}"


DYNAMIC = ("automatic", "mark", "always")


def check_stage(c: Any, compiler: str, ops: Ops | None = None, dynamic: str = "automatic", **backend_options: Any) -> None:
    """Compile ``c.make()`` with fxsplit and check it at every length of ``c.seqs`` (see the module docstring).

    ``dynamic`` says how the changing length is compiled: ``"automatic"``
    (automatic dynamic shapes: static regions at the first length, as many
    dynamic ones at the second, none after), ``"mark"`` (the sequence
    dimension of every input marked with ``torch._dynamo.mark_dynamic``) or
    ``"always"`` (``torch.compile(dynamic=True)``); with the last two only the
    first length compiles, dynamic. Also checks that every backward ran
    compiled: dI and dW once per B/W step; the fused graph (or dI and dW,
    with ``fused_backward=False``) once per ordinary backward.
    """
    assert dynamic in DYNAMIC, dynamic
    ops = ops or Ops()
    ref = c.make()
    mod = copy.deepcopy(ref)
    n_before = len(fxsplit.compiled_regions())
    backend = fxsplit.backend(compiler=compiler, fallback="error", **backend_options)
    cm = torch.compile(mod, backend=backend, dynamic=True if dynamic == "always" else None)
    first: list[Any] = []
    for k, seq in enumerate(c.seqs):
        run_length(c, ref, mod, cm, seq, ops, mark_dynamic=dynamic == "mark")
        if k == 0:
            first = fxsplit.compiled_regions()[n_before:]
            assert first, "nothing was compiled by fxsplit"

    regions = fxsplit.compiled_regions()[n_before:]
    n = len(first)
    if dynamic == "automatic":
        assert len(regions) == 2 * n, f"expected {n} static and {n} dynamic regions, got {len(regions)}"
        runs = [(r, 1) for r in regions[:n]] + [(r, len(c.seqs) - 1) for r in regions[n:]]
        dynamic_regions = regions[n:]
    else:
        assert len(regions) == n, f"recompiled after the first length: {len(regions)} regions, expected {n}"
        runs = [(r, len(c.seqs)) for r in regions]
        dynamic_regions = regions
    for r in dynamic_regions:
        placeholders = r.split.di_graph.graph.find_nodes(op="placeholder")
        assert any(isinstance(p.meta.get("val"), torch.SymInt) for p in placeholders), f"{r.name} is not dynamic"
    fused = backend_options.get("fused_backward", True)
    for r, steps in runs:
        want = {"fused_runs": steps, "di_runs": steps, "dw_runs": steps} if fused else {
            "fused_runs": 0, "di_runs": 2 * steps, "dw_runs": 2 * steps}
        assert r.stats == want, f"{r.name}: {r.stats}, expected {want}"
