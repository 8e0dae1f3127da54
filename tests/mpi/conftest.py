"""The suite launched by an MPI launcher, every rank running pytest:

    mpiexec -n 2 python -m mpi4py -m pytest tests/mpi

Each rank joins through ``pydist.init_process_group(backend="mpi")`` (rank 0
opens the store on a free port and broadcasts it), so the MPI rendezvous and
the mpi4py backend are exercised end to end; a gloo group over the same ranks
is the reference for parity tests.

[Note: a failing rank aborts the job]
Every rank runs the same tests in the same order, so collectives match. When a
test fails on one rank, its peers are typically blocked in a collective that
rank will never join. The report hook below calls ``MPI_COMM_WORLD.Abort`` on
the failing rank as soon as the failure is recorded: the launcher then kills
every rank and exits non-zero, so CI sees the failure within seconds instead of
a hang. Collectives also carry the group's timeout (TIMEOUT_S) and pytest's
per-test timeout backs both up.
"""

import datetime
import os
import sys
import time

import pytest

TIMEOUT_S = 60  # process-group timeout: a collective whose peer is gone fails after this
ABORT_DELAY_S = 0.5  # pause between printing a failure and MPI_Abort


def pytest_configure(config):
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.exit("tests/mpi needs at least 2 ranks: mpiexec -n 2 python -m mpi4py -m pytest tests/mpi", returncode=4)


def pytest_runtest_logreport(report):
    if report.failed:  # See [Note: a failing rank aborts the job]
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        text = (f"\n[rank {rank}] {report.nodeid} failed in {report.when}:\n{report.longreprtext}\n"
                f"[rank {rank}] aborting the MPI job so the other ranks do not wait forever\n")
        sys.stderr.write(text)
        sys.stderr.flush()
        log = os.environ.get("PYDIST_MPI_FAILURE_LOG")  # the launcher may drop output in flight at abort
        if log:
            with open(f"{log}.rank{rank}", "a") as f:
                f.write(text)
        time.sleep(ABORT_DELAY_S)  # let the launcher forward the report before it kills everything
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture(scope="session")
def timeout_s():
    return TIMEOUT_S


@pytest.fixture(scope="session")
def world():
    """The default group (mpi4py backend), joined once for the whole session."""
    import torch.distributed as dist

    import pydist

    result = pydist.init_process_group(backend="mpi", timeout=TIMEOUT_S)
    yield result
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def gloo(world):
    """A gloo group over the same ranks: the reference backend."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
