"""torchtitan's models trained through torchtitan's own pipeline builder, on CPU ranks.

One rank of a run does what torchtitan's ``Trainer`` does to build and step a
pipeline, with torchtitan's code at every step: the config from torchtitan's
``ConfigManager`` (the same command-line options as ``torchtitan.train``), the
model built on the meta device, the model spec's ``pipelining_fn`` (torchtitan's
module split, ``parallelize_fn`` with per-block ``torch.compile``, schedule
builder), ``to_empty`` + ``init_weights``, the chunked loss wired to the last
stage's ``lm_head``, torchtitan's optimizer, LR scheduler and pipeline-aware
gradient clipping, and ``schedule.step`` with the trainer's arguments.

What differs from ``torchtitan.train`` (which needs an accelerator, torchtitan's
test assets for the tokenizer and a dataset download):

* the device is the CPU and the process group gloo (torchtitan picks ``cuda``
  when no accelerator is present; each rank points its mesh builder at
  ``cpu``), parameters in float32 (``--training.mixed_precision_param float32``);
* each block's inner attention is torch's SDPA (causal), swapped in after the
  config is built as torchtitan's own graph_trainer tests do
  (``build_decoder_config_for_backend``): the language models' configured
  attentions have no backward on a CPU (FlexAttention refuses it, varlen
  attention is CUDA's flash kernel). ``attention="config"`` keeps the configured one;
* the batches are made here: random tokens, or bytes of the Python standard
  library's sources (:func:`stdlib_text`), cut into ``seq_len + 1`` windows;
* no checkpointing, metrics logger or validator.

With ``check`` each step is also run by a single-process reference in every
rank: the same model (same weights, torchtitan's loss, optimizer and LR
schedule), unsplit, its blocks eager (or compiled by ``reference``), one
ordinary backward per microbatch; each
microbatch loss and every gradient of the stages the rank holds are compared,
and the FLOPs of the rank's backward actions (``I``, ``W``, ``B``) are counted
against the reference's backward.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch

from fxsplit.bench import world as W

__all__ = ["TitanRun", "cli_args", "rank_main", "run", "stdlib_text"]


@dataclasses.dataclass(frozen=True)
class TitanRun:
    """One training run. ``registry``: ``"fxsplit"`` (``--module fxsplit.integrations.torchtitan``:
    fxsplit's stages) or ``"torchtitan"`` (the model's own registry: torch's stages).
    ``backend``: the blocks' compile backend, ``None`` for eager blocks. ``ac``:
    torchtitan's activation checkpointing (``"none"``, or the config's own). ``data``:
    ``"random"`` or ``"stdlib"``."""

    schedule: str = "ZBVZeroBubble"
    backend: str | None = "fxsplit"
    registry: str = "fxsplit"
    config: str = "llama3_debugmodel"
    steps: int = 2
    seq_len: int = 32
    local_batch: int = 8
    microbatch: int = 2
    layers: int | None = None  # keep the config's first ``layers`` transformer blocks
    attention: str = "sdpa"  # "sdpa": every block's inner attention swapped to SDPA (causal); "config": as configured
    lr: float | None = None  # None: the config's
    ac: str = "none"
    data: str = "random"
    seed: int = 0
    check: bool = True
    reference: str = "eager"  # the single-process run's blocks: "eager", or compiled by "inductor"
    pp: int | None = None  # pipeline-parallel degree; None: every rank (the other dimensions via ``extra``)
    extra: tuple[str, ...] = ()  # more torchtitan command-line options


def cli_args(r: TitanRun, ranks: int) -> list[str]:
    """torchtitan's command-line options for ``r`` (what ``torchtitan.train`` would be given)."""
    if r.registry == "fxsplit":
        module = "fxsplit.integrations.torchtitan"
    else:  # the torchtitan model package whose config_registry has the function
        from fxsplit.integrations.torchtitan.config_registry import _registries

        module = _registries()[r.config].__module__.rsplit(".", 1)[0]
    args = ["--module", module, "--config", r.config,
            "--parallelism.pipeline_parallel_degree", str(r.pp or ranks),
            "--parallelism.pipeline_parallel_schedule", r.schedule,
            "--parallelism.pipeline_parallel_microbatch_size", str(r.microbatch),
            "--training.local_batch_size", str(r.local_batch), "--training.seq_len", str(r.seq_len),
            "--training.steps", str(r.steps), "--training.mixed_precision_param", "float32",
            "--training.disable_cuda_graphs"]
    if r.backend is not None:
        args += ["--compile.enable", "--compile.backend", r.backend]
    if r.lr is not None:
        args += ["--optimizer.lr", str(r.lr)]
    return args + list(r.extra)


