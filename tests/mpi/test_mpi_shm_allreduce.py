"""The mpi4py group's on-node all-reduces through the shared-memory transport
([Note: on-node all-reduces go through shared memory]): sizes around the
threshold and the transport's piece boundaries, SUM and AVG, against exact
answers (integer-valued data, rtol=0, atol=0), every rank's result bitwise
identical, and a counter that proves the path was taken; integer dtypes and
other ops stay on MPI."""

import pytest
import torch
import torch.distributed as dist

from pydist.backends.mpi4py_backend import SHM_MIN_BYTES, MPI4PyProcessGroup

R = dist.ReduceOp
MIN = SHM_MIN_BYTES
CHUNK = 1 << 20  # the transport's piece (kShmPieceBytes in csrc/transport/shm_transport.h)
SHM_DTYPES = (torch.float32, torch.float64)  # as staged; bf16/fp16 are reduced as their float32 copy


def contribution(rank, n, dtype):
    """Rank r holds (i % 13) + r + 1: small integers, exact in every dtype and sum."""
    return (torch.arange(n) % 13 + rank + 1).to(dtype)


def numels(dtype):
    """Element counts just at the threshold, over it by an odd amount, ending one
    element past a chunk, and not divisible by the rank count or the chunk."""
    size = torch.empty((), dtype=dtype).element_size()
    at, chunk = MIN // size, CHUNK // size
    return [at, at + 1, at + chunk + 1, at + 3 * chunk + 7, at + chunk - 1]


@pytest.fixture
def group(world):
    g = dist.group.WORLD
    assert isinstance(g, MPI4PyProcessGroup)
    if not g.shm_possible_:
        pytest.skip("ranks are not all on one node")
    return g


def gather_all(world, t):
    """Every rank's result, to check they agree bitwise."""
    out = [torch.empty_like(t) for _ in range(world.world_size)]
    dist.all_gather(out, t)
    return out


@pytest.mark.parametrize("dtype", SHM_DTYPES, ids=str)
def test_shm_sum_exact_and_identical(world, group, dtype):
    for n in numels(dtype):
        before = group.shm_calls_
        t = contribution(world.rank, n, dtype)
        dist.all_reduce(t)
        assert group.shm_calls_ == before + 1, f"{n} {dtype}: shared-memory path not taken"
        expected = sum(contribution(r, n, torch.float64) for r in range(world.world_size)).to(dtype)
        torch.testing.assert_close(t, expected, rtol=0, atol=0)
        for r, other in enumerate(gather_all(world, t)):
            assert torch.equal(other, t), f"rank {r} differs from rank {world.rank} at {n} {dtype}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_shm_avg(world, group, dtype):
    n = MIN // 4 + CHUNK // 4 + 3  # float32 bytes: bf16 is reduced as its float32 copy
    before = group.shm_calls_
    t = torch.full((n,), float(2 * (world.rank + 1)), dtype=dtype)
    dist.all_reduce(t, op=R.AVG)
    assert group.shm_calls_ == before + 1
    torch.testing.assert_close(t, torch.full((n,), float(world.world_size + 1), dtype=dtype), rtol=0, atol=0)


def test_shm_matches_mpi_path_bitwise(world, group):
    """Non-integer data: the shared-memory sum equals MPICH's own (the
    reference a 2-rank SUM reduces in either order, bitwise the same)."""
    from mpi4py import MPI

    n = MIN // 4 + 12345
    t = torch.randn(n, generator=torch.Generator().manual_seed(world.rank), dtype=torch.float32)
    ref = t.clone()
    group.comm_.Allreduce(MPI.IN_PLACE, ref.numpy(), MPI.SUM)
    dist.all_reduce(t)
    if world.world_size == 2:
        assert torch.equal(t, ref)
    for other in gather_all(world, t):
        assert torch.equal(other, t)


def test_below_threshold_and_other_ops_take_the_mpi_path(world, group):
    calls = group.shm_calls_
    small = contribution(world.rank, MIN // 4 - 1, torch.float32)
    dist.all_reduce(small)
    big = contribution(world.rank, MIN // 4 + 1, torch.float32)
    dist.all_reduce(big, op=R.MAX)
    assert group.shm_calls_ == calls
    torch.testing.assert_close(small, sum(contribution(r, MIN // 4 - 1, torch.float32) for r in range(world.world_size)), rtol=0, atol=0)
    torch.testing.assert_close(big, contribution(world.world_size - 1, MIN // 4 + 1, torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_integer_dtypes_take_the_mpi_path_exactly(world, group, dtype):
    calls = group.shm_calls_
    n = MIN // 4 + 7
    t = contribution(world.rank, n, dtype)
    dist.all_reduce(t)
    assert group.shm_calls_ == calls
    torch.testing.assert_close(t, sum(contribution(r, n, torch.int64) for r in range(world.world_size)).to(dtype),
                               rtol=0, atol=0)


def test_async_shm_ops_in_flight(world, group):
    ts = [contribution(world.rank + i, MIN // 4 + i, torch.float32) for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in reversed(works):
        w.wait()
    for i, t in enumerate(ts):
        expected = sum(contribution(r + i, MIN // 4 + i, torch.float32) for r in range(world.world_size))
        torch.testing.assert_close(t, expected, rtol=0, atol=0)


def test_subgroup_gets_and_drops_its_own_segment(world, group):
    g = dist.new_group(backend="mpi4py")
    t = contribution(world.rank, MIN // 4 + 5, torch.float32)
    dist.all_reduce(t, group=g)
    assert g.shm_ is not None and g.shm_calls_ == 1 and g.shm_ is not group.shm_
    torch.testing.assert_close(t, sum(contribution(r, MIN // 4 + 5, torch.float32) for r in range(world.world_size)), rtol=0, atol=0)
    g.shutdown()  # what teardown calls (shutdown_all at exit): drops its end, frees the communicator
    assert g.shm_ is None and g.comm_ is None
