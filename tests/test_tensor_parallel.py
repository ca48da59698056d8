"""Tensor parallelism (DTensor TP, sequence parallelism) inside split regions.

Real 2-rank gloo runs on CPU (:mod:`tp_harness`): a Llama-style block and
single layers, parallelized with ``parallelize_module`` on a ``tp`` mesh and
compiled with fxsplit, split as a zero-bubble schedule splits them (B0, B1,
W1, W0). In-rank, the input gradients and every weight gradient (a DTensor:
placements and local tensor) are compared with ordinary backward on identical
copies, compiled and uncompiled, and their ``full_tensor()`` with an unsharded
module on the full input. Here: which collectives each phase ran, where the
split put them, and the FLOPs of each phase. Single-process tests on a
1-rank mesh cover the compile-time refusals (never silent).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import logging
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fxsplit
from fxsplit import _torch_internals

sys.path.insert(0, os.path.dirname(__file__))
import pipeline_harness as ph  # noqa: E402
import tp_harness as th  # noqa: E402

fxsplit_backend = importlib.import_module("fxsplit.backend")

# torch 2.11 cannot run split regions with DTensor inputs: the backend refuses them when they
# compile (tested below on every torch); the tests that run such regions need 2.13 or later.
needs_subclass_regions = pytest.mark.skipif(
    not _torch_internals.subclass_regions_supported(),
    reason=f"torch {torch.__version__}: split regions with DTensor inputs need torch 2.13 (the refusal: "
           "test_dtensor_regions_need_torch_2_13_error, test_refused_region_falls_back_with_one_warning)")

LayerCase = th.LayerCase
CASES = [
    LayerCase("block"),
    LayerCase("block", sp=True),
    LayerCase("block", sp=True, defer="all"),
    LayerCase("block", eager_below=True),
    LayerCase("colwise"),
    LayerCase("rowwise"),
    LayerCase("sp_mlp"),
    LayerCase("hf_llama"),
    LayerCase("gathered"),
]
GATHER, SCATTER, REDUCE = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"
# The collectives of each layer kind's backward (functional collectives, in
# graph order), all of which the split puts in dI: README's table.
BACKWARD_COLLECTIVES = {
    # every column-wise projection's input gradient is a partial sum: q, k, v; w1, w3
    "block-eager": [REDUCE] * 5,
    "block-eager-eager_below": [REDUCE] * 5,
    # the output gradient is gathered over the sequence, the input gradient
    # reduce-scattered back to it, once for the attention and once for the MLP
    "block-sp-eager": [GATHER, SCATTER] * 2,
    "block-sp-eager-defer_all": [GATHER, SCATTER] * 2,
    "colwise-eager": [REDUCE],
    "rowwise-eager": [],
    "sp_mlp-sp-eager": [GATHER, SCATTER],
    "hf_llama-eager": [REDUCE] * 5,  # q, k, v; gate, up
    # the gathered weight's gradient is reduce-scattered: only W needs it
    "gathered-eager": [SCATTER],
}
# Where the split puts them: (dI, dW). All in dI but for a collective only a weight gradient needs.
SPLIT_COLLECTIVES = {name: (ops, []) for name, ops in BACKWARD_COLLECTIVES.items()}
SPLIT_COLLECTIVES["gathered-eager"] = ([], [SCATTER])
# The c10d op each functional collective runs as (what the profiler sees).
C10D = {GATHER: "allgather_into_tensor_coalesced_", SCATTER: "reduce_scatter_tensor_coalesced_",
        REDUCE: "allreduce_"}


@pytest.fixture(scope="module")
def tp_world() -> dict[str, list[dict[str, Any]]]:
    """case name -> both ranks' results, from one 2-rank world running every case."""
    per_rank = ph.run_world(CASES, world=th.TP, timeout_s=600, runner=th.run_tp_case)
    by_case: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for rank_results in per_rank:
        for result in rank_results:
            by_case[result["case"]].append(result)
    return by_case


def _counts(functional: list[str]) -> dict[str, int]:
    return dict(collections.Counter(C10D[op] for op in functional))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@needs_subclass_regions
