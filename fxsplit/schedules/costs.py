"""What one microbatch costs on each pipeline stage: the input of the simulator and the generator.

Times are in any one unit (the benchmark uses milliseconds), memory in bytes.
A stage's costs are per microbatch and independent of the schedule; what a
schedule changes is only when each action runs and what it holds meanwhile.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

__all__ = ["PipelineCosts", "StageCosts"]


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per-microbatch costs of one stage.

    * ``f``, ``i``, ``w``: the forward, the input-gradient backward (``I``, fxsplit's
      dI) and the weight-gradient backward (``W``, dW).
    * ``b``: the full backward (``B``: one action doing I and W; fxsplit's fused
      graph); ``None`` means ``i + w``.
    * ``comm``: the latency of handing this stage's output to the next stage when
      that stage is on another rank (the gradient coming back is the same size and
      is charged the same); 0 between stages on one rank.
    * ``activation_bytes``: held from the microbatch's ``F`` until its ``I`` (or
      ``B``) on this stage; ``live_in_bytes``: held from ``I`` until ``W`` (for
      fxsplit, ``SplitResult.live_in_bytes_expr`` at the microbatch's sizes).
    """

    f: float
    i: float
    w: float
    b: float | None = None
    comm: float = 0.0
    activation_bytes: int = 0
    live_in_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("f", "i", "w", "b", "comm", "activation_bytes", "live_in_bytes"):
            v = getattr(self, name)
            if v is not None and not v >= 0:  # also refuses NaN
                raise ValueError(f"StageCosts.{name} must be a number >= 0, got {v!r}")

    @property
    def full_backward(self) -> float:
        """``b``, or ``i + w`` where no full backward was measured."""
        return self.i + self.w if self.b is None else self.b


@dataclasses.dataclass(frozen=True)
class PipelineCosts:
    """Costs of every stage, indexed by stage (stage 0 takes the batch, the last one computes the loss)."""

    stages: tuple[StageCosts, ...]

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("PipelineCosts needs at least one stage")
        object.__setattr__(self, "stages", tuple(self.stages))

    def __len__(self) -> int:
        return len(self.stages)

    def __getitem__(self, stage: int) -> StageCosts:
        return self.stages[stage]

    @classmethod
    def uniform(cls, n_stages: int, f: float, i: float, w: float, b: float | None = None, comm: float = 0.0,
                activation_bytes: int = 0, live_in_bytes: int = 0) -> PipelineCosts:
        """``n_stages`` stages with the same costs."""
        one = StageCosts(f, i, w, b, comm, activation_bytes, live_in_bytes)
        return cls((one,) * n_stages)

    def extended_to(self, n_stages: int) -> PipelineCosts:
        """The same model cut into ``n_stages`` stages of the measured kind: the first
        and last stages as measured, every stage between them the median of the
        measured middle stages (or, with fewer than three measured, of them all).
        What extrapolating measured costs to a deeper pipeline assumes: more stages
        of the same size, not the same model cut finer."""
        if n_stages < 2 or len(self) < 2:
            raise ValueError(f"extended_to needs at least 2 stages measured and asked for, got {len(self)} -> {n_stages}")
        middle = self.stages[1:-1] or self.stages
        mid = StageCosts(
            f=statistics.median(s.f for s in middle), i=statistics.median(s.i for s in middle),
            w=statistics.median(s.w for s in middle), b=statistics.median(s.full_backward for s in middle),
            comm=statistics.median(s.comm for s in middle),
            activation_bytes=int(statistics.median(s.activation_bytes for s in middle)),
            live_in_bytes=int(statistics.median(s.live_in_bytes for s in middle)),
        )
        return PipelineCosts((self.stages[0], *([mid] * (n_stages - 2)), self.stages[-1]))

    def merged(self, group: int) -> PipelineCosts:
        """Every ``group`` consecutive stages as one stage (e.g. the costs of a
        one-stage-per-rank schedule from the costs of the two-stage-per-rank cut of
        the same model): times and bytes add up, the hand-over is the last one's."""
        if group < 1 or len(self) % group:
            raise ValueError(f"cannot merge {len(self)} stages in groups of {group}")
        out = []
        for k in range(0, len(self), group):
            part: Sequence[StageCosts] = self.stages[k:k + group]
            out.append(StageCosts(
                f=sum(s.f for s in part), i=sum(s.i for s in part), w=sum(s.w for s in part),
                b=sum(s.full_backward for s in part), comm=part[-1].comm,
                activation_bytes=sum(s.activation_bytes for s in part),
                live_in_bytes=sum(s.live_in_bytes for s in part),
            ))
        return PipelineCosts(tuple(out))
