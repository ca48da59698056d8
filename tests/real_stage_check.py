"""Check a pipeline stage at changing sequence lengths: B then W, ordinary
backward, eager autograd and FLOPs.

:func:`check_stage` compiles a stage once with fxsplit (``fallback="error"``)
and runs it at the case's sequence lengths in a row, so Dynamo recompiles the
second with a dynamic sequence length (automatic dynamic shapes) and serves
the later ones from that. At every length:

* B then W (``fxsplit.stage_backward_input`` / ``stage_backward_weight``) and
  ordinary backward give the outputs, input gradients and every parameter's
  gradient of eager autograd on an identical copy (``assert_close``), and B
  leaves every ``.grad`` untouched;
* FLOPs(B) + FLOPs(W) == FLOPs(ordinary backward), per op, counted by
  ``FlopCounterMode`` with ``zoo.FLOP_FORMULAS`` for the ops it lacks (the
  two halves a split rule computes are counted under the op they split, see
  :meth:`Ops.fold`);
* B does no weight-gradient matmul FLOPs (mm, addmm, bmm, grouped mm, the
  weight-gradient half of a split expert op, or the weight half of an
  unsplit one), W does all of them;
* the counters are not blind: ordinary backward's weight-gradient matmuls
  cover every ``nn.Linear`` weight and every expert weight of the stage.

A case is anything with the attributes of :class:`zoo.StageCase`: ``name``,
``stage`` (``"middle"``: a tensor output fed a random gradient; ``"last"``: a
scalar loss), ``seqs``, ``make()``, ``inputs(seq)`` (the first input is the
activation requiring grad), ``context()`` and ``assert_close(got, want, msg)``;
optionally ``region_calls``, the most times one region may run per forward (1).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch._dynamo
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry, shape_wrapper

import fxsplit
import zoo
from stage_check import new_regions
from zoo import clone_inputs

aten = torch.ops.aten


# ---------------------------------------------------------------- counting

Shapes = frozenset[tuple[int, ...]]
ATEN_MATMULS = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm)


@dataclasses.dataclass(frozen=True)
class Ops:
    """How to count a stage's ops.

    ``formulas``: ``FlopCounterMode``'s ``custom_mapping`` (shapes in, FLOPs
    out) for the ops its registry lacks. ``weight_share``: every custom matmul
    op (any op not in :data:`ATEN_MATMULS` whose FLOPs are matmul work),
    mapped to the share of its FLOPs that is weight-gradient work: 0 for a
    forward or input-gradient op, 1/2 for one call computing an input and a
    weight gradient together, 1 for a weight-gradient op. Its FLOPs come from
    ``formulas`` or else from torch's FLOP registry. ``rule_halves``: each op
    a split rule computes, mapped to the op the rule splits (see
    :meth:`fold`).
    """

    formulas: dict[Any, Any] = dataclasses.field(default_factory=lambda: dict(zoo.FLOP_FORMULAS))
    weight_share: dict[Any, Fraction] = dataclasses.field(default_factory=lambda: dict(zoo.WEIGHT_SHARE))
    rule_halves: dict[Any, Any] = dataclasses.field(default_factory=lambda: dict(zoo.RULE_HALVES))

    def matmul_names(self) -> set[str]:
        return {str(p) for p in (*ATEN_MATMULS, *self.weight_share)}

    def fold(self, flops: collections.Counter) -> collections.Counter:
        """``flops`` (per op name) with each rule half's FLOPs counted under the
        op it came from. A split rule replaces one op by two (the whole op runs
        in ordinary backward's fused graph, its input-gradient half in B and its
        weight-gradient half in W), so only the folded counts can be compared
        op by op; every other op is compared as counted."""
        names = {str(half): str(whole) for half, whole in self.rule_halves.items()}
        folded: collections.Counter = collections.Counter()
        for op, n in flops.items():
            folded[names.get(op, op)] += n
        return folded

    def custom_flops(self, packet: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
        """A custom matmul's FLOPs, by the formula ``FlopCounterMode`` uses for it."""
        if packet in self.formulas:
            formula = shape_wrapper(self.formulas[packet])
        elif packet in flop_registry:
            formula = flop_registry[packet]
        else:
            raise KeyError(f"no FLOP formula for the custom matmul {packet}: add one to Ops.formulas")
        return formula(*args, **kwargs, out_val=out)

    def matmul_flops(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any, weights: Shapes
    ) -> tuple[int, int]:
        """(total, weight-gradient) FLOPs of one matmul call, (0, 0) for any other op.

        An ATen matmul is weight-gradient work when its result has one of the
        shapes in ``weights`` (see :func:`weight_shapes`): the stages' token
        counts equal no weight dimension, so no other matmul makes such a shape
        (:class:`MatmulLedger` also leaves out a matmul that reads a weight,
        which a per-expert token count may still make).
        """
        packet = func._overloadpacket
        if packet in self.weight_share:
            total = self.custom_flops(packet, args, kwargs, out)
            weight = total * self.weight_share[packet]
            assert weight.denominator == 1, f"{packet}: {total} FLOPs, weight share {self.weight_share[packet]}"
            return total, int(weight)
        if packet is aten._grouped_mm:
            total = self.custom_flops(packet, args, kwargs, out)
        elif packet in (aten.mm, aten.bmm):
            total = 2 * args[0].numel() * args[1].shape[-1]
        elif packet in (aten.addmm, aten.baddbmm):
            total = 2 * args[1].numel() * args[2].shape[-1]
        else:
            return 0, 0
        return total, total if tuple(out.shape) in weights else 0


