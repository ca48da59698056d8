"""A shared zoo of small models for fxsplit tests.

Each :class:`Case` has a ``name``, a ``factory`` returning a fresh
``(module, example_inputs)`` pair (deterministic: it seeds the RNG itself) and
``flags``:

* ``"inductor"``: part of the real-Inductor subset (kept small: Inductor's C++
  compile is slow on CPU); every case also runs with ``compiler="eager"``.
* ``"first_stage"``: no example input requires grad (B has nothing to do).
* ``"random"``: the forward draws random numbers (dropout); compiled and eager
  masks differ, so plain numerics against eager do not apply.
* ``"autocast"``: run the forward under ``torch.autocast("cpu", torch.bfloat16)``.
* ``"buffers"``: the forward updates buffers (BatchNorm running stats).

``atol``/``rtol`` are the tolerances for comparing against eager autograd.

Small helpers shared by the test modules are at the bottom:
:func:`grad_outputs` (outputs requiring grad, flattened), :func:`make_grads`,
:func:`clone_inputs`, :func:`forward`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

__all__ = ["CASES", "Case", "case", "clone_inputs", "forward", "grad_outputs", "make_grads"]


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
