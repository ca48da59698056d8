"""The command lines' argument parser (:mod:`fxsplit.cli`, :mod:`fxsplit.cli_pipeline`)."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineErrorParser", "add_device_options"]


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``<prog>: error: <message> (see <prog> --help)``, exit status 2."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_device_options(p: argparse.ArgumentParser, *, device_help: str, model_help: str) -> None:
    """``--device``, ``--dtype`` and ``--model``, which both benchmarks take with the same choices."""
    # imported here: the benchmark's models pull in torch.distributed.pipelining
    from fxsplit.bench.models import MODELS
    from fxsplit.bench.settings import DTYPES

    p.add_argument("--device", default=None, help=device_help)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default: bfloat16 on CUDA (float16 where the GPU lacks bf16), float32 on CPU")
    p.add_argument("--model", default="gpt", choices=sorted(MODELS), help=model_help)
