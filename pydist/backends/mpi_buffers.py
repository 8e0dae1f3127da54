"""How a tensor becomes an MPI message, and the reduce-op table.

[Note: zero copy, CUDA-aware, or staged]
* CPU tensor, dtype MPI can reduce: a numpy array over the same memory,
  handed to mpi4py through the buffer protocol. No copy. Built from the
  address (``MPI.buffer.fromaddress``), not by ``tensor.numpy()``, which marks
  the storage non-resizable for good: pydist's FSDP gives an unsharded
  buffer's memory back between all-gathers and points it at other memory
  (``resize_`` and ``_C.point_storage_into``; see [Note: the unsharded
  buffer's memory]).
* CPU float16 / bfloat16: MPI has no standard datatype that reduces them. Ops
  that only move bytes (broadcast, all-gather) send their bytes as-is; the
  reductions run on a float32 copy, converted back after (exact for values a
  half type can hold, like every other backend that upcasts).
* CUDA tensor, MPI is CUDA-aware (see ``cuda_aware``): the tensor itself is the buffer (mpi4py reads
  its ``__dlpack__`` / ``__cuda_array_interface__``); the caller's stream is
  synchronized first so MPI reads finished data.
* CUDA tensor, MPI is not CUDA-aware: copied to host memory at issue time
  (a synchronous copy, so it is ordered after the kernels that wrote it), the
  op runs on the host copy, and the result is copied back by the MPI thread
  before the work completes.
A non-contiguous tensor gets a contiguous copy the same way, copied back after.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.distributed as dist

__all__ = ["Message", "mpi_op", "mpi_datatype", "cuda_aware"]


@functools.cache
def cuda_aware() -> bool:
    """Whether MPI accepts CUDA pointers. ``PYDIST_MPI_CUDA_AWARE=0/1`` decides
    if set; otherwise ``MPIX_Query_cuda_support`` (an extension of Open MPI and
    MPICH >= 4; mpi4py does not wrap it, so it is looked up in the MPI library
    mpi4py is linked to) and False where the library has no such function."""
    from mpi4py import MPI

    if os.environ.get("PYDIST_MPI_CUDA_AWARE") is not None:
        return os.environ["PYDIST_MPI_CUDA_AWARE"] == "1"
    query = getattr(MPI, "Query_cuda_support", None)  # should a later mpi4py wrap it
    if query is None:
        query = getattr(ctypes.CDLL(MPI.__file__), "MPIX_Query_cuda_support", None)
    return bool(query()) if query is not None else False


_REDUCIBLE = {
    torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.int8: "INT8_T", torch.uint8: "UINT8_T",
    torch.int16: "INT16_T", torch.int32: "INT32_T", torch.int64: "INT64_T", torch.bool: "C_BOOL",
}
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def mpi_datatype(dtype: torch.dtype, where: str):
    from mpi4py import MPI

    if dtype not in _REDUCIBLE:
        raise TypeError(f"{where}: MPI cannot reduce dtype {dtype}; supported: {sorted(map(str, _REDUCIBLE))}")
    return getattr(MPI, _REDUCIBLE[dtype])


def mpi_op(op, dtype: torch.dtype, where: str):
    """``(mpi_op, divide_by_size)`` for a torch ReduceOp. AVG is a SUM whose
    result the caller divides by the group size (MPI has no average)."""
    from mpi4py import MPI

    R = dist.ReduceOp
    if dtype == torch.bool:  # torch's convention: sum/max of bools is OR, product/min is AND
        table = [(R.SUM, MPI.LOR), (R.MAX, MPI.LOR), (R.PRODUCT, MPI.LAND), (R.MIN, MPI.LAND)]
    else:
        table = [(R.SUM, MPI.SUM), (R.MAX, MPI.MAX), (R.MIN, MPI.MIN), (R.PRODUCT, MPI.PROD),
                 (R.BAND, MPI.BAND), (R.BOR, MPI.BOR), (R.BXOR, MPI.BXOR)]
    for torch_op, found in table:
        if op == torch_op:
            return found, False
    if op == R.AVG:
        if dtype.is_floating_point or dtype in _UPCAST:
            return MPI.SUM, True
        raise TypeError(f"{where}: ReduceOp.AVG needs a floating-point tensor, got {dtype}")
    raise ValueError(f"{where}: the mpi4py backend does not support reduce op {op} for {dtype}")


class Message:
    """One tensor as MPI sees it. Built on the calling thread (at issue time),
    used and written back on the MPI thread (``buffer`` / ``finish``).
    See [Note: zero copy, CUDA-aware, or staged]."""

    def __init__(self, tensor: torch.Tensor, *, reduce: bool, readonly: bool = False):
        self.tensor = tensor  # the caller's tensor; results land here
        self.reduce = reduce  # True: MPI needs a typed buffer it can reduce
        self.readonly = readonly  # True: input only, nothing to copy back
        staged = tensor
        if tensor.is_cuda and not cuda_aware():
            staged = tensor.to("cpu")  # synchronous: ordered after the kernels that wrote it
        elif tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        if not staged.is_contiguous():
            staged = staged.contiguous()
        if reduce and staged.dtype in _UPCAST:
            staged = staged.to(_UPCAST[staged.dtype])
        self.staged = staged  # what MPI reads and writes: the tensor itself when no copy was needed

    @property
    def copied(self) -> bool:
        return self.staged is not self.tensor

    def buffer(self, where: str):
        """The mpi4py message spec ``[buffer, datatype]``."""
        from mpi4py import MPI

        t = self.staged.reshape(-1)
        if self.reduce:
            dtype = mpi_datatype(t.dtype, where)
            return [t if t.is_cuda else self._host_buffer(t), dtype]
        raw = t.view(torch.uint8)  # byte-moving ops send any dtype as bytes
        return [raw if raw.is_cuda else self._host_buffer(raw), MPI.BYTE]

    def _host_buffer(self, t: torch.Tensor):
        """A numpy view of a CPU tensor's memory: see [Note: zero copy, CUDA-aware, or staged]."""
        import numpy as np
        from mpi4py import MPI

        kind = getattr(MPI, "buffer", None) or MPI.memory  # mpi4py 4 / 3
        memory = kind.fromaddress(t.data_ptr(), t.numel() * t.element_size(), readonly=self.readonly)
        return np.frombuffer(memory, dtype=_numpy_dtype(t.dtype))

    def finish(self) -> None:
        """Copy the result back into the caller's tensor when MPI worked on a copy."""
        if self.copied and not self.readonly:
            self.tensor.copy_(self.staged)


@functools.lru_cache(maxsize=None)
def _numpy_dtype(dtype: torch.dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype
