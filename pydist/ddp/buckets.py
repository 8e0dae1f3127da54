"""Which gradients travel together: the bucket assignment.

Buckets are lists of parameter indices, reduced by one collective each, in
list order. Two assignments happen in a model's life:

1. At construction, from the parameter order (see ``initial_buckets``).
2. Once, after the first iteration, from the order gradients actually became
   ready (``Reducer.pending_rebuild_order()``), when ``rebuilds_buckets`` says
   so (this module decides; the reducer only records the order), so that the first bucket to fill is the
   first to launch. Ranks may see slightly different orders; all adopt rank 0's
   assignment (``agree_on_buckets``) so every rank launches the same
   collectives in the same sequence.

[Note: same buckets as torch]
The grouping rule is torch DDP's, so that sums happen over the same bucket
layout (bitwise-equal gradients, and comm hooks such as PowerSGD that key
their state on bucket index see the same buckets): walk the parameters in the
given order, keep one open bucket per (dtype, device), close it when its size
reaches the current cap; the first bucket of each kind closes at the smaller
``first_cap`` and the rest at ``cap``.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch
import torch.distributed as dist

MB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_CAP_MB = 1


def bucket_caps(bucket_cap_mb: float | None, first_bucket_cap_mb: float | None = None) -> tuple[int, int]:
    """(first bucket's cap, every later bucket's cap) in bytes, from the
    wrapper's keywords. Torch's rule: a 1 MB first bucket only when the cap
    is left at its default; else the first bucket takes the cap too."""
    cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    if first_bucket_cap_mb is None:
        first_bucket_cap_mb = DEFAULT_FIRST_BUCKET_CAP_MB if bucket_cap_mb is None else cap_mb
    return int(first_bucket_cap_mb * MB), int(cap_mb * MB)


def assign_by_size(
    params: Sequence[torch.Tensor], order: Sequence[int], caps: Sequence[int]
) -> list[list[int]]:
    """Group ``params`` (visited in ``order``) into buckets of at most ``caps``
    bytes: ``caps[0]`` for the first bucket of each dtype/device, then the
    next cap, the last cap repeating. See [Note: same buckets as torch]."""
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    cap_index: dict[tuple, int] = {}
    closed: list[list[int]] = []
    for index in order:
        p = params[index]
        key = (p.dtype, p.device)
        open_buckets.setdefault(key, []).append(index)
        open_bytes[key] = open_bytes.get(key, 0) + p.numel() * p.element_size()
        level = cap_index.setdefault(key, 0)
        if open_bytes[key] >= caps[level]:
            closed.append(open_buckets.pop(key))
            open_bytes[key] = 0
            cap_index[key] = min(level + 1, len(caps) - 1)
    closed.extend(b for b in open_buckets.values() if b)
    return closed


def rebuilds_buckets(find_unused_parameters: bool, static_graph: bool) -> bool:
    """Whether the buckets are rebuilt once, after the first iteration, from
    the order gradients became ready (the reducer records that order only
    when told so). Torch's rule: not with find_unused_parameters (unless
    static_graph), where the set of gradients may change every iteration."""
    return static_graph or not find_unused_parameters


def initial_buckets(params: Sequence[torch.Tensor], first_cap: int, cap: int, rebuilt: bool) -> list[list[int]]:
    """The construction-time assignment, in launch order.

    Buckets that will be ``rebuilt`` from the real gradient order after the
    first iteration (see ``rebuilds_buckets``) start as one bucket per
    dtype/device rather than guess an order. Otherwise the buckets stay as
    assigned here: parameters in model order, then the list reversed, since
    backward produces gradients roughly last layer first.
    """
    caps = [sys.maxsize] if rebuilt else [first_cap, cap]
    buckets = assign_by_size(params, range(len(params)), caps)
    buckets.sort(key=min)
    return list(reversed(buckets))


def rebuilt_buckets(params: Sequence[torch.Tensor], ready_order: Sequence[int], first_cap: int, cap: int) -> list[list[int]]:
    """The assignment from the order gradients became ready; parameters the
    order lacks (none, normally) go last."""
    seen = set(ready_order)
    order = list(ready_order) + [i for i in range(len(params)) if i not in seen]
    return assign_by_size(params, order, [first_cap, cap])


def agree_on_buckets(buckets: list[list[int]], num_params: int, group, device: torch.device) -> list[list[int]]:
    """Every rank adopts rank 0's assignment: one broadcast of
    [number of buckets, each bucket's length..., the indices...], on the
    model's ``device``: a group may serve only that device (NCCL has no CPU
    tensors)."""
    packed = torch.full((1 + 2 * num_params,), -1, dtype=torch.int64, device=device)
    if dist.get_rank(group) == 0:
        flat = [i for b in buckets for i in b]
        data = [len(buckets)] + [len(b) for b in buckets] + flat
        packed[: len(data)] = torch.tensor(data, dtype=torch.int64, device=device)
    dist.broadcast(packed, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    values = packed.tolist()
    count, lengths = values[0], values[1 : 1 + values[0]]
    flat = values[1 + count :]
    out, start = [], 0
    for length in lengths:
        out.append(flat[start : start + length])
        start += length
    return out
