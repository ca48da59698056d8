"""The multi-rank driver's process world (:mod:`fxsplit.bench.world`): results by rank,
progress from rank 0, and a failing rank's traceback raised in the parent."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import multirank  # noqa: E402
from fxsplit.bench import world as W  # noqa: E402


def _ranks_report(payload: str, rank: int, ranks: int) -> tuple[str, int, int, int]:
    import torch.distributed as dist

    W.progress(f"rank {rank} says hello")
    return payload, rank, ranks, dist.get_world_size()


def _rank_one_fails(payload: str, rank: int, ranks: int) -> int:
    if rank == 1:
        raise ValueError(f"{payload} on rank {rank}")
    return rank


def test_world_returns_each_ranks_result_and_rank_zeros_progress() -> None:
    heard: list[str] = []
    got = W.run_world(_ranks_report, "x", 2, timeout_s=120, preload=multirank.PRELOAD, on_progress=heard.append)
    assert got == [("x", 0, 2, 2), ("x", 1, 2, 2)]
    assert heard == ["rank 0 says hello"]  # the other ranks' progress is dropped


def test_a_failing_rank_raises_its_traceback_in_the_parent() -> None:
    with pytest.raises(W.WorldFailed, match=r"rank 1 failed:[\s\S]*ValueError: boom on rank 1"):
        W.run_world(_rank_one_fails, "boom", 2, timeout_s=120, preload=multirank.PRELOAD)


def _both_ranks_fail(payload: str, rank: int, ranks: int) -> int:
    import time

    if rank == 0:
        time.sleep(0.5)  # (rank 1's error reaches the parent first)
        raise ConnectionError(f"{payload}: rank 0 saw its peer go away")
    raise ValueError(f"{payload}: the cause, on rank 1")


def test_a_world_failure_carries_every_rank_error_that_follows_the_first() -> None:
    with pytest.raises(W.WorldFailed) as e:
        W.run_world(_both_ranks_fail, "boom", 2, timeout_s=120, preload=multirank.PRELOAD)
    message = str(e.value)
    assert "ValueError: boom: the cause, on rank 1" in message
    assert "rank 0 failed too:" in message and "ConnectionError: boom: rank 0 saw its peer go away" in message
    assert message.index("rank 1 failed:") < message.index("rank 0 failed too:")
    assert message.splitlines()[0] == (
        "rank 1: ValueError: boom: the cause, on rank 1; rank 0: ConnectionError: boom: rank 0 saw its peer go away")
