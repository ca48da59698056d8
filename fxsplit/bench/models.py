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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MODELS", "ModelConfig", "Stage", "build"]


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


MODELS: dict[str, Callable[[ModelConfig, torch.device, torch.dtype], Stage]] = {
    "gpt": _gpt,
    "mlp": _mlp,
    "conv": _conv,
}


def build(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Stage:
    """Build model ``cfg.name`` with deterministic weights. Raises ``ValueError`` for an unknown name."""
    if cfg.name not in MODELS:
        raise ValueError(f"unknown model {cfg.name!r}; choose one of {sorted(MODELS)}")
    torch.manual_seed(seed)
    return MODELS[cfg.name](cfg, torch.device(device), dtype)
