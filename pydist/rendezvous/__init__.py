"""Rendezvous from any launcher: ``detect()`` reads the environment (no side
effects), ``init_process_group()`` joins the job. See launchers.py for the
launcher table and process_group.py for the steps."""

from .launchers import LAUNCHERS, LaunchInfo, LauncherConflict, LauncherNotFound, detect, first_slurm_host
from .mpi_runtime import MPINotAvailable, load_mpi
from .process_group import (TORCHRUN_VARIABLES, InitResult, PortInUse, RendezvousError, RendezvousTimeout,
                            export_torchrun_env, init_process_group, resolve_backend)

__all__ = [
    "LAUNCHERS", "LaunchInfo", "LauncherConflict", "LauncherNotFound", "detect", "first_slurm_host",
    "InitResult", "PortInUse", "RendezvousTimeout", "RendezvousError", "init_process_group", "resolve_backend",
    "MPINotAvailable", "load_mpi", "TORCHRUN_VARIABLES", "export_torchrun_env",
]
