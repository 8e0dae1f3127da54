"""What one step's records say about overlap: per bucket, how long the step
waited for its communication after autograd had finished; per step, the
total and the bucket it waited on last.

[Note: exposed communication]
After autograd ends (``backward_end_ms``) finalize waits for the buckets in
launch order and writes each back. Bucket b's *exposed* time is how long
finalize waited for it:

    ready_b   = max(backward_end, done_{b-1})        finalize gets to bucket b
    exposed_b = max(0, complete_b - ready_b)         waiting for its collective
    write-back of b: from max(ready_b, complete_b) to done_b

so a step's exposed communication is the sum of its buckets' (what is left
of ``finalize_end - backward_end`` is write-back). The bucket the step
*waited on last* is the last one with exposed time > 0: the communication
the step finally stalled on; the *stalling* bucket is the one with the
most exposed time. A bucket's *hidden* time is the part of its
communication that ran while autograd was still computing. Chunks (see
[Note: chunked launches] in csrc/reducer/reducer.h) get the same split,
each against its bucket's ready time.

A sharded wrapper's collectives (see [Note: one record schema] in
pydist/ddp/records.py) carry the time the compute thread began waiting for
them, ``needed_ms``, forward or backward: there ``ready_b = needed_b`` and
nothing is written back after the wait (the gradients are handed out in it).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = ["BucketOverlap", "StepOverlap", "analyze_step"]


class BucketOverlap(NamedTuple):
    index: int
    bytes: int
    comm_ms: float        # launch to completion of its collectives
    hidden_ms: float      # communication while autograd still ran
    exposed_ms: float     # finalize waited for it: see [Note: exposed communication]
    write_back_ms: float  # finalize wrote it back
    launch_delay_ms: float  # last gradient ready to launch (waiting for earlier buckets/chunks)
    wait_start_ms: float  # finalize got to it (ready_b)


class StepOverlap(NamedTuple):
    iteration: int
    backward_ms: float          # prepare_for_backward (a sharded wrapper: its root's forward) to the end of autograd
    step_comm_ms: float         # first launch to last completion
    exposed_ms: float           # sum of the buckets' exposed time
    finalize_ms: float          # end of autograd to grads written back
    waited_last: int | None     # bucket index the step waited on last, None if it waited on none
    stalling: int | None        # bucket with the most exposed time, None if none
    buckets: list[BucketOverlap]


def analyze_step(record) -> StepOverlap:
    """``record``: an IterationRecord (pydist.ddp.records), or anything with
    its fields. Buckets are taken in index order, which is launch order."""
    end = record.backward_end_ms
    previous_done = end
    out: list[BucketOverlap] = []
    for b in sorted(record.buckets, key=lambda b: b.index):
        needed = getattr(b, "needed_ms", -1.0)
        if needed >= 0:  # a sharded wrapper's collective: the wait is its own
            ready, write_back = needed, 0.0
            exposed = max(0.0, b.complete_ms - ready)
        else:
            ready = max(end, previous_done)
            exposed = max(0.0, b.complete_ms - ready)
            write_back = max(0.0, b.done_ms - max(ready, b.complete_ms))
        out.append(
            BucketOverlap(
                index=b.index,
                bytes=b.bytes,
                comm_ms=max(0.0, b.complete_ms - b.launch_ms),
                hidden_ms=b.hidden_ms(end),
                exposed_ms=exposed,
                write_back_ms=write_back,
                launch_delay_ms=max(0.0, b.launch_ms - b.last_grad_ms),
                wait_start_ms=ready,
            )
        )
        if needed < 0:
            previous_done = max(previous_done, b.done_ms)
    exposed_buckets = sorted((b for b in out if b.exposed_ms > 0), key=lambda b: (b.wait_start_ms, b.index))
    launches = [b.launch_ms for b in record.buckets if b.launch_ms >= 0]
    completes = [b.complete_ms for b in record.buckets if b.complete_ms >= 0]
    return StepOverlap(
        iteration=record.iteration,
        backward_ms=end,
        step_comm_ms=(max(completes) - min(launches)) if launches and completes else 0.0,
        exposed_ms=sum(b.exposed_ms for b in out),
        finalize_ms=record.finalize_end_ms - end,
        waited_last=exposed_buckets[-1].index if exposed_buckets else None,
        stalling=max(exposed_buckets, key=lambda b: b.exposed_ms).index if exposed_buckets else None,
        buckets=out,
    )


def chunk_exposure(bucket, wait_start_ms: float) -> list[float]:
    """Per chunk of ``bucket`` (its ``chunks``, possibly empty), how long of
    finalize's wait for the bucket each chunk accounts for, in launch order:
    chunk k's collective past the later of ``wait_start_ms`` and chunk k-1's
    completion."""
    out, cursor = [], wait_start_ms
    for c in getattr(bucket, "chunks", ()) or ():
        out.append(max(0.0, c.complete_ms - cursor))
        cursor = max(cursor, c.complete_ms)
    return out


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
