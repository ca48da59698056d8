"""The command lines' argument parser (:mod:`fxsplit.cli`, :mod:`fxsplit.cli_pipeline`)."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineErrorParser"]


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``<prog>: error: <message> (see <prog> --help)``, exit status 2."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
