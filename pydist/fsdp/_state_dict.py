"""State dicts and checkpoints of sharded modules: the sharded state dict
``model.state_dict()`` returns (each rank its shard plus metadata, for
``torch.distributed.checkpoint``), the full one, and the optimizer's.

Each door gives its torch API's kind. ``fully_shard``'s (FSDP2's layout)
parameters are DTensors ``Shard(0)`` (see [Note: DTensor parameters] in
_fsdp_param.py), so its ``state_dict()`` holds them as they are, as torch's
FSDP2 does, and torch's helpers and DCP take them as torch's; a unit on the
meta device gives meta DTensors. ``FullyShardedDataParallel``'s (FSDP1's
flat layout) gives the ShardedTensors of the Note below, as torch's FSDP1
does for SHARDED_STATE_DICT:

    sd = model.state_dict()                     # ShardedTensors: no communication
    dcp.save(sd, checkpoint_id=path)            # any world size reads it back
    sd = model.state_dict(); dcp.load(sd, checkpoint_id=path); model.load_state_dict(sd)
    full = pydist.fsdp.full_state_dict(model)   # full tensors (collective)
    osd = pydist.fsdp.get_optimizer_state_dict(model, opt)   # for dcp.save too
    pydist.fsdp.set_optimizer_state_dict(model, opt, osd)    # after dcp.load(osd, ...)
    full_osd = pydist.fsdp.full_optimizer_state_dict(model, opt)  # full tensors (collective)

[Note: the sharded state dict]
torch's FSDP2 shards each parameter on dim 0, so its ``state_dict()`` holds
DTensors ``Shard(0)`` and ``dcp.save(model.state_dict())`` just works; so
does pydist's ``fully_shard``. Under the flat layout (FSDP1's door) rank r
keeps a contiguous range of its unit's flat layout (see
[Note: the unit's flat layout]), so one parameter's local piece is a *flat*
range ``[local_start, local_end)`` of its flattened elements: not a dim-0
shard, and not something a DTensor placement can say. A flat range of a
row-major tensor is a union of at most ``2 * ndim - 1`` boxes (a partial
first row of the last dim, whole rows, a partial last row, and so on one
dim up): ``flat_range_boxes``. So for a sharded unit ``model.state_dict()``
gives, per parameter, a ``ShardedTensor`` of the parameter's full shape
whose local shards are those boxes, each a *view* of this rank's shard
buffer, and whose metadata lists every rank's boxes (the layout is known on
every rank: no communication). DCP saves ShardedTensors natively, records
each box as a chunk, and reads any saved chunking into any other by
overlap, so a checkpoint moves between world sizes and between pydist and
torch FSDP2 (whose DTensors are saved as dim-0 chunks): the metadata is the
same kind. ``dcp.load`` writes through the views straight into the shards;
``model.load_state_dict`` of such a dict copies them in again (the same
values) and also accepts full tensors (``full_state_dict``, any world size)
and DTensors (gathered first). Buffers and parameters of NO_SHARD units are
plain tensors, the same on every rank, as DCP expects replicated values.

What torch's helpers do with it: ``get_model_state_dict`` and
``set_model_state_dict`` with ``full_state_dict=False`` call
``state_dict`` / ``load_state_dict`` and work; ``set_model_state_dict`` with
``full_state_dict=True`` hands full tensors to ``load_state_dict`` and
works. ``get_model_state_dict(full_state_dict=True)`` gathers every
ShardedTensor with a torch function that assumes torch's own chunking;
pydist puts its own in that function's place: see [Note: torch's
checkpoint helpers on pydist's shards].

ShardedTensor is what torch's FSDP1 gives for SHARDED_STATE_DICT and what
DCP has read and written since torch 2.0 (the state-dict tests pass on
torch 2.11 and 2.13);
torch now warns ``FutureWarning: Please use DTensor instead and we are
deprecating ShardedTensor`` when its torch functions run, which DCP does
(``.size()``, ``.device``). If it goes, the replacement is DCP's protocol
for custom tensors (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, which DCP asks for before ShardedTensor) on a
pydist tensor subclass carrying the same boxes. A rank with no piece of a
parameter declares an empty box past the end of dim 0 (``_empty_box``).
Cost: the metadata lists every rank's boxes (up to ``N * (2 * ndim - 1)``)
and torch checks them pairwise for overlap when the ShardedTensor is made,
per parameter per ``state_dict()``: measured here for a 1000 x 999 weight,
3 ms at 8 ranks, 10 ms at 64, 0.4 s at 256. Beyond a few hundred ranks the
protocol route above would skip that check.

torch's ``get_optimizer_state_dict`` on its own would return pydist's 1-D
local optimizer state as plain tensors, which DCP takes as replicated and
saves from one rank; ``pydist.fsdp.get_optimizer_state_dict`` wraps each
element-wise state tensor the way its parameter is wrapped, and torch's
calls it (one optimizer): see [Note: torch's checkpoint helpers on
pydist's shards].
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from pydist.fsdp._fsdp_param import FSDPParam, as_dtensor
from pydist.fsdp._fsdp_common import Materializing, ShardedState, TrainingState, state_of
from pydist.fsdp._utils import _root_state, _units

__all__ = [
    "full_state_dict",
    "load_full_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "full_optimizer_state_dict",
    "optimizer_state_dict_to_load",
    "flat_range_boxes",
    "Box",
    "register_state_dict_hooks",
]


# --------------------------------------------------------------------------
# A flat range as boxes
# --------------------------------------------------------------------------


class Box(NamedTuple):
    """A rectangular block of a tensor that is also a contiguous flat range
    of it, starting at element ``flat_start``."""

    offsets: tuple  # per dim, where it starts
    sizes: tuple  # per dim, how far it reaches
    flat_start: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def flat_range_boxes(shape, start: int, end: int) -> list[Box]:
    """The elements ``[start, end)`` of a row-major tensor of ``shape`` as
    boxes in flat order, at most ``2 * len(shape) - 1`` of them (none when
    the range is empty). See [Note: the sharded state dict]."""
    shape = tuple(shape)
    if start >= end:
        return []
    if not shape:
        return [Box((), (), 0)]
    inner = 1
    for s in shape[1:]:
        inner *= s
    first_row, last_row = start // inner, (end - 1) // inner

    def in_row(row: int, lo: int, hi: int) -> list[Box]:  # [lo, hi) within row ``row``
        if lo == 0 and hi == inner:
            return [Box((row,) + (0,) * (len(shape) - 1), (1,) + shape[1:], row * inner)]
        return [Box((row,) + b.offsets, (1,) + b.sizes, row * inner + b.flat_start)
                for b in flat_range_boxes(shape[1:], lo, hi)]

    if first_row == last_row:
        return in_row(first_row, start - first_row * inner, end - first_row * inner)
    boxes: list[Box] = []
    whole_from, whole_to = first_row, last_row + 1  # rows wholly inside, [whole_from, whole_to)
    if start % inner:
        boxes += in_row(first_row, start % inner, inner)
        whole_from += 1
    tail = []
    if end % inner:
        tail = in_row(last_row, 0, end % inner)
        whole_to -= 1
    if whole_to > whole_from:
        boxes.append(Box((whole_from,) + (0,) * (len(shape) - 1), (whole_to - whole_from,) + shape[1:],
                         whole_from * inner))
    return boxes + tail


def _rank_range(fp: FSDPParam, r: int) -> tuple[int, int]:
    """The flat range of ``fp`` (parameter-relative, within ``[0, numel]``)
    rank ``r`` keeps; empty when r's shard ends before or starts after it."""
    return fp.rank_range(r)


