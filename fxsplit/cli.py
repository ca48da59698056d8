"""Command line: ``fxsplit bench [options]`` (also ``python -m fxsplit bench``).

``bench`` runs the compiled-vs-eager benchmark of the split backward
(:mod:`fxsplit.bench.run`); ``fxsplit bench --help`` lists its options.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["OneLineErrorParser", "main"]

class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``<prog>: error: <message> (see <prog> --help)``, exit status 2."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_COMMANDS = {"bench": "time, FLOPs and memory of the backward in six modes (eager / inductor / fxsplit, "
                      "ordinary and split), accumulation, memory per stage layout, compile time"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fxsplit <command> ...``; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineErrorParser(prog="fxsplit", description="fxsplit command line")
    parser.add_argument("command", choices=sorted(_COMMANDS),
                        help="; ".join(f"{k}: {v}" for k, v in _COMMANDS.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options of the command (see fxsplit <command> -h)")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    ns = parser.parse_args(argv[:1])
    if ns.command == "bench":
        # imported here: the benchmark pulls in torch.distributed.pipelining and the models
        from fxsplit.bench.run import main as bench_main

        return bench_main(argv[1:], prog="fxsplit bench")
    raise AssertionError(ns.command)  # argparse rejected anything else


if __name__ == "__main__":
    sys.exit(main())