def test_gradients_match_ordinary_backward(tp_world: dict[str, list[dict[str, Any]]], case: LayerCase) -> None:
    """Both ranks checked every gradient in-rank (see tp_harness.run_layer_case);
    the weight gradients are DTensors placed as ordinary backward places them."""
    results = tp_world[case.name]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        # the split copy's B and W ran dI and dW; the ordinary copy's backward, the fused graph
        assert r["stats"] == {"fused_runs": th.N_MICROBATCHES, "di_runs": th.N_MICROBATCHES,
                              "dw_runs": th.N_MICROBATCHES}, r["stats"]
        placements = r["placements"]
        if case.kind == "block":
            prefix = "inner." if case.eager_below else ""
            for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
                assert placements[f"{prefix}{name}.weight"] == ["Shard(dim=0)"], (name, placements)
            for name in ("attention.wo", "feed_forward.w2"):
                assert placements[f"{prefix}{name}.weight"] == ["Shard(dim=1)"], (name, placements)
            norms = [placements[f"{prefix}{n}.weight"] for n in ("attention_norm", "ffn_norm")]
            # sequence parallel: each rank holds the partial sum over its tokens, as ordinary backward leaves it
            assert norms == ([["Partial(sum)"]] * 2 if case.sp else [None, None]), norms


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@needs_subclass_regions
def test_collectives_run_once_in_b_and_never_in_w(tp_world: dict[str, list[dict[str, Any]]],
                                                   case: LayerCase) -> None:
    """Every collective of the input-gradient chain is in the dI graph, a collective
    only a weight gradient needs in dW, each waited in the graph that issues it; at
    run time B and W issue exactly those, together what ordinary backward issues,
    nothing twice."""
    expected = BACKWARD_COLLECTIVES[case.name]
    in_di, in_dw = SPLIT_COLLECTIVES[case.name]
    for r in tp_world[case.name]:
        where = f"{case.name} rank {r['rank']}"
        assert r["fused_collectives"] == expected, where
        assert (r["di_collectives"], r["dw_collectives"]) == (in_di, in_dw), where
        assert r["split_waits"] == [], (where, r["split_waits"])
        for k in range(th.N_MICROBATCHES):
            b, w, ordinary = r["b"][k][0], r["w"][k][0], r["ordinary"][k][0]
            assert ordinary == _counts(expected), (where, k, ordinary)
            assert (b, w) == (_counts(in_di), _counts(in_dw)), (where, k, b, w)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@needs_subclass_regions
def test_b_does_no_weight_gradient_matmul(tp_world: dict[str, list[dict[str, Any]]], case: LayerCase) -> None:
    """W's matmul FLOPs are exactly the weight-gradient matmuls at the local shapes
    (the eager Linear below the region included), B's the rest of ordinary backward."""
    for r in tp_world[case.name]:
        where = f"{case.name} rank {r['rank']}"
        weight = r["weight_grad_flops"] + r["eager_weight_flops"]
        assert weight > 0, where
        for k in range(th.N_MICROBATCHES):
            b, w, ordinary = r["b"][k][1], r["w"][k][1], r["ordinary"][k][1]
            assert w == weight, (where, k, w, weight)
            assert b + w == ordinary, (where, k, b, w, ordinary)


@pytest.mark.parametrize("case", [c for c in CASES if c.sequence_parallel and c.defer is None], ids=lambda c: c.name)
@needs_subclass_regions
def test_sequence_parallel_gathered_gradient_crosses(tp_world: dict[str, list[dict[str, Any]]],
                                                     case: LayerCase) -> None:
    """The output gradient all-gathered in dI, which the weight-gradient matmul
    also reads, crosses to W as a live-in: W gathers nothing again."""
    for r in tp_world[case.name]:
        assert r["gathered_output_grad_crosses"], r["live_ins"]
        assert r["w"][0][0] == {} and r["w"][1][0] == {}


