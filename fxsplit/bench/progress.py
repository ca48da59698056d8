"""Progress of a benchmark run, on stderr (stdout keeps the table).

On a terminal: one progress bar for the whole run (tqdm), saying what is being
measured, how far the run is and about how long is left; notes (the stage, a
baseline that cannot run) print above it. Elsewhere (a log file, CI, a test
capturing stderr): one line when a phase starts and when it ends, and while
counting, the count at most every ``every_s`` seconds. No heartbeat either way.

The run declares its sections up front (:meth:`Progress.plan`); a phase or a
count belongs to the current section, and the bar's position is the sections
done plus the current one's share (a count's done / total). The time left is
tqdm's estimate from that position: rough where sections differ in length.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

__all__ = ["Progress"]

_PREFIX = "[fxsplit bench]"


class Progress:
    """Progress of the long phases, on stderr (the module's docstring).

    ``bar``: ``None`` draws the bar when the stream is a terminal; ``True`` or
    ``False`` force it on or off."""

    def __init__(self, stream: TextIO | None = None, every_s: float = 5.0, bar: bool | None = None) -> None:
        self.stream = stream
        self.every_s = every_s
        self._bar_wanted = bar
        self._bar: Any = None
        self._sections: list[str] = []
        self._section = -1
        self._last = 0.0

    @property
    def _out(self) -> TextIO:
        return self.stream or sys.stderr

    def plan(self, sections: Sequence[str]) -> None:
        """The run's sections, in order: each :meth:`section` call moves to the next."""
        self._sections, self._section = list(sections), -1
        wanted = self._bar_wanted if self._bar_wanted is not None else self._out.isatty()
        if wanted and sections:
            from tqdm import tqdm

            self._bar = tqdm(total=len(sections), file=self._out, unit="section", dynamic_ncols=True,
                             bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed} elapsed, ~{remaining} left")

    def section(self, name: str) -> None:
        """Start the next declared section (``name`` is shown; it need not be the declared one)."""
        self._section += 1
        self._advance(0.0, name)

    def close(self) -> None:
        """End the bar (the table follows)."""
        if self._bar is not None:
            self._advance(1.0, "done")
            self._bar.close()
            self._bar = None

    def _advance(self, fraction: float, what: str) -> None:
        if self._bar is None:
            return
        done = max(self._section, 0) + min(max(fraction, 0.0), 1.0)
        self._bar.n = min(done, len(self._sections))
        self._bar.set_description_str(f"{_PREFIX} {what}", refresh=False)
        self._bar.refresh()

    def say(self, message: str) -> None:
        """A note: above the bar, or a line of its own."""
        line = f"{_PREFIX} {message}"
        if self._bar is not None:
            self._bar.write(line, file=self._out)
        else:
            print(line, file=self._out, flush=True)

    def step(self, what: str) -> None:
        """A step inside the current phase: the bar's text, or a line of its own."""
        if self._bar is not None:
            self._advance(self._bar.n - max(self._section, 0), what)
        else:
            self.say(what)

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """One long step (a compile: nothing to count inside it)."""
        t0 = time.perf_counter()
        if self._bar is not None:
            self._advance(0.0, what)
        else:
            self.say(f"{what} ...")
        yield
        if self._bar is None:
            self.say(f"{what}: done in {time.perf_counter() - t0:.1f} s")

    def count(self, what: str, done: int, total: int, t0: float) -> None:
        """``done`` of ``total`` in the current section, begun at ``t0`` (``time.perf_counter``)."""
        if self._bar is not None:
            self._advance(done / total if total else 1.0, f"{what}: {done}/{total}")
            return
        now = time.perf_counter()
        if done == total or now - self._last >= self.every_s:
            self._last = now
            self.say(f"{what}: {done}/{total}, {now - t0:.0f} s")
