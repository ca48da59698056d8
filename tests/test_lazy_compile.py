"""Compile what is used: a region compiles its fused backward
on the first ordinary backward and its dI/dW pair on the first B, never with
the forward (unless ``lazy_compile=False``).

Inner compiles are counted by wrapping the backend's inner compiler, and
cross-checked with ``region.compiled_graphs`` / ``region.compile_seconds``;
every run's gradients are compared with ordinary backward on an identical copy.
"""

from __future__ import annotations

import collections
import copy
import importlib
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit
from zoo import TwoLinear

fxbackend = importlib.import_module("fxsplit.backend")  # the module: fxsplit.backend is also the function


MLP = TwoLinear


@pytest.fixture
def inner_compiles(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Counts the backend's inner compiles of backward graphs by kind (``dI``, ``dW``,
    ``fused``, ``dW+accumulate``), at the place every one of them goes through."""
    counts: collections.Counter[str] = collections.Counter()
    original = fxbackend._RegionGraphs.compile
    original_acc = fxbackend._RegionGraphs.compile_accumulating

    def compile(self: Any, kind: str) -> Any:
        counts[kind] += 1
        return original(self, kind)

    def compile_accumulating(self: Any, positions: Any, grads: Any) -> Any:
        counts["dW+accumulate"] += 1
        return original_acc(self, positions, grads)

    monkeypatch.setattr(fxbackend._RegionGraphs, "compile", compile)
    monkeypatch.setattr(fxbackend._RegionGraphs, "compile_accumulating", compile_accumulating)
    return counts


def data(n: int, rows: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    return [(torch.randn(rows, 6, generator=gen), torch.randn(rows, 6, generator=gen)) for _ in range(n)]


def split_step(fn: Any, params: list[torch.Tensor], x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    xi = x.clone().requires_grad_()
    (dx,), work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
    fxsplit.stage_backward_weight(params, work)
    return dx


def ordinary_step(fn: Any, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    xi = x.clone().requires_grad_()
    fn(xi).backward(g)
    return xi.grad


def check(model: nn.Module, ref: nn.Module, dxs: list[torch.Tensor], ref_dxs: list[torch.Tensor]) -> None:
    for dx, r in zip(dxs, ref_dxs):
        torch.testing.assert_close(dx, r)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad)


def new_region(before: list[Any]) -> Any:
    (region,) = [r for r in fxsplit.compiled_regions() if r not in before]
    return region


@pytest.mark.parametrize("user", ["split", "ordinary", "both"])
def test_each_graph_compiles_on_first_use_only(user: str, inner_compiles: collections.Counter[str]) -> None:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    before = fxsplit.compiled_regions()
    fn = torch.compile(model, backend=fxsplit.backend(compiler="eager"))
    params = list(model.parameters())
    steps = data(3)
    fn(steps[0][0].clone().requires_grad_())  # the forward compiles the region, and no backward graph
    region = new_region(before)
    assert inner_compiles == {} and region.compiled_graphs == () and region.compile_seconds == {}
    dxs = []
    for i, (x, g) in enumerate(steps):
        if user == "split" or (user == "both" and i > 0):
            dxs.append(split_step(fn, params, x, g))
        else:
            dxs.append(ordinary_step(fn, x, g))
    ref_dxs = [ordinary_step(ref, x, g) for x, g in steps]
    check(model, ref, dxs, ref_dxs)
    expected = {
        "split": {"dI": 1, "dW": 1, "dW+accumulate": 1},  # the variant from the second microbatch on
        "ordinary": {"fused": 1},
        "both": {"fused": 1, "dI": 1, "dW": 1, "dW+accumulate": 1},
    }[user]
    assert dict(inner_compiles) == expected
    assert set(region.compile_seconds) == set(expected)
    assert all(s >= 0 for s in region.compile_seconds.values())
    assert set(region.compiled_graphs) == set(expected)


def test_lazy_compile_false_compiles_every_graph_with_the_forward(inner_compiles: collections.Counter[str]) -> None:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    before = fxsplit.compiled_regions()
    with fxsplit.config.patch(lazy_compile=False):
        fn = torch.compile(model, backend=fxsplit.backend(compiler="eager"))
        (x, g), = data(1)
        fn(x.clone().requires_grad_())
    assert dict(inner_compiles) == {"dI": 1, "dW": 1, "fused": 1}
    assert set(new_region(before).compile_seconds) == {"dI", "dW", "fused"}
    dx = split_step(fn, list(model.parameters()), x, g)
    check(model, ref, [dx], [ordinary_step(ref, x, g)])
    assert dict(inner_compiles) == {"dI": 1, "dW": 1, "fused": 1}


def test_a_dynamic_shape_region_compiles_lazily_and_correctly(inner_compiles: collections.Counter[str]) -> None:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    before = fxsplit.compiled_regions()
    fn = torch.compile(model, backend=fxsplit.backend(compiler="eager"), dynamic=True)
    params = list(model.parameters())
    steps = [*data(1, rows=5), *data(1, rows=7), *data(1, rows=3)]
    fn(steps[0][0].clone().requires_grad_())
    region = new_region(before)
    assert region.graphs.dynamic and inner_compiles == {}
    dxs = [split_step(fn, params, x, g) for x, g in steps]
    assert new_region(before) is region  # one region serves every row count
    ref_dxs = [ordinary_step(ref, x, g) for x, g in steps]
    check(model, ref, dxs, ref_dxs)
    assert dict(inner_compiles) == {"dI": 1, "dW": 1, "dW+accumulate": 1}


def test_the_eager_split_finds_a_region_that_has_compiled_nothing_yet(inner_compiles: collections.Counter[str]) -> None:
    """A compiled body under eager code: B walks autograd's graph to the region
    (through AOTAutograd's compiled backward) before any of its graphs exist."""
    torch.manual_seed(0)
    body = MLP()
    head = nn.Linear(6, 6)
    ref_body, ref_head = copy.deepcopy(body), copy.deepcopy(head)
    compiled = torch.compile(body, backend=fxsplit.backend(compiler="eager"))
    params = [*body.parameters(), *head.parameters()]
    dxs, ref_dxs = [], []
    for x, g in data(2):
        xi = x.clone().requires_grad_()
        (dx,), work = fxsplit.stage_backward_input([torch.tanh(head(compiled(xi)))], [g], [xi], params)
        assert work.compiled, "the compiled body took the eager path"
        fxsplit.stage_backward_weight(params, work)
        dxs.append(dx)
        xr = x.clone().requires_grad_()
        torch.tanh(ref_head(ref_body(xr))).backward(g)
        ref_dxs.append(xr.grad)
    check(body, ref_body, dxs, ref_dxs)
    for p, r in zip(head.parameters(), ref_head.parameters()):
        torch.testing.assert_close(p.grad, r.grad)
    assert inner_compiles["fused"] == 0 and inner_compiles["dI"] == 1


@pytest.mark.fallback
def test_a_graph_that_fails_to_compile_on_first_use_runs_uncompiled(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``fallback="eager"``, a dW graph whose deferred compile fails runs op
    by op (one warning, one fallback record); the region stays split and right."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    original = fxbackend._RegionGraphs._compile_dw

    def broken(self: Any) -> Any:
        raise RuntimeError("injected dW compile failure")

    monkeypatch.setattr(fxbackend._RegionGraphs, "_compile_dw", broken)
    fn = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback="eager"))
    params = list(model.parameters())
    records = len(fxsplit.fallbacks())
    steps = data(2)
    with caplog.at_level("WARNING", logger="fxsplit"):
        dxs = [split_step(fn, params, x, g) for x, g in steps]
    new = fxsplit.fallbacks()[records:]
    assert [r.graph for r in new] == ["dW"]
    assert sum("injected dW compile failure" in m for m in caplog.messages) == 1
    assert "op by op" in caplog.text
    monkeypatch.setattr(fxbackend._RegionGraphs, "_compile_dw", original)
    check(model, ref, dxs, [ordinary_step(ref, x, g) for x, g in steps])


