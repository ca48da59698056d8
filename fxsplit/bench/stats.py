"""The one way fxsplit's benchmarks summarise repeated measurements.

Every timed figure is a median with its interquartile range, the quartiles taken
by one rule (``statistics.quantiles(..., method="inclusive")``: linear
interpolation, numpy's default). A ratio of two modes measured round by round
(round k of each run back to back) is summarised twice: as the ratio of the
two medians and as the median of the per-round ratios (:func:`paired_ratios`).
Both estimate the same thing, so their disagreement, like a mode's own spread,
says how far a figure can be trusted (:mod:`fxsplit.bench.targets` uses both).
``fxsplit bench``, ``fxsplit bench --pipeline`` and every script in
``benchmarks/`` take their figures from here.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

__all__ = ["Spread", "paired_ratios", "spread"]


@dataclasses.dataclass(frozen=True)
class Spread:
    """``n`` values summarised: median, quartiles, range."""

    n: int
    median: float
    q25: float
    q75: float
    min: float
    max: float

    @property
    def iqr(self) -> float:
        return self.q75 - self.q25

    @property
    def relative_iqr(self) -> float:
        """The interquartile range as a share of the median (``inf`` for a median of 0)."""
        return self.iqr / abs(self.median) if self.median else float("inf")

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)

    def format(self, digits: int = 3) -> str:
        """``"median (q25-q75)"``."""
        return f"{self.median:.{digits}f} ({self.q25:.{digits}f}-{self.q75:.{digits}f})"


def spread(values: Sequence[float]) -> Spread:
    """The median, quartiles and range of ``values``. Raises ``ValueError`` if there are none."""
    v = sorted(values)
    if not v:
        raise ValueError("spread() needs at least one value")
    q25, med, q75 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0],) * 3
    return Spread(len(v), med, q25, q75, v[0], v[-1])


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Round-by-round ratios of two modes' times (round k of each ran back to back), over
    the rounds both ran."""
    return [a / b for a, b in zip(numerator, denominator)]
