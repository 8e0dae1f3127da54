"""Choosing the transport of a DDP's gradient all-reduces: the process group,
or shared memory where every rank of the group shares one host.

    shm = open_shm_allreduce(params, group, wanted=None)   # collective; None: use the group

See [Note: which transport] in csrc/reducer/reducer.h for what the reducer
does with it; opening the segment is pydist/transport/shm_segment.py's.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch
import torch.distributed as dist

from pydist import _C
from pydist.transport import shm_segment

__all__ = ["open_shm_allreduce"]


def open_shm_allreduce(params: Sequence[torch.Tensor], group, wanted: bool | None) -> _C.ShmTransport | None:
    """Collective over ``group``: every rank calls it, with the same ``wanted``.

    wanted: None uses shared memory where every rank can, else the group;
    True requires it (raises, on every rank, saying why not); False never
    uses it. Ranks passing different values raise, every one of them, naming
    each rank's value. Returns this rank's end of the transport, or None for
    the group."""
    world_size = dist.get_world_size(group)
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
        shm, failure = shm_segment.map_segment_over_group(group)
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
