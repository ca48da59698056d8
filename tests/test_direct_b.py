"""B without autograd's engine (``fxsplit.config.direct_b``).

B of a stage that is one compiled region calls the region's node itself; on
CUDA the engine's hand-over to its device thread costs more host time than
the rest of B. Where the engine would do anything Python can see (a hook, a
retained gradient, anomaly mode, symbolic sizes that make a forward argument
no tensor), B goes through the engine as before. Either way, what a user
observes is ordinary backward's: checked here against ordinary backward on an
identical copy, and bitwise against the engine path on another. By default
(``"auto"``) CPU tensors keep the engine, which runs in the calling thread
there; these tests turn the direct call on for every device (``True``), so
that it runs here as it does on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit
from stage_check import new_regions
from zoo import GeluResidual, ParallelHeads


@pytest.fixture(autouse=True)
def _direct_everywhere() -> Any:
    with fxsplit.config.patch(direct_b=True):
        yield


def _compiled(model: nn.Module, compiler: str = "eager", **kw: Any) -> Any:
    """The split's graphs run as FX graphs (the path B takes does not depend on
    their compiler) except where a test asks for Inductor's."""
    return torch.compile(model, backend=fxsplit.backend(compiler=compiler, fallback="error"), **kw)


def _region_of(fn: Any, x: torch.Tensor) -> Any:
    """The region ``fn`` compiles (on its first call, here a forward only)."""
    before = fxsplit.compiled_regions()
    fn(x.detach().requires_grad_())
    (region,) = new_regions(before)
    return region


