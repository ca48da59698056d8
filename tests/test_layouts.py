"""Layouts where two compiled graphs meet: whatever the compiled dI
graph returns for a live-in or an input gradient (another rank, other strides,
a storage offset, a view of a larger buffer), W gives ordinary backward's
gradients.

The compiled dI is wrapped so that its outputs come back laid out otherwise
than the FX graph says, as Inductor's GPU-only mix-order reduction returns a
keep-dim ``sum`` of shape ``(1, n)`` as ``(n,)`` on torch 2.11. Then B then W
runs against ordinary backward on an identical copy (compiled and uncompiled).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.layouts import BoundaryGuard, LayoutMismatch, TensorLayout
from stage_check import new_regions


class NormMLP(nn.Module):
    """x + fc2(gelu(fc1(ln(x)))): its dI graph computes the LayerNorm weight and
    bias gradients and the Linear bias gradients (reductions over tokens), and
    hands them, with the activations the weight matmuls need, to dW."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def _other_rank(t: torch.Tensor) -> torch.Tensor:
    """The same values with another rank: size-1 dimensions dropped (a keep-dim
    reduction returned without them), else a leading 1 added."""
    squeezed = t.squeeze()
    return squeezed if squeezed.dim() != t.dim() else t.unsqueeze(0)


def _other_strides(t: torch.Tensor) -> torch.Tensor:
    """The same values laid out column-major (or, for 1-D, every second element of a buffer)."""
    if t.dim() >= 2:
        return t.mT.contiguous().mT
    buf = torch.empty(2 * t.numel(), dtype=t.dtype, device=t.device)
    view = buf[::2]
    view.copy_(t)
    return view


