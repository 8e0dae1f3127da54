"""Making replicas identical: the cross-rank model check and broadcasts.

``verify_same_model`` runs once at construction and raises, on every rank,
an error naming the first parameter that differs between ranks, before any
collective could block on a mismatch. ``broadcast_tensors`` copies parameters
and buffers from one rank to all, one collective per dtype (the fused flatten
packs them).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from pydist import ops


def verify_same_model(named_params: Sequence[tuple[str, torch.Tensor]], group) -> None:
    """Raise on every rank if ranks hold different parameters (count, names
    order, shapes or dtypes), naming the first difference."""
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in named_params]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        for index, (ref, other) in enumerate(zip(reference, theirs)):
            if ref != other:
                raise RuntimeError(
                    f"DistributedDataParallel: the model differs across ranks at parameter {index}: "
                    f"rank 0 has {ref[0]} {list(ref[1])} {ref[2]}, rank {rank} has "
                    f"{other[0]} {list(other[1])} {other[2]}. Every rank must build the same model."
                )
        longer = rank if len(theirs) > len(reference) else 0
        extra = (theirs if len(theirs) > len(reference) else reference)[min(len(reference), len(theirs))]
        raise RuntimeError(
            f"DistributedDataParallel: rank 0 has {len(reference)} parameters but rank {rank} has "
            f"{len(theirs)}; the first parameter only rank {longer} has is {extra[0]} "
            f"{list(extra[1])} {extra[2]}. Every rank must build the same model."
        )


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, group) -> None:
    """Overwrite ``tensors`` on every rank with global rank ``src``'s values: one
    broadcast per (dtype, device) group, packed with the fused flatten."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for same_kind in groups.values():
        flat = ops.flatten([t.detach() for t in same_kind])
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:
            ops.unflatten_into(flat, [t.detach() for t in same_kind])
