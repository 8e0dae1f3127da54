"""The MPI rendezvous end to end: ranks and sizes agree with MPI itself."""

import torch
import torch.distributed as dist
from mpi4py import MPI

import pydist
from pydist.backends.mpi4py_backend import MPI4PyProcessGroup


def test_world_matches_mpi(world):
    comm = MPI.COMM_WORLD
    assert (world.rank, world.world_size) == (comm.Get_rank(), comm.Get_size())
    assert world.launcher in ("openmpi", "pmix", "mpich")
    assert world.backend == "mpi4py"
    assert isinstance(dist.group.WORLD, MPI4PyProcessGroup)


def test_detect_agrees_with_init(world):
    info = pydist.rendezvous.detect()
    assert info.uses_mpi and info.rank == world.rank and info.local_rank == world.local_rank


def test_every_rank_sees_every_rank(world):
    ranks = MPI.COMM_WORLD.allgather(world.rank)
    assert ranks == list(range(world.world_size))
    t = torch.tensor([float(world.rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(world.world_size))
