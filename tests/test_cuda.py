"""The CUDA tier (marker ``cuda``): what only a GPU shows.

Every test here needs a CUDA device and skips, saying so, where there is none
(CI). Run it on a GPU machine with ``python -m pytest -m cuda tests/test_cuda.py``
(docs/development.md, "The CUDA tier"). Nothing here needs ``expecttest``.

Inductor compiles CUDA graphs with passes the CPU never sees (mix-order and
split reductions, persistent reductions, Triton's layouts, cuDNN / flash
attention), chosen by shape: the dense, GQA and grouped-mm MoE stages run at
LLM shapes (width 2048, 4096 tokens and more), where torch 2.11's mix-order
reduction hands a live-in to dW with another rank than the FX graph says.
Gradients of B then W are compared with ``backend="inductor"``'s ordinary
backward and with eager autograd: the split must be as close to Inductor as
Inductor is to eager (:func:`_assert_as_close_as_inductor`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.bench.models import ModelConfig, build
from stage_check import new_regions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA tier needs a CUDA device (none here)"),
]

CUDA = "cuda"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_as_close_as_inductor(name: str, got: torch.Tensor, inductor: torch.Tensor, eager: torch.Tensor) -> None:
    """``got`` (B then W) differs from Inductor's ordinary backward by no more
    than Inductor differs from eager autograd (plus rounding of the dtype)."""
    assert got.shape == inductor.shape and got.dtype == inductor.dtype, name
    assert torch.isfinite(got).all(), name
    floor = 2e-5 if got.dtype == torch.float32 else 2e-3
    err, base = _rel(got, inductor), _rel(inductor, eager)
    assert err <= 2 * base + floor, f"{name}: |split - inductor| {err:.2e} > 2 x |inductor - eager| {base:.2e} + {floor}"


def _run_split(module: nn.Module, fn: Any, xs: list[torch.Tensor], gs: list[torch.Tensor]) -> list[torch.Tensor]:
    """B for every microbatch, then W in reverse (B0 B1 W1 W0): W1 starts from an
    empty .grad, W0 accumulates into it (inside the dW graph where it can)."""
    params = list(module.parameters())
    works, dxs = [], []
    for x, g in zip(xs, gs):
        xi = x.detach().requires_grad_(x.requires_grad)
        inputs = [xi] if xi.requires_grad else []
        dx, work = fxsplit.stage_backward_input([fn(xi)], [g], inputs, params)
        works.append(work)
        dxs.append(dx[0] if dx else None)
    for work in reversed(works):
        fxsplit.stage_backward_weight(params, work)
    return dxs


def _run_ordinary(fn: Any, xs: list[torch.Tensor], gs: list[torch.Tensor]) -> list[torch.Tensor]:
    dxs = []
    for x, g in zip(xs, gs):
        xi = x.detach().requires_grad_(x.requires_grad)
        fn(xi).backward(g)
        dxs.append(xi.grad)
    return dxs


def _compare_stage(module: nn.Module, make_input: Any, microbatches: int = 2, **backend: Any) -> list[Any]:
    """B then W on an fxsplit-compiled copy against backend="inductor" and eager."""
    split_mod, ind_mod, eager_mod = module, copy.deepcopy(module), copy.deepcopy(module)
    before = fxsplit.compiled_regions()
    split_fn = torch.compile(split_mod, backend=fxsplit.backend(**backend))
    ind_fn = torch.compile(ind_mod, backend="inductor")
    xs = [make_input() for _ in range(microbatches)]
    with torch.no_grad():
        out = eager_mod(xs[0])
    gs = [torch.randn_like(out) for _ in range(microbatches)]
    got = _run_split(split_mod, split_fn, xs, gs)
    ind = _run_ordinary(ind_fn, xs, gs)
    eag = _run_ordinary(eager_mod, xs, gs)
    for k, (a, b, c) in enumerate(zip(got, ind, eag)):
        if a is not None:
            _assert_as_close_as_inductor(f"input gradient {k}", a, b, c)
    for (name, p), q, r in zip(split_mod.named_parameters(), ind_mod.parameters(), eager_mod.parameters()):
        assert p.grad is not None and p.grad.stride() == q.grad.stride(), name
        _assert_as_close_as_inductor(name, p.grad, q.grad, r.grad)
    regions = new_regions(before)
    for region in regions:
        print(f"{region.name}: {region.stats}; boundary conformed: {region.boundary.adapted or 'nothing'}")
    return regions


# -- LLM shapes: the GPU-only Inductor passes ---------------------------------------------------

# One block each (the mix-order reduction is chosen per normalization backward, so one
# block shows it; two only double the compile time).
_GPT = ModelConfig("gpt", batch=4, seq=1024, layers=1, dim=2048, heads=16)
LLM = [
    pytest.param(_GPT, torch.bfloat16, id="gpt-w2048-4x1024-bf16"),
    pytest.param(_GPT, torch.float32, id="gpt-w2048-4x1024-fp32"),
    pytest.param(ModelConfig("llama", batch=2, seq=2048, layers=1, dim=2048, heads=16), torch.bfloat16,
                 id="llama-gqa-w2048-2x2048-bf16"),
    pytest.param(ModelConfig("llama", batch=2, seq=2048, layers=1, dim=2048, heads=16), torch.float32,
                 id="llama-gqa-w2048-2x2048-fp32"),
    pytest.param(ModelConfig("moe", batch=2, seq=2048, layers=1, dim=2048, heads=16), torch.bfloat16,
                 id="moe-grouped-mm-w2048-2x2048-bf16"),
]


@pytest.mark.parametrize(("cfg", "dtype"), LLM)
def test_llm_shapes_split_as_ordinary_backward(cfg: ModelConfig, dtype: torch.dtype) -> None:
    stage = build(cfg, CUDA, dtype)
    _compare_stage(stage.module, stage.make_input)


def test_transformers_llama_layers_at_llm_shapes() -> None:
    """transformers' LlamaModel layer (GQA), width 2048, 2 x 2048 tokens, bf16: a model we did not write."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=1,
                                      num_attention_heads=16, num_key_value_heads=4, vocab_size=128,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).to(CUDA, torch.bfloat16)

    class Layers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers, self.rotary = model.layers, model.rotary_emb

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            emb = self.rotary(h, pos)
            for layer in self.layers:
                h = layer(h, position_embeddings=emb, position_ids=pos)
                h = h[0] if isinstance(h, tuple) else h
            return h

    _compare_stage(Layers(), lambda: torch.randn(2, 2048, 2048, device=CUDA, dtype=torch.bfloat16, requires_grad=True))


