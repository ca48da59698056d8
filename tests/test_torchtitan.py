"""torchtitan integration (:mod:`fxsplit.integrations.torchtitan`): torchtitan's Llama 3 debug
model through torchtitan's own config parser, module split, ``parallelize_fn`` (each block
compiled with ``--compile.backend fxsplit``) and schedule builder, driven as its trainer drives
it (:mod:`fxsplit.bench.titan`), against a single-process run of the same model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed (pip install 'fxsplit[torchtitan]')")
try:
    import torchtitan.distributed.pipeline_parallel  # noqa: F401
    import torchtitan.models.llama3  # noqa: F401
except ImportError as e:  # (torchtitan 0.3.0 on torch 2.11: a name its torch lacks)
    pytest.skip(f"torchtitan does not import with torch {torch.__version__}: {e}", allow_module_level=True)

import os
import sys

import fxsplit.integrations.torchtitan as integration
from fxsplit.bench import titan

sys.path.insert(0, os.path.dirname(__file__))
from multirank import upstream_schedule_failure

pytestmark = pytest.mark.inductor

SCHEDULES = ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble")
# why torch's own schedule cannot run here with gloo (torch 2.11's V schedules), or cannot be
# stepped as torchtitan's trainer steps it (torch 2.12 and older), by torchtitan's name
UNRUNNABLE = {s: why for s in SCHEDULES
              if (why := titan.schedule_step_failure() or upstream_schedule_failure("Schedule" + s)) is not None}


@pytest.fixture(scope="module")
def trained() -> dict[str, list[dict]]:
    """Three optimizer steps under each zero-bubble schedule, 2 gloo ranks, one world."""
    schedules = [s for s in SCHEDULES if s not in UNRUNNABLE]
    if not schedules:
        return {}
    by_rank = titan.run(tuple(titan.TitanRun(schedule=s, steps=3) for s in schedules), ranks=2)
    return {s: [rank_results[i] for rank_results in by_rank] for i, s in enumerate(schedules)}


def _ranks(trained: dict, schedule: str) -> list[dict]:
    if schedule in UNRUNNABLE:
        pytest.skip(UNRUNNABLE[schedule])
    return trained[schedule]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_losses_and_gradients_equal_the_single_process_run(trained: dict, schedule: str) -> None:
    ranks = _ranks(trained, schedule)
    assert sorted(s for r in ranks for s in r["stages"]) == [0, 1, 2, 3]
    for r in ranks:
        assert r["stage_classes"] == ["fxsplit.pipelining.PipelineStage"], r["stage_classes"]
        assert r["fallbacks"] == []
        for step in r["steps"]:
            # every parameter of the rank's stages was compared in the rank (assert_close there)
            assert sorted(step["grad_errors"]) == r["params"] and r["params"]
            assert max(step["grad_errors"].values()) < 1e-4
    last = [r for r in ranks if "losses" in r["steps"][0]]
    assert len(last) == 1
    for step in last[0]["steps"]:
        torch.testing.assert_close(torch.tensor(step["losses"]), torch.tensor(step["ref_losses"]),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_block_is_a_split_region_and_no_flop_is_duplicated(trained: dict, schedule: str) -> None:
    """Per step, the backward FLOPs of every action of every stage add up to the single-process
    backward's, and each action ran only its own graphs of each block: so no stage did any
    work twice (a stage repeating work would raise the total, and none can do less and still
    give the exact gradients the other test checks)."""
    ranks = _ranks(trained, schedule)
    for step in range(len(ranks[0]["steps"])):
        # the backward FLOPs of all actions of all stages (I + W, and B where the schedule
        # issues a full backward) equal one ordinary backward of the whole model per microbatch
        total = sum(r["steps"][step]["backward_flops"] for r in ranks)
        assert total == ranks[0]["steps"][step]["ref_backward_flops"] > 0
        for r in ranks:
            for a in r["steps"][step]["actions"]:
                blocks = r["blocks"][a["stage"]]
                if a["kind"] == "I":  # each block's dI graph, and nothing else of the blocks
                    assert (a["di_runs"], a["dw_runs"], a["fused_runs"]) == (blocks, 0, 0), a
                elif a["kind"] == "W":
                    assert (a["di_runs"], a["dw_runs"], a["fused_runs"]) == (0, blocks, 0), a
                else:  # a full backward (DualPipeV's overlapped chunks)
                    assert (a["di_runs"], a["dw_runs"], a["fused_runs"]) == (0, 0, blocks), a
    kinds = {a["kind"] for r in ranks for a in r["steps"][0]["actions"]}
    assert {"I", "W"} <= kinds


def test_refuses_a_zero_bubble_schedule_over_blocks_compiled_by_another_backend() -> None:
    from torchtitan.config import CompileConfig, ParallelismConfig

    for schedule in SCHEDULES:
        with pytest.raises(ValueError, match="--compile.backend fxsplit"):
            integration.check_config(ParallelismConfig(pipeline_parallel_schedule=schedule),
                                     CompileConfig(enable=True, backend="inductor"))
    # fine: fxsplit's backend, eager blocks, or a schedule that runs full backwards only
    integration.check_config(ParallelismConfig(pipeline_parallel_schedule="ZBVZeroBubble"),
                             CompileConfig(enable=True, backend="fxsplit"))
    integration.check_config(ParallelismConfig(pipeline_parallel_schedule="ZBVZeroBubble"), CompileConfig())
    integration.check_config(ParallelismConfig(pipeline_parallel_schedule="1F1B"),
                             CompileConfig(enable=True, backend="inductor"))


def test_maps_torchtitans_pipelining_functions_and_refuses_graph_pp_and_others() -> None:
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()

    def graph_pipeline_llm(*args, **kwargs):  # a stand-in named as GraphPP's module names it
        raise AssertionError("never called")

    graph_pipeline_llm.__module__ = "torchtitan.experiments.graph_trainer.graph_pp.pipeline"
    config.model_spec.pipelining_fn = graph_pipeline_llm
    with pytest.raises(ValueError, match="GraphPP"):
        integration.use_fxsplit(config)

    from torchtitan.distributed.pipeline_parallel import pipeline_llm, pipeline_vlm

    for theirs, ours in ((pipeline_llm, integration.pipeline_llm), (pipeline_vlm, integration.pipeline_vlm)):
        config.model_spec.pipelining_fn = theirs
        assert integration.use_fxsplit(config).model_spec.pipelining_fn is ours
        assert integration.use_fxsplit(config).model_spec.pipelining_fn is ours  # idempotent

    def my_pipeline(*args, **kwargs):
        raise AssertionError("never called")

    config.model_spec.pipelining_fn = my_pipeline
    with pytest.raises(ValueError, match="cannot know how it builds its stages"):
        integration.use_fxsplit(config)


def test_config_registry_serves_torchtitans_configs_with_fxsplit_stages() -> None:
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args([
        "--module", "fxsplit.integrations.torchtitan", "--config", "llama3_debugmodel",
        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
        "--compile.enable", "--training.disable_cuda_graphs"])
    assert config.model_spec.pipelining_fn is integration.pipeline_llm
    assert config.compile.backend == "fxsplit"  # torchtitan's default backend became fxsplit's
    config = ConfigManager().parse_args([
        "--module", "fxsplit.integrations.torchtitan", "--config", "llama3_debugmodel",
        "--compile.backend", "aot_eager"])
    assert config.compile.backend == "aot_eager"  # a backend named on the command line stays
    import fxsplit.integrations.torchtitan.config_registry as registry

    assert "llama3_debugmodel" in dir(registry) and "qwen3_debugmodel" in dir(registry)
    with pytest.raises(AttributeError, match="no config function 'llama3_nonexistent'"):
        registry.llama3_nonexistent  # noqa: B018


def test_missing_torchtitan_is_named_with_the_extra_to_install() -> None:
    with pytest.raises(ImportError, match=r"pip install 'fxsplit\[torchtitan\]'"):
        integration._torchtitan("torchtitan_that_is_not_installed")
    # installed, but a module of it does not import (torchtitan 0.3.0 on torch 2.11 fails so)
    with pytest.raises(ImportError, match=r"torchtitan is installed but torchtitan\.not_a_module does not import "
                                          r"with torch .*this torchtitan does not support this torch"):
        integration._torchtitan("torchtitan.not_a_module")


def test_refuses_flex_attention_blocks_with_the_way_out() -> None:
    from torchtitan.config import CompileConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    model_config = model_registry("debugmodel").model  # FlexAttention: torchtitan's default
    with torch.device("meta"):
        model = model_config.build()
    with pytest.raises(ValueError, match="llama3_debugmodel_varlen_attn"):
        integration._check_attention(model, CompileConfig(enable=True, backend="fxsplit"))
    integration._check_attention(model, CompileConfig())  # eager blocks: nothing to refuse
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = model_config.build()
    integration._check_attention(model, CompileConfig(enable=True, backend="fxsplit"))


def test_a_torch_whose_schedules_take_no_loss_kwargs_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's trainer passes ``loss_kwargs=`` to ``schedule.step``; torch 2.12's
    schedules take no such argument and fail cutting it into microbatches. The driver
    says so before starting a rank (here with 2.12's ``step`` signature)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    def step(self, *args, target=None, losses=None, **kwargs):  # torch 2.12's signature
        raise AssertionError("not called")

    assert titan.schedule_step_failure() is None or "loss_kwargs" in titan.schedule_step_failure()
    monkeypatch.setattr(PipelineScheduleSingle, "step", step)
    assert "schedule.step takes no loss_kwargs=" in titan.schedule_step_failure()
    with pytest.raises(RuntimeError, match="takes no loss_kwargs="):
        titan.run(titan.TitanRun(schedule="InterleavedZeroBubble", steps=1), ranks=2, timeout_s=5)
