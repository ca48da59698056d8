"""Nodes whose one backward call computes every edge's gradient run once, at B.

A custom ``torch.autograd.Function`` or a region another backend compiled
returns its input and weight gradients from one call. B needs the input
gradients, so it runs; what the call produced for the weight side is kept
for W (``fxsplit.config.whole_nodes == "once"``, the default) instead of
running the node again at W. Each stage here runs two microbatches as a
zero-bubble schedule does (B0, B1, W1, W0) and is compared with ordinary
backward on identical copies (compiled as the split copy is, and
uncompiled): FLOPs of B + W equal ordinary backward's, every gradient is
exact, hooks fire at W as often as after ordinary backward, and an
interrupted W loses nothing.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import fxsplit

sys.path.insert(0, os.path.dirname(__file__))
import zoo  # noqa: E402

D = 16


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class TwoBlocks(nn.Module):
    """Two MLP blocks; ``a`` is compiled in place by another backend."""

    def __init__(self) -> None:
        super().__init__()
        self.a = MLPBlock()
        self.b = MLPBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


@torch._dynamo.disable
def _opaque(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return zoo.LinearFn.apply(h, w, b)


class BrokenAroundFunction(nn.Module):
    """Compiled with fxsplit as a whole; Dynamo breaks the graph around an opaque Function."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, D)
        self.opaque = zoo.FnLinear(D, D)
        self.lin2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.lin1(x))
        h = _opaque(h, self.opaque.weight, self.opaque.bias)
        return x + self.lin2(F.gelu(h))


def _functions() -> tuple[nn.Module, Callable[[nn.Module], None]]:
    return zoo.FunctionStage(D), lambda m: None


def _functions_compiled() -> tuple[nn.Module, Callable[[nn.Module], None]]:
    return zoo.FunctionStage(D), lambda m: m.compile(backend=fxsplit.backend(compiler="eager"))


def _block_by(backend: str) -> Callable[[], tuple[nn.Module, Callable[[nn.Module], None]]]:
    return lambda: (TwoBlocks(), lambda m: m.a.compile(backend=backend))


def _broken() -> tuple[nn.Module, Callable[[nn.Module], None]]:
    return BrokenAroundFunction(), lambda m: m.compile(backend=fxsplit.backend(compiler="eager"))


class OneOutputUsed(nn.Module):
    """A :class:`zoo.PairFn` whose second output is unused: its backward gets no gradient
    for it and returns ``None`` for ``w2``, which then gets no gradient at all."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.w2 = nn.Parameter(torch.randn(D, D) / D**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = zoo.PairFn.apply(self.lin(x), self.w, self.w2)
        return x + a


def _beside_fxsplit() -> tuple[nn.Module, Callable[[nn.Module], None]]:
    def prepare(m: nn.Module) -> None:
        m.a.compile(backend="aot_eager")
        m.b.compile(backend=fxsplit.backend(compiler="eager"))

    return TwoBlocks(), prepare


STAGES = {
    "custom_functions": _functions,
    "block_aot_eager_beside_an_fxsplit_block": _beside_fxsplit,
    "function_returning_none_for_an_edge": lambda: (OneOutputUsed(), lambda m: None),
    "custom_functions_fxsplit": _functions_compiled,
    "block_aot_eager": _block_by("aot_eager"),
    "fxsplit_graph_break_around_function": _broken,
}


def _flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _hooked(m: nn.Module, log: Counter[str], phase: list[str]) -> None:
    for name, p in m.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: log.update([f"{name}@{phase[0]}"]))


def _run(stage: str, mode: str = "once") -> dict[str, Any]:
    """The split copy (B0, B1, W1, W0) against the ordinary ones; returns the figures."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    base, prepare = STAGES[stage]()
    copies = {name: copy.deepcopy(base) for name in ("split", "ordinary", "eager")}
    for name in ("split", "ordinary"):
        prepare(copies[name])
    logs = {name: Counter() for name in copies}
    phase = ["B"]
    for name, m in copies.items():
        _hooked(m, logs[name], phase if name == "split" else ["ordinary"])
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 6, D, generator=gen) for _ in range(2)]
    dys = [torch.randn(2, 6, D, generator=gen) for _ in range(2)]
    m = copies["split"]
    params = list(m.parameters())
    inputs = [x.clone().requires_grad_() for x in xs]
    outs = [m(x) for x in inputs]
    b_flops = w_flops = 0
    dxs, works = [], []
    with fxsplit.config.patch(whole_nodes=mode) if mode != "once" else contextlib.nullcontext():  # "once": the default
        for out, dy in zip(outs, dys):
            got: dict[str, Any] = {}
            b_flops += _flops(lambda out=out, dy=dy: got.update(r=fxsplit.stage_backward_input([out], [dy], inputs[len(dxs):len(dxs) + 1], params)))
            (dx,), work = got["r"]
            dxs.append(dx)
            works.append(work)
        assert not logs["split"], f"{stage}: a weight hook fired at B: {logs['split']}"
        assert all(p.grad is None for p in params), f"{stage}: B set a weight's .grad"
        phase[0] = "W"
        held = [w.held_bytes for w in works]
        explain = works[0].explain()
        for work in reversed(works):
            w_flops += _flops(lambda work=work: fxsplit.stage_backward_weight(params, work))
    ordinary_flops = 0
    for name in ("ordinary", "eager"):
        for k, (x, dy) in enumerate(zip(xs, dys)):
            xi = x.clone().requires_grad_()
            out = copies[name](xi)
            if name == "ordinary":
                ordinary_flops += _flops(lambda out=out, dy=dy: out.backward(dy))
            else:
                out.backward(dy)
            torch.testing.assert_close(dxs[k], xi.grad, msg=lambda msg: f"{stage}: dx of microbatch {k} vs {name}: {msg}")
    for pname, p in m.named_parameters():
        for name in ("ordinary", "eager"):
            q = dict(copies[name].named_parameters())[pname]
            torch.testing.assert_close(p.grad, q.grad, msg=lambda msg, name=name: f"{stage}: {pname}.grad vs {name}: {msg}")
    fired = Counter({k.split("@")[0]: n for k, n in logs["split"].items()})
    assert fired == Counter({k.split("@")[0]: n for k, n in logs["ordinary"].items()}), (fired, logs["ordinary"])
    assert all(k.endswith("@W") for k in logs["split"]), logs["split"]
    return {"b": b_flops, "w": w_flops, "ordinary": ordinary_flops, "held": held, "explain": explain}


