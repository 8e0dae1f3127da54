"""The collectives of sharded data parallelism, as free functions over a
``pydist.transport.Transport``: the one seam every byte pydist's FSDP moves
between ranks goes through (see [Note: transports] in
csrc/transport/transport.h).

    transport = open_transport(group, samples, shm=None) # collective, once per root
    fut = all_gather_unit(transport, shard, unsharded)   # unshard one unit
    fut = all_gather_units(transport, shards, outputs, rank_views, dtype)  # several units, one collective
    rs = reduce_scatter_grads(transport, unit.pack_grads, grads, shard_numel, dtype, device)  # a lone unit
    rs.future.wait(); rs.output                          # this rank's summed shard
    pack_unit_grads(transport, grads, numels, rs_input, world_size, column, shard_numel)  # into a batch's input

[Note: which transport carries a sharded unit]
On CPU, gloo runs each collective on the calling thread's behalf but inside
its own worker, and torch FSDP2 waits on every one at once, so nothing
overlaps. pydist opens the shared-memory transport where every rank of the
group maps one segment (``pydist.transport.open_shm``: ranks on one host),
across hosts with two or more ranks on each, the hierarchical transport
(shared memory inside each host, the group across: docs/clusters.md),
else wraps the process group (gloo, NCCL, the mpi4py backend). All queue
the collective and return a future: the shared-memory one runs it on its
own worker thread, so an all-gather prefetched for the next unit or a
reduce-scatter of this unit's gradients runs while autograd computes.
Every rank issues the same collectives in the same order (the engine's
hooks fire in the same order on every rank for the same model), which the
transports require.

[Note: where the 1/N goes]
Gradients are averaged as torch's FSDP does, as the sum over ranks of
``g_r / N``. A transport that applies the scale in its own copies
(``applies_scale``: shared memory) gets ``1/N`` and the packing copy
multiplies by 1; otherwise the packing copy (``pack_unit_grads``, one C++
pass with ``ops::scaled_copy``) multiplies by ``1/N`` and the process group
sums what it gets. With two ranks ``g_0/2 + g_1/2`` is bitwise torch's
``AVG`` whichever way round (scaling by a power of two is exact).
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

import torch
from pydist import _C
from pydist import transport as pydist_transport

__all__ = [
    "open_transport",
    "all_gather_unit",
    "all_gather_units",
    "pack_unit_grads",
    "reference_pack_unit_grads",
    "reduce_scatter_grads",
    "all_reduce_grads",
    "ReduceScatterResult",
]


def open_transport(group, samples: Sequence[torch.Tensor], shm: bool | None = None) -> pydist_transport.Transport:
    """Collective over ``group``: the transport a root's units share.
    ``samples``: a tensor of each dtype and device the units communicate in
    (shards, unsharded buffers, reduce-scatter inputs). ``shm``: None uses
    shared memory where every rank can carry all of them (else the group),
    True requires it (raises on every rank saying why not), False never uses
    it. See [Note: which transport carries a sharded unit]."""
    shm_transport = pydist_transport.open_shm(group, list(samples), wanted=shm, owner="pydist.fully_shard",
                                              keyword="shm", collectives="all-gather and reduce-scatter")
    transport = shm_transport if shm_transport is not None else pydist_transport.ProcessGroupTransport(group)
    pydist_transport.name_lost_hosts(transport, group)
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
# _fsdp_schedule.py). The units' shards and unsharded buffers are separate
# buffers, so:
#   all-gather       one ``Transport.all_gather_many``: this rank's shard is
#                    the units' shards end to end [s_a s_b ...], and rank q's
#                    part of unit u lands straight in u's unsharded buffer at
#                    [q * s_u, (q + 1) * s_u). On shared memory the transport
#                    thread copies each shard into the segment and each
#                    rank's part out of it (no concatenated input, no
#                    rank-major gathered buffer, nothing on the caller's
#                    thread); other transports concatenate, gather and copy
#                    out on completion (see [Note: transports] in
#                    csrc/transport/transport.h);
#   reduce-scatter   the batch's input is rank-major [rank 0: s_a s_b ...,
#                    rank 1: s_a s_b ...]; each unit's post-backward packs its
#                    gradients straight into its column of every row (one pass
#                    over each gradient byte, 1/N folded in: see [Note: packing
#                    a unit into a rank-major reduce-scatter input] in
#                    csrc/fsdp/unit_ops.h); this rank's output is then
#                    [s_a s_b ...], the units' reduced shards end to end, each
#                    unit's a view.
# Every element goes through the same arithmetic as unbatched (the sum of
# g_r / N, term by term), so the results are bitwise those of one collective
# per unit, which are torch FSDP2's at two ranks. A batch of one unit takes
# the unbatched path (``all_gather_unit``).


class UnitsGather:
    """Several units' all-gather in flight as one collective. ``wait()`` is
    idempotent: every unit of the batch calls it. See [Note: batched
    collectives]."""

    def __init__(self, future, outputs: tuple, versions: tuple, inputs: list):
        self.future = future  # pydist.transport.TransportFuture; until the wait
        # The outputs and their version counters before the gather, put back at the wait.
        self.outputs, self.versions = outputs, versions
        self.inputs = inputs  # the shards sent (cast copies under mixed precision): alive until done
        self.completed: int | None = None
        # The units gathered, which the first to wait unshards (set by unshard_units).
        self.members: list | None = None

    def wait(self) -> int:
        if self.completed is None:
            completed = self.future.wait()
            # Put the version counters back, as all_gather_unit does: the
            # shared-memory worker writes through data pointers (no bump), but
            # another transport's copy out (ops.unflatten_into, on the thread
            # that completed the gather) bumps them.
            torch._C._autograd._unsafe_set_version_counter(self.outputs, self.versions)
            self.completed = completed
            # the handle holds the batch's tensors too: let go of them here, with the GIL
            self.future = self.outputs = self.inputs = None
        return self.completed


def all_gather_units(transport, shards: Sequence[torch.Tensor], outputs: tuple[torch.Tensor, ...],
                     per_rank: Sequence[Sequence[torch.Tensor]], dtype: torch.dtype) -> UnitsGather:
    """Starts gathering several units' shards as one collective: ``shards[i]``
    (cast to ``dtype``) of every rank q lands in ``per_rank[q][i]``, a view
    of ``outputs[i]``. ``wait()`` before reading any output. See [Note:
    batched collectives]."""
    inputs = shards if shards[0].dtype == dtype else [shard.to(dtype) for shard in shards]  # the units share a dtype
    # The counters are recorded before the transport may write (see all_gather_unit).
    versions = tuple(map(_version_of, outputs))
    return UnitsGather(transport.all_gather_many(inputs, per_rank), outputs, versions, inputs)


_version_of = operator.attrgetter("_version")


def rank_major(rank_views: Sequence[Sequence[Sequence[torch.Tensor]]], world_size: int) -> list[list[torch.Tensor]]:
    """Each unit's per-rank views (``rank_views[i][q]``: a list, one per
    column of unit i's layout), regrouped per rank: what ``all_gather_units``
    takes as ``per_rank``."""
    return [[view for views in rank_views for view in views[q]] for q in range(world_size)]


def copy_scale(transport) -> float:
    """The scale folded into the packing copy: 1 where the transport applies
    1/N itself, else 1/N. See [Note: where the 1/N goes]."""
    return 1.0 if transport.applies_scale else 1.0 / transport.world_size


def transport_scale(transport) -> float:
    """The scale handed to the transport: 1/N where it applies it, else 1 (the packing did)."""
    return 1.0 / transport.world_size if transport.applies_scale else 1.0


def pack_unit_grads(transport, grads: Sequence[torch.Tensor | None], numels: Sequence[int], out: torch.Tensor,
                    world_size: int, column: int, shard_numel: int) -> None:
    """Writes one unit's gradients (``grads[i]``: ``numels[i]`` elements, in
    ``out``'s dtype, contiguous; None: zeros), with the part of 1/N the
    transport does not apply, into its column of the rank-major ``out``. One
    C++ pass (``pydist._C.pack_rank_major``); ``reference_pack_unit_grads``
    is its oracle. See [Note: packing a unit into a rank-major reduce-scatter
    input] in csrc/fsdp/unit_ops.h."""
    _C.pack_rank_major(grads, numels, out, world_size, column, shard_numel, copy_scale(transport))


def reference_pack_unit_grads(grads: Sequence[torch.Tensor | None], numels: Sequence[int], out: torch.Tensor,
                              world_size: int, column: int, shard_numel: int, scale: float) -> None:
    """The obviously-correct pack_unit_grads (pure torch): the unit's padded
    flat layout, times ``scale``, then shard q into row q's column."""
    flat = torch.zeros(world_size * shard_numel, dtype=out.dtype, device=out.device)
    offset = 0
    for grad, numel in zip(grads, numels):
        if grad is not None:
            flat[offset:offset + numel] = grad.reshape(-1).mul(scale)
        offset += numel
    out.view(world_size, -1)[:, column:column + shard_numel] = flat.view(world_size, shard_numel)