def _empty_box(shape, flat_start: int) -> list[Box]:
    """The box a rank without a piece of a parameter declares: empty, just
    past the end of dim 0. Without one, DCP's load drops the key on that rank
    (``_flatten_sharded_tensors`` skips ShardedTensors with no local shard),
    and a key missing from one rank's load plan sends DCP down its pre-2.4
    key-format path, which fails on optimizer state dicts. See [Note: the
    sharded state dict]."""
    if not shape:
        return []  # a 0-d parameter lives on one rank; the others have no key to load
    return [Box((shape[0],) + (0,) * (len(shape) - 1), (0,) + tuple(shape[1:]), flat_start)]


def _local_boxes(fp: FSDPParam) -> list[Box]:
    return flat_range_boxes(fp.shape, *_rank_range(fp, fp.param_group.rank))


# --------------------------------------------------------------------------
# The sharded state dict: ShardedTensors over the flat pieces
# --------------------------------------------------------------------------


def _as_sharded_tensor(fp: FSDPParam, local: torch.Tensor, group):
    """A ShardedTensor of ``fp``'s full shape whose local shards are views of
    ``local`` (this rank's flat piece: the shard, or optimizer state shaped
    like it). See [Note: the sharded state dict]."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    pg = fp.param_group
    local = local.detach()
    shards_md, local_shards, counts = [], [], []
    for r in range(pg.shard_world_size):
        # Where each piece lives: this rank's device exactly (ShardedTensor
        # checks it), another rank's by its type (its index is that rank's own).
        device = local.device if r == pg.rank else local.device.type
        placement = f"rank:{dist.get_global_rank(group, r) if group is not dist.group.WORLD else r}/{device}"
        lo, hi = _rank_range(fp, r)
        counts.append(hi - lo)
        for box in flat_range_boxes(fp.shape, lo, hi) or _empty_box(fp.shape, lo):
            md = ShardMetadata(list(box.offsets), list(box.sizes), placement)
            shards_md.append(md)
            if r == pg.rank:
                local_shards.append(Shard(local.reshape(-1).narrow(0, box.flat_start - lo, box.numel).view(box.sizes),
                                          md))
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    metadata = ShardedTensorMetadata(shards_md, torch.Size(fp.shape), props)
    sharded = ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata, process_group=group)
    # Each rank's piece, in rank order, is the parameter's next flat range:
    # how _all_gather_sharded_tensor puts it back together.
    sharded._pydist_counts = counts
    _install_full_gather()
    return sharded


# [Note: torch's checkpoint helpers on pydist's shards]
# get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
# (FSDP2's way to a full checkpoint) calls model.state_dict() and gathers
# each ShardedTensor in it with torch.distributed._state_dict_utils.
# _all_gather_sharded_tensor, which assumes torch's own chunking (one dim-0
# chunk of ceil(dim0 / N) rows per rank, the first local shard only). On
# pydist's flat pieces that raised a size mismatch in gloo, or, where each
# rank's first box fits such a chunk, returned wrong values without a word.
# The first pydist ShardedTensor made puts _all_gather_sharded_tensor below
# in torch's place (the name torch looks up at each call); it gathers the
# ShardedTensors pydist made (marked with their ranks' piece sizes) and hands
# every other one to torch's function.
# torch's get_optimizer_state_dict / set_optimizer_state_dict (and
# get_state_dict / set_state_dict) would take pydist's 1-D local optimizer
# state for plain replicated tensors (DCP saved one rank's; the full dict
# held each rank's own piece). For a model with sharded pydist units, the
# functions they call (_get_optim_state_dict, _load_optim_state_dict) are
# put in place to use pydist's
# get_optimizer_state_dict / optimizer_state_dict_to_load, whose layout is
# torch's, with torch's own full-dict and CPU-offload handling after (one
# optimizer per call: several raise).
# Installed once torch.distributed.checkpoint.state_dict is imported (at
# fully_shard, the root's first forward, or a state dict).

def _all_gather_sharded_tensor(sharded_tensor, pg=None, device=None) -> torch.Tensor:
    """The full tensor of a ShardedTensor, on every rank of its group (collective)."""
    counts = getattr(sharded_tensor, "_pydist_counts", None)
    if counts is None:
        return _torch_all_gather_sharded_tensor(sharded_tensor, pg, device)
    # Its own group: the ranks its pieces are laid out over (a unit's group
    # may be a subgroup; torch's default is the world).
    group = sharded_tensor._process_group
    size = sharded_tensor.metadata().size
    dtype = sharded_tensor.metadata().tensor_properties.dtype
    pieces = [shard.tensor.reshape(-1) for shard in sharded_tensor.local_shards()]
    width = max(counts)
    on = pieces[0].device if pieces else torch.device("cpu")
    local = torch.zeros(width, dtype=dtype, device=on)
    if pieces:
        torch.cat(pieces, out=local[:sum(p.numel() for p in pieces)])
    gathered = torch.empty(width * len(counts), dtype=dtype, device=on)
    # torch 2.13 deprecates all_gather_into_tensor for all_gather_single (the same call)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(gathered, local, group=group)
    rows = gathered.view(len(counts), width)
    return torch.cat([rows[r, :n] for r, n in enumerate(counts)]).view(size)


# [Note: resuming a model built on the meta device]
# FSDP2's documented resume: build on the meta device, fully_shard, then
# ``set_model_state_dict(model, full_sd, options=StateDictOptions(
# full_state_dict=True, broadcast_from_rank0=True))`` (rank 0 alone holding
# the dict) and ``set_optimizer_state_dict`` likewise, with no to_empty or
# init in between. torch's loader puts the dict's values in place of the meta
# tensors; pydist's units keep full-size meta parameters until to_empty (see
# [Note: a unit built on the meta device] in _fsdp_param_group.py), so the
# load first materializes them, empty, on the device the group computes on
# (CUDA under NCCL, else the CPU), and the dict fills them. Every unit of the
# model must still be on the meta device then (a model half materialized is
# refused, naming a unit that is not). The optimizer's broadcast gives every
# rank rank 0's whole dict (one broadcast of the pickled dict over the
# world), which pydist then cuts into this rank's shards.

def _load_model_state_dict(model, state_dict, info):
    """torch's, into units still on the meta device too: see [Note: resuming
    a model built on the meta device]."""
    units = _units(model)
    meta = [pg for pg in units if pg.materializing is Materializing.META]
    state_dict, info = _broadcast_for_dtensors(units, state_dict, info)
    if meta and (info.full_state_dict or info.broadcast_from_rank0):
        ready = [pg for pg in units if pg.materializing is not Materializing.META]
        if ready:
            raise NotImplementedError(
                f"pydist set_model_state_dict: units {[pg.label for pg in meta][:3]} are on the meta device and "
                f"{[pg.label for pg in ready][:3]} are not; call model.to_empty(...) on the whole model first")
        backend = dist.get_backend()
        model.to_empty(device=torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu")
    return _torch_checkpoint_api["load_model"](model, state_dict, info)


def _broadcast_for_dtensors(units: list, state_dict: dict, info) -> tuple:
    """``broadcast_from_rank0`` into fully_shard's DTensor units: rank 0's
    dict on every rank, then loaded as a full one (torch's own broadcast
    into DTensors fails on gloo); anything else as it was."""
    if info.broadcast_from_rank0 and any(pg.dtensor for pg in units):
        return _from_rank0(state_dict), dataclasses.replace(info, broadcast_from_rank0=False)
    return state_dict, info


def _from_rank0(state_dict: dict) -> dict:
    """Rank 0's ``state_dict`` on every rank of the world (pickled, one broadcast)."""
    box = [state_dict if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _takes_optimizers(model, optimizers, info, what: str) -> bool:
    """Whether pydist's optimizer state dict answers torch's ``what`` call."""
    if not info.handle_optim or info.fsdp_modules or not any(pg.sharded and not pg.dtensor for pg in _units(model)):
        return False
    if len(optimizers) != 1:
        raise NotImplementedError(f"torch's {what} with {len(optimizers)} optimizers on a model with pydist "
                                  "sharded units: call it once per optimizer")
    return True


def _get_optim_state_dict(model, optimizers, info):
    if not _takes_optimizers(model, optimizers, info, "get_optimizer_state_dict"):
        return _torch_checkpoint_api["get"](model, optimizers, info)
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    osd = get_optimizer_state_dict(model, optimizers[0])
    if info.flatten_optimizer_state_dict:
        osd = torch_state_dict._flatten_optim_state_dict(osd)
    return torch_state_dict._maybe_full_or_cpu_state_dict(osd, info)


def _load_optim_state_dict(model, optimizers, state_dict, info):
    if not _takes_optimizers(model, optimizers, info, "set_optimizer_state_dict"):
        units = _units(model)
        if any(pg.dtensor for pg in units):
            state_dict, info = _broadcast_for_dtensors(units, state_dict, info)
            if len(optimizers) == 1 and state_dict and "state" not in state_dict:
                # flatten_optimizer_state_dict's layout into an optimizer with no
                # state yet, which torch's own load fails on (KeyError, FSDP2 too)
                from torch.distributed.checkpoint import state_dict as torch_state_dict

                torch_state_dict._init_optim_state(optimizers[0])
                state_dict = torch_state_dict._unflatten_optim_state_dict(optimizers[0], state_dict, info)
                info = dataclasses.replace(info, flatten_optimizer_state_dict=False)
            for optimizer in optimizers if len(optimizers) == 1 else ():
                check_optimizer_shapes(model, optimizer, state_dict)  # see [Note: shape-checked loads]
        return _torch_checkpoint_api["load"](model, optimizers, state_dict, info)
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    if info.broadcast_from_rank0:  # rank 0 holds the full dict, the others {}: every rank gets rank 0's
        state_dict = _from_rank0(state_dict)
    if not state_dict:
        return
    if "state" not in state_dict:  # flatten_optimizer_state_dict's layout, unflattened by the state's names
        torch_state_dict._init_optim_state(optimizers[0])
        state_dict = torch_state_dict._unflatten_optim_state_dict(optimizers[0], state_dict, info)
    set_optimizer_state_dict(model, optimizers[0], state_dict)


_torch_all_gather_sharded_tensor = None
_torch_checkpoint_api: dict = {}  # torch's _get_optim_state_dict and _load_optim_state_dict, once replaced


def _install_full_gather() -> None:
    """See [Note: torch's checkpoint helpers on pydist's shards]. Idempotent."""
    global _torch_all_gather_sharded_tensor
    from torch.distributed import _state_dict_utils

    if _torch_all_gather_sharded_tensor is None:
        _torch_all_gather_sharded_tensor = _state_dict_utils._all_gather_sharded_tensor
        _state_dict_utils._all_gather_sharded_tensor = _all_gather_sharded_tensor
    install_torch_checkpoint_api()


def install_torch_checkpoint_api() -> None:
    """Where torch.distributed.checkpoint.state_dict is imported, puts
    pydist's optimizer state in its helpers' place. See [Note: torch's
    checkpoint helpers on pydist's shards]. Idempotent."""
    import sys

    api = sys.modules.get("torch.distributed.checkpoint.state_dict")
    if api is None or _torch_checkpoint_api:
        return
    _torch_checkpoint_api["get"], api._get_optim_state_dict = api._get_optim_state_dict, _get_optim_state_dict
    _torch_checkpoint_api["load"], api._load_optim_state_dict = api._load_optim_state_dict, _load_optim_state_dict
    _torch_checkpoint_api["load_model"], api._load_model_state_dict = api._load_model_state_dict, _load_model_state_dict


def _to_local_piece(fp: FSDPParam, value: Any, key: str) -> torch.Tensor:
    """This rank's piece of ``fp``, in its local shape, from what a state
    dict holds under ``key``: a ShardedTensor of pydist's layout at this
    world size, a DTensor (gathered: collective) or a full tensor."""
    return _flat_local_piece(fp, value, key).view(fp.local_shape)


def _flat_local_piece(fp: FSDPParam, value: Any, key: str) -> torch.Tensor:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    where = f"pydist load_state_dict: {key!r} (rank {fp.param_group.rank})"
    if isinstance(value, ShardedTensor):
        size = tuple(value.metadata().size)  # not value.size(): ShardedTensor's torch functions warn of deprecation
        if size != tuple(fp.shape):
            raise ValueError(f"{where}: a ShardedTensor of shape {size}, the parameter is {tuple(fp.shape)}")
        have = {(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)): s.tensor
                for s in value.local_shards() if s.tensor.numel()}
        want = _local_boxes(fp)
        if set(have) != {(b.offsets, b.sizes) for b in want}:
            raise ValueError(
                f"{where}: its ShardedTensor's local shards {sorted(have)} are not this rank's pieces "
                f"{[(b.offsets, b.sizes) for b in want]} (saved at another world size or by another wrapper?); "
                "read the checkpoint with torch.distributed.checkpoint.load into this model's state_dict() instead"
            )
        pieces = [have[(b.offsets, b.sizes)].reshape(-1) for b in want]
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else fp.sharded_param.new_empty(0)
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(value).__name__}")
    if value.shape != fp.shape:  # the same number of elements is not enough: see [Note: shape-checked loads]
        raise ValueError(f"{where}: size mismatch: copying a tensor of shape {tuple(value.shape)}, the parameter "
                         f"is {tuple(fp.shape)}")
    start, end = _rank_range(fp, fp.param_group.rank)
    return value.reshape(-1).narrow(0, start, end - start)


