"""What pydist.DistributedDataParallel calls into the overlap lab: three
marked hooks, so that environment variables change an unchanged script.

    transport_for(ddp, transport)   building the reducer: PYDIST_SIM_NET / sim_net=
    p2p_delay()                     pipeline channels: PYDIST_SIM_NET (pydist/pipelining)
    attach_pipeline(schedule)       a pipeline schedule is built: PYDIST_TRACE
    reducer_made(ddp, reducer)      after it is built: PYDIST_REPLAY
    attach(ddp)                     end of __init__: PYDIST_TRACE, overlap.record()

and what the sharded wrapper (pydist.fully_shard, FullyShardedDataParallel) calls:

    sharded_made()                  fully_shard(): a PYDIST_SIM_NET it cannot read is refused
    sharded_transport(transport)    the root opens its units' transport: PYDIST_SIM_NET
    sharded_root(state)             the root's first forward: PYDIST_TRACE subscribes to its records

Each does nothing (no clock read, no hook registered) when its variable is
unset and the lab was not asked for.
"""

from __future__ import annotations

import atexit
import os
import sys

from pydist.overlap import network, plans, recording
from pydist.overlap import trace as trace_module

__all__ = ["sharded_made", "sharded_transport", "sharded_root", "transport_for", "p2p_delay", "attach_pipeline", "reducer_made", "attach", "TraceSession"]


def transport_for(ddp, transport):
    """The transport the reducer should use: ``transport`` (None: the
    process group's) behind a simulated link when the wrapper's ``sim_net``
    keyword or PYDIST_SIM_NET names one; else ``transport`` unchanged."""
    spec = getattr(ddp, "_sim_net", None)
    link = network.parse_link(spec) if spec else network.link_from_env()
    if link is None:
        return transport
    from pydist import transport as transports

    parts = transports.hierarchical_parts(transport) if transport is not None else None
    if parts is not None:  # across hosts the link is the cross-host leg only
        return parts.build(cross=network.sim_net(parts.cross, link))
    inner = transport if transport is not None else transports.ProcessGroupTransport(ddp.process_group)
    return network.sim_net(inner, link)


def sharded_made() -> None:
    """Reads PYDIST_SIM_NET (raising ValueError on what it cannot read), so
    that ``fully_shard`` refuses it when called, as DDP's construction does."""
    network.link_from_env()


def sharded_transport(transport):
    """The transport a sharded root's units share: ``transport`` behind the
    PYDIST_SIM_NET link (across hosts, its cross-host leg), or unchanged."""
    link = network.link_from_env()
    if link is None:
        return transport
    from pydist import transport as transports

    parts = transports.hierarchical_parts(transport)
    linked = (parts.build(cross=network.sim_net(parts.cross, link)) if parts is not None
              else network.sim_net(transport, link))
    linked.set_stamp_completion(True)  # the units' records read completion times
    return linked


def sharded_root(state) -> None:
    """PYDIST_TRACE=DIR: this rank's trace takes the root's records of each
    iteration (``state.subscribe``)."""
    directory = os.environ.get(trace_module.ENV, "").strip()
    if directory:
        TraceSession.get(directory).add_sharded(state)


def p2p_delay():
    """For pipeline stages' point-to-point messages: a function of the
    payload's bytes giving the seconds the PYDIST_SIM_NET link takes to
    carry it (its latency plus bytes / bandwidth: a one-hop transfer, what
    ``network.model_seconds`` gives a two-rank all-gather of twice the
    bytes), or None when the variable is unset."""
    link = network.link_from_env()
    if link is None:
        return None
    return lambda nbytes: link.latency_s + nbytes * 8 / link.bandwidth_bps


def reducer_made(ddp, reducer) -> None:
    """PYDIST_REPLAY=FILE: the reducer takes the recorded bucket assignment
    and launch order now, and never rebuilds it."""
    path = os.environ.get(plans.ENV, "").strip()
    if path:
        plans.apply_plan(ddp, plans.load_plan(path), reducer)


