"""The shared-memory transport's in-place all-reduce of buffers it allocated
([Note: buckets in shared memory] in csrc/transport/shm_transport.h), and DDP
on it.

Sums are checked exactly (integer-valued floats, power-of-two scales) and,
for random floats, bitwise: at two ranks against gloo's all-reduce of the
pre-scaled tensors (torch DDP's arithmetic; a two-term sum has one order),
at three against the rank-order sum of the scaled terms that the copying
protocol also computes (gloo's ring adds in another order). The transport's
stats say which path each all-reduce took, so every test also checks that
the path it means to test was the one taken.
"""

import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pydist import _C
from pydist.spawn import run_ranks
from test_shm_allreduce import PIECE_ELEMS_F32, _in_threads, _ints, _name, _pair

SIZES = [1, 15, 1000, PIECE_ELEMS_F32 + 1, 3 * PIECE_ELEMS_F32 + 17]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _exact_in_place(rank, world_size):
    from pydist.transport import open_shm

    shm = open_shm(dist.group.WORLD)
    calls = 0
    for dtype in DTYPES:
        for n in SIZES:
            for scale in (1.0, 0.5):
                # A piece inside a buffer, at an offset, as a bucket's chunk is.
                buffer = shm.empty_buffer(n + 40, dtype)
                buffer.fill_(99)
                piece = buffer[24 : 24 + n]
                piece.copy_(_ints(n, rank, dtype))
                expected = sum(_ints(n, r, torch.float64) * scale for r in range(world_size)).to(dtype)
                shm.all_reduce(piece, scale).wait()
                calls += 1
                assert torch.equal(piece, expected), f"{dtype} n={n} scale={scale}"
                assert (buffer[:24] == 99).all() and (buffer[24 + n :] == 99).all(), "wrote outside the piece"
    stats = shm.stats()
    assert stats == {"in_place_all_reduces": calls, "copied_all_reduces": 0}, stats

    # One rank's piece is not in a buffer: every rank copies, alike.
    n = 2 * PIECE_ELEMS_F32 + 3
    piece = torch.empty(n) if rank == 0 else shm.empty_buffer(n)
    piece.copy_(_ints(n, rank, torch.float32))
    shm.all_reduce(piece, 0.5).wait()
    assert torch.equal(piece, sum(_ints(n, r, torch.float64) * 0.5 for r in range(world_size)).float())
    assert shm.stats()["copied_all_reduces"] == 1

    # Buffers freed and made again (a peer drops its mappings of this rank's
    # freed ones and maps the new ones), on one rank only.
    if rank == world_size - 1:
        del buffer, piece
    for round_ in range(3):
        fresh = shm.empty_buffer(1000)
        fresh.copy_(_ints(1000, rank + round_, torch.float32))
        shm.all_reduce(fresh).wait()
        assert torch.equal(fresh, sum(_ints(1000, r + round_, torch.float32) for r in range(world_size)))
    assert shm.stats()["in_place_all_reduces"] == calls + 3
    return calls


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_in_place_exact_sums_every_dtype_and_size(world_size):
    counts = run_ranks(_exact_in_place, world_size, timeout=100)
    assert counts == [len(DTYPES) * len(SIZES) * 2] * world_size


