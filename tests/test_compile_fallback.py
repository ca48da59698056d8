"""Compilation failures: never silent, and only real failures fall back.

A region the backend cannot build, split or compile runs eagerly (where the
eager split still applies) after ONE short warning on the ``fxsplit`` logger
naming the region, the graph that failed and the exception's first line; the
fallback is recorded in :func:`fxsplit.fallbacks`. With ``fallback="error"``
(what ``fxsplit.config`` sets for the rest of the suite) it raises a short
:class:`fxsplit.FxsplitCompileError` naming the same. Exceptions Dynamo
raises through a backend to steer its own compilation (restarts, graph
breaks) are not failures: they pass through, and the region compiles.

These are the only tests that may record fallbacks (``pytest.mark.fallback``).
"""

from __future__ import annotations

import copy
import importlib
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from stage_check import TwoLayer, assert_grads_equal, clone_input, grads_like, new_regions, reference

import fxsplit
from fxsplit import _torch_internals

# The module, not the fxsplit.backend() function the package exports under that name.
fxsplit_backend = importlib.import_module("fxsplit.backend")

pytestmark = pytest.mark.fallback

# An exception as long as the Inductor IR dumps that used to fill the warning.
LONG_TAIL = "".join(f"  buf{i}: ComputedBuffer(layout=FixedLayout('cpu', torch.float32))\n" for i in range(5000))


def Stage() -> TwoLayer:
    return TwoLayer(torch.sigmoid)


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected: cannot do this\n" + LONG_TAIL)


def _graph_kind(gm: Any, kw: dict[str, Any]) -> str:
    return {"DIGraph": "dI", "DWGraph": "dW"}.get(type(gm).__name__, "fused" if kw.get("is_backward") else "forward")


def _inject(monkeypatch: pytest.MonkeyPatch, graph: str) -> None:
    """Make the step ``graph`` of every region compile fail."""
    if graph == "aot":
        monkeypatch.setattr(_torch_internals, "compile_fx", _raise)
        return
    if graph == "split":
        monkeypatch.setattr(fxsplit_backend, "split_backward", _raise)
        return
    real = fxsplit_backend._inner_compile_for

    def inner_compile_for(opts: Any) -> Callable[..., Any]:
        inner = real(opts)

        def compile_graph(gm: Any, example_inputs: Any, **kw: Any) -> Any:
            if _graph_kind(gm, kw) == graph:
                _raise()
            return inner(gm, example_inputs, **kw)

        return compile_graph

    monkeypatch.setattr(fxsplit_backend, "_inner_compile_for", inner_compile_for)


GRAPHS = ["aot", "forward", "split", "dI", "dW", "fused"]


@pytest.mark.parametrize("graph", GRAPHS)
def test_failed_region_runs_eagerly_and_is_still_split(
    graph: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _inject(monkeypatch, graph)
    model = Stage()
    plain = copy.deepcopy(model)
    # lazy_compile=False: every graph compiles with the forward, where a failure is the
    # region's (tests/test_lazy_compile.py covers failures of graphs compiled on first use).
    stage = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback="eager", lazy_compile=False))
    params = list(model.parameters())
    regions_before, fallbacks_before = fxsplit.compiled_regions(), len(fxsplit.fallbacks())
    x = torch.randn(5, 4, requires_grad=True)
    seeds = (0, 1, 2)
    ref_dins, ref_dw = reference(plain, [x], seeds)

    with caplog.at_level(logging.DEBUG, logger="fxsplit"):
        for s in seeds:
            xi = clone_input(x * (1 + s / 10))
            out = stage(xi)
            dinputs, work = fxsplit.stage_backward_input([out], [grads_like(out, s)], [xi], params)
            assert all(p.grad is None for p in params) or s > 0
            assert work.compiled == [] and len(work.eager_weights) == 4  # the eager split
            torch.testing.assert_close(dinputs[0], ref_dins[s][0])
            fxsplit.stage_backward_weight(params, work)

    assert_grads_equal([p.grad for p in params], ref_dw)
    assert new_regions(regions_before) == []

    # Recorded once, with the graph that failed and the exception's first line.
    (record,) = fxsplit.fallbacks()[fallbacks_before:]
    assert (record.graph, record.exception, record.message) == (graph, "RuntimeError", "injected: cannot do this")
    assert record.region.startswith("region")

    # One warning, short, saying all of that and where the details are.
    warnings = [r for r in caplog.records if r.name == "fxsplit" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    text = warnings[0].getMessage()
    assert len(text.splitlines()) <= 20 and len(text) < 2000, text[:3000]
    for expected in (record.region, fxsplit_backend._GRAPHS[graph], "RuntimeError", "injected: cannot do this",
                     "running the region eagerly", "DEBUG", "fallback='error'", "fxsplit.fallbacks()"):
        assert expected in text, (expected, text)
    assert "buf1" not in text
    # The full exception is there for whoever turns on DEBUG.
    debug = [r for r in caplog.records if r.name == "fxsplit" and r.levelno == logging.DEBUG and r.exc_info]
    assert len(debug) == 1 and "buf4999" in str(debug[0].exc_info[1])


def test_b_leaves_grads_untouched_in_a_failed_region(monkeypatch: pytest.MonkeyPatch) -> None:
    _inject(monkeypatch, "split")
    model = Stage()
    stage = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback="eager"))
    x = torch.randn(5, 4, requires_grad=True)
    out = stage(x)
    fxsplit.stage_backward_input([out], [grads_like(out)], [x], model.parameters())
    assert all(p.grad is None for p in model.parameters())


