"""Turning the reducer's records on and reading them, per wrapper or for all.

    from pydist import overlap
    overlap.record(ddp)              # or overlap.record() for every wrapper, now and later
    ...train...
    for step in overlap.steps(ddp):  # StepOverlap per recorded step, oldest first
        print(step.iteration, step.exposed_ms, step.waited_last)
    overlap.reset(ddp)               # forget what was recorded

The records are those the reducer keeps (``ddp.iteration_records()``, the
last ``keep`` iterations; see pydist/ddp/records.py). A ``StepLog`` copies
each one into a longer log as its backward ends (see [Note: draining at the
end of backward]), so a trace covers every step, even when the wrapper is
gone before the trace is written. Off (the default) nothing here runs and
the reducer reads no clock.
"""

from __future__ import annotations

import collections
import weakref

import torch

from pydist.overlap.analysis import StepOverlap, analyze_step

__all__ = ["record", "stop", "records", "steps", "reset", "StepLog", "wrappers"]

DEFAULT_KEEP = 16  # the reducer's ring: iterations it holds between drains

# Every live pydist DistributedDataParallel, in construction order (attach()).
_wrappers: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_next_id = 0
# record() with no wrapper: the ring size new wrappers record with, or None.
_record_all_keep: int | None = None
# The StepLog of each wrapper that recorded, kept here rather than on the
# wrapper so that pickling and deepcopy of a wrapper never meet it.
_logs: "weakref.WeakKeyDictionary[object, StepLog]" = weakref.WeakKeyDictionary()


def wrappers() -> list:
    """The live pydist DistributedDataParallel wrappers of this process."""
    return [w for _, w in sorted(_wrappers.items())]


def _new_number() -> int:
    """The next wrapper number (a trace's tracks are numbered by it)."""
    global _next_id
    number = _next_id
    _next_id += 1
    return number


def _register(ddp) -> int:
    number = _new_number()
    _wrappers[number] = ddp
    if _record_all_keep is not None:
        record(ddp, keep=_record_all_keep)
    return number


class StepLog:
    """Every record of one wrapper since recording began (up to ``limit``
    steps, the newest kept), drained from the reducer's ring."""

    def __init__(self, ddp, keep: int = DEFAULT_KEEP, limit: int = 10_000):
        self._ddp = weakref.ref(ddp)
        self.keep = keep
        self.records: collections.deque = collections.deque(maxlen=limit)
        self._last_iteration = -1
        self._hook = None  # the forward hook, while the log follows the wrapper
        self.follow()

    def follow(self) -> None:
        """Copy each step's record as its backward ends (see [Note: draining
        at the end of backward])."""
        ddp = self._ddp()
        if self._hook is None and ddp is not None:
            self._hook = ddp.register_forward_hook(_DrainAtBackwardEnd(self))

    def unfollow(self) -> None:
        self.drain()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def drain(self) -> None:
        """Copies the records the reducer holds that the log lacks."""
        ddp = self._ddp()
        if ddp is not None:
            self._take(ddp.iteration_records())

    def drain_last(self) -> None:
        """Copies the reducer's newest record (one, cheaply), if new."""
        from pydist.ddp.records import IterationRecord

        ddp = self._ddp()
        if ddp is not None and ddp.reducer is not None:
            rec = IterationRecord.from_reducer(ddp.reducer.last_record())
            self._take([rec] if rec is not None else [])

    def _take(self, records) -> None:
        for rec in records:
            if rec.iteration > self._last_iteration:
                self.records.append(rec)
                self._last_iteration = rec.iteration

    def clear(self) -> None:
        self.records.clear()


# [Note: draining at the end of backward]
# A record is complete once the reducer's finalize_backward has run, an
# autograd engine callback the reducer queues at the first gradient of the
# backward. To read it right after, without a Python call per gradient: a
# forward hook puts a hook on the output, which autograd runs first in the
# backward; that queues an engine callback (it runs before finalize, queued
# later), which queues another: callbacks queued while callbacks run go to
# the end of the list, so that one runs after finalize and copies the record.
# Reading every step as it ends (rather than the ring now and then) keeps the
# last steps of a wrapper that is dropped before the trace is written.
class _DrainAtBackwardEnd:
    """The forward hook of a StepLog. A pickled or deep-copied wrapper
    carries an inert hook instead (its copy records nothing until asked)."""

    def __init__(self, log: StepLog):
        self._log = weakref.ref(log)

    def __call__(self, module, args, output) -> None:
        if not torch.is_grad_enabled() or not getattr(module, "require_backward_grad_sync", True):
            return
        first = next((t for t in _tensors(output) if t.requires_grad), None)
        if first is not None:
            first.register_hook(self._at_backward_start)

    def _at_backward_start(self, grad) -> None:
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._after_finalize))

    def _after_finalize(self) -> None:
        log = self._log()
        if log is not None:
            log.drain_last()

    def __reduce__(self):
        return (InertHook, ())


class InertHook:
    """What a pickled overlap-lab hook becomes: nothing."""

    def __call__(self, *args) -> None:
        return None


def _tensors(output):
    if torch.is_tensor(output):
        return [output]
    flat, _ = torch.utils._pytree.tree_flatten(output)
    return [t for t in flat if torch.is_tensor(t)]


def _log_of(ddp) -> StepLog | None:
    return _logs.get(ddp)


def record(ddp=None, keep: int = DEFAULT_KEEP) -> None:
    """Turn recording on for ``ddp``, or (None) for every wrapper, live or
    constructed later; ``keep`` is the reducer's ring size."""
    global _record_all_keep
    if ddp is None:
        _record_all_keep = keep
        for w in wrappers():
            record(w, keep)
        return
    ddp.set_record_timing(True, keep=keep)
    if _log_of(ddp) is None:
        _logs[ddp] = StepLog(ddp, keep)
    else:
        _logs[ddp].follow()


def stop(ddp=None) -> None:
    """Turn recording off (the reducer reads no clock again); what was
    recorded stays readable until reset."""
    global _record_all_keep
    if ddp is None:
        _record_all_keep = None
        for w in wrappers():
            stop(w)
        return
    log = _log_of(ddp)
    if log is not None:
        log.unfollow()
    ddp.set_record_timing(False, keep=log.keep if log else ddp._records_kept)  # a wrapper never recorded keeps its ring


def records(ddp) -> list:
    """Every IterationRecord recorded for ``ddp`` since record() (or the
    last reset), oldest first."""
    log = _log_of(ddp)
    if log is None:
        return ddp.iteration_records()
    log.drain()
    return list(log.records)


def steps(ddp) -> list[StepOverlap]:
    """records(ddp), analysed: see [Note: exposed communication]."""
    return [analyze_step(r) for r in records(ddp)]


def reset(ddp=None) -> None:
    """Forget what was recorded (for ``ddp``, or every wrapper)."""
    for w in wrappers() if ddp is None else [ddp]:
        log = _log_of(w)
        if log is not None:
            log.drain()
            log.clear()
        w.clear_records()
