"""Opening the shared-memory transport: rank 0 creates a named segment, the
other ranks of the group map that very object, and the name is removed again.

    shm, why_not = map_segment(rank, world_size, allgather, timeout_s)   # collective
    shm, why_not = map_segment_over_group(group)                          # a torch group
    shm, why_not = map_segment_over_comm(comm, timeout_s)                 # an mpi4py communicator

Whether ranks share a host is not guessed from host names: rank 0 creates the
segment and every other rank must map that very object, so ranks in
containers without a common /dev/shm get (None, why not) on every rank.
Who uses it and when is decided by the callers: ``pydist.transport.open_shm``
(for DistributedDataParallel, see [Note: which transport], and the sharded
wrapper) and the mpi4py backend's large all-reduces
(pydist/backends/mpi4py_backend.py). See [Note: shared-memory all-reduce] in
csrc/transport/shm_transport.h for the protocol.

The segment's name is removed on every path out of the set-up, and names an
earlier job on this host could not remove are swept before a new one is
made: see [Note: the segment's name lives only while ranks attach] in
csrc/transport/shm_transport.h.
"""

from __future__ import annotations

import atexit
import datetime
import os
import secrets
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from pydist import _C

__all__ = ["map_segment", "map_segment_over_group", "map_segment_over_comm", "map_pair_segments",
           "sweep_stale_segments", "group_timeout", "close_all"]

SHM_DIR = "/dev/shm"
# Segment names: /pydist-<creator's pid namespace inode>-<creator's pid>-<random>.
_SEGMENT_PREFIX = "pydist-"


def map_segment_over_group(group) -> tuple[_C.ShmTransport | None, str]:
    """Collective over the torch process group ``group``; see map_segment."""
    world_size = dist.get_world_size(group)

    def allgather(obj) -> list:
        out: list = [None] * world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    return map_segment(dist.get_rank(group), world_size, allgather, group_timeout(group).total_seconds())


def map_segment_over_comm(comm, timeout_s: float) -> tuple[_C.ShmTransport | None, str]:
    """Collective over the mpi4py communicator ``comm``; see map_segment."""
    return map_segment(comm.Get_rank(), comm.Get_size(), comm.allgather, timeout_s)


def map_segment(rank: int, world_size: int, allgather: Callable[[object], list],
                timeout_s: float) -> tuple[_C.ShmTransport | None, str]:
    """Collective: rank 0 creates the segment, the others map it; every rank
    learns whether all did. ``allgather(obj)`` returns every rank's ``obj``
    in rank order (the group's object all-gather); the transport's waits give
    up after ``timeout_s``. Returns (this rank's end, "") or (None, why not),
    the same verdict on every rank."""
    shm, failure = None, None
    try:
        if rank == 0:
            sweep_stale_segments()
            shm, failure = _attach(_new_segment_name(), rank, world_size, timeout_s)
        names = allgather(shm.segment_name if shm is not None else None)
        if rank != 0 and names[0] is not None:
            shm, failure = _attach(names[0], rank, world_size, timeout_s)
        failures = allgather(failure)
    finally:
        # Every rank that could map it has, or the set-up failed (a peer died,
        # an interrupt): the name goes either way; the memory goes with the
        # last mapping.
        if rank == 0 and shm is not None:
            shm.unlink()
    failures = [f for f in failures if f]
    if failures:
        return None, "; ".join(failures)
    global _close_at_exit
    if not _close_at_exit:
        _close_at_exit = atexit.register(close_all)  # see [Note: leaving the segment at exit]
    _opened.add(shm)
    return shm, ""