def _compile_error(stage: Any, *inputs: torch.Tensor) -> fxsplit.FxsplitCompileError:
    with pytest.raises(Exception) as info:
        stage(*inputs)
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or getattr(e, "inner_exception", None)
    errors = [e for e in chain if isinstance(e, fxsplit.FxsplitCompileError)]
    assert errors, f"no FxsplitCompileError in {[type(e).__name__ for e in chain]}"
    return errors[0]


@pytest.mark.parametrize("graph", GRAPHS)
def test_fallback_error_raises_a_short_error_naming_the_graph(graph: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _inject(monkeypatch, graph)
    before = len(fxsplit.fallbacks())
    stage = torch.compile(Stage(), backend=fxsplit.backend(compiler="eager", fallback="error", lazy_compile=False))
    err = _compile_error(stage, torch.randn(5, 4, requires_grad=True))
    text = str(err)
    assert err.graph == graph and err.region is not None and err.region in text
    assert fxsplit_backend._GRAPHS[graph] in text and "RuntimeError: injected: cannot do this" in text
    assert len(text.splitlines()) == 1 and "buf1" not in text
    assert "buf4999" in str(err.__cause__)  # the original exception, whole
    assert len(fxsplit.fallbacks()) == before  # an error is not a fallback


def test_config_sets_the_default_of_the_backend_string(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fxsplit.config.fallback`` decides for every backend without an explicit
    ``fallback=``, the plain ``backend="fxsplit"`` string included."""
    _inject(monkeypatch, "aot")
    assert fxsplit.config.fallback == "error"  # conftest
    with pytest.raises(Exception):
        torch.compile(Stage(), backend="fxsplit")(torch.randn(5, 4, requires_grad=True))
    torch._dynamo.reset()
    before = len(fxsplit.fallbacks())
    model = Stage()
    x = torch.randn(5, 4)
    with fxsplit.config.patch(fallback="eager"):
        out = torch.compile(model, backend="fxsplit")(x)
    assert fxsplit.config.fallback == "error"  # restored
    assert len(fxsplit.fallbacks()) == before + 1
    torch.testing.assert_close(out, model(x))
    # An explicit option wins over the config.
    torch._dynamo.reset()
    with fxsplit.config.patch(fallback="eager"):
        _compile_error(torch.compile(Stage(), backend=fxsplit.backend(fallback="error")), torch.randn(5, 4))


def test_config_rejects_bad_values_before_changing_anything() -> None:
    with pytest.raises(ValueError, match="fallback"):
        with fxsplit.config.patch(fallback="sometimes"):
            pass
    with pytest.raises(AttributeError, match="no option"):
        with fxsplit.config.patch(fallback="eager", fallbackk="error"):
            pass
    assert fxsplit.config.fallback == "error"
    with pytest.raises(ValueError, match="fallback"):
        fxsplit.backend(fallback="sometimes")


def test_dynamo_restart_passes_through(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A restart signal raised inside the backend reaches Dynamo, which traces
    again and compiles the region: no fallback, no warning, even with
    ``fallback="eager"`` (which used to swallow it and run eagerly)."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    real = fxsplit_backend.split_backward
    calls = []

    def restart_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise TensorifyScalarRestartAnalysis
        return real(*args, **kwargs)

    monkeypatch.setattr(fxsplit_backend, "split_backward", restart_once)
    model = Stage()
    plain = copy.deepcopy(model)
    regions_before, fallbacks_before = fxsplit.compiled_regions(), len(fxsplit.fallbacks())
    stage = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback="eager"))
    x = torch.randn(5, 4, requires_grad=True)
    ref_dins, ref_dw = reference(plain, [x], (0,))
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        xi = clone_input(x)
        out = stage(xi)
        dinputs, work = fxsplit.stage_backward_input([out], [grads_like(out, 0)], [xi], model.parameters())
        fxsplit.stage_backward_weight(model.parameters(), work)
    assert len(calls) == 2
    assert (len(new_regions(regions_before)), len(fxsplit.fallbacks())) == (1, fallbacks_before)
    assert len(work.compiled) == 0  # W ran; what B recorded was compiled work
    torch.testing.assert_close(dinputs[0], ref_dins[0][0])
    assert_grads_equal([p.grad for p in model.parameters()], ref_dw)
    assert not [r for r in caplog.records if r.name == "fxsplit"]


class AttentionBlock(nn.Module):
    """Pre-LayerNorm attention with SDPA, heads from the (dynamic) width."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("fallback", ["eager", "error"])
def test_sdpa_stage_with_dynamic_true_compiles(fallback: str) -> None:
    """The case that used to give zero compiled regions: with ``dynamic=True``
    Dynamo restarts its analysis (``TensorifyScalarRestartAnalysis``) from inside
    the backend; the fallback swallowed that. Now the region compiles, once, for
    every sequence length, and its gradients match eager autograd."""
    model = AttentionBlock()
    plain = copy.deepcopy(model)
    regions_before, fallbacks_before = fxsplit.compiled_regions(), len(fxsplit.fallbacks())
    stage = torch.compile(model, backend=fxsplit.backend(compiler="eager", fallback=fallback), dynamic=True)
    for t in (8, 12, 5):
        x = torch.randn(2, t, 16, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        g = torch.randn(2, t, 16)
        out = stage(x)
        (dx,), work = fxsplit.stage_backward_input([out], [g], [x], model.parameters())
        assert len(work.compiled) == 1
        fxsplit.stage_backward_weight(model.parameters(), work)
        plain(xr).backward(g)
        torch.testing.assert_close(dx, xr.grad)
        assert_grads_equal([p.grad for p in model.parameters()], [p.grad for p in plain.parameters()])
    assert (len(new_regions(regions_before)), len(fxsplit.fallbacks())) == (1, fallbacks_before)
