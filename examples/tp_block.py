"""A Llama-style transformer block laid out for tensor parallelism, and its plans.

The block is torchtitan's layout (``attention_norm``, ``attention.{wq,wk,wv,wo}``,
``ffn_norm``, ``feed_forward.{w1,w2,w3}``): RMSNorm, causal attention through
``F.scaled_dot_product_attention``, SwiGLU, no biases. The attention infers
its number of heads from the projection's width (``view(b, t, -1, head_dim)``),
so the same code runs unsharded and with q/k/v sharded by heads.

:func:`block_plan` is the ``parallelize_module`` plan torchtitan uses for
such a block: q/k/v and w1/w3 column-wise, o and w2 row-wise; with
``sequence_parallel=True`` the norms run on sequence shards
(``SequenceParallel``), the attention and feed-forward gather the sequence
on entry and the row-wise projections reduce-scatter it on exit, so the
block takes and returns its input sharded on the sequence dimension (dim 1).

Used by ``examples/tp_pp_torchrun.py`` (import it from the examples folder) and the tensor-parallel
tests.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxsplit.bench.models import RMSNorm

__all__ = ["TPAttention", "TPBlock", "TPFeedForward", "block_plan"]


class TPAttention(nn.Module):
    """Causal multi-head attention whose head count follows the projections' width."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"tp block: dim {dim} must be a multiple of heads {heads}")
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: all of them unsharded, this rank's share under tensor parallelism.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))


class TPFeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``, no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TPBlock(nn.Module):
    """Pre-norm residual block: attention then SwiGLU, each behind an RMSNorm."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = TPAttention(dim, heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = TPFeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def block_plan(sequence_parallel: bool = False, prefix: str = "") -> dict[str, Any]:
    """torchtitan's ``parallelize_module`` plan for a :class:`TPBlock` (module
    names under ``prefix``, e.g. ``"blocks.0."``). Without sequence
    parallelism the block takes and returns its input replicated; with it,
    sharded on dim 1."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan: dict[str, Any] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(**out),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(**out),
    }
    if sequence_parallel:
        gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
        plan.update(
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(**gather),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(**gather),
            }
        )
    return {prefix + k: v for k, v in plan.items()}
