"""Collectives of the mpi4py backend against exactly known answers.

Every tensor holds integer values, so every result is exact (rtol=0, atol=0).
Rank r contributes ``base + r`` patterns; the expected value is computed here
in closed form, not by another backend.
"""

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from pydist.backends import mpi4py_backend
from pydist.backends.mpi_work import CollectiveTimeout

R = dist.ReduceOp
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16]


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def contribution(rank, n, dtype):
    """Rank r holds (i % 7) + r + 1: small integers every dtype holds exactly."""
    return (torch.arange(n) % 7 + rank + 1).to(dtype)


def all_gather_into(out, inp, **kw):  # torch 2.13 renamed it; 2.11 has only the old name
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, **kw)


def reduce_scatter_into(out, inp, **kw):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["SUM", "MAX", "MIN", "PRODUCT"])
def test_all_reduce(world, op, dtype):
    n, ws = 1000, world.world_size
    t = contribution(world.rank, n, dtype)
    dist.all_reduce(t, op=getattr(R, op))
    parts = torch.stack([contribution(r, n, torch.float64) for r in range(ws)])
    expected = {"SUM": parts.sum(0), "MAX": parts.max(0).values, "MIN": parts.min(0).values,
                "PRODUCT": parts.prod(0)}[op]
    exact(t, expected.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_all_reduce_avg(world, dtype):
    ws = world.world_size
    t = torch.full((64,), float(2 * (world.rank + 1)), dtype=dtype)
    dist.all_reduce(t, op=R.AVG)
    exact(t, torch.full((64,), float(ws + 1), dtype=dtype))  # mean of 2, 4, ..., 2*ws


@pytest.mark.parametrize("numel", [0, 1, mpi4py_backend.ALLREDUCE_CHUNK_BYTES // 4 * 3 + 13], ids=["empty", "one", "chunked"])
def test_all_reduce_sizes(world, numel):
    """Includes a message that is chunked (3 chunks and a tail): see [Note: chunked all-reduce]."""
    t = contribution(world.rank, numel, torch.float32)
    dist.all_reduce(t)
    exact(t, sum(contribution(r, numel, torch.float32) for r in range(world.world_size)))


def test_all_reduce_non_contiguous(world):
    base = contribution(world.rank, 200, torch.float32).view(10, 20)
    t = base.t()  # a view with strides (1, 20)
    dist.all_reduce(t)
    exact(base, sum(contribution(r, 200, torch.float32) for r in range(world.world_size)).view(10, 20))


def test_async_work_in_flight(world):
    """Several ops in flight at once, waited for out of order; futures carry the outputs."""
    ws = world.world_size
    tensors = [torch.full((1000,), float(world.rank + i)) for i in range(5)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for i, w in reversed(list(enumerate(works))):
        w.wait()
        exact(tensors[i], torch.full((1000,), float(sum(range(ws)) + ws * i)))
    fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()
    exact(fut.wait()[0], torch.full((3,), float(ws)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.bool], ids=str)
def test_broadcast_from_every_root(world, dtype):
    for root in range(world.world_size):
        t = contribution(world.rank, 333, dtype)
        dist.broadcast(t, src=root)
        exact(t, contribution(root, 333, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bfloat16], ids=str)
def test_all_gather(world, dtype):
    ws = world.world_size
    mine = contribution(world.rank, 77, dtype)
    outs = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(outs, mine)
    for r in range(ws):
        exact(outs[r], contribution(r, 77, dtype))
    flat = torch.empty(ws * 77, dtype=dtype)
    all_gather_into(flat, mine)
    exact(flat, torch.cat([contribution(r, 77, dtype) for r in range(ws)]))


@pytest.mark.parametrize("op", ["SUM", "MAX", "AVG"])
def test_reduce_scatter(world, op):
    ws, block = world.world_size, 50
    full = [contribution(world.rank, ws * block, torch.float32) for _ in range(1)][0]
    parts = torch.stack([contribution(r, ws * block, torch.float64) for r in range(ws)])
    expected = {"SUM": parts.sum(0), "MAX": parts.max(0).values, "AVG": parts.mean(0)}[op].to(torch.float32)
    mine = expected[world.rank * block:(world.rank + 1) * block]

    out = torch.empty(block)
    reduce_scatter_into(out, full.clone(), op=getattr(R, op))
    exact(out, mine)
    out_list = torch.empty(block)
    dist.reduce_scatter(out_list, list(full.clone().chunk(ws)), op=getattr(R, op))
    exact(out_list, mine)


def test_barrier_and_all_reduce_coalesced(world):
    dist.barrier()
    a, b = torch.full((3,), 1.0 + world.rank), torch.full((2, 2), 10.0 * world.rank)
    dist.all_reduce_coalesced([a, b])
    ws = world.world_size
    exact(a, torch.full((3,), float(ws + sum(range(ws)))))
    exact(b, torch.full((2, 2), 10.0 * sum(range(ws))))


def test_subgroup_of_the_last_rank(world):
    """new_group builds a communicator of just those global ranks."""
    last = world.world_size - 1
    group = dist.new_group([last], backend="mpi4py")
    if world.rank == last:
        t = torch.full((4,), 5.0)
        dist.all_reduce(t, group=group)
        exact(t, torch.full((4,), 5.0))
    dist.barrier()


def test_bad_input_names_op_and_rank(world):
    with pytest.raises(ValueError, match=rf"all_gather_into_tensor .* on rank {world.rank} of .*expected"):
        all_gather_into(torch.empty(3), torch.ones(2))
    with pytest.raises(TypeError, match="AVG needs a floating-point"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=R.AVG)


def test_timeout_names_the_collective(world, timeout_s, monkeypatch):
    """Rank 0 waits on an all-reduce rank 1 joins only after rank 0's 1 s
    timeout. With PYDIST_MPI_ABORT_ON_TIMEOUT=0 (the default aborts the job,
    see [Note: the watchdog fails overdue works]) rank 0's wait and future
    raise CollectiveTimeout; the late peer then completes the call inside MPI,
    and the group refuses further collectives."""
    monkeypatch.setenv("PYDIST_MPI_ABORT_ON_TIMEOUT", "0")
    group = dist.new_group(backend="mpi4py", timeout=datetime.timedelta(seconds=1))
    t = torch.ones(4)
    if world.rank == 0:
        work = dist.all_reduce(t, group=group, async_op=True)
        with pytest.raises(CollectiveTimeout, match="allreduce of 4 float32 on cpu on rank 0 of"):
            work.wait()
        with pytest.raises(CollectiveTimeout, match="did not finish within 1 s"):
            work.get_future().wait()
        dist.broadcast(torch.zeros(1), src=0)  # tell the others to join now (world group)
        deadline = time.monotonic() + timeout_s
        while group.stuck and time.monotonic() < deadline:  # the late peer lets the MPI thread out
            time.sleep(0.05)
        assert not group.stuck
        with pytest.raises(CollectiveTimeout, match="an earlier collective of this group timed out"):
            dist.all_reduce(torch.ones(1), group=group)
    else:
        dist.broadcast(torch.zeros(1), src=0)
        dist.all_reduce(t, group=group)
        exact(t, torch.full((4,), float(world.world_size)))
    dist.barrier()


def test_group_timeout_is_visible_to_the_shm_transport(world, timeout_s):
    """Issue 17 item 7: the shm transport reads the group's timeout through
    ``group._get_backend(cpu).options._timeout``; on the mpi4py group that used
    to raise and fall back to 30 minutes."""
    from pydist.transport.shm_segment import group_timeout as _timeout

    assert _timeout(dist.group.WORLD) == datetime.timedelta(seconds=timeout_s)
    group = dist.new_group(backend="mpi4py", timeout=datetime.timedelta(seconds=7))
    assert _timeout(group) == datetime.timedelta(seconds=7)


@pytest.mark.cuda
def test_cuda_all_reduce(world):
    dev = torch.device("cuda", torch.cuda.current_device())
    t = contribution(world.rank, 1 << 20, torch.float32).to(dev)
    dist.all_reduce(t)
    exact(t.cpu(), sum(contribution(r, 1 << 20, torch.float32) for r in range(world.world_size)))


def test_cuda_awareness_is_queried_from_the_mpi_library(world):
    """MPICH from PyPI is built without CUDA: the query must answer False, and
    CUDA tensors would then be staged through host memory."""
    from pydist.backends.mpi_buffers import cuda_aware

    from mpi4py import MPI

    assert isinstance(cuda_aware(), bool)
    if MPI.Get_library_version().startswith("MPICH") and not torch.cuda.is_available():
        assert cuda_aware() is False


@pytest.mark.parametrize("reduce", [True, False], ids=["typed", "bytes"])
def test_cpu_tensors_reach_mpi_without_a_copy(world, reduce):
    """The buffer handed to mpi4py is a view of the tensor's own memory."""
    from pydist.backends.mpi_buffers import Message

    t = torch.arange(10, dtype=torch.float32)
    msg = Message(t, reduce=reduce)
    data, _ = msg.buffer("test")
    assert not msg.copied
    assert data.__array_interface__["data"][0] == t.data_ptr()
    assert data.nbytes == t.numel() * t.element_size()
