"""The transports every pydist collective goes through, from Python.

    from pydist import transport
    t = transport.ProcessGroupTransport(dist.group.WORLD)      # gloo, NCCL, mpi4py
    t = transport.open_shm(dist.group.WORLD)                    # ranks on one host; across hosts,
                                                                # shared memory inside each + the group across
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

import weakref
from typing import NamedTuple

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
    "HierarchicalParts",
    "hierarchical_parts",
    "name_lost_hosts",
    "lost_hosts_context",
]

Transport = _C.Transport
TransportFuture = _C.TransportFuture
ProcessGroupTransport = _C.ProcessGroupTransport
ShmTransport = _C.ShmTransport
registered_wrappers = _C.registered_wrappers


def name_lost_hosts(transport: Transport, group) -> None:
    """Collective over ``group`` the first time its topology is asked for:
    where ``transport`` is the plain process group and the group spans
    hosts, a failed collective's error ends naming the other hosts, as the
    hierarchical transport names them on its cross-host leg
    (``unreachable host: node1 (ranks 2, 3)``; with more hosts, ``among``
    them): gloo's own error names an address at best, or nothing on a
    timeout."""
    if isinstance(transport, ProcessGroupTransport):
        transport.failure_context = lost_hosts_context(group)


def lost_hosts_context(group) -> str:
    """What ``name_lost_hosts`` appends for ``group`` ("" on one host);
    collective the first time the group's topology is asked for."""
    from pydist import topology

    topo = topology.of(group, build_groups=False)
    others = [topo.host_label(h) for h in range(topo.num_hosts) if h != topo.host]
    if not others:
        return ""
    return ("unreachable host: " if len(others) == 1 else "unreachable host among: ") + ", ".join(others)


def wrap(name: str, inner: Transport, **options: float) -> Transport:
    """Puts the wrapper registered as ``name`` (see ``registered_wrappers()``)
    in front of ``inner``; ``options`` are its numeric settings."""
    return _C.wrap_transport(name, inner, {k: float(v) for k, v in options.items()})


