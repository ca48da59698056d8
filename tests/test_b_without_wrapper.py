"""B through autograd's engine runs a split region's compiled backward without
AOTAutograd's wrapper once it has seen what the wrapper does
(``fxsplit.runtime.AotCall``; the direct call's cases are in test_direct_b.py).
Checked against ordinary backward on an identical copy, over microbatches
where the guard holds and where it misses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxsplit
from stage_check import new_regions


class _TwoRegions(nn.Module):
    """A graph break between two blocks: two regions, the input used by both."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(self.ln(x))
        torch._dynamo.graph_break()
        return x + self.b(torch.tanh(h))


def test_b_through_the_engine_skips_the_wrapper_of_every_region() -> None:
    torch.manual_seed(0)
    model = _TwoRegions()
    ordinary = copy.deepcopy(model)
    be = fxsplit.backend(fallback="error")
    fn, ref_fn = torch.compile(model, backend=be), torch.compile(ordinary, backend=be)
    x = torch.randn(4, 8)
    gs = [torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 4).t(), torch.randn(4, 8)]
    before = fxsplit.compiled_regions()
    unwrapped = []
    with fxsplit.config.patch(direct_b=False):
        for step, g in enumerate(gs):
            params = list(model.parameters())
            xi, ri = x.detach().requires_grad_(), x.detach().requires_grad_()
            out = fn(xi)
            (dx,), work = fxsplit.stage_backward_input([out], [g], [xi], params)
            fxsplit.stage_backward_weight(params, work)
            ref_fn(ri).backward(g)
            torch.testing.assert_close(dx, ri.grad, msg=f"step {step}")
            for (name, p), q in zip(model.named_parameters(), ordinary.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}: {name}")
            unwrapped.append(sorted(r.unwrapped_b_runs for r in new_regions(before)))
    regions = new_regions(before)  # (the copies share them: the weights are graph inputs)
    assert len(regions) == 2 and all(r.direct_b_runs == 0 and r.stats["fused_runs"] == 4 for r in regions)
    # The first B learns; the strided gradient goes through the top region's
    # wrapper, which coerces it, and the bottom region's gets a contiguous one.
    assert unwrapped == [[0, 0], [1, 1], [1, 2], [2, 3]]


def test_skip_aot_wrapper_off_keeps_the_wrapper_and_a_bad_value_is_refused() -> None:
    torch.manual_seed(0)
    model = _TwoRegions()
    ordinary = copy.deepcopy(model)
    be = fxsplit.backend(fallback="error")
    fn = torch.compile(model, backend=be)
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    before = fxsplit.compiled_regions()
    with fxsplit.config.patch(skip_aot_wrapper=False):
        for _ in range(3):
            params = list(model.parameters())
            xi = x.detach().requires_grad_()
            (dx,), work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
            fxsplit.stage_backward_weight(params, work)
            ri = x.detach().requires_grad_()
            ordinary(ri).backward(g)
            torch.testing.assert_close(dx, ri.grad)
    for p, q in zip(model.parameters(), ordinary.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    regions = new_regions(before)
    assert len(regions) == 2 and [r.unwrapped_b_runs for r in regions] == [0, 0]
    assert [r.stats["di_runs"] for r in regions] == [3, 3]
    fxsplit.config.skip_aot_wrapper = "no"
    try:
        xi = x.detach().requires_grad_()
        out = fn(xi)
        with pytest.raises(ValueError, match="skip_aot_wrapper"):
            fxsplit.stage_backward_input([out], [g], [xi], list(model.parameters()))
    finally:
        fxsplit.config.skip_aot_wrapper = True
    assert [r.stats["di_runs"] for r in regions] == [3, 3]