# -- FlexAttention ----------------------------------------------------------------------------


class FlexStage(nn.Module):
    """qkv -> flex_attention (causal, a document mask, or a learned per-head bias) -> proj."""

    def __init__(self, kind: str, dim: int = 512, heads: int = 8, seq: int = 1024) -> None:
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(heads, seq, seq) * 0.02) if kind == "bias" else None
        self.register_buffer("doc", torch.arange(seq) // (seq // 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.kind == "bias":
            bias = self.bias

            def score_mod(score: Any, bi: Any, h: Any, qi: Any, ki: Any) -> Any:
                return score + bias[h, qi, ki]

            o = flex_attention(q, k, v, score_mod=score_mod)
        else:
            doc = self.doc

            def mask_mod(bi: Any, h: Any, qi: Any, ki: Any) -> Any:
                causal = qi >= ki
                return causal & (doc[qi] == doc[ki]) if self.kind == "document" else causal

            mask = create_block_mask(mask_mod, None, None, t, t, device=x.device)
            o = flex_attention(q, k, v, block_mask=mask)
        return self.proj(o.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("kind", ["causal", "document", "bias"])
def test_flex_attention_stages(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """FlexAttention splits exactly; its backward stays whole in dI by fxsplit's
    built-in rule (a learned bias's gradient comes from the dQ/dK/dV kernel),
    with no "no split rule" warning."""
    torch.manual_seed(0)
    stage = FlexStage(kind).to(CUDA)
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        regions = _compare_stage(stage, lambda: torch.randn(2, 1024, 512, device=CUDA, requires_grad=True))
    assert not [r for r in caplog.records if "no split rule" in r.getMessage()]
    if kind == "bias":
        kept = [s for r in regions for s in r.split.shared if s.how == "kept"]
        assert kept and all("flex_attention_backward" in s.op for s in kept)


# -- semantics on CUDA ---------------------------------------------------------------------------


def _small(dtype: torch.dtype = torch.float32) -> Any:
    return build(ModelConfig("gpt", batch=2, seq=64, layers=2, dim=128, heads=4), CUDA, dtype)


def test_dynamic_sequence_lengths() -> None:
    stage = _small()
    mod, ref = stage.module, copy.deepcopy(stage.module)
    fn = torch.compile(mod, backend="fxsplit", dynamic=True)
    for t in (48, 64, 96):
        x = torch.randn(2, t, 128, device=CUDA)
        g = torch.randn(2, t, 128, device=CUDA)
        got = _run_split(mod, fn, [x.requires_grad_()], [g])
        want = _run_ordinary(ref, [x], [g])
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    for p, q in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


def test_fused_accumulation_over_microbatches_and_hooks() -> None:
    """Four microbatches into .grad (in the dW graph from the second on), with
    one hooked weight that must take autograd's path; hooks fire as ordinary."""
    stage = _small()
    mod, ref = stage.module, copy.deepcopy(stage.module)
    fired = {"split": 0, "ordinary": 0}
    list(mod.parameters())[0].register_post_accumulate_grad_hook(lambda t: fired.__setitem__("split", fired["split"] + 1))
    list(ref.parameters())[0].register_post_accumulate_grad_hook(
        lambda t: fired.__setitem__("ordinary", fired["ordinary"] + 1))
    fn, ref_fn = torch.compile(mod, backend="fxsplit"), torch.compile(ref, backend="inductor")
    xs = [stage.make_input() for _ in range(4)]
    gs = [torch.randn_like(x) for x in xs]
    params = list(mod.parameters())
    accumulated = []
    for x, g in zip(xs, gs):
        xi = x.detach().requires_grad_()
        _, work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
        fxsplit.stage_backward_weight(params, work)
        accumulated.append(len(work.accumulated_in_graph))
    _run_ordinary(ref_fn, xs, gs)
    assert fired["split"] == fired["ordinary"] == 4
    assert accumulated[0] == 0 and all(n > 0 for n in accumulated[1:]), accumulated
    for p, q in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


def test_interrupted_w_is_finished_by_the_next_w() -> None:
    stage = _small()
    mod, ref = stage.module, copy.deepcopy(stage.module)
    params = list(mod.parameters())
    boom = {"armed": True}

    def hook(t: torch.Tensor) -> None:
        if boom["armed"]:
            boom["armed"] = False
            raise RuntimeError("interrupted")

    params[-1].register_post_accumulate_grad_hook(hook)
    fn = torch.compile(mod, backend="fxsplit")
    x, = [stage.make_input()]
    g = torch.randn_like(x)
    xi = x.detach().requires_grad_()
    _, work = fxsplit.stage_backward_input([fn(xi)], [g], [xi], params)
    with pytest.raises(RuntimeError, match="interrupted"):
        fxsplit.stage_backward_weight(params, work)
    fxsplit.stage_backward_weight(params, work)
    _run_ordinary(ref, [x], [g])
    for p, q in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


def test_eager_split_of_an_uncompiled_stage() -> None:
    stage = _small()
    mod, ref = stage.module, copy.deepcopy(stage.module)
    xs = [stage.make_input() for _ in range(2)]
    gs = [torch.randn_like(x) for x in xs]
    got = _run_split(mod, mod, xs, gs)
    want = _run_ordinary(ref, xs, gs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for p, q in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


# -- CUDA graphs (mode="reduce-overhead") ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reduce_overhead_replays_bitwise_with_microbatches_in_flight(dtype: torch.dtype) -> None:
    """mode="reduce-overhead": dI and dW replay as CUDA graphs, three microbatches
    in flight between B and W over three steps (.grad accumulated across them,
    in the captured dW graph); every gradient bitwise the uncaptured split's."""
    stage = _small(dtype)
    captured, plain = stage.module, copy.deepcopy(stage.module)
    before = fxsplit.compiled_regions()
    fn = torch.compile(captured, backend="fxsplit", mode="reduce-overhead")
    plain_fn = torch.compile(plain, backend="fxsplit")
    for step in range(3):
        xs = [stage.make_input() for _ in range(3)]
        gs = [torch.randn_like(x) for x in xs]
        got = _run_split(captured, fn, xs, gs)
        want = _run_split(plain, plain_fn, xs, gs)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"step {step}: an input gradient differs by {(a - b).abs().max():.3e}"
        for (name, p), q in zip(captured.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name} differs by {(p.grad - q.grad).abs().max():.3e}"
    regions = [r for r in new_regions(before) if r.capture is not None]
    assert regions and all(r.capture.status == "captured" for r in regions), [r.capture.status for r in regions]
    replays = {k: sum(r.capture.replays[k] for r in regions) for k in ("dI", "dW", "dW+accumulate")}
    print({r.name: r.capture.describe() for r in regions})
    assert replays["dI"] == 9 and replays["dW"] + replays["dW+accumulate"] == 9, replays


def test_reduce_overhead_hands_out_weight_gradients_and_never_overwrites_one_held() -> None:
    """mode="reduce-overhead", ``.grad`` set to ``None`` before every step (as
    optimizers do): W hands ``.grad`` the captured graphs' static buffers (no
    copy), every gradient bitwise the uncaptured split's; gradients kept
    across a step (views of every one) are never overwritten by a replay."""
    from fxsplit import _torch_internals as ti

    stage = _small(torch.bfloat16)
    captured, plain = stage.module, copy.deepcopy(stage.module)
    before = fxsplit.compiled_regions()
    fn = torch.compile(captured, backend="fxsplit", mode="reduce-overhead")
    plain_fn = torch.compile(plain, backend="fxsplit")
    kept: dict[str, torch.Tensor] = {}
    held_back: list[int] = []  # W runs left uncaptured so far, after each step
    regions: list[Any] = []
    for step in range(5):
        if step == 2:
            kept = {n: p.grad.view(-1) for n, p in captured.named_parameters()}
        values = {n: v.clone() for n, v in kept.items()}
        for p in (*captured.parameters(), *plain.parameters()):
            p.grad = None
        xs = [stage.make_input() for _ in range(2)]
        gs = [torch.randn_like(x) for x in xs]
        for a, b in zip(_run_split(captured, fn, xs, gs), _run_split(plain, plain_fn, xs, gs)):
            assert torch.equal(a, b), f"step {step}: an input gradient differs"
        for (name, p), q in zip(captured.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name} differs"
            assert p.grad.stride() == q.grad.stride() and not p.grad._is_view()
        _assert_unchanged(kept, values, step)  # (no loop variable of it outlives the step: it would hold a gradient)
        if step == 3:
            kept = {}
        regions = regions or [r for r in new_regions(before) if r.capture is not None]
        held_back.append(sum(r.capture.held_back for r in regions))
    assert regions and all(r.capture.status == "captured" for r in regions)
    described = {r.name: r.capture.describe() for r in regions}
    # Views kept from step 2 to 3 hold gradients a replay would overwrite: those W
    # runs go uncaptured; once they are dropped, W replays again.
    assert held_back[1] == 0 and held_back[3] > held_back[1] and held_back[4] == held_back[3], (held_back, described)
    statics = {
        ti.storage_ptr(o)
        for r in regions for s in r.capture.slots
        for g in (s.di, s.dw, *s.variants.values()) if g is not None
        for o in g.outs if isinstance(o, torch.Tensor)
    }
    copied = [n for n, p in captured.named_parameters() if ti.storage_ptr(p.grad) not in statics]
    assert not copied, f"weight gradients copied out of the captured graphs: {copied}; {described}"
    print(described)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "reduce_overhead"])
def test_direct_b_is_taken_on_cuda_and_bitwise_the_engine_path(mode: str | None) -> None:
    """``fxsplit.config.direct_b``'s default on CUDA: B calls a one-region
    stage's node itself (not autograd's engine), and from its second call its
    compiled backward without AOTAutograd's wrapper; input and weight
    gradients bitwise those of B through the engine and the wrapper on an
    identical copy, two microbatches in flight over two steps, with and
    without CUDA graphs."""
    stage = _small(torch.bfloat16)
    direct, engine = stage.module, copy.deepcopy(stage.module)
    before = fxsplit.compiled_regions()
    kw = {"mode": mode} if mode else {}
    fn = torch.compile(direct, backend="fxsplit", **kw)
    engine_fn = torch.compile(engine, backend="fxsplit", **kw)
    for step in range(2):
        for p in (*direct.parameters(), *engine.parameters()):
            p.grad = None
        xs = [stage.make_input().requires_grad_() for _ in range(2)]
        gs = [torch.randn_like(x) for x in xs]
        got = _run_split(direct, fn, xs, gs)
        with fxsplit.config.patch(direct_b=False, skip_aot_wrapper=False):
            want = _run_split(engine, engine_fn, xs, gs)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"step {step}: an input gradient differs"
        for (name, p), q in zip(direct.named_parameters(), engine.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name} differs"
    regions = new_regions(before)
    runs = sorted(r.direct_b_runs for r in regions)
    assert runs == [0] * (len(regions) - 1) + [4], [(r.name, r.direct_b_runs, r.stats) for r in regions]
    assert sum(r.unwrapped_b_runs for r in regions) == 3, [(r.name, r.unwrapped_b_runs) for r in regions]


def test_cuda_kernels_sees_the_kernels_of_both_backwards(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/cuda_kernels.py`` (the profile docs/benchmark.md quotes) finds
    GPU kernels in Inductor's fused backward and in fxsplit's B + W."""
    import re

    from benchmarks import cuda_kernels

    cuda_kernels.main(["tiny", "1"])
    out = capsys.readouterr().out
    found = re.findall(r"== (inductor|fxsplit): [\d.]+ us of kernels per backward, (\d+) launches", out)
    launches = {m: int(n) for m, n in found}
    assert set(launches) == {"inductor", "fxsplit"} and all(launches.values()), out[-2000:]


def _assert_unchanged(kept: dict[str, torch.Tensor], values: dict[str, torch.Tensor], step: int) -> None:
    for name, v in kept.items():
        assert torch.equal(v, values[name]), f"step {step}: a replay overwrote the kept gradient of {name}"


def test_reduce_overhead_ordinary_backward_is_inductors() -> None:
    """Ordinary backward of a reduce-overhead fxsplit module runs the fused graph
    through Inductor's cudagraph trees, as backend="inductor" does; its
    gradients are Inductor's (.grad set to None between steps, as
    reduce-overhead asks: the trees own the memory of the gradients)."""
    stage = _small()
    mod, ref = stage.module, copy.deepcopy(stage.module)
    fn = torch.compile(mod, backend="fxsplit", mode="reduce-overhead")
    ref_fn = torch.compile(ref, backend="inductor")
    before = fxsplit.compiled_regions()
    for _ in range(3):
        for p in (*mod.parameters(), *ref.parameters()):
            p.grad = None
        x = stage.make_input()
        g = torch.randn_like(x)
        torch.compiler.cudagraph_mark_step_begin()
        _run_ordinary(fn, [x], [g])
        _run_ordinary(ref_fn, [x], [g])
        for p, q in zip(mod.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.clone(), q.grad, rtol=1e-4, atol=1e-4)
    assert all(r.stats["fused_runs"] == 3 for r in new_regions(before))


# -- the benchmark -------------------------------------------------------------------------------


def test_bench_quick_on_cuda(tmp_path: Path) -> None:
    from fxsplit import cli

    out = tmp_path / "cuda-quick.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(["bench", "--quick", "--device", "cuda", "--out", str(out), "--no-chart"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["device"]["type"] == "cuda"
    for m in result["modes"]:
        if m.get("not_measurable"):
            continue
        assert m["backward_ms"] > 0 and m["forward_ms"] > 0, m["key"]


# -- expert parallelism ----------------------------------------------------------------------------


def test_expert_parallel_stage_with_nccl_and_grouped_mm() -> None:
    """One rank's MoE stage with the all-to-all token dispatcher over an NCCL group of
    world size 1, experts through torch._grouped_mm in bfloat16, compiled with fxsplit:
    B then W gives ordinary backward's gradients, the all-to-alls run at B only."""
    import os

    import torch.distributed as dist

    import ep_harness as eh
    from fxsplit.bench.world import free_port

    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref = eh.moe_stage(list(range(eh.N_EXPERTS)), "grouped_mm").to(CUDA)
        mod = eh.moe_stage(list(range(eh.N_EXPERTS)), "grouped_mm", group=dist.group.WORLD).to(CUDA)
        mod.load_state_dict(ref.state_dict())
        fn = torch.compile(mod, backend="fxsplit")
        xs = [torch.randn(eh.MB_BATCH, eh.SEQ, eh.DIM, device=CUDA) for _ in range(2)]
        gs = [torch.randn_like(x) for x in xs]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = _run_split(mod, fn, [x.requires_grad_() for x in xs], gs)
        want = _run_ordinary(ref, xs, gs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
        for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=3e-2, atol=3e-3, msg=name)
        assert any(e.name.startswith("c10d::alltoall") or "all_to_all" in e.name for e in prof.events())
    finally:
        if created:
            dist.destroy_process_group()