def map_pair_segments(group, pairs: list[tuple[int, int]],
                      timeout_s: float) -> tuple[dict[int, _C.ShmTransport] | None, str]:
    """Collective over the torch process group ``group``: one two-rank
    segment per entry of ``pairs`` (group ranks (a, b), a != b), every rank
    of the group passing the same list. Rank a of a pair creates it and is
    rank 0 of its transport, b maps it as rank 1. Returns ({index in pairs:
    this rank's end} for the pairs this rank is in, "") or (None, why not),
    the same verdict on every rank; on failure every end opened is closed.
    Two all_gather_object calls over ``group`` in all (the pipelining's
    point-to-point channels: pydist/pipelining/_p2p.py)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    ends: dict[int, _C.ShmTransport] = {}
    created: list[_C.ShmTransport] = []
    failure = None
    try:
        if any(a == rank for a, _ in pairs):
            sweep_stale_segments()
        names: dict[int, str] = {}
        for i, (a, _) in enumerate(pairs):
            if a == rank and failure is None:
                shm, failure = _attach(_new_segment_name(), 0, 2, timeout_s)
                if shm is not None:
                    ends[i] = shm
                    created.append(shm)
                    names[i] = shm.segment_name
        every_names: list = [None] * world_size
        dist.all_gather_object(every_names, names, group=group)
        for i, (a, b) in enumerate(pairs):
            if b == rank and failure is None:
                name = every_names[a].get(i)
                if name is None:
                    failure = f"rank {a} could not create the segment for ranks ({a}, {b})"
                    continue
                shm, failure = _attach(name, 1, 2, timeout_s)
                if shm is not None:
                    ends[i] = shm
        failures: list = [None] * world_size
        dist.all_gather_object(failures, failure, group=group)
    finally:
        for shm in created:  # every peer that could map has (see map_segment)
            shm.unlink()
    failures = [f for f in failures if f]
    if failures:
        for shm in ends.values():
            shm.close()
        return None, "; ".join(failures)
    global _close_at_exit
    if not _close_at_exit:
        _close_at_exit = atexit.register(close_all)  # see [Note: leaving the segment at exit]
    for shm in ends.values():
        _opened.add(shm)
    return ends, ""


# [Note: leaving the segment at exit]
# A rank that leaves mid-training without a fault its peers could see (a
# sys.exit(0) in the loop, an exception under a launcher that does not kill
# the job) must mark its end gone before anything at exit can block, or its
# peers wait out the whole timeout in their next collective. Under mpiexec
# the exit blocks in MPI_Finalize until every rank finalizes; an end not
# destroyed before it (a sharded model's, held by its units, was seen alive
# there in gdb) stays attached, and the peers waiting on it wait out their
# timeout before they fail. So an atexit handler (Python's, which all run before
# mpi4py finalizes MPI, whoever made the process group) closes every end
# this process opened: a peer still waiting fails at once, naming this rank
# as having shut its end down. A rank that finished its last collective
# closes as its destructor would have, only earlier.
_opened: "weakref.WeakSet[_C.ShmTransport]" = weakref.WeakSet()
_close_at_exit = None  # close_all, once registered with atexit


def close_all() -> None:
    """Closes every shared-memory end this process opened that is still
    alive. See [Note: leaving the segment at exit]."""
    for shm in list(_opened):
        shm.close()


def _attach(name: str, rank: int, world_size: int, timeout_s: float) -> tuple[_C.ShmTransport | None, str | None]:
    """This rank's end of segment ``name`` (rank 0 creates it), or (None, why not)."""
    try:
        return _C.ShmTransport(name, rank, world_size, create=(rank == 0), timeout_s=timeout_s), None
    except RuntimeError as exc:
        return None, f"rank {rank}: {exc}"


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _new_segment_name() -> str:
    return f"/{_SEGMENT_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(6)}"


def _process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited: gone, or a zombie (which ``kill(pid, 0)`` calls alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X", "x")


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Removes the segments whose creator (a rank 0 of this pid namespace)
    has exited: a job killed while its ranks were attaching. Returns their
    names. Names from other pid namespaces, or of a creator still running,
    are left alone."""
    namespace = str(_pid_namespace())
    removed = []
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return removed
    for entry in entries:
        parts = entry[len(_SEGMENT_PREFIX):].split("-") if entry.startswith(_SEGMENT_PREFIX) else []
        if len(parts) != 3 or parts[0] != namespace or not parts[1].isdigit() or namespace == "0":
            continue
        if _process_gone(int(parts[1])):
            try:
                os.unlink(os.path.join(shm_dir, entry))
                removed.append(entry)
            except OSError:
                pass  # another rank 0 swept it first, or it is not ours to remove
    return removed


def group_timeout(group) -> datetime.timedelta:
    """The group's collective timeout, which the transport's waits honour."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d.default_pg_timeout
