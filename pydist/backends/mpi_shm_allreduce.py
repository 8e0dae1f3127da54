"""All-reduce through an MPI-3 shared-memory window, for groups whose ranks
all share one node. Used by ``MPI4PyProcessGroup.allreduce``.

[Note: shared-memory all-reduce]
MPICH's own intra-node all-reduce tops out at ~2.1 GB/s busbw for 128 MiB on
the 2-core CI VM (a bare mpi4py ``Allreduce``, issue #4), so large messages
take this path instead when every rank of the group is on one node
(``comm.Split_type(COMM_TYPE_SHARED)`` spans the group):

* Once per group, lazily at the first eligible all-reduce, every rank
  allocates ``SHM_BUFFERS`` staging buffers of ``SHM_CHUNK_BYTES`` (+ a few
  bytes) in one
  ``MPI.Win.Allocate_shared`` window and maps every peer's slot
  (``Shared_query``). The window stays in a ``Lock_all`` epoch until the group
  is shut down, which frees it.
* The message is processed in chunks of ``SHM_CHUNK_BYTES``; each chunk is
  split into n near-equal slices, slice q reduced by rank q. Every staging
  buffer holds n regions at fixed offsets, region q for slice q. Per chunk k,
  rank r:
    stage(k)     copy the slices it does not own into its regions of its slot;
    sync         ``Win.Sync`` + ``Barrier`` + ``Win.Sync`` (the MPI-3 recipe
                 for shared windows; on x86 the barrier alone orders stores);
    reduce(k)    sum its own slice: for n == 2 in place, ``x[r] += peer[r]``
                 (IEEE addition is commutative, so this is bitwise the
                 rank-order sum x0 + x1); for n > 2 explicitly in rank order
                 x0 + x1 + ... + x_{n-1}; AVG divides here; then publish the
                 slice into region r of its own slot;
    sync         (the same sync as stage(k+1)'s, see below)
    collect(k)   copy every peer's published slice into its tensor.
  Each element is reduced by exactly one rank and copied to the others, so all
  ranks hold bitwise identical results; integer-valued data give exactly what
  MPI_SUM gives.
* One sync per chunk, not two: the sync after reduce(k) is also the one after
  stage(k+1) (the loop runs reduce(k), stage(k+1), sync, collect(k)). Chunks
  alternate between ``SHM_BUFFERS`` = 2 buffers, and that is enough: stage(k+1)
  reuses the buffer of chunk k-1, but writes only regions q != r of its own
  slot, while peers' collect(k-1) reads region q of slot q; and every peer's
  reduce(k-1) read of those regions happened before the sync that precedes
  stage(k+1). The regions must not move with a shorter last chunk, or
  stage(k+1) would overlap a region still being collected (the tests caught
  exactly that).
* Chunks are small enough (2 MiB) to stay in cache between the copy-in, the
  reduction and the copy-out, so DRAM sees about one read and one write of the
  tensor. Copies and sums use numpy (single-threaded, releases the GIL), so the
  MPI thread does not fan out over torch's intra-op pool on a 2-core machine.

Used for: CPU tensors (after mpi_buffers staging; so bf16/fp16 reduce as their
float32 copy, as on the MPI path), dtypes float32/float64/int32/int64, ops
SUM and AVG, messages of at least ``SHM_MIN_BYTES``. Everything else, and
groups that span nodes, takes the MPI path ([Note: chunked all-reduce]).
``PYDIST_MPI_SHM=0`` (same on every rank) turns this path off, for comparisons.
Measured (2 ranks, 2-core VM, benchmarks/RESULTS.md "Shared-memory
all-reduce"): in the quietest run 3.2-3.5 GB/s busbw at 8-128 MiB where MPICH
gave 2.0-2.4 GB/s run right after; below 8 MiB no clear gain, hence
SHM_MIN_BYTES. Under other load half the time goes to the per-chunk barrier
(waiting for a descheduled peer) and the >= 3x gloo target was met in only 2
of 6 runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ShmAllreduce", "SHM_CHUNK_BYTES", "SHM_BUFFERS", "SHM_MIN_BYTES", "SHM_DTYPES"]

SHM_CHUNK_BYTES = 2 << 20  # bytes reduced per step; fits in L2 + L3 with both buffers
SHM_BUFFERS = 2  # staging buffers per rank, used in turn; see the note for why 2
SHM_MIN_BYTES = 8 << 20  # below this MPICH's own all-reduce is as fast or faster (benchmarks/RESULTS.md)
SHM_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


def spans_one_node(comm) -> bool:
    """Collective over ``comm``: whether all its ranks share memory."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() == comm.Get_size()
    finally:
        node.Free()


class _Chunk(NamedTuple):
    """One step of the all-reduce: a piece of the caller's tensor, every rank's
    staging buffer for it, and which slice each rank reduces."""
    data: "numpy.ndarray"  # view into the caller's tensor
    slots: list  # slots[q][p]: in rank q's staging buffer, the region for slice p
    bounds: list  # bounds[q]: the slice rank q reduces