def attach(ddp) -> None:
    number = recording._register(ddp)
    directory = os.environ.get(trace_module.ENV, "").strip()
    if directory:
        TraceSession.get(directory).add(ddp, number)
    record_path = os.environ.get(plans.RECORD_ENV, "").strip()
    if record_path:
        plans.record_plan_at_exit(ddp, record_path)


def attach_pipeline(schedule) -> None:
    """PYDIST_TRACE=DIR: the schedule records its stages' forwards,
    backwards, sends and receives, which go into this rank's trace."""
    directory = os.environ.get(trace_module.ENV, "").strip()
    if directory:
        TraceSession.get(directory).add_pipeline(schedule)


class PublishedLog:
    """The records a wrapper published (a sharded root's, one per
    iteration), as a StepLog holds a DDP wrapper's."""

    def __init__(self, limit: int = 10_000):
        import collections

        self.records = collections.deque(maxlen=limit)

    def take(self, record) -> None:
        self.records.append(record)

    def drain(self) -> None:
        """Nothing to copy: the wrapper hands each record over as it ends."""


class TraceSession:
    """This process's trace: the wrappers it follows and when it writes
    ``DIR/rank{R}.json`` (process group destroyed, exit, uncaught exception)."""

    _current: "TraceSession | None" = None

    @classmethod
    def get(cls, directory: str) -> "TraceSession":
        if cls._current is None or cls._current.directory != directory:
            cls._current = cls(directory)
        return cls._current

    def __init__(self, directory: str):
        import torch.distributed as dist

        self.directory = directory
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.logs: dict[int, recording.StepLog] = {}
        self.pipelines: list = []  # pipeline schedules whose StageRecords go into the trace
        self.wrappers: dict[int, dict] = {}  # DDP wrapper number -> trace.wrapper_info, for the predictor
        atexit.register(self.write)
        self._wrap_destroy_process_group()
        self._wrap_excepthook()

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"rank{self.rank}.json")

    def add(self, ddp, number: int) -> None:
        recording.record(ddp, keep=recording.DEFAULT_KEEP)
        self.logs[number] = recording._log_of(ddp)
        # taken now: the trace may be written after the wrapper is gone
        self.wrappers[number] = trace_module.wrapper_info(ddp)

    def add_sharded(self, state) -> None:
        log = PublishedLog()
        state.subscribe(log.take)
        self.logs[recording._new_number()] = log

    def add_pipeline(self, schedule) -> None:
        schedule.set_record_timing(True)
        self.pipelines.append(schedule)

    def write(self) -> None:
        """Whatever was recorded so far, replacing the previous file."""
        for log in self.logs.values():
            log.drain()
        stage_records = [r for s in self.pipelines for r in s.records()]
        document = trace_module.trace_document({n: list(log.records) for n, log in self.logs.items()}, self.rank,
                                               stage_records=stage_records, wrappers=self.wrappers)
        try:
            trace_module.write_trace(self.path, document)
        except OSError as exc:
            print(f"pydist.overlap: rank {self.rank} could not write its trace {self.path}: {exc}", file=sys.stderr)

    def _wrap_destroy_process_group(self) -> None:
        import torch.distributed as dist

        original = dist.destroy_process_group
        if getattr(original, "pydist_trace_writes", False):
            return
        session = self

        def destroy_process_group(*args, **kwargs):
            TraceSession._current_write(session)
            return original(*args, **kwargs)

        destroy_process_group.pydist_trace_writes = True
        destroy_process_group.__wrapped__ = original
        destroy_process_group.__doc__ = original.__doc__
        dist.destroy_process_group = destroy_process_group
        dist.distributed_c10d.destroy_process_group = destroy_process_group

    def _wrap_excepthook(self) -> None:
        previous = sys.excepthook
        session = self

        def excepthook(exc_type, exc, tb):
            TraceSession._current_write(session)
            previous(exc_type, exc, tb)

        excepthook.pydist_aborts_mpi = getattr(previous, "pydist_aborts_mpi", False)
        sys.excepthook = excepthook

    @staticmethod
    def _current_write(fallback: "TraceSession") -> None:
        (TraceSession._current or fallback).write()
