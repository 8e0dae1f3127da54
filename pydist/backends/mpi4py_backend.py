"""A torch.distributed process group over mpi4py, for the PyPI torch (built
without MPI).

    pydist.init_process_group(backend="mpi")     # under mpirun / srun --mpi
    # or: register(); torch.distributed.init_process_group("mpi4py", ...)

``MPI4PyProcessGroup`` subclasses ``torch.distributed.ProcessGroup``: torch's
C++ callers (DDP's reducer calling ``process_group->allreduce``, the
functional collectives) reach these Python methods through torch's
``PyProcessGroup`` trampoline. Each collective is queued on the group's MPI
thread and returns an ``MPIWork`` at once (see mpi_work.py); tensors become
MPI buffers as mpi_buffers.py describes.

Requirements: the process was started by an MPI launcher, torch's global rank
equals the rank in ``MPI_COMM_WORLD`` (``pydist.init_process_group`` ensures
it), and MPI was initialized with ``MPI_THREAD_MULTIPLE`` (mpi4py's default).
"""

from __future__ import annotations

import atexit
import collections
import datetime
import itertools
import os
import sys
import threading
import types
import weakref

import torch
import torch.distributed as dist

from pydist.transport.shm_segment import map_segment_over_comm

from .mpi_buffers import Message, mpi_op
from .mpi_work import CommThread, MPIWork

__all__ = ["MPI4PyProcessGroup", "register", "shutdown_all", "finish_at_exit", "BACKEND_NAME",
           "ALLREDUCE_CHUNK_BYTES", "SHM_MIN_BYTES"]

BACKEND_NAME = "mpi4py"

# [Note: chunked all-reduce]
# MPICH picks its all-reduce algorithm by message size, and on this 2-core VM
# its large-message path is the slow one: issue #4 measured a bare mpi4py
# Allreduce at 5.3-5.6 GB/s for 1-8 MiB but 2.4 GB/s at 32 MiB. A message
# larger than ALLREDUCE_CHUNK_BYTES is therefore reduced as consecutive chunks
# of that size, each in the mid-size regime, with up to ALLREDUCE_INFLIGHT
# non-blocking chunks outstanding so MPI always has the next chunk to work on.
# The result is bit-identical: every element is reduced by the same MPI op over
# the same ranks; only the message boundaries move. The sizes were picked by
# timing 1-8 MiB chunks, blocking or with 2-4 in flight (benchmarks/RESULTS.md).
ALLREDUCE_CHUNK_BYTES = 4 << 20
ALLREDUCE_INFLIGHT = 2

# [Note: on-node all-reduces go through shared memory]
# When every rank of a group shares one node, all-reduces of at least
# SHM_MIN_BYTES (SUM, or AVG of floating data, in a dtype the transport
# carries) run through pydist's shared-memory transport, the one DDP uses
# (csrc/transport/shm_transport.h, [Note: shared-memory all-reduce]), instead
# of MPI: MPICH moves large on-node messages more slowly than a copy through
# one shared segment (benchmarks/RESULTS.md, "Shared-memory all-reduce").
# The transport sums in rank order and AVG divides afterwards, as the MPI
# path does, so integer-valued data give exactly what MPI_SUM gives and every
# rank ends with the same bits. Its end is opened lazily by the MPI thread at
# the first eligible all-reduce (a collective: every rank reaches it at the
# same collective) and dropped in shutdown(); if the segment cannot be mapped
# on every rank, the group stays on MPI. PYDIST_MPI_SHM=0 (the same on every
# rank) turns the path off, for comparisons.
SHM_MIN_BYTES = 8 << 20

_live_groups: "weakref.WeakSet[MPI4PyProcessGroup]" = weakref.WeakSet()  # for shutdown_all at exit
_lock = threading.Lock()
_created = itertools.count()  # creation order of this rank's groups; shutdown_all frees communicators in it


