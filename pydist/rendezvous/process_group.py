"""``init_process_group``: one call that joins the job under any launcher.

    import pydist
    result = pydist.init_process_group()   # InitResult(rank=1, world_size=4, ...)

The steps, in order: ``detect()`` the launcher -> ``resolve_backend`` ->
``open_store`` (rank 0 hosts a TCPStore; under MPI it picks a free port and
broadcasts it) -> ``wait_for_ranks`` (every rank checks in, or a timeout names
the missing ones) -> ``torch.distributed.init_process_group`` on that store ->
the CUDA device from the local rank.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import socket
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from .launchers import LaunchInfo, LauncherConflict, detect

__all__ = ["init_process_group", "InitResult", "RendezvousTimeout", "PortInUse", "resolve_backend"]


class RendezvousTimeout(TimeoutError):
    """Some ranks did not check in within the timeout; the message names them."""


class PortInUse(RuntimeError):
    """Rank 0 could not listen on the rendezvous port."""


class InitResult(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    backend: str  # the torch.distributed backend name in use ("gloo", "nccl", "mpi4py", "mpi")
    launcher: str  # LaunchInfo.launcher, or "init_method" when only a URL was given


_ARRIVAL_POLL_S = 0.02
_attempts = itertools.count()  # [Note: one key space per attempt]


def resolve_backend(backend: str | None) -> str:
    """None -> nccl with CUDA, else gloo. "mpi" -> torch's own MPI backend when
    torch was built with one, else pydist's mpi4py backend (registered here)."""
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    name = backend.lower()
    if name == "mpi" and dist.is_mpi_available():
        return "mpi"
    if name in ("mpi", "mpi4py"):
        from pydist.backends.mpi4py_backend import register

        return register()
    return name


def _timeout(timeout) -> datetime.timedelta:
    if timeout is None:
        return datetime.timedelta(minutes=30)  # torch's default for gloo
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _listen_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "address already in use" in text or "eaddrinuse" in text or "errno 98" in text


def _host_store(addr: str, port: int, world_size: int, timeout: datetime.timedelta, where: str) -> dist.TCPStore:
    try:
        return dist.TCPStore(addr, port, world_size, True, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        if _listen_error(exc):
            raise PortInUse(
                f"{where}: rank 0 cannot listen on port {port} for the rendezvous store: the port is already "
                f"in use on {socket.gethostname()}; pick another MASTER_PORT (or unset it under MPI to get a free one)"
            ) from exc
        raise


def _join_store(addr: str, port: int, world_size: int, rank: int, timeout: datetime.timedelta, where: str):
    try:
        return dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    except (RuntimeError, OSError) as exc:
        raise RendezvousTimeout(
            f"{where}: rank {rank} of {world_size} could not reach the rendezvous store at {addr}:{port} within "
            f"{timeout.total_seconds():.0f} s; missing ranks: [0] (rank 0 hosts the store and never answered)"
        ) from exc


def _open_mpi_store(info: LaunchInfo, timeout: datetime.timedelta):
    """[Note: rendezvous under MPI]
    mpirun starts every rank at once but tells none of them a master address.
    Rank 0 opens the TCPStore on port 0 (the kernel picks a free port, so no
    race between choosing and binding) and broadcasts ``(host, ip, port)`` -- or
    its error, so the other ranks fail with it instead of waiting in the
    broadcast. Ranks on rank 0's host connect to 127.0.0.1."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    where = f"init_process_group under {info.launcher}"
    if info.world_size is not None and comm.Get_size() != info.world_size:
        raise LauncherConflict(
            f"{where}: the launcher says world size {info.world_size} but MPI_COMM_WORLD has {comm.Get_size()} ranks"
        )
    if comm.Get_rank() != info.rank:
        raise LauncherConflict(f"{where}: the launcher says rank {info.rank} but MPI_COMM_WORLD says {comm.Get_rank()}")
    rank, size = comm.Get_rank(), comm.Get_size()
    store, message = None, None
    if rank == 0:
        host = socket.gethostname()
        try:
            addr = os.environ.get("MASTER_ADDR") or socket.gethostbyname(host)
            port = int(os.environ.get("MASTER_PORT", 0))
            store = _host_store(addr, port, size, timeout, where)
            message = {"host": host, "addr": addr, "port": store.port}
        except BaseException as exc:  # noqa: BLE001 - sent to the others, then re-raised
            comm.bcast({"error": f"{type(exc).__name__}: {exc}"}, root=0)
            raise
    message = comm.bcast(message, root=0)
    if "error" in message:
        raise RuntimeError(f"{where}: rank {rank}: rank 0 failed to open the rendezvous store: {message['error']}")
    if rank != 0:
        addr = "127.0.0.1" if message["host"] == socket.gethostname() else message["addr"]
        store = _join_store(addr, message["port"], size, rank, timeout, where)
    return store, rank, size


def open_store(info: LaunchInfo, timeout: datetime.timedelta):
    """Return ``(store, rank, world_size)``. Rank 0 hosts the store, except
    under torchrun, whose agent already hosts one at MASTER_PORT."""
    if info.uses_mpi:
        return _open_mpi_store(info, timeout)
    where = f"init_process_group under {info.launcher}"
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if info.rank == 0 and not agent_hosts_it:
        store = _host_store(info.master_addr, info.master_port, info.world_size, timeout, where)
    else:
        store = _join_store(info.master_addr, info.master_port, info.world_size, info.rank, timeout, where)
    return store, info.rank, info.world_size


def wait_for_ranks(store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Check in, then wait until all ``world_size`` ranks have. On timeout,
    raise ``RendezvousTimeout`` naming the ranks that never checked in."""
    store.set(f"arrived/{rank}", "1")
    store.add("arrived", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add("arrived", 0) < world_size:
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"arrived/{r}"])]
            raise RendezvousTimeout(
                f"rank {rank}: ranks {missing} of {world_size} did not arrive within "
                f"{timeout.total_seconds():.0f} s (were they started, with the same WORLD_SIZE and MASTER_ADDR?)"
            )
        time.sleep(_ARRIVAL_POLL_S)


