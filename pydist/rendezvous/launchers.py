"""Which launcher started this process, read from its environment.

    info = detect()          # LaunchInfo(launcher='openmpi', rank=1, ...)

One table, one reader per launcher family, no side effects: nothing here
imports MPI or opens a socket, so ``detect()`` is safe to call anywhere.

[Note: which launcher wins]
Launchers nest: ``srun torchrun ...`` (torchrun's workers inherit Slurm's
variables), ``mpirun`` inside an ``sbatch`` allocation (the ranks inherit the
batch step's ``SLURM_PROCID``), SageMaker starting ``mpirun`` (``SM_*`` names
hosts, not processes). The innermost launcher is the one that numbered *this*
process, so families are read in the order of ``LAUNCHERS`` below and the first
present wins:

  1. torchrun / ``torch.distributed.launch`` (``RANK``, ``WORLD_SIZE``)
  2. the MPI launchers: Open MPI, PMIx, MPICH / Intel MPI / Hydra
  3. Slurm ``srun``
  4. SageMaker

A family that cannot describe this process is ignored when a more specific one
is present: Slurm and SageMaker under any other launcher, and every outer
launcher under torchrun's elastic agent (it sets ``TORCHELASTIC_RUN_ID``).
Every other pair of families that is present must agree on rank and world
size; if they do not, ``detect()`` raises ``LauncherConflict`` naming the
variables, because guessing would put two processes on the same rank.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Callable, Mapping, NamedTuple, Sequence

__all__ = ["LaunchInfo", "LauncherNotFound", "LauncherConflict", "detect", "first_slurm_host", "LAUNCHERS"]

DEFAULT_PORT = 29500  # torchrun's default MASTER_PORT, used where a launcher names none
# Set by init_process_group to the launcher family it derived the torchrun
# variables from: while that family is present, those variables are pydist's
# own output, not a torchrun launch (see process_group.py).
EXPORTED_FROM_ENV = "PYDIST_TORCHRUN_ENV_FROM"


class LauncherNotFound(RuntimeError):
    """No launcher variables were found; the message lists what was looked for."""


class LauncherConflict(ValueError):
    """Launcher variables contradict each other; the message names them."""


class LaunchInfo(NamedTuple):
    """What the launcher told this process. ``None`` means "not known yet"."""

    launcher: str  # family name, a key of LAUNCHERS ("torchrun", "openmpi", ...)
    rank: int
    world_size: int | None  # None under bare PMIx: MPI's COMM_WORLD gives it
    local_rank: int
    master_addr: str | None  # None under MPI: rank 0 broadcasts it
    master_port: int | None
    uses_mpi: bool  # True: rendezvous over mpi4py (rank 0 picks the port)
    variables: tuple[str, ...]  # the environment variables it was read from
    local_world_size: int | None = None  # ranks on this host, where the launcher says


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        number = int(value)
    except ValueError:
        raise LauncherConflict(f"environment variable {name}={value!r} is not an integer") from None
    if number < 0:
        raise LauncherConflict(f"environment variable {name}={value!r} is negative")
    return number


def _legacy_local_rank(argv: Sequence[str]) -> int | None:
    """``python -m torch.distributed.launch`` passes ``--local_rank=N`` (or
    ``--local-rank N``) to the script instead of setting ``LOCAL_RANK``."""
    for i, arg in enumerate(argv):
        for flag in ("--local_rank", "--local-rank"):
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            else:
                continue
            try:
                return int(value)
            except ValueError:
                raise LauncherConflict(f"command-line argument {flag}={value!r} is not an integer") from None
    return None


def _master(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    return env.get("MASTER_ADDR"), port


def _torchrun(env, argv):
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    arg_local = _legacy_local_rank(argv)
    if "LOCAL_RANK" in env:
        local = _int(env, "LOCAL_RANK")
        if arg_local is not None and arg_local != local:
            raise LauncherConflict(f"LOCAL_RANK={local} contradicts the command-line argument --local_rank={arg_local}")
    else:
        local = arg_local if arg_local is not None else 0
    addr, port = _master(env)
    missing = [n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None]
    if missing:
        raise LauncherNotFound(
            f"RANK and WORLD_SIZE are set (torchrun-style launch) but {' and '.join(missing)} "
            "is not: set it, or launch with torchrun, which sets all four"
        )
    local_size = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None
    return LaunchInfo("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"), local, addr, port, False,
                      ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"), local_size)


def _job_port(job_id: int) -> int:
    """[Note: Slurm port] one port per job, so two jobs sharing a node do not collide."""
    return 20000 + job_id % 20000


def _mpi(name, rank_var, size_var, local_var, local_size_var=None, job_var=None):
    def read(env, argv):
        if rank_var not in env:
            return None
        size = _int(env, size_var) if size_var and size_var in env else None
        local = _int(env, local_var) if local_var and local_var in env else 0
        local_size = _int(env, local_size_var) if local_size_var and local_size_var in env else None
        used = tuple(v for v in (rank_var, size_var, local_var) if v)
        # [Note: rendezvous without MPI] a launcher that gives a job id and the first
        # host (every rank local, or MASTER_ADDR) lets backends other than MPI agree on
        # the store without loading MPI at all; see open_store in process_group.py.
        addr = port = None
        if job_var and job_var in env and size is not None:
            addr = env.get("MASTER_ADDR") or ("127.0.0.1" if local_size == size else None)
            if addr is not None:
                port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else _job_port(_int(env, job_var))
        return LaunchInfo(name, _int(env, rank_var), size, local, addr, port, True, used, local_size)

    return read


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: ``"gpu[003-005,9],cpu1"`` -> ``"gpu003"``."""
    m = re.match(r"([^,\[]*)(\[([^\]]*)\])?", nodelist.strip())
    if not m or not (m.group(1) or m.group(3)):
        raise LauncherConflict(f"SLURM_JOB_NODELIST={nodelist!r} is not a Slurm hostlist")
    prefix, ranges = m.group(1), m.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]  # zero padding is kept: "003"
    return prefix + first


