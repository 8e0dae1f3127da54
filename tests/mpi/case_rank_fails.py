"""Not collected by `pytest tests/mpi` (the name does not start with test_):
tests/test_mpi_launch.py runs it under mpiexec to check that a failing rank
aborts the job. Rank 1 fails; rank 0 meanwhile waits in a collective that
rank 1 never joins, which would block until the group's 60 s timeout."""

import torch
import torch.distributed as dist


def test_rank_one_fails(world):
    if world.rank == 1:
        raise AssertionError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))
