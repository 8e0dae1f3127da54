"""The collectives of sharded data parallelism, as free functions over a
``pydist.transport.Transport``: the one seam every byte pydist's FSDP moves
between ranks goes through (see [Note: transports] in
csrc/transport/transport.h).

    transport = open_transport(group, shm=None)          # collective, once per root
    fut = all_gather_unit(transport, shard, unsharded)   # unshard one unit
    rs = reduce_scatter_grads(transport, layout, grads, scale)   # post-backward
    rs.future.wait(); rs.output                          # this rank's summed shard

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
    "pack_grads",
    "reduce_scatter_grads",
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
        view = out.narrow(0, seg.offset, seg.numel)
        if seg.grads is None:
            view.zero_()
        else:
            ops.flatten(seg.grads, out=view, scale=scale)
        end = seg.offset + seg.numel
    if end < out.numel():
        out.narrow(0, end, out.numel() - end).zero_()


class ReduceScatterResult(NamedTuple):
    """One unit's gradient reduce-scatter in flight."""

    future: object  # pydist.transport.TransportFuture
    input: torch.Tensor  # the packed gradients; must live until the future completes
    output: torch.Tensor  # this rank's shard of the averaged gradients once it has


def reduce_scatter_grads(transport, segments: Sequence[Segment], padded_numel: int, shard_numel: int, dtype) -> ReduceScatterResult:
    """Packs the unit's gradients and starts reducing them, averaged over the
    ranks, into this rank's shard. See [Note: where the 1/N goes]."""
    scale = 1.0 / transport.world_size
    rs_input = torch.empty(padded_numel, dtype=dtype)
    pack_grads(segments, rs_input, 1.0 if transport.applies_scale else scale)
    rs_output = torch.empty(shard_numel, dtype=dtype)
    future = transport.reduce_scatter(rs_input, rs_output, scale if transport.applies_scale else 1.0)
    return ReduceScatterResult(future, rs_input, rs_output)


def all_reduce_grads(transport, segments: Sequence[Segment], numel: int, dtype) -> ReduceScatterResult:
    """NO_SHARD: packs the unit's gradients and starts averaging them in place
    over the ranks; ``output`` is the whole averaged flat."""
    scale = 1.0 / transport.world_size
    flat = torch.empty(numel, dtype=dtype)
    pack_grads(segments, flat, 1.0 if transport.applies_scale else scale)
    future = transport.all_reduce(flat, scale if transport.applies_scale else 1.0)
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
