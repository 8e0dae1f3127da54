"""Per-bucket timings of one backward, as the C++ reducer recorded them,
and the overlap they imply.

All times are milliseconds since the reducer was armed for backward (the end
of forward). A bucket's communication runs from ``launch_ms`` (its first
collective) to ``complete_ms`` (its last collective finished, stamped by the
thread that finished it); ``done_ms`` is when finalize had waited for it and
written its gradients back, which is never before autograd ends at
``backward_end_ms``. Everything from there until ``finalize_end_ms`` is
communication the backward could not hide (plus writing results back).
On NCCL a collective's future completes once its kernels are enqueued, so
there ``complete_ms`` marks the enqueue, not the end of the transfer.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def hidden_ms(self, backward_end_ms: float) -> float:
        """How long its communication ran while autograd was still computing."""
        return max(0.0, min(self.complete_ms, backward_end_ms) - self.launch_ms)


@dataclass(frozen=True)
class IterationRecord:
    iteration: int
    backward_end_ms: float
    finalize_end_ms: float
    buckets: list[BucketTiming]

    @classmethod
    def from_reducer(cls, record) -> "IterationRecord | None":
        if record.iteration < 0:
            return None
        ms = lambda ns: ns / 1e6  # noqa: E731
        return cls(
            iteration=record.iteration,
            backward_end_ms=ms(record.backward_end_ns),
            finalize_end_ms=ms(record.finalize_end_ns),
            buckets=[
                BucketTiming(b.index, b.num_params, b.bytes, ms(b.first_grad_ns), ms(b.last_grad_ns),
                             ms(b.launch_ns), ms(b.complete_ns), ms(b.done_ns))
                for b in record.buckets
            ],
        )

    @property
    def exposed_comm_ms(self) -> float:
        """Time between the end of autograd and grads being ready to use."""
        return self.finalize_end_ms - self.backward_end_ms

    @property
    def comm_hidden_ms(self) -> float:
        """Sum over buckets of how long each one's communication ran while
        autograd was still computing."""
        return sum(b.hidden_ms(self.backward_end_ms) for b in self.buckets)

    def report(self) -> str:
        lines = [
            f"iteration {self.iteration}: backward ended at {self.backward_end_ms:.2f} ms, "
            f"grads ready at {self.finalize_end_ms:.2f} ms (exposed communication {self.exposed_comm_ms:.2f} ms)",
            f"{'bucket':>6} {'params':>6} {'MB':>8} {'1st grad':>9} {'last grad':>9} {'launch':>9} "
            f"{'complete':>9} {'done':>9} {'hidden':>8}",
        ]
        for b in self.buckets:
            lines.append(
                f"{b.index:>6} {b.num_params:>6} {b.bytes / 2**20:>8.2f} {b.first_grad_ms:>9.2f} "
                f"{b.last_grad_ms:>9.2f} {b.launch_ms:>9.2f} {b.complete_ms:>9.2f} {b.done_ms:>9.2f} "
                f"{b.hidden_ms(self.backward_end_ms):>8.2f}"
            )
        return "\n".join(lines)