# [Note: activation checkpointing's key prefix]
# torch's checkpoint_wrapper (apply_activation_checkpointing, used before or
# after wrapping, with either door) puts the module it wraps under
# ``_checkpoint_wrapped_module`` and hides that name from state dicts: its
# state_dict hook strips the segment, its load pre-hook puts it back. torch's
# FSDP1 strips it from its parameter names too (``clean_tensor_name``), so a
# checkpoint's keys, the optimizer state dict's and FSDP1's are the cleaned
# ones. pydist names parameters by walking the modules, so it cleans the same
# segment; and a unit's own state-dict hooks, which run before or after a
# wrapper's (the wrapper around the unit, the unit itself, wrappers inside
# it), find a parameter under whichever form the dict holds at that moment
# (_key_forms).
_CHECKPOINT_SEGMENT = "_checkpoint_wrapped_module."


def clean_key(key: str) -> str:
    """``key`` without activation checkpointing's wrapper segments (see the Note)."""
    return key.replace(_CHECKPOINT_SEGMENT, "") if _CHECKPOINT_SEGMENT in key else key


def _key_forms(key: str) -> tuple[str, ...]:
    """The forms a state dict may hold ``key`` (relative to a unit's module)
    in while one of the unit's hooks runs: as named, cleaned, or cleaned but
    for the unit's own wrapper segment (the unit is a checkpoint wrapper
    whose load pre-hook ran, the wrappers inside it not yet)."""
    if _CHECKPOINT_SEGMENT not in key:
        return (key,)
    forms = [key, clean_key(key)]
    if key.startswith(_CHECKPOINT_SEGMENT):
        forms.append(_CHECKPOINT_SEGMENT + clean_key(key[len(_CHECKPOINT_SEGMENT):]))
    return tuple(dict.fromkeys(forms))


