"""Turning the reducer's records on and reading them, per wrapper or for all.

    from pydist import overlap
    overlap.record(ddp)              # or overlap.record() for every wrapper, now and later
    ...train...
    for step in overlap.steps(ddp):  # StepOverlap per recorded step, oldest first
        print(step.iteration, step.exposed_ms, step.waited_last)
    overlap.reset(ddp)               # forget what was recorded

The records are those the reducer keeps (``ddp.iteration_records()``, the
last ``keep`` iterations; see pydist/ddp/records.py). A ``StepLog`` drains
them every ``keep // 2`` forwards into a longer log, so a trace covers every
step, not only the last few. Off (the default) nothing here runs and the
reducer reads no clock.
"""

from __future__ import annotations

import collections
import weakref

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


def _register(ddp) -> int:
    global _next_id
    number = _next_id
    _next_id += 1
    _wrappers[number] = ddp
    if _record_all_keep is not None:
        record(ddp, keep=_record_all_keep)
    return number


def _set_record_timing(ddp, on: bool, keep: int) -> None:
    try:
        ddp.set_record_timing(on, keep=keep)
    except TypeError:  # a reducer without the ring: one record, drained every forward
        ddp.set_record_timing(on)


def _held_records(ddp) -> list:
    if hasattr(ddp, "iteration_records"):
        return list(ddp.iteration_records())
    last = ddp.last_iteration_record()
    return [last] if last is not None else []


class StepLog:
    """Every record of one wrapper since recording began (up to ``limit``
    steps, the newest kept), drained from the reducer's ring."""

    def __init__(self, ddp, keep: int = DEFAULT_KEEP, limit: int = 100_000):
        self._ddp = weakref.ref(ddp)
        self.keep = keep
        self.records: collections.deque = collections.deque(maxlen=limit)
        self._last_iteration = -1
        self._forwards = 0
        has_ring = hasattr(ddp, "iteration_records")
        # How many forwards between drains: before the ring could wrap.
        self._drain_every = max(1, keep // 2) if has_ring else 1
        self._hook = ddp.register_forward_pre_hook(_DrainHook(self))

    def on_forward(self) -> None:
        self._forwards += 1
        if self._forwards % self._drain_every == 0:
            self.drain()

    def drain(self) -> None:
        ddp = self._ddp()
        if ddp is None:
            return
        for rec in _held_records(ddp):
            if rec.iteration > self._last_iteration:
                self.records.append(rec)
                self._last_iteration = rec.iteration

    def clear(self) -> None:
        self.records.clear()

    def close(self) -> None:
        self.drain()
        self._hook.remove()


class _DrainHook:
    """The forward pre-hook of a StepLog. A pickled or deep-copied wrapper
    carries an inert hook instead (its copy records nothing until asked)."""

    def __init__(self, log: StepLog):
        self._log = weakref.ref(log)

    def __call__(self, module, args) -> None:
        log = self._log()
        if log is not None:
            log.on_forward()

    def __reduce__(self):
        return (InertHook, ())


class InertHook:
    """What a pickled overlap-lab hook becomes: nothing."""

    def __call__(self, module, args) -> None:
        return None


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
    _set_record_timing(ddp, True, keep)
    if _log_of(ddp) is None:
        _logs[ddp] = StepLog(ddp, keep)


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
        log.drain()
        log._hook.remove()
    _set_record_timing(ddp, False, log.keep if log else DEFAULT_KEEP)


def records(ddp) -> list:
    """Every IterationRecord recorded for ``ddp`` since record() (or the
    last reset), oldest first."""
    log = _log_of(ddp)
    if log is None:
        return _held_records(ddp)
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
        if hasattr(w, "clear_records"):
            w.clear_records()
