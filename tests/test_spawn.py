"""The spawn harness itself: results come back in rank order, and a failing
rank ends the run with its traceback instead of leaving the others hanging."""

import pytest
import torch
import torch.distributed as dist

from pydist.spawn import RanksFailed, run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _rank1_raises_then_peer_waits(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.zeros(1))  # would block forever without fail-fast


def test_results_in_rank_order():
    assert run_ranks(_sum_ranks, 3, timeout=60) == [6.0, 6.0, 6.0]


def test_failing_rank_fails_fast():
    with pytest.raises(RanksFailed, match="boom on rank 1"):
        run_ranks(_rank1_raises_then_peer_waits, 2, timeout=60)