@needs_subclass_regions
def test_plain_weights_of_a_tp_region_accumulate_in_the_graph(tp_world: dict[str, list[dict[str, Any]]]) -> None:
    """Without sequence parallelism the norm weights are plain tensors beside the
    DTensor weights: from the second microbatch on they accumulate inside the dW
    graph, while the DTensor gradients go through autograd."""
    for r in tp_world["block-eager"]:
        assert r["accumulated_in_graph"] == ["attention_norm.weight", "ffn_norm.weight"], r["accumulated_in_graph"]
    for r in tp_world["block-sp-eager"]:
        assert r["accumulated_in_graph"] == [], r["accumulated_in_graph"]


@pytest.mark.inductor
@needs_subclass_regions
def test_inductor_tp_block_and_the_eager_split_for_comparison() -> None:
    """With Inductor: the sequence-parallel block splits as with the eager compiler.
    For comparison, the same block compiled by backend="inductor" through fxsplit's
    eager split: with whole_nodes="again" (the way upstream splits compiled stages)
    B runs the region's whole backward and W runs it again, every collective and
    matmul included; by default it runs once, at B, and W only commits the DTensor
    gradients B kept (no collective, no matmul)."""
    cases = [LayerCase("block", sp=True, compiler="inductor"), th.EagerSplitCase(sp=True),
             th.EagerSplitCase(sp=True, whole_nodes="once")]
    per_rank = ph.run_world(cases, world=th.TP, timeout_s=600, runner=th.run_tp_case)
    expected = _counts([GATHER, SCATTER] * 2)
    for split, eager, once in per_rank:
        (b_coll, b_flops), (w_coll, w_flops), (o_coll, o_flops) = once["b"], once["w"], once["ordinary"]
        assert b_coll == o_coll == expected and w_coll == {}, (once["rank"], once)
        assert b_flops == o_flops > 0 and w_flops == 0, (once["rank"], once)
        where = f"rank {split['rank']}"
        assert split["di_collectives"] == [GATHER, SCATTER] * 2 and split["dw_collectives"] == [], where
        for k in range(th.N_MICROBATCHES):
            assert split["b"][k][0] == expected and split["w"][k][0] == {}, (where, split["b"][k], split["w"][k])
            assert split["w"][k][1] == split["weight_grad_flops"], where
            assert split["b"][k][1] + split["w"][k][1] == split["ordinary"][k][1], where
        # the eager split: W repeats every collective and every matmul FLOP of the backward
        (b_coll, b_flops), (w_coll, w_flops), (o_coll, o_flops) = eager["b"], eager["w"], eager["ordinary"]
        assert b_coll == w_coll == o_coll == expected, (where, eager)
        assert b_flops == w_flops == o_flops > 0, (where, eager)


# ---------------------------------------------------------------------------------------------
# single process, 1-rank mesh: compile-time refusals
@pytest.fixture
def tp_mesh_of_one() -> Any:
    """A 1-rank gloo process group in this process and a 1-rank ``tp`` mesh on it."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():  # pragma: no cover - another test leaked a group
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _tp_stage(mesh: Any) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    from torch.distributed.tensor.parallel import parallelize_module

    model, plan = th.build(LayerCase("block"))
    parallelize_module(model, mesh, plan)
    return model, list(model.parameters())


def _as_old_reader(parts: list[Any] | None) -> list[Any] | None:
    """What fxsplit read before it knew subclass descriptors: a DTensor weight's pieces unidentified."""
    if parts is None:
        return None
    return [dataclasses.replace(p, input_index=None) if p is not None and p.part else p for p in parts]


def _compile_error(fn: Any) -> fxsplit.FxsplitCompileError:
    with pytest.raises(Exception) as info:
        fn()
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or getattr(e, "inner_exception", None)
    errors = [e for e in chain if isinstance(e, fxsplit.FxsplitCompileError)]
    assert errors, f"no FxsplitCompileError in {[type(e).__name__ for e in chain]}"
    return errors[0]


