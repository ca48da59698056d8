"""A stage output that eager weight-holding code in the stage also consumed.

``{"out": tanh(head(h)), "h": h}``: the eager ``head``'s ``AddmmBackward0``
saved ``h`` itself for the weight's gradient, and W re-runs that node. B still
detaches ``h`` in place (upstream's way of freeing the graph above the
outputs), so W must work all the same, as ordinary backward does: gradients
are compared with ordinary backward on identical copies, compiled and not.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from stage_check import assert_grads_equal, clone_input, flat_pairs, grads_like, reference

import fxsplit
from fxsplit import _torch_internals


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class LinearSavingInput(torch.autograd.Function):
    """An eager linear as a custom Function: its node saves the input through
    ``ctx.save_for_backward`` (``_raw_saved_tensors``) rather than as a C++ node."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(h, w)
        return h @ w.t() + b

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        h, w = ctx.saved_tensors
        return g @ w, g.t() @ h, g.sum(0)


class Stage(nn.Module):
    """Returns a tensor (``h``) that the eager head, which holds weights, consumed too."""

    def __init__(self, function_head: bool = False) -> None:
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(6, 3)
        self.function_head = function_head

    @torch._dynamo.disable
    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.function_head:
            return torch.tanh(LinearSavingInput.apply(h, self.head.weight, self.head.bias))
        return torch.tanh(self.head(h))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"out": self._head(h), "h": h}


def build(mode: str) -> tuple[nn.Module, Callable[[nn.Module], nn.Module]]:
    """The stage for ``mode`` (uncompiled) and how to compile a copy of it the same way."""
    torch.manual_seed(0)
    stage = Stage(function_head=mode == "function_head")

    def compile_as(m: nn.Module) -> nn.Module:
        if mode == "whole_disable":  # compiled as a whole; the head under torch._dynamo.disable
            m.compile(backend=fxsplit.backend(compiler="eager"))
        elif mode == "mixed":  # the body compiled in place, the head a plain eager module
            m.body.compile(backend=fxsplit.backend(compiler="eager"))
        elif mode == "inductor":
            m.body.compile(backend=fxsplit.backend())
        return m

    return stage, compile_as


def ordinary(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    xi = clone_input(x)
    out = model(xi)
    torch.autograd.backward(*flat_pairs(out, grads_like(out)))
    return xi.grad, [p.grad for p in model.parameters()]


MODES = [
    "eager",
    "function_head",
    "whole_disable",
    "mixed",
    pytest.param("inductor", marks=pytest.mark.inductor),
]


@pytest.mark.parametrize("first_stage", [False, True], ids=["middle", "first"])
@pytest.mark.parametrize("mode", MODES)
def test_output_saved_by_eager_weight_code(mode: str, first_stage: bool) -> None:
    stage, compile_as = build(mode)
    x = torch.randn(5, 4, requires_grad=not first_stage)
    ((ref_din,),), ref_dw = reference(stage, [x])
    compiled_din, compiled_dw = ordinary(compile_as(copy.deepcopy(stage)), x)

    before = fxsplit.compiled_regions()
    run = compile_as(stage)
    xi = clone_input(x)
    out = run(xi)
    params = list(stage.parameters())
    dinputs, work = fxsplit.stage_backward_input(out, grads_like(out), [xi], params)
    assert all(p.grad is None for p in params), "B did weight-gradient work"
    if _torch_internals.can_keep_saved_through_detach():
        assert out["h"].grad_fn is None, "B left the output attached: its graph is not freed"
    elif mode == "function_head" and not first_stage and fxsplit.config.current("whole_nodes") == "once":
        # The Function that saved it is on the input's path: it ran once, at B, and W runs no
        # node that saved it (in a first stage it is W's, as under whole_nodes="again").
        assert out["h"].grad_fn is None, "B left the output attached: its graph is not freed"
    else:  # torch 2.11: the saved reference cannot be version-checked when re-packed
        assert out["h"].grad_fn is not None, "B detached an output W's nodes saved"
    if mode in ("whole_disable", "mixed", "inductor"):
        assert work.compiled, "the compiled body did not split"
        assert len([r for r in fxsplit.compiled_regions() if not any(r is b for b in before)]) >= 1
    fxsplit.stage_backward_weight(params, work)

    dw = [p.grad for p in params]
    assert_grads_equal(dw, ref_dw)
    assert_grads_equal(dw, compiled_dw)
    if first_stage:
        assert dinputs[0] is None
    else:
        torch.testing.assert_close(dinputs[0], ref_din)
        torch.testing.assert_close(dinputs[0], compiled_din)


@pytest.mark.parametrize("mode", ["eager", "mixed"])
def test_b_twice_on_such_outputs_is_refused_and_w_still_completes(mode: str) -> None:
    stage, compile_as = build(mode)
    x = torch.randn(5, 4, requires_grad=True)
    ((ref_din,),), ref_dw = reference(stage, [x])
    run = compile_as(stage)
    xi = clone_input(x)
    out = run(xi)
    params = list(stage.parameters())
    grads = grads_like(out)
    _, work = fxsplit.stage_backward_input(out, grads, [xi], params)
    din = xi.grad.clone()
    for again in (out, out["h"]):
        with pytest.raises(RuntimeError, match="stage_backward_input already ran"):
            fxsplit.stage_backward_input(again, grads if again is out else grads["h"], [xi], params)
    torch.testing.assert_close(xi.grad, din)  # the refused B changed nothing
    fxsplit.stage_backward_weight(params, work)
    torch.testing.assert_close(xi.grad, ref_din)
    assert_grads_equal([p.grad for p in params], ref_dw)


@pytest.mark.parametrize("when", ["between_b_and_w", "before_b"])
def test_such_an_output_modified_in_place_is_an_error_at_w(when: str) -> None:
    """Autograd's version check still guards what W re-runs: ordinary backward
    raises for a saved tensor modified in place, and so does W. ``before_b``:
    a first stage, whose B runs nothing, modified without autograd seeing it
    (under ``no_grad``), so the node that saved it is still the one W runs."""
    stage, _ = build("eager")
    x = torch.randn(5, 4, requires_grad=when == "between_b_and_w")
    params = list(stage.parameters())
    if when == "before_b":
        ref = copy.deepcopy(stage)
        out = ref(x)
        with torch.no_grad():
            out["h"].add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.backward(*flat_pairs(out, grads_like(out)))
    out = stage(x)
    if when == "before_b":
        with torch.no_grad():
            out["h"].add_(1.0)
    _, work = fxsplit.stage_backward_input(out, grads_like(out), [x], params)
    if when == "between_b_and_w":
        out["h"].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fxsplit.stage_backward_weight(params, work)
    assert stage.head.weight.grad is None
