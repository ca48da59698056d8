"""A region the backend cannot build or split runs eagerly, with one warning on
the ``fxsplit`` logger, and is still split, by the eager path; with
``fallback="error"`` it raises :class:`fxsplit.FxsplitCompileError`."""

from __future__ import annotations

import copy
import importlib
import logging

import pytest
import torch
from stage_check import TwoLayer, assert_grads_equal, clone_input, grads_like, reference

import fxsplit
from fxsplit import _torch_internals

# The module, not the fxsplit.backend() function the package exports under that name.
fxsplit_backend = importlib.import_module("fxsplit.backend")


def Stage() -> TwoLayer:
    return TwoLayer(torch.sigmoid)


def _cannot_split(*args, **kwargs):
    raise RuntimeError("injected: cannot split this backward")


def _cannot_build(*args, **kwargs):
    raise RuntimeError("injected: cannot build this graph")


FAILURES = {
    "split": (fxsplit_backend, "split_backward", _cannot_split),
    "build": (_torch_internals, "compile_fx", _cannot_build),
}


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()  # make the next call compile, so the injected failure is hit
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_failed_region_runs_eagerly_and_is_still_split(
    failure: str, fresh_dynamo: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module, name, fail = FAILURES[failure]
    monkeypatch.setattr(module, name, fail)
    torch.manual_seed(0)
    model = Stage()
    plain = copy.deepcopy(model)
    stage = torch.compile(model, backend=fxsplit.backend(compiler="eager"))
    params = list(model.parameters())
    regions_before = fxsplit.compiled_regions()
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
    assert [r for r in fxsplit.compiled_regions() if not any(r is b for b in regions_before)] == []
    warnings = [r for r in caplog.records if r.name == "fxsplit" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "injected" in warnings[0].getMessage() and "running it eagerly" in warnings[0].getMessage()


def test_b_leaves_grads_untouched_in_a_failed_region(
    fresh_dynamo: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fxsplit_backend, "split_backward", _cannot_split)
    model = Stage()
    stage = torch.compile(model, backend=fxsplit.backend(compiler="eager"))
    x = torch.randn(5, 4, requires_grad=True)
    out = stage(x)
    fxsplit.stage_backward_input([out], [grads_like(out)], [x], model.parameters())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_fallback_error_raises(failure: str, fresh_dynamo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    module, name, fail = FAILURES[failure]
    monkeypatch.setattr(module, name, fail)
    stage = torch.compile(Stage(), backend=fxsplit.backend(compiler="eager", fallback="error"))
    with pytest.raises(Exception) as info:
        stage(torch.randn(5, 4, requires_grad=True))
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or getattr(e, "inner_exception", None)
    errors = [e for e in chain if isinstance(e, fxsplit.FxsplitCompileError)]
    assert errors, f"no FxsplitCompileError in {[type(e).__name__ for e in chain]}"
    assert "could not compile or split" in str(errors[0]) and "injected" in str(errors[0])