@pytest.mark.parametrize("stage", list(STAGES))
def test_b_plus_w_flops_equal_ordinary_backward(stage: str) -> None:
    r = _run(stage)
    assert r["b"] + r["w"] == r["ordinary"] > 0, r
    assert r["w"] > 0, r  # W does the weight-gradient work that is left


def test_functions_run_once_and_their_kept_gradients_are_explained_and_counted() -> None:
    once = _run("custom_functions", "once")
    again = _run("custom_functions", "again")
    assert "ran once, in B" in once["explain"] and "LinearFnBackward" in once["explain"], once["explain"]
    assert "ran once" not in again["explain"], again["explain"]
    # "again": the Functions' backward runs at B and again at W
    assert again["b"] + again["w"] > again["ordinary"] == once["ordinary"], (again, once)
    # kept for W: at least every Function weight's gradient (4 fp32 matrices of D x D, 2 vectors)
    weight_bytes = 4 * (3 * D * D + 2 * D)
    assert min(once["held"]) >= weight_bytes, (once["held"], weight_bytes)


def test_a_block_compiled_by_inductor_runs_once() -> None:
    STAGES["block_inductor"] = _block_by("inductor")
    try:
        r = _run("block_inductor")
    finally:
        del STAGES["block_inductor"]
    assert r["b"] + r["w"] == r["ordinary"] > 0, r


@pytest.mark.parametrize("interrupt", [RuntimeError, KeyboardInterrupt])
def test_an_interrupted_w_loses_no_kept_gradient(interrupt: type[BaseException]) -> None:
    torch.manual_seed(0)
    m = zoo.FunctionStage(D)
    ref = copy.deepcopy(m)
    calls = []

    def hook(g: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 1:
            raise interrupt("stop")
        return g

    m.fn1.weight.register_hook(hook)
    ref.fn1.weight.register_hook(lambda g: g)
    x = torch.randn(2, 6, D)
    dy = torch.randn(2, 6, D)
    xi = x.clone().requires_grad_()
    out = m(xi)
    params = list(m.parameters())
    (dx,), work = fxsplit.stage_backward_input([out], [dy], [xi], params)
    with pytest.raises(BaseException) as raised:
        fxsplit.stage_backward_weight(params, work)
    assert isinstance(raised.value, interrupt) or isinstance(raised.value.__cause__, interrupt), raised.value
    assert work.pending
    # untouched or final: a .grad is either None or its full gradient
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda msg, name=name: f"{name} after the interrupt: {msg}")
    fxsplit.stage_backward_weight(params, work)  # finishes exactly the rest
    assert not work.pending
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda msg, name=name: f"{name}: {msg}")
    torch.testing.assert_close(dx, xr.grad)


class _HFLlamaStage(nn.Module):
    """A model we did not write: transformers' ``LlamaModel`` (two layers, random init)
    fed hidden states; its first decoder layer is compiled in place by another backend."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(
            hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=2 * D, vocab_size=32, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
            pad_token_id=0,
        )
        self.model = transformers.LlamaModel(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x).last_hidden_state


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_held_out_transformers_layer_compiled_by_another_backend(backend: str) -> None:
    pytest.importorskip("transformers")
    STAGES["hf_llama"] = lambda: (_HFLlamaStage(), lambda m: m.model.layers[0].compile(backend=backend))
    try:
        r = _run("hf_llama")
    finally:
        del STAGES["hf_llama"]
    assert r["b"] + r["w"] == r["ordinary"] > 0, r