@functools.cache
def stdlib_text() -> torch.Tensor:
    """The bytes of the Python standard library's ``.py`` sources (sorted by path, the
    ``test`` packages left out), as a 1-D ``int64`` tensor: real text that ships with
    every Python, the same on every machine with the same Python version."""
    root = os.path.dirname(os.__file__)
    chunks = []
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "idlelib", "site-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(base, name), "rb") as f:
                    chunks.append(f.read())
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def _batches(r: TitanRun, vocab: int) -> Iterator[torch.Tensor]:
    """``(local_batch, seq_len + 1)`` token windows, the same in every rank."""
    g = torch.Generator().manual_seed(r.seed + 1)
    if r.data == "random":
        while True:
            yield torch.randint(0, vocab, (r.local_batch, r.seq_len + 1), generator=g)
    text = stdlib_text()
    starts = torch.randperm(text.numel() // (r.seq_len + 1), generator=g) * (r.seq_len + 1)
    for i in range(0, starts.numel() - r.local_batch, r.local_batch):
        yield torch.stack([text[s:s + r.seq_len + 1] for s in starts[i:i + r.local_batch].tolist()])


def _name(fqn: str) -> str:
    return fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _build(config: Any, parallel_dims: Any) -> dict[str, Any]:
    """What ``Trainer.__init__`` builds for a pipeline, on CPU."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.tools import utils

    spec = config.model_spec
    model_config = spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"), utils.set_default_dtype(torch.float32):
        model = model_config.build()
    loss_fn = config.loss.build(compile_config=config.compile)
    schedule, parts, first, last = spec.pipelining_fn(
        model, parallel_dims=parallel_dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=config.dump_folder,
        device=torch.device("cpu"), model_config=model_config, parallelize_fn=spec.parallelize_fn, loss_fn=loss_fn)
    for m in parts:
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        m.train()
    if isinstance(loss_fn, ChunkedLossWrapper) and last:
        loss_fn.set_lm_head(parts[-1].lm_head)
        parts[-1]._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=parts)
    if spec.post_optimizer_build_fn is not None:  # e.g. MoE load balancing's expert-bias update
        spec.post_optimizer_build_fn(optimizers, parts, parallel_dims)
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    return {"model_config": model_config, "schedule": schedule, "parts": parts, "first": first, "last": last,
            "optimizers": optimizers, "schedulers": schedulers}


def _reference(config: Any, model_config: Any, seed: int, parallel_dims: Any, reference: str) -> dict[str, Any]:
    """The whole model on one process, with torchtitan's loss, optimizer and schedule; its
    blocks eager, or compiled by the backend ``reference`` names."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.config import CompileConfig
    from torchtitan.tools import utils

    torch.manual_seed(seed)
    with utils.set_default_dtype(torch.float32):
        ref = model_config.build()
    with torch.no_grad():
        ref.init_weights(buffer_device=None)
    ref.train()
    if reference != "eager":  # each block compiled in place, as torchtitan's apply_compile does
        torch._dynamo.config.capture_scalar_outputs = True
        for block in ref.layers.values():
            block.compile(backend=reference, fullgraph=True)
    loss_fn = config.loss.build(compile_config=CompileConfig(enable=False))
    if isinstance(loss_fn, ChunkedLossWrapper):
        loss_fn.set_lm_head(ref.lm_head)
        ref._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[ref])
    if config.model_spec.post_optimizer_build_fn is not None:
        config.model_spec.post_optimizer_build_fn(optimizers, [ref], parallel_dims)
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    return {"model": ref, "loss_fn": loss_fn, "optimizers": optimizers, "schedulers": schedulers}


