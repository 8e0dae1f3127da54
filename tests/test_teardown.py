"""Freeing pydist's objects never hangs on a collective still in flight (see
[Note: freed without the GIL] in csrc/module.cpp).

Freeing a DDP model whose reducer holds a destroyed group's last reference
(a script that calls ``destroy_process_group``, then lets the model go) runs
gloo's destructor, which waits for gloo's worker thread; freeing a
transport with a thread of its own waits for that thread. Here the worker is
still in a collective on a tensor Python holds when the object is freed (the
peer joins a moment later), and once done it lets go of that tensor, which
takes the GIL: the freeing thread must not hold it, or rank 0 hangs here for
ever (no timeout covers a deadlock).
"""

import gc
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import pydist
from pydist import transport
from pydist.spawn import run_ranks

PEER_DELAY_S = 1.0


def _build(kind: str, group):
    if kind == "reducer":
        model = pydist.DistributedDataParallel(nn.Linear(4, 2), process_group=group)
        model(torch.ones(3, 4)).sum().backward()
        return model
    if kind == "shm_transport":
        return transport.open_shm(group)
    return transport.ProcessGroupTransport(group)


def _free_while_a_collective_is_in_flight(rank: int, world_size: int, kind: str) -> float:
    group = dist.new_group(backend="gloo")
    freed = _build(kind, group)
    held = torch.full((8,), float(rank + 1))
    if rank == 0:
        # The handle is dropped: the worker lets go of the collective's tensors.
        if kind == "shm_transport":
            freed.all_reduce(held)
        else:
            dist.all_reduce(held, group=group, async_op=True)
        dist.destroy_process_group(group)
        del group  # a reducer or a ProcessGroupTransport holds the group's last reference now
        start = time.monotonic()
        del freed
        gc.collect()  # a module wrapped in DDP sits in reference cycles
        return time.monotonic() - start
    time.sleep(PEER_DELAY_S)
    if kind == "shm_transport":
        try:
            freed.all_reduce(held).wait()
        except RuntimeError as e:  # freed mid-collective, rank 0's end aborted it
            assert "aborted the transport" in str(e), e
    else:
        dist.all_reduce(held, group=group)
    dist.destroy_process_group(group)
    del freed
    return 0.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["reducer", "pg_transport", "shm_transport"])
def test_freeing_while_a_collective_is_in_flight_does_not_hang(kind):
    freed_in = run_ranks(_free_while_a_collective_is_in_flight, 2, args=(kind,), timeout=60)[0]
    assert freed_in < 30, f"freeing took {freed_in:.1f} s"
