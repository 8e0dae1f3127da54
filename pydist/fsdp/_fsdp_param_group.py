"""One unit of pydist's FSDP: the parameters one ``fully_shard`` call
manages, communicated together.

[Note: the unit's flat layout]
A unit's parameters (one dtype) are laid end to end in the order the module
registers them: the flat layout, ``total`` elements. It is padded at its
end only, to ``padded = N * shard_numel`` with ``shard_numel =
ceil(total / N)``, and rank r keeps ``[r * shard_numel, (r+1) * shard_numel)``
in one contiguous shard buffer. So the shards *are* the all-gather's input
and the all-gather's output *is* the unsharded parameters (each a view of
it): no copy in or out, and at most N - 1 padding elements per unit where
torch's FSDP2 pads every parameter's dim 0 to a multiple of N (a
``Linear(4096, 1)`` + ``Linear(1, 4096)`` pair at 4 ranks: 2.0x the bytes
there, ~1.0x here). The reduce-scatter input is the same layout, holding
the gradients, so rank r receives exactly the gradient of its shard.

[Note: a unit's layout]
Each door lays a unit out as the torch API it imitates does, once, when
the unit is made (``Layout``); everything after (the pool, the batched
collectives, the packing, the plans, the transports) reads the result, a
list of columns. A column is a run of the unsharded buffer cut evenly
across the ranks, ``width`` elements each: rank r keeps cut r, and the
shard buffer is the rank's cuts of every column end to end.
  FLAT   (``FullyShardedDataParallel``, FSDP1's): one column, the flat layout
         above.
  SHARD0 (``fully_shard``, FSDP2's): one column per parameter, its dim 0
         chunked as torch chunks it (``ceil(dim0 / N)`` rows a rank, the
         last ranks' chunks short or empty, padded to that many rows), so
         rank r's piece of a parameter is rows ``[r * c, (r + 1) * c)`` and
         the shard is FSDP2's all-gather input byte for byte.
In the unsharded buffer a column is whole, ``N * width`` elements: its
parameters in full, then its padding. So a unit of one column all-gathers
straight into it, and a unit of several gathers as a batch of columns does
(each rank's cut copied out into its column, see [Note: batched
collectives]), which is the copy-out torch's FSDP2 makes after its
all-gather; a gradient is packed into the reduce-scatter input per column.
Bytes on the wire and in the shard are FSDP2's under SHARD0: padding per
parameter, not per unit.

[Note: the unsharded buffer's memory]
Autograd keeps the unsharded parameters a unit's forward used (``Linear``
saves its weight) and reads them in backward. The tensors it saved are views
of the unit's unsharded buffer, so they pin its storage *object*: each unit
keeps one storage object for good, and only the memory behind it comes and
goes. ``reshard`` leaves the storage with no memory (a null pointer, 0
bytes: ``_C.point_storage_at_nothing``), ``unshard`` gives it memory again
and all-gathers into it, so backward reads the re-gathered values through
the saved views (the version counters are left alone: see
``all_gather_unit``).

The memory comes from the root's pool (``UnshardPool``, _fsdp_schedule.py): POOL_SLOTS = 2
slots, prefetch depth + 1 (the batch being computed and the one the root's
plan gathers ahead; see [Note: gather and reduce plans] in _fsdp_schedule.py).
A slot is one allocation that grows within an iteration (to the largest
batch it held), and a batch of units gathered as one collective shares one
slot, each unit's storage pointing at its offset without owning it
(``_C.point_storage_into``). So an iteration allocates the unsharded
buffers' memory once per slot, where giving every unit its own memory at
each unshard (``resize_``) cost a malloc and a free per unit and phase, and
for a large unit fresh zeroed pages from the kernel every time. When the
iteration's unsharding is over (the root's final callback, or a root forward
without grad) the root frees the slots (``UnshardPool.release``): between
iterations the pool holds nothing, so a rank's persistent bytes stay the
shards, gradients and optimizer state (16 Psi / N for fp32 Adam), and
unsharded memory is only ever what this iteration needs. (A batched gather
off shared memory still stages through a buffer of the transport's own,
freed at its completion: see ``UnitsGather``.)

What makes reuse safe, by construction: a slot is taken whole at unshard,
only when no unit points into it, and is given back only when the last unit
in it has resharded (``PoolSlot.users``); a unit's storage is pointed only
while it holds no memory. ``PoolSlot.take`` and ``PoolSlot.give_back`` check
both and raise, naming the units, rather than let two batches share bytes.

Who borrows a slot: a unit unsharded by the root's plan or by its own
pre-forward / pre-backward, when it will reshard at the end of that phase
(reshard_after_forward in forward, and not the root, which keeps its
parameters for backward; reshard_after_backward in backward). Everything
else owns its memory as before (``resize_``): an explicit ``unshard()``, a
``set_modules_to_forward_prefetch`` / ``_backward_prefetch`` target, the
root, units under reshard_after_forward=False or set_reshard_after_backward(
False), and a batch that finds both slots taken (a parent unit computing
around its children holds its slot throughout). A borrowing unit that turns
out not to reshard when expected (its post-forward or post-backward does not
reshard it: the settings changed in between) moves its
bytes to memory of its own first (``_leave_pool``), so no slot outlives its
phase. The pool is on the root's units' device (one device per root: see
[Note: units on a CUDA device]). What it holds is counted in ``pydist.fsdp.persistent_bytes(...).pools``: 0
between iterations, unless a slot is still taken then (a unit unsharded
by hand, say).

[Note: units on a CUDA device]
A unit lives where its parameters are: the shard, the unsharded buffer, the
pool's slots, the reduce inputs and outputs are allocated on that device
(a unit built on the meta device: the one ``to_empty`` gives it), and every
unit of a root is on one device. Everything else is the CPU path with three
differences, each where the host's view of a device collective is not the
device's:
  * the transport is the process group (NCCL; gloo, which stages CUDA
    tensors through pinned host memory): shared memory carries CPU tensors;
  * the small collectives (the wrapping and built-model checks, the
    gradient flags) send their values from the units' device, as NCCL
    carries no CPU tensor (``collectives.all_gather_small(..., device)``);
  * a collective "done" on the host may still run on a stream of the
    group's: a batched all-gather copies its output out on the waiting
    thread after the group's wait (csrc/transport/transport.cpp,
    ``Transport::all_gather_many``), and a reduction's input is let go of
    only after the compute stream waited for its collective, two
    reductions later (see [Note: reduce inputs on a device] in
    _fsdp_schedule.py).
Communication overlaps compute where the group runs it on its own stream
(NCCL); the packing copies and casts run on the compute stream. Packing a
unit's gradients is one ATen op per cut on the device (``pack_rank_major``
in csrc/fsdp/unit_ops.cpp), bitwise the CPU pack.

[Note: mixed precision]
With a ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` the
shard stays fp32 (what the optimizer steps on); ``unshard`` casts it to
``param_dtype`` and all-gathers that, so the unsharded buffer, forward and
backward are bf16; ``post_backward`` casts the bf16 gradients to
``reduce_dtype`` as it packs them and reduce-scatters in fp32; the reduced
shard is cast to the shard's dtype for ``.grad``. These are the casts torch's
FSDP2 makes, in the same places, so the results are bitwise its at two ranks.
"""

from __future__ import annotations

import enum
import time
from typing import NamedTuple, Sequence

import torch
import torch.nn as nn

from pydist import _C
from pydist.fsdp import _clip_grad as clip_grad
from pydist.fsdp import _fsdp_collectives as collectives
from pydist.fsdp._fsdp_common import Materializing, Phase, ShardedState, TrainingState
from pydist.fsdp._fsdp_param import FSDPParam, ParamModuleInfo, dtensor_spec, hand_out_dtensor_grads

__all__ = ["FSDPParamGroup", "Layout", "Column", "Phase", "Materializing", "TrainingState", "ShardedState",
           "CollectiveRecord", "ReplicaReduce"]


class Layout(enum.Enum):
    """How a unit's parameters are cut across the ranks: see [Note: a unit's layout]."""

    FLAT = "flat"  # FSDP1's: the parameters end to end, cut evenly
    SHARD0 = "shard0"  # FSDP2's: each parameter's dim 0 chunked


class Column(NamedTuple):
    """A run of a unit's unsharded buffer cut evenly across the ranks: see
    [Note: a unit's layout]."""

    offset: int  # where it starts in the unsharded buffer
    shard_offset: int  # where a rank's cut starts in the shard buffer
    width: int  # elements per rank
    rows: int  # SHARD0: rows of its one parameter per rank (the cut is along dim 0); 0: flat