def open_shm(group=None, params: list[torch.Tensor] | None = None, wanted: bool | None = True,
             owner: str = "pydist.transport.open_shm", keyword: str = "wanted",
             collectives: str = "all-reduce") -> Transport | None:
    """Collective over ``group`` (default: the world): this rank's end of a
    shared-memory transport, every rank passing the same ``wanted``. Where
    the group spans hosts (``pydist.topology``) and at least two of its ranks
    share one, the end is a hierarchical transport instead: shared memory
    inside each host, the process group across hosts (see [Note:
    hierarchical collectives] in csrc/transport/hierarchical_transport.cpp).

    wanted: True requires it (raises, on every rank, saying why not); None
    uses it where every rank can (every rank on this host, ``params`` all
    CPU tensors of a dtype the transport carries), else returns None: use
    the group; False returns None. Ranks passing different values raise,
    every one of them, naming each rank's value. Errors name ``owner`` and
    its ``keyword`` (e.g. ``DistributedDataParallel`` and ``shm_allreduce``),
    since the caller's keyword is what the user sets, and the ``collectives``
    it would run (e.g. "all-gather and reduce-scatter" for a sharded wrapper)."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    params = params if params is not None else [torch.zeros(1)]
    world_size = dist.get_world_size(group)
    why_not = _why_not_shm_here(params, world_size, collectives) if wanted is not False else None
    verdicts: list = [None] * world_size
    dist.all_gather_object(verdicts, (wanted, why_not), group=group)
    if len({w for w, _ in verdicts}) > 1:
        values = ", ".join(f"rank {r}: {w}" for r, (w, _) in enumerate(verdicts))
        raise ValueError(f"{owner}: {keyword} differs across ranks ({values}); pass the same on every rank")
    if wanted is False:
        return None
    refusals = [f"rank {r}: {reason}" for r, (_, reason) in enumerate(verdicts) if reason]
    if not refusals:
        from pydist import topology
        from pydist.transport import shm_segment

        topo = topology.of(group)
        if not topo.spans_hosts:
            shm, failure = shm_segment.map_segment_over_group(group)
        elif not topo.shares_host:
            shm, failure = None, f"every rank is on a host of its own ({topo.describe()})"
        elif not topo.uniform:
            shm, failure = None, f"hosts have different numbers of ranks ({topo.uneven_hosts()}); the " \
                "hierarchical transport needs the same number on every host"
        else:
            shm, failure = _open_hierarchical(group, topo)
        if shm is not None:
            return shm
        refusals = [failure]
    if wanted:
        raise RuntimeError(
            f"{owner}({keyword}=True): this group cannot {collectives} through shared memory ("
            + "; ".join(refusals)
            + f"). Pass {keyword}=None to fall back to the process group."
        )
    return None


class HierarchicalParts(NamedTuple):
    """What a hierarchical transport is made of (``hierarchical_parts``), so
    a wrapper can go in front of its cross-host leg only (the overlap lab's
    simulated link): ``parts.build(cross=wrap(..., parts.cross))``."""

    local_in: ShmTransport  # this host's shared memory, first legs
    local_out: ShmTransport  # this host's shared memory, last legs
    cross: Transport  # this rank's stream: local rank l of every host
    rank: int
    rank_of: list  # [host][local index] -> group rank
    host_names: list  # for errors: "node1 (ranks 2, 3)"

    def build(self, cross: Transport | None = None) -> Transport:
        made = _C.hierarchical_transport(self.local_in, self.local_out, cross if cross is not None else self.cross,
                                         self.rank, self.rank_of, self.host_names)
        _parts[made] = self._replace(cross=cross) if cross is not None else self
        return made


_parts: "weakref.WeakKeyDictionary[Transport, HierarchicalParts]" = weakref.WeakKeyDictionary()


def hierarchical_parts(t: Transport) -> HierarchicalParts | None:
    """The parts of a hierarchical transport made by ``open_shm``, else None."""
    return _parts.get(t)


def _open_hierarchical(group, topo) -> tuple[Transport | None, str]:
    """Collective over ``group``: the hierarchical transport of ``topo``
    (which spans hosts, shares one, every host the same size), or (None, why not)
    on every rank."""
    import torch.distributed as dist

    from pydist.transport import shm_segment

    local_size = topo.local_size

    def local_allgather(obj) -> list:
        out: list = [None] * local_size
        dist.all_gather_object(out, obj, group=topo.local_group)
        return out

    timeout_s = shm_segment.group_timeout(group).total_seconds()
    ends, failure = [], ""
    # The last legs wait twice the group's timeout: a host peer stages its
    # last leg only once its own cross-host leg is done, which may take the
    # whole timeout to fail (a stalled host); that failure then aborts both
    # legs naming the lost host (HierarchicalTransport::fail), which a peer
    # waiting here must see rather than time out first with "did not arrive".
    for leg_timeout_s in (timeout_s, 2 * timeout_s):
        shm, failure = shm_segment.map_segment(topo.local_rank, local_size, local_allgather, leg_timeout_s)
        if shm is None:
            break
        ends.append(shm)
    outcomes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, failure, group=group)  # every host must have both segments
    host_of = {r: h for h, ranks in enumerate(topo.hosts) for r in ranks}
    failures = [f"{topo.host_label(host_of[r])}: {f}" for r, f in enumerate(outcomes) if f]
    if failures:
        for shm in ends:
            shm.close()
        return None, "; ".join(failures)
    # A stream group of its own: two transports issuing on one group from
    # their own threads could interleave differently on different ranks.
    from pydist import topology

    cross = ProcessGroupTransport(topology.new_cross_group(group, topo))
    parts = HierarchicalParts(ends[0], ends[1], cross, topo.rank,
                              [list(h) for h in topo.hosts], [topo.host_label(h) for h in range(topo.num_hosts)])
    return parts.build(), ""


def _why_not_shm_here(params: list[torch.Tensor], world_size: int, collectives: str = "all-reduce") -> str | None:
    """What keeps this rank off the shared-memory transport, or None."""
    import sys

    if not sys.platform.startswith("linux"):
        return f"the shared-memory transport is Linux-only (this is {sys.platform})"
    if world_size < 2:
        return f"a group of one rank has nothing to {collectives}"
    for p in params:
        if p.device.type != "cpu":
            return f"a parameter is on {p.device} (the transport carries CPU tensors)"
        if not ShmTransport.supports(p.dtype):
            return f"a parameter is {p.dtype} (the transport takes float32, float64, bfloat16 and float16)"
    return None


def transport_of(ddp) -> Transport:
    """The transport a pydist DistributedDataParallel's gradients go through."""
    return ddp.reducer.transport
