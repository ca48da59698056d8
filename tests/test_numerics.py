"""Numerics of fxsplit-compiled modules against plain eager autograd.

For every zoo case: forward through ``torch.compile(backend=fxsplit.backend(...))``,
then B (``stage_backward_input``) and W (``stage_backward_weight``), and compare
outputs, input gradients, weight gradients and buffers with eager autograd
(``torch.testing.assert_close``); then the same with ordinary ``.backward()``
on the compiled module. Every case runs with ``compiler="eager"``; the cases
flagged ``"inductor"`` in the zoo also run with the real Inductor (marked
``inductor``). ``fallback="error"`` everywhere, so a region that silently
fell back to eager would fail the test instead of passing vacuously.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn as nn
from torch.testing import assert_close

import fxsplit
import zoo
from stage_check import new_regions
from zoo import Case, clone_inputs, forward, grad_outputs, make_grads


def compile_split(module: nn.Module, compiler: str = "eager", **kw: Any) -> nn.Module:
    return torch.compile(module, backend=fxsplit.backend(compiler=compiler, fallback="error", **kw))


def all_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor of a nested output, in a fixed order (grad or not)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in all_tensors(o)]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in all_tensors(out[k])]
    return []


def total_stats(regions: list[Any]) -> dict[str, int]:
    total = {"fused_runs": 0, "di_runs": 0, "dw_runs": 0}
    for r in regions:
        for k in total:
            total[k] += r.stats[k]
    return total


def eager_step(c: Case, module: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, list[Any]]:
    """Forward + ordinary eager backward; returns (output, input grads)."""
    out = forward(c, module, inputs)
    outs = grad_outputs(out)
    torch.autograd.backward(outs, make_grads(outs))
    return out, [x.grad if isinstance(x, torch.Tensor) else None for x in inputs]


def split_step(c: Case, module: nn.Module, cm: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, list[Any]]:
    """Forward through ``cm``, then B and W; checks B leaves every weight's .grad untouched."""
    out = forward(c, cm, inputs)
    outs = grad_outputs(out)
    before = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
    dinputs, work = fxsplit.stage_backward_input(outs, make_grads(outs), list(inputs), module.parameters())
    for n, p in module.named_parameters():
        if before[n] is None:
            assert p.grad is None, f"B wrote {n}.grad"
        else:
            assert_close(p.grad, before[n], rtol=0, atol=0, msg=f"B changed {n}.grad")
    fxsplit.stage_backward_weight(module.parameters(), work)
    return out, list(dinputs)


def assert_same_state(c: Case, ref: nn.Module, mod: nn.Module) -> None:
    for (n, p), (_, q) in zip(ref.named_parameters(), mod.named_parameters()):
        assert (p.grad is None) == (q.grad is None), f"{n}.grad: eager {p.grad is None=}, fxsplit {q.grad is None=}"
        if p.grad is not None:
            assert_close(q.grad, p.grad, atol=c.atol, rtol=c.rtol, msg=lambda m: f"{n}.grad: {m}")
    for (n, b), (_, d) in zip(ref.named_buffers(), mod.named_buffers()):
        assert_close(d, b, atol=c.atol, rtol=c.rtol, msg=lambda m: f"buffer {n}: {m}")


def assert_same_results(c: Case, out_ref: Any, out: Any, dref: list[Any], dgot: list[Any]) -> None:
    ref_t, got_t = all_tensors(out_ref), all_tensors(out)
    assert len(ref_t) == len(got_t)
    for a, b in zip(ref_t, got_t):
        assert_close(b, a, atol=c.atol, rtol=c.rtol)
    for k, (a, b) in enumerate(zip(dref, dgot)):
        assert (a is None) == (b is None), f"input {k}: eager grad {a is None=}, fxsplit {b is None=}"
        if a is not None:
            assert_close(b, a, atol=c.atol, rtol=c.rtol, msg=lambda m: f"grad of input {k}: {m}")


def clear_grads(module: nn.Module, inputs: tuple[Any, ...]) -> None:
    for p in module.parameters():
        p.grad = None
    for x in inputs:
        if isinstance(x, torch.Tensor):
            x.grad = None


NUMERIC_CASES = [c for c in zoo.CASES.values() if "random" not in c.flags]
PARAMS = [pytest.param(c, "eager", id=f"{c.name}-eager") for c in NUMERIC_CASES] + [
    pytest.param(c, "inductor", id=f"{c.name}-inductor", marks=pytest.mark.inductor)
    for c in NUMERIC_CASES
    if "inductor" in c.flags
]