def _offset_view(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view of a larger buffer, at a storage offset."""
    buf = torch.empty(t.numel() + 7, dtype=t.dtype, device=t.device)
    view = buf[7:].view(t.shape)
    view.copy_(t)
    return view


def _flattened(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.dim() != 1 else t.unsqueeze(-1)


DISTORTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "rank": _other_rank,
    "strides": _other_strides,
    "offset": _offset_view,
    "flattened": _flattened,
}


def _distort_di(region: Any, distort: Callable[[torch.Tensor], torch.Tensor], outputs_too: bool) -> list[int]:
    """Wrap ``region``'s compiled dI so that every tensor it computes for dW (and,
    with ``outputs_too``, every input gradient) comes back distorted. Returns
    the positions distorted."""
    region.prepare_split()
    real = region._run_di
    split = region.split
    n = len(split.di_outputs)
    positions = [n + k for k, live in enumerate(split.live_ins) if live.source == "dI" and live.kind == "tensor"]
    if outputs_too:
        positions = list(range(n)) + positions

    def distorted(args: list[Any]) -> list[Any]:
        outs = list(real(args))
        for i in positions:
            if isinstance(outs[i], torch.Tensor):
                outs[i] = distort(outs[i])
        return outs

    region._run_di = distorted
    return positions


def _run_split(module: nn.Module, compiled: Any, xs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[Any]:
    params = list(module.parameters())
    pending = []
    dxs = []
    for x, g in zip(xs, grads):
        out = compiled(x)
        (dx,), work = fxsplit.stage_backward_input([out], [g], [x], params)
        dxs.append(dx)
        pending.append(work)
    for work in reversed(pending):  # B0 B1 W1 W0, as a zero-bubble schedule runs them
        fxsplit.stage_backward_weight(params, work)
    return dxs


def _run_ordinary(module: Callable[..., Any], xs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[Any]:
    dxs = []
    for x, g in zip(xs, grads):
        out = module(x)
        dxs.append(torch.autograd.grad([out], [x], [g], retain_graph=True)[0])
        torch.autograd.backward([out], [g])
    return dxs


COMPILERS = [pytest.param("eager", id="eager"), pytest.param("inductor", id="inductor", marks=pytest.mark.inductor)]


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("how", sorted(DISTORTIONS))
def test_distorted_live_ins_give_ordinary_gradients(compiler: str, how: str, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    base = NormMLP()
    mod, ref, ref_compiled = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    backend = fxsplit.backend(compiler=compiler)
    compiled = torch.compile(mod, backend=backend)
    ordinary_compiled = torch.compile(ref_compiled, backend=backend)
    xs = [torch.randn(2, 5, 16, requires_grad=True) for _ in range(2)]
    grads = [torch.randn(2, 5, 16) for _ in range(2)]
    before = fxsplit.compiled_regions()
    compiled(xs[0].detach().requires_grad_())  # compile
    (region,) = new_regions(before)
    positions = _distort_di(region, DISTORTIONS[how], outputs_too=how in ("rank", "flattened"))
    assert positions, "the stage must hand dW tensors computed in dI"

    with caplog.at_level(logging.INFO, logger="fxsplit"):
        dxs = _run_split(mod, compiled, [x.detach().requires_grad_() for x in xs], grads)
    ordinary = _run_ordinary(ordinary_compiled, [x.detach().requires_grad_() for x in xs], grads)
    eager = _run_ordinary(ref, [x.detach().requires_grad_() for x in xs], grads)

    for got, want, plain in zip(dxs, ordinary, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got, plain)
    for (name, p), q, r in zip(mod.named_parameters(), ref_compiled.parameters(), ref.parameters()):
        assert p.grad is not None, name
        assert p.grad.shape == p.shape and p.grad.stride() == q.grad.stride(), name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"{name} vs ordinary compiled backward")
        torch.testing.assert_close(p.grad, r.grad, msg=f"{name} vs eager autograd")

    # Never silent: every repaired boundary is listed, and said once. A view of a
    # larger buffer at an offset, with the expected sizes and strides, needs no
    # repair: compiled code reads it where it is.
    if how == "offset":
        assert not region.boundary.adapted
    else:
        assert region.boundary.adapted, "no boundary was reported as conformed"
    said = [r for r in caplog.records if "came back from the compiled dI graph" in r.getMessage()]
    assert len(said) == len(region.boundary.adapted), [r.getMessage() for r in said]


def test_rank_is_conformed_by_a_view_not_a_copy() -> None:
    """A keep-dim reduction returned without its size-1 dimension gets it back as a
    view of the same memory (what torch 2.11's mix-order reduction needs)."""
    value = torch.empty(1, 8)
    layout = TensorLayout(value)
    got = torch.arange(8.0)
    out, how = layout.conform(got)
    assert how == "view" and out.shape == (1, 8) and out.data_ptr() == got.data_ptr()
    transposed = torch.arange(12.0).view(3, 4).mT.contiguous().mT  # column-major 3x4
    out, how = TensorLayout(torch.empty(3, 4)).conform(transposed)
    assert how == "copy" and out.stride() == (4, 1)
    torch.testing.assert_close(out, transposed, rtol=0, atol=0)


def test_strides_of_size_one_dimensions_are_ignored() -> None:
    layout = TensorLayout(torch.empty(1, 8))
    assert layout.matches(torch.empty(8, 1).mT)  # (1, 8) with stride (1, 1)
    assert not layout.matches(torch.empty(8))


def test_symbolic_layouts_fix_rank_and_order() -> None:
    """With symbolic sizes the expected layout is its rank, its static size-1
    dimensions and its dimension order."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC, DimDynamic.STATIC])
    fake = mode.from_tensor(torch.empty(5, 1, 4), symbolic_context=ctx)
    layout = TensorLayout(fake)
    assert not layout.static and layout.rank == 3 and layout.ones == (1,)
    got = torch.arange(28.0).view(7, 4)  # the size-1 dimension dropped, another batch size
    assert not layout.matches(got)
    out, how = layout.conform(got)
    assert how == "view" and out.shape == (7, 1, 4)
    torch.testing.assert_close(out.reshape(7, 4), got, rtol=0, atol=0)
    column_major = torch.arange(28.0).view(7, 4).mT.contiguous().mT.unsqueeze(1)
    assert not layout.matches(column_major)
    out, how = layout.conform(column_major)
    assert how == "copy" and layout.matches(out)


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_a_broadcast_layout_is_conformed_by_its_first_element(symbolic: bool) -> None:
    """A consumer compiled for an expanded value (stride 0 along a dimension
    of size 8) reads one element along it; a materialized tensor of the same
    values (Inductor's choice on one side of the boundary) is not that
    layout, and is conformed to it: one copy of index 0 along the broadcast
    dimension, no overlapping write. With symbolic sizes, density alone
    took the materialized tensor for the expected layout (fuzz seed 52 with
    Inductor: the dW graph's ``assert_size_stride`` failed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    column = torch.empty(6, 1)
    if symbolic:
        mode = FakeTensorMode(shape_env=ShapeEnv())
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
        column = mode.from_tensor(column, symbolic_context=ctx)
    layout = TensorLayout(column.expand(column.shape[0], 8))  # stride (1, 0)
    assert layout.zeros == (1,) and layout.static is not symbolic
    values = torch.arange(5.0 if symbolic else 6.0).unsqueeze(1)  # (another batch size where symbolic)
    materialized = values.expand(-1, 8).contiguous()  # stride (8, 1)
    assert not layout.matches(materialized)
    out, how = layout.conform(materialized)
    assert how == "copy" and out.stride() == (1, 0) and layout.matches(out)
    torch.testing.assert_close(out, materialized, rtol=0, atol=0)
    assert layout.matches(values.expand(-1, 8))  # an expand as compiled for: as it is


def test_a_symbolic_slice_of_a_wider_buffer_is_checked_at_its_strides() -> None:
    """A consumer compiled for ``h[..., :4]`` of a symbolic ``(s0, s1, 8)``
    expects strides ``(8*s1, 8, 1)``: not dense. Given the symbols' values
    (the sizes the dW graph receives as integers), the view as compiled
    passes as it is, and a dense copy of the same values is conformed to
    those strides. Density alone took it the other way round (fuzz seed 247
    with Inductor: the guard copied the right view into a dense tensor, and
    the dW graph's ``assert_size_stride`` failed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC, DimDynamic.STATIC])
    fake = mode.from_tensor(torch.empty(2, 5, 8), symbolic_context=ctx)
    s0, s1 = fake.shape[0], fake.shape[1]
    guard = BoundaryGuard("region3", [s0, s1, fake[..., :4]], ["s0", "s1", "live-in slice_4"])
    h = torch.randn(3, 4, 8)
    as_compiled = [3, 4, h[..., :4]]
    assert guard(as_compiled)[2] is as_compiled[2] and not guard.adapted
    dense = [3, 4, h[..., :4].contiguous()]
    out = guard(dense)[2]
    assert out.stride() == (32, 8, 1) and "live-in slice_4" in guard.adapted
    torch.testing.assert_close(out, h[..., :4], rtol=0, atol=0)


def test_symbolic_sizes_of_other_functions_are_evaluated_too() -> None:
    """A size Inductor writes with a floor division (``s0 // 2`` from an
    unflatten) is evaluated by sympy at the symbol's value; without a value
    for its symbol the layout has no exact sizes (density decides)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    fake = mode.from_tensor(torch.empty(6, 8), symbolic_context=ctx)
    with mode:
        halves = fake.unflatten(0, (2, -1))  # (2, s0 // 2, 8)
    layout = TensorLayout(halves)
    (name,) = {str(s) for e in layout.exprs[0] for s in getattr(e, "free_symbols", ())}
    assert layout.exact({name: 10}) == ((2, 5, 8), (40, 8, 1))
    assert layout.exact({}) is None and layout.exact({"another": 10}) is None
    assert layout.matches(torch.empty(2, 5, 8), {name: 10}) and not layout.matches(torch.empty(2, 6, 8), {name: 10})


class SliceOfCat(nn.Module):
    """``cat([h[..., :4] * w[:4], h[..., 4:]])``: dW reads ``h[..., :4]``, a
    slice of ``h`` (width 8), as the dI graph returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.cat([h[..., :4] * self.w[:4], h[..., 4:]], -1)


@pytest.mark.inductor
def test_a_dynamic_region_whose_live_in_is_a_slice_gives_ordinary_gradients() -> None:
    """Inductor, symbolic batch and sequence sizes: the live-in ``h[..., :4]``
    comes back from dI as the strided view dW was compiled for, and crosses
    as it is, at every shape; B then W is ordinary backward on compiled and
    uncompiled copies."""
    torch.manual_seed(0)
    model = SliceOfCat()
    ordinary, eager = copy.deepcopy(model), copy.deepcopy(model)
    before = fxsplit.compiled_regions()
    fn = torch.compile(model, backend=fxsplit.backend(compiler="inductor"), dynamic=True)
    ref = torch.compile(ordinary, backend=fxsplit.backend(compiler="inductor"), dynamic=True)
    params = list(model.parameters())
    for b, t in ((2, 5), (3, 4), (4, 7)):
        x, g = torch.randn(b, t, 8), torch.randn(b, t, 8)
        xs = [x.clone().requires_grad_() for _ in range(3)]
        (dx,), work = fxsplit.stage_backward_input([fn(xs[0])], [g], [xs[0]], params)
        fxsplit.stage_backward_weight(params, work)
        ref(xs[1]).backward(g)
        eager(xs[2]).backward(g)
        torch.testing.assert_close(dx, xs[1].grad)
        torch.testing.assert_close(dx, xs[2].grad)
    for p, q, e in zip(model.parameters(), ordinary.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        torch.testing.assert_close(p.grad, e.grad)
    split = [r for r in new_regions(before) if r.stats["di_runs"]]
    assert len(split) == 1 and split[0].stats["dw_runs"] == 3 and split[0].boundary.adapted == {}


def test_another_number_of_elements_is_a_clear_error() -> None:
    guard = BoundaryGuard("region9", [torch.empty(1, 8)], ["live-in sum_1"])
    with pytest.raises(LayoutMismatch, match=r"region9: live-in sum_1 came back .* size \(9,\)"):
        guard([torch.empty(9)])


@pytest.mark.parametrize("how", ["rank", "strides", "flattened"])
def test_distorted_live_ins_with_symbolic_sizes(how: str) -> None:
    """A region compiled for symbolic sequence lengths: the expected layouts are
    symbolic, and each length is conformed at its own sizes. Flattened, a
    value with two symbolic sizes is given its shape from the sizes the dW
    graph receives as integers, which cross the same boundary."""
    torch.manual_seed(0)
    base = NormMLP()
    mod, ref = copy.deepcopy(base), copy.deepcopy(base)
    compiled = torch.compile(mod, backend=fxsplit.backend(compiler="eager"), dynamic=True)
    before = fxsplit.compiled_regions()
    compiled(torch.randn(2, 5, 16, requires_grad=True))
    (region,) = new_regions(before)
    assert region.graphs.dynamic
    _distort_di(region, DISTORTIONS[how], outputs_too=how != "strides")
    xs = [torch.randn(2, t, 16, requires_grad=True) for t in (5, 9, 3)]
    grads = [torch.randn(2, t, 16) for t in (5, 9, 3)]
    dxs = _run_split(mod, compiled, [x.detach().requires_grad_() for x in xs], grads)
    eager = _run_ordinary(ref, [x.detach().requires_grad_() for x in xs], grads)
    for got, want in zip(dxs, eager):
        torch.testing.assert_close(got, want)
    for p, r in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad)
    assert region.boundary.adapted


def test_a_layout_that_cannot_be_told_is_a_clear_error() -> None:
    """A value that cannot be what its consumer was compiled for: flattened
    with two symbolic sizes whose values nothing crossing the boundary tells,
    or holding another number of elements. The guard raises naming the
    region and the value; from B, no .grad is touched."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC, DimDynamic.STATIC])
    fake = mode.from_tensor(torch.empty(2, 5, 16), symbolic_context=ctx)
    guard = BoundaryGuard("region7", [fake], ["live-in mul_3"])
    with pytest.raises(LayoutMismatch, match=r"region7: live-in mul_3 came back .* size \(336,\)"):
        guard([torch.empty(3 * 7 * 16)])

    mod = NormMLP()
    compiled = torch.compile(mod, backend=fxsplit.backend(compiler="eager"), dynamic=True)
    before = fxsplit.compiled_regions()
    compiled(torch.randn(2, 5, 16, requires_grad=True))
    (region,) = new_regions(before)
    _distort_di(region, lambda t: t.reshape(-1)[1:], outputs_too=True)
    x = torch.randn(3, 7, 16, requires_grad=True)
    out = compiled(x)
    with pytest.raises(RuntimeError, match=r"region\d+: the gradient of input \d+ came back from the compiled dI graph"):
        fxsplit.stage_backward_input([out], [torch.randn_like(out)], [x], list(mod.parameters()))
    assert x.grad is None and all(p.grad is None for p in mod.parameters())


@pytest.mark.parametrize("compiler", COMPILERS)
def test_layouts_that_change_after_steps_as_compiled_are_still_checked(compiler: str) -> None:
    """B and W check a region's layouts with one C call once they have seen
    them as compiled for (the dI outputs, the weight gradients an empty
    ``.grad`` takes). Layouts that change after such steps (dI's live-ins and
    input gradients of another rank, weight gradients in another layout than
    their weight's) are still conformed, and ``.grad`` still gets the weight's
    layout, as after ordinary backward."""
    torch.manual_seed(0)
    base = NormMLP()
    mod, ref = copy.deepcopy(base), copy.deepcopy(base)
    backend = fxsplit.backend(compiler=compiler)
    compiled, ordinary = torch.compile(mod, backend=backend), torch.compile(ref, backend=backend)
    params = list(mod.parameters())
    before = fxsplit.compiled_regions()
    x = torch.randn(2, 5, 16)
    g = torch.randn(2, 5, 16)
    for step in range(4):
        if step == 3:  # as compiled for three times; now every layout changes
            (region,) = new_regions(before)
            _distort_di(region, _other_rank, outputs_too=True)
            real_dw = region._run_dw

            def column_major(t: torch.Tensor) -> torch.Tensor:  # not a view: a tensor of its own
                return torch.empty_strided(t.shape, (1, t.shape[0]), dtype=t.dtype).copy_(t)

            def other_layouts(live_ins: list[Any]) -> list[Any]:
                return [column_major(t) if isinstance(t, torch.Tensor) and t.dim() == 2 else t
                        for t in real_dw(live_ins)]

            region._run_dw = other_layouts
        for p, q in zip(params, ref.parameters()):
            p.grad = q.grad = None
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        (dx,), work = fxsplit.stage_backward_input([compiled(xa)], [g], [xa], params)
        fxsplit.stage_backward_weight(params, work)
        ordinary(xb).backward(g)
        torch.testing.assert_close(dx, xb.grad, rtol=0, atol=0)
        for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
            assert p.grad is not None and p.grad.stride() == q.grad.stride() == p.stride(), (step, name)
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"step {step}: {name}")
    assert region.boundary.adapted, "the changed dI layouts were not reported"


def test_boundary_guard_checks_again_after_its_fast_path_misses() -> None:
    """The one-call check a guard builds after exact matches passes exactly those
    layouts; anything else goes through the full check (and is conformed)."""
    expected = [torch.empty(1, 8), torch.empty(3, 4)]
    guard = BoundaryGuard("region", expected, ["a", "b"])
    for _ in range(2):
        values = [torch.randn(1, 8), torch.randn(3, 4)]
        assert guard(list(values))[0] is values[0]
    bent = [torch.randn(8), torch.randn(3, 4).mT.contiguous().mT]
    out = guard(list(bent))
    assert out[0].shape == (1, 8) and out[1].stride() == (4, 1)
    torch.testing.assert_close(out[1], bent[1], rtol=0, atol=0)
    assert set(guard.adapted) == {"a", "b"}


def test_storage_pointer_without_a_storage_object() -> None:
    from fxsplit import _torch_internals as ti

    buf = torch.randn(40)
    for t in (buf, buf[7:], buf[3:].view(37)[5:], buf.view(5, 8).mT, torch.empty(0)):
        assert ti.storage_ptr(t) == t.untyped_storage().data_ptr()


@pytest.mark.parametrize("compiler", COMPILERS)
def test_what_can_change_between_steps_is_decided_again_every_w(compiler: str) -> None:
    """Once W has planned its commits and taken every gradient of a region as
    it is (decided over the weights at once), what can change between steps
    without any layout changing is still guarded every time: a tensor hook, a
    post-accumulate-grad hook, a ``.grad`` left from the step before each make
    W plan again. Each step's gradients, ``.grad`` tensors and hook calls are
    those of ordinary backward on an identical copy; where nothing changed, W
    replays its plan and takes the gradients in one decision."""
    from fxsplit import pending

    torch.manual_seed(0)
    # No biases: a bias gradient may be a view of a live-in (eager compiler),
    # which W never takes as it is.
    base = nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.Linear(32, 16, bias=False),
                         nn.Tanh(), nn.Linear(16, 16, bias=False))
    mod, ref = copy.deepcopy(base), copy.deepcopy(base)
    backend = fxsplit.backend(compiler=compiler)
    compiled, ordinary = torch.compile(mod, backend=backend), torch.compile(ref, backend=backend)
    params, refs = list(mod.parameters()), list(ref.parameters())
    x, g = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    calls: dict[str, list[Any]] = {"split": [], "ordinary": []}
    handles: list[Any] = []
    planned: list[int] = []
    per_weight: list[int] = []
    real_plan, real_layout = pending.plan_commits, pending._in_weight_layout

    def planning(*args: Any) -> Any:
        planned.append(1)
        return real_plan(*args)

    def deciding(*args: Any) -> Any:
        per_weight.append(1)
        return real_layout(*args)

    pending.plan_commits, pending._in_weight_layout = planning, deciding
    try:
        for step in range(7):
            keep = step == 4  # .grad of params[2] left from step 3: accumulated into
            for k, (p, q) in enumerate(zip(params, refs)):
                if not (keep and k == 2):
                    p.grad = q.grad = None
            if step == 2:  # a tensor hook that changes the gradient
                for who, w in (("split", params[0]), ("ordinary", refs[0])):
                    handles.append(w.register_hook(lambda t, who=who: calls[who].append(("hook", t.clone())) or t * 2))
            if step == 3:  # a post-accumulate-grad hook
                for who, w in (("split", params[1]), ("ordinary", refs[1])):
                    handles.append(w.register_post_accumulate_grad_hook(
                        lambda p, who=who: calls[who].append(("post", p.grad.clone()))))
            if step == 5:
                for h in handles:
                    h.remove()
                handles.clear()
            planned.clear()
            per_weight.clear()
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            (dx,), work = fxsplit.stage_backward_input([compiled(xa)], [g], [xa], params)
            fxsplit.stage_backward_weight(params, work)
            ordinary(xb).backward(g)
            torch.testing.assert_close(dx, xb.grad, rtol=0, atol=0)
            for (name, p), q in zip(mod.named_parameters(), refs):
                assert p.grad.stride() == q.grad.stride(), (step, name)
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"step {step}: {name}")
            for kind in ("hook", "post"):  # autograd orders no hooks of different weights
                mine = [t for k, t in calls["split"] if k == kind]
                theirs = [t for k, t in calls["ordinary"] if k == kind]
                assert len(mine) == len(theirs), (step, kind)
                for a, b in zip(mine, theirs):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
            if step in (1, 5, 6):  # nothing observes the accumulation: all taken, as they are
                assert sorted(work.handed_over) == list(range(len(params))), step
            # planned at the first step and where a hook or a .grad came or went, else replayed
            assert len(planned) == (step in (0, 2, 3, 4)), step
            if step in (1, 6):  # ... and taken behind the layout guard (step 5 makes it for the whole set again)
                assert not per_weight, step
            if step in (2, 3):  # the others' gradients: their layouts checked weight by weight
                assert per_weight, step
            if step in (2, 3, 4):  # the weight that changed goes the way autograd would
                assert {2: 0, 3: 1, 4: 2}[step] not in work.handed_over, step
        assert sorted(k for k, _ in calls["split"]) == ["hook"] * 3 + ["post"] * 2
    finally:
        pending.plan_commits, pending._in_weight_layout = real_plan, real_layout
        for h in handles:
            h.remove()


