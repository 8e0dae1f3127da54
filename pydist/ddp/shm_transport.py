"""Choosing the transport of a DDP's gradient all-reduces: the process group,
or shared memory where every rank of the group shares one host.

    shm = open_shm_allreduce(params, group, wanted=None)   # collective; None: use the group

See [Note: which transport] in csrc/reducer/reducer.h for what the reducer
does with it, and [Note: shared-memory all-reduce] in
csrc/transport/shm_transport.h for the protocol. Whether ranks share a host is not guessed from host names:
rank 0 creates the segment and every other rank must map that very object,
so ranks in containers without a common /dev/shm fall back to the group.

The segment's name is removed on every path out of the set-up, and names an
earlier job on this host could not remove are swept before a new one is
made: see [Note: the segment's name lives only while ranks attach] in
csrc/transport/shm_transport.h.
"""

from __future__ import annotations

import datetime
import os
import secrets
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from pydist import _C

__all__ = ["open_shm_allreduce", "sweep_stale_segments"]

SHM_DIR = "/dev/shm"
# Segment names: /pydist-<creator's pid namespace inode>-<creator's pid>-<random>.
_SEGMENT_PREFIX = "pydist-"


def open_shm_allreduce(params: Sequence[torch.Tensor], group, wanted: bool | None) -> _C.ShmTransport | None:
    """Collective over ``group``: every rank calls it, with the same ``wanted``.

    wanted: None uses shared memory where every rank can, else the group;
    True requires it (raises, on every rank, saying why not); False never
    uses it. Ranks passing different values raise, every one of them, naming
    each rank's value. Returns this rank's end of the transport, or None for
    the group."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    why_not = _why_not_here(params, world_size) if wanted is not False else None
    verdicts: list = [None] * world_size
    dist.all_gather_object(verdicts, (wanted, why_not), group=group)
    if len({w for w, _ in verdicts}) > 1:
        values = ", ".join(f"rank {r}: {w}" for r, (w, _) in enumerate(verdicts))
        raise ValueError(f"DistributedDataParallel: shm_allreduce differs across ranks ({values}); pass the same on every rank")
    if wanted is False:
        return None
    refusals = [f"rank {r}: {reason}" for r, (_, reason) in enumerate(verdicts) if reason]
    if not refusals:
        shm, failure = _map_segment(rank, world_size, group)
        if shm is not None:
            return shm
        refusals = [failure]
    if wanted:
        raise RuntimeError(
            "DistributedDataParallel(shm_allreduce=True): this group cannot all-reduce through shared memory ("
            + "; ".join(refusals)
            + "). Pass shm_allreduce=None to fall back to the process group."
        )
    return None


def _why_not_here(params: Sequence[torch.Tensor], world_size: int) -> str | None:
    """What keeps this rank off the shared-memory path, or None."""
    if not sys.platform.startswith("linux"):
        return f"the shared-memory transport is Linux-only (this is {sys.platform})"
    if world_size < 2:
        return "a group of one rank has nothing to all-reduce"
    for p in params:
        if p.device.type != "cpu":
            return f"a parameter is on {p.device} (the transport carries CPU tensors)"
        if not _C.ShmTransport.supports(p.dtype):
            return f"a parameter is {p.dtype} (the transport takes float32, float64, bfloat16 and float16)"
    return None


def _map_segment(rank: int, world_size: int, group) -> tuple[_C.ShmTransport | None, str]:
    """Rank 0 creates the segment, the others map it; every rank learns
    whether all did. Returns (this rank's end, "") or (None, why not)."""
    timeout_s = _timeout(group).total_seconds()
    shm, failure = None, None
    names: list = [None] * world_size
    try:
        if rank == 0:
            sweep_stale_segments()
            shm, failure = _attach(_new_segment_name(), rank, world_size, timeout_s)
        dist.all_gather_object(names, shm.segment_name if shm is not None else None, group=group)
        if rank != 0 and names[0] is not None:
            shm, failure = _attach(names[0], rank, world_size, timeout_s)
        failures: list = [None] * world_size
        dist.all_gather_object(failures, failure, group=group)
    finally:
        # Every rank that could map it has, or the set-up failed (a peer died,
        # an interrupt): the name goes either way; the memory goes with the
        # last mapping.
        if rank == 0 and shm is not None:
            shm.unlink()
    failures = [f for f in failures if f]
    if failures:
        return None, "; ".join(failures)
    return shm, ""


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


def _timeout(group) -> datetime.timedelta:
    """The group's collective timeout, which the transport's waits honour."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d.default_pg_timeout
