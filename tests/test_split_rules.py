"""Multi-output backward ops through the whole backend: split rules, the
shipped grouped-mm rule, ops with no rule, and torch's own ``grouped_mm``.

The ops here are registered with ``torch.library`` the way model code does:
a forward op whose autograd formula calls one backward op returning
``(grad_input, grad_weight)``. Gradients are compared with eager autograd on
an identical copy after B then W.
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from stage_check import assert_grads_equal, new_regions

import fxsplit
from fxsplit import rules

# ---- a Linear whose backward is one op returning (grad_input, grad_weight) ----------


@torch.library.custom_op("fxsplit_test::fused_linear", mutates_args=())
def fused_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


@fused_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("fxsplit_test::fused_linear_backward", mutates_args=())
def fused_linear_backward(x: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return grad_out @ w, grad_out.T @ x


@fused_linear_backward.register_fake
def _(x: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _fused_linear_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _fused_linear_grad(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = ctx.saved_tensors
    return torch.ops.fxsplit_test.fused_linear_backward(x, w, grad_out)


fused_linear.register_autograd(_fused_linear_grad, setup_context=_fused_linear_setup)
FUSED_BW = "fxsplit_test::fused_linear_backward"


class FusedLinearStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(12, 6) / 3)
        self.w2 = nn.Parameter(torch.randn(6, 12) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fxsplit_test.fused_linear(torch.tanh(torch.ops.fxsplit_test.fused_linear(x, self.w1)), self.w2)


def fused_linear_rule(outputs: frozenset[int], x: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor) -> Any:
    return (grad_out @ w if 0 in outputs else None, grad_out.T @ x if 1 in outputs else None)


@pytest.fixture
def clean_rules() -> Any:
    """Leave the registry as the test found it."""
    saved = fxsplit.split_rules()
    yield
    for op in fxsplit.split_rules():
        if op not in saved:
            fxsplit.unregister_split_rule(op)
    for op, rule in saved.items():
        fxsplit.register_split_rule(op, rule)


def run_split(model: nn.Module, stage: Any, inputs: list[torch.Tensor], ref: nn.Module) -> Any:
    """B then W on ``stage``, ordinary backward on ``ref``; compare; return the W work."""
    for p in (*model.parameters(), *ref.parameters()):
        p.grad = None
    refs = [i.detach().clone().requires_grad_(i.requires_grad) for i in inputs]
    out = stage(*inputs)
    g = torch.randn_like(out)
    grads, work = fxsplit.stage_backward_input([out], [g], [inputs[0]], model.parameters())
    assert all(p.grad is None for p in model.parameters())
    fxsplit.stage_backward_weight(model.parameters(), work)
    ref(*refs).backward(g)
    torch.testing.assert_close(grads[0], refs[0].grad)
    assert_grads_equal([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    return work


def ops_in(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_op_without_rule_runs_whole_in_di_and_is_reported_once(
    clean_rules: None, caplog: pytest.LogCaptureFixture
) -> None:
    model = FusedLinearStage()
    ref = copy.deepcopy(model)
    before = fxsplit.compiled_regions()
    regions: list[Any] = []  # (held: the registry is weak, and the reset below drops Dynamo's references)
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        for dynamic in (False, True):  # two regions, one warning
            torch._dynamo.reset()
            stage = torch.compile(model, backend=fxsplit.backend(compiler="eager"), dynamic=dynamic)
            run_split(model, stage, [torch.randn(5, 6, requires_grad=True)], ref)
            regions += new_regions(before + regions)
    assert len(regions) == 2
    for region in regions:
        split = region.split
        assert [s.op for s in split.weight_work_in_di] == [FUSED_BW, FUSED_BW]
        assert sum(FUSED_BW.replace("::", ".") in op for op in ops_in(split.di_graph)) == 2
        assert "weight work in dI" in split.describe()
        assert all(l.kind in ("tensor", "symint") for l in split.live_ins)
    warnings = [r.getMessage() for r in caplog.records if r.name == "fxsplit" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and FUSED_BW in warnings[0] and "register_split_rule" in warnings[0], warnings


class ViewSplitStage(nn.Module):
    """A forward ``chunk`` whose first half feeds the input-gradient chain and
    whose second half a weight product (the backward recomputes the view, as
    ``aten.split``, to get both), then a ``fused_linear``: a real op with no rule."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8, bias=False)
        self.out = nn.Linear(4, 4, bias=False)
        self.w = nn.Parameter(torch.randn(3, 4) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        a, b = h.chunk(2, -1)
        return torch.ops.fxsplit_test.fused_linear(torch.sin(a) + self.out(b), self.w)


def test_view_split_feeding_both_chains_is_not_reported_as_weight_work(
    clean_rules: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Warnings are once per op per process: start from none reported.
    monkeypatch.setattr(sys.modules["fxsplit.backend"], "_REPORTED_OPS", set())
    model = ViewSplitStage()
    refs = [copy.deepcopy(model), torch.compile(copy.deepcopy(model), backend=fxsplit.backend(compiler="eager"))]
    x = torch.randn(5, 6, requires_grad=True)
    g = torch.randn(5, 3)
    expected = []
    for ref in refs:  # ordinary backward, uncompiled and compiled
        xr = x.detach().clone().requires_grad_()
        ref(xr).backward(g)
        expected.append((xr.grad, [p.grad for p in ref.parameters()]))
    before = fxsplit.compiled_regions()
    params = list(model.parameters())
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        out = torch.compile(model, backend=fxsplit.backend(compiler="eager"))(x)
        (dx,), work = fxsplit.stage_backward_input(out, g, [x], params)
        assert all(p.grad is None for p in params)
        fxsplit.stage_backward_weight(params, work)
    for ref_dx, ref_dw in expected:
        torch.testing.assert_close(dx, ref_dx)
        assert_grads_equal([p.grad for p in params], ref_dw)

    (region,) = [r for r in new_regions(before) if r.split.shared]
    split = region.split
    assert region.stats["di_runs"] == region.stats["dw_runs"] == 1  # B then W went through the split
    assert any("aten.split" in op for op in ops_in(split.di_graph)), "the backward has no view split to test"
    assert [s.op for s in split.weight_work_in_di] == [FUSED_BW]
    flagged = [line for line in split.describe().splitlines() if "weight work in dI" in line or "shared:" in line]
    assert flagged and all(FUSED_BW in line for line in flagged), flagged
    warnings = [r.getMessage() for r in caplog.records if r.name == "fxsplit" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and FUSED_BW in warnings[0], warnings


@pytest.mark.parametrize("key", ["string", "packet", "overload"])
def test_registered_rule_moves_weight_work_to_dw(key: str, clean_rules: None, caplog: pytest.LogCaptureFixture) -> None:
    op = {"string": FUSED_BW, "packet": torch.ops.fxsplit_test.fused_linear_backward,
          "overload": torch.ops.fxsplit_test.fused_linear_backward.default}[key]
    fxsplit.register_split_rule(op, fused_linear_rule)
    model = FusedLinearStage()
    ref = copy.deepcopy(model)
    stage = torch.compile(model, backend=fxsplit.backend(compiler="eager"))
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        run_split(model, stage, [torch.randn(5, 6, requires_grad=True)], ref)
    split = fxsplit.compiled_regions()[-1].split
    assert [s.how for s in split.shared] == ["rule", "rule"] and split.weight_work_in_di == ()
    assert not any("fused_linear_backward" in op for op in ops_in(split.di_graph) + ops_in(split.dw_graph))
    # dI: two input-gradient matmuls; dW: two weight-gradient matmuls.
    assert ops_in(split.di_graph).count("aten.mm.default") == 2
    assert ops_in(split.dw_graph).count("aten.mm.default") == 2
    assert not [r for r in caplog.records if r.name == "fxsplit" and r.levelno >= logging.WARNING]


def test_rule_in_other_strides_than_the_op_is_said_once(
    clean_rules: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule whose weight gradient is the transpose of a contiguous product
    (the op's is contiguous) is correct, but the graph after it was traced for
    the op's strides and the gradient may reach W out of its weight's layout
    (autograd then copies it): the split says which outputs, and a warning
    says so once per op. Gradients equal ordinary backward's."""
    monkeypatch.setattr(sys.modules["fxsplit.backend"], "_REPORTED_OPS", set())

    def transposed_rule(outputs: frozenset[int], x: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor) -> Any:
        return (grad_out @ w if 0 in outputs else None, (x.T @ grad_out).T if 1 in outputs else None)

    fxsplit.register_split_rule(FUSED_BW, transposed_rule)
    model = FusedLinearStage()
    ref = copy.deepcopy(model)
    before = fxsplit.compiled_regions()
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        for _ in range(2):
            torch._dynamo.reset()
            stage = torch.compile(model, backend=fxsplit.backend(compiler="eager"))
            run_split(model, stage, [torch.randn(5, 6, requires_grad=True)], ref)
    regions = new_regions(before)
    assert len(regions) == 2
    for region in regions:
        shared = region.split.shared
        assert [(s.how, s.other_strides) for s in shared] == [("rule", (1,)), ("rule", (1,))]
        assert "outputs [1] in other strides than the op's" in region.split.describe()
    warnings = [r.getMessage() for r in caplog.records if r.name == "fxsplit" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and FUSED_BW in warnings[0] and "other strides" in warnings[0], warnings


def test_rule_as_decorator_and_unregister(clean_rules: None) -> None:
    @fxsplit.register_split_rule("fxsplit_test::not_an_op_yet")
    def rule(outputs: frozenset[int], *args: Any) -> Any:
        return NotImplemented

    assert fxsplit.split_rules()["fxsplit_test::not_an_op_yet"] is rule
    fxsplit.unregister_split_rule("fxsplit_test::not_an_op_yet")
    assert "fxsplit_test::not_an_op_yet" not in fxsplit.split_rules()
    assert "transformers::grouped_mm_fallback_backward" in fxsplit.split_rules()  # shipped


def test_registry_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="namespace::name"):
        fxsplit.register_split_rule("fused_linear_backward", fused_linear_rule)
    with pytest.raises(TypeError, match="operator"):
        fxsplit.register_split_rule(fused_linear_backward, fused_linear_rule)  # the Python function, not the op
    with pytest.raises(TypeError, match="callable"):
        fxsplit.register_split_rule(FUSED_BW, 3)
    assert FUSED_BW not in fxsplit.split_rules()


def test_rule_that_declines_leaves_the_op_whole(clean_rules: None) -> None:
    fxsplit.register_split_rule(FUSED_BW, lambda outputs, *args: NotImplemented)
    model = FusedLinearStage()
    stage = torch.compile(model, backend=fxsplit.backend(compiler="eager"))
    run_split(model, stage, [torch.randn(5, 6, requires_grad=True)], copy.deepcopy(model))
    assert [s.how for s in fxsplit.compiled_regions()[-1].split.shared] == ["unsplit", "unsplit"]


@pytest.mark.parametrize("bad", ["too_few", "not_a_tensor", "wrong_shape"])
def test_broken_rule_fails_the_compile_naming_the_op(bad: str, clean_rules: None) -> None:
    def rule(outputs: frozenset[int], x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> Any:
        if bad == "too_few":
            return (g @ w,)
        if bad == "not_a_tensor":
            return (g @ w if 0 in outputs else None, 1.0)
        return (g @ w if 0 in outputs else None, g.T @ g)

    fxsplit.register_split_rule(FUSED_BW, rule)
    stage = torch.compile(FusedLinearStage(), backend=fxsplit.backend(compiler="eager"))
    with pytest.raises(Exception) as info:
        stage(torch.randn(5, 6, requires_grad=True))
    e: BaseException | None = info.value
    while e is not None and not isinstance(e, fxsplit.FxsplitCompileError):
        e = e.__cause__ or getattr(e, "inner_exception", None)
    assert e is not None and e.graph == "split" and FUSED_BW in str(e), info.value


# ---- the shipped grouped-mm rule --------------------------------------------------------


@torch.library.custom_op("fxsplit_test::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[rows of g] = x[rows of g] @ w[g]``, rows of group g ending at ``offs[g]``:
    the signature and meaning of ``transformers::grouped_mm_fallback``."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("fxsplit_test::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for g, end in enumerate(offs.tolist()):
        grad_x[start:end] = grad_out[start:end] @ w[g].T
        grad_w[g] = x[start:end].T @ grad_out[start:end]
        start = end
    return grad_x, grad_w


@grouped_mm_backward.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _grouped_mm_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _grouped_mm_grad(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    x, w = ctx.saved_tensors
    grad_x, grad_w = torch.ops.fxsplit_test.grouped_mm_backward(x, w, ctx.offs, grad_out)
    return grad_x, grad_w, None


grouped_mm.register_autograd(_grouped_mm_grad, setup_context=_grouped_mm_setup)


class Experts(nn.Module):
    """Two grouped matmuls over tokens sorted by expert (an MoE expert MLP)."""

    def __init__(self, mm: Any, experts: int = 3, dim: int = 16, hidden: int = 32, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.mm = mm
        self.w1 = nn.Parameter((torch.randn(experts, dim, hidden) / 4).to(dtype))
        self.w2 = nn.Parameter((torch.randn(experts, hidden, dim) / 4).to(dtype))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self.mm(F.silu(self.mm(x, self.w1, offs)), self.w2, offs)


def check_grouped_rule_split(split: Any, backward_op: str) -> None:
    assert [(s.op, s.how) for s in split.shared] == [(backward_op, "rule")] * 2
    di, dw = ops_in(split.di_graph), ops_in(split.dw_graph)
    assert di.count("fxsplit.grouped_mm_input_grad.default") == 2 and "fxsplit.grouped_mm_weight_grad.default" not in di
    assert dw.count("fxsplit.grouped_mm_weight_grad.default") == 2 and "fxsplit.grouped_mm_input_grad.default" not in dw
    assert not any(backward_op.split("::")[1] in op for op in di + dw)


@pytest.mark.inductor
def test_shipped_grouped_mm_rule_under_inductor(clean_rules: None) -> None:
    """The rule shipped for transformers' op, applied to an op of the same
    signature and meaning: dI does the input-gradient grouped matmuls, dW the
    weight-gradient ones; token counts change (a dynamic region follows)."""
    fxsplit.register_split_rule("fxsplit_test::grouped_mm_backward", rules.grouped_mm_backward_rule)
    model = Experts(torch.ops.fxsplit_test.grouped_mm)
    ref = copy.deepcopy(model)
    stage = torch.compile(model, backend=fxsplit.backend(fused_backward=False))
    before = fxsplit.compiled_regions()
    for tokens, offs in ((10, [3, 3, 10]), (13, [5, 9, 13])):  # an empty expert, then a resize
        offs_t = torch.tensor(offs)
        work = run_split(model, stage, [torch.randn(tokens, 16, requires_grad=True), offs_t], ref)
        assert work is not None
        check_grouped_rule_split(fxsplit.compiled_regions()[-1].split, "fxsplit_test::grouped_mm_backward")
    regions = new_regions(before)
    assert len(regions) == 2 and "symint" in [l.kind for l in regions[-1].split.live_ins]


@pytest.mark.inductor
def test_transformers_grouped_mm_fallback_is_split() -> None:
    """transformers' own op, when transformers is installed (the test above
    covers the same rule without it)."""
    pytest.importorskip("transformers.integrations.moe", reason="transformers is not installed")
    model = Experts(torch.ops.transformers.grouped_mm_fallback)
    ref = copy.deepcopy(model)
    stage = torch.compile(model, backend=fxsplit.backend(fused_backward=False))
    run_split(model, stage, [torch.randn(10, 16, requires_grad=True), torch.tensor([4, 4, 10])], ref)
    check_grouped_rule_split(fxsplit.compiled_regions()[-1].split, "transformers::grouped_mm_fallback_backward")


class StoredTransposedExperts(nn.Module):
    """Expert weights stored ``(experts, out, in)`` and multiplied as
    ``(experts, in, out)`` views, as transformers' MoE layers do."""

    def __init__(self, mm: Any, experts: int = 3, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.mm = mm
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / 4)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / 4)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self.mm(F.silu(self.mm(x, self.w1.transpose(1, 2), offs)), self.w2.transpose(1, 2), offs)


@pytest.mark.inductor
def test_shipped_rule_gives_the_weight_gradient_the_layout_of_transformers_op() -> None:
    """transformers' backward lays the weight gradient out like the weight it
    is given (``zeros_like``): for experts multiplied transposed, transposed
    back it has the stored weight's layout, so autograd keeps it as the new
    ``.grad``. The shipped rule's half does the same: W takes both experts'
    gradients as they are (no engine call, no copy), with ordinary
    backward's values and ``.grad`` strides, microbatch after microbatch."""
    pytest.importorskip("transformers.integrations.moe", reason="transformers is not installed")
    torch.manual_seed(0)
    model = StoredTransposedExperts(torch.ops.transformers.grouped_mm_fallback)
    backend = fxsplit.backend(fused_backward=False)
    uncompiled = copy.deepcopy(model)
    compiled = torch.compile(copy.deepcopy(model), backend=backend)  # (ordinary backward through the same split)
    stage = torch.compile(model, backend=backend)
    for offs in ([4, 4, 10], [2, 7, 10]):  # (an expert without tokens)
        for ref in (uncompiled, compiled):
            work = run_split(model, stage, [torch.randn(10, 16, requires_grad=True), torch.tensor(offs)], ref)
            assert sorted(work.handed_over) == [0, 1], offs
            for p, q in zip(model.parameters(), ref.parameters()):
                assert p.grad.stride() == q.grad.stride() == p.stride(), offs
    check_grouped_rule_split(fxsplit.compiled_regions()[-1].split, "transformers::grouped_mm_fallback_backward")


# ---- torch's grouped_mm: two separate ops, split by reachability -------------------------


def torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(x, w, offs=offs)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no torch.nn.functional.grouped_mm")
@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_torch_grouped_mm_backward_lands_in_di_and_dw(compiler: str) -> None:
    """Its backward is two ``_grouped_mm`` calls: grad_out @ w.T (dI) and
    x.T @ grad_out grouped by ``offs`` (dW). On CPU, torch 2.13 compiles
    ``_grouped_mm`` for bfloat16 only (its meta function refuses float32), and
    needs 16-byte-aligned strides, so the test uses bf16 and widths of 16/32."""
    model = Experts(torch_grouped_mm, dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    stage = torch.compile(model, backend=fxsplit.backend(compiler=compiler, fused_backward=False))
    x = torch.randn(10, 16, dtype=torch.bfloat16, requires_grad=True)
    run_split(model, stage, [x, torch.tensor([3, 7, 10], dtype=torch.int32)], ref)
    split = fxsplit.compiled_regions()[-1].split
    assert ops_in(split.di_graph).count("aten._grouped_mm.default") == 2
    assert ops_in(split.dw_graph).count("aten._grouped_mm.default") == 2
    assert split.shared == ()


def test_shipped_rule_puts_weight_flops_in_w(clean_rules: None) -> None:
    """With the shipped rule, B counts only input-gradient grouped matmuls and W
    only weight-gradient ones (FlopCounterMode formulas of fxsplit's two ops:
    2 * rows * in * out each), and B + W is the matmul work of the two fused
    backward calls (two gradients each)."""
    from torch.utils.flop_counter import FlopCounterMode

    fxsplit.register_split_rule("fxsplit_test::grouped_mm_backward", rules.grouped_mm_backward_rule)
    model = Experts(torch.ops.fxsplit_test.grouped_mm)
    stage = torch.compile(model, backend=fxsplit.backend(compiler="eager", fused_backward=False))
    x = torch.randn(10, 16, requires_grad=True)
    out = stage(x, torch.tensor([3, 3, 10]))
    with FlopCounterMode(display=False) as b_count:
        _, work = fxsplit.stage_backward_input([out], [torch.randn_like(out)], [x], model.parameters())
    with FlopCounterMode(display=False) as w_count:
        fxsplit.stage_backward_weight(model.parameters(), work)
    b_ops = {str(op): n for op, n in b_count.get_flop_counts()["Global"].items()}
    w_ops = {str(op): n for op, n in w_count.get_flop_counts()["Global"].items()}
    per_gradient = 2 * 10 * 16 * 32  # rows * in * out, the same for both matmuls of the MLP
    assert b_ops == {"fxsplit.grouped_mm_input_grad": 2 * per_gradient}
    assert w_ops == {"fxsplit.grouped_mm_weight_grad": 2 * per_gradient}


def test_keep_in_di_is_a_decision_not_a_warning(clean_rules: None, caplog: pytest.LogCaptureFixture) -> None:
    """An op declared KEEP_IN_DI runs whole in dI without a warning, is listed
    as kept, and the gradients are ordinary backward's."""
    fxsplit.register_split_rule(FUSED_BW, fxsplit.KEEP_IN_DI)
    model = FusedLinearStage()
    ref = copy.deepcopy(model)
    before = fxsplit.compiled_regions()
    with caplog.at_level(logging.DEBUG, logger="fxsplit"):
        stage = torch.compile(model, backend=fxsplit.backend(compiler="eager"))
        run_split(model, stage, [torch.randn(5, 6, requires_grad=True)], ref)
    (region,) = new_regions(before)
    split = region.split
    assert [s.how for s in split.shared] == ["kept", "kept"]
    assert split.weight_work_in_di == ()
    assert "kept whole in dI by its rule" in split.describe()
    assert not [r for r in caplog.records if r.name == "fxsplit" and r.levelno >= logging.WARNING]


def test_flex_attention_backward_is_kept_in_di_by_default() -> None:
    """FlexAttention's backward computes score_mod buffer gradients in the kernel
    that computes dQ, dK, dV: fxsplit keeps it whole in dI (no warning). Its
    backward runs on CUDA only; the CUDA tier runs real FlexAttention stages."""
    hop = torch.ops.higher_order.flex_attention_backward
    assert rules._rule_for(hop) is fxsplit.KEEP_IN_DI
    assert "higher_order::flex_attention_backward" in fxsplit.split_rules()
