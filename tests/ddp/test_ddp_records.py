"""The reducer's per-bucket records (``record_timing=True``).

``last_iteration_record()`` reports, per bucket, when its gradients became
ready, when its communication was launched, when it actually completed (on
the thread that completed it) and when finalize wrote it back. These tests
hold the record to what happened: every parameter and byte is accounted
for, the events are in causal order, and the completion time is the
collective's own, not the moment finalize got round to waiting for it. A
backward that sleeps at its very end (once every gradient is ready)
separates the two: a stamp taken by finalize would fall after the
sleep.
"""

import time

import pytest
import torch
from torch import nn

from pydist.spawn import run_ranks

SLEEP_S = 0.3  # at the end of backward, once every parameter's gradient is ready


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLEEP_S)
        return grad


class _SlowTail(nn.Module):
    """Identity whose backward (the last autograd step, since it sees the
    input) sleeps; the input requires grad so the step runs at all."""

    def forward(self, x):
        return _SleepInBackward.apply(x)


def _model() -> nn.Module:
    layers = [_SlowTail()]
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers)


def _records_main(rank, world_size, record_timing, comm_hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from pydist import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.01, record_timing=record_timing)
    if comm_hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    x = torch.randn(8, 64, requires_grad=True)
    for _ in range(3):
        ddp.zero_grad()
        ddp(x).sum().backward()
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    return ddp.last_iteration_record(), len(params), sum(p.numel() * p.element_size() for p in params)


@pytest.mark.timeout(120)
def test_no_record_without_record_timing():
    for record, _, _ in run_ranks(_records_main, 2, args=(False, False)):
        assert record is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("comm_hook", [False, True], ids=["allreduce", "comm_hook"])
def test_record_accounts_for_every_bucket_in_causal_order(comm_hook):
    for rank, (record, num_params, num_bytes) in enumerate(run_ranks(_records_main, 2, args=(True, comm_hook))):
        assert record is not None, f"rank {rank}: no record with record_timing=True"
        assert record.iteration == 2
        buckets = record.buckets
        assert len(buckets) > 2, f"rank {rank}: expected several buckets, got {len(buckets)}"
        assert [b.index for b in buckets] == list(range(len(buckets)))
        assert sum(b.num_params for b in buckets) == num_params
        assert sum(b.bytes for b in buckets) == num_bytes
        for b in buckets:
            events = [0.0, b.first_grad_ms, b.last_grad_ms, b.launch_ms, b.complete_ms, b.done_ms, record.finalize_end_ms]
            assert events == sorted(events), f"rank {rank}, bucket {b.index}: events out of order: {events}"
            assert b.last_grad_ms <= record.backward_end_ms <= b.done_ms, f"rank {rank}, bucket {b.index}"

        # Every bucket launched before the sleep at the end of backward
        # (autograd runs gradient accumulation as soon as it can) and finished
        # long before autograd did; only the collective's own stamp shows that.
        sleep_ms = SLEEP_S * 1e3
        for b in buckets:
            assert b.complete_ms < record.backward_end_ms - sleep_ms / 2, (
                f"rank {rank}, bucket {b.index}: completed at {b.complete_ms:.1f} ms, "
                f"backward ended at {record.backward_end_ms:.1f} ms"
            )
            assert b.hidden_ms(record.backward_end_ms) == pytest.approx(b.complete_ms - b.launch_ms)
        assert record.comm_hidden_ms > 0
        assert record.exposed_comm_ms >= 0
        assert "complete" in record.report()