def _lay_out(shapes: Sequence[torch.Size], layout: Layout, world_size: int) -> tuple[list, list]:
    """The columns of a unit of parameters of ``shapes``, and per parameter
    (its column, where it starts in the unsharded buffer)."""
    if layout is Layout.FLAT:
        column = Column(0, 0, -(-sum(s.numel() for s in shapes) // world_size), 0)
        places, offset = [], 0
        for shape in shapes:
            places.append((column, offset))
            offset += shape.numel()
        return [column], places
    columns, places, shard_offset = [], [], 0
    for shape in shapes:
        numel = shape.numel()
        rows = -(-shape[0] // world_size) if len(shape) > 0 else 0
        width = rows * shape[1:].numel() if rows else -(-numel // world_size)
        column = Column(world_size * shard_offset, shard_offset, width, rows)
        columns.append(column)
        places.append((column, column.offset))
        shard_offset += width
    return columns, places


class CollectiveRecord(NamedTuple):
    """One collective of one unit in one iteration, on time.monotonic_ns's
    clock, as the DDP reducer keeps per bucket: so exposed communication can
    be attributed to a unit."""

    unit: str  # the unit's module name under the root ("" for the root)
    kind: str  # "all_gather" or "reduce_scatter"
    phase: str  # a Phase's value: an all-gather's; "backward" for reductions
    issued_ns: int  # handed to the transport
    needed_ns: int  # the compute thread began waiting for it
    completed_ns: int  # the transport finished it (-1: not stamped)

    @property
    def exposed_ns(self) -> int:
        """How long the compute thread waited for it."""
        return max(0, self.completed_ns - self.needed_ns) if self.completed_ns >= 0 else 0


# The states the hot paths test by identity.
_IDLE, _FORWARD = TrainingState.IDLE, TrainingState.FORWARD
_PRE_BACKWARD, _POST_BACKWARD = TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD
_SHARDED, _UNSHARDING, _UNSHARDED, _KEPT = (ShardedState.SHARDED, ShardedState.UNSHARDING, ShardedState.UNSHARDED,
                                            ShardedState.KEPT)


class FSDPParamGroup:
    """The parameters of one unit, their shard buffer and their collectives.

    Lifecycle per iteration: ``pre_forward`` (unshard, wait) ->
    ``post_forward`` (reshard if reshard_after_forward) -> ``pre_backward``
    (unshard again, prefetch the next unit) -> ``post_backward`` (pack the
    gradients, start the reduce-scatter, reshard) -> ``finalize_backward``
    (wait, hand the shards their ``.grad``). See [Note: the unit's flat layout].
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter, list[ParamModuleInfo]]],
                 rank: int, world_size: int, sharded: bool, reshard_after_forward: bool, label: str,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 zeros_for_unused: bool = False, layout: Layout = Layout.FLAT, mesh=None):
        dtypes = {p.dtype for _, p, _ in named_params}
        if len(dtypes) > 1:
            listing = ", ".join(f"{n}: {p.dtype}" for n, p, _ in named_params)
            raise NotImplementedError(
                f"pydist.fully_shard({label}): the parameters of one unit must share a dtype ({listing}); "
                "call fully_shard on submodules so each unit has one dtype"
            )
        devices = {p.device for _, p, _ in named_params}
        for n, p, _ in named_params:
            if p.device.type not in ("cpu", "cuda", "meta") or len(devices) > 1:
                raise NotImplementedError(
                    f"pydist.fully_shard({label}): parameter {n} is on {p.device}"
                    + (f" and others of the unit on {sorted(map(str, devices - {p.device}))}" if len(devices) > 1
                       else "")
                    + "; pydist shards a unit whose parameters are all on one CPU or CUDA device, or all on the meta "
                    "device (see [Note: a unit built on the meta device])"
                )
        # See [Note: a unit built on the meta device]: META until
        # to_empty, FULL (LOCAL) until the unit's first use, then None.
        self.materializing: Materializing | None = (Materializing.META if {d.type for d in devices} == {"meta"}
                                                    else None)
        # Where the shard, the unsharded buffer and the gradients live: the
        # parameters' device (a meta unit's: the one to_empty gives it).
        self.device: torch.device = next(iter(devices), torch.device("cpu"))
        # Per parameter, a digest of the values this rank built (int64; set
        # when the unit is laid out, dropped when a state dict loads into it):
        # see [Note: every rank builds the same model] in _fsdp_state.py.
        self.built_digests: torch.Tensor | None = None
        if self.materializing and not sharded:
            raise NotImplementedError(f"pydist FSDP ({label}): NO_SHARD on the meta device is not implemented yet; "
                                      "materialize the module (to_empty(device='cpu'), then initialize it) first")
        if param_dtype is not None and not sharded:
            raise NotImplementedError(f"pydist FSDP ({label}): mixed precision with NO_SHARD is not implemented yet")
        self.label = label  # the module's class, then (root lazy init) its name under the root: records, errors
        # The shards' dtype: theirs, their gradients' and the optimizer's.
        self.dtype = dtypes.pop()
        # Mixed precision (see [Note: mixed precision]): the dtype forward and
        # backward compute in (the unsharded buffer's), and the one gradients
        # are reduced in.
        self.compute_dtype = param_dtype or self.dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        # What the MixedPrecisionPolicy set of those two (None: follow the
        # shards' dtype), for a cast of the unit (_retype).
        self._mp_dtypes = (param_dtype, reduce_dtype)
        self.rank = rank
        # Ranks the parameters are sharded over: the group's size, or 1 for
        # NO_SHARD (every rank keeps everything, gradients are all-reduced).
        self.shard_world_size = world_size if sharded else 1
        self.world_size = world_size
        self.sharded = sharded
        self.total_numel = sum(p.numel() for _, p, _ in named_params)
        # See [Note: a unit's layout]: the columns, and per parameter its
        # column and its first element's place in the unsharded buffer.
        self.layout = layout if sharded else Layout.FLAT
        self.columns, places = _lay_out([p.shape for _, p, _ in named_params], self.layout, self.shard_world_size)
        self.shard_numel = sum(c.width for c in self.columns)
        self.padded_numel = self.shard_numel * self.shard_world_size
        # This rank's shard; the sharded parameters are views of it. Lives
        # as long as the unit (a meta unit's is replaced when it is sharded
        # for real: shard_materialized).
        self.shard = (torch.empty(self.shard_numel, dtype=self.dtype, device="meta") if self.materializing
                      else self._shard_of([p for _, p, _ in named_params]))
        shard_rank = self.rank if sharded else 0
        # FSDP2's door: DTensor parameters on ``mesh`` (see [Note: DTensor parameters] in _fsdp_param.py).
        self.dtensor = mesh is not None and self.layout is Layout.SHARD0
        specs = [None] * len(named_params)
        if self.dtensor:
            for fqn, p, _ in named_params:
                if p.dim() == 0:
                    raise NotImplementedError(
                        f"pydist.fully_shard({label}): parameter {fqn} has no dimension; FSDP2 shards each "
                        "parameter on dim 0 (torch's fully_shard refuses it too): give it shape (1,), or leave it "
                        "out of fully_shard'ed modules")
            specs = [dtensor_spec(mesh, p.shape, p.dtype) for _, p, _ in named_params]
        self.fsdp_params = [FSDPParam(p, infos, fqn, offset, self.shard, column, shard_rank, spec)
                            for (fqn, p, infos), (column, offset), spec in zip(named_params, places, specs)]
        for fp in self.fsdp_params:
            fp.param_group = self  # the unit a shard belongs to, for clip_grad_norm_ and state dicts
        # The all-gather's output; the unsharded parameters are views of it.
        # Holds memory only while unsharded: see [Note: the unsharded buffer's memory].
        if sharded:
            self.unsharded = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=self.device)
            self.unsharded.untyped_storage().resize_(0)
        else:
            self.unsharded = self.shard
            for fp in self.fsdp_params:  # NO_SHARD: the module keeps its full parameters, the same objects
                param = fp.sharded_param
                param.data = fp.full_view(self.shard)
                fp.unsharded_param = param
        # The unsharded buffer's bytes (what a pool slot lends it).
        self.unsharded_nbytes = self.padded_numel * self.unsharded.element_size()
        # Where each parameter is registered, as (module._parameters, name,
        # the tensor to put there), flattened once: what reshard and
        # wait_for_unshard put in place (the unsharded list once the
        # unsharded parameters exist).
        self._sharded_regs = self._registrations("sharded_param")
        self._unsharded_regs: list | None = None
        if not self.materializing or self.dtensor:  # a flat meta unit keeps the full-size meta parameters
            _register(self._sharded_regs)
        # The unsharded parameters, once they exist (NO_SHARD: now), as the
        # post-backward packs their .grads; whether any FSDPParam holds an
        # accumulated_grad (gradient sync off under mixed precision), which
        # that packing does not read.
        self._unsharded_params: list[nn.Parameter] | None = (
            None if sharded else [fp.unsharded_param for fp in self.fsdp_params])
        # The _C.GradPack of those gradients, once they exist (sharded units):
        # what a closed output gate packs in a run (see [Note: runs of units]
        # in _fsdp_schedule.py).
        self._grad_pack = None
        self._accumulating = False
        # The trainable parameters (_take_up_requires_grad); every
        # parameter's numel, as the packing copy reads the layout.
        self._take_up_requires_grad()
        self._numels = [fp.numel for fp in self.fsdp_params]
        # Per column, the parameters in it ([first, end) of fsdp_params):
        # what a packing copy takes per column (see [Note: a unit's layout]).
        self._column_params = _column_params(self.fsdp_params, self.columns)
        # Per rank, each column's cut of the unsharded buffer: what a batched
        # all-gather copies into. Views, valid across resizes, made at the
        # first (a view cannot be made while the buffer has no memory); with
        # them, each column's cut of the shard (what it sends), made once
        # for every batch the unit is in (forward's and backward's).
        self.rank_views: list[list[torch.Tensor]] | None = None
        self.shard_views: list[torch.Tensor] | None = None
        # Where each parameter's part of the reduced output starts: the
        # output is laid out as the shard buffer is.
        for fp in self.fsdp_params:
            fp._grad_offset = fp.shard_offset
        # NO_SHARD units are unsharded for good: unshard and reshard do nothing.
        self.sharded_state = ShardedState.SHARDED if sharded else ShardedState.UNSHARDED
        self.training_state = TrainingState.IDLE
        # Set by the root at its lazy init: the transport every unit of the
        # root shares (see [Note: which transport carries a sharded unit]).
        self.transport = None
        # HSDP: the transport over the replicas (set with ``transport``;
        # None: no replica to all-reduce with). See [Note: HSDP].
        self.replicate_transport = None
        self._replica_reduce: ReplicaReduce | None = None
        # HSDP: False (set_requires_all_reduce) keeps this unit's reduced
        # shards in _partial, summed over backwards, until a backward with
        # True all-reduces them with its own. See [Note: HSDP].
        self.requires_all_reduce = True
        self._partial: torch.Tensor | None = None
        # set_all_reduce_hook's hook: called with the unit's reduced shard
        # (after the replicas' all-reduce under HSDP) before it becomes .grad.
        self.all_reduce_hook = None
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        # See [Note: parameters without a gradient]: True gives every
        # trainable shard a .grad (torch FSDP1's answer), False leaves those
        # no rank had a gradient for as they are (FSDP2's). Per parameter,
        # whether it had a gradient here in this synced backward (None: the
        # unit reduced nothing yet), and the parameters whose shards get a
        # .grad from it once the root has asked every rank (None: the
        # trainable ones, the common case).
        self.zeros_for_unused = zeros_for_unused
        self.had_grad: list[bool] | None = None
        self._grads_for: list[FSDPParam] | None = None
        self.requires_gradient_sync = True
        # The all-gather in flight while UNSHARDING (an UnshardResult), and
        # (issued_ns, its Phase's value) for its record.
        self._unshard_future = None
        self._unshard_issue: tuple[int, str] = (0, "")
        # This iteration's collectives (the root clears them at its pre-forward),
        # as (kind, phase, issued, needed, completed) tuples, one per
        # collective, shared by the units of a batch: strings and ints, which
        # the garbage collector stops tracking, where a CollectiveRecord per
        # collective would be three tracked objects per unit per iteration
        # that live on into the next (and make Python's full collections come
        # more often). ``records`` builds them.
        self._timings: list = []
        # The reduce-scatter started in post_backward, waited in finalize_backward,
        # and when it was started.
        self._reduce: collectives.ReduceScatterResult | None = None
        self._reduce_issued = 0
        # Set by the root's reduce plan for this backward: the units whose
        # gradients go as one reduce-scatter with this one's (None: alone).
        # See [Note: batched collectives] in _fsdp_collectives.py.
        self.grad_batch = None  # a _fsdp_schedule.GradBatch
        # Gathered ahead by the root's plan and not yet used: the root
        # reshards it if its forward does not come (see [Note: gather and
        # reduce plans] in _fsdp_schedule.py).
        self.gathered_ahead = False
        # In the last batch the root's forward plan gathers: its post-forward
        # leaves it KEPT, not SHARDED, as backward needs it first (see [Note:
        # gather and reduce plans] in _fsdp_schedule.py).
        self.keep_for_backward = False
        # Set by the root at its lazy init: the nearest unit whose module
        # contains this one's, the root aside (None: none).
        self.enclosing: FSDPParamGroup | None = None
        # Set by the root at its lazy init: the pool of unshard slots every
        # unit of the root shares, and whether this is the root's own unit
        # (it keeps its parameters from forward to backward). See [Note: the
        # unsharded buffer's memory]. The slot the unsharded buffer points
        # into while unsharded (None: it owns its memory, or has none).
        self.pool = None  # a _fsdp_schedule.UnshardPool
        self.reduce_inputs = None  # the root's _fsdp_schedule.ReduceInputs, on a device
        self.is_root = False
        self._slot = None  # a _fsdp_schedule.PoolSlot
        # unshard_units' lists of the batch this unit heads: (the units,
        # their shards, their buffers, the buffers' per-rank views rank-major).
        self._gather_lists: tuple | None = None
        # The run of units this unit's backward is handled with this
        # iteration (a _fsdp_schedule.UnitRun; None: alone), and the output
        # hook of the unit before it in the run, until its post-forward links
        # them. The schedule's state, kept here for the hooks to read: only
        # _fsdp_schedule.py writes them (Schedule.plan_forward / extend_run,
        # UnitRun). See [Note: runs of units] in _fsdp_schedule.py.
        self.run = None
        self._run_link = None

    def _registrations(self, which: str) -> list:
        """What ``_register`` puts in place: every place a parameter is
        registered, with the FSDPParam's ``which`` tensor, grouped as
        (module._parameters, {name: tensor}) per module."""
        return registrations((i.module._parameters, i.name, getattr(fp, which))
                             for fp in self.fsdp_params for i in fp.module_infos)

    def _shard_of(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of ``params`` (the unit's, full size) laid out
        flat: a new buffer. Notes their digests for the root's check that
        every rank built the same values (see [Note: every rank builds the
        same model])."""
        from pydist import ops

        with torch.no_grad():
            flat = torch.empty(self.total_numel, dtype=self.dtype, device=self.device)
            if params:
                ops.flatten([p.detach() for p in params], out=flat)
            self.built_digests = _digests(flat.cpu(), [p.shape for p in params])  # once, at setup
            if self.layout is Layout.FLAT:
                full = torch.cat([flat, flat.new_zeros(self.padded_numel - self.total_numel)])
            else:
                full = flat.new_zeros(self.padded_numel)
                for column, piece in zip(self.columns, flat.split([p.numel() for p in params])):
                    full.narrow(0, column.offset, piece.numel()).copy_(piece)
            return self.shard_of_full(full)

    def shard_of_full(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s shard (this rank's: None) of ``full``, a buffer
        laid out as the unsharded buffer: a new buffer."""
        r = (self.rank if self.sharded else 0) if rank is None else rank
        return torch.cat([full.narrow(0, c.offset + r * c.width, c.width) for c in self.columns])

    def cut_views(self, full: torch.Tensor) -> list[list[torch.Tensor]]:
        """Per rank, each column's cut of ``full`` (laid out as the unsharded
        buffer): where an all-gather puts every rank's shard."""
        return [[full.narrow(0, c.offset + r * c.width, c.width) for c in self.columns]
                for r in range(self.shard_world_size)]

    def shard_cuts(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each column's cut in ``shard`` (laid out as the shard buffer)."""
        return [shard.narrow(0, c.shard_offset, c.width) for c in self.columns]

    def gather(self, shard: torch.Tensor, full: torch.Tensor):
        """Starts all-gathering every rank's ``shard`` (laid out as the shard
        buffer, in ``full``'s dtype) into ``full`` (as the unsharded buffer);
        ``wait()`` the result."""
        if len(self.columns) == 1:
            return collectives.all_gather_unit(self.transport, shard, full)
        return collectives.all_gather_units(self.transport, self.shard_cuts(shard), (full,),
                                            collectives.rank_major([self.cut_views(full)], self.shard_world_size),
                                            full.dtype)

    def pack_grads(self, grads: Sequence[torch.Tensor | None], out: torch.Tensor, world_size: int, column: int,
                   scale: float) -> None:
        """Packs the unit's gradients (per parameter, in ``out``'s dtype,
        contiguous; None: zeros), times ``scale``, into its column of the
        rank-major ``out``: one C++ pass per column of the layout."""
        numels = self._numels
        for c, (first, end) in zip(self.columns, self._column_params):
            _C.pack_rank_major(grads[first:end], numels[first:end], out, world_size, column + c.shard_offset,
                               c.width, scale)

    def pack_param_grads(self, out: torch.Tensor, world_size: int, column: int, scale: float) -> list[bool]:
        """``pack_grads`` of the .grads on the unsharded parameters, which are
        cleared; returns which parameters had one. The unit's _C.GradPack
        does it (what a closed gate packs: see [Note: runs of units]), aimed
        here and packed at once; an aim a run left unpacked is replaced."""
        pack = self._grad_pack
        pack.aim(out, world_size, column, scale)
        pack.pack()
        return pack.take_had()

    # [Note: a unit built on the meta device]
    # FSDP2's recipe for a model too large to build whole on one device:
    #     with torch.device("meta"): model = Model()
    #     for block in model.blocks: fully_shard(block)
    #     fully_shard(model)
    #     model.to_empty(device="cpu"); model.reset_parameters()  # or init_weights(), a checkpoint
    #     opt = torch.optim.AdamW(model.parameters())
    # torch's sharded parameters are DTensors of the full shape, so the init
    # runs on them (kaiming needs the shape). pydist's are 1-D pieces of the
    # flat layout, so a meta unit goes through two states (``Materializing``) first:
    #   META    fully_shard leaves the module's full-size meta parameters in
    #           place and makes a meta shard (no memory);
    #   FULL    to_empty (Module._apply: after_apply) creates full-size CPU
    #           parameters on the modules, which this unit adopts as its
    #           sharded parameters; the user's init fills them, the optimizer
    #           takes them (a DTensor unit: LOCAL, each rank's chunks);
    #   None    at the unit's first use (the root's lazy init, a state dict,
    #           unshard) shard_materialized lays them out flat, keeps this
    #           rank's shard, and points each of those same Parameter objects
    #           at its piece (``.data``), so the optimizer holds the shards.
    # Each rank materializes the unit in full once, as a model built on the
    # CPU and then fully_shard'ed does; every rank must initialize the same
    # values (the same seed), as then. The result is bitwise that model's.
    def after_apply(self, what: str = "moving or casting a fully_shard'ed module (Module._apply: .to(), .float(), "
                                      ".half() ...)") -> bool:
        """``what`` (``Module._apply``: to_empty, .to, .float ...; or one on
        a submodule, see [Note: a parameter replaced inside a unit] in
        _fsdp_state.py) ran over the unit's modules: a meta unit adopts the
        parameters it left there, a DTensor unit those and their dtype; any
        other unit must still have its own in place, or raises. Returns
        whether the unit's parameter objects or dtype changed."""
        if self.dtensor:
            return self.adopt_registered(what)
        if self.materializing:
            self._adopt_applied()
            return True
        for fp in self.fsdp_params:
            for info in fp.module_infos:
                current = info.module._parameters.get(info.name)
                if current is fp.sharded_param:
                    home = self.shard
                elif current is not None and current is fp.unsharded_param:
                    home = self.unsharded
                else:
                    home = None
                if home is None or current.untyped_storage().data_ptr() != home.untyped_storage().data_ptr():
                    raise NotImplementedError(
                        f"pydist.fully_shard({self.label}): moving or casting a fully_shard'ed module (Module._apply: "
                        f".to(), .float(), .half(), .share_memory() ...) replaced parameter {fp.fqn}, which pydist's "
                        "unit no longer sees; the model is broken. Move or cast the module before fully_shard "
                        "(pydist shards parameters where they are; for a compute dtype, use "
                        "mp_policy=MixedPrecisionPolicy(...))"
                    )
        return False

    def params_replaced(self) -> bool:
        """SHARDED: whether its modules hold other parameters than its
        sharded ones somewhere, or those no longer hold their pieces of the
        shard (swap_tensors, ``.data``)."""
        if any(params.get(name) is not p for params, names in self._sharded_regs for name, p in names.items()):
            return True
        if self.materializing is not None:
            return False
        base, size = self.shard.data_ptr(), self.shard.element_size()
        return any((local := fp.local_tensor()).dtype != self.dtype or local.data_ptr() != base + fp.shard_offset * size
                   for fp in self.fsdp_params if fp.local_numel)

    def _adopt_applied(self) -> None:
        for fp in self.fsdp_params:
            first = fp.module_infos[0]
            p = first.module._parameters[first.name]
            if p.device.type not in ("cpu", "cuda", "meta") or p.dtype != self.dtype or p.shape != fp.shape:
                raise NotImplementedError(
                    f"pydist.fully_shard({self.label}): parameter {fp.fqn} of a unit built on the meta device became "
                    f"{p.dtype} {tuple(p.shape)} on {p.device}; pydist materializes it on a CPU or CUDA device in "
                    f"the dtype fully_shard saw ({self.dtype}): call module.to_empty(device='cpu') (or 'cuda')"
                )
            for info in fp.module_infos[1:]:
                info.module._parameters[info.name] = p  # to_empty makes one Parameter per place: tie them again
            p._pydist_fsdp_param = fp
            fp.sharded_param = p
            fp.requires_grad = p.requires_grad
            if p.device.type != "meta":
                if self.materializing is Materializing.FULL and p.device != self.device:
                    raise NotImplementedError(
                        f"pydist.fully_shard({self.label}): parameter {fp.fqn} was materialized on {p.device}, others "
                        f"of its unit on {self.device}; a unit's parameters live on one device")
                self.materializing = Materializing.FULL
                self.device = p.device
        self._sharded_regs = self._registrations("sharded_param")
        self._take_up_requires_grad()

    def adopt_registered(self, what: str) -> bool:
        """DTensor units: ``what`` (to_empty, ``load_state_dict(assign=True)``,
        a move or cast) may have put new DTensor parameters on the modules,
        or new local tensors in the old ones (``swap_tensors``). Each becomes
        the sharded parameter; its local values go into the shard (a unit
        still on the meta device: LOCAL, sharded at its first use); all of
        them cast to another dtype, the unit takes it (``_retype``). As
        torch FSDP2's ``reset_sharded_param``. See [Note: DTensor parameters]
        in _fsdp_param.py. Returns whether the parameter objects or the
        dtype changed."""
        from torch.distributed.tensor import DTensor

        registered = [fp.module_infos[0].module._parameters.get(fp.module_infos[0].name) for fp in self.fsdp_params]
        dtypes = {p._local_tensor.dtype for p in registered if isinstance(p, DTensor) and not p._local_tensor.is_meta}
        changed = self.materializing is None and len(dtypes) == 1 and self.dtype not in dtypes
        if changed:
            self._retype(dtypes.pop(), what)  # every parameter cast alike: the unit takes the dtype
        for fp, p in zip(self.fsdp_params, registered):  # (_retype leaves the modules as they are)
            if not isinstance(p, DTensor) or p.shape != fp.shape or p._spec.placements != fp.spec.placements:
                raise NotImplementedError(
                    f"pydist.fully_shard({self.label}): {what} left parameter {fp.fqn} as "
                    f"{type(p).__name__} {tuple(p.shape) if p is not None else ''}; a fully_shard'ed module keeps "
                    f"DTensor parameters of their own shape, sharded as {fp.spec.placements}")
            local = p._local_tensor
            if local.is_meta:
                continue
            if local.dtype != self.dtype or local.shape != fp.local_shape or (
                    self.materializing is None and local.device != self.device):
                raise NotImplementedError(
                    f"pydist.fully_shard({self.label}): {what} made parameter {fp.fqn} {local.dtype} "
                    f"{tuple(local.shape)} on {local.device} locally; its unit keeps {self.dtype} "
                    f"{tuple(fp.local_shape)}" + (f" on {self.device}" if self.materializing is None else "")
                    + ". A unit's parameters share one dtype and device: cast the whole fully_shard'ed module "
                    "(model.to(dtype)), or fully_shard the submodule as a unit of its own; move it before fully_shard "
                    "(for a compute dtype: mp_policy=MixedPrecisionPolicy(...)); materialize it with "
                    "to_empty(device=...)")
            for info in fp.module_infos[1:]:
                info.module._parameters[info.name] = p  # one Parameter per place: tie them again
            p._pydist_fsdp_param = fp  # (swap_tensors swaps the objects' attributes too)
            if p is not fp.sharded_param:
                fp.sharded_param = p
                changed = True
            if self.materializing is not None:
                self.materializing = Materializing.LOCAL
                self.device = local.device
            elif local.data_ptr() != (view := fp.local_view(self.shard)).data_ptr():
                with torch.no_grad():
                    view.copy_(local)
                fp.set_local(view)
        if changed:
            self._sharded_regs = self._registrations("sharded_param")
            self._take_up_requires_grad()
            if self.sharded_state is ShardedState.SHARDED:
                _register(self._sharded_regs)
        return changed

    def _retype(self, dtype: torch.dtype, what: str) -> None:
        """``what`` cast every parameter of this DTensor unit to ``dtype``
        (``model.to(torch.float32)`` after fully_shard, as accelerate's FSDP2
        preparation upcasts a model loaded in bf16): the unit takes the dtype
        for its shards, and for compute and reduction unless its
        MixedPrecisionPolicy set those. New shard and unsharded buffers; what
        was made from the old ones goes (the caller copies the cast values
        in). Between iterations only, as torch's FSDP2 (whose ``_apply``
        reshards first) casts."""
        busy = ("is unsharded" if self.sharded_state is not ShardedState.SHARDED
                else "is in a forward or backward" if self.training_state is not TrainingState.IDLE
                else "holds gradients not reduced yet (gradient sync off)" if self.has_pending_grads()
                else "holds reduced gradients not all-reduced yet (set_requires_all_reduce(False))"
                if self._partial is not None else None)
        if busy is not None:
            raise NotImplementedError(
                f"pydist.fully_shard({self.label}): {what} cast the unit's parameters to {dtype} while the unit "
                f"{busy}; cast the module between iterations, with its parameters resharded (model.reshard())")
        param_dtype, reduce_dtype = self._mp_dtypes
        self.dtype = dtype
        self.compute_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.shard = torch.zeros(self.shard_numel, dtype=dtype, device=self.device)  # zero padding, as built
        self.unsharded = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=self.device)
        self.unsharded.untyped_storage().resize_(0)
        self.unsharded_nbytes = self.padded_numel * self.unsharded.element_size()
        for fp in self.fsdp_params:
            fp.spec = dtensor_spec(fp.spec.mesh, fp.shape, dtype)
            fp.unsharded_param = None  # made again, in the compute dtype, at the next unshard
        self._unsharded_regs = self._unsharded_params = self._grad_pack = None
        self.rank_views = self.shard_views = self._gather_lists = None

    def shard_materialized(self) -> None:
        """At the unit's first use: its full-size parameters (the user
        initialized them since to_empty) become its shard, the same
        Parameter objects now 1-D pieces of it. See [Note: a unit built on
        the meta device]."""
        if self.materializing is None:
            return
        if self.materializing is Materializing.META:
            raise RuntimeError(
                f"pydist.fully_shard({self.label}): the unit's parameters are still on the meta device; call "
                "module.to_empty(device='cpu') on the root and initialize the parameters (e.g. reset_parameters(), "
                "or load a state dict) before its first forward, state dict or unshard"
            )
        if self.materializing is Materializing.LOCAL:  # each rank has its pieces only: see [Note: DTensor parameters]
            self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
            with torch.no_grad():
                for fp in self.fsdp_params:
                    fp.local_view(self.shard).copy_(fp.local_tensor())
        else:
            self.shard = self._shard_of([fp.sharded_param for fp in self.fsdp_params])
        if self.unsharded.device != self.device:  # built on meta: no view of it exists yet
            self.unsharded = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=self.device)
            self.unsharded.untyped_storage().resize_(0)
        for fp in self.fsdp_params:
            fp.set_local(fp.local_view(self.shard))
        self.materializing = None

    # --- unshard / wait_for_unshard / reshard ---------------------------------

    def unshard(self, phase: Phase = Phase.EXPLICIT, pooled: bool = False) -> None:
        """Starts the all-gather of the unit's parameters (no-op unless
        SHARDED); ``pooled``: into a pool slot when one is free and the unit
        may borrow one (see [Note: the unsharded buffer's memory])."""
        if self.sharded_state != ShardedState.SHARDED:
            return
        if self.transport is None:
            self._check_transport("unshard")
        slot = None
        if pooled and self.may_borrow(phase):
            slot = self.pool.take(self.unsharded_nbytes)
            if slot is not None:
                slot.place(self, 0)
        self.begin_unshard((time.monotonic_ns(), phase.value), slot)
        shard = self.shard if self.compute_dtype == self.dtype else self.shard.to(self.compute_dtype)
        self._unshard_future = self.gather(shard, self.unsharded)

    def may_borrow(self, phase: Phase) -> bool:
        """Whether an unshard in ``phase`` may take pool memory: the unit
        reshards at the end of that phase. See [Note: the unsharded buffer's memory]."""
        if self.pool is None:
            return False
        if phase.in_forward:
            return self.reshard_after_forward and not self.is_root
        return phase.in_backward and self.reshard_after_backward

    def begin_unshard(self, issue: tuple[int, str], slot=None, batched: bool = False) -> None:
        """Its all-gather is about to be issued (``issue``: (issued_ns, the
        Phase's value), for its record): the unsharded buffer gets memory,
        ``slot``'s where a pool slot placed it (see [Note: the unsharded
        buffer's memory]), else its own; ``batched``: as one of a batch
        (``_fsdp_schedule.unshard_units``), which copies into its per-rank views."""
        self._slot = slot
        if slot is None:
            self.unsharded.untyped_storage().resize_(self.unsharded_nbytes)
        self._unshard_issue = issue
        self.sharded_state = _UNSHARDING
        if batched and self.rank_views is None:
            self.rank_views = self.cut_views(self.unsharded)
            self.shard_views = self.shard_cuts(self.shard)

    def gathering(self, future) -> None:
        """``future``: the all-gather just issued for it (and its batch)."""
        self._unshard_future = future

    def _leave_pool(self) -> None:
        """Moves the unsharded buffer out of its pool slot into memory of its
        own (same storage object, same bytes): the unit stays unsharded past
        the phase it borrowed the slot for."""
        slot = self._slot
        if slot is None:
            return
        values = self.unsharded.untyped_storage().clone()
        self._slot = None
        slot.give_back(self)
        storage = self.unsharded.untyped_storage()
        storage.resize_(self.unsharded_nbytes)
        storage.copy_(values)  # a storage copy: the version counter is untouched

    def batches_with(self, other: "FSDPParamGroup") -> bool:
        """Whether this unit's collectives can share one with ``other``'s."""
        return (self.sharded and other.sharded and self.transport is other.transport and self.dtype == other.dtype
                and self.compute_dtype == other.compute_dtype and self.reduce_dtype == other.reduce_dtype)

    def _wait_all_gather(self) -> None:
        """Waits for this unit's all-gather; when it is a batch's (see
        [Note: batched collectives]), the batch's other units are done with
        it too, and are unsharded here, so each of their hooks finds its
        parameters in place and waits for nothing. Their records say so:
        needed when this wait returned, not before."""
        future = self._unshard_future
        needed = time.monotonic_ns()
        completed = future.wait()
        self._unshard_future = None
        issued, phase = self._unshard_issue
        self._timings.append(("all_gather", phase, issued, needed, completed))
        mates = getattr(future, "members", None)
        if mates is not None:
            future.members = None
            record = ("all_gather", phase, issued, time.monotonic_ns(), completed)
            for pg in mates:
                if pg._unshard_future is future:
                    pg._gathered(record)

    def _gathered(self, record: tuple) -> None:
        """The batch's all-gather (``record``) that another unit waited for is
        done: the full parameters go on this unit's modules."""
        self._unshard_future = None
        self._timings.append(record)
        self._register_unsharded()

    def _register_unsharded(self) -> None:
        """The all-gather is done: the full parameters go on the modules."""
        if self._unsharded_regs is None:
            for fp in self.fsdp_params:
                fp.init_unsharded_param(self.unsharded)
            self._unsharded_regs = self._registrations("unsharded_param")
            self._unsharded_params = [fp.unsharded_param for fp in self.fsdp_params]
            # What a closed gate packs (see [Note: runs of units]), and pack_param_grads.
            self._grad_pack = _C.GradPack(self._unsharded_params, self._numels,
                                          [(first, end, c.shard_offset, c.width)
                                           for c, (first, end) in zip(self.columns, self._column_params)])
        _register(self._unsharded_regs)
        self.sharded_state = ShardedState.UNSHARDED

    def wait_for_unshard(self, phase: Phase = Phase.EXPLICIT) -> None:
        """Waits for the all-gather and registers the full parameters on the modules."""
        if self.sharded_state is ShardedState.KEPT:  # gathered already (its backward, a recompute)
            _register(self._unsharded_regs)
            self.sharded_state = ShardedState.UNSHARDED
            return
        if self.sharded_state == ShardedState.SHARDED:
            self.unshard(phase, pooled=phase is not Phase.EXPLICIT)
        if self.sharded_state == ShardedState.UNSHARDING:
            self._wait_all_gather()
            self._register_unsharded()

    def reshard(self) -> None:
        """Registers the shards on the modules and gives the buffer's memory back."""
        state = self.sharded_state
        if state is _SHARDED or not self.sharded:
            return
        if state is _UNSHARDING:
            self._wait_all_gather()  # the transport is still writing the buffer
        for params, tensors in self._sharded_regs:
            params.update(tensors)
        slot = self._slot
        if slot is not None:
            self._slot = None
            slot.give_back(self)
        else:
            _C.point_storage_at_nothing(self.unsharded)
        self.sharded_state = _SHARDED
        self.gathered_ahead = False
        self.keep_for_backward = False

    # --- the iteration ---------------------------------------------------------

    def pre_forward(self) -> None:
        """Its forward came (a plan that gathered it ahead is answered): FORWARD, unsharded."""
        self.gathered_ahead = False
        self.training_state = _FORWARD
        if self.sharded_state is not _UNSHARDED:
            self.wait_for_unshard(Phase.FORWARD)

    def post_forward(self, reshard: bool) -> None:
        if self.keep_for_backward:
            # The memory stays, the shards go on the modules as after a
            # reshard: ``model.parameters()`` gives what the optimizer steps
            # on until the backward, and an edit there is seen (the root
            # reshards a KEPT unit at its next forward if no backward came).
            self.keep_for_backward = False
            _register(self._sharded_regs)
            self.sharded_state = ShardedState.KEPT
        elif reshard:
            self.reshard()
        else:
            self._leave_pool()  # see [Note: the unsharded buffer's memory]
        self.training_state = TrainingState.IDLE

    def pre_backward(self) -> bool:
        """Unshards for this unit's backward; False when it already did this backward."""
        if self.training_state is _POST_BACKWARD:
            # Its gradients were packed and reduced already, so the backward
            # reaching it now would read resharded parameters, and its
            # gradients would miss this use.
            raise RuntimeError(
                f"pydist FSDP unit {self.label!r}: backward reached it again after its gradients were reduced this "
                "iteration. The unit ran forward more than once before one backward (a module reused, or two root "
                "forwards summed into one loss), which is not supported: fully_shard a module that runs once per "
                "backward (e.g. the parent of the reused one), or call backward after each forward"
            )
        self.gathered_ahead = False  # its backward came
        if self.training_state is _PRE_BACKWARD:
            return False
        self.training_state = _PRE_BACKWARD
        if self.sharded_state is not _UNSHARDED:
            self.wait_for_unshard(Phase.BACKWARD)
        return True

    # [Note: the per-gradient seam]
    # Packing happens per unit, from Python, once all of the unit's gradients
    # exist, in one C++ call that writes them, 1/N folded in, straight into
    # its column of its GradBatch's rank-major reduce-scatter input (or its
    # own input when alone); the batch's last member launches the collective.
    # In a batch with nothing accumulated across backwards (the common case)
    # that call reads the .grads off the unsharded parameters and clears them
    # (GradBatch.add_params -> _C.pack_param_grads); otherwise
    # _grads_to_reduce gathers them (accumulated_grad under mixed precision)
    # for pack_unit_grads.
    # Each gradient byte is copied once on its way in, and once out of the
    # transport into the reduced output. What a post-accumulate-grad hook per
    # parameter in C++ would add is the copy moved earlier, to when each
    # gradient lands: the same bytes on the same thread (CPU autograd runs on
    # the caller's), the launch still waiting for the unit's last gradient;
    # and it would have to keep the launch point the same on every rank when a
    # parameter gets its gradient on some ranks only (this one is: the unit's
    # post-backward comes from the graph's structure). It would replace
    # exactly the packing; the batching, finalize and the records stay.
    def post_backward(self) -> None:
        """Packs this unit's gradients into the reduce-scatter input (1/N folded
        in) and starts it; reshards. See [Note: the per-gradient seam].
        Gradients are all accumulated by now: autograd runs every
        AccumulateGrad as soon as it is ready, before the node that hands
        gradients to the unit's inputs, where this is called; the final
        callback calls it for the units autograd did not."""
        if self.training_state is _POST_BACKWARD:
            return
        run = self.run
        if run is not None and run.started and run.members[0].param_group is self:
            run.finish()  # this unit's post-backward among the others': see [Note: runs of units]
            return
        self.training_state = _POST_BACKWARD
        batch = self.grad_batch
        if batch is not None:
            self.grad_batch = None
            if (not batch.launched and self.requires_gradient_sync and not self._accumulating
                    and self._unsharded_params is not None):
                # The common case, one C++ call: the .grads autograd left on the
                # unsharded parameters are packed into the batch (planned after
                # the root opened the transport) and cleared.
                self.had_grad = batch.add_params(self)
                if self.reshard_after_backward:
                    self.reshard()
                else:
                    self._leave_pool()
                return
        if not self._trainable and not self.has_pending_grads():
            self._reshard_after_backward()
            return
        # Every parameter holding a gradient, frozen or not: one frozen
        # (requires_grad_(False)) between micro-batches of gradient
        # accumulation still reduces what it accumulated, as torch's FSDP2.
        keep = not self.requires_gradient_sync
        if keep or self._accumulating:
            for fp in self.fsdp_params:
                if keep or fp.accumulated_grad is not None:
                    fp.accumulate_grad(self.reduce_dtype, keep=keep)
            self._accumulating = keep and any(fp.accumulated_grad is not None for fp in self.fsdp_params)
        if self.requires_gradient_sync:
            self._check_transport("post_backward")
            grads = self._grads_to_reduce()
            self.had_grad = [g is not None for g in grads]
            self._reduce_issued = time.monotonic_ns()
            if batch is not None and not batch.launched:
                batch.add(self, grads)  # the batch's launch tells reduce_inputs
            else:
                if self.sharded:
                    self._reduce = collectives.reduce_scatter_grads(self.transport, self.pack_grads, grads,
                                                                    self.shard_numel, self.reduce_dtype, self.device)
                else:
                    self._reduce = collectives.all_reduce_grads(self.transport, grads, self._numels,
                                                                self.padded_numel, self.dtype, self.device)
                if self.reduce_inputs is not None:
                    self.reduce_inputs.launched(self._reduce.future, self._let_go_of_reduce_input)
            for fp in self.fsdp_params:  # packed: the reduce-scatter input holds them now
                fp.accumulated_grad = None
                if fp.unsharded_param is not None:
                    fp.unsharded_param.grad = None
        self._reshard_after_backward()

    def aimed_grad_pack(self):
        """At a run's start: this unit's _C.GradPack aimed at its column of
        its reduce batch, where its post-backward would take the common case
        (the one C++ call); else None. See [Note: runs of units] in _fsdp_schedule.py."""
        batch = self.grad_batch
        pack = self._grad_pack
        if pack is None or batch is None or batch.launched or not self.requires_gradient_sync or self._accumulating:
            return None
        pack.aim(batch.input_for(self), batch.world_size, batch.columns[id(self)], batch.copy_scale)
        return pack

    def finish_packed(self) -> bool:
        """At a run's finish: the rest of this unit's post-backward when a
        closed gate packed its gradients (False: it did not; the unit's
        post_backward does it all)."""
        pack = self._grad_pack
        if pack is None:
            return False
        if not pack.packed:
            pack.take_had()  # forgets an aim that was never packed (and the input it holds)
            return False
        self.training_state = _POST_BACKWARD
        batch, self.grad_batch = self.grad_batch, None
        self.had_grad = pack.take_had()
        batch.arrive(self)
        self._reshard_after_backward()
        return True

    def _reshard_after_backward(self) -> None:
        if self.reshard_after_backward:
            self.reshard()
        else:
            self._leave_pool()

    def _let_go_of_reduce_input(self) -> None:
        """See [Note: reduce inputs on a device] in _fsdp_schedule.py."""
        if self._reduce is not None:
            self._reduce = self._reduce._replace(input=None)

    def _grads_to_reduce(self) -> list:
        """Per parameter, the gradient to reduce, in reduce_dtype and
        contiguous, or None (no gradient this backward: zeros)."""
        dtype = self.reduce_dtype
        grads = []
        for fp in self.fsdp_params:
            grad = fp.grad_to_reduce()
            if grad is not None and (grad.dtype != dtype or not grad.is_contiguous()):
                grad = grad.to(dtype).contiguous()
            grads.append(grad)
        return grads

    # [Note: resharding after backward]
    # As torch's FSDP2: post_backward reshards a unit only when
    # reshard_after_backward (set_reshard_after_backward), and
    # finalize_backward does not reshard what backward left unsharded, so
    # under False the unit's parameters stay unsharded into the next
    # forward, which then gathers nothing for it (the memory traded for the
    # communication in gradient accumulation). They are the values gathered
    # before the optimizer stepped, in torch too: a user steps the optimizer
    # after a backward with True, or calls ``reshard()``. An all-gather still
    # in flight at the end of backward (a prefetch whose backward did not
    # come) is waited and resharded under either setting, as torch drops it.
    def finalize_backward(self) -> None:
        """Waits for the reduce-scatter and hands each shard its ``.grad`` (a
        view of the reduced shard; added to a ``.grad`` the user kept). A
        unit of a GradBatch was finalized by the batch already
        (``GradBatch.finalize``): here it only reshards, unless
        reshard_after_backward is off (see [Note: resharding after backward])."""
        self.reduce_replicas()
        reduce, self._reduce = self._reduce, None
        replica, self._replica_reduce = self._replica_reduce, None
        self.grad_batch = None
        if reduce is not None:
            if replica is not None:
                self._timings += replica.wait()
            else:
                needed = time.monotonic_ns()
                completed = reduce.future.wait()
                kind = "reduce_scatter" if self.sharded else "all_reduce"
                self._timings.append((kind, Phase.BACKWARD.value, self._reduce_issued, needed, completed))
            if replica is None or not replica.held:  # held (set_requires_all_reduce(False)): no .grad now
                if self.all_reduce_hook is not None and self.sharded:
                    self.all_reduce_hook(reduce.output)
                params, offsets = [], []
                self.grads_to_hand_out(params, offsets, 0)
                _hand_out_grads(reduce.output, self, params, offsets)
        # See [Note: resharding after backward]. (Most units resharded in their post-backward.)
        if self.sharded_state is not ShardedState.SHARDED:
            if self.reshard_after_backward or self.sharded_state is not ShardedState.UNSHARDED:
                self.reshard()
            else:
                self._leave_pool()
        self.training_state = TrainingState.IDLE

    def reduce_replicas(self) -> None:
        """HSDP, a unit reduced alone: once its reduce-scatter is done, starts
        the all-reduce of its output over the replicas (at most once). See
        [Note: HSDP]."""
        if self.replicate_transport is not None and self._reduce is not None and self._replica_reduce is None:
            self._replica_reduce = ReplicaReduce(self.replicate_transport, self._reduce.future, self._reduce_issued,
                                                 self._reduce.output, [(self, 0)])

    def has_pending_grads(self) -> bool:
        """Whether gradients of earlier backwards wait to be reduced (gradient
        sync was off)."""
        return any(fp.grad_to_reduce() is not None for fp in self.fsdp_params)

    def sync_requires_grad(self) -> None:
        """Takes up ``requires_grad`` switched since the last forward on the
        parameter the module held: the one the optimizer sees
        (``model.parameters()``), or the unsharded one while the unit was left
        unsharded (``set_reshard_after_backward(False)``, ``unshard()``). The
        other follows, and so does what the unit reduces."""
        changed = False
        for fp in self.fsdp_params:
            wanted = fp.sharded_param.requires_grad
            unsharded = fp.unsharded_param
            if unsharded is not None and unsharded is not fp.sharded_param and unsharded.requires_grad != fp.requires_grad:
                wanted = unsharded.requires_grad
            if wanted != fp.requires_grad:
                fp.requires_grad = wanted
                fp.sharded_param.requires_grad_(wanted)
                if unsharded is not None:
                    unsharded.requires_grad_(wanted)
                changed = True
        if changed:
            self._take_up_requires_grad()

    # Counts the calls of _take_up_requires_grad in this process: a
    # ReduceLayout's cached hand-out list holds while it stays.
    trainable_epoch = 0

    def _take_up_requires_grad(self) -> None:
        """The trainable parameters, and whether every parameter is one (then
        the gradients are one run of the flat layout when all are present),
        from each FSDPParam's ``requires_grad``."""
        self._trainable = [fp for fp in self.fsdp_params if fp.requires_grad]
        self._all_trainable = len(self._trainable) == len(self.fsdp_params)
        FSDPParamGroup.trainable_epoch += 1

    def abandon_iteration(self) -> None:
        """After an iteration raised (see [Note: an iteration that raised] in
        _fsdp_state.py): waits for what this unit has in flight, drops the
        gradients it has not reduced, reshards and goes back to IDLE. The
        shards' ``.grad`` (reduced by earlier backwards) are left as they are."""
        reduce, self._reduce = self._reduce, None
        replica, self._replica_reduce = self._replica_reduce, None
        self._partial = None  # HSDP: what the failed iteration held goes with its gradients
        if replica is not None:
            replica.wait()  # HSDP: every rank issued it too
        elif reduce is not None:
            reduce.future.wait()  # every rank issued it; its result is the failed backward's
        self.grad_batch = None
        self.gathered_ahead = False
        self.had_grad = None
        self._accumulating = False
        for fp in self.fsdp_params:
            fp.accumulated_grad = None
            if fp.unsharded_param is not None:
                fp.unsharded_param.grad = None  # NO_SHARD: the parameter the optimizer sees
        self.reshard()  # waits for an all-gather in flight; gives back a pool slot
        self.training_state = TrainingState.IDLE

    # [Note: parameters without a gradient]
    # A parameter that gets no gradient on some ranks is packed as zeros from
    # them, so every rank issues the same collectives, and every rank's shard
    # of it gets a .grad. One that gets none on any rank: torch's FSDP2
    # leaves its .grad as it was (None after zero_grad), so AdamW's weight
    # decay and momentum skip it; torch's FSDP1 reduces its flat gradient,
    # zeros there (zeros_for_unused: pydist.FullyShardedDataParallel). Which
    # case a parameter is in takes every rank's word: what this rank saw,
    # and its reduced piece being zero, do not tell (another rank's gradient
    # can be zero on this rank's slice: embedding rows not looked up). So
    # each synced post-backward notes which parameters had a gradient here
    # (had_grad), and the root's final callback sums those flags over the
    # ranks, one small all-reduce for all its units, before any shard gets
    # its .grad (take_grads_anywhere). A frozen parameter that still holds a
    # gradient (frozen between micro-batches) is reduced and handed out too.
    def take_grads_anywhere(self, counts: Sequence[float]) -> None:
        """``counts``: per parameter, how many ranks had a gradient for it in
        this backward. See [Note: parameters without a gradient]."""
        self.had_grad = None
        zeros = self.zeros_for_unused
        chosen = [fp for fp, n in zip(self.fsdp_params, counts) if n > 0 or (zeros and fp.requires_grad)]
        self._grads_for = None if chosen == self._trainable else chosen

    def grads_to_hand_out(self, params: list, offsets: list, base: int) -> None:
        """Appends the sharded parameters that get a ``.grad`` to ``params``,
        and where each one's part of a reduced output starts to ``offsets``,
        the unit's own output starting at ``base``. See [Note: parameters
        without a gradient]."""
        for fp in self._trainable if self._grads_for is None else self._grads_for:
            params.append(fp.sharded_param)
            offsets.append(base + fp._grad_offset)

    # --- what the root and its schedule tell the unit ---------------------------

    def join_root(self, label: str, enclosing: FSDPParamGroup | None, transport, replicate_transport, schedule,
                  is_root: bool) -> None:
        """The root's lazy init: the unit's place under the root (``label``),
        the nearest unit around it, the transports, the unshard pool and
        reduce inputs every unit of the root shares (``schedule``'s), and
        whether it is the root's own unit."""
        self.label = label
        self.enclosing = enclosing
        self.transport = transport
        self.replicate_transport = replicate_transport if self.sharded else None
        self.pool = schedule.pool
        self.reduce_inputs = schedule.reduce_inputs
        self.is_root = is_root

    def begin_iteration(self) -> None:
        """The root's pre-forward: this iteration's records start empty, and
        what a backward that failed before its final callback left is dropped."""
        self._timings = []
        self.had_grad = None

    def record(self, records: list) -> None:
        """Collectives of a batch it was reduced in: their records."""
        self._timings += records

    def mark_gathered_ahead(self, keep_for_backward: bool = False) -> None:
        """The root's plan gathered it ahead of its use (see [Note: gather and
        reduce plans] in _fsdp_schedule.py); ``keep_for_backward``: in the
        forward's last batch, kept unsharded for the backward after its forward."""
        self.gathered_ahead = True
        if keep_for_backward:
            self.keep_for_backward = True

    def join_grad_batch(self, batch) -> None:
        """The root's reduce plan for this backward: the GradBatch its
        gradients go in (None: alone)."""
        self.grad_batch = batch

    def take_grads_everywhere(self) -> bool:
        """The root found that every parameter of every unit had a gradient
        on some rank: ``take_grads_anywhere``'s common case. Returns whether
        the unit hands out exactly its trainable shards."""
        self.had_grad = None
        self._grads_for = None if self._all_trainable else self.fsdp_params
        return self._all_trainable

    def fold_partial(self, piece: torch.Tensor, held: bool) -> None:
        """HSDP: ``piece`` is its reduce-scattered shard of this backward;
        ``held`` (set_requires_all_reduce(False)): summed into ``_partial``
        rather than all-reduced; else what is held is added to it first, as
        torch orders the additions. See [Note: HSDP]."""
        if held:
            self._partial = piece.clone() if self._partial is None else self._partial.add_(piece)
        elif self._partial is not None:
            piece.add_(self._partial)
            self._partial = None

    def begin_summon(self) -> None:
        """summon_full_params put its full parameters on the modules (see
        [Note: summoning full parameters] in _unshard_params.py)."""
        self.training_state = TrainingState.SUMMONED

    def end_summon(self) -> None:
        self.training_state = _IDLE

    def forget_built_values(self) -> None:
        """A state dict loaded into it replaces what was built: see [Note:
        every rank builds the same model] in _fsdp_state.py."""
        self.built_digests = None

    # --- helpers -------------------------------------------------------------

    @property
    def records(self) -> list[CollectiveRecord]:
        """This iteration's collectives so far, in the order they were waited on."""
        return [CollectiveRecord(self.label, *t) for t in self._timings]

    def clear_records(self) -> None:
        self._timings.clear()

    def _check_transport(self, where: str) -> None:
        if self.transport is None:
            raise RuntimeError(
                f"pydist FSDP unit {self.label!r}: {where} before the root's first forward opened the transport; "
                "run a forward of the root module (the outermost fully_shard'ed one) first"
            )

    def persistent_bytes(self) -> int:
        """Bytes this unit holds between iterations: its shard buffer (the
        sharded gradients are views of a reduce output of the same size)."""
        return self.shard.untyped_storage().nbytes()

    def __repr__(self) -> str:
        return (f"FSDPParamGroup({self.label!r}, {len(self.fsdp_params)} params, total={self.total_numel}, "
                f"shard={self.shard_numel}, {self.sharded_state.name}, {self.training_state.name})")


def _column_params(fsdp_params: Sequence[FSDPParam], columns: Sequence[Column]) -> list[tuple[int, int]]:
    """Per column, the [first, end) of ``fsdp_params`` in it."""
    spans, first = [], 0
    for column in columns:
        end = first
        while end < len(fsdp_params) and fsdp_params[end].column is column:
            end += 1
        spans.append((first, end))
        first = end
    return spans


def _hand_out_grads(output: torch.Tensor, unit: FSDPParamGroup, params: list, offsets: list) -> None:
    """``output`` (this rank's reduced shards, in the reduce dtype) split into
    the ``.grad`` of the shards ``params`` (each from its offset in
    ``output``; see ``grads_to_hand_out``) in one C++ call; ``unit``: one of
    the units they belong to, all of one dtype. The output is cast once
    where the reduce dtype is not the shards'."""
    output = output.to(unit.dtype)
    if unit.dtensor:  # DTensor gradients, as torch's FSDP2 gives them; the views made in one C++ call
        hand_out_dtensor_grads(params, _C.pieces_like(output, [p._local_tensor for p in params], offsets))
        return
    if unit.sharded:  # see [Note: the global norm of sharded gradients] in _clip_grad.py
        clip_grad.mark_shard_grads(output, unit.transport)
    _C.hand_out_grads(output, params, offsets)


# The integer type of each float's width: digests sum bit patterns.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Digests weigh the j-th element of each chunk of _DIGEST_CHUNK elements by
# j * _MIX + 1 (in int32 for elements up to 4 bytes, int64 for 8): 2**32
# (2**64) over the golden ratio, odd, so distinct places get distinct weights.
_MIX32 = 0x9E3779B9 - 2**32
_MIX64 = 0x9E3779B97F4A7C15 - 2**64
_DIGEST_CHUNK = 1 << 20


def _digests(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> torch.Tensor | None:
    """Per parameter laid out in ``flat`` (of ``shapes[i]``, in order), an
    int64 digest of its values, their order and its shape; None for complex
    dtypes. Each chunk of ``_DIGEST_CHUNK`` elements gives the sum of its
    bit patterns times their places' weights (products wrapping in int32 or
    int64, summed in int64); the digest folds the shape's code and the
    chunks' sums together, modulo 2**64. Integer arithmetic wraps, so the
    threads' order of summation changes nothing: equal on two ranks exactly
    when they built the same values in the same places of the same shape
    (barring a collision); a weight transposed on one rank differs. Costs a
    few passes over the values, once, where the unit is laid out. See
    [Note: every rank builds the same model] in _fsdp_state.py."""
    if flat.is_complex() or (flat.is_floating_point() and flat.element_size() not in _BITS):
        return None
    bits = flat.view(_BITS[flat.element_size()]) if flat.is_floating_point() else flat
    kind, mix = (torch.int64, _MIX64) if bits.element_size() == 8 else (torch.int32, _MIX32)
    longest = min(_DIGEST_CHUNK, max((s.numel() for s in shapes), default=0))
    weights = torch.arange(longest, dtype=kind).mul_(mix).add_(1)
    products = torch.empty(longest, dtype=kind)
    digests, start = [], 0
    for shape in shapes:
        n = shape.numel()
        digest = _shape_code(shape)
        for at in range(0, n, _DIGEST_CHUNK):
            m = min(_DIGEST_CHUNK, n - at)
            chunk = torch.mul(bits.narrow(0, start + at, m), weights[:m], out=products[:m])
            digest = _wrap(digest * _MIX64 + int(chunk.sum(dtype=torch.int64)))
        digests.append(digest)
        start += n
    return torch.tensor(digests, dtype=torch.int64)


def _shape_code(shape: Sequence[int]) -> int:
    """An int64 that tells shapes apart, the same in every process."""
    code = len(shape)
    for size in shape:
        code = code * 1000003 + int(size)
    return _wrap(code)


def _wrap(value: int) -> int:
    """``value`` modulo 2**64, as an int64."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


def registrations(places) -> list:
    """(module._parameters, name, tensor) triples grouped as
    (module._parameters, {name: tensor}) per module: what ``_register`` takes."""
    grouped: dict[int, tuple[dict, dict]] = {}
    for params, name, p in places:
        grouped.setdefault(id(params), (params, {}))[1][name] = p
    return list(grouped.values())


def _register(regs: list) -> None:
    """Puts the tensors of ``regs`` (see ``registrations``) in place: one
    dict update per module."""
    for params, tensors in regs:
        params.update(tensors)


# [Note: HSDP]
# fully_shard over a 2-D ("replicate", "shard") mesh, FSDP1's HYBRID_SHARD
# and _HYBRID_SHARD_ZERO2: a unit is sharded over the shard group (its
# transport, shared memory where those ranks share a host) and every replica
# holds the same shards. Each reduce-scatter (a batch's, a lone unit's)
# averages over the shard group as without HSDP; once it is done, its output
# is all-reduced over the replicate group (the root's replicate transport,
# chosen as the shard group's is), averaged there (1/R applied by the
# transport), and only then handed out as ``.grad``. So every gradient is
# the mean over all R * S ranks, in torch's order: the S-term sum first, then
# the R-term sum of those; scaling by 1/S and 1/R where they are powers of
# two is exact, which makes it bitwise torch's HSDP (which divides by S and
# R at the same points) at 2 x 2. The all-reduces start at the root's final
# callback, every batch's before the first is waited on, in the same order
# on every rank. set_requires_all_reduce(False) skips it as torch does: the
# reduced shards are summed into each unit's _partial and no .grad is handed
# out; the next backward that all-reduces adds _partial to its own shards
# first (torch's order of additions). A replicate group of one rank has nothing to reduce (no
# transport), and a shard group of one reduce-scatters to itself, so no mesh
# shape skips the all-reduce. The root's checks (the same wrapping, the same
# built model, the same forward order) and its agreement on which
# parameters had a gradient run over both groups.


class ReplicaReduce:
    """HSDP: one reduce-scatter's output all-reduced over the replicas,
    started once the reduce-scatter is done. See [Note: HSDP]."""

    def __init__(self, replicate, scattered, issued_ns: int, output: torch.Tensor, members: list):
        """``members``: (unit, where its shard starts in ``output``)."""
        needed = time.monotonic_ns()
        completed = scattered.wait()
        self.scatter_record = ("reduce_scatter", Phase.BACKWARD.value, issued_ns, needed, completed)
        wanted = {pg.requires_all_reduce for pg, _ in members}
        if len(wanted) > 1:
            raise NotImplementedError(
                "pydist.fully_shard: set_requires_all_reduce differs between units reduced together ("
                + ", ".join(f"{pg.label!r}: {pg.requires_all_reduce}" for pg, _ in members)
                + "); set it on the root (recurse=True), or set_collective_batch_bytes(0)")
        # torch's order: the held sum accumulates each backward's shard; the
        # all-reducing backward adds the held sum to its own shard.
        self.held = wanted == {False}
        for pg, start in members:
            pg.fold_partial(output.narrow(0, start, pg.shard_numel), self.held)
        self.issued_ns = time.monotonic_ns()
        self.future = None if self.held else replicate.all_reduce(output, 1.0 / replicate.world_size)

    def wait(self) -> list:
        """Waits; the records of the collectives."""
        if self.held:
            return [self.scatter_record]
        needed = time.monotonic_ns()
        completed = self.future.wait()
        return [self.scatter_record, ("all_reduce", Phase.BACKWARD.value, self.issued_ns, needed, completed)]
