"""The collectives of sharded data parallelism, as free functions over a
``pydist.transport.Transport``: the one seam every byte pydist's FSDP moves
between ranks goes through (see [Note: transports] in
csrc/transport/transport.h).

    transport = open_transport(group, shm=None)          # collective, once per root
    fut = all_gather_unit(transport, shard, unsharded)   # unshard one unit
    fut = all_gather_units(transport, shards, outputs)   # unshard several as one collective
    rs = reduce_scatter_grads(transport, layout, grads, scale)   # post-backward
    rs.future.wait(); rs.output                          # this rank's summed shard
    rss = reduce_scatter_units(transport, packed, shard_numels)  # several units as one collective

[Note: which transport carries a sharded unit]
On CPU, gloo runs each collective on the calling thread's behalf but inside
its own worker, and torch FSDP2 waits on every one at once, so nothing
overlaps. pydist opens the shared-memory transport where every rank of the
group maps one segment (``pydist.transport.open_shm``: ranks on one host),
else wraps the process group (gloo, NCCL, the mpi4py backend). Both queue
the collective and return a future: the shared-memory one runs it on its
own worker thread, so an all-gather prefetched for the next unit or a
reduce-scatter of this unit's gradients runs while autograd computes.
Every rank issues the same collectives in the same order (the engine's
hooks fire in the same order on every rank for the same model), which both
transports require.

[Note: where the 1/N goes]
Gradients are averaged as torch's FSDP does, as the sum over ranks of
``g_r / N``. A transport that applies the scale in its own copies
(``applies_scale``: shared memory) gets ``1/N`` and the packing copy
multiplies by 1; otherwise the packing copy (``pydist.ops.flatten`` with
``scale``, one fused C++ pass) multiplies by ``1/N`` and the process group
sums what it gets. With two ranks ``g_0/2 + g_1/2`` is bitwise torch's
``AVG`` whichever way round (scaling by a power of two is exact).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from pydist import ops
from pydist import transport as pydist_transport

__all__ = [
    "open_transport",
    "all_gather_unit",
    "all_gather_units",
    "pack_grads",
    "pack_unit_grads",
    "reduce_scatter_grads",
    "reduce_scatter_units",
    "all_reduce_grads",
    "ReduceScatterResult",
]


def open_transport(group, shm: bool | None = None) -> pydist_transport.Transport:
    """Collective over ``group``: the transport a root's units share. ``shm``:
    None uses shared memory where every rank can (else the group), True
    requires it (raises on every rank saying why not), False never uses it.
    See [Note: which transport carries a sharded unit]."""
    shm_transport = pydist_transport.open_shm(group, wanted=shm, owner="pydist.fully_shard", keyword="shm")
    transport = shm_transport if shm_transport is not None else pydist_transport.ProcessGroupTransport(group)
    transport.set_stamp_completion(True)  # the per-unit records read completion times
    return transport


def all_gather_unit(transport, shard: torch.Tensor, unsharded: torch.Tensor) -> "UnshardResult":
    """Starts gathering every rank's ``shard`` into ``unsharded`` (rank order).
    ``wait()`` the result before reading ``unsharded``.

    The unit's unsharded parameters are views of ``unsharded`` that autograd
    saved in forward and checks in backward; their values are the same, only
    the memory was given back and refilled in between, so the version
    counter is put back as it was once the gather is done (a process group
    may copy into ``unsharded`` on its own thread, after the call returns)."""
    preserve = torch.autograd._unsafe_preserve_version_counter(unsharded)
    return UnshardResult(transport.all_gather(shard, unsharded), preserve, shard)


class UnshardResult(NamedTuple):
    """One unit's all-gather in flight."""

    future: object  # pydist.transport.TransportFuture
    preserve: object  # restores the output's version counter
    input: torch.Tensor  # the shard sent (a cast copy under mixed precision): alive until done

    def wait(self) -> int:
        """Waits; returns when the transport finished it (ns, time.monotonic_ns's clock)."""
        completed = self.future.wait()
        self.preserve.__exit__(None, None, None)
        return completed


