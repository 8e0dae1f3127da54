"""Full parameters on the modules between iterations: what torch FSDP1's
``summon_full_params`` gives (``pydist.FullyShardedDataParallel.summon_full_params``).

[Note: summoning full parameters]
    with FSDP.summon_full_params(model):             # collective
        print(model.fc.weight.shape)                  # the full shape, on every rank
        model.fc.weight.mul_(0.5)                     # kept after the block (writeback)
Each unit under ``module`` (only the module's own with ``recurse=False``)
gathers its shard in the parameters' own dtype (fp32 under mixed precision:
torch's FSDP1 summons full precision too) into a buffer of its own, and new
full-shape Parameters, views of it, are registered where the unit's are. The
shards and their ``.grad`` stay as they were: the optimizer does not see the
full parameters. On leaving, with ``writeback`` each rank copies its own
slice of the buffer back into its shard (an edit is kept where it fell in
some rank's slice: everywhere, if every rank made it, as torch's), then the
shards are registered again and the buffer goes.

A state dict taken inside (``model.state_dict()``, ``full_state_dict``)
holds the summoned full parameters as they are, with no collective, as
torch's: the old way to save full weights, ``with
FSDP.summon_full_params(model, writeback=False, rank0_only=True):`` then
``torch.save(model.state_dict(), ...)`` on rank 0 alone, works.
As torch's: not inside a forward or backward (a unit not between iterations
raises). A forward inside it runs on the full parameters, its summoned
units' hooks doing nothing (no gathers, no casts): under ``torch.no_grad()``
only (``generate``, evaluation), since the gradients of a backward there
would reach neither the shards nor the optimizer, silently. ``rank0_only`` registers the full parameters on rank 0 only (every rank
takes part in the gathers), and refuses ``writeback``. A NO_SHARD unit's
parameters are full already: edits stay, whatever ``writeback``. A unit
left unsharded by its last forward or backward (SHARD_GRAD_OP,
``set_reshard_after_backward(False)``) is resharded first; its next forward
gathers again. ``offload_to_cpu`` changes nothing (the parameters are on the
CPU). ``with_grads``: each full parameter's ``.grad`` is the full gradient,
gathered from the shards' ``.grad`` (zeros where a rank's shard has none;
none at all where no rank's shards of the unit have one), and written back
to the shards' ``.grad`` with ``writeback``, as torch's.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from pydist.fsdp import _fsdp_collectives as collectives
from pydist.fsdp._fsdp_common import TrainingState, state_of
from pydist.fsdp._fsdp_param_group import FSDPParamGroup, _register, registrations
from pydist.fsdp._state_dict import gather_full_flat, gather_pieces

__all__ = ["summon_full_params"]


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       with_grads: bool = False) -> Iterator[None]:
    """See [Note: summoning full parameters]. Collective."""
    if writeback and rank0_only:
        raise NotImplementedError(
            "pydist summon_full_params: writeback=True with rank0_only=True is not supported (as torch's FSDP1): "
            "the other ranks hold no full parameters to write back; pass writeback=False"
        )
    states = [s for m in module.modules() if (s := state_of(m)) is not None]
    for state in states:  # pre-order: the outermost first, whose init reaches the ones inside it
        if state.root is None:
            state._lazy_init()  # collective: opens the transport, as a first forward would
    if not recurse:
        states = [s for s in states if s.module is module]
    units = [s.param_group for s in states if s.param_group is not None]
    for pg in units:
        if pg.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                f"pydist summon_full_params: unit {_name(pg)} is in {pg.training_state.name} (its forward or "
                "backward is running, or its parameters are summoned already); summon between iterations"
            )
    register = not rank0_only or dist.get_rank() == 0  # torch's rank0_only: global rank 0
    with contextlib.ExitStack() as stack:
        for pg in units:
            stack.enter_context(_summoned(pg, writeback, register, with_grads))
        yield


@contextlib.contextmanager
def _summoned(pg: FSDPParamGroup, writeback: bool, register: bool, with_grads: bool) -> Iterator[None]:
    pg.reshard()  # from the shards: see the note
    full = gather_full_flat(pg) if pg.sharded else None
    full_grads = _gather_full_grads(pg) if full is not None and with_grads else None
    params = []
    if full is not None and register:
        for fp in pg.fsdp_params:
            param = nn.Parameter(fp.full_view(full), requires_grad=fp.sharded_param.requires_grad)
            if full_grads is not None and param.requires_grad:
                param.grad = fp.full_view(full_grads)
            params.append(param)
        _register(registrations((info.module._parameters, info.name, param)
                                for fp, param in zip(pg.fsdp_params, params) for info in fp.module_infos))
    pg.begin_summon()
    try:
        yield
    finally:
        if full is not None:
            if writeback:
                with torch.no_grad():
                    pg.shard.copy_(pg.shard_of_full(full))
                    if full_grads is not None:
                        _write_back_grads(pg, full_grads)
            _register(pg._sharded_regs)
        pg.end_summon()


def _gather_full_grads(pg: FSDPParamGroup) -> torch.Tensor | None:
    """Collective: the unit's full flat gradient, from every rank's shards'
    ``.grad`` (zeros where a shard has none), as torch's FSDP1 ``with_grads``
    gives it: None when no rank's shards of the unit have a gradient."""
    has = torch.tensor([float(any(fp.sharded_param.grad is not None for fp in pg.fsdp_params))])
    if collectives.all_reduce_sum(pg.transport, has, pg.device).item() == 0:
        return None
    return gather_pieces(pg, [(fp, fp.sharded_param.grad) for fp in pg.fsdp_params], pg.dtype)


def _write_back_grads(pg: FSDPParamGroup, full_grads: torch.Tensor) -> None:
    """Each shard's ``.grad`` takes its slice of the full gradient (edits in
    the block kept, as the parameters'); a shard without one gets one."""
    for fp in pg.fsdp_params:
        if not fp.sharded_param.requires_grad:
            continue
        piece = full_grads.narrow(0, fp.local_start, fp.local_numel).view(fp.local_shape)
        if fp.sharded_param.grad is None:
            fp.sharded_param.grad = piece.clone()
        else:
            fp.sharded_param.grad.copy_(piece)


def _name(pg: FSDPParamGroup) -> str:
    return repr(pg.label) if pg.label else "'' (the root)"
