"""Loading MPI for pydist: the one place that imports ``mpi4py.MPI``.

    MPI = load_mpi("init_process_group under openmpi")

Three things happen before or right after MPI starts, in this order:

1. mpi4py must be importable; if not, the error says what to install.
2. Under Open MPI's launcher, mpi4py must load Open MPI's library, see
   [Note: Open MPI's mpirun with the pip MPI].
3. An uncaught exception aborts the whole job, see
   [Note: an uncaught exception aborts the job].
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Mapping

__all__ = ["load_mpi", "MPINotAvailable", "openmpi_libmpi", "ABORT_ENV"]

ABORT_ENV = "PYDIST_MPI_ABORT_ON_EXCEPTION"  # "0": an uncaught exception does not abort the MPI job


class MPINotAvailable(ImportError):
    """mpi4py is missing, or would load an MPI library the launcher cannot talk to."""


# [Note: Open MPI's mpirun with the pip MPI]
# The pip wheels of mpi4py load whichever libmpi they find first (MPI4PY_LIBMPI
# overrides); with the pip ``mpich`` package installed that is MPICH's, and
# MPICH aborts every rank under Open MPI's launcher ("Runtime environment uses
# unsupported PMI version PMIx") before Python can say a word. So under Open
# MPI (OMPI_COMM_WORLD_RANK set) and with MPI4PY_LIBMPI unset, pydist points
# mpi4py at Open MPI's own ``libmpi.so.40`` (OPAL_PREFIX, then the usual system
# places); if there is none and the pip MPICH is there, it refuses with what
# to set instead of letting MPICH abort.
_OPENMPI_DIRS = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib/powerpc64le-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/openmpi/lib", "/usr/lib64/openmpi/lib", "/usr/lib64", "/usr/local/lib",
    "/opt/openmpi/lib",
)


def openmpi_libmpi(env: Mapping[str, str] | None = None) -> str | None:
    """Path of Open MPI's ``libmpi.so.40`` on this machine, or None."""
    env = os.environ if env is None else env
    dirs = [os.path.join(env["OPAL_PREFIX"], "lib")] if env.get("OPAL_PREFIX") else []
    for d in dirs + list(_OPENMPI_DIRS):
        path = os.path.join(d, "libmpi.so.40")
        if os.path.exists(path):
            return path
    return None


def _pip_mpich() -> str | None:
    """The pip ``mpich`` package's library, which mpi4py's wheel finds first."""
    for prefix in dict.fromkeys((sys.prefix, sys.exec_prefix, sys.base_prefix)):
        for path in sorted(glob.glob(os.path.join(prefix, "lib", "libmpi.so.12*"))):
            return path
    return None


def _choose_libmpi(where: str) -> None:
    """See [Note: Open MPI's mpirun with the pip MPI]."""
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" not in env or env.get("MPI4PY_LIBMPI") or "mpi4py.MPI" in sys.modules:
        return
    found = openmpi_libmpi(env)
    if found is not None:
        env["MPI4PY_LIBMPI"] = found  # read by mpi4py when it loads MPI; inherited by children
        return
    mpich = _pip_mpich()
    if mpich is not None:
        raise MPINotAvailable(
            f"{where}: this job was started by Open MPI's mpirun (OMPI_COMM_WORLD_RANK is set) but mpi4py would load "
            f"MPICH ({mpich}), which cannot join an Open MPI job, and no Open MPI libmpi.so.40 was found (looked in "
            f"$OPAL_PREFIX/lib and {', '.join(_OPENMPI_DIRS)}). Set MPI4PY_LIBMPI=/path/to/openmpi/lib/libmpi.so.40, "
            "or launch with MPICH's mpiexec (pip install mpich puts it on PATH)"
        )


def _require_mpi4py(where: str) -> None:
    try:
        import mpi4py  # noqa: F401 - the package only; MPI starts when mpi4py.MPI is imported
    except ImportError as exc:
        raise MPINotAvailable(
            f"{where}: this process was started by an MPI launcher, and joining the job needs mpi4py, which is not "
            "installed. Install it with `pip install 'pydist[mpi]'` (mpi4py and the pip MPICH), or "
            "`pip install mpi4py` built against your cluster's MPI; or launch with torchrun instead"
        ) from exc


# [Note: an uncaught exception aborts the job]
# Under ``mpiexec -n N python train.py`` an uncaught exception on one rank ends
# that rank's script, but mpi4py then calls MPI_Finalize, which waits for every
# other rank, and those wait in a collective the dead rank will never join: the
# job hangs. ``python -m mpi4py train.py`` avoids this by calling MPI_Abort on
# an uncaught exception; pydist does the same from ``sys.excepthook`` whenever
# it initialized MPI, so the README's plain launch line behaves. Set
# PYDIST_MPI_ABORT_ON_EXCEPTION=0 to keep the default behaviour (for example
# when the ranks are meant to finish independently).
def _abort_on_uncaught_exception(MPI) -> None:
    if os.environ.get(ABORT_ENV, "1").strip() == "0" or getattr(sys.excepthook, "pydist_aborts_mpi", False):
        return
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
            return
        # torch.distributed.init_process_group, called after MPI was loaded,
        # wraps this hook in its own, which points sys.stderr at a buffer while
        # this one runs and prints the buffer (rank-prefixed) when it returns.
        # This one never returns, so print the buffer now, to the real stderr.
        err = sys.stderr
        if err is not sys.__stderr__ and sys.__stderr__ is not None and hasattr(err, "getvalue"):
            sys.__stderr__.write(err.getvalue())
            err = sys.__stderr__
        err.write(
            f"[pydist] rank {MPI.COMM_WORLD.Get_rank()}: uncaught {exc_type.__name__}; aborting the MPI job so the "
            f"other ranks do not wait for this one ({ABORT_ENV}=0 turns this off)\n"
        )
        for stream in (sys.stdout, err):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
                pass
        MPI.COMM_WORLD.Abort(1)

    excepthook.pydist_aborts_mpi = True
    sys.excepthook = excepthook


def load_mpi(where: str):
    """Import and return ``mpi4py.MPI`` (initializing MPI), per the module's
    three steps. ``where`` prefixes the errors."""
    if "mpi4py.MPI" not in sys.modules:
        _require_mpi4py(where)
        _choose_libmpi(where)
    from mpi4py import MPI

    _abort_on_uncaught_exception(MPI)
    return MPI