def _copy_weights(ref: torch.nn.Module, parts: list[torch.nn.Module]) -> None:
    """The reference's parameters and buffers into the stage modules, by name."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    state = {_name(k): v for k, v in [*ref.named_parameters(), *ref.named_buffers()]}
    with torch.no_grad():
        for part in parts:
            for fqn, t in [*part.named_parameters(), *part.named_buffers()]:
                want = state[_name(fqn)]
                if isinstance(t, DTensor):  # sharded (FSDP2, TP): this rank's shard of the whole
                    t.copy_(distribute_tensor(want, t.device_mesh, t.placements))
                else:
                    t.copy_(want)
                assert torch.equal(_local(t), want), fqn


def _reference_step(ref: dict[str, Any], mbs: list[tuple[torch.Tensor, torch.Tensor]],
                    tokens: torch.Tensor, count_flops: bool) -> tuple[list[float], int]:
    """One step of the reference: losses per microbatch and the backward's FLOPs (the
    gradients are left in ``.grad`` for the comparison; :func:`_reference_update` steps)."""
    model, loss_fn = ref["model"], ref["loss_fn"]
    ref["optimizers"].zero_grad(set_to_none=True)
    losses, flops = [], 0
    for inputs, labels in mbs:
        loss, _ = loss_fn(model(inputs), labels, tokens)
        if count_flops:
            with W.MatmulCounter() as counter:
                loss.backward()
            flops += counter.total - counter.attention
        else:
            loss.backward()
        losses.append(loss.item())
    return losses, flops


def _reference_update(ref: dict[str, Any], max_norm: float) -> None:
    torch.nn.utils.clip_grad_norm_(ref["model"].parameters(), max_norm, foreach=True)
    ref["optimizers"].step()
    ref["schedulers"].step()


def _compare(parts: list[torch.nn.Module], ref: torch.nn.Module, rtol: float, atol: float) -> dict[str, float]:
    """Largest relative gradient error per parameter of ``parts`` (asserts each is within tolerance)."""
    ref_grads = {_name(k): p.grad for k, p in ref.named_parameters()}
    errors = {}
    for part in parts:
        for fqn, p in part.named_parameters():
            name, want = _name(fqn), ref_grads[_name(fqn)]
            assert p.grad is not None, f"{name}: no gradient after the step (reference has one)"
            got = _local(p.grad)
            errors[name] = float(((got - want).norm() / want.norm().clamp_min(1e-30)).item())
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    return errors


def _step(schedule: Any, built: dict[str, Any], mbs: list[tuple[torch.Tensor, torch.Tensor]],
          inputs: torch.Tensor, labels: torch.Tensor, losses: list[torch.Tensor] | None, tokens: torch.Tensor) -> None:
    """``schedule.step`` as the trainer calls it: with the microbatches (``arg_mbs``,
    ``target_mbs``) where the schedule takes them (torch >= 2.14), else with the whole
    batch, which the schedule cuts into the same microbatches (torch 2.13)."""
    loss_kwargs = {"global_valid_tokens": tokens}
    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        schedule.step(arg_mbs=[(i,) for i, _ in mbs] if built["first"] else None, kwarg_mbs=[{} for _ in mbs],
                      target_mbs=[t for _, t in mbs] if built["last"] else None, losses=losses,
                      loss_kwargs=loss_kwargs, return_outputs=False)
    else:
        args = (inputs,) if built["first"] else ()
        schedule.step(*args, target=labels if built["last"] else None, losses=losses, loss_kwargs=loss_kwargs,
                      return_outputs=False)


def _config(r: TitanRun, ranks: int) -> Any:
    """torchtitan's config for ``r``, parsed by its ``ConfigManager`` from :func:`cli_args`."""
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(cli_args(r, ranks))
    if r.ac == "none":
        config.activation_checkpoint = None
    if r.layers is not None:
        config.model_spec.model.layers = config.model_spec.model.layers[:r.layers]
    if r.attention == "sdpa":
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in config.model_spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _train(r: TitanRun, rank: int, ranks: int) -> dict[str, Any]:
    """One run in this rank: per step the loss (last-stage ranks) and, with ``r.check``, the
    reference's losses and backward FLOPs, the gradient errors (asserted within
    tolerance) and every backward action of the rank's stages (region runs, FLOPs)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    import fxsplit
    import fxsplit.integrations.torchtitan as integration
    from fxsplit.pipelining import PipelineStage

    parallel_dims_module.device_type = "cpu"  # torchtitan's mesh device: "cuda" without an accelerator
    fallbacks_before = len(fxsplit.fallbacks())
    config = _config(r, ranks)
    parallel_dims = ParallelDims.from_config(config.parallelism, ranks)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    observed = W.observed_stage_class(PipelineStage)
    with integration._stage_class(observed):
        built = _build(config, parallel_dims)
    parts, schedule = built["parts"], built["schedule"]
    stages = integration._schedule_stages(schedule)
    # FLOPs are counted without activation checkpointing only: the counter's dispatch mode
    # cannot run the run_with_rng_state operator a checkpointed compiled block recomputes with
    count_flops = r.check and r.ac == "none"
    for stage in stages:
        if isinstance(stage, observed) and r.check:
            stage.observers = [W.RegionRuns.observer] + ([W.MatmulCounter.observer()] if count_flops else [])
    # the weights: a seeded whole model's, the same whatever the split (and the reference)
    ref = _reference(config, built["model_config"], r.seed, parallel_dims, r.reference)
    _copy_weights(ref["model"], parts)
    pp_mesh = parallel_dims.get_optional_mesh("pp")
    max_norm = config.training.max_norm
    out: dict[str, Any] = {
        "rank": rank, "run": dataclasses.asdict(r), "torch": torch.__version__,
        "stages": [s.stage_index for s in stages], "layers": len(config.model_spec.model.layers),
        "stage_classes": sorted({c.__module__ + "." + c.__qualname__ for s in stages
                                 for c in [type(s).__mro__[1] if isinstance(s, observed) else type(s)]}),
        "blocks": {s.stage_index: len(part.layers) for s, part in zip(stages, parts)},
        "params": sorted(_name(n) for part in parts for n, _ in part.named_parameters()),
        "steps": [],
    }
    batches = _batches(r, built["model_config"].vocab_size)
    n_mb = r.local_batch // r.microbatch
    for step in range(r.steps):
        x = next(batches)
        inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        mbs = list(zip(inputs.chunk(n_mb), labels.chunk(n_mb)))
        tokens = torch.tensor(labels.numel())
        built["optimizers"].zero_grad(set_to_none=True)
        for stage in stages:
            getattr(stage, "actions", []).clear()
        losses: list[torch.Tensor] | None = [] if built["last"] else None
        _step(schedule, built, mbs, inputs, labels, losses, tokens)
        record: dict[str, Any] = {"step": step}
        if losses is not None:
            record["losses"] = [float(t.item()) for t in losses]
            record["loss"] = sum(record["losses"])
        if r.check:
            ref_losses, ref_flops = _reference_step(ref, mbs, tokens, count_flops)
            errors = _compare(parts, ref["model"], rtol=2e-4, atol=2e-5)
            actions = [a for s in stages for a in getattr(s, "actions", [])]
            record.update(ref_losses=ref_losses, grad_errors=errors, actions=actions)
            if count_flops:
                record.update(ref_backward_flops=ref_flops,
                              backward_flops=sum(a["flops"] - a["attention_flops"] for a in actions))
        dist_utils.clip_grad_norm_([p for m in parts for p in m.parameters()], max_norm, foreach=True,
                                   pp_mesh=pp_mesh, ep_enabled=parallel_dims.ep_enabled)
        built["optimizers"].step()
        built["schedulers"].step()
        if r.check:
            _reference_update(ref, max_norm)
        out["steps"].append(record)
        W.progress(f"{r.schedule} step {step + 1}/{r.steps}" + (f" loss {record['loss']:.4f}" if "loss" in record else ""))
    out["fallbacks"] = [dataclasses.asdict(f) for f in fxsplit.fallbacks()[fallbacks_before:]]
    return out


def rank_main(runs: tuple[TitanRun, ...], rank: int, ranks: int) -> list[dict[str, Any]]:
    """Every run of ``runs`` in this rank, one after the other (they share the process group
    and the compile caches); the results in order."""
    import fxsplit

    with fxsplit.config.patch(fallback="error"):
        return [_train(r, rank, ranks) for r in runs]


def schedule_step_failure() -> str | None:
    """Why torch's pipeline schedules cannot be stepped as torchtitan 0.3.0's trainer
    steps them (``None`` where they can): it passes ``loss_kwargs=`` to
    ``schedule.step``, which torch 2.13 and later take; an older ``step`` would
    treat it as a model input and fail cutting it into microbatches.
    Feature-detected, not version-compared."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    if all("loss_kwargs" in inspect.signature(c.step).parameters for c in (PipelineScheduleSingle, PipelineScheduleMulti)):
        return None
    return (f"torch {torch.__version__}'s schedule.step takes no loss_kwargs=, which torchtitan's trainer passes "
            "(torch 2.13 and later take it)")


