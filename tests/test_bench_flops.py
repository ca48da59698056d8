"""The benchmark's FLOP formulas for ops FlopCounterMode does not know
(:mod:`fxsplit.bench.flops`), against the FLOPs FlopCounterMode counts for the
same computation written as a loop of ``mm`` / ``bmm``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fxsplit.bench.flops import FLOP_FORMULAS, flop_counter


def _count(fn, counter) -> int:
    with counter as fc:
        fn()
    return fc.get_total_flops()


def _plain() -> FlopCounterMode:
    return FlopCounterMode(display=False)


def _grouped_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    torch.manual_seed(0)
    sizes = [3, 0, 5, 8]  # an empty group counts nothing
    rows = torch.randn(sum(sizes), 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(len(sizes), 16, 24, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return rows, weight, offs, sizes


def test_the_formulas_agree_with_torch_wherever_torch_counts_these_ops() -> None:
    """Why the formulas exist: torch 2.13's registry counts these ops as 0 FLOPs (2.15
    counts CPU flash attention). Where torch counts an op, it must agree with ours."""
    rows, weight, offs, _ = _grouped_case()
    q = torch.randn(1, 2, 8, 4)
    cases = [
        lambda: F.grouped_mm(rows, weight, offs=offs),
        lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q),
    ]
    for fn in cases:
        ours = _count(fn, flop_counter())
        assert ours > 0
        assert _count(fn, _plain()) in (0, ours)
    assert set(FLOP_FORMULAS) >= {torch.ops.aten._grouped_mm}


def test_grouped_mm_forward_and_backward_equal_a_loop_of_mm() -> None:
    rows, weight, offs, sizes = _grouped_case()
    grad = torch.randn(rows.shape[0], weight.shape[-1], dtype=torch.bfloat16)

    def grouped() -> None:
        F.grouped_mm(rows, weight, offs=offs).backward(grad)

    def loop() -> None:
        outs, start = [], 0
        for g, n in enumerate(sizes):
            outs.append(rows[start:start + n] @ weight[g])
            start += n
        torch.cat(outs).backward(grad)

    with flop_counter() as fc:
        out = F.grouped_mm(rows, weight, offs=offs)
    fwd = fc.get_total_flops()
    assert fwd == 2 * sum(sizes) * 16 * 24
    with flop_counter() as fc:
        out.backward(grad)
    bwd = fc.get_total_flops()
    with _plain() as ref_fwd:
        outs, start = [], 0
        for g, n in enumerate(sizes):
            outs.append(rows[start:start + n] @ weight[g])
            start += n
        ref = torch.cat(outs)
    with _plain() as ref_bwd:
        ref.backward(grad)
    assert fwd == ref_fwd.get_total_flops()
    assert bwd == ref_bwd.get_total_flops() == 2 * fwd  # dA and dB: one matmul each
    assert _count(grouped, flop_counter()) == _count(loop, _plain())


@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: grouped-query attention
def test_cpu_flash_attention_equals_the_matmuls_of_math_attention(kv_heads: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 6, requires_grad=True)
    k = torch.randn(2, kv_heads, 10, 6, requires_grad=True)
    v = torch.randn(2, kv_heads, 10, 6, requires_grad=True)
    grad = torch.randn(2, 4, 8, 6)
    gqa = kv_heads != 4

    def flash() -> torch.Tensor:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def math() -> torch.Tensor:  # what flash computes, as bmm
        kk, vv = (t.repeat_interleave(4 // kv_heads, dim=1) for t in (k, v))
        scores = torch.matmul(q, kk.transpose(-1, -2)) / 6**0.5
        return torch.matmul(scores.softmax(-1), vv)

    with flop_counter() as f_fwd:
        out = flash()
    with flop_counter() as f_bwd:
        out.backward(grad)
    with _plain() as m_fwd:
        ref = math()
    with _plain() as m_bwd:
        ref.backward(grad)
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in f_fwd.get_flop_counts()["Global"], (
        "the CPU flash kernel did not run")
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward in f_bwd.get_flop_counts()["Global"]
    assert f_fwd.get_total_flops() == m_fwd.get_total_flops() > 0
    # flash's backward also recomputes Q K^T: the math backward plus one forward matmul
    qk = 2 * 2 * 4 * 8 * 10 * 6
    assert f_bwd.get_total_flops() == m_bwd.get_total_flops() + qk
