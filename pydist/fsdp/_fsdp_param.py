"""One parameter under pydist's FSDP: where it lives in its unit's flat
layout, the slice of it this rank keeps, and the two tensors a module sees.

[Note: what the optimizer sees]
torch's FSDP2 gives the optimizer DTensors sharded on dim 0 (each padded to
a multiple of the world size). pydist gives plain ``nn.Parameter``s: each is
a 1-D view of this rank's contiguous slice of the *flattened* parameter
(the part of ``[offset, offset + numel)`` of the unit's flat layout that
falls in this rank's shard), possibly empty. So ``model.parameters()``
outside forward and backward yields these 1-D local shards, their ``.grad``
is this rank's slice of the averaged gradient, and optimizers that work
element by element (SGD, Adam, AdamW...) step exactly as on the full
tensors. Optimizers that need a parameter's shape (Shampoo, Muon) need
the global view: ``pydist.fsdp.full_state_dict`` gives full tensors under
the unwrapped module's keys. ``clip_grad_norm_`` (torch's or pydist's) takes
the norm over every rank's shards: see [Note: the global norm of sharded
gradients] in _clip_grad.py.

[Note: the Parameter objects stay]
The module's own ``nn.Parameter`` objects become those 1-D shards (their
``.data`` re-pointed, as torch's FSDP1 does with ``use_orig_params=True``,
and as a meta unit's are at its first use); NO_SHARD's keep their shape.
torch's FSDP2 registers new DTensor parameters instead, so an optimizer
built before ``fully_shard`` steps tensors the model no longer uses and the
model silently never trains; under pydist (both front doors) it steps the
shards, exactly as one built after, with the same
param groups: a script that groups parameters by ``p.dim()`` (nanoGPT's
``configure_optimizers``: weight decay for the matrices only) must build its
groups before sharding, when the shapes are still the full ones, since
afterwards every shard is 1-D. A ``.grad`` the parameter held is dropped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

__all__ = ["FSDPParam", "ParamModuleInfo"]


class ParamModuleInfo(NamedTuple):
    """A place a parameter is registered: ``module._parameters[name]``."""

    module: nn.Module
    name: str


class FSDPParam:
    """Per-parameter state of one parameter of an ``FSDPParamGroup``.

    Lives as long as the unit. ``sharded_param`` is registered on the module
    outside forward/backward, ``unsharded_param`` while the unit is
    unsharded; both objects are created once and kept, so autograd's
    accumulators and an optimizer's state stay attached to them.
    """

    def __init__(self, param: nn.Parameter, infos: list[ParamModuleInfo], fqn: str, offset: int,
                 shard: torch.Tensor, shard_start: int):
        # Where the parameter is registered (more than one place when shared
        # within the unit); the unit swaps all of them (its _sharded_regs,
        # _unsharded_regs).
        self.module_infos = infos
        # Its name under the module fully_shard was called on, for errors and state dicts.
        self.fqn = fqn
        self.shape = param.shape
        self.numel = param.numel()
        self.requires_grad = param.requires_grad
        # Its first element's index in the unit's flat (unsharded) layout.
        self.offset = offset
        # This rank's part of it: [local_start, local_end) of the flat layout,
        # at [local_start - shard_start, ...) of the unit's shard buffer.
        shard_numel = shard.numel()
        self.local_start = min(max(offset, shard_start), shard_start + shard_numel)
        self.local_end = max(min(offset + self.numel, shard_start + shard_numel), self.local_start)
        # The parameter the optimizer sees: a 1-D view of the shard buffer
        # (see [Note: what the optimizer sees]). Lives as long as the unit.
        # It is the module's own Parameter object, pointed at its piece, so
        # an optimizer built before fully_shard holds it (see [Note: the
        # Parameter objects stay]); a meta one is adopted at to_empty instead.
        view = shard.narrow(0, self.local_start - shard_start, self.local_end - self.local_start)
        if param.is_meta:
            self.sharded_param = nn.Parameter(view, requires_grad=param.requires_grad)
        else:
            param.grad = None  # one of the full shape no longer fits (FSDP2's new parameter has none either)
            param.data = view
            self.sharded_param = param
        self.sharded_param._pydist_fsdp_param = self  # how state dicts find the unit
        # The full parameter, a view of the unit's unsharded buffer; made at
        # the first unshard (the buffer has no memory before) and kept.
        self.unsharded_param: nn.Parameter | None = None
        # Under mixed precision with gradient sync off: the gradients of the
        # backwards so far, summed in the reduce dtype (as torch's FSDP2 keeps
        # them) until a backward with sync reduces them. None otherwise.
        self.accumulated_grad: torch.Tensor | None = None
        # Where its part of its unit's reduced output starts (set by the unit).
        self._grad_offset = -1

    @property
    def local_numel(self) -> int:
        return self.local_end - self.local_start

    def full_view(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter in full, a view of ``flat``: a buffer in the unit's
        flat (unsharded) layout."""
        return flat.narrow(0, self.offset, self.numel).view(self.shape)

    def init_unsharded_param(self, unsharded: torch.Tensor) -> None:
        if self.unsharded_param is None:
            self.unsharded_param = nn.Parameter(self.full_view(unsharded), requires_grad=self.requires_grad)

    def accumulate_grad(self, reduce_dtype: torch.dtype, keep: bool) -> None:
        """Folds this backward's gradient into ``accumulated_grad`` where one
        is kept; with ``keep`` (sync off), starts keeping one when the gradient
        is not in ``reduce_dtype``."""
        grad = self.unsharded_param.grad if self.unsharded_param is not None else None
        if grad is None:
            return
        if self.accumulated_grad is not None:
            self.accumulated_grad += grad
        elif keep and grad.dtype != reduce_dtype:
            self.accumulated_grad = grad.to(reduce_dtype)
        else:
            return
        self.unsharded_param.grad = None

    def grad_to_reduce(self) -> torch.Tensor | None:
        if self.accumulated_grad is not None:
            return self.accumulated_grad
        return self.unsharded_param.grad if self.unsharded_param is not None else None

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn}, shape={tuple(self.shape)}, local=[{self.local_start}, {self.local_end}))"
