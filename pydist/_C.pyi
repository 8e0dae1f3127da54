"""Type stubs for pydist._C, the compiled extension (csrc/module.cpp).

The ops (flatten, flatten_into, unflatten_into) are registered with torch's
dispatcher (TORCH_LIBRARY in csrc/module.cpp) and reached as
torch.ops.pydist.*, wrapped by pydist/ops.py; they are not attributes of
this module. tests/test_transport.py checks that these stubs name exactly
what the extension exports.
"""

from typing import Sequence

import torch
import torch.distributed as dist

# --- records (csrc/reducer/records.h, [Note: record clocks]) -----------------

DEFAULT_RECORDS_KEPT: int
"""Iterations whose records a reducer keeps unless told otherwise."""

def profiler_clock_offset_ns() -> int:
    """ns to add to a steady-clock (time.monotonic_ns) time to get torch.profiler's clock."""

class ChunkRecord:
    """One collective of a bucket; ns since the iteration's start_ns, -1 where it did not happen."""

    @property
    def offset(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def collective(self) -> str: ...
    @property
    def launch_ns(self) -> int: ...
    @property
    def complete_ns(self) -> int: ...

class BucketRecord:
    """Timing of one bucket; ns since the iteration's start_ns, -1 where it did not happen."""

    @property
    def index(self) -> int: ...
    @property
    def num_params(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def first_grad_ns(self) -> int: ...
    @property
    def last_grad_ns(self) -> int: ...
    @property
    def param_indices(self) -> list[int]: ...  # the bucket's parameters, in the order their gradients were ready
    @property
    def grad_ns(self) -> list[int]: ...  # when each of them was ready
    @property
    def launch_ns(self) -> int: ...
    @property
    def complete_ns(self) -> int: ...
    @property
    def done_ns(self) -> int: ...
    @property
    def chunks(self) -> list[ChunkRecord]: ...

class IterationRecord:
    """What the reducer measured in one iteration."""

    @property
    def iteration(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def transport(self) -> str: ...
    @property
    def start_ns(self) -> int:
        """Absolute steady-clock time the reducer was armed for this backward."""
    @property
    def backward_end_ns(self) -> int: ...
    @property
    def finalize_end_ns(self) -> int: ...
    @property
    def buckets(self) -> list[BucketRecord]: ...

# --- transports (csrc/transport/transport.h) ----------------------------------

class TransportFuture:
    """One collective in flight on a transport."""

    def wait(self) -> int:
        """Blocks until done (raises its error); the completion time in ns on
        time.monotonic_ns's clock, or -1 when the transport stamps no times."""
    def done(self) -> bool: ...

class Transport:
    """Moves tensors between the ranks of one group; see [Note: transports]."""

    def all_reduce(self, piece: torch.Tensor, scale: float = 1.0, *, priority: int = 0) -> TransportFuture: ...
    def reduce_scatter(
        self, input: torch.Tensor, output_shard: torch.Tensor, scale: float = 1.0
    ) -> TransportFuture: ...
    def all_gather(self, shard: torch.Tensor, output: torch.Tensor) -> TransportFuture: ...
    def all_gather_many(self, inputs: list[torch.Tensor], outputs: list[list[torch.Tensor]]) -> TransportFuture:
        """One all-gather of the concatenation of ``inputs``: rank q's ``inputs[i]``
        lands in ``outputs[q][i]`` (contiguous, one dtype, sizes matching)."""
    def empty_buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialized 1-d CPU tensor to all-reduce pieces of; the shared-memory
        transport reduces pieces of its own buffers in place."""
    def stats(self) -> dict[str, int]: ...
    def abort(self, why: str) -> None: ...
    def set_stamp_completion(self, on: bool) -> None: ...
    @property
    def applies_scale(self) -> bool: ...
    @property
    def owns_buckets(self) -> bool: ...
    @property
    def orders_by_priority(self) -> bool: ...  # sim_net and ordered decide the order from priorities
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def name(self) -> str: ...

class ProcessGroupTransport(Transport):
    def __init__(self, process_group: dist.ProcessGroup) -> None: ...
    @property
    def failure_context(self) -> str: ...  # appended to a failed collective's error
    @failure_context.setter
    def failure_context(self, value: str) -> None: ...

class ShmTransport(Transport):
    def __init__(self, name: str, rank: int, world_size: int, create: bool, timeout_s: float) -> None: ...
    def unlink(self) -> None: ...
    def close(self) -> None: ...
    def allreduce_(self, tensor: torch.Tensor, scale: float = 1.0) -> torch.Tensor: ...
    @staticmethod
    def supports(dtype: torch.dtype) -> bool: ...
    @property
    def segment_name(self) -> str: ...

def wrap_transport(name: str, inner: Transport, options: dict[str, float] = ...) -> Transport: ...
def registered_wrappers() -> list[str]: ...
def hierarchical_transport(
    local_in: Transport,
    local_out: Transport,
    cross: Transport,
    rank: int,
    rank_of: list[list[int]],
    host_names: list[str],
) -> Transport: ...  # csrc/transport/hierarchical_transport.cpp

# --- the reducer (csrc/reducer/reducer.h) -------------------------------------

class Reducer:
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        param_names: Sequence[str],
        bucket_indices: Sequence[Sequence[int]],
        process_group: dist.ProcessGroup,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        rebuild_buckets: bool = False,
        record_timing: bool = False,
        chunk_bytes: int = ...,
        transport: Transport | None = None,
        records_kept: int = ...,
    ) -> None: ...
    def rebuild_buckets(self, bucket_indices: Sequence[Sequence[int]]) -> None: ...
    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None: ...
    @property
    def walks_outputs(self) -> bool: ...  # whether prepare_for_backward reads its outputs
    def delay_all_reduce(self) -> None: ...
    def set_comm_hook(self, state: object, hook: object) -> None: ...
    def set_transport(self, transport: Transport) -> None: ...
    def match_all_reduce_for_bwd_pass(self) -> None: ...
    def match_unused_params_allreduce(self) -> None: ...
    def pending_rebuild_order(self) -> list[int] | None: ...
    def bucket_indices(self) -> list[list[int]]: ...
    @property
    def has_rebuilt_buckets(self) -> bool: ...
    def last_record(self) -> IterationRecord: ...
    def iteration_records(self) -> list[IterationRecord]: ...
    def clear_records(self) -> None: ...
    def set_record_timing(self, on: bool, keep: int = ...) -> None: ...
    def set_average_divisor(self, divisor: int) -> None: ...
    @property
    def transport(self) -> Transport: ...
    # overlap_optimizer's deferred finalize (pydist/ddp/overlap_optimizer.py)
    def set_defer_finalize(self, on: bool) -> None: ...
    @property
    def defer_finalize(self) -> bool: ...
    def finish_bucket(self, bucket_index: int) -> bool: ...  # waits for one bucket, writes its grads back
    def landed_buckets(self) -> list[int]: ...  # buckets not finished whose collectives all completed (no wait)
    def finish_all(self) -> None: ...
    @property
    def state(self) -> str: ...  # "Idle", "Armed", "Reducing" or "Finishing"

# --- a sharded unit's gradients (csrc/reducer/bucket.h) ------------------------

def pack_rank_major(
    grads: Sequence[torch.Tensor | None],
    numels: Sequence[int],
    out: torch.Tensor,
    world_size: int,
    column: int,
    shard_numel: int,
    scale: float = 1.0,
) -> None:
    """Writes a unit's flat gradient layout (None: zeros; zero padding to
    world_size * shard_numel), times scale, into its column of the rank-major
    ``out``: element e at ``out[(e // shard_numel) * row + column + e % shard_numel]``."""

def pack_param_grads(
    params: Sequence[torch.Tensor],
    numels: Sequence[int],
    out: torch.Tensor,
    world_size: int,
    column: int,
    shard_numel: int,
    scale: float = 1.0,
) -> list[bool]:
    """``pack_rank_major`` of ``params``' ``.grad``s (each cast to ``out``'s
    dtype and made contiguous where it is not; None: zeros), then clears
    them. Returns, per parameter, whether it had a ``.grad``."""

def pieces_like(output: torch.Tensor, likes: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
    """``output[offsets[i]:offsets[i] + likes[i].numel()]`` viewed in ``likes[i]``'s shape
    (contiguous strides), one view per tensor, no copy."""

def hand_out_grads(output: torch.Tensor, params: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Each ``params[i].grad`` becomes ``output[offsets[i]:offsets[i] + params[i].numel()]``
    (1-D, contiguous, in its dtype) viewed in its shape, or that is added to the one it has."""

def point_storage_into(buffer: torch.Tensor, slot: torch.Tensor, offset_bytes: int) -> None:
    """Points ``buffer``'s storage (holding no memory) at ``slot``'s bytes from
    ``offset_bytes`` on, without owning them; the caller keeps ``slot`` alive."""

def point_storages_into(buffers: Sequence[torch.Tensor], slot: torch.Tensor, offsets_bytes: Sequence[int]) -> None:
    """point_storage_into of each buffer at its offset: a batch of units gathered into one slot."""

def point_storage_at_nothing(buffer: torch.Tensor) -> int:
    """Leaves ``buffer``'s storage with no memory (frees it if it owned it);
    returns the address it held (0: none)."""

# --- pydist/fsdp's hooks on unit outputs (csrc/fsdp/output_gate.h) ------------

class OutputGate:
    """A unit output's backward hook that can be closed: open, it calls
    ``callback()`` under the GIL; closed, it returns at once without it."""

    def __init__(self, callback: object) -> None: ...
    def attach(self, output: torch.Tensor) -> None:
        """Registers the gate as a backward hook of ``output`` (which requires grad)."""
    def close(self, pack: GradPack | None = None) -> None:
        """From now on the hook returns at once, packing ``pack`` when it fires."""
    @property
    def closed(self) -> bool: ...

class GradPack:
    """One unit's gradients on their way into its reduce batch's rank-major input."""

    def __init__(self, params: Sequence[torch.Tensor], numels: Sequence[int],
                 columns: Sequence[tuple[int, int, int, int]]) -> None:
        """``columns``: the unit's layout, (first, end, shard_offset, width) each."""
    def aim(self, input: torch.Tensor, world_size: int, column: int, scale: float) -> None:
        """Where this backward's pack goes: the unit's part of input's world_size rows starts at column, times scale."""
    def pack(self) -> None:
        """pack_param_grads into the aim, once."""
    @property
    def packed(self) -> bool: ...
    def take_had(self) -> list[bool]:
        """Which parameters had a gradient, once packed; forgets the aim."""

def streaming_isa() -> str:
    """Instruction set the CPU flatten kernels stream large buffers with (avx512, avx or none)."""