class ReduceScatterResult(NamedTuple):
    """One unit's gradient reduce-scatter (or NO_SHARD all-reduce) in flight."""

    future: object  # pydist.transport.TransportFuture
    input: torch.Tensor  # the packed gradients; must live until the future completes
    output: torch.Tensor  # this rank's shard of the averaged gradients once it has


def reduce_scatter_grads(transport, pack, grads: Sequence[torch.Tensor | None], shard_numel: int,
                         dtype, device: torch.device | str = "cpu") -> ReduceScatterResult:
    """A lone unit: packs its gradients with ``pack`` (the unit's
    ``pack_grads``: into its layout, rank-major) and starts reducing them,
    averaged over the ranks, into this rank's shard."""
    world_size = transport.world_size
    rs_input = torch.empty(world_size * shard_numel, dtype=dtype, device=device)
    pack(grads, rs_input, world_size, 0, copy_scale(transport))
    rs_output = torch.empty(shard_numel, dtype=dtype, device=device)
    future = transport.reduce_scatter(rs_input, rs_output, transport_scale(transport))
    return ReduceScatterResult(future, rs_input, rs_output)


def all_reduce_grads(transport, grads: Sequence[torch.Tensor | None], numels: Sequence[int], numel: int,
                     dtype, device: torch.device | str = "cpu") -> ReduceScatterResult:
    """NO_SHARD: packs the unit's gradients and starts averaging them in place
    over the ranks; ``output`` is the whole averaged flat."""
    flat = torch.empty(numel, dtype=dtype, device=device)
    pack_unit_grads(transport, grads, numels, flat, 1, 0, numel)
    future = transport.all_reduce(flat, transport_scale(transport))
    return ReduceScatterResult(future, flat, flat)


def all_reduce_sum(transport, value: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``value`` (a small tensor) summed over the ranks, through the
    transport, sent from ``device`` (the units' device: NCCL carries no CPU
    tensor) and returned where ``value`` is."""
    sent = value.to(device, copy=True) if device is not None else value.clone()
    sent = sent.contiguous()
    transport.all_reduce(sent, 1.0).wait()
    return sent.to(value.device)


def all_gather_small(transport, value: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Every rank's ``value`` (a small tensor), stacked in rank order; sent
    from ``device`` as ``all_reduce_sum``, returned where ``value`` is."""
    sent = (value.to(device) if device is not None else value).reshape(-1).contiguous()
    out = sent.new_empty(sent.numel() * transport.world_size)
    transport.all_gather(sent, out).wait()
    return out.view(transport.world_size, -1).to(value.device)
