"""The transports every pydist collective goes through, from Python.

    from pydist import transport
    t = transport.ProcessGroupTransport(dist.group.WORLD)      # gloo, NCCL, mpi4py
    t = transport.open_shm(dist.group.WORLD)                    # ranks on one host
    t = transport.wrap("counting", t)                           # a wrapper in front
    t.all_reduce(x, scale=0.5).wait()                           # -> completion time (ns)
    t.reduce_scatter(flat, shard).wait()
    t.all_gather(shard, flat).wait()
    t.stats()                                                   # a wrapper's counters

The objects are the C++ ones DistributedDataParallel's reducer uses (see
[Note: transports] in csrc/transport/transport.h), so a benchmark or a
sharded wrapper drives exactly what DDP drives. Completion times are
nanoseconds on the steady clock, the clock of ``time.monotonic_ns()``.
"""

from __future__ import annotations

import torch

from pydist import _C

__all__ = [
    "Transport",
    "TransportFuture",
    "ProcessGroupTransport",
    "ShmTransport",
    "open_shm",
    "wrap",
    "registered_wrappers",
    "transport_of",
]

Transport = _C.Transport
TransportFuture = _C.TransportFuture
ProcessGroupTransport = _C.ProcessGroupTransport
ShmTransport = _C.ShmTransport
registered_wrappers = _C.registered_wrappers


def wrap(name: str, inner: Transport, **options: float) -> Transport:
    """Puts the wrapper registered as ``name`` (see ``registered_wrappers()``)
    in front of ``inner``; ``options`` are its numeric settings."""
    return _C.wrap_transport(name, inner, {k: float(v) for k, v in options.items()})


def open_shm(group=None, params: list[torch.Tensor] | None = None) -> ShmTransport:
    """Collective over ``group``: this rank's end of a shared-memory transport
    (every rank of the group must share this host's /dev/shm). Raises on
    every rank, saying why, where that cannot be."""
    import torch.distributed as dist

    from pydist.ddp.shm_transport import open_shm_allreduce

    group = group if group is not None else dist.group.WORLD
    return open_shm_allreduce(params if params is not None else [torch.zeros(1)], group, wanted=True)


def transport_of(ddp) -> Transport:
    """The transport a pydist DistributedDataParallel's gradients go through."""
    return ddp.reducer.transport
