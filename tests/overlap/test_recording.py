"""pydist.overlap's recording API on real runs: on for one wrapper or all,
each step's records and their analysis, reset; off, the lab adds nothing."""

import pytest
import torch
import torch.distributed as dist

from pydist.spawn import run_ranks


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])


def _steps(ddp, n, rank):
    gen = torch.Generator().manual_seed(rank)
    for _ in range(n):
        ddp.zero_grad()
        ddp(torch.randn(8, 256, generator=gen)).square().sum().backward()


def _recording(rank, world_size):
    from pydist import DistributedDataParallel as DDP
    from pydist import overlap, transport

    # Off: no hook of the lab's, no wrapper in front of the transport, no records.
    plain = DDP(_model())
    assert not plain._forward_hooks and not plain._forward_pre_hooks
    assert transport.transport_of(plain).name == "shm"
    _steps(plain, 2, rank)
    assert plain.iteration_records() == [] and overlap.records(plain) == []

    # On for one wrapper, over a slow simulated link, so that communication is exposed.
    ddp = DDP(_model(), bucket_cap_mb=0.3, sim_net="0.2Gbps,50us")
    overlap.record(ddp, keep=2)  # a ring of 2: the log still keeps every step
    _steps(ddp, 5, rank)
    steps = overlap.steps(ddp)
    assert [s.iteration for s in steps] == [0, 1, 2, 3, 4]
    grad_bytes = sum(p.numel() * 4 for p in ddp.parameters())
    model_ms = 1e3 * overlap.model_seconds("all_reduce", grad_bytes, world_size, "0.2Gbps,50us")
    for s in steps[1:]:  # after the rebuild
        assert sum(b.bytes for b in s.buckets) == grad_bytes and len(s.buckets) > 2
        assert s.step_comm_ms >= model_ms * 0.999
        assert s.exposed_ms > 0 and s.waited_last is not None and s.stalling is not None
        assert s.exposed_ms <= s.finalize_ms + 1e-9
    overlap.reset(ddp)
    assert overlap.steps(ddp) == []
    _steps(ddp, 1, rank)
    assert [s.iteration for s in overlap.steps(ddp)] == [5]

    # On for every wrapper, those made later too; then off again.
    overlap.record()
    later = DDP(_model())
    _steps(later, 2, rank)
    assert len(overlap.steps(later)) == 2
    overlap.stop()
    _steps(later, 1, rank)
    assert len(overlap.steps(later)) == 2
    overlap.record(later)  # on again: follows each step again
    _steps(later, 2, rank)
    assert [s.iteration for s in overlap.steps(later)] == [0, 1, 3, 4]
    dist.barrier()
    return True


@pytest.mark.timeout(120)
def test_recording_api_on_real_steps():
    assert run_ranks(_recording, 2, timeout=100) == [True, True]
