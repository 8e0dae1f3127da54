"""What a root publishes to those who subscribed (the overlap lab): each
iteration's collectives in the record schema DDP's reducer uses (see
[Note: one record schema] in pydist/ddp/records.py).

Nothing here runs unless something subscribed (``FSDPState.subscribe``):
the root then stamps its forward and backward start, and at the end of its
final callback hands each subscriber one ``IterationRecord``.
"""

from __future__ import annotations

import torch.distributed as dist

from pydist.ddp.records import BucketTiming, ChunkTiming, IterationRecord

__all__ = ["iteration_record"]

_NOT = -1e-6  # an event that did not happen, as the reducer's records write it


def iteration_record(root, finalize_end_ns: int) -> IterationRecord:
    """``root``'s iteration just finished, one bucket per collective: the
    units of a batch (see [Note: batched collectives] in _fsdp_collectives.py)
    each hold the collective's record; they become one bucket naming them
    all. A bucket's index is stable over iterations (the first time its units,
    kind and phase were seen), so the lab can follow one across steps."""
    start = root.forward_start_ns
    ms = lambda ns: (ns - start) / 1e6 if ns >= 0 else _NOT  # noqa: E731
    merged: dict[tuple, list] = {}  # (kind, phase, issued, completed) -> [needed, units, bytes, params]
    for pg in root._units:
        for kind, phase, issued, needed, completed in pg._timings:
            entry = merged.setdefault((kind, phase, issued, completed), [needed, [], 0, 0])
            entry[0] = min(entry[0], needed)
            entry[1].append(pg.label)
            entry[2] += pg.unsharded_nbytes if kind == "all_gather" else pg.padded_numel * pg.reduce_dtype.itemsize
            entry[3] += len(pg.fsdp_params)
    indices = root.record_indices
    buckets = []
    for (kind, phase, issued, completed), (needed, units, nbytes, params) in sorted(merged.items(),
                                                                                   key=lambda kv: kv[0][2]):
        unit = "+".join(units)
        index = indices.setdefault((unit, kind, phase), len(indices))
        grads = ms(issued) if kind != "all_gather" else _NOT  # a reduction is issued once the unit's grads are ready
        buckets.append(BucketTiming(
            index, params, nbytes, grads, grads, ms(issued), ms(completed), ms(max(needed, completed)),
            (ChunkTiming(0, nbytes, kind, ms(issued), ms(completed)),), unit=unit, phase=phase, needed_ms=ms(needed)))
    transport = root.transport
    return IterationRecord(
        iteration=root.iteration - 1,  # the root counts forwards from 1; the reducer's iterations count from 0
        rank=dist.get_rank(root.group),
        transport=getattr(transport, "name", type(transport).__name__),
        start_ns=start,
        backward_end_ms=ms(root.backward_end_ns),
        finalize_end_ms=ms(finalize_end_ns),
        buckets=buckets,
        backward_start_ms=ms(root.backward_start_ns) if root.backward_start_ns >= 0 else 0.0,
    )