def run(runs: TitanRun | tuple[TitanRun, ...], ranks: int = 2, timeout_s: float = 1800.0,
        on_progress: Any = None) -> list[list[dict[str, Any]]]:
    """``runs`` on ``ranks`` gloo CPU ranks (one intra-op thread each), with fxsplit's
    ``fallback="error"``: per rank, the result of each run. Raises ``RuntimeError``,
    before starting any rank, where :func:`schedule_step_failure` says this torch
    cannot step the schedules as the trainer does."""
    why = schedule_step_failure()
    if why is not None:
        raise RuntimeError(f"fxsplit.bench.titan: {why}")
    runs = (runs,) if isinstance(runs, TitanRun) else tuple(runs)
    return W.run_world(rank_main, runs, ranks, timeout_s=timeout_s, on_progress=on_progress,
                       preload=["torch", "torch.distributed.pipelining", "torch._inductor.compile_fx", "torchtitan",
                                "torchtitan.models.llama3", "fxsplit", "fxsplit.pipelining", __name__])


def _summary(results: list[dict[str, Any]]) -> list[str]:
    """What a run's ranks saw, as lines: per step the loss and the checks."""
    r0 = results[0]
    lines = [(f"torchtitan {r0['run']['config']} ({r0['layers']} layers), schedule {r0['run']['schedule']}, "
              f"compile backend {r0['run']['backend']}, {len(results)} ranks, torch {r0['torch']}")]
    for r in results:
        lines.append(f"rank {r['rank']}: stages {r['stages']} ({', '.join(r['stage_classes'])}), "
                     f"blocks per stage {r['blocks']}, fallbacks {len(r['fallbacks'])}")
    last = next(r for r in results if "losses" in r["steps"][0])
    for i, step in enumerate(last["steps"]):
        line = f"step {i + 1}: loss {step['loss']:.6f}"
        if "ref_losses" in step:
            line += f" (single process, {r0['run']['reference']} blocks: {sum(step['ref_losses']):.6f})"
            worst = max(max(r["steps"][i]["grad_errors"].values()) for r in results)

            acts: dict[str, list[int]] = {}
            for r in results:
                for a in r["steps"][i]["actions"]:
                    runs = acts.setdefault(a["kind"], [0, 0, 0, 0])
                    for j, k in enumerate(("di_runs", "dw_runs", "fused_runs")):
                        runs[j] += a[k]
                    runs[3] += 1
            line += f", gradients: largest relative error {worst:.1e}"
            if "backward_flops" in step:
                flops = sum(r["steps"][i]["backward_flops"] for r in results)
                line += f", backward FLOPs {flops / step['ref_backward_flops']:.4f} x single process"
            line += ("; " + ", ".join(f"{n} {k}: dI {v[0]} dW {v[1]} fused {v[2]}"
                                                      for k, v in sorted(acts.items()) for n in [v[3]]))
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m fxsplit.bench.titan``: one checked run, printed."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m fxsplit.bench.titan", description=(
        "Train torchtitan's model through its own pipeline builder on gloo CPU ranks, as its trainer does, "
        "and compare every step with a single-process run. Options after -- go to torchtitan's config parser."))
    p.add_argument("--config", default="llama3_debugmodel")
    p.add_argument("--schedule", default="ZBVZeroBubble", help="torchtitan's schedule name")
    p.add_argument("--backend", default="fxsplit", help="compile backend of the blocks; 'none': eager blocks")
    p.add_argument("--registry", choices=("fxsplit", "torchtitan"), default="fxsplit",
                   help="fxsplit: --module fxsplit.integrations.torchtitan; torchtitan: the model's own (torch's stages)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree (default: --ranks)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--local-batch", type=int, default=8)
    p.add_argument("--microbatch", type=int, default=2)
    p.add_argument("--layers", type=int, default=None, help="keep the first LAYERS blocks")
    p.add_argument("--ac", choices=("none", "config"), default="none",
                   help="activation checkpointing: none, or the config's")
    p.add_argument("--data", choices=("random", "stdlib"), default="random")
    p.add_argument("--no-check", action="store_true", help="no single-process reference")
    p.add_argument("--reference", default="eager",
                   help="the single-process run's blocks: eager, or a backend compiling each (inductor)")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    r = TitanRun(config=args.config, schedule=args.schedule, backend=None if args.backend == "none" else args.backend,
                 registry=args.registry, steps=args.steps, seq_len=args.seq_len, local_batch=args.local_batch,
                 microbatch=args.microbatch, layers=args.layers, ac=args.ac, data=args.data,
                 check=not args.no_check, reference=args.reference, pp=args.pp, extra=tuple(extra))
    print("torchtitan options: " + " ".join(cli_args(r, args.ranks)), flush=True)
    results = [rank[0] for rank in run(r, ranks=args.ranks)]
    print("\n".join(_summary(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
