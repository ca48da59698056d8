"""torchtitan: zero-bubble pipeline schedules over blocks compiled by fxsplit.

torchtitan builds a pipeline with its model spec's ``pipelining_fn``
(``torchtitan.distributed.pipeline_parallel.pipeline_llm`` for the language
models): it splits the model into stage modules, applies ``parallelize_fn``
to each (FSDP2, TP, activation checkpointing, and ``torch.compile`` of every
transformer block in place with ``--compile.backend``), wraps each in torch's
``PipelineStage`` and builds the schedule. This module supplies the same
function with one change: the stages are :class:`fxsplit.pipelining.PipelineStage`,
so a block compiled with ``backend="fxsplit"`` runs its compiled dI graph at
the schedule's ``I`` and its compiled dW graph at ``W``.

From torchtitan's command line, with the config registry of this package
(torchtitan loads ``<--module>.config_registry`` and calls the function that
``--config`` names; every config function of torchtitan's models is
available under its own name)::

    torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module fxsplit.integrations.torchtitan --config llama3_debugmodel_varlen_attn \\
        --parallelism.pipeline_parallel_degree 2 \\
        --parallelism.pipeline_parallel_schedule ZBVZeroBubble \\
        --compile.enable --compile.backend fxsplit --training.disable_cuda_graphs

From Python: ``use_fxsplit(config)`` on a ``torchtitan.trainer.Trainer.Config``,
or pass :func:`pipeline_llm` as a ``ModelSpec``'s ``pipelining_fn``.

What it refuses (``ValueError`` when the pipeline is built, naming the fix):

* blocks with FlexAttention (torchtitan's default for its language models) compiled
  with ``backend="fxsplit"``: torchtitan's ``apply_compile`` accepts only
  ``inductor`` and ``aot_eager`` for them. Use a config with another attention
  (``llama3_debugmodel_varlen_attn``);

* a schedule that splits the backward (``InterleavedZeroBubble``,
  ``ZBVZeroBubble``, ``DualPipeV``, or a CSV schedule, which may) over blocks
  compiled by a backend other than fxsplit: such a block's backward cannot be
  split into compiled dI and dW graphs (fxsplit's eager split would run it
  whole at ``I``, upstream refuses or runs it twice);
* GraphPP (``torchtitan.experiments.graph_trainer``): its runner executes its
  own backward graphs instead of autograd's, so there is no stage backward
  for fxsplit to split; use it or this module, not both.

``import fxsplit.integrations.torchtitan`` does not import torchtitan; every
function here does, and raises ``ImportError`` naming the ``fxsplit[torchtitan]``
extra when it is missing.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

log = logging.getLogger("fxsplit")

__all__ = ["SPLIT_SCHEDULES", "check_config", "pipeline_llm", "pipeline_vlm", "use_fxsplit"]

#: torchtitan's names (``--parallelism.pipeline_parallel_schedule``) of the schedules
#: whose stages run ``I`` and ``W`` separately.
SPLIT_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
_PREFIX = "fxsplit.integrations.torchtitan: "
_GRAPH_PP = "torchtitan.experiments.graph_trainer"


def _torchtitan(module: str = "torchtitan.distributed.pipeline_parallel") -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if importlib.util.find_spec(module.split(".")[0]) is not None:  # installed, but not for this torch
            raise ImportError(
                _PREFIX + f"torchtitan is installed but {module} does not import with torch {torch.__version__} "
                f"({e}): this torchtitan does not support this torch (fxsplit tests torchtitan 0.3.0)"
            ) from e
        raise ImportError(
            _PREFIX + f"needs torchtitan ({e}); install it with pip install 'fxsplit[torchtitan]'"
        ) from e


def _splits_backward(parallelism: Any) -> bool:
    """Whether the configured schedule runs ``I`` and ``W`` as separate actions (a CSV
    schedule may: it is counted as one that does)."""
    if getattr(parallelism, "pipeline_parallel_schedule_csv", None):
        return True
    name = parallelism.pipeline_parallel_schedule.lower()
    return name in {s.lower() for s in SPLIT_SCHEDULES}


def check_config(parallelism: Any, compile_config: Any) -> None:
    """Raise ``ValueError`` for a combination this integration cannot honour: a schedule
    that splits the backward with blocks compiled by another backend than ``fxsplit``.
    Arguments are torchtitan's ``ParallelismConfig`` and ``CompileConfig``."""
    compiled = compile_config.enable and "model" in compile_config.components
    if compiled and compile_config.backend != "fxsplit" and _splits_backward(parallelism):
        schedule = parallelism.pipeline_parallel_schedule_csv or parallelism.pipeline_parallel_schedule
        raise ValueError(
            _PREFIX + f"schedule {schedule} splits each stage's backward into I and W, but the transformer "
            f"blocks are compiled with backend {compile_config.backend!r}, whose backward fxsplit cannot split "
            "into compiled dI and dW graphs. Pass --compile.backend fxsplit (or leave --compile.enable off to "
            "run the blocks eagerly, split by fxsplit's eager split)."
        )


