"""A shared zoo of small models for fxsplit tests.

Each :class:`Case` has a ``name``, a ``factory`` returning a fresh
``(module, example_inputs)`` pair (deterministic: it seeds the RNG itself) and
``flags``:

* ``"inductor"``: part of the real-Inductor subset (kept small: Inductor's C++
  compile is slow on CPU); every case also runs with ``compiler="eager"``.
* ``"first_stage"``: no example input requires grad (B runs only the activation-gradient chain).
* ``"random"``: the forward draws random numbers (dropout); compiled and eager
  masks differ, so plain numerics against eager do not apply.
* ``"autocast"``: run the forward under ``torch.autocast("cpu", torch.bfloat16)``.
* ``"buffers"``: the forward updates buffers (BatchNorm running stats).

``atol``/``rtol`` are the tolerances for comparing against eager autograd.

Small helpers shared by the test modules are at the bottom:
:func:`grad_outputs` (outputs requiring grad, flattened), :func:`make_grads`,
:func:`clone_inputs`, :func:`forward`.

Transformer-style stages are in :data:`STAGE_CASES`, kept apart
from :data:`CASES` because they run at several sequence lengths: a Llama-,
a GPT-2- and two MoE-style blocks (experts through ``F.grouped_mm`` or
through the custom op ``fxsplit_test::expert_mm``, whose backward is a second
custom op returning ``(grad_input, grad_weight)`` in one tuple, split by the
rule :func:`expert_mm_backward_rule` registered on import), each as a middle
and a last stage, in float32 and under bfloat16 autocast.
:data:`FLOP_FORMULAS` counts the ops ``FlopCounterMode`` does not know,
:data:`WEIGHT_SHARE` says how much of each custom matmul is weight-gradient
work and :data:`RULE_HALVES` which op each half of a split rule comes from.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

import fxsplit
from fxsplit.bench.models import Block, LlamaBlock, MoEFeedForward, RMSNorm, grouped_mm_experts

__all__ = [
    "BlockStage", "Blocks", "CASES", "Case", "FLOP_FORMULAS", "FnLinear", "FunctionStage", "LMStage", "LinearFn",
    "MoEStage", "NormHead", "PairFn", "Projection", "RULE_HALVES", "STAGE_CASES", "ScaleFn", "StageCase", "TPStage",
    "WEIGHT_SHARE", "case",
    "clone_inputs", "expert_mm", "expert_mm_backward", "expert_mm_backward_flops", "expert_mm_backward_rule",
    "expert_mm_flops", "expert_mm_input_grad", "expert_mm_input_grad_flops", "expert_mm_weight_grad",
    "expert_mm_weight_grad_flops", "forward", "grad_outputs", "make_grads", "settle",
]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    factory: Callable[[], tuple[nn.Module, tuple[Any, ...]]]
    flags: frozenset[str] = frozenset()
    atol: float = 1e-5
    rtol: float = 1.3e-6

    def make(self) -> tuple[nn.Module, tuple[Any, ...]]:
        torch.manual_seed(0)
        return self.factory()

    def __str__(self) -> str:
        return self.name


def _x(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=grad)


# ---------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, d: int = 8, h: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelHeads(nn.Module):
    """Linear(d, d) and Linear(d, d) side by side on one input: a region with two outputs, each
    from a weight of its own."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class TwoLinear(nn.Module):
    """Linear(6, 8), ReLU, Linear(8, 6): the smallest stage with two weights in a row, for
    tests of semantics (hooks, accumulation, compile counts) rather than numerics."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class GeluResidual(nn.Module):
    """Linear(8, 16), GELU, Linear(16, 8) plus the input: a residual block small enough for
    tests of bookkeeping (memory census, benchmark sections) rather than numerics."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(x))) + x


class LayerNormLinear(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(x))


class Attention(nn.Module):
    """Multi-head causal self-attention over ``F.scaled_dot_product_attention``."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class TiedEmbedding(nn.Module):
    """Token embedding whose weight is also the output head; ``h`` is a float
    input (e.g. the previous stage's hidden state) that requires grad."""

    def __init__(self, vocab: int = 16, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids) + h)))


