"""FLOP formulas the benchmark adds to ``torch.utils.flop_counter``.

``FlopCounterMode`` (torch 2.13) has no formula for ``aten._grouped_mm`` (the
MoE experts) nor for the CPU flash attention kernels
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), so
it counts them as 0 FLOPs: on the llama and moe stages the duplicated-FLOP
figure and the per-phase FLOPs would then miss every attention and expert
matmul. :func:`flop_counter` passes these formulas as ``custom_mapping``.

Conventions match torch's own formulas for the CUDA kernels, so a CPU and a
CUDA run count alike: a multiply-add is 2 FLOPs; attention counts its two
matmuls (``Q K^T`` and ``P V``) in full whether causal or not; its backward
counts the four matmul gradients plus the recomputation of ``Q K^T`` that a
flash backward does (torch's ``sdpa_backward_flop_count``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["FLOP_FORMULAS", "flop_counter", "grouped_mm_flop", "sdpa_backward_flop", "sdpa_flop"]

Shape = Sequence[int]
aten = torch.ops.aten


def grouped_mm_flop(a_shape: Shape, b_shape: Shape, *args: Any, out_shape: Shape | None = None, **kwargs: Any) -> int:
    """``_grouped_mm(a, b, offs)``: 2 * M * K * N summed over the groups.

    The four layouts (``offs`` splits the dimension a 2-D operand shares with
    the groups): 2-D x 3-D ``(M, K) x (G, K, N) -> (M, N)``; 3-D x 2-D
    ``(G, M, K) x (K, N) -> (M, N)``; 3-D x 3-D ``(G, M, K) x (G, K, N) ->
    (G, M, N)``: each output element is a K-long dot product, so
    ``2 * numel(out) * K``. 2-D x 2-D ``(M, K) x (K, N) -> (G, M, N)`` splits K
    into the groups: ``2 * M * K * N``.
    """
    if len(a_shape) == 2 and len(b_shape) == 2:
        m, k = a_shape
        return 2 * m * k * b_shape[1]
    if out_shape is None:
        raise ValueError("grouped_mm_flop: the output shape is needed for 3-D operands")
    numel = 1
    for s in out_shape:
        numel *= s
    return 2 * numel * a_shape[-1]


def _attention_dims(q: Shape, k: Shape, v: Shape) -> tuple[int, int, int, int, int]:
    """``(batch * query heads, query length, key length, qk width, v width)``.
    Key/value may have fewer heads than the query (grouped-query attention):
    each query head still does its own matmuls."""
    *lead, s_q, d_q = q
    s_k, d_v = k[-2], v[-1]
    if k[-1] != d_q or v[-2] != s_k:
        raise ValueError(f"attention FLOPs: incompatible shapes q={list(q)} k={list(k)} v={list(v)}")
    bh = 1
    for s in lead:
        bh *= s
    return bh, s_q, s_k, d_q, d_v


def sdpa_flop(q: Shape, k: Shape, v: Shape, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """Attention forward: ``Q K^T`` (2 * s_q * s_k * d_qk) and ``P V`` (2 * s_q * s_k * d_v) per head."""
    bh, s_q, s_k, d_q, d_v = _attention_dims(q, k, v)
    return 2 * bh * s_q * s_k * (d_q + d_v)


def sdpa_backward_flop(grad_out: Shape, q: Shape, k: Shape, v: Shape, *args: Any, out_shape: Any = None,
                       **kwargs: Any) -> int:
    """Attention backward: ``Q K^T`` recomputed, then ``dP = dO V^T``, ``dV = P^T dO``,
    ``dQ = dS K`` and ``dK = dS^T Q``."""
    bh, s_q, s_k, d_q, d_v = _attention_dims(q, k, v)
    return 2 * bh * s_q * s_k * (3 * d_q + 2 * d_v)


FLOP_FORMULAS: dict[Any, Any] = {
    aten._grouped_mm: grouped_mm_flop,
    aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop,
}


def flop_counter() -> FlopCounterMode:
    """A quiet ``FlopCounterMode`` that also counts the ops in :data:`FLOP_FORMULAS`."""
    return FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
