"""The cases of upstream's ``test/distributed/pipelining/test_backward.py``
(newest version, with its GradientEdge cases), written here for fxsplit's
drop-ins and run on eager modules, on modules compiled with fxsplit
(``compiler="eager"``) and, for a subset, with the real Inductor.

Where fxsplit differs from upstream on purpose, the test says so and docs/semantics.md
("Differences from upstream") gives the reason.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit

MODES = ["eager", "compiled", pytest.param("inductor", marks=pytest.mark.inductor)]
FAST = ["eager", "compiled"]
D, BATCH = 16, 8


def staged(mod: nn.Module, mode: str) -> Any:
    if mode == "eager":
        return mod
    return torch.compile(mod, backend=fxsplit.backend(compiler="inductor" if mode == "inductor" else "eager", fallback="error"))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(D, D)
        self.net2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(torch.relu(self.net1(x)))


class PassThrough(torch.autograd.Function):
    """(x, w) -> (x, w): one autograd node with two outputs, in the B set and next to a weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.view_as(x), w.view_as(w)

    @staticmethod
    def backward(ctx: Any, gx: torch.Tensor, gw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gx, gw


class TwoOutputIntermediate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D // 2, D // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, [D // 2, D // 2], dim=1)
        a, w = PassThrough.apply(a, self.w)
        return (a @ w) * b


class Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = ctx.saved_tensors
        ga = g @ b.t() if ctx.needs_input_grad[0] else None
        gb = a.t() @ g if ctx.needs_input_grad[1] else None
        return ga, gb


class CustomMatmulStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Matmul.apply(x, self.weight)


class SharedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w) @ self.w


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(D, D)
        self.net2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.net1(x), self.net2(x), torch.ones(1)


def pair(mod_cls: type[nn.Module]) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """A stage, an identical reference copy, an input that requires grad and its reference twin."""
    torch.manual_seed(0)
    mod = mod_cls()
    x = torch.randn(BATCH, D, requires_grad=True)
    return mod, copy.deepcopy(mod), x, x.detach().clone().requires_grad_()


def assert_params_match(mod: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, r) in zip(mod.named_parameters(), ref.named_parameters()):
        if r.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, r.grad, msg=lambda m: f"{name}: {m}")


mse = nn.MSELoss(reduction="sum")


@pytest.mark.parametrize("mode", MODES)
def test_full_stage_backward_on_a_loss(mode: str) -> None:
    mod, ref, x, rx = pair(MLP)
    target = torch.randn(BATCH, D)
    grads = fxsplit.stage_backward(stage_output=mse(staged(mod, mode)(x), target), output_grads=None, input_values=(x,))
    mse(ref(rx), target).backward()
    torch.testing.assert_close(grads[0], rx.grad)
    assert x.grad is None  # handed back, not kept, as upstream does
    assert_params_match(mod, ref)


@pytest.mark.parametrize("mode", FAST)
def test_b_on_a_loss_gives_input_grads_and_leaves_weights(mode: str) -> None:
    mod, ref, x, rx = pair(MLP)
    target = torch.randn(BATCH, D)
    dinputs, _ = fxsplit.stage_backward_input(
        stage_outputs_or_loss=(mse(staged(mod, mode)(x), target),), output_grads=None,
        input_values=[x], weights=mod.parameters(),
    )
    mse(ref(rx), target).backward()
    torch.testing.assert_close(x.grad, rx.grad)
    torch.testing.assert_close(dinputs[0], rx.grad)
    assert all(p.grad is None for p in mod.parameters())


@pytest.mark.parametrize("mode", FAST)
def test_b_skips_inputs_that_are_not_tensors(mode: str) -> None:
    mod, ref, x, rx = pair(MLP)
    dinputs, _ = fxsplit.stage_backward_input(
        stage_outputs_or_loss=(staged(mod, mode)(x).sum(),), output_grads=None,
        input_values=[object(), x], weights=mod.parameters(),
    )
    ref(rx).sum().backward()
    assert dinputs[0] is None
    torch.testing.assert_close(x.grad, rx.grad)
    torch.testing.assert_close(dinputs[1], rx.grad)


class ViewIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


@pytest.mark.parametrize("mode", FAST)
def test_split_backward_of_a_view_output(mode: str) -> None:
    """A stage ending at an activation-checkpoint-like identity that returns a view."""
    mod, ref, x, rx = pair(MLP)
    g = torch.randn(BATCH, D)
    out = ViewIdentity.apply(staged(mod, mode)(x))
    assert out._is_view()
    dinputs, groups = fxsplit.stage_backward_input((out,), [g], [x], mod.parameters())
    fxsplit.stage_backward_weight(mod.parameters(), groups)
    ref(rx).backward(g)
    torch.testing.assert_close(dinputs[0], rx.grad)
    assert_params_match(mod, ref)


@pytest.mark.parametrize("mode", MODES)
def test_custom_function_split_after_the_output_is_dropped(mode: str) -> None:
    mod, ref, x, rx = pair(CustomMatmulStage)
    g = torch.randn(BATCH, D)
    out = staged(mod, mode)(x)
    dinputs, groups = fxsplit.stage_backward_input((out,), [g], [x], mod.parameters())
    del out  # pipeline stages may drop activations before W
    gc.collect()
    fxsplit.stage_backward_weight(mod.parameters(), groups)
    ref(rx).backward(g)
    torch.testing.assert_close(dinputs[0], rx.grad)
    assert_params_match(mod, ref)


@pytest.mark.parametrize("mode", FAST)
def test_w_with_retain_graph(mode: str) -> None:
    mod, ref, x, rx = pair(MLP)
    target = torch.randn(BATCH, D)
    _, groups = fxsplit.stage_backward_input((mse(staged(mod, mode)(x), target),), None, [x], mod.parameters())
    fxsplit.stage_backward_weight(mod.parameters(), groups, retain_graph=True)
    mse(ref(rx), target).backward()
    assert_params_match(mod, ref)


@pytest.mark.parametrize("mode", FAST)
def test_ten_microbatches_b_then_w_each(mode: str) -> None:
    mod, ref, _, _ = pair(MLP)
    fn = staged(mod, mode)
    target = torch.randn(BATCH, D)
    xs = [torch.randn(BATCH, D, requires_grad=True) for _ in range(10)]
    for x in xs:
        _, groups = fxsplit.stage_backward_input((mse(fn(x), target),), None, [x], mod.parameters())
        fxsplit.stage_backward_weight(mod.parameters(), groups)
    for x in xs:
        mse(ref(x.detach().requires_grad_()), target).backward()
    assert_params_match(mod, ref)


