"""A balanced first stage through the public API: B runs the activation-gradient
chain, W only the weight-gradient leaves.

A first stage's inputs (token ids) need no gradient. B still runs every
compiled region's dI graph (for a region in ``first_stage`` mode, the chain
through it; for one whose input comes from an eager embedding, its input
gradient, handed to W's embedding backward), and W runs only the dW graphs and
eager weight work. Checked per stage layout:

* gradients equal ordinary backward on identical copies (eager, and compiled
  with fxsplit), with two microbatches in flight (B B W W);
* each region runs its dI graph once at B and its dW graph once at W, and B
  touches no ``.grad``;
* FLOPs: B's equal those of the activation-gradient chain (eager autograd of
  the stage from its embedding output, every weight frozen), W's the
  weight-gradient FLOPs only (ordinary backward's minus the chain's): nothing
  is duplicated;
* memory: between B and W a microbatch holds no more than 1.1x what the
  pending W work declares (live-ins and eager W state), as on other stages;
* weight hooks fire once per weight and microbatch, at W.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from stage_check import new_regions
from test_leaks import _alive_after
from test_semantics import Hooks
from torch.testing import assert_close
from torch.utils.flop_counter import FlopCounterMode

import fxsplit
from fxsplit.stage_plan import is_split_region

Counts = collections.Counter
VOCAB, BATCH, SEQ = 64, 4, 16


class Block(nn.Module):
    """A pre-norm MLP block with a residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Trunk(nn.Module):
    """Embedding, a block, optionally eager code with a weight (a graph break), a block."""

    def __init__(self, dim: int, graph_break: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.first = Block(dim)
        self.mid = nn.LayerNorm(dim) if graph_break else None
        self.second = Block(dim)

    @torch._dynamo.disable
    def _eager(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(h))

    def from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        h = self.first(h)
        if self.mid is not None:
            h = self._eager(h)
        return self.second(h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.from_hidden(self.embed(ids))


class FirstStage(nn.Module):
    """Token ids in; hidden states out, or (``head``) a cross-entropy loss, as a
    pipeline with one stage is both first and last."""

    def __init__(self, dim: int, graph_break: bool = False, head: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.trunk = Trunk(dim, graph_break)
        self.head = nn.Linear(dim, VOCAB, bias=not tied) if head else None
        if tied:  # GPT-2's tied embedding and output weights
            self.head.weight = self.trunk.embed.weight
        self.labels = torch.randint(0, VOCAB, (BATCH * SEQ,))

    def _top(self, h: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return h
        return F.cross_entropy(self.head(h).flatten(0, 1), self.labels)

    def from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Everything after the embedding (for the chain's reference FLOPs)."""
        return self._top(self.trunk.from_hidden(h))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._top(self.trunk(ids))


# layout -> (model kwargs, what is compiled in place, fxsplit regions per forward)
LAYOUTS: dict[str, tuple[dict[str, bool], Callable[[FirstStage], list[nn.Module]], int]] = {
    # one region holding the embedding: its inputs need no gradient (split mode "first_stage")
    "compiled": ({}, lambda m: [m.trunk], 1),
    # eager embedding under two compiled blocks: their inputs need a gradient (the embedding's)
    "eager_embedding": ({}, lambda m: [m.trunk.first, m.trunk.second], 2),
    # the break inside from_hidden splits the trunk into three regions: the embedding
    # alone (first_stage mode: its dI is empty, its dW the embedding backward), the
    # first block, and (after the eager LayerNorm, which has a weight) the second block
    "graph_break": ({"graph_break": True}, lambda m: [m.trunk], 3),
    # first and last: compiled trunk under an eager head and cross-entropy
    "first_and_last": ({"head": True}, lambda m: [m.trunk], 1),
    # first and last, compiled blocks between an eager embedding and an eager head (B retains
    # the graph for the head, yet W's calls pass through no region: the regions free theirs)
    "eager_ends": ({"head": True}, lambda m: [m.trunk.first, m.trunk.second], 2),
    # the same with the head tied to the embedding: W's call for that weight starts at the
    # head and passes through the regions to the embedding, so they keep their saved state
    "tied_ends": ({"head": True, "tied": True}, lambda m: [m.trunk.first, m.trunk.second], 2),
}
# W re-runs the input-gradient work between a tied weight's two uses (docs/semantics.md, Limitations)
UNTIED = [name for name, (kwargs, _, _) in LAYOUTS.items() if not kwargs.get("tied")]


def build(layout: str, dim: int = 16, compiler: str = "eager") -> tuple[FirstStage, FirstStage, int]:
    """(eager reference, the same weights compiled with fxsplit in place, regions per forward)."""
    torch.manual_seed(0)
    kwargs, parts, n_regions = LAYOUTS[layout]
    ref = FirstStage(dim, **kwargs)
    model = copy.deepcopy(ref)
    for part in parts(model):
        part.compile(backend=fxsplit.backend(compiler=compiler, fallback="error"))
    return ref, model, n_regions


def token_ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def output_grad(out: torch.Tensor, seed: int) -> torch.Tensor | None:
    if out.numel() == 1:
        return None  # a loss
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + seed))


def ordinary_backward(model: nn.Module, seeds: list[int]) -> list[torch.Tensor]:
    for s in seeds:
        out = model(token_ids(s))
        torch.autograd.backward([out], None if out.numel() == 1 else [output_grad(out, s)])
    return [p.grad for p in model.parameters()]


def stats(regions: list[Any]) -> list[dict[str, int]]:
    return [dict(r.stats) for r in regions]


def flops(fn: Callable[[], Any]) -> Counts:
    with FlopCounterMode(display=False) as counter:
        fn()
    return Counts({str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items() if n})


def _check_b_then_w(layout: str, compiler: str) -> None:
    ref, model, n_regions = build(layout, compiler=compiler)
    params = list(model.parameters())
    before = fxsplit.compiled_regions()
    seeds = [0, 1]
    outs = [model(token_ids(s)) for s in seeds]  # two microbatches in flight
    regions = new_regions(before)
    assert len(regions) == n_regions, [r.name for r in regions]
    assert all(r.stats == {"fused_runs": 0, "di_runs": 0, "dw_runs": 0} for r in regions)

    pending = []
    for s, out in zip(seeds, outs):
        ids = token_ids(s)
        (dids,), work = fxsplit.stage_backward_input([out], [output_grad(out, s)] if out.numel() > 1 else None,
                                                     [ids], params)
        assert dids is None
        pending.append(work)
    assert all(p.grad is None for p in params), "B touched a weight gradient"
    # B: every region ran its dI graph once per microbatch, nothing else
    assert stats(regions) == [{"fused_runs": 0, "di_runs": 2, "dw_runs": 0}] * n_regions
    assert sum(len(w.compiled) for w in pending) == 2 * n_regions
    for work in pending:
        fxsplit.stage_backward_weight(params, work)
    assert stats(regions) == [{"fused_runs": 0, "di_runs": 2, "dw_runs": 2}] * n_regions

    expected = ordinary_backward(ref, seeds)
    for got, want in zip(params, expected):
        assert_close(got.grad, want)
    # ordinary backward through the same compiled stage: the same gradients
    for p in params:
        p.grad = None
    for got, want in zip(ordinary_backward(model, seeds), expected):
        assert_close(got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_b_runs_each_region_di_and_w_its_dw(layout: str) -> None:
    _check_b_then_w(layout, "eager")


@pytest.mark.inductor
def test_b_runs_each_region_di_and_w_its_dw_inductor() -> None:
    _check_b_then_w("first_and_last", "inductor")


@pytest.mark.parametrize("layout", UNTIED)
def test_w_does_only_weight_gradient_flops(layout: str) -> None:
    """B's FLOPs are the activation-gradient chain's, W's the weight gradients' only."""
    ref, model, _ = build(layout)
    params = list(model.parameters())
    ids = token_ids(0)

    out = ref(ids)
    full = flops(lambda: torch.autograd.backward([out], None if out.numel() == 1 else [output_grad(out, 0)]))
    # The chain: eager autograd from the embedding output, every weight frozen.
    frozen = copy.deepcopy(ref).requires_grad_(False)
    h = frozen.trunk.embed(ids).detach().requires_grad_()
    out = frozen.from_hidden(h)
    chain = flops(lambda: torch.autograd.grad([out], [h], None if out.numel() == 1 else [output_grad(out, 0)]))
    weight_only = full - chain
    assert sum(chain.values()) > 0 and sum(weight_only.values()) > 0, (chain, full)

    out = model(ids)
    box: dict[str, Any] = {}
    b = flops(lambda: box.update(r=fxsplit.stage_backward_input(
        [out], None if out.numel() == 1 else [output_grad(out, 0)], [ids], params)))
    _, work = box.pop("r")
    w = flops(lambda: fxsplit.stage_backward_weight(params, work))
    assert b == chain, f"B={dict(b)}, chain={dict(chain)}"
    assert w == weight_only, f"W={dict(w)}, weight gradients={dict(weight_only)}"
    assert b + w == full


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_b_frees_what_w_does_not_need(layout: str) -> None:
    """Between B and W a first-stage microbatch holds what W declares it needs
    (``held_bytes``: compiled live-ins, eager W state), not its activations; and
    no compiled region's saved activations are part of it unless W's eager
    calls pass through the region (a tied weight)."""
    ref, model, _ = build(layout, dim=64)
    params = list(model.parameters())
    for k in range(2):  # the first microbatch also compiles
        ids = token_ids(k)
        pending: list[fxsplit.PendingWeightGrads] = []

        def forward_and_b(ids: torch.Tensor = ids, k: int = k) -> None:
            out = model(ids)
            grads = None if out.numel() == 1 else [output_grad(out, k)]
            _, work = fxsplit.stage_backward_input([out], grads, [ids], params)
            pending.append(work)

        alive = _alive_after(forward_and_b)
        work = pending.pop()
        if k == 1:
            kept = [n.name() for n in work._rerun if is_split_region(n)]
            assert bool(kept) == ("tied" in layout), f"{layout}: regions kept for W: {kept}"
            assert work.held_bytes > 0
            assert alive <= 1.1 * work.held_bytes, (
                f"{layout}: {alive} bytes alive between B and W, {work.held_bytes} declared "
                f"({work.live_in_bytes} live-ins, {work.eager_saved_bytes} eager saved state)"
            )
        fxsplit.stage_backward_weight(params, work)
    for got, want in zip(params, ordinary_backward(ref, [0, 1])):
        assert_close(got.grad, want)


@pytest.mark.parametrize("layout", ["compiled", "eager_embedding", "first_and_last", "tied_ends"])
def test_weight_hooks_fire_once_at_w(layout: str) -> None:
    """Tensor, post-accumulate-grad and grad-accumulator hooks: none at B, each
    once per microbatch at W, as in ordinary backward (the tensor hook doubles
    the gradient, so a hook run twice or skipped shows in ``.grad``)."""
    ref, model, _ = build(layout)
    ref_hooks, hooks = Hooks(ref), Hooks(model)
    params = list(model.parameters())
    ordinary_backward(ref, [0, 1])
    for s in (0, 1):
        ids = token_ids(s)
        out = model(ids)
        _, work = fxsplit.stage_backward_input([out], None if out.numel() == 1 else [output_grad(out, s)],
                                               [ids], params)
        assert (sum(hooks.pre.values()), sum(hooks.post.values()), sum(hooks.acc.values())) == (
            s * len(params), s * len(params), s * len(params)
        ), "a weight hook fired during B"
        fxsplit.stage_backward_weight(params, work)
    assert hooks.pre == ref_hooks.pre and hooks.post == ref_hooks.post and hooks.acc == ref_hooks.acc
    for got, want in zip(params, ref.parameters()):
        assert_close(got.grad, want.grad)


def test_stage_without_regions_runs_everything_at_w() -> None:
    """An eager first stage: nothing needs an input gradient and no region runs
    at B, so (as upstream) B does nothing and W the whole backward."""
    torch.manual_seed(0)
    ref = FirstStage(16)
    model = copy.deepcopy(ref)
    params = list(model.parameters())
    ids = token_ids(0)
    out = model(ids)
    box: dict[str, Any] = {}
    b = flops(lambda: box.update(r=fxsplit.stage_backward_input([out], [output_grad(out, 0)], [ids], params)))
    _, work = box.pop("r")
    assert not b and all(p.grad is None for p in params)
    fxsplit.stage_backward_weight(params, work)
    for got, want in zip(params, ordinary_backward(ref, [0])):
        assert_close(got.grad, want)


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "output_hook"])
def test_one_region_first_stage_b_needs_no_engine_call(hooked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first stage compiled as one region: B's plan is the compiled-only
    walk's, and what flows into the region is the output gradient itself, so
    B runs the region's dI graph with no autograd call to capture it (before,
    the general plan and an engine call). A tensor hook on the output is run
    by the engine, as ordinary backward runs it: then B makes that call.
    Gradients equal ordinary backward's on an identical eager copy, two
    microbatches in flight."""
    ref, model, _ = build("compiled")
    params = list(model.parameters())
    engine_calls: list[int] = []
    real = torch.autograd.grad

    def counted(*args: Any, **kwargs: Any) -> Any:
        engine_calls.append(1)
        return real(*args, **kwargs)

    seen: list[int] = []
    outs = [model(token_ids(s)) for s in (0, 1)]
    monkeypatch.setattr(torch.autograd, "grad", counted)  # (after the forwards: compiling traces with it)
    if hooked:
        for o in outs:
            o.register_hook(lambda g: seen.append(1))
    works = []
    for s, out in enumerate(outs):
        dinputs, work = fxsplit.stage_backward_input([out], [output_grad(out, s)], [token_ids(s)], params)
        assert dinputs == (None,)
        works.append(work)
    assert all(p.grad is None for p in params)
    assert len(engine_calls) == (2 if hooked else 0) and len(seen) == (2 if hooked else 0)
    for work in works:
        fxsplit.stage_backward_weight(params, work)
    want = ordinary_backward(ref, [0, 1])
    for (name, p), w in zip(model.named_parameters(), want):
        assert_close(p.grad, w, msg=name)
    assert len(seen) == (2 if hooked else 0)  # (once per microbatch, as ordinary backward runs it)



def test_one_region_first_stage_with_its_loss_b_needs_no_engine_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first stage that is also the last, compiled whole with its loss, given
    to B as the loss with no output gradient (the scalar's implicit one): B
    calls the region's node itself, no autograd call, as for hidden-state
    outputs. Gradients equal ordinary backward's on an identical eager copy,
    two microbatches in flight."""
    torch.manual_seed(0)
    ref = FirstStage(16, head=True)
    model = copy.deepcopy(ref)
    model.compile(backend=fxsplit.backend(fallback="error"))
    params = list(model.parameters())
    before = fxsplit.compiled_regions()
    losses = [model(token_ids(s)) for s in (0, 1)]
    (region,) = new_regions(before)
    engine_calls: list[int] = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: (engine_calls.append(1), real(*a, **k))[1])
    works = [fxsplit.stage_backward_input(loss, None, [token_ids(s)], params)[1] for s, loss in enumerate(losses)]
    assert not engine_calls and region.direct_b_runs == 2 and all(p.grad is None for p in params)
    for work in works:
        fxsplit.stage_backward_weight(params, work)
    for (name, p), w in zip(model.named_parameters(), ordinary_backward(ref, [0, 1])):
        assert_close(p.grad, w, msg=name)

def _hook_regions(out: torch.Tensor, seen: list[tuple[int, str, list[torch.Tensor]]]) -> int:
    """Register a pre-hook and a hook on every compiled region's autograd node
    below ``out`` (numbered in the order of a walk from it), recording what fires."""
    found: list[Any] = []
    queue, visited = [out.grad_fn], set()
    while queue:
        node = queue.pop(0)
        if node is None or node in visited:
            continue
        visited.add(node)
        if is_split_region(node):
            found.append(node)
        queue += [child for child, _ in node.next_functions]
    for k, node in enumerate(found):
        node.register_prehook(lambda gs, k=k: seen.append((k, "pre", [g.clone() for g in gs if g is not None])))
        node.register_hook(lambda gi, go, k=k: seen.append((k, "post", [])))
    return len(found)


def _hook_weights(model: nn.Module, seen: list[str], but: str | None) -> None:
    for name, p in model.named_parameters():
        if name != but:
            p.register_hook(lambda g, name=name: seen.append(name))


@pytest.mark.parametrize("weight_hooks", [False, True], ids=["", "weight_hooks"])
@pytest.mark.parametrize("direct", ["auto", True, False], ids=["direct_auto", "direct", "engine"])
@pytest.mark.parametrize("layout", ["compiled", "graph_break"])
def test_hooks_on_a_first_stage_region_node_fire_at_b(layout: str, direct: Any, weight_hooks: bool) -> None:
    """A hook or pre-hook on a compiled region's autograd node fires where
    ordinary backward runs the node: B runs each region's input-gradient part,
    so each fires at B, once per microbatch, in ordinary backward's order, with
    the same incoming gradients. That includes the bottom region of a first
    stage, whose incoming gradient B takes without running the node through
    autograd's engine (for a first stage of one region, the output gradient
    itself): a hooked one is run by the engine, whose call stops at a weight
    with no tensor hook below it (``weight_hooks``: every weight but the
    embedding's has one; none fires at B). Gradients equal ordinary
    backward's on an identical compiled copy and an eager one; two
    microbatches in flight."""
    eager, model, _ = build(layout)
    _, ordinary, _ = build(layout)
    params = list(model.parameters())
    weight_seen: list[str] = []
    ordinary_weight_seen: list[str] = []
    if weight_hooks:
        _hook_weights(model, weight_seen, "trunk.embed.weight")
        _hook_weights(ordinary, ordinary_weight_seen, "trunk.embed.weight")
    with fxsplit.config.patch(direct_b=direct):
        works, seen_b = [], []
        for s in (0, 1):
            out = model(token_ids(s))
            seen: list[Any] = []
            assert _hook_regions(out, seen) == LAYOUTS[layout][2]
            _, work = fxsplit.stage_backward_input([out], [output_grad(out, s)], [token_ids(s)], params)
            seen_b.append(list(seen))
            works.append((work, seen))
        assert not weight_seen, "a weight's hook fired at B"
        for work, seen in works:
            fxsplit.stage_backward_weight(params, work)
            assert len(seen) == len(seen_b[0]), "a region node's hook fired at W"
    for s, got in enumerate(seen_b):
        out = ordinary(token_ids(s))
        want: list[Any] = []
        _hook_regions(out, want)
        out.backward(output_grad(out, s))
        assert [(k, kind) for k, kind, _ in got] == [(k, kind) for k, kind, _ in want]
        for (_, _, g), (_, _, w) in zip(got, want):
            assert len(g) == len(w)
            for a, b in zip(g, w):
                assert_close(a, b)
    for (name, p), q, e in zip(model.named_parameters(), ordinary.parameters(), ordinary_backward(eager, [0, 1])):
        assert_close(p.grad, q.grad, msg=name)
        assert_close(p.grad, e, msg=name)
    assert sorted(weight_seen) == sorted(ordinary_weight_seen) and len(weight_seen) == (2 * (len(params) - 1)
                                                                                        if weight_hooks else 0)


def test_hooks_on_a_first_stage_region_node_that_b_cannot_run_are_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """Where every edge below a first stage's bottom region is a weight with a
    tensor hook, an engine call stopping there would call those hooks at B:
    B runs the region itself and its node's hooks do not run, which is said
    once. Weight hooks fire at W only; gradients are ordinary backward's."""
    _, model, _ = build("graph_break")
    _, ordinary, _ = build("graph_break")
    params = list(model.parameters())
    weight_seen: list[str] = []
    ordinary_weight_seen: list[str] = []
    _hook_weights(model, weight_seen, None)
    _hook_weights(ordinary, ordinary_weight_seen, None)
    with caplog.at_level("WARNING", logger="fxsplit"):
        for s in (0, 1):
            out = model(token_ids(s))
            seen: list[Any] = []
            _hook_regions(out, seen)
            fired = len(weight_seen)
            _, work = fxsplit.stage_backward_input([out], [output_grad(out, s)], [token_ids(s)], params)
            assert len(weight_seen) == fired, "a weight's hook fired at B"
            assert [(k, kind) for k, kind, _ in seen] == [(0, "pre"), (0, "post"), (1, "pre"), (1, "post")]
            fxsplit.stage_backward_weight(params, work)
            out = ordinary(token_ids(s))
            out.backward(output_grad(out, s))
    assert len([r for r in caplog.records if "do not run" in r.getMessage()]) == 1
    assert sorted(weight_seen) == sorted(ordinary_weight_seen)
    for (name, p), q in zip(model.named_parameters(), ordinary.parameters()):
        assert_close(p.grad, q.grad, msg=name)
