"""Shared test setup: every test is bounded by pytest-timeout (pytest.ini);
multi-rank tests run through pydist.spawn.run_ranks, which fails fast."""

import contextlib
import os
import time

import pytest
import torch

from pydist.spawn import START_METHOD_ENV

# Ranks forked from a server that imported torch once: see [Note: ranks from
# a forkserver] in pydist/spawn.py (a test may still name start_method).
os.environ.setdefault(START_METHOD_ENV, "forkserver")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    if not torch.cuda.is_available():
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip_cuda)


# tests/mpi runs with every rank started by an MPI launcher (`make test` does
# it: mpiexec -n 2 python -m mpi4py -m pytest tests/mpi); a plain `pytest
# tests` leaves it out instead of running it on one rank.
def _under_mpi_launcher():
    from pydist.rendezvous import detect

    info = detect(required=False)
    return info is not None and info.uses_mpi


collect_ignore = [] if _under_mpi_launcher() else ["mpi"]


# [Note: MPICH's segments after an aborted job]
# MPICH maps one /dev/shm/mpich_shm_* segment per job on each host and
# unlinks it when its ranks finalize; a job that mpiexec aborts (a rank that
# exits early or raises: the fault cells, the straggler and abort cases of
# test_mpi_launch) leaves it behind, 2 MB a job. After each test, the
# segments that appeared during it and that no live process holds open or
# maps are removed; a segment of another job still running is kept.
_MPICH_SHM = "/dev/shm"


def _mpich_segments():
    try:
        return {n for n in os.listdir(_MPICH_SHM) if n.startswith("mpich_shm_")}
    except OSError:
        return set()


def _held_segments(names):
    """Those of ``names`` some live process has open or mapped."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for what in ("maps", "fd"):
            path = f"/proc/{pid}/{what}"
            try:
                text = (open(path).read() if what == "maps"
                        else " ".join(os.readlink(f"{path}/{fd}") for fd in os.listdir(path)))
            except OSError:
                continue
            held.update(n for n in names if n in text)
    return held


@pytest.fixture(autouse=True)
def _no_mpich_segments_left():
    before = _mpich_segments()
    yield
    _remove_unheld(_mpich_segments() - before)


def _remove_unheld(new, patience_s=3.0):
    """Unlinks the segments of ``new`` that no process holds, waiting up to
    ``patience_s`` for an aborted job's ranks to finish exiting."""
    deadline = time.monotonic() + patience_s
    while new:
        held = _held_segments(new)
        for name in new - held:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(_MPICH_SHM, name))
        new = held
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)


_SESSION_START = _mpich_segments()


def pytest_sessionfinish(session, exitstatus):
    _remove_unheld(_mpich_segments() - _SESSION_START)
