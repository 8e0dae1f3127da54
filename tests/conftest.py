"""Shared test setup: every test is bounded by pytest-timeout (pytest.ini);
multi-rank tests run through pydist.spawn.run_ranks, which fails fast."""

import pytest
import torch


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
