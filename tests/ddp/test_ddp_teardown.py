"""Freeing a pydist DDP model after its process group was destroyed never
hangs (see [Note: freed without the GIL] in csrc/module.cpp).

A script that calls ``destroy_process_group`` and then lets its model go
leaves pydist's reducer holding the last reference to the group, so freeing
the model runs gloo's destructor, which waits for gloo's worker thread. Here
that worker is still finishing a collective on a tensor Python holds when the
model is freed (the peer joins the all-reduce a moment later), so it needs the
GIL to free that tensor: the freeing thread must not hold it, or
rank 0 hangs here for ever (no timeout covers a deadlock).
"""

import gc
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import pydist
from pydist.spawn import run_ranks

PEER_DELAY_S = 1.0


def _free_model_after_destroying_its_group(rank: int, world_size: int) -> float:
    group = dist.new_group(backend="gloo")
    model = pydist.DistributedDataParallel(nn.Linear(4, 2), process_group=group)
    model(torch.ones(3, 4)).sum().backward()
    held = torch.full((8,), float(rank + 1))
    if rank == 0:
        dist.all_reduce(held, group=group, async_op=True)  # the handle is dropped: gloo's worker frees the work
        dist.destroy_process_group(group)
        del group  # now pydist's reducer holds the group's last reference
        start = time.monotonic()
        del model
        gc.collect()  # a module wrapped in DDP sits in reference cycles
        return time.monotonic() - start
    time.sleep(PEER_DELAY_S)
    dist.all_reduce(held, group=group)
    dist.destroy_process_group(group)
    del model
    return 0.0


@pytest.mark.timeout(120)
def test_freeing_a_model_after_destroy_process_group_does_not_hang():
    freed_in = run_ranks(_free_model_after_destroying_its_group, 2, timeout=60)[0]
    assert freed_in < 30, f"freeing the model took {freed_in:.1f} s"
