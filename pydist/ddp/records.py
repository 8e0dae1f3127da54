"""What the C++ reducer recorded per iteration, per bucket and per chunk,
and the overlap it implies.

An iteration's record begins when the reducer is armed for backward (the end
of forward): ``IterationRecord.start_ns`` is that instant on the steady clock
(CLOCK_MONOTONIC, the clock of ``time.monotonic_ns()``), and every ``*_ms``
field is milliseconds since then (-1e-6 where the event did not happen). A
bucket's communication runs from ``launch_ms`` (its first collective) to
``complete_ms`` (its last collective finished, stamped by the thread that
finished it); each of its chunks (one collective each, see [Note: chunked
launches] in csrc/reducer/reducer.h) has its own launch and completion.
``done_ms`` is when finalize had waited for the bucket and written its
gradients back, which is never before autograd ends at ``backward_end_ms``.
Everything from there until ``finalize_end_ms`` is communication the
backward could not hide (plus writing results back). On NCCL a collective's
future completes once its kernels are enqueued, so there ``complete_ms``
marks the enqueue, not the end of the transfer.

[Note: one record schema]
The sharded wrapper (pydist/fsdp) publishes its iterations in these types
too, so that the overlap lab reads one kind of record: a "bucket" is one of
its collectives (an all-gather or a reduce-scatter of a unit, or of a batch
of units sent as one), with ``unit``, ``phase`` and ``needed_ms`` set, and
one chunk naming the collective. Its record starts at the root's forward
(``backward_start_ms`` says where backward began), and a collective's
exposed time is how long the compute thread waited for it, ``complete_ms -
needed_ms``, forward or backward (see [Note: exposed communication]).
A reduce-scatter's ``first_grad_ms`` and ``last_grad_ms`` are its issue:
the unit's gradients were ready then.

torch.profiler stamps its events on another clock; ``profiler_clock_offset_ns()``
converts (see [Note: record clocks] in csrc/reducer/records.h).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydist import _C


def profiler_clock_offset_ns() -> int:
    """Nanoseconds to add to a steady-clock time (``time.monotonic_ns()``,
    ``IterationRecord.start_ns``) to get torch.profiler's clock: the
    ``start_ns()`` of its events, i.e. CLOCK_REALTIME. Measured on each call
    (the wall clock can be stepped); 0 would mean the two are one clock."""
    return _C.profiler_clock_offset_ns()


@dataclass(frozen=True)
class ChunkTiming:
    offset: int          # first element of the chunk in its bucket
    bytes: int
    collective: str      # "all_reduce" (DDP); a sharded wrapper adds "reduce_scatter" / "all_gather"
    launch_ms: float     # handed to the transport
    complete_ms: float   # the collective finished


@dataclass(frozen=True)
class BucketTiming:
    index: int
    num_params: int
    bytes: int
    first_grad_ms: float  # its first gradient became ready
    last_grad_ms: float   # its last gradient became ready
    launch_ms: float      # its first collective (chunk or comm hook) was launched
    complete_ms: float    # its last collective finished
    done_ms: float        # finalize had waited for it and written its grads back
    chunks: tuple[ChunkTiming, ...] = ()  # its collectives, in launch order
    # A sharded wrapper's collective (see [Note: one record schema]); a DDP bucket leaves them as they are.
    unit: str = ""           # the units it carries, "+"-joined ("" for the root unit)
    phase: str = ""          # "forward", "backward", "forward_prefetch", ...
    needed_ms: float = -1.0  # the compute thread began waiting for it (-1: finalize's order decides, DDP)
    # DDP: per parameter, in buffer order, which one (its index among the
    # wrapper's parameters) and when its gradient became ready (-1e-6: not
    # this iteration); the overlap lab's predictor re-buckets from these.
    param_indices: tuple[int, ...] = ()
    grad_ms: tuple[float, ...] = ()

    def hidden_ms(self, backward_end_ms: float) -> float:
        """How long its communication ran while autograd was still computing."""
        return max(0.0, min(self.complete_ms, backward_end_ms) - self.launch_ms)


def _ms(ns: int) -> float:
    return ns / 1e6


@dataclass(frozen=True)
class IterationRecord:
    iteration: int
    rank: int              # in the wrapper's process group
    transport: str         # what carried the chunks: "gloo", "shm", "comm_hook", "counting(gloo)", ...
    start_ns: int          # steady-clock time the reducer was armed; the *_ms fields count from here
    backward_end_ms: float
    finalize_end_ms: float
    buckets: list[BucketTiming]
    backward_start_ms: float = 0.0  # DDP's record starts at backward; a sharded wrapper's at its root's forward

    @classmethod
    def from_reducer(cls, record) -> "IterationRecord | None":
        """From a ``_C.IterationRecord``; None for the empty one (iteration -1)."""
        if record.iteration < 0:
            return None
        return cls(
            iteration=record.iteration,
            rank=record.rank,
            transport=record.transport,
            start_ns=record.start_ns,
            backward_end_ms=_ms(record.backward_end_ns),
            finalize_end_ms=_ms(record.finalize_end_ns),
            buckets=[
                BucketTiming(
                    b.index, b.num_params, b.bytes, _ms(b.first_grad_ns), _ms(b.last_grad_ns), _ms(b.launch_ns),
                    _ms(b.complete_ns), _ms(b.done_ns),
                    tuple(ChunkTiming(c.offset, c.bytes, c.collective, _ms(c.launch_ns), _ms(c.complete_ns)) for c in b.chunks),
                    param_indices=tuple(b.param_indices), grad_ms=tuple(_ms(t) for t in b.grad_ns),
                )
                for b in record.buckets
            ],
        )

    @property
    def finalize_ms(self) -> float:
        """From the end of autograd until the gradients are ready to use:
        the exposed waits plus writing reduced buckets back."""
        return self.finalize_end_ms - self.backward_end_ms

    @property
    def exposed_comm_ms(self) -> float:
        """How long the step waited for communication after autograd ended
        (write-back excluded): ``pydist.overlap``'s exposed time of this step."""
        from pydist.overlap.analysis import analyze_step

        return analyze_step(self).exposed_ms

    @property
    def comm_hidden_ms(self) -> float:
        """Sum over buckets of how long each one's communication ran while
        autograd was still computing."""
        return sum(b.hidden_ms(self.backward_end_ms) for b in self.buckets)

    def report(self) -> str:
        lines = [
            f"iteration {self.iteration}: backward ended at {self.backward_end_ms:.2f} ms, grads ready at "
            f"{self.finalize_end_ms:.2f} ms (exposed communication {self.exposed_comm_ms:.2f} ms, write-back included "
            f"{self.finalize_ms:.2f} ms); "
            f"rank {self.rank}, transport {self.transport}",
            f"{'bucket':>6} {'params':>6} {'MB':>8} {'chunks':>6} {'1st grad':>9} {'last grad':>9} {'launch':>9} "
            f"{'complete':>9} {'done':>9} {'hidden':>8}",
        ]
        for b in self.buckets:
            lines.append(
                f"{b.index:>6} {b.num_params:>6} {b.bytes / 2**20:>8.2f} {len(b.chunks):>6} {b.first_grad_ms:>9.2f} "
                f"{b.last_grad_ms:>9.2f} {b.launch_ms:>9.2f} {b.complete_ms:>9.2f} {b.done_ms:>9.2f} "
                f"{b.hidden_ms(self.backward_end_ms):>8.2f}"
            )
        return "\n".join(lines)