class TransposedExperts(nn.Module):
    """Expert weights stored ``(experts, out, in)`` and multiplied transposed,
    as transformers stores an MoE's (a grouped matmul with
    ``w.transpose(1, 2)``): each one's gradient comes out of the dW graph
    transposed, not in its weight's layout, and autograd copies it into the
    weight's. Between two plain Linears, whose gradients W takes as they are."""

    def __init__(self, experts: int = 3, dim: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, dim, dim) / 4)
        self.down = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h = torch.ops.fxsplit_test.expert_mm(self.up(x), self.experts.transpose(1, 2), offs)
        return self.down(torch.tanh(h))


@pytest.mark.parametrize("compiler", COMPILERS)
def test_gradients_in_another_layout_than_their_weights_are_decided_once(compiler: str) -> None:
    """Which of a region's weight gradients have their weight's layout is
    decided at the first W and read behind the layout guard at every W
    after it, also where one does not (it goes to autograd's engine, which
    copies it into the weight's layout): no later W checks the weights one
    by one (before: every W did, for every weight of the region). Every W
    gives ordinary backward's gradients and ``.grad`` strides on an
    identical copy."""
    import zoo  # noqa: F401 - registers fxsplit_test::expert_mm and its split rule
    from fxsplit import pending

    torch.manual_seed(0)
    base = TransposedExperts()
    mod, ref = copy.deepcopy(base), copy.deepcopy(base)
    backend = fxsplit.backend(compiler=compiler)
    compiled, ordinary = torch.compile(mod, backend=backend), torch.compile(ref, backend=backend)
    params, refs = list(mod.parameters()), list(ref.parameters())
    offs = torch.tensor([3, 3, 10])  # (an expert without tokens)
    per_weight: list[bool] = []
    real_layout = pending._in_weight_layout

    def deciding(*args: Any) -> bool:
        per_weight.append(real_layout(*args))
        return per_weight[-1]

    pending._in_weight_layout = deciding
    try:
        for step in range(4):
            for p, q in zip(params, refs):
                p.grad = q.grad = None
            per_weight.clear()
            x, g = torch.randn(10, 16), torch.randn(10, 16)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            (dx, _), work = fxsplit.stage_backward_input([compiled(xa, offs)], [g], [xa, offs], params)
            fxsplit.stage_backward_weight(params, work)
            ordinary(xb, offs).backward(g)
            torch.testing.assert_close(dx, xb.grad)
            for (name, p), q in zip(mod.named_parameters(), refs):
                assert p.grad.stride() == q.grad.stride(), (step, name)
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step}: {name}: {m}")
            assert sorted(work.handed_over) == [1, 2], step  # (experts, parameter 0: through the engine)
            assert sorted(per_weight) == ([False, True, True] if step == 0 else []), (step, per_weight)
    finally:
        pending._in_weight_layout = real_layout