def weight_shapes(module: nn.Module) -> Shapes:
    """The shapes of ``module``'s parameters and of one expert of each grouped
    expert weight (3 or more dimensions: ``weight[e]``, whose gradient a model
    looping over its experts computes one matmul per expert), each also with
    its last two dimensions swapped (a weight gradient may be computed
    transposed, and grouped expert weights may be stored as ``(experts, out, in)``)."""
    shapes = {tuple(p.shape) for p in module.parameters()}
    shapes |= {s[1:] for s in shapes if len(s) >= 3}
    return frozenset(shapes | {_swapped(s) for s in shapes if len(s) >= 2})


def weight_storages(module: nn.Module) -> frozenset[int]:
    """The storages of ``module``'s parameters: a matmul reading one (the weight
    itself, a transpose, an expert's slice) is forward or input-gradient work."""
    return frozenset(p.untyped_storage().data_ptr() for p in module.parameters())


def _computed(shape: tuple[int, ...], outputs: set[tuple[int, ...]]) -> bool:
    """Whether the gradient of a weight of ``shape`` came out of matmuls with
    these ``outputs``: whole, or one expert at a time, either possibly transposed."""
    return any(s in outputs or _swapped(s) in outputs for s in (shape, *([shape[1:]] if len(shape) >= 3 else [])))


