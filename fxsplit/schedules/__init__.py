"""Pipeline schedules as data: simulate any action order, generate one from measured costs.

* :class:`StageCosts` / :class:`PipelineCosts`: what one microbatch costs on
  each stage (``F``, ``I``, ``W``, full backward, the hand-over to the next
  rank, the memory it holds).
* :func:`simulate`: replay an action order in ``torch.distributed.pipelining``'s
  IR (a schedule's ``pipeline_order``, or the lowered order with sends and
  receives that ``_PipelineScheduleRuntime`` executes) with those costs: the
  step time, each rank's bubble and peak memory.
* :func:`upstream_order`: the order of one of upstream's schedule classes for
  given sizes, computed by the class itself without a model or process group.
* :func:`generate_schedule`: a zero-bubble order built for the measured costs
  within a memory limit, which upstream's ``_PipelineScheduleRuntime`` runs
  unchanged (:meth:`GeneratedSchedule.build`, or its CSV,
  :meth:`GeneratedSchedule.to_csv`).

Nothing here needs a process group; only :meth:`GeneratedSchedule.build` takes
real ``PipelineStage`` s.
"""

from fxsplit.schedules.costs import PipelineCosts, StageCosts
from fxsplit.schedules.generate import Candidate, GeneratedSchedule, generate_schedule, greedy_order
from fxsplit.schedules.orders import (
    PLACEMENTS, UPSTREAM_SCHEDULES, action, lower, one_f_one_b_order, stage_to_rank, upstream_order,
    upstream_stage_to_rank,
)
from fxsplit.schedules.simulate import ScheduleError, Simulation, TimedAction, simulate

__all__ = [
    "PLACEMENTS", "UPSTREAM_SCHEDULES", "Candidate", "GeneratedSchedule", "PipelineCosts", "ScheduleError",
    "Simulation", "StageCosts", "TimedAction", "action", "generate_schedule", "greedy_order", "lower",
    "one_f_one_b_order", "simulate", "stage_to_rank", "upstream_order", "upstream_stage_to_rank",
]
