"""Built-in benchmark models: one pipeline stage each.

Every model is built by :func:`build` from a :class:`ModelConfig` and comes
with the stage input it takes. The default is a middle pipeline stage, whose
input is an activation that requires grad, so that B (input gradients) has
real work to do and W (weight gradients) is what a zero-bubble schedule
defers:

* ``gpt``: a GPT-style stack of pre-LayerNorm transformer blocks (causal
  attention through ``F.scaled_dot_product_attention``, GELU MLP). As a middle
  stage it takes hidden states ``(batch, seq, dim)``; with ``embedding=True``
  it is a first stage (token + position embedding, then the blocks) taking
  token ids, where B has no input gradient to compute and W does everything.
* ``mlp``: residual ``LayerNorm -> Linear -> GELU -> Linear`` blocks on
  ``(batch * seq, dim)`` rows.
* ``conv``: residual ``Conv2d -> GroupNorm -> GELU -> Conv2d`` blocks on a
  ``(batch, channels, seq, seq)`` feature map (``seq`` is the image side).
* ``llama``: a middle stage of Llama-style blocks (RMSNorm, rotary position
  embedding, grouped-query attention through ``F.scaled_dot_product_attention``
  with half as many key/value heads as query heads, SwiGLU MLP, no biases).
* ``moe``: a middle stage of Mixtral-style blocks: the Llama attention, then a
  mixture-of-experts feed-forward (softmax router, top-2 of 8 SwiGLU experts)
  whose experts run through ``torch.nn.functional.grouped_mm``. torch 2.13's
  ``grouped_mm`` compiles only in bfloat16, so the experts compute in
  bfloat16 whatever the model's dtype (as autocast would run a matmul).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "MODELS", "Block", "BlockStack", "LlamaBlock", "MoEFeedForward", "ModelConfig", "RMSNorm", "Stage", "SwiGLU",
    "build", "grouped_mm_experts",
]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Size of a benchmark model. ``seq`` is the sequence length (gpt, mlp rows
    per batch item) or the image side (conv)."""

    name: str = "gpt"
    batch: int = 4
    seq: int = 128
    layers: int = 4
    dim: int = 256
    heads: int = 4
    vocab: int = 1024
    embedding: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)); x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"gpt: dim ({dim}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPTStage(nn.Module):
    """A stage of a GPT-style model: optional embeddings, then ``layers`` blocks."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embedding = cfg.embedding
        if cfg.embedding:
            self.tok = nn.Embedding(cfg.vocab, cfg.dim)
            self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for blk in self.blocks:
            x = blk(x)
        return x


class MLPStack(nn.Module):
    """Residual MLP blocks: x + W2 gelu(W1 ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))
            for _ in range(cfg.layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = x + blk(x)
        return x


class ConvNet(nn.Module):
    """Residual conv blocks: x + conv(gelu(groupnorm(conv(x))))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        c = cfg.dim
        groups = math.gcd(c, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(groups, c), nn.GELU(), nn.Conv2d(c, c, 3, padding=1)
            )
            for _ in range(cfg.layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = x + blk(x)
        return x


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, normalized in float32 and cast back (as Llama does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding tables for positions ``0 .. seq - 1``.

    The tables are computed in the forward from ``seq`` (not cached at a
    fixed length), so a compiled stage serves any sequence length.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(seq, device=self.inv_freq.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply the rotary embedding to ``x`` of shape ``(batch, heads, seq, head_dim)``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with rotary embeddings, no biases.

    ``kv_heads`` key/value heads are shared by ``heads // kv_heads`` query heads
    each (``enable_gqa`` of ``F.scaled_dot_product_attention``).
    """

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        if dim % heads or heads % kv_heads:
            raise ValueError(f"llama: need dim % heads == 0 and heads % kv_heads == 0, got {dim=}, {heads=}, {kv_heads=}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.rotary = Rotary(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(t, q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def grouped_mm_experts(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``rows[offs[i-1]:offs[i]] @ weight[i]`` for every expert ``i``, through
    ``torch.nn.functional.grouped_mm`` (``rows`` sorted by expert, ``weight``
    of shape ``(experts, in, out)``, ``offs`` int32 cumulative row counts)."""
    return F.grouped_mm(rows, weight, offs=offs)


ExpertMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class MoEFeedForward(nn.Module):
    """Mixture of SwiGLU experts with a top-k softmax router (Mixtral-style).

    Each token goes to the ``top_k`` experts with the highest router
    probability, weighted by those probabilities renormalized to sum to one.
    Rows are sorted by expert and each expert's rows multiplied by its weights
    with ``expert_mm(rows, weight, offs)`` (default :func:`grouped_mm_experts`;
    tests pass a custom op). ``compute_dtype`` is the dtype the experts
    compute in (default: the router's output dtype, i.e. autocast's).
    Every shape depends only on the number of tokens, never on the routing,
    so the block compiles without data-dependent shapes.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts: int,
        top_k: int,
        expert_mm: ExpertMM = grouped_mm_experts,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.expert_mm = expert_mm
        self.compute_dtype = compute_dtype
        self.router = nn.Linear(dim, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, dim, 2 * hidden) * dim**-0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, dim) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        gates, ids = logits.float().softmax(dim=-1).topk(self.top_k, dim=-1)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = (flat.unsqueeze(1) == torch.arange(self.experts, device=x.device)).sum(dim=0)
        offs = counts.cumsum(dim=0).to(torch.int32)
        dtype = self.compute_dtype or logits.dtype
        rows = tokens[order // self.top_k].to(dtype)
        gate, up = self.expert_mm(rows, self.gate_up.to(dtype), offs).chunk(2, dim=-1)
        y = self.expert_mm(F.silu(gate) * up, self.down.to(dtype), offs)
        y = y[order.argsort()].view(-1, self.top_k, y.shape[-1])  # back to (token, slot) order
        out = (y * gates.unsqueeze(-1).to(y.dtype)).sum(dim=1)
        return out.to(x.dtype).view(x.shape)


class LlamaBlock(nn.Module):
    """Pre-RMSNorm Llama-style block: x + attn(norm(x)); x + ffn(norm(x)).

    ``ffn`` is the given module (e.g. a :class:`MoEFeedForward`), or else a
    SwiGLU MLP of width ``hidden``; ``attention=False`` drops the attention
    half. Raises ``ValueError`` if neither ``ffn`` nor ``hidden`` is given.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        kv_heads: int,
        hidden: int | None = None,
        *,
        ffn: nn.Module | None = None,
        attention: bool = True,
    ) -> None:
        super().__init__()
        if ffn is None:
            if hidden is None:
                raise ValueError("LlamaBlock: give the SwiGLU width (hidden) or an ffn module")
            ffn = SwiGLU(dim, hidden)
        self.attn_norm = RMSNorm(dim) if attention else None
        self.attn = LlamaAttention(dim, heads, kv_heads) if attention else None
        self.ffn_norm = RMSNorm(dim)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attn is not None:
            x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class BlockStack(nn.Module):
    """``blocks`` applied in order: a middle pipeline stage."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


@dataclasses.dataclass
class Stage:
    """A built model and a factory for its stage input.

    ``make_input()`` returns a fresh input tensor each call: an activation
    that requires grad (middle stage) or token ids (first stage).
    """

    module: nn.Module
    make_input: Callable[[], torch.Tensor]
    config: ModelConfig
    description: str


def _gpt(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Stage:
    module = GPTStage(cfg).to(device=device, dtype=dtype)
    if cfg.embedding:
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device=device)
        return Stage(module, lambda: ids.clone(), cfg, "GPT first stage (embeddings + blocks), input: token ids")
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, device=device, dtype=dtype)
    return Stage(
        module, lambda: x.clone().requires_grad_(True), cfg,
        "GPT middle stage (transformer blocks), input: hidden states requiring grad",
    )


def _mlp(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Stage:
    module = MLPStack(cfg).to(device=device, dtype=dtype)
    x = torch.randn(cfg.batch * cfg.seq, cfg.dim, device=device, dtype=dtype)
    return Stage(module, lambda: x.clone().requires_grad_(True), cfg, "residual MLP stack, input: rows requiring grad")


def _conv(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Stage:
    module = ConvNet(cfg).to(device=device, dtype=dtype)
    x = torch.randn(cfg.batch, cfg.dim, cfg.seq, cfg.seq, device=device, dtype=dtype)
    return Stage(
        module, lambda: x.clone().requires_grad_(True), cfg, "residual conv net, input: feature map requiring grad"
    )


def _llama_sizes(cfg: ModelConfig) -> tuple[int, int]:
    """(key/value heads, SwiGLU width): half the query heads (at least one), and
    about 8/3 of ``dim`` rounded up to a multiple of 16 (as Llama sizes it)."""
    return max(1, cfg.heads // 2), -(-8 * cfg.dim // 3 // 16) * 16


def _hidden_states(cfg: ModelConfig, module: nn.Module, device: torch.device, dtype: torch.dtype, what: str) -> Stage:
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, device=device, dtype=dtype)
    return Stage(module, lambda: x.clone().requires_grad_(True), cfg, f"{what}, input: hidden states requiring grad")


def _llama(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Stage:
    kv_heads, hidden = _llama_sizes(cfg)
    blocks = [LlamaBlock(cfg.dim, cfg.heads, kv_heads, hidden) for _ in range(cfg.layers)]
    module = BlockStack(blocks).to(device=device, dtype=dtype)
    what = (f"Llama-style middle stage ({cfg.layers} x block: RMSNorm, RoPE, grouped-query attention with "
            f"{cfg.heads} query / {kv_heads} key-value heads, SwiGLU of width {hidden}, no biases)")
    return _hidden_states(cfg, module, device, dtype, what)


MOE_EXPERTS, MOE_TOP_K = 8, 2


def _moe(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Stage:
    kv_heads, _ = _llama_sizes(cfg)
    # Expert width = dim: top-2 of 8 experts then costs about what one dense
    # MLP of width 2 * dim does per token.
    blocks = [
        LlamaBlock(cfg.dim, cfg.heads, kv_heads,
                   ffn=MoEFeedForward(cfg.dim, cfg.dim, MOE_EXPERTS, MOE_TOP_K, compute_dtype=torch.bfloat16))
        for _ in range(cfg.layers)
    ]
    module = BlockStack(blocks).to(device=device, dtype=dtype)
    what = (f"MoE middle stage ({cfg.layers} x Mixtral-style block: the Llama attention, then top-{MOE_TOP_K} of "
            f"{MOE_EXPERTS} SwiGLU experts of width {cfg.dim} through F.grouped_mm in bfloat16)")
    return _hidden_states(cfg, module, device, dtype, what)


MODELS: dict[str, Callable[[ModelConfig, torch.device, torch.dtype], Stage]] = {
    "gpt": _gpt,
    "mlp": _mlp,
    "conv": _conv,
    "llama": _llama,
    "moe": _moe,
}


def build(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Stage:
    """Build model ``cfg.name`` with deterministic weights. Raises ``ValueError`` for an unknown name."""
    if cfg.name not in MODELS:
        raise ValueError(f"unknown model {cfg.name!r}; choose one of {sorted(MODELS)}")
    torch.manual_seed(seed)
    return MODELS[cfg.name](cfg, torch.device(device), dtype)