def _split_step(model: nn.Module, fn: Any, x: torch.Tensor, g: torch.Tensor,
                before_b: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor | None:
    params = list(model.parameters())
    xi = x.detach().requires_grad_()
    out = fn(xi)
    if before_b is not None:
        before_b(out, xi)
    (dx,), work = fxsplit.stage_backward_input([out], [g], [xi], params)
    fxsplit.stage_backward_weight(params, work)
    return dx


def _ordinary_step(model: nn.Module, fn: Any, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    xi = x.detach().requires_grad_()
    fn(xi).backward(g)
    return xi.grad


def _assert_same(a: nn.Module, b: nn.Module, bitwise: bool = False) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if bitwise:
            assert torch.equal(p.grad, q.grad), name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def _stage(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = GeluResidual()
    x = torch.randn(4, 8)
    return model, x, torch.randn(4, 8)


def test_b_calls_the_region_itself_and_matches_ordinary_backward_and_the_engine_path() -> None:
    model, x, g = _stage()
    ordinary, engine, eager = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    fn = _compiled(model, "inductor")
    region = _region_of(fn, x)
    ref_fn, engine_fn = _compiled(ordinary, "inductor"), _compiled(engine, "inductor")
    for step in range(3):  # .grad accumulates across the steps, in every copy
        dx = _split_step(model, fn, x + step, g)
        ref_dx = _ordinary_step(ordinary, ref_fn, x + step, g)
        with fxsplit.config.patch(direct_b=False):
            engine_dx = _split_step(engine, engine_fn, x + step, g)
        eager_dx = _ordinary_step(eager, eager, x + step, g)  # uncompiled
        torch.testing.assert_close(dx, ref_dx)
        torch.testing.assert_close(dx, eager_dx)
        assert torch.equal(dx, engine_dx)
        _assert_same(model, ordinary)
        _assert_same(model, eager)
        _assert_same(model, engine, bitwise=True)
    assert region.direct_b_runs == 3 and region.stats["di_runs"] == 3


def test_b_calls_the_region_of_a_transformers_stage() -> None:
    """Code we did not write: transformers' Llama (small config, random
    init; rotary embeddings, grouped-query attention) as a middle stage,
    hidden states in and out, compiled whole (one region), all its
    parameters given as a pipeline stage gives them, the token embedding
    that such a stage never uses included. B calls the region itself at every step; input and weight
    gradients are bitwise the engine path's and close to uncompiled eager
    autograd's, over two accumulating steps."""
    from test_transformers_models import DIM, HFCase

    case = HFCase("llama", "middle")
    model = case.make()
    engine, eager = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(2, 7, DIM)
    g = torch.randn(2, 7, DIM)
    before = fxsplit.compiled_regions()
    fn, engine_fn = _compiled(model), _compiled(engine)
    for step in range(2):
        for m, f, direct in ((model, fn, True), (engine, engine_fn, False)):
            weights = list(m.parameters())
            xi = (x + step).requires_grad_()
            with fxsplit.config.patch(direct_b=direct):
                (dx,), work = fxsplit.stage_backward_input([f(xi)], [g], [xi], weights)
                fxsplit.stage_backward_weight(weights, work)
            if direct:
                got = dx
            else:
                assert torch.equal(got, dx), f"step {step}: the input gradient differs from the engine path's"
        xe = (x + step).requires_grad_()
        eager(xe).backward(g)
        case.assert_close(got, xe.grad, f"step {step}: input gradient")
        for (n, p), q, r in zip(model.named_parameters(), engine.parameters(), eager.parameters()):
            assert (p.grad is None) == (r.grad is None), n
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), f"step {step}: {n} differs from the engine path's"
                case.assert_close(p.grad, r.grad, f"step {step}: {n}")
    assert model.model.embed_tokens.weight.grad is None
    regions = new_regions(before)
    assert sum(r.direct_b_runs for r in regions) == 2 and sum(r.stats["di_runs"] for r in regions) == 4


def test_b_frees_the_saved_activations_as_the_engine_does() -> None:
    model, x, g = _stage()
    fn = _compiled(model)
    params = list(model.parameters())
    xi = x.detach().requires_grad_()
    out = fn(xi)
    keep = out.view_as(out)  # a view keeps the graph reachable after B detaches the output
    _, work = fxsplit.stage_backward_input([out], [g], [xi], params)
    with pytest.raises(RuntimeError, match="second time"):
        keep.backward(g)
    fxsplit.stage_backward_weight(params, work)


def _output_hook(out: torch.Tensor, x: torch.Tensor, seen: list[str]) -> None:
    out.register_hook(lambda grad: seen.append("output"))


def _output_retain_grad(out: torch.Tensor, x: torch.Tensor, seen: list[str]) -> None:
    out.retain_grad()


def _input_hook(out: torch.Tensor, x: torch.Tensor, seen: list[str]) -> None:
    x.register_hook(lambda grad: seen.append("input"))


def _node_hook(out: torch.Tensor, x: torch.Tensor, seen: list[str]) -> None:
    out.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append("node"))


def _node_prehook(out: torch.Tensor, x: torch.Tensor, seen: list[str]) -> None:
    out.grad_fn.register_prehook(lambda grad_outputs: seen.append("node pre"))


@pytest.mark.parametrize("observe", [_output_hook, _output_retain_grad, _input_hook, _node_hook, _node_prehook],
                         ids=["output_hook", "output_retain_grad", "input_hook", "node_hook", "node_prehook"])
def test_b_goes_through_the_engine_where_it_would_run_a_hook(observe: Callable[..., None]) -> None:
    model, x, g = _stage()
    ordinary = copy.deepcopy(model)
    fn = _compiled(model)
    region = _region_of(fn, x)
    ref_fn = _compiled(ordinary)
    seen: list[str] = []
    ref_seen: list[str] = []
    kept: dict[str, torch.Tensor] = {}

    def before_b(out: torch.Tensor, xi: torch.Tensor) -> None:
        observe(out, xi, seen)
        kept["out"] = out

    dx = _split_step(model, fn, x, g, before_b)
    xi = x.detach().requires_grad_()
    out = ref_fn(xi)
    observe(out, xi, ref_seen)
    out.backward(g)
    torch.testing.assert_close(dx, xi.grad)
    _assert_same(model, ordinary)
    assert seen == ref_seen
    if observe is _output_retain_grad:
        torch.testing.assert_close(kept["out"].grad, out.grad)
    assert region.direct_b_runs == 0 and region.stats["di_runs"] == 1


def test_b_goes_through_the_engine_in_anomaly_mode_and_when_turned_off() -> None:
    model, x, g = _stage()
    fn = _compiled(model)
    region = _region_of(fn, x)
    with torch.autograd.detect_anomaly(check_nan=False):
        _split_step(model, fn, x, g)
    with fxsplit.config.patch(direct_b=False):
        _split_step(model, fn, x, g)
    assert region.direct_b_runs == 0 and region.stats["di_runs"] == 2
    _split_step(model, fn, x, g)
    assert region.direct_b_runs == 1


def test_symbolic_sizes_go_through_the_engine() -> None:
    """A region with symbolic sizes takes them as forward arguments that are
    no tensors: its node's results do not line up with its edges."""
    model, x, g = _stage()
    ordinary = copy.deepcopy(model)
    before = fxsplit.compiled_regions()
    fn = _compiled(model, dynamic=True)
    ref_fn = _compiled(ordinary, dynamic=True)
    for n in (4, 6):
        xs, gs = torch.randn(n, 8), torch.randn(n, 8)
        torch.testing.assert_close(_split_step(model, fn, xs, gs), _ordinary_step(ordinary, ref_fn, xs, gs))
    _assert_same(model, ordinary)
    regions = [r for r in new_regions(before) if r.stats["di_runs"]]
    assert regions and all(r.direct_b_runs == 0 for r in regions)


def test_a_bad_direct_b_value_is_refused_by_name() -> None:
    model, x, g = _stage()
    fn = _compiled(model)
    with pytest.raises(ValueError, match="direct_b"):
        with fxsplit.config.patch(direct_b="yes"):
            pass
    fxsplit.config.direct_b = "yes"  # type: ignore[assignment]
    try:
        with pytest.raises(ValueError, match="direct_b"):
            _split_step(model, fn, x, g)
    finally:
        fxsplit.config.direct_b = True  # (the fixture restores the default)
    assert all(p.grad is None for p in model.parameters()), "a refused B must leave .grad untouched"


def test_a_second_b_through_a_region_node_the_direct_call_holds_is_refused() -> None:
    """B on one output of a region calls its node itself; while that call runs
    (inside its dI graph), B on the other output, in another thread, reaches
    the same node and is refused (``RuntimeError``) before it changes
    anything. The first B and its W complete as ordinary backward of that
    output does, on a compiled and an uncompiled copy."""
    torch.manual_seed(0)
    model = ParallelHeads(8)
    ordinary, eager = copy.deepcopy(model), copy.deepcopy(model)
    fn, ref_fn = _compiled(model), _compiled(ordinary)
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    before = fxsplit.compiled_regions()
    xi = x.clone().requires_grad_()
    out_a, out_b = fn(xi)
    (region,) = new_regions(before)
    params = list(model.parameters())
    errors: list[BaseException] = []

    def other_b() -> None:
        try:
            fxsplit.stage_backward_input([out_b], [g], [xi], params)
        except RuntimeError as e:
            errors.append(e)

    run_di = region._di_and_live

    def di_while_another_b_tries(*args: Any, **kwargs: Any) -> Any:
        assert xi.grad is None and all(p.grad is None for p in params)
        t = threading.Thread(target=other_b)
        t.start()
        t.join(timeout=60)
        assert xi.grad is None and all(p.grad is None for p in params), "the refused B changed a .grad"
        return run_di(*args, **kwargs)

    region._di_and_live = di_while_another_b_tries
    try:
        (dx,), work = fxsplit.stage_backward_input([out_a], [g], [xi], params)
    finally:
        del region._di_and_live
    assert len(errors) == 1 and "another split backward is running" in str(errors[0]), errors
    assert region.direct_b_runs == 1
    fxsplit.stage_backward_weight(params, work)
    for other, f in ((ordinary, ref_fn), (eager, eager)):
        xr = x.clone().requires_grad_()
        f(xr)[0].backward(g)
        torch.testing.assert_close(dx, xr.grad)
    _assert_same(model, ordinary)  # (b's gradient: zeros through the compiled region, as AOTAutograd gives it)
    _assert_same(model.a, eager.a)
    assert eager.b.weight.grad is None


def test_auto_keeps_the_engine_for_cpu_tensors() -> None:
    model, x, g = _stage()
    fn = _compiled(model)
    region = _region_of(fn, x)
    with fxsplit.config.patch(direct_b="auto"):
        _split_step(model, fn, x, g)
    assert region.direct_b_runs == 0 and region.stats["di_runs"] == 1


class _SavesItsOutput(nn.Module):
    """A block whose compiled region saves a forward output for backward (tanh's)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x))


def _layouts_and_states() -> list[tuple[str, Callable[[], Any], torch.Tensor]]:
    """(what differs, a context B runs in, the output gradient) for microbatches
    where AOTAutograd's wrapper does not pass things through unchanged, or the
    thread differs from the call B learned from."""
    torch.manual_seed(1)
    strided = torch.randn(8, 4).t()  # another layout: the wrapper makes it contiguous
    plain = torch.randn(4, 8)
    return [
        ("learned", contextlib.nullcontext, plain),
        ("strided gradient", contextlib.nullcontext, strided),
        ("autocast", lambda: torch.autocast("cpu", dtype=torch.bfloat16), plain),
        ("deterministic", _deterministic, plain),
        ("learned again", contextlib.nullcontext, plain),
    ]


def _b_then_w(model: nn.Module, out: torch.Tensor, g: torch.Tensor, xi: torch.Tensor) -> torch.Tensor | None:
    params = list(model.parameters())
    (dx,), work = fxsplit.stage_backward_input([out], [g], [xi], params)
    fxsplit.stage_backward_weight(params, work)
    return dx


@contextlib.contextmanager
def _deterministic() -> Any:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("block", [GeluResidual, _SavesItsOutput], ids=["gelu_residual", "saves_its_output"])
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_b_skips_aotautograds_wrapper_after_learning_it_and_matches_ordinary_backward(
    block: type[nn.Module], compiler: str
) -> None:
    torch.manual_seed(0)
    model = block()
    ordinary = copy.deepcopy(model)
    engine = copy.deepcopy(model)
    fn, ref_fn = _compiled(model, compiler), _compiled(ordinary, compiler)
    engine_fn = _compiled(engine, compiler)
    x = torch.randn(4, 8)
    region = _region_of(fn, x)
    unwrapped = []
    for what, context, g in _layouts_and_states():
        before = region.unwrapped_b_runs
        xs = [x.detach().requires_grad_() for _ in range(3)]
        outs = [f(xi) for f, xi in zip((fn, engine_fn, ref_fn), xs)]  # (forwards outside the context)
        if what == "deterministic":  # refused through the wrapper, as ordinary backward refuses it
            with context():
                with pytest.raises(RuntimeError, match="use_deterministic_algorithms"):
                    _b_then_w(model, outs[0], g, xs[0])
                with fxsplit.config.patch(direct_b=False), pytest.raises(RuntimeError, match="use_deterministic"):
                    _b_then_w(engine, outs[1], g, xs[1])
                with pytest.raises(RuntimeError, match="use_deterministic_algorithms"):
                    outs[2].backward(g)
            unwrapped.append(region.unwrapped_b_runs - before)
            continue
        with context():
            dx = _b_then_w(model, outs[0], g, xs[0])
            with fxsplit.config.patch(direct_b=False):
                dx_engine = _b_then_w(engine, outs[1], g, xs[1])
            outs[2].backward(g)
        assert torch.equal(dx, dx_engine), what
        _assert_same(model, engine, bitwise=True)
        torch.testing.assert_close(dx, xs[2].grad, msg=what)
        if what != "autocast":  # (W runs its dW graph with autocast off; ordinary backward under it does not)
            _assert_same(model, ordinary)
        else:
            for p, q in zip(model.parameters(), ordinary.parameters()):
                q.grad = p.grad.clone()
        unwrapped.append(region.unwrapped_b_runs - before)
    # The first call learns; the strided one goes through the wrapper (it
    # coerces that gradient), and so do those under another thread state.
    assert unwrapped == [0, 0, 0, 0, 1]
    assert region.direct_b_runs == 4  # (the refused call ran no dI)


def test_b_without_the_wrapper_checks_the_saved_tensors_versions() -> None:
    model, x, g = _stage()
    fn = _compiled(model)
    region = _region_of(fn, x)
    params = list(model.parameters())
    _split_step(model, fn, x, g)
    xi = x.detach().requires_grad_()
    out = fn(xi)
    with torch.no_grad():
        model.a.weight.mul_(2)  # saved by the region: backward must refuse, as ordinary backward does
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        fxsplit.stage_backward_input([out], [g], [xi], params)
    cause = raised.value.__cause__
    assert cause is not None and "aot_saved_args" in {f.name for f in traceback.extract_tb(cause.__traceback__)}
    assert region.stats["di_runs"] == 1


def test_b_without_the_wrapper_under_non_reentrant_checkpointing() -> None:
    """The saved tensors are checkpoint holders that may be unpacked once: B
    learns without unpacking them itself, and the recomputation runs once."""
    model, x, g = _stage()
    ordinary = copy.deepcopy(model)
    compiled, ref_compiled = _compiled(model), _compiled(ordinary)

    def fn(xi: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(compiled, xi, use_reentrant=False)

    def ref_fn(xi: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(ref_compiled, xi, use_reentrant=False)

    region = _region_of(compiled, x)
    for step in range(3):
        dx = _split_step(model, fn, x, g)
        ref = _ordinary_step(ordinary, ref_fn, x, g)
        torch.testing.assert_close(dx, ref, msg=f"step {step}")
        _assert_same(model, ordinary)
    assert region.direct_b_runs == 3 and region.unwrapped_b_runs == 2


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return torch.relu(h), h.sin()


def test_b_without_the_wrapper_where_a_region_output_has_no_gradient() -> None:
    """The stage passes on one of the region's two outputs: its node is given
    zeros for the other (as the engine gives them), which the wrapper passed
    on unchanged when B learned it, and B passes on too."""
    torch.manual_seed(0)
    model = _TwoOutputs()
    ordinary = copy.deepcopy(model)
    fn, ref_fn = _compiled(model), _compiled(ordinary)
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    before = fxsplit.compiled_regions()
    for step in range(3):
        params = list(model.parameters())
        xi, ri = x.detach().requires_grad_(), x.detach().requires_grad_()
        out, _ = fn(xi)
        (dx,), work = fxsplit.stage_backward_input([out], [g], [xi], params)
        fxsplit.stage_backward_weight(params, work)
        ref_fn(ri)[0].backward(g)
        torch.testing.assert_close(dx, ri.grad, msg=f"step {step}")
        _assert_same(model, ordinary)
    regions = new_regions(before)  # (the split copy's and the ordinary one's)
    assert sorted(r.direct_b_runs for r in regions) == [0, 3]
    assert sorted(r.unwrapped_b_runs for r in regions) == [0, 2]


def _other_strides(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t() if t.dim() == 2 else t


def _at_an_offset(t: torch.Tensor) -> torch.Tensor:
    buf = torch.empty(t.numel() + 5, dtype=t.dtype)
    buf[5:].view(t.shape).copy_(t)
    return buf[5:].view(t.shape)


@pytest.mark.parametrize("distort", [
    pytest.param(lambda t: t.double(), id="dtype"),
    pytest.param(_other_strides, id="strides"),
    pytest.param(_at_an_offset, id="offset"),
    pytest.param(lambda t: t.reshape(-1), id="rank"),
])
def test_b_calls_the_region_itself_where_dI_returns_another_layout(distort: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Inductor may return an input gradient in any layout that holds its
    values: the direct call hands B's caller what the engine path does (the
    boundary guard conforms its shape and dtype to the input's; strides pass
    as they are, to the engine too), and the gradients are ordinary backward's
    on identical copies, compiled and uncompiled."""
    model, x, g = _stage()
    engine, ordinary, eager = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    fn, engine_fn, ref_fn = _compiled(model), _compiled(engine), _compiled(ordinary)
    regions = [_region_of(f, x) for f in (fn, engine_fn)]
    for region in regions:
        region.prepare_split()
        real, n = region._run_di, len(region.split.di_outputs)

        def distorted(args: list[Any], real: Any = real, n: int = n) -> list[Any]:
            outs = list(real(args))
            return [distort(o) if i < n and isinstance(o, torch.Tensor) else o for i, o in enumerate(outs)]

        region._run_di = distorted
    for step in range(2):
        dx = _split_step(model, fn, x + step, g)
        with fxsplit.config.patch(direct_b=False):
            engine_dx = _split_step(engine, engine_fn, x + step, g)
        ref_dx = _ordinary_step(ordinary, ref_fn, x + step, g)
        eager_dx = _ordinary_step(eager, eager, x + step, g)  # uncompiled
        assert (dx.shape, dx.dtype) == (x.shape, x.dtype) and dx.stride() == engine_dx.stride()
        assert torch.equal(dx, engine_dx)
        torch.testing.assert_close(dx, ref_dx)
        torch.testing.assert_close(dx, eager_dx)
        _assert_same(model, engine, bitwise=True)
        _assert_same(model, ordinary)
        _assert_same(model, eager)
    assert [r.direct_b_runs for r in regions] == [2, 0]


def test_b_calls_the_region_itself_and_refuses_an_input_changed_after_the_forward() -> None:
    """An input whose shape changed after the forward (``x.data = ...``) no
    longer matches its gradient: B raises, naming it, as the engine path
    raises when it assigns ``.grad``, and no weight gradient is written."""
    model, x, g = _stage()
    fn = _compiled(model)
    params = list(model.parameters())
    _split_step(model, fn, x, g)  # (a first B learns the region's call)
    model.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    out = fn(xi)
    xi.data = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"the gradient of a stage input is \(4, 8\).*the input \(2, 8\)"):
        fxsplit.stage_backward_input([out], [g], [xi], params)
    assert xi.grad is None and all(p.grad is None for p in params)