@needs_subclass_regions
def test_unidentified_weight_gradients_are_a_compile_error(tp_mesh_of_one: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A region whose backward outputs cannot all be attributed to an input is
    refused when it compiles (it would otherwise split with weight-gradient
    matmuls in dI), under fallback="error" as FxsplitCompileError."""
    _unidentified_gradients(monkeypatch)
    model, _ = _tp_stage(tp_mesh_of_one)
    model.compile(backend=fxsplit.backend(compiler="eager", fallback="error"))
    x = torch.randn(th.BATCH, th.SEQ, th.DIM, requires_grad=True)
    err = _compile_error(lambda: model(x))
    assert err.graph == "split" and "_local_tensor" in str(err) and "cannot tell" in str(err), str(err)


def _refuse_dtensor_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the backend sees on torch 2.11 (a no-op there)."""
    monkeypatch.setattr(_torch_internals, "subclass_regions_supported", lambda: False)


def _unidentified_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _torch_internals.backward_output_parts
    monkeypatch.setattr(_torch_internals, "backward_output_parts", lambda bw: _as_old_reader(real(bw)))


def test_dtensor_regions_need_torch_2_13_error(tp_mesh_of_one: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch whose AOTAutograd has no per-class backward epilogue (2.11), a
    region with DTensor inputs is refused when it compiles, naming the torch
    version, not at B with an AttributeError."""
    _refuse_dtensor_regions(monkeypatch)
    model, _ = _tp_stage(tp_mesh_of_one)
    model.compile(backend=fxsplit.backend(compiler="eager", fallback="error"))
    err = _compile_error(lambda: model(torch.randn(th.BATCH, th.SEQ, th.DIM, requires_grad=True)))
    assert err.graph == "split" and "DTensor" in str(err) and "torch 2.13" in str(err), str(err)
    assert torch.__version__ in str(err), str(err)


@pytest.mark.fallback
@pytest.mark.parametrize(("cause", "message"), [
    pytest.param(_unidentified_gradients, "cannot tell", marks=needs_subclass_regions, id="unidentified"),
    pytest.param(_refuse_dtensor_regions, "torch 2.13", id="dtensor_regions_need_torch_2_13"),
])
def test_refused_region_falls_back_with_one_warning(
    tp_mesh_of_one: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cause: Any, message: str
) -> None:
    """Under fallback="eager" a refused region runs eagerly after one warning (the
    eager split still applies, with ordinary backward's gradients)."""
    import copy

    cause(monkeypatch)
    model, params = _tp_stage(tp_mesh_of_one)
    plain = copy.deepcopy(model)
    model.compile(backend=fxsplit.backend(compiler="eager", fallback="eager"))
    before = len(fxsplit.fallbacks())
    x = torch.randn(th.BATCH, th.SEQ, th.DIM)
    dy = torch.randn(th.BATCH, th.SEQ, th.DIM)
    xs, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    with caplog.at_level(logging.WARNING, logger="fxsplit"):
        out = model(xs)
        dx, work = fxsplit.stage_backward_input([out], [dy], [xs], params)
        fxsplit.stage_backward_weight(params, work)
    warnings = [r.getMessage() for r in caplog.records if r.name == "fxsplit" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and message in warnings[0], warnings
    (record,) = fxsplit.fallbacks()[before:]
    assert record.graph == "split"
    plain(xo).backward(dy)
    torch.testing.assert_close(dx[0], xo.grad)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        th._assert_same_grad(p.grad, q.grad, name)


@needs_subclass_regions
def test_a_weight_gradient_matmul_left_in_di_is_a_compile_error(tp_mesh_of_one: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A split whose dI graph would run a weight-gradient matmul is refused when the region compiles."""
    real = fxsplit_backend.split_backward

    def misplacing(*args: Any, **kwargs: Any) -> Any:
        split = real(*args, **kwargs)
        assert split.weight_contractions_in_di == ()  # what the pass itself produces
        mm = next(n.name for n in split.dw_graph.graph.nodes if n.target is torch.ops.aten.mm.default)
        return dataclasses.replace(split, weight_contractions_in_di=(mm,))

    monkeypatch.setattr(fxsplit_backend, "split_backward", misplacing)
    model, _ = _tp_stage(tp_mesh_of_one)
    model.compile(backend=fxsplit.backend(compiler="eager", fallback="error"))
    err = _compile_error(lambda: model(torch.randn(th.BATCH, th.SEQ, th.DIM, requires_grad=True)))
    assert err.graph == "split" and "weight-gradient matmul" in str(err) and "in dI" in str(err), str(err)


# ---------------------------------------------------------------------------------------------
# 3-D parallelism: tensor x pipeline (4 ranks), and x FSDP2 (8 ranks)
import tp_pp_harness as tpp  # noqa: E402

TPPPCase = tpp.TPPPCase
SPLIT_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble")
TP_PP_CASES = [TPPPCase(s, sp) for s in SPLIT_SCHEDULES for sp in (False, True)]
TP_PP_CASES.append(TPPPCase("ScheduleZBVZeroBubble", sp=True, compile="blocks"))
FSDP_CASE = TPPPCase("ScheduleZBVZeroBubble", sp=True, fsdp=True)
FSDP_OPS = ("_allgather_base_", "_reduce_scatter_base_", "allgather_", "reduce_scatter_")


def _skip_where_upstream_fails(case: TPPPCase) -> None:
    why = ph.upstream_schedule_failure(case.schedule)
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def tp_pp_world() -> dict[str, list[dict[str, Any]]]:
    """case name -> the four ranks' results, from one 4-rank world running every case."""
    runnable = [c for c in TP_PP_CASES if ph.upstream_schedule_failure(c.schedule) is None]
    per_rank = ph.run_world(runnable, world=PP_TP_WORLD, timeout_s=600, runner=tpp.run_tp_pp_case)
    by_case: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for rank_results in per_rank:
        for result in rank_results:
            by_case[result["case"]].append(result)
    return by_case


PP_TP_WORLD = tpp.PP * tpp.TP


def _check_pipeline_run(case: TPPPCase, results: list[dict[str, Any]]) -> None:
    """Coverage of the in-rank checks (losses and full gradients against the
    single-process reference, both steps), then, per action of the last step:
    I ran only dI graphs and W only dW graphs; W issued no collective; with
    every module compiled, I's matmul FLOPs are the input-gradient ones and W's
    the weight-gradient ones at the local shapes; without FSDP, I and W together
    issue exactly the collectives and FLOPs of one ordinary backward of the stage."""
    assert sorted(r["rank"] for r in results) == list(range(case.world))
    stages = {s for r in results for s in r["stages"]}
    assert stages == set(range(tpp.N_STAGES))
    with_loss = [r for r in results if tpp.N_STAGES - 1 in r["stages"]]
    assert len(with_loss) == case.world // tpp.PP
    for r in with_loss:
        assert len(r["losses"]) == tpp.N_STEPS and all(len(v) == tpp.N_MICROBATCHES for v in r["losses"])
    for r in results:
        where = f"{case.name} rank {r['rank']}"
        assert r["grads_checked"] > 0, where
        per_stage: dict[int, dict[str, list[dict[str, Any]]]] = collections.defaultdict(lambda: {"I": [], "W": []})
        for a in r["actions"]:
            assert a["kind"] in ("I", "W"), (where, a)  # zero-bubble schedules: no full B
            per_stage[a["stage"]][a["kind"]].append(a)
        for s, kinds in per_stage.items():
            assert len(kinds["I"]) == len(kinds["W"]) == tpp.N_MICROBATCHES, (where, s)
            weight = r["weight_grad_flops"][s]
            input_flops = weight - r["input_proj_flops"][s]  # stage 0's input needs no gradient
            yard = r["yardstick"].get(s) if isinstance(r["yardstick"], dict) else None
            yard = yard if yard is not None else r["yardstick"].get(str(s))
            for i, w in zip(sorted(kinds["I"], key=lambda a: a["mb"]), sorted(kinds["W"], key=lambda a: a["mb"])):
                what = f"{where} stage {s} mb {i['mb']}"
                assert i["di_runs"] >= 1 and i["dw_runs"] == 0 and i["fused_runs"] == 0, (what, i)
                assert w["dw_runs"] >= 1 and w["di_runs"] == 0 and w["fused_runs"] == 0, (what, w)
                assert not any(op in FSDP_OPS for op in i["collectives"]), (what, i["collectives"])
                if case.compile == "all":
                    assert w["collectives"] == {}, (what, w["collectives"])
                    # matmuls: the attention backward (input-gradient work) is counted only where
                    # torch's FLOP registry knows its CPU kernel (2.15, not 2.13)
                    assert w["attention_flops"] == 0, (what, w["attention_flops"])
                    assert (i["flops"] - i["attention_flops"], w["flops"]) == (input_flops, weight), (
                        what, i["flops"], i["attention_flops"], w["flops"])
                if yard is not None:
                    both = collections.Counter(i["collectives"]) + collections.Counter(w["collectives"])
                    assert dict(both) == yard[0], (what, i["collectives"], w["collectives"], yard[0])
                    if case.compile == "all":
                        assert i["flops"] + w["flops"] == yard[1], (what, i["flops"], w["flops"], yard[1])


@pytest.mark.parametrize("case", TP_PP_CASES, ids=lambda c: c.name)
@needs_subclass_regions
def test_tp_pp_zero_bubble(tp_pp_world: dict[str, list[dict[str, Any]]], case: TPPPCase) -> None:
    _skip_where_upstream_fails(case)
    _check_pipeline_run(case, tp_pp_world[case.name])


@needs_subclass_regions
def test_tp_pp_blocks_only_compiled_eager_projections_split_at_w(
        tp_pp_world: dict[str, list[dict[str, Any]]]) -> None:
    """Only the blocks compiled (torchtitan's way): the eager, sequence-parallel input
    projection of stage 0 gathers its output gradient for its weight gradient, which
    only W needs, so that all-gather runs in W, once; every other collective runs in I."""
    case = TP_PP_CASES[-1]
    _skip_where_upstream_fails(case)
    for r in tp_pp_world[case.name]:
        for a in r["actions"]:
            if a["kind"] == "W":
                expected = {"allgather_into_tensor_coalesced_": 1} if a["stage"] == 0 else {}
                assert a["collectives"] == expected, (r["rank"], a)


@pytest.mark.slow
@needs_subclass_regions
def test_tp_pp_fsdp_zero_bubble() -> None:
    """TP x PP x FSDP2 on 8 ranks (2 x 2 x 2): ZB-V, sequence parallel, per-block
    compile and fully_shard. As above, and FSDP's own collectives stay outside I
    and W (gathered at the schedule's UNSHARD, reduce-scattered at REDUCE_GRAD)."""
    _skip_where_upstream_fails(FSDP_CASE)
    results = [r[0] for r in ph.run_world([FSDP_CASE], world=FSDP_CASE.world, timeout_s=900,
                                          runner=tpp.run_tp_pp_case)]
    _check_pipeline_run(FSDP_CASE, results)
    for r in results:
        labels = [label for op, label in r["collectives"] if op in FSDP_OPS]
        assert any("REDUCE_GRAD" in label for label in labels), (r["rank"], r["collectives"])
        assert not any(":I" in label or ":W" in label for label in labels), (r["rank"], labels)


@needs_subclass_regions
def test_ordinary_backward_retains_the_graph_through_a_dtensor_region(tp_mesh_of_one: Any) -> None:
    """Ordinary backward with retain_graph=True through a region with DTensor weights
    works as through any fxsplit region (its backward donates no buffer), and a
    second backward accumulates the same gradients again."""
    import copy

    model, _ = _tp_stage(tp_mesh_of_one)
    plain = copy.deepcopy(model)
    model.compile(backend=fxsplit.backend(compiler="eager", fallback="error"))
    x = torch.randn(th.BATCH, th.SEQ, th.DIM)
    dy = torch.randn(th.BATCH, th.SEQ, th.DIM)
    out = model(x)
    out.backward(dy, retain_graph=True)
    out.backward(dy)
    ref = plain(x)
    ref.backward(dy, retain_graph=True)
    ref.backward(dy)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        th._assert_same_grad(p.grad, q.grad, name)
