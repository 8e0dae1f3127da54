"""The spawn harness itself: results come back in rank order, a failing
rank ends the run with its traceback instead of leaving the others hanging,
under both start methods, and a forkserver's rank runs in the caller's
environment of its own call (see [Note: ranks from a forkserver])."""

import os

import pytest
import torch
import torch.distributed as dist

from pydist.spawn import RanksFailed, run_ranks

METHODS = pytest.mark.parametrize("method", ["spawn", "forkserver"])


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _rank1_raises_then_peer_waits(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.zeros(1))  # would block forever without fail-fast


def _environment_value(rank, world_size, name):
    return os.environ.get(name)


@METHODS
def test_results_in_rank_order(method):
    assert run_ranks(_sum_ranks, 3, timeout=60, start_method=method) == [6.0, 6.0, 6.0]


@METHODS
def test_failing_rank_fails_fast(method):
    with pytest.raises(RanksFailed, match="boom on rank 1"):
        run_ranks(_rank1_raises_then_peer_waits, 2, timeout=60, start_method=method)


def test_a_forkservers_ranks_get_the_callers_environment_of_each_call(monkeypatch):
    # The server keeps the environment it started with; three calls with
    # three environments cannot all match it unless each call hands its own.
    name = "PYDIST_TEST_SPAWN_VALUE"
    for value in ("first", "second", None):
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
        assert run_ranks(_environment_value, 2, args=(name,), timeout=60, start_method="forkserver") == [value] * 2


def test_an_unknown_start_method_is_refused_naming_it():
    with pytest.raises(ValueError, match="'fork'"):
        run_ranks(_sum_ranks, 2, start_method="fork")