def _swapped(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[:-2] + (shape[-1], shape[-2])


def matmul_weights(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The parameters whose gradient is matmul work: every ``nn.Linear``'s
    weight and every parameter of 3 or more dimensions (grouped expert
    weights), by name. Each must show up as a weight-gradient matmul output
    in ordinary backward, or the FLOP checks would not be looking at it."""
    found = {f"{m}.weight".lstrip("."): tuple(mod.weight.shape) for m, mod in module.named_modules()
             if isinstance(mod, nn.Linear) and mod.weight.requires_grad}
    found.update({n: tuple(p.shape) for n, p in module.named_parameters() if p.dim() >= 3 and p.requires_grad})
    return found


class MatmulLedger(TorchDispatchMode):
    """Matmul FLOPs dispatched while active: ``total``, and the ``weight``-gradient part."""

    def __init__(self, ops: Ops, weights: Shapes, storages: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.ops = ops
        self.weights = weights
        self.storages = storages
        self.total = 0
        self.weight = 0
        self.calls: list[str] = []
        self.weight_outputs: set[tuple[int, ...]] = set()  # shapes of the weight gradients computed

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        total, weight = self.ops.matmul_flops(func, args, kwargs, out, self.weights)
        if weight and func._overloadpacket not in self.ops.weight_share and any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages for a in args
        ):
            weight = 0  # (it reads a weight: a token count made the weight's shape)
        if total:
            self.total += total
            self.weight += weight
            if weight:
                outs = out if isinstance(out, (tuple, list)) else (out,)
                self.weight_outputs |= {tuple(o.shape) for o in outs if tuple(o.shape) in self.weights}
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
def counting(ops: Ops, weights: Shapes, storages: frozenset[int] = frozenset()) -> Iterator[Count]:
    """Count what the body dispatches. Only backward phases may run inside: a
    forward under a dispatch mode makes Dynamo run that frame eagerly from
    then on, which would take the compiled region out of the test."""
    counter = FlopCounterMode(display=False, custom_mapping=ops.formulas)
    ledger = MatmulLedger(ops, weights, storages)
    result = Count(collections.Counter(), ledger)
    with counter, ledger:
        yield result
    result.flops.update({str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items() if n})


# ---------------------------------------------------------------- one step


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
    storages = weight_storages(mod)
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
    with counting(ops, shapes, storages) as b:
        dinputs, work = fxsplit.stage_backward_input([out], None if grad is None else [grad], list(x), mod.parameters())
    written = [n for n, p in mod.named_parameters() if p.grad is not None]
    assert not written, f"B wrote .grad of {written}"
    with counting(ops, shapes, storages) as w:
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
    with counting(ops, shapes, storages) as fused:
        torch.autograd.backward(out, grad)
    _assert_same(c, f"ordinary backward at seq {seq}", _grads(mod, x), want)

    # No work duplicated, none of the weight-gradient matmuls in B.
    assert fused.total > 0 and fused.matmul.weight > 0, "the counters saw nothing; the test would be vacuous"
    unseen = {n: s for n, s in matmul_weights(mod).items() if not _computed(s, fused.matmul.weight_outputs)}
    assert not unseen, f"seq {seq}: no weight-gradient matmul counted for {unseen}: {fused.matmul.calls}"
    assert ops.fold(b.flops) + ops.fold(w.flops) == ops.fold(fused.flops), (
        f"seq {seq}: B={dict(b.flops)} W={dict(w.flops)} ordinary={dict(fused.flops)}"
    )
    names = ops.matmul_names()
    for phase in (b, w, fused):
        counted = {op: n for op, n in phase.flops.items() if op in names}
        assert phase.matmul.total == sum(counted.values()), (
            f"the matmul ledger and FlopCounterMode disagree: {phase.matmul.calls} vs {counted}"
        )
    assert b.matmul.weight == 0, f"seq {seq}: B did weight-gradient matmuls: {b.matmul.calls}"
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
    compiled: dI and dW once per B/W step (dI only, for a region with no
    weight gradients); the fused graph (or dI and dW, with
    ``fused_backward=False``) once per ordinary backward.
    """
    assert dynamic in DYNAMIC, dynamic
    ops = ops or Ops()
    ref = c.make()
    mod = copy.deepcopy(ref)
    before = fxsplit.compiled_regions()  # held: regions are compared by identity (the registry is weak)
    backend = fxsplit.backend(compiler=compiler, fallback="error", **backend_options)
    cm = torch.compile(mod, backend=backend, dynamic=True if dynamic == "always" else None)
    first: list[Any] = []
    for k, seq in enumerate(c.seqs):
        run_length(c, ref, mod, cm, seq, ops, mark_dynamic=dynamic == "mark")
        if k == 0:
            first = new_regions(before)
            assert first, "nothing was compiled by fxsplit"

    regions = new_regions(before)
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
    most = getattr(c, "region_calls", 1)
    for r, steps in runs:
        # W runs a region's dW graph only when it has weight gradients to give:
        # a region without any (a loss after a graph break) is done after B.
        # A region may run k times per forward (k <= the case's region_calls:
        # one compiled block after a graph break that a model calls twice).
        k = max(1, r.stats["di_runs"] // (steps if fused else 2 * steps))
        assert k <= most, f"{r.name}: {r.stats} is {k} runs per step, the case allows {most}"
        w_steps = k * steps if r.split.dw_outputs else 0
        want = {"fused_runs": k * steps, "di_runs": k * steps, "dw_runs": w_steps} if fused else {
            "fused_runs": 0, "di_runs": 2 * k * steps, "dw_runs": k * steps + w_steps}
        assert r.stats == want, f"{r.name}: {r.stats}, expected {want}"