def _keys_of_units(module: nn.Module, units, clean: bool = True) -> dict[int, list[str]]:
    """For each FSDPParam of ``units`` (by id), the state-dict keys it has
    under ``module`` (several when shared), in ``module.state_dict()`` order;
    cleaned as ``module.state_dict()`` gives them, or as named (``clean=False``)."""
    slot_to_fp = {(id(info.module), info.name): fp for pg in units for fp in pg.fsdp_params for info in fp.module_infos}
    keys: dict[int, list[str]] = {}
    for mod_name, m in module.named_modules(remove_duplicate=False):
        for name in m._parameters:
            fp = slot_to_fp.get((id(m), name))
            if fp is not None:
                key = f"{mod_name}.{name}" if mod_name else name
                keys.setdefault(id(fp), []).append(clean_key(key) if clean else key)
    return keys


class _UnitStateDictHooks:
    """The hooks ``register_state_dict_hooks`` puts on one fully_shard'ed
    module whose unit is sharded: ``state_dict`` gives its parameters as
    ShardedTensors, ``load_state_dict`` takes them (or full tensors, or
    DTensors) back into the shards. See [Note: the sharded state dict]."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._keys: dict[int, list[str]] | None = None  # by id(FSDPParam), relative to module; made on first use

    def _param_group(self):
        state = state_of(self.module)
        pg = state.param_group if state is not None else None
        if pg is None or not pg.sharded:
            return None
        if pg.dtensor and pg.materializing is Materializing.META:
            # Still on meta: the state dict holds the meta DTensor parameters, as torch's, whose mesh and
            # placements FSDP2's DTensor-API resume reads to distribute a full checkpoint before a
            # load_state_dict(assign=True); a load without assign leaves them on meta, as torch's does.
            return pg
        pg.shard_materialized()  # a unit built on the meta device: its shard is what a state dict holds
        return pg

    def _entries(self, pg, prefix: str, state_dict: dict):
        """(FSDPParam, its key in ``state_dict``) for each key of each
        parameter the dict holds, in whichever form it holds it (see
        [Note: activation checkpointing's key prefix])."""
        if self._keys is None:
            self._keys = {i: [_key_forms(k) for k in ks]
                          for i, ks in _keys_of_units(self.module, [pg], clean=False).items()}
        for fp in pg.fsdp_params:
            for forms in self._keys.get(id(fp), []):
                for form in forms:
                    if prefix + form in state_dict:
                        yield fp, prefix + form
                        break

    def state_dict_hook(self, module, state_dict, prefix, local_metadata):
        pg = self._param_group()
        if pg is None:
            return None
        if pg.dtensor:  # DTensor parameters are FSDP2's state dict as they are; an unsharded unit's too
            if pg.sharded_state is not ShardedState.SHARDED:
                for fp, key in self._entries(pg, prefix, state_dict):
                    state_dict[key] = fp.sharded_param.detach()
            return None
        if pg.training_state is TrainingState.SUMMONED:
            return None  # the summoned full parameters, as torch's: see [Note: summoning full parameters]
        group = state_of(module).group
        for fp, key in self._entries(pg, prefix, state_dict):
            # A zero-size parameter has no piece anywhere: given whole, as an empty tensor of its shape
            # (see [Note: a unit of zero-size parameters] in _fully_shard.py).
            state_dict[key] = (_as_sharded_tensor(fp, fp.sharded_param, group) if fp.numel
                               else fp.sharded_param.detach().new_empty(fp.shape))
        return None

    def load_state_dict_pre_hook(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                                 unexpected_keys, error_msgs):
        pg = self._param_group()  # (lays out a unit built on meta, digesting what to_empty left)
        unit = state_of(module).param_group
        if unit is not None:  # loaded values replace the built ones: see [Note: every rank builds the same model]
            unit.forget_built_values()
        if pg is None:
            return
        if pg.sharded_state != ShardedState.SHARDED:
            root = state_of(module).root
            if pg.training_state != TrainingState.IDLE and root is not None and root.iteration_failed():
                root.recover_from_failed_iteration()  # see [Note: an iteration that raised] in _fsdp_state.py
            if pg.training_state != TrainingState.IDLE:
                where = f"{pg.label!r}" if pg.label else f"'' (the root, {type(module).__name__})"
                raise RuntimeError(f"pydist load_state_dict: unit {where} is in {pg.training_state.name} (its "
                                   "forward or backward is running); load between iterations")
            pg.reshard()  # the shards are what loads; a later unshard gathers the new values
        from torch.distributed.tensor import DTensor

        for fp, key in self._entries(pg, prefix, state_dict):
            mismatch = _full_shape_mismatch(fp, state_dict[key], key)
            if mismatch is not None:  # see [Note: shape-checked loads]
                error_msgs.append(mismatch)
                state_dict[key] = fp.sharded_param.detach()  # load_state_dict copies the shard onto itself
                continue
            value = state_dict[key]
            if pg.dtensor and isinstance(value, DTensor) and value._spec.placements == fp.spec.placements \
                    and value._spec.mesh == fp.spec.mesh:
                continue  # torch's load copies it local to local
            piece = _to_local_piece(fp, value, key)
            state_dict[key] = as_dtensor(piece, fp.spec) if pg.dtensor else piece


# [Note: shape-checked loads]
# A sharded parameter loads from its flattened elements, so a full tensor
# with the parameter's number of elements but another shape (a (7, 13)
# tensor for a (13, 7) weight) would load, its values scrambled. torch's
# load_state_dict refuses it ("size mismatch for KEY: copying a param with
# shape ... from checkpoint, the shape in current model is ...", raised once
# every module has loaded, as a RuntimeError "Error(s) in loading
# state_dict"); so does the pre-hook here, with torch's words, for full
# tensors and DTensors (their shape is the global one). Every other load
# goes through _to_local_piece, which refuses any shape but the parameter's
# (ShardedTensors by their metadata's), and the optimizer's state dict
# refuses a state tensor with the parameter's number of elements but
# another shape (optimizer_state_dict_to_load), which torch's optimizer
# would take without a check.
def _full_shape_mismatch(fp: FSDPParam, value: Any, key: str) -> str | None:
    """torch's "size mismatch" entry for a full tensor or DTensor ``value``
    whose shape is not ``fp``'s; None otherwise."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, torch.Tensor) or isinstance(value, ShardedTensor) or value.shape == fp.shape:
        return None
    return (f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
            f"the shape in current model is {torch.Size(fp.shape)}.")


def register_state_dict_hooks(module: nn.Module) -> None:
    """Called by ``fully_shard`` on the module it shards: see [Note: the sharded state dict]."""
    hooks = _UnitStateDictHooks(module)
    module._register_state_dict_hook(hooks.state_dict_hook)
    module._register_load_state_dict_pre_hook(hooks.load_state_dict_pre_hook, with_module=True)


# --------------------------------------------------------------------------
# Full state dicts
# --------------------------------------------------------------------------


def gather_full_flat(pg) -> torch.Tensor:
    """Collective: the unit's full flat parameters in their own dtype (a
    fresh buffer; a NO_SHARD unit's shard, which is whole)."""
    if not pg.sharded:
        return pg.shard
    full = torch.empty(pg.padded_numel, dtype=pg.dtype, device=pg.device)
    pg.gather(pg.shard, full).wait()
    return full


def full_state_dict(module: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Collective: ``module.state_dict()`` with every sharded parameter
    replaced by its full tensor (a fresh copy), under the unwrapped module's
    keys, on every rank (``rank0_only``: rank 0's dict, ``{}`` on the others,
    as torch FSDP1's ``FullStateDictConfig(rank0_only=True)``). Call it
    between iterations; one unit's full parameters exist at a time."""
    state = _root_state(module)
    units = _units(module)
    keys = _keys_of_units(module, units)
    sd = module.state_dict()
    keep = not rank0_only or dist.get_rank(state.group) == 0
    for pg in units:
        if pg.training_state is TrainingState.SUMMONED:  # no collective: see [Note: summoning full parameters]
            for fp in pg.fsdp_params:
                for key in keys.get(id(fp), []):
                    if key in sd:
                        sd[key] = sd[key].clone() if keep else None
            continue
        flat = gather_full_flat(pg)
        for fp in pg.fsdp_params:
            full = fp.full_view(flat).clone() if keep else None
            for key in keys.get(id(fp), []):
                if key in sd:
                    sd[key] = full
    _check_nothing_sharded_left(sd, units)
    return sd if keep else {}


def _check_nothing_sharded_left(sd: dict, units) -> None:
    """Raises where a full state dict still holds a piece of a shard (a
    ShardedTensor, a DTensor, or a view of a unit's shard): a key
    ``full_state_dict`` did not find, renamed by a state-dict hook it does
    not know. Saved, such a checkpoint would hold one rank's piece under a
    full parameter's name."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    shards = {pg.shard.untyped_storage().data_ptr() for pg in units if pg.sharded and pg.shard.numel()}
    left = [key for key, value in sd.items()
            if isinstance(value, (ShardedTensor, DTensor)) or (
                isinstance(value, torch.Tensor) and value.layout is torch.strided and value.numel()
                and value.untyped_storage().data_ptr() in shards)]
    if left:
        raise RuntimeError(
            f"pydist full_state_dict: {left[:5]} still hold this rank's shard, not the full tensor: their keys are not "
            "the ones pydist names the parameters by (a state-dict hook renamed them?); nothing was returned, so no "
            "checkpoint of shards is saved as a full one")


def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = False):
    """Loads full tensors (``full_state_dict``'s keys; any world size saved
    them) into this rank's shards; buffers and unsharded parameters load as
    ``load_state_dict`` would, and its missing and unexpected keys are
    returned, or raised with ``strict=True``, as torch's: a parameter with
    no entry keeps its shard and is among the missing keys."""
    _root_state(module)
    with torch.no_grad():
        return module.load_state_dict(state_dict, strict=strict)


# --------------------------------------------------------------------------
# The optimizer's state
# --------------------------------------------------------------------------


class _OptimizerEntry(NamedTuple):
    key: str  # the parameter's first state-dict key under the module
    param: torch.Tensor  # what the optimizer steps on
    fsdp_param: FSDPParam | None  # None: a parameter no sharded unit manages
    group: Any  # the process group its unit is sharded over (None without fsdp_param)


def _optimizer_entries(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[_OptimizerEntry]:
    """Every parameter ``optimizer`` steps on, in its param_groups' order."""
    states = [s for m in module.modules() if (s := state_of(m)) is not None and s.param_group is not None]
    units = [s.param_group for s in states]
    group_of = {id(s.param_group): s.group for s in states}
    keys = _keys_of_units(module, units)
    plain = {id(p): clean_key(n) for n, p in module.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            fp = getattr(p, "_pydist_fsdp_param", None)
            if fp is not None and fp.param_group.sharded and keys.get(id(fp)):
                out.append(_OptimizerEntry(keys[id(fp)][0], p, fp, group_of[id(fp.param_group)]))
            elif id(p) in plain:
                out.append(_OptimizerEntry(plain[id(p)], p, None, None))
            else:
                raise ValueError(f"pydist optimizer state dict: a parameter of shape {tuple(p.shape)} the "
                                 f"optimizer steps on is not one of {type(module).__name__}'s")
    return out


def _ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Makes the optimizer create its state, as torch's
    get_optimizer_state_dict does, so a checkpoint has tensors to load into:
    a step with zero gradients and lr 0, when it has no state and no
    gradients yet (with gradients, the next real step creates it; a step
    here would count them). Leaves gradients (None) and lr as they were."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p in params:
            p.grad = None


def _dtensor_model(module: nn.Module) -> bool:
    """Whether ``module``'s units are ``fully_shard``'s (DTensor parameters):
    then torch's own checkpoint helpers answer (see [Note: DTensor
    parameters] in _fsdp_param.py), and pydist's optimizer helpers hand over to them."""
    return any(pg.dtensor for pg in _units(module))


def _torch_optimizer_state_dict(module, optimizer, full: bool, rank0_only: bool = False) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as torch_get

    return torch_get(module, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=rank0_only))


def get_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, copies: bool = False) -> dict:
    """The optimizer's state by parameter key (torch's
    ``get_optimizer_state_dict`` layout: ``{"state": {key: {name: value}},
    "param_groups": [{..., "params": [key, ...]}]}``). A state tensor shaped
    like a sharded parameter's local piece (SGD's momentum, Adam's moments)
    is given as a ShardedTensor of the parameter's shape, as ``state_dict``
    gives the parameter (views: ``dcp.load`` writes into the optimizer's
    state); scalars (Adam's ``step``) stay as they are, the same on every
    rank. So element-wise optimizers' state reshards with DCP like the
    parameters. Creates the state if the optimizer has none yet and no
    gradients (see ``_ensure_optimizer_state``). ``copies``: every tensor
    copied instead (a snapshot that later steps leave as it is).
    ``fully_shard``'s modules: torch's ``get_optimizer_state_dict`` (DTensors)."""
    _root_state(module)
    if _dtensor_model(module):
        osd = _torch_optimizer_state_dict(module, optimizer, full=False)
        return copy.deepcopy(osd) if copies else osd
    _ensure_optimizer_state(optimizer)
    entries = _optimizer_entries(module, optimizer)
    state_out: dict[str, dict] = {}
    for e in entries:
        per_param = {}
        for name, value in optimizer.state.get(e.param, {}).items():
            if copies:
                value = _detached(value)
            if _is_sharded_state(e, value):
                value = _as_sharded_tensor(e.fsdp_param, value, e.group)
            per_param[name] = value
        state_out[e.key] = per_param
    return {"state": state_out, "param_groups": _named_param_groups(optimizer, entries)}


def full_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool = False) -> dict:
    """Collective: ``get_optimizer_state_dict``'s dict with full tensors in
    place of the ShardedTensors (one all-gather per unit and state name; a
    unit's full state exists one at a time), on every rank, or rank 0's and
    ``{}`` elsewhere with ``rank0_only`` (torch FSDP1's
    ``FullOptimStateDictConfig``). ``set_optimizer_state_dict`` loads it at
    any world size. ``fully_shard``'s modules: torch's ``get_optimizer_state_dict``."""
    root = _root_state(module)
    if _dtensor_model(module):
        return _torch_optimizer_state_dict(module, optimizer, full=True, rank0_only=rank0_only)
    _ensure_optimizer_state(optimizer)
    entries = _optimizer_entries(module, optimizer)
    # Copies of what is not gathered below (the gathered values are new tensors already).
    out = {"state": {e.key: {n: v if _is_sharded_state(e, v) else _detached(v)
                             for n, v in optimizer.state.get(e.param, {}).items()} for e in entries},
           "param_groups": _named_param_groups(optimizer, entries)}
    by_fp = {id(e.fsdp_param): e for e in entries if e.fsdp_param is not None}
    for pg in _units(module):
        members = [(fp, by_fp[id(fp)]) for fp in pg.fsdp_params if id(fp) in by_fp]
        names = sorted({n for _, e in members for n, v in optimizer.state.get(e.param, {}).items()
                        if _is_sharded_state(e, v)})
        for name in names:  # the same on every rank: an element-wise optimizer keeps the same names per parameter
            values = [(fp, e, optimizer.state[e.param].get(name)) for fp, e in members]
            dtype = next(v.dtype for _, _, v in values if v is not None)
            full = gather_pieces(pg, [(fp, v) for fp, _, v in values], dtype)
            for fp, e, v in values:
                if v is not None:
                    out["state"][e.key][name] = fp.full_view(full).clone()
    return out if not rank0_only or dist.get_rank(root.group) == 0 else {}


def gather_pieces(pg, pieces: list, dtype: torch.dtype) -> torch.Tensor:
    """Collective: per parameter of the unit ``pg``, this rank's piece
    (``(fp, tensor)``: shaped like its local part, or None for zeros) laid out
    as the unit's shard and all-gathered: a fresh buffer in the unit's flat
    layout (``FSDPParam.full_view`` reads a parameter's part of it)."""
    shard = torch.zeros(pg.shard_numel, dtype=dtype, device=pg.device)
    for fp, piece in pieces:
        if piece is not None:
            shard.narrow(0, fp.shard_offset, fp.local_numel).copy_(piece.reshape(-1))
    full = torch.empty(pg.padded_numel, dtype=dtype, device=pg.device)
    pg.gather(shard, full).wait()
    return full


def _is_sharded_state(entry: _OptimizerEntry, value: Any) -> bool:
    """Whether ``value`` is state of a sharded parameter shaped like its local
    piece (an element-wise optimizer's: SGD's momentum, Adam's moments);
    a zero-size parameter's stays as it is."""
    return (entry.fsdp_param is not None and entry.fsdp_param.numel > 0 and isinstance(value, torch.Tensor)
            and value.dim() >= 1 and value.shape == entry.param.shape)


def _detached(value: Any) -> Any:
    """A tensor value copied (the optimizer that loads or gave it steps it in
    place, Adam's ``step`` included: a dict held or loaded twice must not
    change with it); anything else as it is."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _named_param_groups(optimizer: torch.optim.Optimizer, entries: list[_OptimizerEntry]) -> list[dict]:
    groups, i = [], 0
    for group in optimizer.param_groups:
        n = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [e.key for e in entries[i:i + n]]})
        i += n
    return groups


def optimizer_state_dict_to_load(module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """What ``optimizer.load_state_dict`` takes, from a dict keyed by
    parameter name (``get_optimizer_state_dict``'s after ``dcp.load`` into
    it, saved at any world size, or ``full_optimizer_state_dict``'s): a
    ShardedTensor of pydist's layout, a DTensor or a full tensor of a
    sharded parameter's shape becomes this rank's piece; the rest is kept."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    _root_state(module)
    entries = _optimizer_entries(module, optimizer)
    saved_groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if [len(g["params"]) for g in saved_groups] != sizes:
        raise ValueError(f"pydist optimizer state dict: the saved param_groups hold "
                         f"{[len(g['params']) for g in saved_groups]} parameters, the optimizer's {sizes}")
    new_state = {}
    for index, e in enumerate(entries):  # optimizer.state_dict() numbers parameters in this order
        saved = state_dict["state"].get(e.key)
        if saved is None:
            continue
        per_param = {}
        for name, value in saved.items():
            fp = e.fsdp_param
            _check_state_shape(e, name, value)
            if fp is not None and (isinstance(value, (ShardedTensor, DTensor)) or
                                   (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == fp.shape)):
                value = _to_local_piece(fp, value, f"{e.key} optimizer state {name!r}")
            per_param[name] = _detached(value)
        new_state[index] = per_param
    groups, i = [], 0
    for saved_group, n in zip(saved_groups, sizes):
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": list(range(i, i + n))})
        i += n
    return {"state": new_state, "param_groups": groups}


def _check_state_shape(entry: _OptimizerEntry, name: str, value: Any) -> None:
    """Refuses a full state tensor with the parameter's number of elements
    but another shape (see [Note: shape-checked loads])."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    fp = entry.fsdp_param
    if (fp is not None and fp.numel > 0 and isinstance(value, torch.Tensor)
            and not isinstance(value, (ShardedTensor, DTensor)) and value.dim() >= 1 and value.numel() == fp.numel
            and value.shape != fp.shape):
        raise ValueError(
            f"pydist optimizer state dict: size mismatch for {entry.key!r} state {name!r}: a tensor of shape "
            f"{tuple(value.shape)}, the parameter is {tuple(fp.shape)} (rank {fp.param_group.rank})")


def check_optimizer_shapes(module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """``_check_state_shape`` over a dict keyed by parameter name (a
    flattened one, without "state", is left to torch)."""
    saved = state_dict.get("state")
    if not isinstance(saved, dict):
        return
    for e in _optimizer_entries(module, optimizer):
        for name, value in saved.get(e.key, {}).items():
            _check_state_shape(e, name, value)


def rekey_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict,
                               to_ids: bool) -> dict:
    """``state_dict`` with its parameters keyed by their index in
    ``optimizer``'s param_groups (``to_ids``: what ``optimizer.state_dict()``
    uses) or by name (``get_optimizer_state_dict``'s keys), as torch FSDP1's
    ``rekey_optim_state_dict``; keys already of that kind stay."""
    names = [e.key for e in _optimizer_entries(module, optimizer)]
    new_key = dict(enumerate(names)) if not to_ids else {name: i for i, name in enumerate(names)}

    def key(old):
        if isinstance(old, int) == to_ids:
            return old
        if old not in new_key:
            raise KeyError(f"pydist rekey_optim_state_dict: {old!r} is not a parameter the optimizer steps on")
        return new_key[old]

    return {"state": {key(k): v for k, v in state_dict["state"].items()},
            "param_groups": [{**g, "params": [key(k) for k in g["params"]]} for g in state_dict["param_groups"]]}


def set_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Loads ``optimizer_state_dict_to_load``'s answer into ``optimizer``
    (``fully_shard``'s modules: torch's ``set_optimizer_state_dict``, full
    or sharded as the dict is)."""
    if _dtensor_model(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict as torch_set
        from torch.distributed.tensor import DTensor

        sharded = any(isinstance(v, DTensor) for per in state_dict.get("state", {}).values() for v in per.values())
        check_optimizer_shapes(module, optimizer, state_dict)
        torch_set(module, optimizer, state_dict, options=StateDictOptions(full_state_dict=not sharded))
        return
    optimizer.load_state_dict(optimizer_state_dict_to_load(module, optimizer, state_dict))
