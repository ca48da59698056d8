"""What the developer scripts share: a benchmark model compiled with fxsplit."""

from __future__ import annotations

import torch

from fxsplit.bench.models import Stage, build
from fxsplit.bench.settings import DTYPES, settings_from_args
from fxsplit.cli import build_bench_parser


def fxsplit_stage(model: str) -> tuple[Stage, torch.nn.Module, list[torch.Tensor]]:
    """The ``fxsplit bench`` stage of ``model`` at its default CPU sizes and dtype
    (seeded), its module compiled in place with ``backend="fxsplit"``, and the
    parameters that require grad."""
    parser = build_bench_parser()
    settings = settings_from_args(parser.parse_args(["--device", "cpu", "--model", model, "--no-chart"]), parser)
    torch.manual_seed(0)
    stage = build(settings.model, "cpu", DTYPES[settings.dtype])
    module = stage.module
    module.compile(backend="fxsplit")
    return stage, module, [q for q in module.parameters() if q.requires_grad]
