"""Run a function on N local ranks, each in its own process, and fail fast.

    results = run_ranks(train, world_size=2, args=(cfg,), backend="gloo")

Used by the tests and the benchmarks. Each rank joins a process
group through a file store in a fresh temporary folder (no port to collide
on), runs ``fn(rank, world_size, *args)`` and sends back its return value.

[Note: fail fast, never hang]
The parent watches every rank. The first rank that raises or dies ends the
run: the others are killed and the parent raises ``RanksFailed`` carrying
that rank's traceback. A run that outlives ``timeout`` seconds is killed and
raises ``RanksTimedOut`` naming the ranks that had not finished. The process
group gets the same timeout, so a collective whose peer is gone errors out
in the surviving ranks instead of blocking them.

[Note: ranks from a forkserver]
A spawned rank is a fresh interpreter that imports torch: about a second
per rank, most of a short test's time (two ranks on two cores, ~2 s a
call). ``start_method="forkserver"`` (or ``PYDIST_RUN_RANKS_START``; the
test suite sets it in tests/conftest.py) forks each rank from one server
process that imported torch and torch.distributed once (~0.2 s a call after
the first). Nothing else is imported there: pydist, the test's module and
``fn`` are imported in the rank, as under spawn. The server was started
with the environment of the first call, so every rank is handed the
caller's ``os.environ`` of its own call and installs it before running
``fn``; what torch itself read at import (OMP_NUM_THREADS for the default
thread count, TORCH_LOGS) is the server's. Benchmarks keep spawn, so the
peak RSS they report is a fresh process's.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

__all__ = ["run_ranks", "RanksFailed", "RanksTimedOut"]


class RanksFailed(RuntimeError):
    """A rank raised or died; the message holds its traceback or exit code."""


class RanksTimedOut(TimeoutError):
    """The ranks did not all finish within the timeout."""


START_METHOD_ENV = "PYDIST_RUN_RANKS_START"
_PRELOAD = ["torch", "torch.distributed"]  # see [Note: ranks from a forkserver]


def _rank_main(fn, rank, world_size, args, backend, store_path, timeout, threads, results, environ):
    if os.environ != environ:  # a forkserver's rank: see [Note: ranks from a forkserver]
        os.environ.clear()
        os.environ.update(environ)
    # Errors are reported the moment they happen, before the process group is
    # torn down, so the parent hears of the root cause before its echoes
    # ("connection closed by peer") arrive from the other ranks.
    try:
        import torch
        import torch.distributed as dist

        if threads:
            torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        # Plain pickle copies tensors by value; the queue's own pickler would
        # share them through file descriptors that die with this process.
        results.put((rank, "ok", pickle.dumps(value), time.time()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, "error", traceback.format_exc(), time.time()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout: float = 120.0,
    threads: int | None = 1,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    ``fn`` must be importable by name (a module-level function). Returns the
    ranks' return values in rank order. ``threads`` sets each rank's torch
    intra-op threads (None leaves torch's default). ``start_method``:
    "spawn" (the default) or "forkserver" (see [Note: ranks from a
    forkserver]); None reads PYDIST_RUN_RANKS_START. See [Note: fail fast,
    never hang].
    """
    method = start_method or os.environ.get(START_METHOD_ENV) or "spawn"
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"run_ranks: start_method {method!r} (or {START_METHOD_ENV}) must be 'spawn' or 'forkserver'")
    if method == "forkserver":
        mp.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts: the first call
    ctx = mp.get_context(method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pydist-spawn-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, tuple(args), backend, store_path, timeout, threads, results,
                      dict(os.environ)),
                daemon=True,
                name=f"pydist-rank-{rank}",
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)


def _collect(procs, results, timeout):
    world_size = len(procs)
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout + 30  # the group's own timeout fires first
    while len(values) < world_size:
        try:
            rank, status, value, when = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
            if dead:
                _raise_failures(results, [], world_size, died=dead, procs=procs)
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in values]
                raise RanksTimedOut(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
            continue
        if status == "error":
            _raise_failures(results, [(when, rank, value)], world_size)
        values[rank] = pickle.loads(value)
    return [values[r] for r in range(world_size)]


def _raise_failures(results, errors, world_size, died=(), procs=()):
    """Gather the errors other ranks report within a short grace period and
    raise them all, earliest first: the earliest is the cause, the rest echo it."""
    grace = time.monotonic() + 2.0
    while time.monotonic() < grace:
        try:
            rank, status, value, when = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "error":
            errors.append((when, rank, value))
    errors.sort()
    parts = [f"rank {rank} of {world_size} raised:\n{tb}" for _, rank, tb in errors]
    reported = {rank for _, rank, _ in errors}
    parts += [
        f"rank {r} of {world_size} died with exit code {procs[r].exitcode}" for r in died if r not in reported
    ]
    raise RanksFailed("\n".join(parts))
