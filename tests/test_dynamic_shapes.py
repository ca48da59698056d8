"""Symbolic sizes end to end, with the real Inductor.

A ``[batch, seq, dim]`` MLP (Linear-GELU-Linear) flattens its activations to
``[batch*seq, dim]`` for the matmuls, so its dW graph reads tensors whose
sizes are products of symbols. dW must receive the SymInts that bind those
symbols, or Inductor cannot compile it ("For 2*s27, expected [s27] to have
been codegen-ed") and the FX graph cache cannot check its guards. Every way
of getting dynamic sizes is covered: automatic dynamic shapes (the sequence
length changes once), ``dynamic=True``, ``mark_dynamic`` on batch and
sequence, and recompiles alternating static and dynamic, with a fresh FX
graph cache and without one. Gradients are compared with eager autograd after
every B-then-W step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from stage_check import assert_grads_equal, new_regions
from test_split_pass import unbound_symbols
from torch._dynamo.utils import counters

import fxsplit

pytestmark = pytest.mark.inductor


class MLP3D(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def split_step(model: nn.Module, stage: nn.Module, ref: nn.Module, x: torch.Tensor, mark: bool = False) -> None:
    """B then W through the compiled stage, ordinary backward on ``ref``; compare."""
    for p in (*model.parameters(), *ref.parameters()):
        p.grad = None
    xr = x.detach().clone().requires_grad_()
    if mark:
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(x, 1)
    out = stage(x)
    g = torch.randn_like(out)
    (dx,), work = fxsplit.stage_backward_input([out], [g], [x], model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert len(work.compiled) == 1, "the stage did not run a compiled split region"
    fxsplit.stage_backward_weight(model.parameters(), work)
    ref(xr).backward(g)
    torch.testing.assert_close(dx, xr.grad)
    assert_grads_equal([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])


def assert_dynamic_and_bound(regions: list) -> None:
    """The last region is dynamic, and its dW graph binds every size symbol it mentions."""
    dw = regions[-1].split.dw_graph
    kinds = [l.kind for l in regions[-1].split.live_ins]
    assert "symint" in kinds, f"the region is not dynamic: {regions[-1].split.describe()}"
    assert unbound_symbols(dw) == set(), regions[-1].split.describe()


# (batch, seq) per step, and how dynamic sizes come about. No size equals the
# model width (8): Dynamo would give both one symbol, then specialize it.
MODES = {
    "automatic": dict(shapes=[(2, 6), (2, 10), (2, 5)], compile={}, mark=False, regions=2),
    "dynamic_true": dict(shapes=[(2, 6), (3, 10)], compile={"dynamic": True}, mark=False, regions=1),
    "mark_dynamic": dict(shapes=[(2, 6), (3, 10)], compile={}, mark=True, regions=1),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sizes_change_under_inductor(mode: str) -> None:
    spec = MODES[mode]
    model = MLP3D()
    ref = copy.deepcopy(model)
    before = fxsplit.compiled_regions()
    stage = torch.compile(model, backend=fxsplit.backend(fused_backward=False), **spec["compile"])
    for batch, seq in spec["shapes"]:
        split_step(model, stage, ref, torch.randn(batch, seq, 8, requires_grad=True), mark=spec["mark"])
    regions = new_regions(before)
    assert len(regions) == spec["regions"]
    assert_dynamic_and_bound(regions)


def test_ordinary_backward_of_a_dynamic_region_matches_eager() -> None:
    """The fused backward of a dynamic region (what ordinary ``.backward()`` runs)."""
    model = MLP3D()
    ref = copy.deepcopy(model)
    stage = torch.compile(model, backend="fxsplit", dynamic=True)
    for batch, seq in ((2, 6), (3, 5)):
        x = torch.randn(batch, seq, 8, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        g = torch.randn(batch, seq, 8)
        stage(x).backward(g)
        ref(xr).backward(g)
        torch.testing.assert_close(x.grad, xr.grad)
        assert_grads_equal([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    assert fxsplit.compiled_regions()[-1].stats["fused_runs"] == 2


@pytest.mark.parametrize("fx_graph_cache", [True, False], ids=["fx_graph_cache", "no_fx_graph_cache"])
def test_alternating_static_and_dynamic_recompiles(
    fx_graph_cache: bool, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dynamic, static, dynamic compiles of one module, twice over, in a fresh
    Inductor cache directory: the second round loads every graph from the FX
    graph cache (when on), whose guards are checked against the dW graph's
    SymInt inputs (this used to raise ``KeyError: 'x0'`` on the dW compile)."""
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = MLP3D()
    ref = copy.deepcopy(model)
    with inductor_config.patch(fx_graph_cache=fx_graph_cache):
        for round_ in range(2 if fx_graph_cache else 1):  # a second round only tests the cache
            counters.clear()
            for dynamic in (True, False, True):
                torch._dynamo.reset()
                before = fxsplit.compiled_regions()
                stage = torch.compile(model, backend=fxsplit.backend(fused_backward=False), dynamic=dynamic)
                for batch, seq in ((2, 6), (2, 6)) if not dynamic else ((2, 6), (3, 5)):
                    split_step(model, stage, ref, torch.randn(batch, seq, 8, requires_grad=True))
                regions = new_regions(before)
                assert len(regions) == 1
                if dynamic:
                    assert_dynamic_and_bound(regions)
            hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
            if not fx_graph_cache:
                assert hits == 0
            elif round_ == 0:
                # A fresh cache: the first dynamic and the static region miss; the
                # second dynamic region hits (forward, dI, dW), as in the issue.
                assert misses >= 6 and hits >= 3, dict(counters["inductor"])
            else:
                assert misses == 0 and hits >= 9, dict(counters["inductor"])