def test_storage_pointers_in_bulk() -> None:
    """``storage_ptrs``: each plain tensor's storage, other values skipped, in
    bulk where every tensor starts its storage and per tensor otherwise."""
    from fxsplit import _torch_internals as ti

    buf, other = torch.randn(40), torch.randn(3, 4)
    at_start = [buf, None, other.mT, 3, torch.empty(0)]
    assert ti.storage_ptrs(at_start) == {t.untyped_storage().data_ptr() for t in at_start if isinstance(t, torch.Tensor)}
    offset = [buf[7:], other, buf.view(5, 8)[1:].mT]
    assert ti.storage_ptrs(offset) == {buf.untyped_storage().data_ptr(), other.untyped_storage().data_ptr()}
    assert ti.storage_ptrs([]) == set()


@pytest.mark.parametrize("compiler", COMPILERS)
def test_input_gradients_count_as_held_only_where_they_are_live_ins(compiler: str) -> None:
    """W does not take as it is a dW output that shares storage with a tensor
    someone else holds. An input gradient B returned is such a tensor only
    where it is also a live-in (a dW output can share storage only with its
    inputs): one that is not may be freed after B and its memory become a dW
    output's, which W must still take as autograd would."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False)
    ref = copy.deepcopy(lin)  # ordinary backward, uncompiled
    compiled = torch.compile(lin, backend=fxsplit.backend(compiler=compiler))
    params = list(lin.parameters())
    for _ in range(2):
        lin.weight.grad = ref.weight.grad = None
        x, g = torch.randn(8, 8), torch.randn(8, 8)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        (dx,), work = fxsplit.stage_backward_input([compiled(xa)], [g], [xa], params)
        (record,) = work.compiled
        held = record.held_elsewhere
        assert dx.untyped_storage().data_ptr() not in held
        assert held <= record.live_in_storages()
        del dx, xa  # the input gradient is freed before W: its memory is free for W's outputs
        fxsplit.stage_backward_weight(params, work)
        assert work.handed_over == [0]
        ref(xb).backward(g)
        torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


class _ScaledShift(nn.Module):
    """``(x + shift) * 2``: the input gradient and the shift's gradient are
    the same tensor of the backward graph (``2 * g``), computed in dI, a
    live-in of dW, and dW's output as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.shift) * 2


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_weight_gradient_that_is_an_input_gradient_is_copied_as_autograd_does(compiler: str) -> None:
    """W reads the storages of every live-in only where a dW output shares
    one with an input gradient (``CompiledWeightWork.holds_none_of``); where
    it does, the gradient is someone else's and ``.grad`` gets a copy, as
    after ordinary backward. ``holds_none_of`` answers as
    ``held_elsewhere`` does for the storages of every value involved."""
    torch.manual_seed(0)
    model = _ScaledShift()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxsplit.backend(compiler=compiler, fallback="error"))
    params = list(model.parameters())
    for step in range(3):
        model.shift.grad = ref.shift.grad = None
        x, g = torch.randn(4, 8), torch.randn(4, 8)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        (dx,), work = fxsplit.stage_backward_input([compiled(xa)], [g], [xa], params)
        if step == 2:  # W as it runs on the earlier steps (nothing read before), here inspected first
            (record,) = work.compiled
            ptrs = record.live_in_storages() | {dx.untyped_storage().data_ptr(), 0}
            answers = [record.holds_none_of({p}) for p in ptrs]  # before held_elsewhere is read (and kept)
            assert answers == [p not in record.held_elsewhere for p in ptrs]
            assert dx.untyped_storage().data_ptr() in record.held_elsewhere  # dx is a live-in
        fxsplit.stage_backward_weight(params, work)
        ref(xb).backward(g)
        torch.testing.assert_close(model.shift.grad, ref.shift.grad)
        torch.testing.assert_close(xa.grad, xb.grad)
        assert model.shift.grad.untyped_storage().data_ptr() != xa.grad.untyped_storage().data_ptr()
        assert (model.shift.grad.untyped_storage().data_ptr() == xb.grad.untyped_storage().data_ptr()) == (
            ref.shift.grad.untyped_storage().data_ptr() == xb.grad.untyped_storage().data_ptr()
        )