@pytest.mark.parametrize("c,compiler", PARAMS)
def test_split_and_ordinary_backward_match_eager(c: Case, compiler: str) -> None:
    ref, inputs = c.make()
    mod = copy.deepcopy(ref)
    before = fxsplit.compiled_regions()
    cm = compile_split(mod, compiler)
    x_ref, x_got = clone_inputs(inputs), clone_inputs(inputs)

    # Round 1: B then W.
    out_ref, dref = eager_step(c, ref, x_ref)
    out, dgot = split_step(c, mod, cm, x_got)
    assert_same_results(c, out_ref, out, dref, dgot)
    assert_same_state(c, ref, mod)
    regions = new_regions(before)
    assert regions, "nothing was compiled by fxsplit"
    stats = total_stats(regions)
    # First stages too: B runs each region's dI graph (the activation-gradient chain), W its dW.
    assert stats == {"fused_runs": 0, "di_runs": len(regions), "dw_runs": len(regions)}

    # Round 2: ordinary .backward() on the compiled module (runs the fused graph).
    clear_grads(ref, x_ref)
    clear_grads(mod, x_got)
    out_ref, dref = eager_step(c, ref, x_ref)
    out, dgot = eager_step(c, cm, x_got)
    assert_same_results(c, out_ref, out, dref, dgot)
    assert_same_state(c, ref, mod)
    assert len(new_regions(before)) == len(regions), "recompiled on the second call"
    assert total_stats(regions)["fused_runs"] == stats["fused_runs"] + len(regions)


def test_batchnorm_running_stats_updated_once_per_forward() -> None:
    c = zoo.case("conv_bn")
    ref, inputs = c.make()
    mod = copy.deepcopy(ref)
    cm = compile_split(mod)
    for step in range(3):
        x = clone_inputs(inputs)
        eager_step(c, ref, clone_inputs(inputs))
        split_step(c, mod, cm, x)
        assert int(mod.bn.num_batches_tracked) == step + 1
        assert_close(mod.bn.running_mean, ref.bn.running_mean)
        assert_close(mod.bn.running_var, ref.bn.running_var)


def test_b_leaves_existing_weight_grads_untouched() -> None:
    """With .grad already holding values, B keeps them bit for bit; W adds the new gradient."""
    c = zoo.case("mlp")
    ref, inputs = c.make()
    mod = copy.deepcopy(ref)
    cm = compile_split(mod)
    for p, q in zip(ref.parameters(), mod.parameters()):
        p.grad = torch.full_like(p, 0.5)
        q.grad = torch.full_like(q, 0.5)
    eager_step(c, ref, clone_inputs(inputs))
    split_step(c, mod, cm, clone_inputs(inputs))  # asserts B left .grad as it was
    assert_same_state(c, ref, mod)


def test_microbatches_in_flight() -> None:
    """B(mb0), B(mb1), W(mb1), W(mb0) == ordinary backward accumulated over both."""
    c = zoo.case("layernorm_linear")
    ref, _ = c.make()
    mod = copy.deepcopy(ref)
    cm = compile_split(mod)
    mbs = [torch.randn(4, 8, requires_grad=True) for _ in range(2)]
    ref_in = [m.detach().clone().requires_grad_() for m in mbs]
    grads = [torch.randn(4, 8) for _ in range(2)]
    for x, g in zip(ref_in, grads):
        ref(x).backward(g)

    work = []
    for x, g in zip(mbs, grads):
        (dx,), w = fxsplit.stage_backward_input([cm(x)], [g], [x], mod.parameters())
        work.append(w)
        assert all(p.grad is None for p in mod.parameters())
    for w in reversed(work):
        fxsplit.stage_backward_weight(mod.parameters(), w)
    for x, xr in zip(mbs, ref_in):
        assert_close(x.grad, xr.grad)
    assert_same_state(c, ref, mod)
    (region,) = fxsplit.compiled_regions()[-1:]
    assert region.stats == {"fused_runs": 0, "di_runs": 2, "dw_runs": 2}


def test_first_stage_b_runs_the_chain_and_w_the_leaves() -> None:
    """Inputs need no grad: B runs the dI graph (the activation-gradient chain) and
    touches no ``.grad``, W the dW graph; each once."""
    c = zoo.case("first_stage")
    ref, (x,) = c.make()
    mod = copy.deepcopy(ref)
    cm = compile_split(mod)
    g = torch.randn(4, 8)
    ref(x).backward(g)
    out = cm(x)
    region = fxsplit.compiled_regions()[-1]
    (dx,), work = fxsplit.stage_backward_input([out], [g], [x], mod.parameters())
    assert dx is None
    assert region.stats == {"fused_runs": 0, "di_runs": 1, "dw_runs": 0}
    assert all(p.grad is None for p in mod.parameters())
    fxsplit.stage_backward_weight(mod.parameters(), work)
    assert region.stats == {"fused_runs": 0, "di_runs": 1, "dw_runs": 1}
    assert_same_state(c, ref, mod)