def _bitwise(rank, world_size):
    from pydist.transport import open_shm

    shm = open_shm(dist.group.WORLD)
    n = 3 * PIECE_ELEMS_F32 + 5
    scale = 1.0 / world_size
    mine = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    everyone = [torch.empty(n) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    buffer = shm.empty_buffer(n)
    buffer.copy_(mine)
    shm.all_reduce(buffer, scale).wait()
    if world_size == 2:
        expected = mine * scale
        dist.all_reduce(expected)  # torch DDP: pre-divide, then a gloo sum
    else:
        terms = [t * scale for t in everyone]
        expected = terms[0] + terms[1]
        for t in terms[2:]:
            expected += t
    assert shm.stats()["in_place_all_reduces"] == 1
    return torch.equal(buffer, expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_in_place_random_floats_bitwise(world_size):
    assert run_ranks(_bitwise, world_size, timeout=50) == [True] * world_size


@pytest.mark.timeout(30)
def test_in_place_peer_that_never_arrives_times_out():
    ends = _pair(timeout_s=0.5)
    buffers = [e.empty_buffer(1000) for e in ends]
    for r, b in enumerate(buffers):
        b.copy_(_ints(1000, r, torch.float32))
    # Both once (the path is settled), then rank 1 stays away.
    assert _in_threads([lambda e=e, b=b: e.all_reduce(b).wait() for e, b in zip(ends, buffers)]) == [None, None]
    assert ends[0].stats()["in_place_all_reduces"] == 1
    with pytest.raises(RuntimeError, match="rank 1 did not arrive within the timeout of 500 ms"):
        ends[0].all_reduce(buffers[0]).wait()
    # Rank 0 aborted the segment: rank 1's next collective names it.
    with pytest.raises(RuntimeError, match="rank 0 failed an all-reduce"):
        ends[1].all_reduce(buffers[1]).wait()


@pytest.mark.timeout(30)
def test_in_place_peer_that_shuts_down_fails_the_wait_at_once():
    ends = _pair(timeout_s=60)
    buffers = [e.empty_buffer(1000) for e in ends]
    assert _in_threads([lambda e=e, b=b: e.all_reduce(b).wait() for e, b in zip(ends, buffers)]) == [None, None]
    future = ends[0].all_reduce(buffers[0])
    ends[1].close()
    with pytest.raises(RuntimeError, match="rank 1 has shut its end down"):
        future.wait()


def _reduce_once_then_die(name):
    end = _C.ShmTransport(name, 1, 2, create=False, timeout_s=20)
    buffer = end.empty_buffer(1000)
    buffer.copy_(_ints(1000, 1, torch.float32))
    end.all_reduce(buffer).wait()
    os._exit(3)  # no destructor: as if killed


@pytest.mark.timeout(60)
def test_in_place_peer_process_that_died_fails_the_wait_at_once():
    name = _name()
    # The transport's timeout under the test's: a child that never arrives fails the wait, naming it.
    end = _C.ShmTransport(name, 0, 2, create=True, timeout_s=20)
    child = mp.get_context("spawn").Process(target=_reduce_once_then_die, args=(name,), daemon=True)
    child.start()
    buffer = end.empty_buffer(1000)
    buffer.copy_(_ints(1000, 0, torch.float32))
    end.all_reduce(buffer).wait()  # with the child, in place (it has mapped the child's buffer)
    assert torch.equal(buffer, _ints(1000, 0, torch.float32) + _ints(1000, 1, torch.float32))
    assert end.stats()["in_place_all_reduces"] == 1
    child.join(30)
    end.unlink()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 .*its process \(pid {child.pid}\) has exited"):
        end.all_reduce(buffer).wait()
    assert time.monotonic() - start < 5


# --------------------------------------------------------------------------
# DDP: buckets in shared memory, gradients as torch DDP's
# --------------------------------------------------------------------------


def _ddp(rank, world_size):
    import pydist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))

    ours = pydist.DistributedDataParallel(model(), shm_allreduce=True, bucket_cap_mb=0.25)
    theirs = TorchDDP(model(), bucket_cap_mb=0.25)
    plain = model()
    held = []
    for step in range(4):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        # The exact answer: every rank's local gradient times 1/world_size,
        # summed in rank order (the transport's order; gloo's ring, torch
        # DDP's at three ranks, adds in another and differs at rounding level).
        local = torch.autograd.grad(plain(x).square().sum(), list(plain.parameters()))
        expected = []
        for g in local:
            terms = [torch.empty_like(g) for _ in range(world_size)]
            dist.all_gather(terms, g)
            total = terms[0] * (1.0 / world_size) + terms[1] * (1.0 / world_size)
            for t in terms[2:]:
                total += t * (1.0 / world_size)
            expected.append(total)
        for m in (ours, theirs):
            # Step 2 drops the grads while holding one: its bucket gets a
            # fresh buffer (the peers map it anew); the others keep theirs.
            if step == 2:
                held.append(next(m.parameters()).grad)
            m.zero_grad(set_to_none=(step == 2))
            m(x).square().sum().backward()
        for (name, p), q, e in zip(ours.module.named_parameters(), theirs.module.parameters(), expected):
            assert torch.equal(p.grad, e), f"step {step} {name}: not the rank-order sum"
            if world_size == 2:
                assert torch.equal(p.grad, q.grad), f"step {step} {name}: not bitwise torch DDP's"
    stats = ours.reducer.transport.stats()
    assert stats["in_place_all_reduces"] > 0 and stats["copied_all_reduces"] == 0, stats
    return [p.grad for p in ours.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_reduces_buckets_in_place(world_size):
    grads = run_ranks(_ddp, world_size, timeout=100)
    for rank in range(1, world_size):  # every rank ends with the same bits
        assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[rank]))