@pytest.mark.parametrize(
    "injected",
    [("grad", "grad"), ("grad", None), (None, "grad")],
    ids=["both", "first_only", "second_only"],
)
def test_param_groups_grads_can_be_replaced_on_eager_groups(injected: tuple[Any, Any]) -> None:
    """Upstream's grad-validation case: the caller iterates param_groups and
    replaces each group's saved "grads" (None entries allowed) before W.
    Here the injected values make W's result exactly predictable: the
    intermediate passes its gradient straight through to the weight.
    The intermediate is a custom Function, which runs once at B by default
    (see the next test): with ``whole_nodes="again"`` it is upstream's
    intermediate, re-run at W from its replaceable saved gradients."""
    mod, _, x, _ = pair(TwoOutputIntermediate)
    with fxsplit.config.patch(whole_nodes="again"):
        _, groups = fxsplit.stage_backward_input([mod(x).sum()], None, [x], mod.parameters())
    (group,) = list(groups)
    assert set(group) == {"params", "intermediates", "grads"}
    assert group["params"] == {torch.autograd.graph.get_gradient_edge(mod.w).node}
    assert [n.name() for n in group["intermediates"]] == ["PassThroughBackward"]
    assert len(group["grads"]) == 1 and len(group["grads"][0]) == 2
    shapes = [(BATCH, D // 2), (D // 2, D // 2)]
    mock = tuple(None if k is None else torch.randn(s) for k, s in zip(injected, shapes))
    for g in groups:
        g["grads"] = [mock]
    fxsplit.stage_backward_weight(mod.parameters(), groups)
    # A Python autograd.Function sees a missing gradient as zeros (materialize_grads).
    expected = torch.zeros(shapes[1]) if mock[1] is None else mock[1]
    torch.testing.assert_close(mod.w.grad, expected)


def test_param_groups_of_a_node_that_ran_once() -> None:
    """Documented difference: a custom Function runs once, at B (``whole_nodes="once"``,
    the default); its group has no intermediate whose "grads" could be replaced, and
    setting them raises, naming the option that restores upstream's behaviour. W
    still gives ordinary backward's gradients."""
    mod, ref, x, rx = pair(TwoOutputIntermediate)
    _, groups = fxsplit.stage_backward_input([mod(x).sum()], None, [x], mod.parameters())
    (group,) = list(groups)
    assert group["params"] == {torch.autograd.graph.get_gradient_edge(mod.w).node}
    assert group["intermediates"] == [] and group["grads"] == []
    with pytest.raises(TypeError, match=r"PassThroughBackward, which ran once.*whole_nodes='again'"):
        group["grads"] = [(torch.ones(BATCH, D // 2), None)]
    fxsplit.stage_backward_weight(mod.parameters(), groups)
    ref(rx).sum().backward()
    assert_params_match(mod, ref)


@pytest.mark.parametrize("mode", ["compiled", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_param_groups_of_a_compiled_region(mode: str) -> None:
    """Documented difference: a compiled region's W work is a group with no
    intermediates (its dW graph runs on live-ins), so its "grads" cannot be
    replaced; iterating and reading work as upstream."""
    mod, ref, x, rx = pair(TwoOutputIntermediate)
    _, groups = fxsplit.stage_backward_input([staged(mod, mode)(x).sum()], None, [x], mod.parameters())
    (group,) = list(groups)
    assert group["params"] == {torch.autograd.graph.get_gradient_edge(mod.w).node}
    assert group["intermediates"] == [] and group["grads"] == []
    with pytest.raises(TypeError, match="compiled region"):
        group["grads"] = [(torch.ones(BATCH, D // 2), None)]
    fxsplit.stage_backward_weight(mod.parameters(), groups)
    ref(rx).sum().backward()
    assert_params_match(mod, ref)


@pytest.mark.parametrize("mode", MODES)
def test_intermediate_with_several_outputs(mode: str) -> None:
    mod, ref, x, rx = pair(TwoOutputIntermediate)
    dinputs, groups = fxsplit.stage_backward_input([staged(mod, mode)(x).sum()], None, [x], mod.parameters())
    fxsplit.stage_backward_weight(mod.parameters(), groups)
    ref(rx).sum().backward()
    torch.testing.assert_close(dinputs[0], rx.grad)
    assert_params_match(mod, ref)


@pytest.mark.parametrize("mode", FAST)
def test_weight_used_twice(mode: str) -> None:
    mod, ref, x, rx = pair(SharedWeight)
    dinputs, groups = fxsplit.stage_backward_input([staged(mod, mode)(x).sum()], None, [x], mod.parameters())
    fxsplit.stage_backward_weight(mod.parameters(), groups)
    ref(rx).sum().backward()
    torch.testing.assert_close(dinputs[0], rx.grad)
    assert_params_match(mod, ref)


@pytest.mark.parametrize("mode", FAST)
def test_full_backward_from_a_gradient_edge_of_a_released_output(mode: str) -> None:
    mod, ref, x, rx = pair(MLP)
    g = torch.randn(BATCH, D)
    out = staged(mod, mode)(x)
    edge = torch.autograd.graph.get_gradient_edge(out)
    released = weakref.ref(out)
    del out
    assert released() is None, "the edge must not keep the activation alive"
    grads = fxsplit.stage_backward(stage_output=(edge,), output_grads=(g,), input_values=(x,))
    ref(rx).backward(g)
    torch.testing.assert_close(grads[0], rx.grad)
    assert_params_match(mod, ref)


@pytest.mark.parametrize("mode", FAST)
def test_full_backward_from_edge_tensor_and_no_grad_outputs(mode: str) -> None:
    mod, ref, x, rx = pair(TwoOutputs)
    grads = (torch.randn(BATCH, D), torch.randn(BATCH, D), None)
    first, second, constant = staged(mod, mode)(x)
    edge = torch.autograd.graph.get_gradient_edge(first)
    del first
    assert not constant.requires_grad
    dx = fxsplit.stage_backward(stage_output=(edge, second, None), output_grads=grads, input_values=(x,))
    r1, r2, _ = ref(rx)
    torch.autograd.backward((r1, r2), (grads[0], grads[1]))
    torch.testing.assert_close(dx[0], rx.grad)
    assert_params_match(mod, ref)


class ScaleBy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.factor, None


def test_an_edge_keeps_a_python_function_node_alive() -> None:
    x = torch.randn(BATCH, D, requires_grad=True)
    g = torch.randn(BATCH, D)
    out = ScaleBy.apply(x, 3.0)
    edge = torch.autograd.graph.get_gradient_edge(out)
    del out
    (dx,) = fxsplit.stage_backward(stage_output=(edge,), output_grads=(g,), input_values=(x,))
    torch.testing.assert_close(dx, g * 3.0)


@pytest.mark.parametrize("mode", FAST)
def test_split_backward_from_a_gradient_edge(mode: str) -> None:
    mod, ref, x, rx = pair(MLP)
    g = torch.randn(BATCH, D)
    out = staged(mod, mode)(x)
    edge = torch.autograd.graph.get_gradient_edge(out)
    del out
    dinputs, groups = fxsplit.stage_backward_input([edge], [g], [x], mod.parameters())
    fxsplit.stage_backward_weight(mod.parameters(), groups)
    ref(rx).backward(g)
    torch.testing.assert_close(dinputs[0], rx.grad)
    assert_params_match(mod, ref)


@pytest.mark.parametrize("mode", FAST)
def test_a_gradient_edge_needs_its_output_gradient(mode: str) -> None:
    """Upstream raises AssertionError("... requires output gradients"); fxsplit's
    error is that and a ValueError, raised before anything changes."""
    mod, ref, x, rx = pair(MLP)
    edge = torch.autograd.graph.get_gradient_edge(staged(mod, mode)(x))
    with pytest.raises(AssertionError, match="requires output gradients") as info:
        fxsplit.stage_backward_input(stage_outputs_or_loss=[edge], output_grads=None, input_values=[x],
                                     weights=mod.parameters())
    assert isinstance(info.value, ValueError) and isinstance(info.value, fxsplit.MissingOutputGradError)
    assert x.grad is None and all(p.grad is None for p in mod.parameters())


@pytest.mark.parametrize("mode", FAST)
def test_full_backward_of_the_outputs_picked_by_index_as_upstream(mode: str) -> None:
    """``outputs_with_grads_idxs`` (upstream keeps it for its compiler) picks the
    outputs, and their gradients, that the full backward starts from: the
    input gradients and every ``.grad`` are upstream's ``stage_backward``'s on
    an identical copy, compiled the same way."""
    from torch.distributed.pipelining import _backward as upstream

    mod, ref, x, rx = pair(TwoOutputs)
    grads = [torch.randn(BATCH, D), torch.randn(BATCH, D), None]
    dx = fxsplit.stage_backward(list(staged(mod, mode)(x)), grads, [x], outputs_with_grads_idxs=[1])
    (rdx,) = upstream.stage_backward(list(staged(ref, mode)(rx)), grads, [rx], outputs_with_grads_idxs=[1])
    torch.testing.assert_close(dx[0], rdx)
    assert mod.net2.weight.grad is not None and bool(mod.net2.weight.grad.abs().sum() > 0)
    assert_params_match(mod, ref)