def test_dropout_uses_the_same_mask_in_forward_and_backward() -> None:
    """Compiled and eager dropout draw different masks, so the reference is built
    from the mask the compiled forward used (read off the returned dropout output):
    eager autograd of ``fc2(fc1(x) * mask / (1 - p))``. If B or W used another mask
    (or recomputed the dropout), the gradients would differ."""
    c = zoo.case("dropout")
    ref, (x,) = c.make()
    mod = copy.deepcopy(ref)
    cm = compile_split(mod)
    xg = x.detach().clone().requires_grad_()
    y, out = cm(xg)
    mask = (y != 0).detach()
    assert 0 < mask.float().mean() < 1, "dropout kept or dropped everything; the test would be vacuous"
    gy, gout = torch.randn_like(y), torch.randn_like(out)
    (dx,), work = fxsplit.stage_backward_input([y, out], [gy, gout], [xg], mod.parameters())
    fxsplit.stage_backward_weight(mod.parameters(), work)

    xr = x.detach().clone().requires_grad_()
    yr = ref.fc1(xr) * mask / (1 - ref.p)
    outr = ref.fc2(yr)
    assert_close(y, yr)
    assert_close(out, outr)
    torch.autograd.backward([yr, outr], [gy, gout])
    assert_close(dx, xr.grad)
    assert_same_state(c, ref, mod)


def _dynamic_round(c: Case, ref: nn.Module, mod: nn.Module, cm: nn.Module, batch: int, mark: bool) -> None:
    x = torch.randn(batch, 8, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    if mark:
        torch._dynamo.mark_dynamic(x, 0)
    clear_grads(ref, ())
    clear_grads(mod, ())
    out_ref, dref = eager_step(c, ref, (xr,))
    out, dgot = split_step(c, mod, cm, (x,))
    assert_same_results(c, out_ref, out, dref, dgot)
    assert_same_state(c, ref, mod)


@pytest.mark.parametrize(
    "compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)]
)
def test_mark_dynamic_one_region_for_all_batch_sizes(compiler: str) -> None:
    c = zoo.case("mlp")
    ref, _ = c.make()
    mod = copy.deepcopy(ref)
    cm = compile_split(mod, compiler)
    before = fxsplit.compiled_regions()
    for batch in (8, 5, 3):
        _dynamic_round(c, ref, mod, cm, batch, mark=True)
    regions = new_regions(before)
    assert len(regions) == 1, f"expected one dynamic region, got {len(regions)}"
    assert total_stats(regions) == {"fused_runs": 0, "di_runs": 3, "dw_runs": 3}


def test_automatic_dynamic_smaller_last_microbatch() -> None:
    """A smaller last microbatch makes Dynamo recompile with a dynamic batch
    size; microbatches of both regions can be in flight at once."""
    c = zoo.case("mlp")
    ref, _ = c.make()
    mod = copy.deepcopy(ref)
    cm = compile_split(mod)
    before = fxsplit.compiled_regions()
    xs = [torch.randn(b, 8, requires_grad=True) for b in (8, 8, 3)]
    gs = [torch.randn(b, 8) for b in (8, 8, 3)]
    for x, g in zip(xs, gs):
        ref(x.detach().clone()).backward(g)
    work = []
    for x, g in zip(xs, gs):
        _, w = fxsplit.stage_backward_input([cm(x)], [g], [x], mod.parameters())
        work.append(w)
    for w in reversed(work):
        fxsplit.stage_backward_weight(mod.parameters(), w)
    assert_same_state(c, ref, mod)
    regions = new_regions(before)
    assert len(regions) == 2, "expected a static region and an automatic-dynamic one"
    dyn_inputs = regions[1].split.di_graph.graph.find_nodes(op="placeholder")
    assert any(isinstance(p.meta.get("val"), torch.SymInt) for p in dyn_inputs), "second region is not dynamic"
    # The dynamic region serves any later batch size without recompiling.
    _dynamic_round(c, ref, mod, cm, 5, mark=False)
    assert len(new_regions(before)) == 2


def test_forward_under_no_grad() -> None:
    c = zoo.case("mlp")
    ref, (x,) = c.make()
    mod = copy.deepcopy(ref)
    cm = compile_split(mod)
    with torch.no_grad():
        out = cm(x)
        assert not out.requires_grad
        assert_close(out, ref(x))
    # A later forward with grad still splits correctly.
    _dynamic_round(c, ref, mod, cm, 4, mark=False)


def test_stage_backward_full_matches_eager() -> None:
    c = zoo.case("weight_twice")
    ref, (x,) = c.make()
    mod = copy.deepcopy(ref)
    cm = compile_split(mod)
    xr, xg = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    g = torch.randn(4, 8)
    ref(xr).backward(g)
    (dx,) = fxsplit.stage_backward(cm(xg), [g], [xg])
    assert_close(dx, xr.grad)
    assert_same_state(c, ref, mod)


def test_ordinary_backward_without_fused_graph() -> None:
    """``fused_backward=False``: ordinary backward runs dI then dW back to back."""
    c = zoo.case("conv_bn")
    ref, inputs = c.make()
    mod = copy.deepcopy(ref)
    cm = compile_split(mod, fused_backward=False)
    x_ref, x_got = clone_inputs(inputs), clone_inputs(inputs)
    out_ref, dref = eager_step(c, ref, x_ref)
    out, dgot = eager_step(c, cm, x_got)
    assert_same_results(c, out_ref, out, dref, dgot)
    assert_same_state(c, ref, mod)
    assert fxsplit.compiled_regions()[-1].stats == {"fused_runs": 0, "di_runs": 1, "dw_runs": 1}