def _mlp_step() -> Callable[[bool], None]:
    """One microbatch of a new fxsplit-compiled Linear-GELU-Linear: B then W
    (``True``) or ordinary backward, ``.grad`` emptied first, the gradients
    checked against ordinary backward on an uncompiled copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxsplit.backend(fallback="error"))
    params = list(model.parameters())

    def step(split: bool) -> None:
        for p, q in zip(params, ref.parameters()):
            p.grad = q.grad = None
        x, g = torch.randn(4, 8), torch.randn(4, 8)
        xa = x.clone().requires_grad_()
        out = compiled(xa)
        if split:
            _, work = fxsplit.stage_backward_input([out], [g], [xa], params)
            fxsplit.stage_backward_weight(params, work)
        else:
            out.backward(g)
        ref(x).backward(g)
        for p, q in zip(params, ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)

    return step


@pytest.mark.inductor
def test_graphs_are_called_past_their_wrapper_only_while_no_one_records_each_call() -> None:
    """From a graph's second call on, the region calls Inductor's generated
    code directly (``_torch_internals.generated_call``), except while the
    profiler is on: then every dI, dW and fused call is one ``## Call
    CompiledFxGraph`` event, as with Inductor's own backward. Gradients as
    after ordinary backward on an uncompiled copy throughout."""
    from torch.profiler import ProfilerActivity, profile

    step = _mlp_step()
    before = fxsplit.compiled_regions()
    for _ in range(3):
        step(split=True)
        step(split=False)
    (region,) = [r for r in fxsplit.compiled_regions() if r not in before]
    for kind in ("dI", "dW", "fused"):
        wrapper = region._compiled[kind]
        assert region._callable(kind) is wrapper.current_callable, kind
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(split=True)
        step(split=True)
        step(split=False)
    calls = [e for e in prof.events() if e.name.startswith("## Call CompiledFxGraph")]
    # the compiled forward's three calls, and the backward graphs': 2 x (dI, dW) and one fused
    assert len(calls) == 3 + 5, [e.name for e in calls]


@pytest.mark.inductor
def test_graphs_are_called_through_their_wrapper_while_inductor_records_execution_order() -> None:
    """While Inductor records the order graphs run in
    (``torch._inductor.debug.record_and_log_graph_execution_order``), every
    dI, dW and fused call goes through ``CompiledFxGraph.__call__`` and is in
    that record, past their second call too."""
    from torch._inductor import debug

    if not hasattr(debug, "record_and_log_graph_execution_order"):
        pytest.skip(f"torch {torch.__version__} has no graph execution record")
    step = _mlp_step()
    for _ in range(3):
        step(split=True)
        step(split=False)
    with debug.record_and_log_graph_execution_order():
        step(split=True)
        step(split=False)
        order = list(debug.GRAPH_EXECUTION_ORDER)
    # per step the forward, then dI and dW, or the fused backward
    assert len(order) == 2 + 2 + 1, order


def test_accumulating_dw_graphs_are_called_past_their_wrapper_too() -> None:
    """The dW variant that accumulates into ``.grad`` (every microbatch after a
    step's first) is called as dI and dW are: Inductor's generated code from
    its third call on, through its wrapper while the profiler records each
    call. Gradients as after ordinary backward on an uncompiled copy."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxsplit.backend(fallback="error"))
    params = list(model.parameters())

    def microbatch() -> None:
        x, g = torch.randn(4, 8), torch.randn(4, 8)
        xa = x.clone().requires_grad_()
        _, work = fxsplit.stage_backward_input([compiled(xa)], [g], [xa], params)
        fxsplit.stage_backward_weight(params, work)
        assert work.accumulated_in_graph or all(p.grad is not None for p in params)
        ref(x).backward(g)
        for p, q in zip(params, ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)

    before = fxsplit.compiled_regions()
    for _ in range(5):  # the first takes an empty .grad; four accumulate
        microbatch()
    (region,) = [r for r in fxsplit.compiled_regions() if r not in before]
    keys = [k for k in region._compiled if not isinstance(k, str)]
    assert len(keys) == 1 and region.accumulating_runs == 4
    assert region._inner.get(keys[0]) is region._compiled[keys[0]].current_callable
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        microbatch()
    calls = [e for e in prof.events() if e.name.startswith("## Call CompiledFxGraph")]
    assert len(calls) == 3, [e.name for e in calls]  # forward, dI, accumulating dW


def test_metadata_guard_passes_exactly_the_metadata_it_was_made_on_also_with_a_tensor_given_twice() -> None:
    """The C-level check the boundary guard and W keep: a tensor at two
    positions (a dI output that is also a live-in) must be the same object
    there again; any other change of metadata fails it."""
    from fxsplit._torch_internals import _tensor_guards_class, metadata_guard

    if _tensor_guards_class() is None:
        pytest.skip("this torch has no usable TensorGuards class")
    a, b = torch.zeros(2, 3), torch.zeros(3, 2).mT
    guard = metadata_guard([a, b, a])
    assert guard is not None
    a2, b2 = torch.ones(2, 3), torch.ones(3, 2).mT
    assert guard(a2, b2, a2)
    assert not guard(a2, b2, torch.ones(2, 3))  # the same metadata, but not the same tensor again
    assert not guard(a2, torch.ones(2, 3), a2)  # other strides
    assert not guard(a2.double(), b2, a2.double())  # another dtype
    assert not guard(a2, b2, b2)


def test_boundary_guard_guards_a_call_that_passed_in_an_accepted_layout() -> None:
    """Values that pass without being conformed, in a layout the consumer
    accepts though not the compiled one (a size-1 dimension's stride), and a
    tensor at two positions: the next call with that metadata is checked in one
    C call; a value that then needs conforming is still conformed."""
    expected = [torch.empty(1, 8), torch.empty(4, 8)]
    guard = BoundaryGuard("region", [*expected, expected[1]], ["a", "b", "c"])
    odd = torch.empty(8, 1).t()  # shape (1, 8), strides (1, 1): accepted, not exact
    assert odd.stride() != expected[0].stride()
    x = torch.randn(4, 8)
    assert guard([odd, x, x]) == [odd, x, x]
    assert guard._fast_state == "on"
    y = torch.randn(4, 8)
    values = [torch.empty(8, 1).t(), y, y]
    assert all(a is b for a, b in zip(guard(list(values)), values))
    wrong = torch.randn(8, 4).t()  # (4, 8) column-major: conformed to the compiled layout
    got = guard([torch.empty(8, 1).t(), wrong, wrong])
    assert got[1].stride() == (8, 1) and torch.equal(got[1], wrong)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_grad_sharing_storage_with_what_the_dw_graph_reads_is_accumulated_after_it(compiler: str) -> None:
    """A ``.grad`` that shares storage with the stage input, which the weight's
    gradient is computed from (a live-in of the dW graph): W does not add into
    it inside that graph (it would overwrite what the graph still reads) but
    through autograd's accumulation after it, as ordinary backward does, in
    place; the bias beside it is still accumulated in the graph. ``.grad``,
    its storage and the input's values after are ordinary backward's
    (compiled and uncompiled copies)."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    ref, eager = copy.deepcopy(lin), copy.deepcopy(lin)
    backend = fxsplit.backend(compiler=compiler, fallback="error")
    fns = (torch.compile(lin, backend=backend), torch.compile(ref, backend=backend), eager)
    params = list(lin.parameters())
    for _ in range(3):
        x, g = torch.randn(8, 8), torch.randn(8, 8)
        seen = []
        for m, fn in zip((lin, ref, eager), fns):
            xi = x.clone().requires_grad_()
            out = fn(xi)
            m.weight.grad, m.bias.grad = xi.detach(), torch.ones(8)
            if m is lin:
                _, work = fxsplit.stage_backward_input([out], [g], [xi], params)
                fxsplit.stage_backward_weight(params, work)
                assert work.accumulated_in_graph == [1]
            else:
                out.backward(g)
            seen.append((m.weight.grad.data_ptr() == xi.data_ptr(), m.weight.grad, m.bias.grad, xi.detach()))
        for other in seen[1:]:
            assert seen[0][0] == other[0]
            for a, b in zip(seen[0][1:], other[1:]):
                torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_dw_graph_returning_one_tensor_for_two_gradients_gives_each_weight_its_own(compiler: str) -> None:
    """Two weights whose gradients are equal, and a dW graph that returns one
    tensor for both (numerically the same values: Inductor may): W takes
    neither as it is, and each weight gets a ``.grad`` of its own, as in
    ordinary backward (where the graph returns two)."""

    class Twin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Parameter(torch.ones(6)), nn.Parameter(torch.ones(6))
            self.lin = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x * self.a + x * self.b)

    torch.manual_seed(0)
    model = Twin()
    ref, eager = copy.deepcopy(model), copy.deepcopy(model)
    backend = fxsplit.backend(compiler=compiler, fallback="error")
    fn, ref_fn = torch.compile(model, backend=backend), torch.compile(ref, backend=backend)
    before = fxsplit.compiled_regions()
    fn(torch.randn(5, 6, requires_grad=True))
    (region,) = [r for r in fxsplit.compiled_regions() if r not in before]
    region.prepare_split()
    real = region._run_dw
    (a_out, b_out) = (region.weight_grads[k].positions[0] for k in (0, 1))

    def one_for_both(args: list[Any]) -> list[Any]:
        outs = list(real(args))
        outs[b_out] = outs[a_out]
        return outs

    region._run_dw = one_for_both
    params = list(model.parameters())
    for _ in range(2):
        for p in (*params, *ref.parameters(), *eager.parameters()):
            p.grad = None
        x, g = torch.randn(5, 6), torch.randn(5, 6)
        _, work = fxsplit.stage_backward_input([fn(xa := x.clone().requires_grad_())], [g], [xa], params)
        fxsplit.stage_backward_weight(params, work)
        ref_fn(x.clone().requires_grad_()).backward(g)
        eager(x.clone().requires_grad_()).backward(g)
        assert model.a.grad.untyped_storage().data_ptr() != model.b.grad.untyped_storage().data_ptr()
        for other in (ref, eager):
            for p, q in zip(params, other.parameters()):
                torch.testing.assert_close(p.grad, q.grad, **({} if other is ref else {"rtol": 2e-5, "atol": 1e-5}))
                assert p.grad.stride() == q.grad.stride()
        assert 0 not in work.handed_over and 1 not in work.handed_over
