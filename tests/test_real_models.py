"""Transformer-style stages at changing sequence lengths.

Every stage of ``zoo.STAGE_CASES`` (Llama-, GPT-2- and MoE-style blocks, as a
middle and a last stage, float32 and bfloat16 autocast) is compiled with
fxsplit and run at three sequence lengths in a row, and checked by
:func:`real_stage_check.check_stage`: gradients of B then W and of ordinary
backward against eager autograd, FLOPs(B) + FLOPs(W) == FLOPs(ordinary
backward), no weight-gradient matmul in B. All with ``fallback="error"``: a
region that could not be compiled or split fails the test instead of
running eagerly. ``compiler="eager"`` for every case (the graphs Inductor
would compile, run op by op), and each block once as a middle stage with the
real Inductor (marked ``inductor``). How the changing length is compiled
(automatic dynamic shapes, ``mark_dynamic``, ``dynamic=True``) is part of
each test's id.
"""

from __future__ import annotations

import copy

import pytest
import torch
from real_stage_check import check_stage

import fxsplit
import zoo
from fxsplit.bench.models import ModelConfig, build
from zoo import StageCase

# ---------------------------------------------------------------- tests

# How each case gets its changing sequence length compiled (see
# real_stage_check.check_stage). With the eager compiler, every float32 case
# takes the path most training runs meet, automatic dynamic shapes (a static
# compile, then one dynamic recompile at the second length); the bfloat16
# cases mark the sequence dimension dynamic from the start (one compile, so
# half the tracing time). Two exceptions: the grouped_mm MoE middle stage has
# no float32 twin, so it takes automatic dynamic shapes; the GPT-2 middle
# stage uses torch.compile(dynamic=True), where its LayerNorm's float eps
# makes Dynamo raise its restart signal (TensorifyScalarRestartAnalysis),
# which the backend must let through.
DYNAMIC_EXCEPTIONS = {"moe_grouped_mm-middle-bf16": "automatic", "gpt2-middle-bf16": "always"}


def _dynamic(c: StageCase) -> str:
    return DYNAMIC_EXCEPTIONS.get(c.name, "mark" if c.autocast else "automatic")


# Real-Inductor runs: the compiled C++ code, the dW graph's symbolic sizes and
# Inductor's layouts only show there. Each block once, as a middle stage. To
# keep the C++ compiles few (they dominate these tests' time), one compile
# serves all three lengths: the sequence dimension is marked dynamic from the
# first length, or for GPT-2 torch.compile(dynamic=True) (the restart signal
# again); and without the fused backward (Inductor's own compile of the
# unsplit graph; ordinary backward then runs dI and dW).
INDUCTOR_CASES = {
    "llama-middle-fp32": "mark",
    "gpt2-middle-fp32": "always",
    "moe_grouped_mm-middle-bf16": "mark",
    "moe_custom_op-middle-fp32": "mark",
}

PARAMS = [
    pytest.param(c, "eager", _dynamic(c), id=f"{name}-eager-{_dynamic(c)}") for name, c in zoo.STAGE_CASES.items()
] + [
    pytest.param(zoo.STAGE_CASES[name], "inductor", dynamic, id=f"{name}-inductor-{dynamic}", marks=pytest.mark.inductor)
    for name, dynamic in INDUCTOR_CASES.items()
]


@pytest.mark.parametrize("c,compiler,dynamic", PARAMS)
def test_stage_at_three_sequence_lengths(c: StageCase, compiler: str, dynamic: str) -> None:
    if compiler == "inductor":
        check_stage(c, compiler, dynamic=dynamic, fused_backward=False)
    else:
        check_stage(c, compiler, dynamic=dynamic)


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
