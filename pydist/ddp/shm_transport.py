"""Choosing the transport of a DDP's gradient all-reduces: the process group,
or shared memory where every rank of the group shares one host.

    shm = open_shm_allreduce(params, group, wanted=None)   # collective; None: use the group

See [Note: which transport] in csrc/reducer/reducer.h for what the reducer
does with it, and [Note: shared-memory all-reduce] in csrc/shm/shm_allreduce.h
for the protocol. Whether ranks share a host is not guessed from host names:
rank 0 creates the segment and every other rank must map that very object,
so ranks in containers without a common /dev/shm fall back to the group.
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

__all__ = ["open_shm_allreduce"]


def open_shm_allreduce(params: Sequence[torch.Tensor], group, wanted: bool | None) -> _C.ShmAllreduce | None:
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
        if not _C.ShmAllreduce.supports(p.dtype):
            return f"a parameter is {p.dtype} (the transport takes float32, float64, bfloat16 and float16)"
    return None


def _map_segment(rank: int, world_size: int, group) -> tuple[_C.ShmAllreduce | None, str]:
    """Rank 0 creates the segment, the others map it; every rank learns
    whether all did. Returns (this rank's end, "") or (None, why not)."""
    timeout_s = _timeout(group).total_seconds()
    shm, failure = None, None
    names: list = [None] * world_size
    if rank == 0:
        shm, failure = _attach(f"/pydist-{os.getpid()}-{secrets.token_hex(6)}", rank, world_size, timeout_s)
    dist.all_gather_object(names, shm.name if shm is not None else None, group=group)
    if rank != 0 and names[0] is not None:
        shm, failure = _attach(names[0], rank, world_size, timeout_s)
    failures: list = [None] * world_size
    dist.all_gather_object(failures, failure, group=group)
    if rank == 0 and shm is not None:
        shm.unlink()  # every rank that could map it has; the memory goes with the last mapping
    failures = [f for f in failures if f]
    if failures:
        return None, "; ".join(failures)
    return shm, ""


def _attach(name: str, rank: int, world_size: int, timeout_s: float) -> tuple[_C.ShmAllreduce | None, str | None]:
    """This rank's end of segment ``name`` (rank 0 creates it), or (None, why not)."""
    try:
        return _C.ShmAllreduce(name, rank, world_size, create=(rank == 0), timeout_s=timeout_s), None
    except RuntimeError as exc:
        return None, f"rank {rank}: {exc}"


def _timeout(group) -> datetime.timedelta:
    """The group's collective timeout, which the transport's waits honour."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d.default_pg_timeout