def spans_one_node(comm) -> bool:
    """Collective over ``comm``: whether all its ranks share memory."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() == comm.Get_size()
    finally:
        node.Free()


def allreduce_chunked(comm, msg_buf, count: int, itemsize: int, op) -> None:
    """In-place all-reduce of ``msg_buf = [ndarray|tensor, datatype]`` over
    ``comm``, chunked per [Note: chunked all-reduce]."""
    from mpi4py import MPI

    data, datatype = msg_buf
    chunk = max(1, ALLREDUCE_CHUNK_BYTES // itemsize)
    if count <= chunk:
        comm.Allreduce(MPI.IN_PLACE, [data, datatype], op)
        return
    pending = []
    for start in range(0, count, chunk):
        if len(pending) >= ALLREDUCE_INFLIGHT:
            pending.pop(0).Wait()
        pending.append(comm.Iallreduce(MPI.IN_PLACE, [data[start:start + chunk], datatype], op))
    MPI.Request.Waitall(pending)


class MPI4PyProcessGroup(dist.ProcessGroup):
    """One torch process group = one MPI communicator + one MPI thread."""

    def __init__(self, comm, rank: int, size: int, timeout: datetime.timedelta, name: str):
        super().__init__(rank, size)
        self.comm_ = comm  # this group's own communicator (a Dup / Create_group), freed in shutdown()
        self.rank_ = rank  # rank in this group (== comm_.Get_rank())
        self.size_ = size
        self.timeout_ = timeout  # bounds every MPIWork.wait
        self.thread_ = CommThread(name=f"pydist-mpi4py-{name}")  # runs the collectives, in issue order
        self.issued_: collections.Counter[str] = collections.Counter()  # op name -> calls; tests and debugging
        self.seq_ = next(_created)  # orders collective teardown across groups, see shutdown_all
        # All ranks on one node: large all-reduces go through shared memory, see
        # [Note: on-node all-reduces go through shared memory]. Read after the
        # collective Split_type so ranks never disagree on calling it; cleared
        # (on every rank) if the segment cannot be mapped.
        self.shm_possible_ = size > 1 and spans_one_node(comm) and os.environ.get("PYDIST_MPI_SHM", "1") != "0"
        self.shm_ = None  # this rank's end of the transport (a pydist.transport.ShmTransport), opened lazily
        self.shm_calls_ = 0  # all-reduces that took it; tests assert the path was taken
        _live_groups.add(self)

    # -- identity -------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"MPI4PyProcessGroup(rank={self.rank_}, size={self.size_})"

    # [Note: the group is its own backend]
    # With the extended API torch uses the object the creator returns as the
    # group itself and registers no per-device Backend, so torch's
    # ``group._get_backend(device)`` raises. Code that reads a group's settings
    # through it (``group._get_backend(cpu).options._timeout``, as pydist's
    # shm transport does) gets this group and its timeout instead.
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def _get_backend(self, device=None) -> "MPI4PyProcessGroup":
        return self

    @property
    def options(self) -> types.SimpleNamespace:
        """The group's settings, named as torch's ``Backend.Options`` names them."""
        return types.SimpleNamespace(_timeout=self.timeout_, backend=BACKEND_NAME)

    @property
    def stuck(self) -> bool:
        """A collective of this group timed out and its MPI thread is still
        inside MPI. See [Note: the watchdog fails overdue works] in mpi_work.py."""
        return self.thread_.stuck

    def _where(self, op: str, tensor: torch.Tensor | None = None) -> str:
        what = f" of {tensor.numel()} {str(tensor.dtype).replace('torch.', '')} on {tensor.device}" if tensor is not None else ""
        return f"{op}{what} on rank {self.rank_} of {self.size_}"

    def _issue(self, op: str, description: str, run, messages, result) -> MPIWork:
        self.issued_[op] += 1

        def body():
            run()
            for m in messages:
                m.finish()

        return self.thread_.enqueue(body, MPIWork(description, result, self.timeout_))

    # -- all-reduce -----------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self._one_tensor("allreduce", tensors)
        tensor = tensors[0]
        where = self._where("allreduce", tensor)
        mpi, divide = mpi_op(op, tensor.dtype, where)
        msg = Message(tensor, reduce=True)
        comm, size = self.comm_, self.size_

        def run():
            t = msg.staged.reshape(-1)
            if self._shm_eligible(t, mpi, divide) and self._open_shm():
                self.shm_.all_reduce(t, 1.0).wait()
                self.shm_calls_ += 1
            else:
                buf = msg.buffer(where)
                allreduce_chunked(comm, buf, t.numel(), t.element_size(), mpi)
            if divide:
                t.div_(size)

        return self._issue("allreduce", where, run, [msg], tensors)

    def _shm_eligible(self, staged: torch.Tensor, mpi_op, divide: bool) -> bool:
        """Whether this all-reduce takes shared memory. Depends only on what every
        rank of a matching collective agrees on (size, dtype, op, device)."""
        from mpi4py import MPI

        from pydist import _C

        return (self.shm_possible_ and mpi_op == MPI.SUM and staged.device.type == "cpu"
                and _C.ShmTransport.supports(staged.dtype)
                and staged.numel() * staged.element_size() >= SHM_MIN_BYTES
                and (not divide or staged.dtype.is_floating_point))

    def _open_shm(self) -> bool:
        """On the MPI thread, collective the first time: this rank's end of the
        shared-memory transport. False (on every rank) when it cannot be mapped."""
        if self.shm_ is None and self.shm_possible_:
            self.shm_, why_not = map_segment_over_comm(self.comm_, self.timeout_.total_seconds())
            if self.shm_ is None:
                self.shm_possible_ = False
                print(f"pydist mpi4py group (rank {self.rank_}): shared memory unavailable, all-reduces stay on MPI: "
                      f"{why_not}", file=sys.stderr)
        return self.shm_ is not None

    def allreduce_coalesced(self, tensors, opts=None):
        """Several tensors as one flat message (DDP's reducer does not use
        this; torch.distributed.all_reduce_coalesced does)."""
        if not tensors:
            return self._issue("allreduce_coalesced", "allreduce_coalesced of nothing", lambda: None, [], tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        opts1 = dist.AllreduceOptions()
        opts1.reduceOp = op
        inner = self.allreduce([flat], opts1)

        def unflatten():
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

        return self._then("allreduce_coalesced", [inner], tensors, unflatten)

    # -- broadcast ------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        self._one_tensor("broadcast", tensors)
        self._check_root("broadcast", root)
        where = self._where(f"broadcast from rank {root}", tensors[0])
        msg = Message(tensors[0], reduce=False)
        comm = self.comm_

        def run():
            comm.Bcast(msg.buffer(where), root=root)

        return self._issue("broadcast", where, run, [msg], tensors)

    # -- all-gather -----------------------------------------------------------
    def all_gather_single(self, output, input, opts=None):
        """all_gather_into_tensor: ``output`` holds size x ``input``, rank order."""
        where = self._where("all_gather_into_tensor", input)
        self._check_sizes(where, output, input.numel() * self.size_, input.dtype)
        out, inp = Message(output, reduce=False), Message(input, reduce=False, readonly=True)
        comm = self.comm_

        def run():
            comm.Allgather(inp.buffer(where), out.buffer(where))

        return self._issue("all_gather_single", where, run, [out], [output])

    _allgather_base = all_gather_single  # the name torch <= 2.11 calls

    def _check_one_per_rank(self, where, what, tensors, numel, dtype):
        """A list form takes one tensor per rank, each of ``numel`` elements."""
        if len(tensors) != self.size_:
            raise ValueError(f"{where}: expected {self.size_} {what} tensors, got {len(tensors)}")
        for i, t in enumerate(tensors):
            self._check_sizes(f"{where}, {what} {i}", t, numel, dtype)

    def allgather(self, output_lists, inputs, opts=None):
        self._one_tensor("allgather", inputs)
        outputs, input = output_lists[0], inputs[0]
        where = self._where("all_gather", input)
        self._check_one_per_rank(where, "output", outputs, input.numel(), input.dtype)
        flat = torch.empty((self.size_ * input.numel(),), dtype=input.dtype, device=input.device)
        inner = self.all_gather_single(flat, input.contiguous())

        def scatter_back():
            for o, piece in zip(outputs, flat.chunk(self.size_)):
                o.copy_(piece.view_as(o))

        return self._then("allgather", [inner], output_lists, scatter_back)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs)]
        return self._then("all_gather_into_tensor_coalesced", works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- reduce-scatter -------------------------------------------------------
    def reduce_scatter_single(self, output, input, opts=None):
        """reduce_scatter_tensor: rank r gets the reduction of block r of ``input``."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        where = self._where("reduce_scatter_tensor", input)
        self._check_sizes(where, input, output.numel() * self.size_, output.dtype)
        mpi, divide = mpi_op(op, input.dtype, where)
        out, inp = Message(output, reduce=True), Message(input, reduce=True, readonly=True)
        comm, size = self.comm_, self.size_

        def run():
            comm.Reduce_scatter_block(inp.buffer(where), out.buffer(where), mpi)
            if divide:
                out.staged.div_(size)

        return self._issue("reduce_scatter_single", where, run, [out], [output])

    _reduce_scatter_base = reduce_scatter_single  # the name torch <= 2.11 calls

    def reduce_scatter(self, outputs, input_lists, opts=None):
        self._one_tensor("reduce_scatter", outputs)
        output, inputs = outputs[0], input_lists[0]
        where = self._where("reduce_scatter", output)
        self._check_one_per_rank(where, "input", inputs, output.numel(), output.dtype)
        flat = torch.cat([i.reshape(-1) for i in inputs])
        return self.reduce_scatter_single(output, flat, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._then("reduce_scatter_tensor_coalesced", works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- barrier --------------------------------------------------------------
    def barrier(self, opts=None):
        comm = self.comm_
        return self._issue("barrier", self._where("barrier"), comm.Barrier, [], [])

    # -- lifecycle ------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish queued collectives, stop the MPI thread, drop this rank's end of
        the shared-memory transport and free the communicator (collective)."""
        from mpi4py import MPI

        if self.thread_.stop() and self.comm_ is not None and not MPI.Is_finalized():
            self.comm_.Free()
        self.shm_ = None
        self.comm_ = None

    def abort(self) -> None:
        self.shutdown()

    # -- checks and helpers ---------------------------------------------------
    def _one_tensor(self, op: str, tensors) -> None:
        if len(tensors) != 1:
            raise ValueError(f"{op} on rank {self.rank_}: the mpi4py backend takes one tensor per call, got {len(tensors)}")

    def _check_root(self, op: str, root: int) -> None:
        if not 0 <= root < self.size_:
            raise ValueError(f"{op} on rank {self.rank_}: root rank {root} is not in [0, {self.size_})")

    @staticmethod
    def _check_sizes(where: str, tensor: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
        if tensor.numel() != numel or tensor.dtype != dtype:
            raise ValueError(f"{where}: expected a {dtype} tensor of {numel} elements, got {tensor.dtype} of {tensor.numel()}")

    def _then(self, op: str, works, result, then=lambda: None) -> MPIWork:
        """A work that completes after ``works`` (already queued, so already run
        when the MPI thread reaches this one) and then runs ``then``: how ops
        built from other ops (coalesced, list outputs) report one result."""

        def run():
            for w in works:
                w.wait()
            then()

        return self._issue(op, f"{op} on rank {self.rank_} of {self.size_}", run, [], result)


def _create(opts, backend_options=None) -> MPI4PyProcessGroup:
    """Creator torch calls (extended API) for every group using this backend,
    only on the group's members: the default group dups MPI_COMM_WORLD,
    subgroups build a communicator of their global ranks."""
    from pydist.rendezvous.mpi_runtime import load_mpi

    where = f"mpi4py backend, group {opts.group_id!r}"
    MPI = load_mpi(where)
    world = MPI.COMM_WORLD
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            f"{where}: MPI was initialized without MPI_THREAD_MULTIPLE; do not lower mpi4py.rc.thread_level "
            "(the backend runs collectives on a thread of its own)"
        )
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    if ranks == list(range(world.Get_size())):
        comm = world.Dup()
    elif len(ranks) == opts.group_size and max(ranks) < world.Get_size():
        comm = world.Create_group(world.Get_group().Incl(ranks))
    else:
        raise RuntimeError(
            f"{where}: group of {opts.group_size} ranks {ranks} does not fit MPI_COMM_WORLD of {world.Get_size()} "
            "ranks; launch with mpirun and the same number of processes as the torch world size"
        )
    if comm.Get_rank() != opts.group_rank or comm.Get_size() != opts.group_size:
        raise RuntimeError(
            f"{where}: torch says rank {opts.group_rank} of {opts.group_size}, MPI says rank {comm.Get_rank()} of "
            f"{comm.Get_size()}; torch ranks must equal MPI_COMM_WORLD ranks (use pydist.init_process_group)"
        )
    return MPI4PyProcessGroup(comm, opts.group_rank, opts.group_size, opts.timeout, str(opts.group_id))


def register() -> str:
    """Register the backend with torch.distributed (idempotent); returns its name."""
    with _lock:
        if BACKEND_NAME not in dist.Backend.backend_list:
            dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
            atexit.register(finish_at_exit)  # See [Note: abort, not finalize, after a timeout]
    return BACKEND_NAME


def shutdown_all() -> list[MPI4PyProcessGroup]:
    """Stop every live group's MPI thread; called at exit, see
    [Note: exit cleanly under mpiexec] in pydist/rendezvous/process_group.py.
    Returns the groups that could not stop (a collective timed out)."""
    stuck = []
    for group in sorted(_live_groups, key=lambda g: g.seq_):  # one order on every rank: Comm.Free is collective
        if group.stuck:  # its communicator is in use by a call that never returns: leave it
            stuck.append(group)
            continue
        group.shutdown()
        if group.thread_.thread_.is_alive():
            stuck.append(group)
    return stuck


# [Note: abort, not finalize, after a timeout]
# mpi4py calls MPI_Finalize when the interpreter ends. If a group's MPI thread
# is still inside a collective whose peer died (a timeout), MPI_Finalize tears
# down the transport under it and the process crashes (seen: a segfault in
# ucp_worker_destroy), and mpiexec reports the crash instead of the timeout.
# At exit, once every group that can stop has stopped, a stuck group makes
# this rank call MPI_Abort, which ends the job with the timeout's message.
def finish_at_exit() -> None:
    """Stop every group; abort the MPI job if one is stuck. Registered at exit
    by ``register`` (and called by pydist's own exit handler)."""
    stuck = shutdown_all()
    if not stuck:
        return
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        reasons = "; ".join(str(g.thread_.timed_out_ or f"{g!r} did not stop") for g in stuck)
        sys.stderr.write(f"[pydist] rank {MPI.COMM_WORLD.Get_rank()}: aborting the MPI job at exit instead of "
                         f"finalizing, because a collective never finished: {reasons}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