class ShmAllreduce:
    """The shared window of one group and the all-reduce over it. Created,
    used and freed on the group's MPI thread only."""

    def __init__(self, comm):
        from mpi4py import MPI

        self.comm_ = comm  # the group's communicator, borrowed (the group frees it)
        self.rank_ = comm.Get_rank()
        self.size_ = comm.Get_size()
        # A buffer holds n regions at fixed offsets (see _chunk), each up to
        # ceil(chunk / n) elements: up to n elements of 8 bytes more than a chunk.
        buffer_bytes = SHM_CHUNK_BYTES + 8 * self.size_
        self.win_ = MPI.Win.Allocate_shared(SHM_BUFFERS * buffer_bytes, 1, comm=comm)  # freed in free()
        self.slots_ = []  # slots_[q][b]: rank q's staging buffer b, as raw uint8 numpy views into the window
        for q in range(self.size_):
            mem, _ = self.win_.Shared_query(q)
            raw = torch.frombuffer(mem, dtype=torch.uint8).numpy()
            self.slots_.append([raw[b * buffer_bytes:(b + 1) * buffer_bytes] for b in range(SHM_BUFFERS)])
        self.win_.Lock_all()  # one passive epoch for the window's life, so Win.Sync is legal
        self.calls_ = 0  # all-reduces run here; tests assert the path was taken

    @staticmethod
    def eligible(tensor: torch.Tensor, op, divide: bool) -> bool:
        """Whether ``tensor`` (the staged, contiguous message) with this MPI op
        can take the shared-memory path. Depends only on what every rank of a
        matching collective agrees on (size, dtype, op, device)."""
        from mpi4py import MPI

        return (op == MPI.SUM and tensor.device.type == "cpu" and tensor.dtype in SHM_DTYPES
                and tensor.numel() * tensor.element_size() >= SHM_MIN_BYTES
                and (not divide or tensor.dtype.is_floating_point))

    def _sync(self) -> None:
        self.win_.Sync()
        self.comm_.Barrier()
        self.win_.Sync()

    def allreduce(self, tensor: torch.Tensor, divide: bool) -> None:
        """In-place SUM (AVG when ``divide``) of the contiguous CPU ``tensor``.
        Collective: every rank calls it with a tensor of the same size and dtype.
        One sync per chunk, see [Note: shared-memory all-reduce]."""
        x = tensor.reshape(-1).numpy()
        per_chunk = SHM_CHUNK_BYTES // x.itemsize
        chunks = [self._chunk(x, k, start) for k, start in enumerate(range(0, x.size, per_chunk))]
        self._stage(chunks[0])
        self._sync()
        for k, chunk in enumerate(chunks):
            self._reduce_and_publish(chunk, divide)
            if k + 1 < len(chunks):
                self._stage(chunks[k + 1])
            self._sync()
            self._collect(chunk)
        self.calls_ += 1

    def _chunk(self, x, k: int, start: int) -> _Chunk:
        per_chunk = SHM_CHUNK_BYTES // x.itemsize
        data = x[start:start + per_chunk]
        m, n = data.size, self.size_
        bounds = [slice(m * q // n, m * (q + 1) // n) for q in range(n)]
        # Rank q's slice sits at a fixed offset q * stride in every slot, whatever
        # the chunk's length: a shorter last chunk must not move the regions, or its
        # staging could overwrite a slice a peer is still collecting from the chunk
        # two steps earlier in the same buffer (one sync per chunk, see the note).
        stride = -(-per_chunk // n)
        slots = []
        for q in range(n):
            typed = self.slots_[q][k % SHM_BUFFERS][:n * stride * x.itemsize].view(x.dtype)
            slots.append([typed[p * stride:p * stride + (b.stop - b.start)] for p, b in enumerate(bounds)])
        return _Chunk(data, slots, bounds)

    def _stage(self, c: _Chunk) -> None:
        """Copy the slices the peers reduce into my slot."""
        for q in range(self.size_):
            if q != self.rank_:
                c.slots[self.rank_][q][...] = c.data[c.bounds[q]]

    def _reduce_and_publish(self, c: _Chunk, divide: bool) -> None:
        """Reduce my slice in rank order x0 + x1 + ... (bitwise, see the note),
        leave it in my tensor and in my slot for the peers."""
        n, r, mine = self.size_, self.rank_, c.bounds[self.rank_]
        own = c.data[mine]
        if n == 2:
            own += c.slots[1 - r][r]
        else:
            parts = [own if q == r else c.slots[q][r] for q in range(n)]
            acc = parts[0] + parts[1]
            for p in parts[2:]:
                acc += p
            own[...] = acc
        if divide:
            own /= n
        c.slots[r][r][...] = own

    def _collect(self, c: _Chunk) -> None:
        """Copy the peers' reduced slices into my tensor."""
        for q in range(self.size_):
            if q != self.rank_:
                c.data[c.bounds[q]] = c.slots[q][q]

    def free(self) -> None:
        """Collective: end the epoch and free the window."""
        self.win_.Unlock_all()
        self.win_.Free()
        self.slots_ = []
