"""All-reduce through an MPI-3 shared-memory window, for groups whose ranks
all share one node. Used by ``MPI4PyProcessGroup.allreduce``.

[Note: shared-memory all-reduce]
MPICH's own intra-node all-reduce tops out at ~2.1 GB/s busbw for 128 MiB on
the 2-core CI VM (a bare mpi4py ``Allreduce``, issue #4), so large messages
take this path instead when every rank of the group is on one node
(``comm.Split_type(COMM_TYPE_SHARED)`` spans the group):

* Once per group, lazily at the first eligible all-reduce, every rank
  allocates ``SHM_BUFFERS`` staging chunks of ``SHM_CHUNK_BYTES`` in one
  ``MPI.Win.Allocate_shared`` window and maps every peer's slot
  (``Shared_query``). The window stays in a ``Lock_all`` epoch until the group
  is shut down, which frees it.
* The message is processed in chunks of ``SHM_CHUNK_BYTES``; each chunk is
  split into n near-equal slices, slice q owned by rank q. Per chunk, rank r:
    1. copies the slices it does not own into its slot (peers read them there);
    2. ``Win.Sync`` + ``Barrier`` + ``Win.Sync`` (the MPI-3 separate-memory
       recipe; on x86 the barrier alone orders the stores);
    3. reduces its own slice: for n == 2 in place, ``x[r] += slot_peer[r]``
       (IEEE addition is commutative, so this is bitwise the rank-order sum
       x0 + x1); for n > 2 explicitly in rank order x0 + x1 + ... + x_{n-1};
       AVG divides the slice here; then publishes the slice in its own slot;
    4. sync + barrier again;
    5. copies every peer's published slice into its tensor.
  Each element is reduced by exactly one rank and copied to the others, so all
  ranks hold bitwise identical results; integer-valued data give exactly what
  MPI_SUM gives.
* Chunks alternate between the ``SHM_BUFFERS`` (2) staging buffers, so the
  copy-in of chunk k+1 never overwrites a slice a peer is still copying out of
  chunk k: a rank reaches copy-in of chunk k+2 (same buffer as k) only after
  the second barrier of chunk k+1, which every rank passes after finishing
  its copy-out of chunk k. Two barriers per chunk suffice.
* Chunks are small enough (2 MiB) to stay in cache between the copy-in, the
  reduction and the copy-out, so DRAM sees about one read and one write of the
  tensor. Copies and sums use numpy (single-threaded, releases the GIL), so the
  MPI thread does not fan out over torch's intra-op pool on a 2-core machine.

Used for: CPU tensors (after mpi_buffers staging; so bf16/fp16 reduce as their
float32 copy, as on the MPI path), dtypes float32/float64/int32/int64, ops
SUM and AVG, messages of at least ``SHM_MIN_BYTES``. Everything else, and
groups that span nodes, takes the MPI path ([Note: chunked all-reduce]).
Measured numbers are in benchmarks/RESULTS.md ("Shared-memory all-reduce").
"""

from __future__ import annotations

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


class ShmAllreduce:
    """The shared window of one group and the all-reduce over it. Created,
    used and freed on the group's MPI thread only."""

    def __init__(self, comm):
        from mpi4py import MPI

        self.comm_ = comm  # the group's communicator, borrowed (the group frees it)
        self.rank_ = comm.Get_rank()
        self.size_ = comm.Get_size()
        self.win_ = MPI.Win.Allocate_shared(SHM_BUFFERS * SHM_CHUNK_BYTES, 1, comm=comm)  # freed in free()
        self.slots_ = []  # slots_[q][b]: rank q's staging buffer b, as raw uint8 numpy views into the window
        for q in range(self.size_):
            mem, _ = self.win_.Shared_query(q)
            raw = torch.frombuffer(mem, dtype=torch.uint8).numpy()
            self.slots_.append([raw[b * SHM_CHUNK_BYTES:(b + 1) * SHM_CHUNK_BYTES] for b in range(SHM_BUFFERS)])
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
        Collective: every rank calls it with a tensor of the same size and dtype."""
        x = tensor.reshape(-1).numpy()
        n, r = self.size_, self.rank_
        per_chunk = SHM_CHUNK_BYTES // x.itemsize
        for k, start in enumerate(range(0, x.size, per_chunk)):
            chunk = x[start:start + per_chunk]
            m = chunk.size
            bounds = [m * q // n for q in range(n + 1)]
            b = k % SHM_BUFFERS
            slot = [self.slots_[q][b][:m * x.itemsize].view(x.dtype) for q in range(n)]
            lo, hi = bounds[r], bounds[r + 1]
            # 1. stage the slices the peers reduce
            for q in range(n):
                if q != r:
                    slot[r][bounds[q]:bounds[q + 1]] = chunk[bounds[q]:bounds[q + 1]]
            self._sync()
            # 3. reduce my slice, same order for every element: x0 + x1 + ... (see the note)
            mine = chunk[lo:hi]
            if n == 2:
                mine += slot[1 - r][lo:hi]
            else:
                parts = [mine if q == r else slot[q][lo:hi] for q in range(n)]
                acc = parts[0] + parts[1]
                for p in parts[2:]:
                    acc += p
                mine[...] = acc
            if divide:
                mine /= n
            slot[r][lo:hi] = mine
            self._sync()
            # 5. collect the peers' reduced slices
            for q in range(n):
                if q != r:
                    chunk[bounds[q]:bounds[q + 1]] = slot[q][bounds[q]:bounds[q + 1]]
        self.calls_ += 1

    def free(self) -> None:
        """Collective: end the epoch and free the window."""
        self.win_.Unlock_all()
        self.win_.Free()
        self.slots_ = []