def test_fallback_error_raises_at_b_before_anything_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = MLP()

    def broken(self: Any) -> Any:
        raise RuntimeError("injected dI compile failure")

    monkeypatch.setattr(fxbackend._RegionGraphs, "_compile_di", broken)
    fn = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback="error"))
    params = list(model.parameters())
    ((x, g),) = data(1)
    xi = x.clone().requires_grad_()
    out = fn(xi)
    with pytest.raises(fxsplit.FxsplitCompileError, match="dI"):
        fxsplit.stage_backward_input([out], [g], [xi], params)
    assert xi.grad is None and all(p.grad is None for p in params)


def test_fallback_error_on_the_accumulating_graph_raises_at_w_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The accumulating dW variant compiles at the second microbatch's W: its failure under
    ``fallback="error"`` raises there, names what the fallback would do, changes no ``.grad``,
    and W without fused accumulation then finishes the microbatch."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected accumulate compile failure")

    monkeypatch.setattr(fxbackend, "accumulate_into", broken)
    fn = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback="error"))
    params = list(model.parameters())
    (first, (x, g)) = data(2)
    dxs = [split_step(fn, params, *first)]
    before = [p.grad.clone() for p in params]
    xi = x.clone().requires_grad_()
    (dx,), work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
    with pytest.raises(fxsplit.FxsplitCompileError) as info:
        fxsplit.stage_backward_weight(params, work)
    message = str(info.value)
    assert "injected accumulate compile failure" in message
    assert message.endswith("would be accumulating those gradients through autograd instead"), message
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0)
    fxsplit.stage_backward_weight(params, work, fused_accumulation=False)
    dxs.append(dx)
    check(model, ref, dxs, [ordinary_step(ref, xx, gg) for xx, gg in data(2)])


@pytest.mark.inductor
@pytest.mark.parametrize("user", ["split", "ordinary"])
def test_inductor_compiles_only_what_each_user_runs(user: str, inner_compiles: collections.Counter[str]) -> None:
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    before = fxsplit.compiled_regions()
    fn = torch.compile(model, backend=fxsplit.backend(compiler="inductor", fused_accumulation=False))
    params = list(model.parameters())
    steps = data(2)
    fn(steps[0][0].clone().requires_grad_())
    assert inner_compiles == {}
    if user == "split":
        dxs = [split_step(fn, params, x, g) for x, g in steps]
    else:
        dxs = [ordinary_step(fn, x, g) for x, g in steps]
    check(model, ref, dxs, [ordinary_step(ref, x, g) for x, g in steps])
    expected = {"dI", "dW"} if user == "split" else {"fused"}
    assert dict(inner_compiles) == {k: 1 for k in expected}
    region = new_region(before)
    assert set(region.compile_seconds) == expected and all(s > 0 for s in region.compile_seconds.values())