# [Note: batched collectives]
# A rendezvous of the ranks costs about the same whatever it carries, so a
# model of many small units (400 x Linear(64)+LayerNorm: 17 KB each) spends
# its step meeting, not moving bytes, if every unit all-gathers and
# reduce-scatters on its own (1,200 collectives a step). The root therefore
# hands several consecutive units to the transport as one collective (how
# many: the root's batch_bytes; see [Note: gather and reduce plans] in
# _fsdp_state.py). The transport's collectives are over one contiguous
# per-rank shard, and the units' shards are separate buffers, so:
#   all-gather       the units' shards are concatenated (one copy), gathered
#                    into rank-major [rank 0: s_a s_b ..., rank 1: s_a s_b ...],
#                    and rank q's part of each unit copied into its unsharded
#                    buffer at [q * s_u, (q + 1) * s_u) (one fused copy per rank);
#   reduce-scatter   each unit's gradients are packed into its own padded flat
#                    as for a lone unit, and rank q's shard of every unit
#                    copied into the rank-major input (one fused copy per
#                    rank); this rank's output is then [s_a s_b ...], the
#                    units' reduced shards end to end, each unit's a view.
# Every element goes through the same arithmetic as unbatched (the sum of
# g_r / N, term by term), so the results are bitwise those of one collective
# per unit, which are torch FSDP2's at two ranks. A batch of one unit takes
# the unbatched path (no extra copy).


class UnitsGather:
    """Several units' all-gather in flight as one collective. ``wait()``
    (idempotent: every unit of the batch calls it) copies each rank's part
    into the units' unsharded buffers. See [Note: batched collectives]."""

    def __init__(self, future, joined: torch.Tensor, gathered: torch.Tensor, outputs: tuple, rank_views: list):
        self.future = future  # pydist.transport.TransportFuture
        self.joined = joined  # the concatenated shards: alive until the transport is done
        self.gathered = gathered  # the rank-major output; alive until the copy out
        self.outputs = outputs  # the units' unsharded buffers
        self.rank_views = rank_views  # per unit, its buffer's part for each rank
        self.completed: int | None = None

    def wait(self) -> int:
        if self.completed is None:
            completed = self.future.wait()
            # The buffers' autograd-saved views hold the same values as in
            # forward: put the version counters back (see all_gather_unit).
            preserve = torch.autograd._unsafe_preserve_version_counter(self.outputs)
            world_size = len(self.rank_views[0])
            length = self.gathered.numel() // world_size
            for q in range(world_size):
                ops.unflatten_into(self.gathered.narrow(0, q * length, length), [views[q] for views in self.rank_views])
            preserve.__exit__(None, None, None)
            self.completed = completed
            self.joined = self.gathered = self.outputs = self.rank_views = None
        return self.completed


def all_gather_units(transport, shards: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                     rank_views: Sequence[Sequence[torch.Tensor]], dtype: torch.dtype) -> UnitsGather:
    """Starts gathering several units' shards as one collective: ``shards[i]``
    (cast to ``dtype``) of every rank q lands in ``rank_views[i][q]``, a view
    of ``outputs[i]``. ``wait()`` before reading any output. See [Note:
    batched collectives]."""
    joined = torch.cat(list(shards))
    if joined.dtype != dtype:
        joined = joined.to(dtype)
    gathered = torch.empty(joined.numel() * transport.world_size, dtype=dtype)
    return UnitsGather(transport.all_gather(joined, gathered), joined, gathered, tuple(outputs), list(rank_views))


class Segment(NamedTuple):
    """A run of the unit's flat layout: ``grads`` (None: zeros) packed at ``offset``."""

    offset: int
    numel: int
    grads: list | None


def pack_grads(segments: Sequence[Segment], out: torch.Tensor, scale: float) -> None:
    """Fills ``out`` (the unit's padded flat layout) with the segments' gradients
    times ``scale`` (one fused copy per run of present gradients) and zeros
    elsewhere (frozen or unused parameters, the padding at the end)."""
    end = 0
    for seg in segments:
        view = out if seg.numel == out.numel() else out.narrow(0, seg.offset, seg.numel)
        if seg.grads is None:
            view.zero_()
        else:
            torch.ops.pydist.flatten_into(seg.grads, view, float(scale))  # ops.flatten(out=), per unit per step
        end = seg.offset + seg.numel
    if end < out.numel():
        out.narrow(0, end, out.numel() - end).zero_()


