"""What the developer scripts share: a benchmark model compiled with fxsplit."""

from __future__ import annotations

import torch

from fxsplit.bench.models import Stage, build
from fxsplit.bench.run import _DTYPES, build_parser, settings_from_args


def fxsplit_stage(model: str) -> tuple[Stage, torch.nn.Module, list[torch.Tensor]]:
    """The ``fxsplit bench`` stage of ``model`` at its default CPU sizes and dtype
    (seeded), its module compiled in place with ``backend="fxsplit"``, and the
    parameters that require grad."""
    settings = settings_from_args(build_parser().parse_args(["--device", "cpu", "--model", model, "--no-chart"]))
    torch.manual_seed(0)
    stage = build(settings.model, "cpu", _DTYPES[settings.dtype])
    module = stage.module
    module.compile(backend="fxsplit")
    return stage, module, [q for q in module.parameters() if q.requires_grad]
