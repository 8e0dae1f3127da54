"""Asynchronous work for the mpi4py backend: one MPI thread per group, and
the ``Work`` handle a collective returns.

[Note: one thread per group, in issue order]
MPI requires every rank to call the collectives of a communicator in the same
order. torch issues them in program order from the main thread (DDP's reducer
issues bucket all-reduces from autograd threads, also in a fixed order), so a
single FIFO thread per communicator keeps that order while the caller goes on
computing: ``enqueue`` returns at once, ``MPIWork.wait`` blocks until the
thread has run the op. Blocking MPI calls release the GIL (mpi4py does that),
so the training thread keeps running Python meanwhile.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["CommThread", "MPIWork", "CollectiveTimeout"]


class CollectiveTimeout(RuntimeError):
    """A collective did not finish within the group's timeout."""


class MPIWork(dist._Work):
    """The handle of one enqueued collective.

    ``wait`` blocks until the op ran (or raises its error, or
    ``CollectiveTimeout`` after the group's timeout); ``get_future`` returns a
    ``torch.futures.Future`` completed with the op's output tensors, which is
    what DDP's reducer chains its comm hook on.
    """

    def __init__(self, description: str, result: Any, timeout: datetime.timedelta):
        super().__init__()
        self.description = description  # "allreduce of 1048576 float32 on rank 1 of 2", for errors
        self.result_ = result  # the output tensors, handed to the future
        self.timeout_ = timeout  # the group's timeout, used when wait() gets none
        self.done_ = threading.Event()  # set by the MPI thread when the op ran
        self.error_: BaseException | None = None  # the op's exception, raised by wait()
        self.future_ = torch.futures.Future()  # completed by the MPI thread

    # -- called by the MPI thread --------------------------------------------
    def finish(self, error: BaseException | None) -> None:
        self.error_ = error
        self.done_.set()
        if error is None:
            self.future_.set_result(self.result_)
        else:
            self.future_.set_exception(error)

    # -- called by the user / by torch ---------------------------------------
    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        # torch passes timedelta(0) for "no timeout given" (kNoTimeout).
        limit = self.timeout_ if not timeout else timeout
        if not self.done_.wait(limit.total_seconds()):
            raise CollectiveTimeout(
                f"mpi4py backend: {self.description} did not finish within {limit.total_seconds():.0f} s; "
                "a peer rank may have died or called a different collective"
            )
        if self.error_ is not None:
            raise self.error_
        return True

    def is_completed(self) -> bool:
        return self.done_.is_set()

    def is_success(self) -> bool:
        return self.done_.is_set() and self.error_ is None

    def exception(self):
        return self.error_

    def get_future(self) -> torch.futures.Future:
        return self.future_


class CommThread:
    """Runs ops on one communicator, one at a time, in the order enqueued.
    See [Note: one thread per group, in issue order]."""

    _STOP = object()

    def __init__(self, name: str):
        self.queue_: queue.SimpleQueue = queue.SimpleQueue()  # (fn, work) pairs, or _STOP
        self.thread_ = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread_.start()

    def enqueue(self, fn: Callable[[], None], work: MPIWork) -> MPIWork:
        if not self.thread_.is_alive():
            raise RuntimeError(f"mpi4py backend: {work.description} was issued after its group was shut down")
        self.queue_.put((fn, work))
        return work

    def _run(self) -> None:
        while True:
            item = self.queue_.get()
            if item is self._STOP:
                return
            fn, work = item
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                work.finish(RuntimeError(f"mpi4py backend: {work.description} failed: {exc}"))
            else:
                work.finish(None)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Let queued ops finish, then end the thread. False if it is stuck
        (in a collective whose peers never came)."""
        if self.thread_.is_alive():
            self.queue_.put(self._STOP)
            self.thread_.join(timeout_s)
        return not self.thread_.is_alive()