def init_process_group(backend: str | None = None, timeout=None, init_method: str | None = None) -> InitResult:
    """Join the default process group, whatever launched this process.

    ``backend``: None (nccl with CUDA, else gloo), any torch backend name, or
    "mpi" (torch's MPI backend if built in, else pydist's mpi4py backend).
    ``timeout``: seconds or a timedelta, for the rendezvous and the group.
    ``init_method``: a torch URL (``tcp://``, ``file://``) used instead of the
    launcher's address; rank and world size still come from the launcher if
    one is found, else from the URL's query.
    """
    info = detect(required=init_method is None)
    backend = resolve_backend(backend)
    timeout = _timeout(timeout)
    local_rank = info.local_rank if info else 0
    if torch.cuda.is_available():  # before the group exists, so NCCL binds to this device
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if init_method is not None:
        rank = info.rank if info else -1
        size = info.world_size if info and info.world_size is not None else -1
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    elif backend == "mpi":  # torch's own MPI backend reads MPI_COMM_WORLD itself
        dist.init_process_group(backend, timeout=timeout)
    else:
        store, rank, size = open_store(info, timeout)
        # See [Note: one key space per attempt]
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"pydist/{restart}/{next(_attempts)}", store)
        wait_for_ranks(store, rank, size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    _destroy_at_exit()
    return InitResult(dist.get_rank(), dist.get_world_size(), local_rank, backend,
                      info.launcher if info else "init_method")


# [Note: one key space per attempt]
# The store can outlive this call: torchrun's agent keeps its store across
# worker restarts, and a script may destroy and re-create its group. Keys are
# prefixed by the restart count and a per-process attempt number, so arrivals
# of an earlier attempt are never counted for this one.

# [Note: exit cleanly under mpiexec]
# A script that never calls destroy_process_group leaves its groups to be torn
# down during interpreter shutdown. Seen under mpiexec (backtrace in gdb): a
# gloo worker thread ("pt_gloo_runloop") frees its last finished work object
# *after* the caller saw it complete; freeing it drops Python tensors, which
# needs the GIL; if the interpreter is finalizing by then, CPython ends the
# thread with a forced unwind through a noexcept destructor, and
# std::terminate aborts the process ("terminate called without an active
# exception"), so mpiexec reports a failed job although the script succeeded.
# destroy_process_group alone does not help while the script still holds a
# group: gloo stops its threads only when the group object dies. So at exit,
# while Python is still fully alive: destroy every group (this also stops the
# mpi4py backend's MPI threads before mpi4py finalizes MPI, which runs after
# all atexit handlers), then release the GIL for EXIT_GRACE_S so the worker
# threads can drop what they hold.
EXIT_GRACE_S = 0.1
_registered = False


def _destroy_at_exit() -> None:
    global _registered
    if not _registered:
        atexit.register(_destroy_all)
        _registered = True


def _destroy_all() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    backend_module = sys.modules.get("pydist.backends.mpi4py_backend")
    if backend_module is not None:  # stop MPI threads of groups never destroyed
        backend_module.shutdown_all()
    time.sleep(EXIT_GRACE_S)  # See [Note: exit cleanly under mpiexec]
