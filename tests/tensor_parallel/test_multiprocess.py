"""The multi-process harness (`bench.harness.ranks`): results in rank order, a rank's exception re-raised
with its traceback, a hung rank killed at the deadline, and each rank's collectives logged."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from bench.harness import ranks
from bench.harness.ranks import RankFailed, collective_log, collectives, run_ranks


def _work(rank, world_size):
    if rank == 1:
        raise KeyError("rank one's own failure")
    t = torch.full((3,), float(rank))
    with collectives() as log:
        dist.all_reduce(t)  # rank 1 never joins: rank 0 waits here until the harness kills it
    return log, collective_log()


def _log_and_sum(rank, world_size):
    t = torch.full((2, 3), float(rank + 1))
    with collectives() as log:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = torch.empty(world_size * 2, 3)
        dist.all_gather_into_tensor(out, t)
    return log, t, out


def _sleep(rank, world_size):
    time.sleep(60)


def _one_waits(rank, world_size):
    if rank == 0:
        dist.barrier()  # rank 1 is still computing: rank 0 waits here
    time.sleep(60)


def test_results_in_rank_order_and_collectives_logged():
    results = run_ranks(_log_and_sum, 2, timeout_s=60)
    (log0, t0, out0), (log1, t1, out1) = results
    assert torch.equal(t0, torch.full((2, 3), 2.0)) and torch.equal(out1, torch.full((4, 3), 2.0))
    assert log0 == log1
    assert [entry[0] for entry in log0] == ["all_reduce", "all_gather_into_tensor"]  # logged once, not per alias
    assert log0[0] == ("all_reduce", (((2, 3), "float32"),), str(dist.ReduceOp.MAX), 2)


def test_a_rank_exception_is_reraised_with_its_traceback():
    with pytest.raises(RankFailed) as info:
        run_ranks(_work, 2, timeout_s=60, grace_s=1)
    text = str(info.value)
    assert "rank 1 of 2 failed" in text and "KeyError" in text and "rank one's own failure" in text
    assert "_work" in text  # the rank's traceback, not only the exception


def test_a_hung_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"did not finish within 3 s on a quiet machine") as info:
        run_ranks(_sleep, 2, timeout_s=3)
    assert time.monotonic() - start < 20
    # What it cannot tell, it says so: no rank was in a collective.
    assert "rank 0: no torch.distributed collective yet" in str(info.value)
    assert "no rank waits in a torch.distributed collective: slow computing, or a hang" in str(info.value)


def test_the_deadline_says_which_rank_waits_in_which_collective():
    with pytest.raises(RankFailed) as info:
        run_ranks(_one_waits, 2, timeout_s=8)
    text = str(info.value)
    assert "rank 0: inside barrier (collective #1)" in text, text
    assert "rank 1: no torch.distributed collective yet" in text
    assert "ranks [0] wait in a collective ranks [1] have not reached" in text
    assert "rank 1's stack (innermost first): File" in text and "in _one_waits" in text


def test_the_deadline_follows_the_load(monkeypatch):
    # Twice as many runnable processes as CPUs: each second of waiting counts half.
    monkeypatch.setattr(ranks.os, "getloadavg", lambda: (2.0 * os.cpu_count(), 0.0, 0.0))
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"within 3 s on a quiet machine \((\d+) s waited, load up to 2.0 x"):
        run_ranks(_sleep, 2, timeout_s=3)
    assert time.monotonic() - start >= 6
    monkeypatch.setenv("DEADLINE_SCALE", "2")
    monkeypatch.setattr(ranks.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    with pytest.raises(RankFailed, match=r"within 6 s on a quiet machine"):
        run_ranks(_sleep, 2, timeout_s=3)