def _check_attention(model: Any, compile_config: Any) -> None:
    """FlexAttention blocks cannot be compiled with ``backend="fxsplit"`` by torchtitan 0.3.0:
    its ``apply_compile`` accepts only ``inductor`` and ``aot_eager`` for a model with
    FlexAttention and raises otherwise, with a message that points at ``inductor``, which
    a split schedule cannot use either (:func:`check_config`). Say so first, with the way out."""
    if not (compile_config.enable and "model" in compile_config.components and compile_config.backend == "fxsplit"):
        return
    from torchtitan.models.common.attention import FlexAttention

    if any(isinstance(m, FlexAttention) for m in model.modules()):
        raise ValueError(
            _PREFIX + "the model's attention is FlexAttention, and torchtitan's apply_compile compiles a "
            "FlexAttention model only with backend 'inductor' or 'aot_eager', whose compiled backward cannot be "
            "split into dI and dW graphs. Use a config whose blocks use another attention (e.g. --config "
            "llama3_debugmodel_varlen_attn), or leave --compile.enable off."
        )


@contextlib.contextmanager
def _fxsplit_stages(pp_module: Any) -> Iterator[None]:
    """torchtitan's pipeline module, with its ``PipelineStage`` name bound to fxsplit's class
    for the duration of the block.

    torchtitan constructs the stages in ``_pipeline_module_split`` with the
    ``PipelineStage`` its module imported, and exposes no argument for the class;
    rebinding that one name lets torchtitan's own module split, ``parallelize_fn``
    call and schedule builder run unchanged (nothing of them is repeated here).
    :func:`pipeline_llm` checks afterwards that every stage is fxsplit's, so a
    torchtitan that builds stages another way fails loudly instead of silently
    giving upstream stages. Not thread-safe (torchtitan builds the pipeline once,
    on the main thread)."""
    from fxsplit.pipelining import PipelineStage

    saved = pp_module.PipelineStage
    pp_module.PipelineStage = _STAGE_CLASS or PipelineStage
    try:
        yield
    finally:
        pp_module.PipelineStage = saved


_STAGE_CLASS: type | None = None  # a subclass of fxsplit's stage, set by _stage_class


@contextlib.contextmanager
def _stage_class(cls: type) -> Iterator[None]:
    """Build the stages with ``cls`` (a subclass of fxsplit's ``PipelineStage``, e.g. one that
    observes its actions: ``fxsplit.bench.titan``) within the block."""
    global _STAGE_CLASS
    saved, _STAGE_CLASS = _STAGE_CLASS, cls
    try:
        yield
    finally:
        _STAGE_CLASS = saved


