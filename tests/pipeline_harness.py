"""Plain pipelines (CPU, gloo, 2 ranks): the cases of :mod:`multirank` without a mesh.

Each case builds the same small transformer in every rank (same seed), in
one of two layouts (``Case.layout``): ``"float"``, every stage compiled as a
whole in place, float inputs and an MSE loss; ``"lm"``, a language model:
stage 0 takes token ids through an eager ``nn.Embedding`` (its inputs need
no gradient), every stage's blocks are compiled in place, and the last
stage has an eager head (LayerNorm, Linear to the vocabulary) under a
cross-entropy loss; ``"fn"``, uncompiled stages of custom autograd Functions
(:class:`zoo.FunctionStage`: nodes whose one backward call computes every
gradient), float inputs and an MSE loss. :func:`run_case` runs two optimizer steps of an upstream
schedule (or a generated one) over fxsplit ``PipelineStage`` s through
:func:`multirank.drive`, which checks every microbatch loss and every
parameter gradient against a single-process non-pipelined eager reference.
It returns, per backward action, the fxsplit region counters and FLOPs
measured around it, and the FLOP yardsticks the tests compare them with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import multirank
import zoo
from fxsplit.bench import world as W

D_MODEL = 16
N_HEADS = 2
N_BLOCKS = 4
MB_BATCH = 2  # samples per microbatch
SEQ = 6  # tokens per sample; MB_BATCH * SEQ = 12 differs from every weight dimension
N_MICROBATCHES = 4
N_STEPS = 2
LR = 0.1
VOCAB = 24  # "lm" layout

SCHEDULES = multirank.SCHEDULES
V_SCHEDULES = W.V_SCHEDULES
RUNNABLE_SCHEDULES = multirank.RUNNABLE_SCHEDULES
upstream_schedule_failure = multirank.upstream_schedule_failure


def stage_module(n_blocks: int, last: bool) -> zoo.BlockStage:
    """A ``"float"`` stage: ``n_blocks`` blocks, and (last) the head."""
    return zoo.BlockStage(n_blocks, D_MODEL, N_HEADS, last)


def build_reference(n_stages: int, layout: str = "float") -> list[nn.Module]:
    torch.manual_seed(0)
    per = N_BLOCKS // n_stages
    if layout == "lm":
        return [zoo.LMStage(per, D_MODEL, N_HEADS, VOCAB, first=(s == 0), last=(s == n_stages - 1))
                for s in range(n_stages)]
    if layout == "fn":
        return [zoo.FunctionStage(D_MODEL, last=(s == n_stages - 1)) for s in range(n_stages)]
    return [stage_module(per, last=(s == n_stages - 1)) for s in range(n_stages)]


def compile_stage(module: nn.Module, layout: str, backend: Any) -> None:
    """In place (the schedules refuse OptimizedModule): the whole stage, or (``"lm"``) its
    body; ``"fn"`` stages stay eager."""
    if layout != "fn":
        (module.body if layout == "lm" else module).compile(backend=backend)


def make_data(step: int, layout: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = MB_BATCH * N_MICROBATCHES
    if layout == "lm":
        return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return torch.randn(n, SEQ, D_MODEL, generator=g), torch.randn(n, SEQ, D_MODEL, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def lm_loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def loss_for(layout: str) -> Any:
    return lm_loss_fn if layout == "lm" else loss_fn


def weight_grad_flops(module: nn.Module) -> int:
    """FLOPs of the weight-gradient matmuls of every Linear for one microbatch (2*T*in*out each)."""
    tokens = MB_BATCH * SEQ
    return sum(2 * tokens * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


@dataclasses.dataclass
class Case:
    schedule: str
    compiler: str = "eager"
    fused_backward: bool = True
    layout: str = "float"  # or "lm", "fn" (see the module docs)
    # schedule "generated": a fxsplit.schedules.GeneratedSchedule, run by its build()
    generated: Any = None

    @property
    def key(self) -> str:
        return self.schedule if self.layout == "float" else f"{self.schedule}:{self.layout}"


def _reference_step(stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor, layout: str = "float") -> list[float]:
    """Non-pipelined eager reference: per-microbatch losses, grads scaled as the schedule does."""
    losses = []
    for xm, ym in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)):
        h = xm
        for s in stages:
            h = s(h)
        loss = loss_for(layout)(h, ym)
        loss.backward()
        losses.append(loss.detach())
    for s in stages:
        for p in s.parameters():
            p.grad.div_(N_MICROBATCHES)
    return [float(v) for v in losses]


def reference_backward_flops(module: nn.Module, first: bool, last: bool, layout: str = "float") -> tuple[int, int]:
    """(input-gradient-only, full) backward FLOPs of one microbatch through the eager ``module``.

    Eager ``autograd.grad`` w.r.t. the input alone skips every weight-gradient
    matmul, so the first number is what B may cost and no more (0 for the
    first stage, whose input needs no gradient).
    """
    if layout == "lm" and first:
        x = torch.randint(0, VOCAB, (MB_BATCH, SEQ))
    else:
        x = torch.randn(MB_BATCH, SEQ, D_MODEL, requires_grad=not first)
    params = list(module.parameters())

    def outputs() -> tuple[torch.Tensor, torch.Tensor | None]:
        out = module(x)
        if last and layout == "lm":
            return lm_loss_fn(out, torch.zeros(out.shape[:-1], dtype=torch.long)), None
        if last:
            return loss_fn(out, torch.zeros_like(out)), None
        return out, torch.ones_like(out)

    input_only = 0
    if not first:
        out, g = outputs()
        with W.MatmulCounter() as c:
            torch.autograd.grad(out, [x], g)
        input_only = c.total
    out, g = outputs()
    with W.MatmulCounter() as c:
        torch.autograd.grad(out, ([] if first else [x]) + params, g)
    return input_only, c.total


def run_case(case: Case, rank: int, world: int) -> dict[str, Any]:
    """One case in one rank (module docstring); returns what the tests check."""
    import fxsplit

    torch._dynamo.reset()
    stage_ids, n_stages = W.stage_ids(case.schedule, rank, world, case.generated)
    reference = build_reference(n_stages, case.layout)
    modules = multirank.deep_copies(reference, stage_ids)
    backend = fxsplit.backend(compiler=case.compiler, fused_backward=case.fused_backward)
    for m in modules.values():
        compile_stage(m, case.layout, backend)

    def step_data(step: int) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        x, y = make_data(step, case.layout)
        return x, y, _reference_step(reference, x, y, case.layout)

    out = multirank.drive(multirank.Run(
        name=f"{case.key} rank {rank}", schedule=case.schedule, generated=case.generated, stage_ids=stage_ids,
        n_stages=n_stages, modules=modules, reference=reference, step_data=step_data,
        loss_fn=loss_for(case.layout), microbatches=N_MICROBATCHES, steps=N_STEPS, lr=LR))
    return {
        **out,  # losses, grads_checked, actions (of the last step: the first also compiles)
        "schedule": case.schedule,
        "layout": case.layout,
        "key": case.key,
        "rank": rank,
        "stages": stage_ids,
        "n_stages": n_stages,
        "weight_grad_flops": {s: weight_grad_flops(m) for s, m in modules.items()},
        "reference_flops": {
            s: reference_backward_flops(reference[s], s == 0, s == n_stages - 1, case.layout) for s in stage_ids
        },
    }


def run_world(cases: list[Any], world: int = 2, timeout_s: float = 240.0,
              runner: Any = None) -> list[list[dict[str, Any]]]:
    """``runner`` (default :func:`run_case`) for every case in each of ``world`` ranks."""
    return multirank.run_world(cases, world, runner or run_case, timeout_s=timeout_s)
