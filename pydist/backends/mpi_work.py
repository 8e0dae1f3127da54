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

[Note: the watchdog fails overdue works]
An MPI call whose peer died never returns, and nothing can interrupt it: the
MPI thread stays inside it. ``MPIWork.wait`` bounds itself by the group's
timeout, but torch's DDP reducer (and any comm hook) waits on the work's
*future*, which only the MPI thread would complete. So each ``CommThread``
has a watchdog that acts when the oldest unfinished work is older than the
group's timeout. As NCCL's watchdog does by default, it reports the
collective and aborts the job (``MPI_Abort``): torch's own DDP cannot take an
error from a Python process group's future (torch 2.13 crashes in
``parseCppCommHookResult`` when the future holds an exception), and a rank
whose peer is gone cannot do much more than stop. With
PYDIST_MPI_ABORT_ON_TIMEOUT=0 it fails that work and every work queued behind
it with ``CollectiveTimeout`` instead (their futures raise: pydist's DDP and
direct waits report it); the group is then unusable, later collectives on it
fail at once, and if its thread is still inside MPI at exit, pydist aborts
rather than finalizes (``finish_at_exit`` in mpi4py_backend.py).
"""

from __future__ import annotations

import collections
import datetime
import os
import queue
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["CommThread", "MPIWork", "CollectiveTimeout", "ABORT_ON_TIMEOUT_ENV"]

ABORT_ON_TIMEOUT_ENV = "PYDIST_MPI_ABORT_ON_TIMEOUT"  # "0": a timed-out collective raises instead of aborting


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
        self.future_ = torch.futures.Future()  # completed by the MPI thread, or by the watchdog
        self.deadline_ = time.monotonic() + timeout.total_seconds()  # the watchdog fails the work after it
        self.finish_lock_ = threading.Lock()  # the MPI thread and the watchdog may both finish it

    # -- called by the MPI thread, or by the watchdog ------------------------
    def finish(self, error: BaseException | None) -> bool:
        """Complete the work once; False if it was already completed."""
        with self.finish_lock_:
            if self.done_.is_set():
                return False
            self.error_ = error
            self.done_.set()
        if error is None:
            self.future_.set_result(self.result_)
        else:
            self.future_.set_exception(error)
        return True

    # -- called by the user / by torch ---------------------------------------
    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        # torch passes timedelta(0) for "no timeout given" (kNoTimeout).
        limit = self.timeout_ if not timeout else timeout
        if not self.done_.wait(limit.total_seconds()):
            raise CollectiveTimeout(timeout_message(self.description, limit))
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


def timeout_message(description: str, limit: datetime.timedelta) -> str:
    return (f"mpi4py backend: {description} did not finish within {limit.total_seconds():g} s (the group's "
            "timeout); a peer rank may have died, hung, or called a different collective")


def _abort_job(error: CollectiveTimeout) -> None:
    """See [Note: the watchdog fails overdue works]."""
    from mpi4py import MPI

    sys.stderr.write(f"[pydist] rank {MPI.COMM_WORLD.Get_rank()}: {error}. Aborting the MPI job "
                     f"({ABORT_ON_TIMEOUT_ENV}=0 raises CollectiveTimeout instead)\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


class CommThread:
    """Runs ops on one communicator, one at a time, in the order enqueued.
    See [Note: one thread per group, in issue order] and
    [Note: the watchdog fails overdue works]."""

    _STOP = object()

    def __init__(self, name: str):
        self.queue_: queue.SimpleQueue = queue.SimpleQueue()  # (fn, work) pairs, or _STOP
        self.pending_: collections.deque[MPIWork] = collections.deque()  # enqueued, not finished; issue order
        self.cond_ = threading.Condition()  # guards pending_, running_, timed_out_; wakes the watchdog
        self.running_: MPIWork | None = None  # the work inside MPI now
        self.timed_out_: CollectiveTimeout | None = None  # set once, when a work times out: the group is unusable
        self.thread_ = threading.Thread(target=self._run, name=name, daemon=True)
        self.watchdog_ = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self.thread_.start()
        self.watchdog_.start()

    def enqueue(self, fn: Callable[[], None], work: MPIWork) -> MPIWork:
        if not self.thread_.is_alive():
            raise RuntimeError(f"mpi4py backend: {work.description} was issued after its group was shut down")
        with self.cond_:
            if self.timed_out_ is not None:
                raise CollectiveTimeout(f"mpi4py backend: {work.description} cannot run: an earlier collective "
                                        f"of this group timed out ({self.timed_out_})")
            self.pending_.append(work)
            self.cond_.notify()
        self.queue_.put((fn, work))
        return work

    def _run(self) -> None:
        while True:
            item = self.queue_.get()
            if item is self._STOP:
                with self.cond_:
                    self.cond_.notify()  # let the watchdog see the end
                return
            fn, work = item
            with self.cond_:
                self.running_ = work
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                work.finish(RuntimeError(f"mpi4py backend: {work.description} failed: {exc}"))
            else:
                work.finish(None)
            with self.cond_:
                self.running_ = None
                if self.pending_ and self.pending_[0] is work:
                    self.pending_.popleft()

    def _watch(self) -> None:
        """See [Note: the watchdog fails overdue works]."""
        with self.cond_:
            while self.thread_.is_alive():
                if not self.pending_:
                    self.cond_.wait(1.0)
                    continue
                oldest = self.pending_[0]
                left = oldest.deadline_ - time.monotonic()
                if left > 0:
                    self.cond_.wait(min(left, 1.0))
                    continue
                self.timed_out_ = CollectiveTimeout(timeout_message(oldest.description, oldest.timeout_))
                if os.environ.get(ABORT_ON_TIMEOUT_ENV, "1").strip() != "0":
                    _abort_job(self.timed_out_)
                for work in self.pending_:
                    work.finish(self.timed_out_ if work is oldest else CollectiveTimeout(
                        f"mpi4py backend: {work.description} was queued behind a collective that timed out "
                        f"({self.timed_out_})"))
                self.pending_.clear()
                return

    @property
    def stuck(self) -> bool:
        """A collective timed out and the MPI thread is still inside it."""
        with self.cond_:
            return self.timed_out_ is not None and self.running_ is not None and self.thread_.is_alive()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Let queued ops finish, then end the thread. False if it is stuck
        (in a collective whose peers never came)."""
        if self.stuck:  # it would wait for the collective that timed out
            return False
        if self.thread_.is_alive():
            self.queue_.put(self._STOP)
            self.thread_.join(timeout_s)
        return not self.thread_.is_alive()
