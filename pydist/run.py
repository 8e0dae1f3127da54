"""Run a torchrun script, unchanged, under mpirun/mpiexec or srun.

    mpiexec -n 4 python -m pydist.run train.py --lr 0.1
    srun -n 8 python -m pydist.run train.py
    mpiexec -n 4 python -m pydist.run -m package.train --lr 0.1

Scripts written for torchrun read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` -- often before any
init, to decide whether they run distributed at all. This entry point derives
them from the launcher that started the process, then runs the script as
``python script.py`` would (``runpy``, ``sys.argv`` set, ``__name__ ==
"__main__"``), so ``torch.distributed.init_process_group()`` on ``env://``,
or ``pydist.init_process_group()``, joins the job.

[Note: pydist.run hosts the store, as torchrun's agent does]
torchrun's agent hosts the rendezvous store and tells its workers so with
``TORCHELASTIC_USE_AGENT_STORE=True``: every worker, rank 0 included, then
connects to it as a client. pydist.run does the same on rank 0: under MPI it
opens the store on a free port (port 0: no race between choosing and binding)
and agrees on it through MPI exactly as ``pydist.init_process_group`` does;
under Slurm, or Open MPI with a job id and every rank on one host, the port
comes from the job id and MPI is never loaded. The store lives as long as rank
0's script. Variables already set to other values are never overwritten (see
[Note: the torchrun variables after init]); under torchrun itself nothing is
derived and the script just runs.
"""

from __future__ import annotations

import datetime
import os
import runpy
import sys
from typing import NamedTuple

__all__ = ["main", "derive_torchrun_env", "TorchrunEnv"]

USAGE = "usage: python -m pydist.run [-m module | script.py] [args...]"
STORE_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default; the script's own timeout governs its group

_store = None  # rank 0's rendezvous store, kept alive while the script runs


class TorchrunEnv(NamedTuple):
    """The torchrun variables of this process, as pydist.run sets them."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str

    def variables(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                # See [Note: pydist.run hosts the store, as torchrun's agent does]
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


def derive_torchrun_env(timeout: datetime.timedelta = STORE_TIMEOUT) -> TorchrunEnv | None:
    """Work out this process's torchrun variables from its launcher, opening
    the store on rank 0. None under torchrun (it set them already)."""
    global _store
    from pydist.rendezvous.launchers import LauncherNotFound, detect
    from pydist.rendezvous.process_group import _host_store, _open_mpi_store

    info = detect(required=False)
    if info is not None and info.launcher == "torchrun":
        return None
    where = f"pydist.run under {info.launcher if info else 'no launcher'}"
    if info is None:  # a single process, as `torchrun --nproc_per_node=1` would run it
        _store = _host_store("127.0.0.1", 0, 1, timeout, where, bind="127.0.0.1")
        return TorchrunEnv(0, 0, 1, 1, "127.0.0.1", _store.port, "none")
    if info.uses_mpi and info.master_addr is None:
        opened = _open_mpi_store(info, timeout)
        if opened.rank == 0:
            _store = opened.store
        addr = "127.0.0.1" if opened.local_world_size == opened.world_size else opened.master_addr
        return TorchrunEnv(opened.rank, info.local_rank, opened.world_size, opened.local_world_size, addr,
                           opened.master_port, info.launcher)
    if info.local_world_size is None:
        raise LauncherNotFound(
            f"{where}: the launcher does not say how many ranks run on this host (LOCAL_WORLD_SIZE); under Slurm "
            "set SLURM_TASKS_PER_NODE and SLURM_NODEID (srun does), or set LOCAL_WORLD_SIZE"
        )
    if info.rank == 0:
        bind = "127.0.0.1" if info.master_addr == "127.0.0.1" else None
        _store = _host_store(info.master_addr, info.master_port, info.world_size, timeout, where, bind=bind)
    return TorchrunEnv(info.rank, info.local_rank, info.world_size, info.local_world_size, info.master_addr,
                       info.master_port, info.launcher)


def main(argv: list[str] | None = None) -> None:
    """``python -m pydist.run [-m module | script] args...``."""
    from pydist.rendezvous.process_group import _destroy_at_exit, export_torchrun_env

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        sys.stderr.write(USAGE + "\n")
        raise SystemExit(2)
    derived = derive_torchrun_env()
    if derived is not None:
        export_torchrun_env(derived.variables(), f"pydist.run under {derived.launcher}")
    # The script's own groups (torch's init_process_group) are destroyed at
    # exit while Python is alive, as pydist.init_process_group's are: gloo's
    # threads otherwise abort the rank in the interpreter's shutdown. See
    # [Note: exit cleanly under mpiexec] in pydist/rendezvous/process_group.py.
    _destroy_at_exit()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        if not os.path.exists(script):
            raise SystemExit(f"pydist.run: no such script: {script}\n{USAGE}")
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
