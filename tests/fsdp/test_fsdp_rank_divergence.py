"""Ranks whose forwards run different units issue different collectives:
on shared memory that fails every rank at once, naming both collectives,
instead of pairing one unit's gather with another's (which finished with
wrong parameters and gradients, or waited for the group's timeout)."""

import time

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks


class Skipping(nn.Module):
    """Three units of different sizes; ``skip`` leaves the middle one out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 4)
        self.skip = False

    def forward(self, x):
        x = self.a(x)
        if not self.skip:
            x = self.b(x)
        return self.c(x)


def _diverging_rank(rank, world_size):
    import pydist

    model = Skipping()
    for unit in (model.a, model.b, model.c):
        pydist.fully_shard(unit, shm=True)
    pydist.fully_shard(model, shm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()  # one step where every rank agrees
    opt.step()
    model.skip = rank == 1
    start = time.monotonic()
    try:
        model(x).sum().backward()
        opt.step()
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.timeout(90)
def test_a_unit_skipped_on_one_rank_fails_every_rank_at_once():
    for rank, (message, seconds) in enumerate(run_ranks(_diverging_rank, 2, timeout=80)):
        assert "the ranks issued different collectives" in message, f"rank {rank}: {message}"
        assert seconds < 20, f"rank {rank} failed only after {seconds:.0f} s"
