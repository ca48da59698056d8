"""One API over mixed stages: fxsplit-compiled regions, graph breaks, eager
code between compiled submodules, and modules not compiled at all.

For each stage: dinputs and ``.grad`` equal plain autograd, B leaves every
weight's ``.grad`` untouched, and no region is computed twice (region
counters, and FLOPs(B) + FLOPs(W) == FLOPs(ordinary backward)).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from stage_check import assert_grads_equal, clone_input, grads_like, reference
from torch.utils.flop_counter import FlopCounterMode

import fxsplit

BACKEND = fxsplit.backend(compiler="eager")


class GraphBreak(nn.Module):
    """Compiled as a whole; Dynamo breaks it into two regions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h).relu() * 2


class Block(nn.Module):
    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.lin = nn.Linear(i, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class EagerBetweenCompiled(nn.Module):
    """compiled Block -> eager Linear (and an eager scale fed into a compiled
    block's input) -> compiled Block."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Block(6, 8)
        self.middle = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.full((8,), 0.5))
        self.last = Block(8, 4)

    def compile_parts(self) -> EagerBetweenCompiled:
        self.first.compile(backend=BACKEND)
        self.last.compile(backend=BACKEND)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.middle(self.first(x)) * self.scale)


class NotCompiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build(kind: str) -> tuple[nn.Module, nn.Module, int]:
    """(plain module for the reference, the stage as run, fxsplit regions it has)."""
    torch.manual_seed(0)
    if kind == "graph_break":
        m = GraphBreak()
        return copy.deepcopy(m), torch.compile(m, backend=BACKEND), 2
    if kind == "eager_between_compiled":
        m = EagerBetweenCompiled()
        return copy.deepcopy(m), m.compile_parts(), 2
    m = NotCompiled()
    return copy.deepcopy(m), m, 0


def region_counters() -> dict[int, dict[str, int]]:
    return {id(r): dict(r.stats) for r in fxsplit.compiled_regions()}


def delta(before: dict, after: dict, key: str) -> dict[int, int]:
    return {k: v[key] - before.get(k, {}).get(key, 0) for k, v in after.items() if v[key] != before.get(k, {}).get(key, 0)}


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


KINDS = ["graph_break", "eager_between_compiled", "not_compiled"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("first_stage", [False, True], ids=["middle_stage", "first_stage"])
def test_mixed_stage_matches_autograd_and_computes_each_region_once(kind: str, first_stage: bool) -> None:
    plain, stage, n_regions = build(kind)
    x = torch.randn(5, 6, requires_grad=not first_stage)
    ref_dins, ref_dw = reference(plain, [x])
    params = list(stage.parameters())

    # FLOPs of an ordinary backward of the same stage (fused graphs for compiled regions).
    out = stage(clone_input(x))
    full = flops(lambda: out.backward(grads_like(out)))
    for p in params:
        p.grad = None

    xi = clone_input(x)
    out = stage(xi)
    c0 = region_counters()
    box = {}
    b_flops = flops(lambda: box.update(r=fxsplit.stage_backward_input([out], [grads_like(out)], [xi], params)))
    dinputs, work = box.pop("r")
    c1 = region_counters()
    assert all(p.grad is None for p in params), "B touched a weight gradient"
    assert len(work.compiled) == n_regions
    w_flops = flops(lambda: fxsplit.stage_backward_weight(params, work))
    c2 = region_counters()

    assert_grads_equal(list(dinputs), ref_dins[0])
    assert_grads_equal([p.grad for p in params], ref_dw)
    assert b_flops + w_flops == full, f"B {b_flops} + W {w_flops} != full backward {full}"
    assert w_flops > 0
    # A first stage too: each region's dI (the activation-gradient chain) at B, its dW at W.
    # Only a stage with no region and no input gradient does nothing at B (upstream's way).
    if first_stage and not n_regions:
        assert b_flops == 0
    else:
        assert b_flops > 0
        assert sorted(delta(c0, c1, "di_runs").values()) == [1] * n_regions
        assert delta(c0, c1, "dw_runs") == {} and delta(c0, c1, "fused_runs") == {}
        assert sorted(delta(c1, c2, "dw_runs").values()) == [1] * n_regions
        assert delta(c1, c2, "di_runs") == {} and delta(c1, c2, "fused_runs") == {}
        assert set(delta(c0, c1, "di_runs")) == set(delta(c1, c2, "dw_runs"))


def test_which_path_each_part_took_is_logged_and_explained(caplog: pytest.LogCaptureFixture) -> None:
    _, stage, _ = build("eager_between_compiled")
    x = torch.randn(5, 6, requires_grad=True)
    params = list(stage.parameters())
    out = stage(x)
    with caplog.at_level(logging.DEBUG, logger="fxsplit"):
        _, work = fxsplit.stage_backward_input([out], [grads_like(out)], [x], params)
        text = fxsplit.explain(work)
        fxsplit.stage_backward_weight(params, work)
    lines = text.splitlines()
    assert sum(line.startswith("compiled") for line in lines) == 2
    assert any(line.startswith("eager") and "AddmmBackward0" in line for line in lines)
    assert lines[-1] == "weights: 3 by eager autograd in W, 4 by compiled dW graphs, 0 with no gradient from these outputs"
    messages = [r.getMessage() for r in caplog.records if r.name == "fxsplit"]
    b_logs = [m for m in messages if m.startswith("fxsplit: B:")]
    w_logs = [m for m in messages if m.startswith("fxsplit: W:")]
    assert len(b_logs) == 1 and "dI ran compiled in region" in b_logs[0]
    assert len(w_logs) == 1 and "eager autograd for 3 weight(s)" in w_logs[0]
    assert fxsplit.explain(work) == "W already ran for this microbatch; nothing is held."