def _slurm(env, argv):
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LauncherNotFound("SLURM_PROCID is set but SLURM_JOB_NODELIST is not: cannot find the first host")
    addr = env.get("MASTER_ADDR") or first_slurm_host(nodelist)
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else (
        _job_port(_int(env, "SLURM_JOB_ID")) if "SLURM_JOB_ID" in env else DEFAULT_PORT)
    local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    return LaunchInfo("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), local, addr, port, False,
                      ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST"), _slurm_local_size(env))


def slurm_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE``: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LauncherConflict(f"SLURM_TASKS_PER_NODE={spec!r} is not a Slurm task count list")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _slurm_local_size(env) -> int | None:
    if "SLURM_TASKS_PER_NODE" not in env or "SLURM_NODEID" not in env:
        return None
    counts, node = slurm_tasks_per_node(env["SLURM_TASKS_PER_NODE"]), _int(env, "SLURM_NODEID")
    return counts[node] if node < len(counts) else None


def _sagemaker(env, argv):
    """One process per host (SageMaker's own launcher for PyTorch); a script
    started per GPU is started by torchrun or mpirun, which come first."""
    if "SM_HOSTS" not in env or "SM_CURRENT_HOST" not in env:
        return None
    try:
        hosts = sorted(json.loads(env["SM_HOSTS"]))
    except (ValueError, TypeError):
        raise LauncherConflict(f"SM_HOSTS={env['SM_HOSTS']!r} is not a JSON list of host names") from None
    current = env["SM_CURRENT_HOST"]
    if current not in hosts:
        raise LauncherConflict(f"SM_CURRENT_HOST={current!r} is not in SM_HOSTS={hosts}")
    addr, port = _master(env)
    return LaunchInfo("sagemaker", hosts.index(current), len(hosts), 0, addr or hosts[0], port or DEFAULT_PORT,
                      False, ("SM_HOSTS", "SM_CURRENT_HOST", "SM_NUM_GPUS"), 1)


# name -> reader, in the order of [Note: which launcher wins].
LAUNCHERS: dict[str, Callable[[Mapping[str, str], Sequence[str]], LaunchInfo | None]] = {
    "torchrun": _torchrun,
    "openmpi": _mpi("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_MCA_ess_base_jobid"),
    "pmix": _mpi("pmix", "PMIX_RANK", None, None),
    "mpich": _mpi("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "slurm": _slurm,
    "sagemaker": _sagemaker,
}
_OUTER_ONLY = {"slurm", "sagemaker"}  # describe allocations; ignored under any other launcher


def _looked_for() -> str:
    return (
        "torchrun / torch.distributed.launch (RANK, WORLD_SIZE, LOCAL_RANK or --local_rank, MASTER_ADDR, "
        "MASTER_PORT); Open MPI (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK); "
        "PMIx (PMIX_RANK); MPICH / Intel MPI / Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID); "
        "Slurm srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST); "
        "SageMaker (SM_HOSTS, SM_CURRENT_HOST, SM_NUM_GPUS)"
    )


def detect(env: Mapping[str, str] | None = None, argv: Sequence[str] | None = None, *, required: bool = True
           ) -> LaunchInfo | None:
    """Say which launcher started this process, without initializing anything.

    Raises ``LauncherNotFound`` (listing every variable looked for) when none
    did and ``required`` is true, else returns None. Raises
    ``LauncherConflict`` naming the variables that contradict each other.
    See [Note: which launcher wins].
    """
    env = os.environ if env is None else env
    argv = sys.argv[1:] if argv is None else argv
    found, incomplete = [], None
    for read in LAUNCHERS.values():
        try:
            info = read(env, argv)
        except LauncherNotFound as exc:  # RANK and WORLD_SIZE without MASTER_*: stale, if another family is whole
            if read is not _torchrun:
                raise
            incomplete = exc
            continue
        if info is not None:
            found.append(info)
    # See [Note: the torchrun variables after init] in process_group.py
    derived_from = env.get(EXPORTED_FROM_ENV)
    if found and found[0].launcher == "torchrun" and any(i.launcher == derived_from for i in found[1:]):
        found = found[1:]
    if incomplete is not None:
        if found:
            stale = [n for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if n in env]
            raise LauncherConflict(
                f"{found[0].launcher} started this process ({', '.join(f'{v}={env[v]}' for v in found[0].variables if v in env)}) "
                f"but {', '.join(f'{v}={env[v]}' for v in stale)} are also set, as torchrun sets them, without "
                f"MASTER_ADDR/MASTER_PORT: they are probably left over from another launch; unset "
                f"{' and '.join(stale)}"
            ) from incomplete
        raise incomplete
    if not found:
        if required:
            raise LauncherNotFound(f"no launcher environment found; looked for {_looked_for()}")
        return None
    primary = found[0]
    if primary.launcher == "torchrun" and "TORCHELASTIC_RUN_ID" in env:
        others = []  # the elastic agent renumbers its workers
    else:
        others = [i for i in found[1:] if i.launcher not in _OUTER_ONLY]
    for other in others:
        for field in ("rank", "world_size"):
            a, b = getattr(primary, field), getattr(other, field)
            if a is not None and b is not None and a != b:
                raise LauncherConflict(
                    f"launcher variables disagree on the {field.replace('_', ' ')}: {primary.launcher} "
                    f"({', '.join(primary.variables)}) says {a} but {other.launcher} ({', '.join(other.variables)}) "
                    f"says {b}; unset the variables of the launcher that did not start this process"
                )
    if primary.world_size is None:  # PMIx alone carries no size; a sibling family may
        sizes = [i.world_size for i in others if i.world_size is not None]
        if sizes:
            primary = primary._replace(world_size=sizes[0])
    local_size = primary.local_world_size
    if local_size is not None and not (primary.local_rank < local_size and
                                       (primary.world_size is None or local_size <= primary.world_size)):
        raise LauncherConflict(
            f"{primary.launcher}: local rank {primary.local_rank} and local world size {local_size} do not fit a "
            f"world of {primary.world_size} (variables {', '.join(primary.variables)}, and the local world size's)"
        )
    if primary.world_size is not None and primary.rank >= primary.world_size:
        raise LauncherConflict(
            f"{primary.launcher}: rank {primary.rank} is not below the world size {primary.world_size} "
            f"(variables {', '.join(primary.variables)})"
        )
    return primary