class WeightTwice(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.fc(x)))


class Frozen(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.frozen(x))) * self.scale


class Unused(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.unused = nn.Linear(d, d)
        self.unused_p = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class MultiIO(nn.Module):
    """Several inputs (one not requiring grad) and nested tuple/dict outputs,
    some of which do not require grad."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> dict[str, Any]:
        s = self.a(x) + self.b(y) * z
        return {
            "sum": s,
            "pair": (x * self.w, s.argmax(dim=-1)),
            "no_grad": z * 2,
            "y": torch.sigmoid(y),
        }


class Dropout(nn.Module):
    """Returns the dropout output too, so a test can read the mask off it."""

    def __init__(self, d: int = 8, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = F.dropout(self.fc1(x), p=self.p, training=self.training)
        return y, self.fc2(y)


class Checkpointed(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.block = MLP(d, 16)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.out(h)


# ---------------------------------------------------------------- cases

_CASE_LIST = [
    Case("linear", lambda: (nn.Linear(8, 6), (_x(4, 8),))),
    Case("mlp", lambda: (MLP(), (_x(4, 8),)), frozenset({"inductor"})),
    Case("layernorm", lambda: (nn.LayerNorm(8), (_x(4, 8),))),
    Case("layernorm_linear", lambda: (LayerNormLinear(), (_x(4, 8),))),
    Case("attention", lambda: (Attention(), (_x(2, 5, 16),)), frozenset({"inductor"}), atol=1e-5, rtol=1e-4),
    Case("conv_bn", lambda: (ConvBN().train(), (_x(2, 3, 8, 8),)), frozenset({"inductor", "buffers"}),
         atol=1e-4, rtol=1e-4),
    Case("tied_embedding", lambda: (TiedEmbedding(), (torch.randint(0, 16, (3, 5)), _x(3, 5, 8)))),
    Case("weight_twice", lambda: (WeightTwice(), (_x(4, 8),))),
    Case("frozen_params", lambda: (Frozen(), (_x(4, 8),))),
    Case("unused_params", lambda: (Unused(), (_x(4, 8),))),
    Case("multi_io", lambda: (MultiIO(), (_x(4, 8), _x(4, 8), _x(4, 8, grad=False)))),
    Case("dropout", lambda: (Dropout().train(), (_x(4, 8),)), frozenset({"random"})),
    Case("checkpoint", lambda: (Checkpointed(), (_x(4, 8),))),
    Case("autocast_mlp", lambda: (MLP(), (_x(4, 8),)), frozenset({"inductor", "autocast"}), atol=2e-2, rtol=2e-2),
    Case("first_stage", lambda: (MLP(), (_x(4, 8, grad=False),)), frozenset({"first_stage"})),
]

CASES: dict[str, Case] = {c.name: c for c in _CASE_LIST}


def case(name: str) -> Case:
    return CASES[name]


# ---------------------------------------------------------------- experts as custom ops
# A grouped matmul registered with torch.library, opaque to Dynamo and
# Inductor, whose backward is a second custom op computing the input and the
# weight gradient together and returning them in one tuple: the shape of the
# CPU fallback that MoE model code ships for when grouped_mm cannot be used.
# Written as plain per-expert loops (the reference semantics, not fast).


@torch.library.custom_op("fxsplit_test::expert_mm", mutates_args=())
def expert_mm(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``rows[offs[i-1]:offs[i]] @ weight[i]`` for each expert ``i`` (``rows`` sorted by expert)."""
    out = rows.new_zeros(rows.shape[0], weight.shape[2])
    start = 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = rows[start:end] @ weight[i]
        start = end
    return out


@expert_mm.register_fake
def _expert_mm_fake(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[2])


@torch.library.custom_op("fxsplit_test::expert_mm_backward", mutates_args=())
def expert_mm_backward(
    rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_rows, grad_weight)`` of :func:`expert_mm`, both from one call."""
    grad_rows = torch.zeros_like(rows)
    grad_weight = torch.zeros_like(weight)
    start = 0
    for i, end in enumerate(offs.tolist()):
        grad_rows[start:end] = grad_out[start:end] @ weight[i].T
        grad_weight[i] = rows[start:end].T @ grad_out[start:end]
        start = end
    return grad_rows, grad_weight


@expert_mm_backward.register_fake
def _expert_mm_backward_fake(
    rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(rows), torch.empty_like(weight)


def _expert_mm_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _expert_mm_grad(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    rows, weight, offs = ctx.saved_tensors
    grad_rows, grad_weight = torch.ops.fxsplit_test.expert_mm_backward(rows, weight, offs, grad_out)
    return grad_rows, grad_weight, None


expert_mm.register_autograd(_expert_mm_grad, setup_context=_expert_mm_setup)


def _custom_op_experts(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch.ops.fxsplit_test.expert_mm(rows, weight, offs)


# The split rule, declared as a model author would next to the op: two more
# custom ops, each computing one of the two gradients exactly as
# expert_mm_backward does (same matmul per expert, same zero fill), so the
# split gradients equal the unsplit ones bit for bit. With it, dI runs only
# the input-gradient half and dW only the weight-gradient half.


@torch.library.custom_op("fxsplit_test::expert_mm_input_grad", mutates_args=())
def expert_mm_input_grad(weight: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``grad_rows`` of :func:`expert_mm_backward` alone (rows past the last offset get zeros)."""
    grad_rows = grad_out.new_zeros(grad_out.shape[0], weight.shape[1])
    start = 0
    for i, end in enumerate(offs.tolist()):
        grad_rows[start:end] = grad_out[start:end] @ weight[i].T
        start = end
    return grad_rows


@expert_mm_input_grad.register_fake
def _expert_mm_input_grad_fake(weight: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    return grad_out.new_empty(grad_out.shape[0], weight.shape[1])


@torch.library.custom_op("fxsplit_test::expert_mm_weight_grad", mutates_args=())
def expert_mm_weight_grad(rows: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``grad_weight`` of :func:`expert_mm_backward` alone (experts without rows get zeros)."""
    grad_weight = rows.new_zeros(offs.shape[0], rows.shape[1], grad_out.shape[1])
    start = 0
    for i, end in enumerate(offs.tolist()):
        grad_weight[i] = rows[start:end].T @ grad_out[start:end]
        start = end
    return grad_weight


@expert_mm_weight_grad.register_fake
def _expert_mm_weight_grad_fake(rows: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(offs.shape[0], rows.shape[1], grad_out.shape[1])


def expert_mm_backward_rule(
    outputs: frozenset[int], rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fxsplit's split rule for :func:`expert_mm_backward`: output 0 (``grad_rows``)
    and output 1 (``grad_weight``), each only when asked for."""
    grad_rows = torch.ops.fxsplit_test.expert_mm_input_grad(weight, offs, grad_out) if 0 in outputs else None
    grad_weight = torch.ops.fxsplit_test.expert_mm_weight_grad(rows, offs, grad_out) if 1 in outputs else None
    return grad_rows, grad_weight


fxsplit.register_split_rule(torch.ops.fxsplit_test.expert_mm_backward, expert_mm_backward_rule)


# FLOP formulas (FlopCounterMode ``custom_mapping``) for the ops its registry
# lacks: shapes in, FLOPs out; a multiply-add counts 2, as torch's formulas do.


def expert_mm_flops(rows: Any, weight: Any, offs: Any, *, out_shape: Any = None) -> int:
    return 2 * rows[0] * rows[1] * weight[2]


def expert_mm_backward_flops(rows: Any, weight: Any, offs: Any, grad_out: Any, *, out_shape: Any = None) -> int:
    return 2 * (2 * rows[0] * rows[1] * weight[2])  # grad_rows and grad_weight, one matmul each


def expert_mm_input_grad_flops(weight: Any, offs: Any, grad_out: Any, *, out_shape: Any = None) -> int:
    return 2 * grad_out[0] * grad_out[1] * weight[1]


def expert_mm_weight_grad_flops(rows: Any, offs: Any, grad_out: Any, *, out_shape: Any = None) -> int:
    return 2 * rows[0] * rows[1] * grad_out[1]


def _grouped_mm_flops(a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """``aten._grouped_mm``: the jagged dimension is split among groups, so
    every row (2-D ``a``) or column (2-D ``b``) is multiplied once."""
    if len(a) == 2 and len(b) == 3:  # (rows, k) x (groups, k, n): forward / input gradient
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:  # (m, rows) x (rows, n) -> (groups, m, n): weight gradient
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 2:  # (groups, m, k) x (k, cols) -> (m, cols)
        return 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]  # (groups, m, k) x (groups, k, n)


def _cpu_sdpa_flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(q, k, v)


def _with_query_heads(q: Any, kv: Any) -> tuple[int, ...]:
    """``kv``'s shape with ``q``'s head count: grouped-query attention costs what
    attention with the key/value heads repeated costs (torch 2.13's formula counts
    it so; torch 2.11's ``sdpa_backward_flop_count`` refuses differing head counts)."""
    shape = tuple(kv)
    return (shape[0], tuple(q)[1], *shape[2:])


def _cpu_sdpa_backward_flops(grad: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad, q, _with_query_heads(q, k), _with_query_heads(q, v))


FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    torch.ops.fxsplit_test.expert_mm: expert_mm_flops,
    torch.ops.fxsplit_test.expert_mm_backward: expert_mm_backward_flops,
    torch.ops.fxsplit_test.expert_mm_input_grad: expert_mm_input_grad_flops,
    torch.ops.fxsplit_test.expert_mm_weight_grad: expert_mm_weight_grad_flops,
    torch.ops.aten._grouped_mm: _grouped_mm_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
}

# The custom matmul ops, each mapped to the share of its FLOPs that is
# weight-gradient work: none for the forward and the input-gradient half, half
# for the backward computing both gradients in one call, all for the
# weight-gradient half.
WEIGHT_SHARE: dict[Any, Fraction] = {
    torch.ops.fxsplit_test.expert_mm: Fraction(0),
    torch.ops.fxsplit_test.expert_mm_backward: Fraction(1, 2),
    torch.ops.fxsplit_test.expert_mm_input_grad: Fraction(0),
    torch.ops.fxsplit_test.expert_mm_weight_grad: Fraction(1),
}

# Each op a split rule computes, mapped to the op it splits: ordinary backward
# (the fused graph) runs the whole op, B and W its halves.
RULE_HALVES: dict[Any, Any] = {
    torch.ops.fxsplit_test.expert_mm_input_grad: torch.ops.fxsplit_test.expert_mm_backward,
    torch.ops.fxsplit_test.expert_mm_weight_grad: torch.ops.fxsplit_test.expert_mm_backward,
}


# ---------------------------------------------------------------- transformer stages ----------

DIM, HEADS, KV_HEADS, HIDDEN, EXPERTS, TOP_K, VOCAB, BATCH = 32, 4, 2, 48, 4, 2, 40, 2
# Odd sequence lengths: no token count (batch * seq, or * top_k) equals a
# dimension of any weight, so a matmul's output shape tells whether it is a
# weight gradient (tests classify matmuls that way).
SEQS = (7, 11, 5)


class LastStage(nn.Module):
    """``block``, then a final norm, an LM head and the mean cross-entropy loss."""

    def __init__(self, block: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.norm = norm
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.block(x)))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _llama() -> tuple[nn.Module, nn.Module]:
    return LlamaBlock(DIM, HEADS, KV_HEADS, HIDDEN), RMSNorm(DIM)


def _gpt2() -> tuple[nn.Module, nn.Module]:
    return Block(DIM, HEADS), nn.LayerNorm(DIM)


def _moe(expert_fn: Callable[..., torch.Tensor]) -> Callable[[], tuple[nn.Module, nn.Module]]:
    def make() -> tuple[nn.Module, nn.Module]:
        # The MoE feed-forward alone (no attention), so that an expert problem
        # is not hidden behind an attention one; the Llama block covers that.
        ffn = MoEFeedForward(DIM, HIDDEN // 2, EXPERTS, TOP_K, expert_mm=expert_fn)
        return LlamaBlock(DIM, HEADS, KV_HEADS, ffn=ffn, attention=False), RMSNorm(DIM)

    return make


BLOCKS: dict[str, Callable[[], tuple[nn.Module, nn.Module]]] = {
    "llama": _llama,
    "gpt2": _gpt2,
    "moe_grouped_mm": _moe(grouped_mm_experts),
    "moe_custom_op": _moe(_custom_op_experts),
}


def stage_inputs(stage: str, seq: int, dim: int = DIM, vocab: int = VOCAB, batch: int = BATCH) -> tuple[torch.Tensor, ...]:
    """Deterministic inputs of a ``"middle"`` stage (hidden states that require grad) or a
    ``"last"`` one (hidden states and target token ids) at sequence length ``seq``."""
    gen = torch.Generator().manual_seed(seq)
    x = torch.randn(batch, seq, dim, generator=gen).requires_grad_()
    if stage == "middle":
        return (x,)
    return x, torch.randint(0, vocab, (batch, seq), generator=gen)


@dataclasses.dataclass(frozen=True)
class StageCase:
    """A transformer-style pipeline stage run at the sequence lengths ``seqs`` in a row.

    ``stage``: ``"middle"`` (input: hidden states requiring grad; output:
    hidden states) or ``"last"`` (inputs: hidden states and labels; output:
    the loss). ``autocast``: forward under bfloat16 autocast.
    """

    block: str
    stage: str
    autocast: bool
    seqs: tuple[int, ...] = SEQS

    @property
    def name(self) -> str:
        return f"{self.block}-{self.stage}-{'bf16' if self.autocast else 'fp32'}"

    def assert_close(self, got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
        """``got`` matches eager autograd's ``want`` up to sums reordered by
        decompositions (float32), or roundings to bfloat16 taken at other points
        (Inductor computes fused bfloat16 math in float32): relative to each
        element, and absolute relative to the tensor's largest element."""
        rel = 3e-2 if self.autocast else 1e-4
        scale = float(want.detach().abs().max()) if want.numel() else 0.0
        torch.testing.assert_close(got, want, rtol=rel, atol=rel * max(scale, 1e-3), msg=lambda m: f"{msg}: {m}")

    def make(self) -> nn.Module:
        """A fresh module with deterministic weights."""
        torch.manual_seed(0)
        block, norm = BLOCKS[self.block]()
        return block if self.stage == "middle" else LastStage(block, norm)

    def inputs(self, seq: int) -> tuple[torch.Tensor, ...]:
        """Deterministic stage inputs for sequence length ``seq``."""
        return stage_inputs(self.stage, seq)

    def context(self) -> contextlib.AbstractContextManager[None]:
        """The context the forward runs in."""
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def __str__(self) -> str:
        return self.name


# torch 2.13 compiles grouped_mm only in bfloat16 (its meta function raises
# "Expected inputs of BF16 type" for float32, though the eager CPU kernel
# accepts float32), so the grouped_mm MoE runs under autocast only.
STAGE_CASES: dict[str, StageCase] = {
    c.name: c
    for c in (
        StageCase(block, stage, autocast)
        for block in BLOCKS
        for stage in ("middle", "last")
        for autocast in (False, True)
    )
    if c.autocast or c.block != "moe_grouped_mm"
}


# ---------------------------------------------------------------- helpers


def grad_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors in a (nested tuple/list/dict) output that require grad, in a fixed order."""
    found: list[torch.Tensor] = []

    def visit(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.requires_grad:
                found.append(o)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)
        elif isinstance(o, dict):
            for k in sorted(o):
                visit(o[k])

    visit(out)
    return found


def make_grads(outs: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    """Deterministic random output gradients, one per output, matching dtype and shape."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]


def clone_inputs(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Fresh leaf copies of the example inputs, with the same ``requires_grad``."""
    return tuple(
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs
    )


@contextlib.contextmanager
def _maybe_autocast(c: Case) -> Iterator[None]:
    if "autocast" in c.flags:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    else:
        yield


def forward(c: Case, module: Callable[..., Any], inputs: tuple[Any, ...]) -> Any:
    """Run ``module(*inputs)`` the way case ``c`` requires (e.g. under autocast)."""
    with _maybe_autocast(c):
        return module(*inputs)


# ---------------------------------------------------------------- multi-rank stages ----------
# The stage modules of the multi-rank worlds (tests/multirank.py and its case modules).


class Blocks(nn.Module):
    """``n_blocks`` of the benchmark's pre-LN transformer block, one after the other."""

    def __init__(self, n_blocks: int, dim: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class BlockStage(Blocks):
    """A run of blocks; the last stage also has a LayerNorm and a Linear head (float in, float out)."""

    def __init__(self, n_blocks: int, dim: int, heads: int, last: bool) -> None:
        super().__init__(n_blocks, dim, heads)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return self.head(x) if self.head is not None else x


class LMStage(nn.Module):
    """A language model's stage: an eager embedding (first stage), ``body`` (the part
    compiled in place), an eager head to the vocabulary (last stage)."""

    def __init__(self, n_blocks: int, dim: int, heads: int, vocab: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim) if first else None
        self.body = Blocks(n_blocks, dim, heads)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.body(x)
        return self.head(x) if self.head is not None else x


class Projection(nn.Module):
    """A bias-free Linear in a module of our own class (in-place compile of a torch.nn
    module itself does nothing)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class NormHead(nn.Module):
    """RMSNorm, then a bias-free Linear."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def settle(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a plain tensor if an eager DTensor layer returned it as an
    ``AsyncCollectiveTensor`` (its local output while its collective is in
    flight). torch 2.13: such a tensor as a compiled region's input breaks that
    region's backward, with every backend (``aot_eager`` and ``inductor``
    too: a redistribute's backward is handed a plain tensor), so it is
    copied first (its collective waited) when the projection runs eagerly."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return x.clone() if isinstance(x, AsyncCollectiveTensor) else x


class TPStage(nn.Module):
    """One Llama-style ``TPBlock`` (``examples/tp_block.py``, on ``sys.path``); the first
    stage also has an input projection, the last a norm and an output projection."""

    def __init__(self, dim: int, heads: int, hidden: int, first: bool, last: bool) -> None:
        super().__init__()
        from tp_block import TPBlock

        self.inp = Projection(dim, dim) if first else None
        self.block = TPBlock(dim, heads, hidden)
        self.head = NormHead(dim) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = settle(self.inp(x))
        x = self.block(x)
        return self.head(x) if self.head is not None else x


class MoEStage(nn.Module):
    """``x + experts(route(proj(x)))``: a dense projection, a softmax router choosing the
    top ``top_k`` of ``n_experts`` GELU experts; the experts at ``expert_ids`` live here.

    ``group`` is the expert-parallel process group (``None``: every expert is local,
    no communication). With a group, tokens reach their experts as torchtitan's
    all-to-all token dispatcher sends them (:meth:`_dispatch_and_run`). ``experts``:
    ``"loop"`` (one matmul pair per local expert, split sizes from ``.tolist()``: a
    graph break) or ``"grouped_mm"`` (``torch._grouped_mm``, bfloat16 weights).
    """

    def __init__(self, expert_ids: list[int], experts: str, group: Any = None, dim: int = 16, hidden: int = 32,
                 n_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.expert_ids = list(expert_ids)
        self.mode = experts
        self.group = group
        self.n_experts, self.top_k = n_experts, top_k
        dtype = torch.bfloat16 if experts == "grouped_mm" else torch.float32
        self.w_in = nn.Parameter(torch.randn(len(expert_ids), dim, hidden, dtype=dtype) * dim**-0.5)
        self.w_out = nn.Parameter(torch.randn(len(expert_ids), hidden, dim, dtype=dtype) * hidden**-0.5)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each local expert on its rows (``rows`` sorted by local expert, ``counts[e]`` rows each)."""
        if self.mode == "grouped_mm":
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(rows.to(torch.bfloat16), self.w_in, offs=offs)
            return torch._grouped_mm(F.gelu(h), self.w_out, offs=offs).to(rows.dtype)
        parts = rows.split(counts.tolist())  # a graph break, as in torchtitan's loop over experts
        return torch.cat([F.gelu(part @ self.w_in[e]) @ self.w_out[e] for e, part in enumerate(parts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.proj(x).reshape(b * t, d)
        probs = self.router(h).softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        rows = h[order // self.top_k]
        counts = torch.bincount(flat, minlength=self.n_experts)
        if self.group is None:  # every expert here
            out_rows = self._experts(rows, counts)
        else:
            out_rows = self._dispatch_and_run(rows, counts)
        combined = torch.zeros_like(h).index_add(0, order // self.top_k,
                                                 out_rows * weights.reshape(-1)[order].unsqueeze(1))
        return x + combined.reshape(b, t, d)

    def _dispatch_and_run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """torchtitan's all-to-all token dispatch: the counts, then the tokens, to
        the ranks owning the experts (split sizes from ``.tolist()``, a graph
        break); the experts on the rows regrouped by expert; the results back."""
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        group = self.group
        ep, local = self.n_experts // len(self.expert_ids), len(self.expert_ids)
        received = all_to_all_single(counts, None, None, group)  # [src rank][my expert] counts
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.view(ep, local).sum(1).tolist()
        got = all_to_all_single_autograd(rows, recv, send, group)
        # rows arrive grouped by source rank, then by expert: regroup them by expert
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
            received, output_size=got.shape[0])
        perm = expert_of_row.argsort(stable=True)
        out = self._experts(got[perm], received.view(ep, local).sum(0))
        back = torch.empty_like(out).index_copy(0, perm, out)
        return all_to_all_single_autograd(back, send, recv, group)


# ---------------------------------------------------------------- custom autograd Functions ---
# Nodes whose one backward call computes every edge's gradient (what B keeps for W
# instead of running them twice: ``fxsplit.config.whole_nodes``).


class LinearFn(torch.autograd.Function):
    """``x @ w.T + b`` with a ctx-style ``forward(ctx, ...)``; the backward skips the
    gradients ``ctx.needs_input_grad`` says nobody needs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        rows, xs = g.flatten(0, -2), x.flatten(0, -2)
        return (g @ w if ctx.needs_input_grad[0] else None, rows.t() @ xs if ctx.needs_input_grad[1] else None,
                rows.sum(0) if ctx.needs_input_grad[2] else None)


class ScaleFn(torch.autograd.Function):
    """``x * w * factor`` (``factor`` a Python float) in the ``setup_context`` style."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, factor: float) -> torch.Tensor:
        return x * w * factor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, factor = inputs
        ctx.save_for_backward(x, w)
        ctx.factor = factor

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        return g * w * ctx.factor, (g * x * ctx.factor).flatten(0, -2).sum(0), None


class PairFn(torch.autograd.Function):
    """Two outputs, ``(x @ w, x @ w2)``, ``once_differentiable``: its backward returns
    ``None`` for ``w2`` when the second output got no gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x, w, w2)
        return x @ w, x @ w2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor, g2: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, w, w2 = ctx.saved_tensors
        xs = x.flatten(0, -2)
        dx = g @ w.t()
        dw2 = None
        if g2 is not None:
            dx = dx + g2 @ w2.t()
            dw2 = xs.t() @ g2.flatten(0, -2)
        return dx, xs.t() @ g.flatten(0, -2), dw2


class FnLinear(nn.Module):
    """A Linear layer through :class:`LinearFn`."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LinearFn.apply(x, self.weight, self.bias)


class FunctionStage(nn.Module):
    """A stage of custom Functions around torch's own ops: an ``nn.Linear``, a
    :class:`FnLinear`, a :class:`ScaleFn`, a :class:`PairFn` of which both outputs
    are used, GELU, and a last :class:`FnLinear` (with ``last``, a LayerNorm first)."""

    def __init__(self, dim: int, last: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.fn1 = FnLinear(dim, dim)
        self.scale = nn.Parameter(torch.rand(dim) + 0.5)
        self.pair_a = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.pair_b = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.norm = nn.LayerNorm(dim) if last else None
        self.fn2 = FnLinear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fn1(self.inp(x))
        h = ScaleFn.apply(h, self.scale, 0.5)
        a, b = PairFn.apply(h, self.pair_a, self.pair_b)
        h = F.gelu(a) + b
        if self.norm is not None:
            h = self.norm(h)
        return x + self.fn2(h)