def _schedule_stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def _build(torchtitan_fn: Callable[..., Any], model: Any, kwargs: dict[str, Any]) -> Any:
    from fxsplit.pipelining import PipelineStage

    parallelism, compile_config = kwargs["parallelism"], kwargs["compile_config"]
    check_config(parallelism, compile_config)
    _check_attention(model, compile_config)
    pp_module = _torchtitan()
    with _fxsplit_stages(pp_module):
        result = torchtitan_fn(model, **kwargs)
    schedule = result[0]
    stages = _schedule_stages(schedule)
    others = [type(s).__qualname__ for s in stages if not isinstance(s, PipelineStage)]
    if others:
        raise RuntimeError(
            _PREFIX + f"torchtitan built stages of class {', '.join(sorted(set(others)))} instead of "
            "fxsplit.pipelining.PipelineStage; this torchtitan constructs its stages in a way this integration "
            "does not know (it was written against torchtitan 0.3.0)"
        )
    compiled = compile_config.enable and "model" in compile_config.components
    how = f"blocks compiled with backend {compile_config.backend!r}" if compiled else "blocks eager"
    log.info(
        _PREFIX + "schedule %s over fxsplit PipelineStage(s) %s on this rank (%s)",
        type(schedule).__name__, [s.stage_index for s in stages], how,
    )
    if not compiled and _splits_backward(parallelism):
        log.info(_PREFIX + "--compile.enable is off: fxsplit's eager split splits the blocks' backward at I and W")
    return result


def pipeline_llm(model: Any, **kwargs: Any) -> tuple[Any, list[Any], bool, bool]:
    """torchtitan's ``pipeline_llm`` (same signature and result: ``(schedule, model_parts,
    has_first_stage, has_last_stage)``) with fxsplit's pipeline stages.

    Raises ``ValueError`` (before anything is built) for a schedule that splits the
    backward over blocks compiled by another backend (:func:`check_config`)."""
    return _build(_torchtitan().pipeline_llm, model, kwargs)


def pipeline_vlm(model: Any, **kwargs: Any) -> tuple[Any, list[Any], bool, bool]:
    """torchtitan's ``pipeline_vlm`` (the vision encoder placed with the first stage, then
    :func:`pipeline_llm`) with fxsplit's pipeline stages."""
    pp_module = _torchtitan()
    # pipeline_vlm calls pipeline_llm by its module-level name, so the stages it builds go
    # through the same rebinding; the check runs once, here.
    return _build(pp_module.pipeline_vlm, model, kwargs)


def use_fxsplit(config: Any) -> Any:
    """Make a torchtitan ``Trainer.Config`` build its pipeline with fxsplit's stages, and
    compile blocks with ``backend="fxsplit"`` unless the config names another backend.

    The model spec's ``pipelining_fn`` must be torchtitan's ``pipeline_llm`` or
    ``pipeline_vlm`` (replaced by this module's), or already this module's. Raises
    ``ValueError`` for GraphPP's (``torchtitan.experiments.graph_trainer``), whose
    runner does not use autograd's backward, and for any other ``pipelining_fn``
    (fxsplit cannot know what it builds). Returns ``config``, changed in place."""
    pp_module = _torchtitan()
    spec = config.model_spec
    fn = spec.pipelining_fn
    ours = {pp_module.pipeline_llm: pipeline_llm, pp_module.pipeline_vlm: pipeline_vlm}
    if fn in (pipeline_llm, pipeline_vlm):
        pass
    elif fn in ours:
        spec.pipelining_fn = ours[fn]
    elif getattr(fn, "__module__", "").startswith(_GRAPH_PP):
        raise ValueError(
            _PREFIX + f"{spec.name} is configured with GraphPP ({fn.__module__}.{fn.__qualname__}), whose runner "
            "executes its own backward graphs rather than autograd's, so there is no stage backward for fxsplit "
            "to split. Use torchtitan's main trainer configs (e.g. --module fxsplit.integrations.torchtitan "
            "--config llama3_debugmodel) for fxsplit, or GraphPP without fxsplit."
        )
    else:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(
            _PREFIX + f"{spec.name}'s pipelining_fn is {getattr(fn, '__module__', '?')}.{name}, not torchtitan's "
            "pipeline_llm or pipeline_vlm; fxsplit cannot know how it builds its stages. Build them with "
            "fxsplit.pipelining.PipelineStage in that function instead."
        )
    if config.compile.backend == "inductor":  # torchtitan's default: not a choice the user made
        config.compile.backend = "fxsplit"
    return config
