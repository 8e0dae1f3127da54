"""The reducer's records (``record_timing=True``).

``last_iteration_record()`` reports, per bucket and per chunk, when its
gradients became ready, when its communication was launched, when it
actually completed (on the thread that completed it) and when finalize
wrote it back. These tests hold the record to what happened: every
parameter and byte is accounted for, the events are in causal order, and
the completion time is the collective's own, not the moment finalize got
round to waiting for it. A backward that sleeps at its very end (once every
gradient is ready) separates the two: a stamp taken by finalize would fall
after the sleep. The last K iterations are kept (``iteration_records()``),
and the stamps land inside the reducer's own scopes in a torch.profiler
trace once converted with ``profiler_clock_offset_ns()``.
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
    # 20 KB buckets of 16 KB weights, cut into chunks of about 5 KB: several
    # buckets, and buckets of several collectives.
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.02, allreduce_chunk_mb=0.005, record_timing=record_timing)
    if comm_hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    x = torch.randn(8, 64, requires_grad=True)
    for _ in range(3):
        ddp.zero_grad()
        before = time.monotonic_ns()
        ddp(x).sum().backward()
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    # Off, the transport stamps nothing (-1): it reads no clock.
    stamped = ddp.reducer.transport.all_reduce(torch.zeros(4)).wait() if not comm_hook else None
    return (ddp.last_iteration_record(), len(params), sum(p.numel() * p.element_size() for p in params),
            (before, time.monotonic_ns()), ddp.iteration_records(), stamped)


@pytest.mark.timeout(120)
def test_no_record_without_record_timing():
    for record, _, _, _, records, stamped in run_ranks(_records_main, 2, args=(False, False)):
        assert record is None
        assert records == []
        assert stamped == -1, "with records off the transport stamped a completion time (read a clock)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("comm_hook", [False, True], ids=["allreduce", "comm_hook"])
def test_record_accounts_for_every_bucket_in_causal_order(comm_hook):
    results = run_ranks(_records_main, 2, args=(True, comm_hook))
    for rank, (record, num_params, num_bytes, (before, after), records, _) in enumerate(results):
        assert record is not None, f"rank {rank}: no record with record_timing=True"
        assert record.iteration == 2
        assert [r.iteration for r in records] == [0, 1, 2] and records[-1] == record
        assert record.rank == rank
        assert record.transport == ("comm_hook" if comm_hook else "shm")
        # start_ns is the arming (end of forward) on time.monotonic_ns's clock
        assert before <= record.start_ns <= before + record.finalize_end_ms * 1e6 <= after
        buckets = record.buckets
        assert len(buckets) >= 2, f"rank {rank}: expected several buckets, got {len(buckets)}"
        assert [b.index for b in buckets] == list(range(len(buckets)))
        assert sum(b.num_params for b in buckets) == num_params
        assert sum(b.bytes for b in buckets) == num_bytes
        for b in buckets:
            # (its first chunk may launch before its last gradient is ready)
            events = [0.0, b.first_grad_ms, b.launch_ms, b.complete_ms, b.done_ms, record.finalize_end_ms]
            assert events == sorted(events), f"rank {rank}, bucket {b.index}: events out of order: {events}"
            assert b.first_grad_ms <= b.last_grad_ms <= b.chunks[-1].launch_ms, f"rank {rank}, bucket {b.index}"
            assert b.last_grad_ms <= record.backward_end_ms <= b.done_ms, f"rank {rank}, bucket {b.index}"
            # its chunks tile the bucket, launch in order, and bound its launch and completion
            assert b.chunks and all(c.collective == "all_reduce" for c in b.chunks)
            assert sum(c.bytes for c in b.chunks) == b.bytes
            itemsize = 4
            assert [c.offset for c in b.chunks] == [sum(c.bytes for c in b.chunks[:i]) // itemsize for i in range(len(b.chunks))]
            assert b.chunks[0].launch_ms == b.launch_ms
            assert max(c.complete_ms for c in b.chunks) == b.complete_ms
            for c in b.chunks:
                assert b.first_grad_ms <= c.launch_ms <= c.complete_ms <= b.done_ms, f"rank {rank}, bucket {b.index}: {c}"
            launches = [c.launch_ms for c in b.chunks]
            assert launches == sorted(launches)
        if comm_hook:
            assert all(len(b.chunks) == 1 for b in buckets), "a comm hook gets whole buckets"
        else:
            assert any(len(b.chunks) > 1 for b in buckets), "expected chunked buckets"

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


# --- the ring of the last K iterations ------------------------------------------


def _ring_main(rank, world_size):
    from pydist import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(_model()[1:], shm_allreduce=False)
    x = torch.randn(8, 64)
    seen = {}

    def step():
        ddp(x).sum().backward()

    step()  # off: nothing recorded
    seen["off"] = ddp.iteration_records()
    ddp.set_record_timing(True, keep=3)
    for _ in range(5):
        step()
    seen["keep3"] = ddp.iteration_records()
    with ddp.no_sync():  # not synchronized: not recorded
        step()
    seen["no_sync"] = ddp.iteration_records()
    ddp.set_record_timing(True, keep=2)  # shrinking drops the oldest
    seen["keep2"] = ddp.iteration_records()
    ddp.clear_records()
    seen["cleared"] = (ddp.iteration_records(), ddp.last_iteration_record())
    out = ddp(x)  # armed with records on
    ddp.set_record_timing(False)  # between forward and backward: from the next forward on
    out.sum().backward()
    seen["stopped_mid"] = ddp.iteration_records()
    step()
    seen["off_again"] = ddp.iteration_records()
    with pytest.raises(ValueError, match="keep must be a positive int"):
        ddp.set_record_timing(True, keep=0)
    return seen


@pytest.mark.timeout(120)
def test_records_keep_the_last_k_iterations():
    for rank, seen in enumerate(run_ranks(_ring_main, 2)):
        assert seen["off"] == []
        # The first backward is iteration 0 (unrecorded); then 1..5, of which 3 are kept.
        assert [r.iteration for r in seen["keep3"]] == [3, 4, 5], f"rank {rank}"
        starts = [r.start_ns for r in seen["keep3"]]
        assert starts == sorted(starts) and len(set(starts)) == 3
        assert all(r.rank == rank and r.transport == "gloo" for r in seen["keep3"])
        assert seen["no_sync"] == seen["keep3"]
        assert seen["keep2"] == seen["keep3"][1:]
        assert seen["cleared"] == ([], None)
        # The iteration armed with records on is recorded whole, its
        # completions stamped; the next one is not recorded.
        [mid] = seen["stopped_mid"]
        assert all(0 <= b.launch_ms <= b.complete_ms <= b.done_ms for b in mid.buckets), mid.report()
        assert seen["off_again"] == seen["stopped_mid"]


# --- the profiler's view ------------------------------------------------------------

LAUNCH_SCOPE = "pydist.Reducer.launch_chunk"
FINALIZE_SCOPE = "pydist.Reducer.finalize_backward"


def test_profiler_clock_offset_converts_to_the_profilers_clock():
    """A steady-clock stamp plus the offset falls where torch.profiler puts
    an event taken between two such stamps."""
    from torch.autograd.profiler import record_function
    from torch.profiler import profile

    from pydist.ddp.records import profiler_clock_offset_ns

    spans = []
    with profile() as prof:
        for i in range(20):
            before = time.monotonic_ns()
            with record_function(f"probe{i}"):
                time.sleep(0.001)
            spans.append((before, time.monotonic_ns()))
    offset = profiler_clock_offset_ns()
    events = {e.name(): e for e in prof.profiler.kineto_results.events() if e.name().startswith("probe")}
    assert len(events) == 20
    slack_ns = 50_000  # the offset is measured to well under 1 us; the profiler's TSC conversion adds a little
    for i, (before, after) in enumerate(spans):
        e = events[f"probe{i}"]
        assert before + offset - slack_ns <= e.start_ns(), (i, e.start_ns() - (before + offset))
        assert e.start_ns() + e.duration_ns() <= after + offset + slack_ns, (i, e.start_ns() + e.duration_ns() - (after + offset))
    # the profiler's clock is the wall clock: the offset is REALTIME - MONOTONIC
    assert abs(offset - (time.time_ns() - time.monotonic_ns())) < 5_000_000


def _profiled_main(rank, world_size):
    from torch.profiler import profile

    from pydist import DistributedDataParallel
    from pydist.ddp.records import profiler_clock_offset_ns

    torch.manual_seed(0)
    ddp = DistributedDataParallel(_model()[1:], bucket_cap_mb=0.02, allreduce_chunk_mb=0.005, record_timing=True)
    x = torch.randn(8, 64)
    for _ in range(2):  # the second rebuilds the buckets
        ddp(x).sum().backward()
    with profile() as prof:
        ddp(x).sum().backward()
    events = [(e.name(), e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
              if e.name() in (LAUNCH_SCOPE, FINALIZE_SCOPE)]
    return events, ddp.last_iteration_record(), profiler_clock_offset_ns()


@pytest.mark.timeout(120)
def test_profiler_trace_shows_the_reducer_scopes_around_its_records():
    for rank, (events, record, offset) in enumerate(run_ranks(_profiled_main, 2)):
        launches = [(start, end) for name, start, end in events if name == LAUNCH_SCOPE]
        finalizes = [(start, end) for name, start, end in events if name == FINALIZE_SCOPE]
        chunks = [c for b in record.buckets for c in b.chunks]
        assert len(launches) == len(chunks) > len(record.buckets), f"rank {rank}: {len(launches)} launch scopes"
        assert len(finalizes) == 1, f"rank {rank}: {len(finalizes)} finalize scopes"
        # Each chunk's launch stamp, on the profiler's clock, lies inside its own launch scope.
        slack_ns = 50_000
        to_profiler = lambda ms: record.start_ns + int(ms * 1e6) + offset  # noqa: E731
        for i, (c, (start, end)) in enumerate(zip(chunks, sorted(launches))):
            t = to_profiler(c.launch_ms)
            assert start - slack_ns <= t <= end + slack_ns, f"rank {rank}, chunk {i}: {t - start} ns after its scope began, scope {end - start} ns"
        start, end = finalizes[0]
        assert start - slack_ns <= to_profiler(record.backward_end_ms) <= end + slack_ns
        assert start - slack_ns <= to_profiler(record.finalize_end_ms) <= end + slack_ns