class ReduceScatterResult(NamedTuple):
    """One unit's gradient reduce-scatter in flight."""

    future: object  # pydist.transport.TransportFuture
    input: torch.Tensor  # the packed gradients; must live until the future completes
    output: torch.Tensor  # this rank's shard of the averaged gradients once it has
    # ``output`` split as the unit asked (its parameters' parts), made once
    # for a whole batch (reduce_scatter_units); None: the unit splits it.
    pieces: list | None = None


def pack_unit_grads(transport, segments: Sequence[Segment], padded_numel: int, dtype) -> torch.Tensor:
    """The unit's reduce-scatter input: its gradients packed into its padded
    flat layout, with the part of 1/N the transport does not apply itself
    (see [Note: where the 1/N goes])."""
    rs_input = torch.empty(padded_numel, dtype=dtype)
    pack_grads(segments, rs_input, 1.0 if transport.applies_scale else 1.0 / transport.world_size)
    return rs_input


def _transport_scale(transport) -> float:
    """The scale handed to the transport: 1/N where it applies it, else 1 (the packing did)."""
    return 1.0 / transport.world_size if transport.applies_scale else 1.0


def reduce_scatter_grads(transport, segments: Sequence[Segment], padded_numel: int, shard_numel: int, dtype) -> ReduceScatterResult:
    """Packs the unit's gradients and starts reducing them, averaged over the
    ranks, into this rank's shard. See [Note: where the 1/N goes]."""
    rs_input = pack_unit_grads(transport, segments, padded_numel, dtype)
    rs_output = torch.empty(shard_numel, dtype=dtype)
    future = transport.reduce_scatter(rs_input, rs_output, _transport_scale(transport))
    return ReduceScatterResult(future, rs_input, rs_output)


def reduce_scatter_units(transport, packed: Sequence[torch.Tensor], shard_numels: Sequence[int],
                         splits: Sequence[Sequence[int]]) -> list[ReduceScatterResult]:
    """Starts reducing several units' packed gradients (``pack_unit_grads``)
    as one collective; one result per unit, its ``output`` a view of the
    batch's output and its ``pieces`` that view split at ``splits[i]`` (one
    split for the batch). See [Note: batched collectives]."""
    world_size = transport.world_size
    rs_input = torch.cat([p.view(world_size, -1) for p in packed], dim=1).view(-1)  # rank-major
    rs_output = torch.empty(sum(shard_numels), dtype=rs_input.dtype)
    future = transport.reduce_scatter(rs_input, rs_output, _transport_scale(transport))
    outputs = rs_output.split_with_sizes(list(shard_numels))
    pieces = rs_output.split_with_sizes([n for split in splits for n in split])
    results, start = [], 0
    for output, split in zip(outputs, splits):
        results.append(ReduceScatterResult(future, rs_input, output, pieces[start:start + len(split)]))
        start += len(split)
    return results


def all_reduce_grads(transport, segments: Sequence[Segment], numel: int, dtype) -> ReduceScatterResult:
    """NO_SHARD: packs the unit's gradients and starts averaging them in place
    over the ranks; ``output`` is the whole averaged flat."""
    flat = pack_unit_grads(transport, segments, numel, dtype)
    future = transport.all_reduce(flat, _transport_scale(transport))
    return ReduceScatterResult(future, flat, flat)


def all_reduce_sum(transport, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a small tensor) summed over the ranks, through the transport."""
    value = value.contiguous().clone()
    transport.all_reduce(value, 1.0).wait()
    return value


def all_gather_small(transport, value: torch.Tensor) -> torch.Tensor:
    """Every rank's ``value`` (a small tensor), stacked in rank order."""
    value = value.reshape(-1).contiguous()
    out = value.new_empty(value.numel() * transport.world_size)
    transport.all_gather(value, out).wait()
    return out.view(transport.world_size, -1)
