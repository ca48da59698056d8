"""Transformer-style stages at changing sequence lengths (issue 8, item 4).

Every stage of ``zoo.STAGE_CASES`` (Llama-, GPT-2- and MoE-style blocks, as a
middle and a last stage, float32 and bfloat16 autocast) is compiled once with
fxsplit and run at three sequence lengths in a row (automatic dynamic shapes
recompile at the second), and checked by :func:`real_stage_check.check_stage`:
gradients of B then W and of ordinary backward against eager autograd,
FLOPs(B) + FLOPs(W) == FLOPs(ordinary backward), no weight-gradient matmul in
B. All with ``fallback="error"``: a region that could not be compiled or split
fails the test instead of running eagerly. ``compiler="eager"`` for every
case (the graphs Inductor would compile, run op by op); a real-Inductor run
of the Llama and MoE blocks (marked ``inductor``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from real_stage_check import check_stage

import fxsplit
import zoo
from fxsplit.bench.models import ModelConfig, build
from zoo import StageCase

# ---------------------------------------------------------------- tests

def _param(name: str, compiler: str) -> Any:
    marks = [pytest.mark.inductor] if compiler == "inductor" else []
    return pytest.param(zoo.STAGE_CASES[name], compiler, id=f"{name}-{compiler}", marks=marks)


# Real-Inductor runs: the compiled C++ code, the dW graph's symbolic sizes and
# Inductor's layouts only show there. The Llama and both MoE blocks (the
# GPT-2-style block, the benchmark's default, already runs under Inductor in
# tests/test_pipelining.py). To keep the C++ compiles few (they dominate these
# tests' time), the sequence dimension is marked dynamic from the first length
# (one compile serves all three; the eager cases cover the static-then-dynamic
# recompile), and without the fused backward (Inductor's own compile of the
# unsplit graph; ordinary backward then runs dI and dW).
INDUCTOR_CASES = ["llama-middle-fp32", "moe_grouped_mm-middle-bf16", "moe_custom_op-middle-fp32"]

PARAMS = [_param(name, "eager") for name in zoo.STAGE_CASES] + [_param(name, "inductor") for name in INDUCTOR_CASES]


@pytest.mark.parametrize("c,compiler", PARAMS)
def test_stage_at_three_sequence_lengths(c: StageCase, compiler: str) -> None:
    if compiler == "inductor":
        check_stage(c, compiler, dynamic="mark", fused_backward=False)
    else:
        check_stage(c, compiler)


def test_gpt2_stage_compiled_with_dynamic_true() -> None:
    """``torch.compile(dynamic=True)``: one dynamic compile serves all three lengths."""
    check_stage(zoo.STAGE_CASES["gpt2-middle-fp32"], "eager", dynamic="always")


@pytest.mark.parametrize("name", ["llama", "moe"])
def test_benchmark_stage_splits_like_eager(name: str) -> None:
    """The stages ``fxsplit bench --model llama|moe`` builds (two blocks here,
    tiny): B then W on the fxsplit-compiled stage give eager autograd's
    gradients, and B leaves every ``.grad`` untouched."""
    stage = build(ModelConfig(name=name, batch=2, seq=7, layers=2, dim=32, heads=4))
    ref = stage.module
    mod = copy.deepcopy(ref)
    cm = torch.compile(mod, backend=fxsplit.backend(compiler="eager", fallback="error"))
    x_ref, x = stage.make_input(), stage.make_input()
    grad = torch.randn_like(x)
    ref(x_ref).backward(grad)
    (dx,), work = fxsplit.stage_backward_input([cm(x)], [grad], [x], mod.parameters())
    assert all(p.grad is None for p in mod.parameters()), "B wrote a weight's .grad"
    fxsplit.stage_backward_weight(mod.parameters(), work)
    # The MoE experts compute in bfloat16 (see fxsplit.bench.models).
    rel = 3e-2 if name == "moe" else 1e-4
    for what, got, want in [("input", dx, x_ref.grad)] + [
        (n, q.grad, p.grad) for (n, p), q in zip(ref.named_parameters(), mod.parameters())
    ]:
        atol = rel * max(float(want.abs().max()), 1e-3)
        torch.testing.assert_close(got, want, rtol=rel, atol=atol, msg=lambda m: f"{name} {what}: {m}")
    assert fxsplit.compiled_regions()[-1].stats == {"fused_runs": 0, "di_runs": 1, "dw_runs": 1}