def _holds_saved(node: Any) -> bool:
    """Whether an autograd node still holds the activations it saved."""
    try:
        node.saved_tensors
    except RuntimeError:
        return False
    return True


class _EagerBelow(nn.Module):
    """An eager Linear below a block (compiled on its own unless ``compile``
    is false): B's engine call keeps the graph for W (the Linear's weight
    needs the gradient B saves at its output)."""

    def __init__(self, block: nn.Module, compile: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.block = block
        object.__setattr__(self, "run_block", _compiled(block) if compile else block)  # (not a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_block(self.lin(x))


@pytest.mark.parametrize("direct_b", [True, False], ids=["direct_b", "engine"])
@pytest.mark.parametrize("stage", ["middle", "first", "eager_below"])
def test_the_region_lets_go_of_its_saved_activations_before_its_backward_graph_runs(
    stage: str, direct_b: bool
) -> None:
    """Under an engine call that keeps no graph, AOTAutograd clears the
    region's node's saved activations before the compiled backward runs, so
    that the graph frees each after its last use. B's dI graph starts with
    the node holding none either: where B calls the node itself (the direct
    call; a first stage's region, on the captured output gradient), where
    the engine calls it, and where B's engine call keeps the graph for W's
    eager part. The gradients are ordinary backward's on identical copies,
    compiled and uncompiled."""
    block, x, g = _stage()
    if stage == "eager_below":
        model = _EagerBelow(copy.deepcopy(block))
        ordinary = _EagerBelow(copy.deepcopy(block))
        eager = _EagerBelow(copy.deepcopy(block), compile=False)
        ordinary.lin.load_state_dict(model.lin.state_dict())
        eager.lin.load_state_dict(model.lin.state_dict())
        fn, ref_fn = model, ordinary
    else:
        model, ordinary, eager = block, copy.deepcopy(block), copy.deepcopy(block)
        fn, ref_fn = _compiled(model), _compiled(ordinary)
    regions = []
    for f in (fn, ref_fn):  # (each compiled for the stage's input: one needing no gradient is another graph)
        before = fxsplit.compiled_regions()
        f(x.detach().requires_grad_(stage != "first"))
        regions += new_regions(before)
    assert len(regions) == 2
    nodes: list[Any] = []
    held: dict[str, list[bool]] = {"dI": [], "fused": []}
    for region in regions:
        region.prepare_split()
        for kind, attr in (("dI", "_run_di"), ("fused", "_run_fused")):
            real = getattr(region, attr)

            def watched(args: list[Any], real: Any = real, kind: str = kind) -> Any:
                held[kind].append(_holds_saved(nodes[-1]))
                return real(args)

            setattr(region, attr, watched)
    params = list(model.parameters())
    with fxsplit.config.patch(direct_b=direct_b):
        for step in range(3):
            for m in (model, ordinary, eager):
                m.zero_grad(set_to_none=True)
            xi, ri, ei = ((x + step).detach().requires_grad_(stage != "first") for _ in range(3))
            out = fn(xi)
            nodes.append(out.grad_fn)  # (the region's: the block's output is the stage's)
            dxs, work = fxsplit.stage_backward_input([out], [g], [xi], params)
            assert work.retains_graph == (stage == "eager_below")
            fxsplit.stage_backward_weight(params, work)
            ref = ref_fn(ri)
            nodes.append(ref.grad_fn)
            ref.backward(g)
            eager(ei).backward(g)
            if stage != "first":
                torch.testing.assert_close(dxs[0], ri.grad)
                torch.testing.assert_close(dxs[0], ei.grad)
            _assert_same(model, ordinary)
            _assert_same(model, eager)
    assert held == {"dI": [False] * 3, "fused": [False] * 3}, held
    assert regions[0].direct_b_runs == (3 if direct_b and stage != "eager_below" else 0)


class _PassesItsInput(nn.Module):
    """A block whose outputs are its result and its input itself (or a view of it)."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.lin, self.view = nn.Linear(8, 8), view

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.nn.functional.gelu(self.lin(x)), x.view(2, 2, 8) if self.view else x


@pytest.mark.parametrize("flag", [True, False, "auto"])
@pytest.mark.parametrize("kind", ["leaf", "non_leaf", "view"])
def test_a_stage_that_returns_its_input_splits_as_ordinary_backward(flag: Any, kind: str) -> None:
    """A stage whose outputs include its input itself (a leaf, as a pipeline
    stage's input is, or a tensor made upstream) or a view of it: B then W
    give ordinary backward's gradients on a compiled and an uncompiled copy,
    on every microbatch, under every ``direct_b`` (B goes through the engine:
    an output is not the region's). A non-leaf input returned as it is
    failed B outright before 2026-11-29. (B detaches such an output in
    place, as upstream's B detaches every output that is no view.)"""
    torch.manual_seed(0)
    model = _PassesItsInput(view=kind == "view")
    compiled_copy, eager_copy = copy.deepcopy(model), copy.deepcopy(model)
    fn, ordinary_fn = _compiled(model, "inductor"), _compiled(compiled_copy, "inductor")
    params = list(model.parameters())
    with fxsplit.config.patch(direct_b=flag):
        for _ in range(3):
            for m in (model, compiled_copy, eager_copy):
                m.zero_grad(set_to_none=True)
            x = torch.randn(4, 8)
            gs = [torch.randn(4, 8), torch.randn(2, 2, 8) if kind == "view" else torch.randn(4, 8)]
            found = []
            for f in (fn, ordinary_fn, eager_copy):
                leaf = x.clone().requires_grad_()
                xi = leaf * 1.0 if kind == "non_leaf" else leaf
                outs = list(f(xi))
                if f is fn:
                    (dx,), work = fxsplit.stage_backward_input(outs, gs, [xi], params)
                    fxsplit.stage_backward_weight(params, work)
                    found.append(dx)  # (a non-leaf input is ``leaf * 1.0``: the same gradient as ``leaf``'s)
                else:
                    torch.autograd.backward(outs, gs)
                    found.append(leaf.grad)
            torch.testing.assert_close(found[0], found[1])
            torch.testing.assert_close(found[0], found[2])
            _assert_same(model, compiled_copy)
            _assert_same(model, eager_copy)


class _PlainTensorWeights(nn.Module):
    """Weights held as plain tensors that require grad, not ``nn.Parameter`` (functional code)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, self.w1)), self.w2)


@pytest.mark.parametrize("flag", [True, False, "auto"])
def test_plain_tensor_weights_split_as_ordinary_backward(flag: Any) -> None:
    """Weights given to B and W as plain leaf tensors (B's plan for compiled
    regions only takes ``nn.Parameter`` weights; these take the general plan):
    on every microbatch, the input gradient and each weight's ``.grad`` equal
    ordinary backward's on a compiled and an uncompiled copy."""
    torch.manual_seed(0)
    model = _PlainTensorWeights()
    copies = [_PlainTensorWeights(), _PlainTensorWeights()]
    for c in copies:
        c.w1, c.w2 = model.w1.detach().clone().requires_grad_(), model.w2.detach().clone().requires_grad_()
    fn, ordinary_fns = _compiled(model, "inductor"), [_compiled(copies[0], "inductor"), copies[1]]
    weights = [model.w1, model.w2]
    with fxsplit.config.patch(direct_b=flag):
        for _ in range(3):
            x, g = torch.randn(4, 8), torch.randn(4, 8)
            xi = x.clone().requires_grad_()
            (dx,), work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], weights)
            fxsplit.stage_backward_weight(weights, work)
            for c, f in zip(copies, ordinary_fns):
                xo = x.clone().requires_grad_()
                f(xo).backward(g)
                torch.testing.assert_close(dx, xo.grad)
                torch.testing.assert_close(model.w1.grad, c.w1.grad)
                torch.testing.assert_close(model.w2.grad, c.w2.grad)
