"""``torch.compile(m, backend="fxsplit", mode=..., options=...)``: accepted,
meaning what they mean for ``backend="inductor"``, and forwarded to every graph
of the region; a bad one is a clear error, never a ``TypeError`` from inside Dynamo.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit import _torch_internals as ti


def _stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _split_and_compare(model: nn.Module, compiled: Any) -> None:
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    out = compiled(x)
    g = torch.randn_like(out)
    (dx,), work = fxsplit.stage_backward_input([out], [g], [x], list(model.parameters()))
    fxsplit.stage_backward_weight(list(model.parameters()), work)
    xr = x.detach().clone().requires_grad_()
    ref(xr).backward(g)
    torch.testing.assert_close(dx, xr.grad)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.fixture
def seen_config(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The Inductor config each graph of the region was compiled under (what Inductor reads)."""
    from torch._inductor import config

    seen: list[dict[str, Any]] = []
    real = ti.inductor_compile_graph

    def spy(gm: Any, example_inputs: Any, **kw: Any) -> Any:
        seen.append({"is_backward": kw.get("is_backward", False), "max_autotune": config.max_autotune,
                     "cudagraphs": config.triton.cudagraphs, "epilogue_fusion": config.epilogue_fusion})
        return real(gm, example_inputs, **kw)

    monkeypatch.setattr(ti, "inductor_compile_graph", spy)
    return seen


@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_torch_compile_mode_is_accepted_and_forwarded(mode: str, seen_config: list[dict[str, Any]]) -> None:
    model = _stage()
    compiled = torch.compile(model, backend="fxsplit", mode=mode)
    _split_and_compare(model, compiled)
    # forward, dI, dW: each compiled under the mode's options (on CPU, reduce-overhead is
    # a no-op for the graphs, as for backend="inductor")
    assert len(seen_config) == 3, seen_config
    want = torch._inductor.list_mode_options(mode) if mode != "default" else {}
    for cfg in seen_config:
        assert cfg["max_autotune"] == want.get("max_autotune", False)
        assert cfg["cudagraphs"] == want.get("triton.cudagraphs", False)


@pytest.mark.inductor
def test_torch_compile_options_are_forwarded_to_every_graph(seen_config: list[dict[str, Any]]) -> None:
    model = _stage()
    compiled = torch.compile(model, backend="fxsplit", options={"epilogue_fusion": False})
    _split_and_compare(model, compiled)
    assert seen_config and all(cfg["epilogue_fusion"] is False for cfg in seen_config)
    # the same through fxsplit.backend, where options= is inductor_config's other name
    torch._dynamo.reset()
    seen_config.clear()
    opts = fxsplit.backend(options={"epilogue_fusion": False}, mode="max-autotune-no-cudagraphs").options
    assert opts.inductor_config == {"epilogue_fusion": False} and opts.mode == "max-autotune-no-cudagraphs"
    assert opts.inductor_patches() == {"max_autotune": True, "coordinate_descent_tuning": True,
                                       "epilogue_fusion": False}


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"mode": "fastest"}, r"Unrecognized mode=fastest"),
        ({"options": {"no_such_option": 1}}, r"fxsplit: unknown Inductor option 'no_such_option'"),
        ({"options": {"max_autotune": "yes"}}, r"fxsplit: Inductor option 'max_autotune' takes a bool, got str"),
    ],
)
def test_bad_mode_or_option_is_a_clear_error(kwargs: dict[str, Any], error: str) -> None:
    model = _stage()
    with pytest.raises(Exception, match=error) as info:
        torch.compile(model, backend="fxsplit", **kwargs)(torch.randn(2, 8))
    assert not isinstance(info.value, TypeError) or "unexpected keyword" not in str(info.value)
    assert not fxsplit.fallbacks() or all("fastest" not in str(r) for r in fxsplit.fallbacks())
    # fxsplit.backend checks them when it is made, before anything compiles
    option_kwargs = {"options" if k == "options" else k: v for k, v in kwargs.items()}
    with pytest.raises((ValueError, TypeError), match=error):
        fxsplit.backend(**option_kwargs)


def test_options_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="options= or as inductor_config="):
        fxsplit.backend(options={"max_autotune": True}, inductor_config={"max_autotune": False})


def test_eager_compiler_says_once_that_inductor_options_do_nothing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    monkeypatch.setattr(importlib.import_module("fxsplit.backend"), "_WARNED_EAGER_OPTIONS", set())
    model = _stage()
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        for _ in range(2):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=fxsplit.backend(compiler="eager", options={"max_autotune": True}))
            _split_and_compare(model, compiled)
            for p in model.parameters():
                p.grad = None
    said = [r.getMessage() for r in caplog.records if "have no effect" in r.getMessage()]
    assert len(said) == 1 and "max_autotune" in said[0], said
