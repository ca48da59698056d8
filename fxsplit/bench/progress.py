"""Progress of the benchmark's long phases, on stderr (stdout keeps the table)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Progress of the long phases, on stderr (stdout keeps the table).

    A line when a phase starts and when it ends (with its duration); while a
    phase runs, a line every ``heartbeat_s`` (a compile is one long call with
    nothing to count); while timing, the rounds done, at most every
    ``every_s``.
    """

    def __init__(self, stream: TextIO | None = None, heartbeat_s: float = 15.0, every_s: float = 5.0) -> None:
        self.stream = stream
        self.heartbeat_s = heartbeat_s
        self.every_s = every_s
        self._last = 0.0

    def say(self, message: str) -> None:
        stream = self.stream or sys.stderr
        print(f"[fxsplit bench] {message}", file=stream, flush=True)

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        self.say(f"{what} ...")
        t0 = time.perf_counter()
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(self.heartbeat_s):
                self.say(f"{what}: still running, {time.perf_counter() - t0:.0f} s")

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        try:
            yield
        finally:
            done.set()
            beat.join()
        self.say(f"{what}: done in {time.perf_counter() - t0:.1f} s")

    def count(self, what: str, done: int, total: int, t0: float) -> None:
        now = time.perf_counter()
        if done == total or now - self._last >= self.every_s:
            self._last = now
            self.say(f"{what}: {done}/{total}, {now - t0:.0f} s")
