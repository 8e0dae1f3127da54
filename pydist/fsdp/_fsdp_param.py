"""One parameter under pydist's FSDP: where it lives in its unit's flat
layout, the slice of it this rank keeps, and the two tensors a module sees.

[Note: what the optimizer sees]
Each door gives the optimizer what its torch API gives (see [Note: a
unit's layout] in _fsdp_param_group.py):
  * ``fully_shard`` (FSDP2's): DTensor parameters, see [Note: DTensor
    parameters];
  * ``FullyShardedDataParallel`` (FSDP1's, ``use_orig_params=True``): plain
    ``nn.Parameter``s, each a 1-D view of this rank's contiguous slice of
    the *flattened* parameter (the part of ``[offset, offset + numel)`` of
    the unit's flat layout that falls in this rank's shard), possibly empty.
Either way ``model.parameters()`` outside forward and backward yields this
rank's pieces, their ``.grad`` is this rank's piece of the averaged
gradient, and optimizers that work element by element (SGD, Adam, AdamW...)
step exactly as on the full tensors. ``clip_grad_norm_`` (torch's or
pydist's) takes the norm over every rank's pieces: DTensors carry it for
FSDP2's door, and see [Note: the global norm of sharded gradients] in
_clip_grad.py for FSDP1's.

[Note: DTensor parameters]
Under ``fully_shard`` a sharded parameter is a new ``nn.Parameter`` holding
a DTensor of the parameter's full shape, placed as torch's FSDP2 places it
(``(Shard(0),)`` on a 1-D mesh, ``(Replicate(), Shard(0))`` on a 2-D
("replicate", "shard") one), whose local tensor is this rank's dim-0 chunk:
a view of the unit's shard buffer, so the optimizer's in-place updates land
in what the next all-gather sends. Its ``.grad`` is a DTensor of the same
spec over a view of the reduce-scatter's output (``hand_out_dtensor_grads``). So torch's
own ``clip_grad_norm_``, ``get_total_norm``, ``GradScaler``, DTensor-API
checkpoints (``full_tensor``, ``distribute_tensor``), DCP and
``get_/set_model_state_dict`` see FSDP2's parameters. The
module's old Parameter objects are replaced, as under torch: build the
optimizer after ``fully_shard``. Under torch an optimizer built before
silently never trains (it steps tensors that get no gradient); pydist
marks the old objects, and an optimizer's first step over one raises,
naming it (``_replace``; one check per optimizer, not per step). A unit built on
the meta device holds meta DTensors
until ``to_empty`` gives each rank its local chunks, which the user's
initialization (DTensor ops, as under torch) fills; the unit takes them up
at its first use (``adopt_registered``, ``shard_materialized``), as it
takes up parameters that ``load_state_dict(assign=True)`` puts on the
modules (torch's ``reset_sharded_param``). While a unit is unsharded its
modules hold plain full-size parameters, views of the unsharded buffer,
as torch's do.

[Note: the Parameter objects stay]
Under ``FullyShardedDataParallel`` the module's own ``nn.Parameter``
objects become those 1-D shards (their ``.data`` re-pointed, as torch's
FSDP1 does with ``use_orig_params=True``, and as a meta unit's are at its
first use); NO_SHARD's keep their shape. So an optimizer built before
wrapping steps the shards, exactly as one built after, with the same param
groups: a script that groups parameters by ``p.dim()`` (nanoGPT's
``configure_optimizers``: weight decay for the matrices only) must build its
groups before wrapping, when the shapes are still the full ones, since
afterwards every shard is 1-D. A ``.grad`` the parameter held is dropped.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Sequence

import torch
import torch.nn as nn

__all__ = ["FSDPParam", "ParamModuleInfo", "as_dtensor", "dtensor_parameter", "dtensor_spec"]


def _replace(param: nn.Parameter, new: nn.Parameter, fqn: str) -> nn.Parameter:
    """``new`` (the DTensor parameter) in ``param``'s place, as torch's
    FSDP2 registers new parameters; ``param`` is marked, so an optimizer
    that still steps it raises rather than never training (see [Note:
    DTensor parameters]). ``param`` keeps its values."""
    new.__dict__.update({k: v for k, v in param.__dict__.items() if not k.startswith("_pydist")})  # a user's tags
    param._pydist_replaced_as = fqn
    param.grad = None
    _refuse_replaced_parameters()
    return new


# Per optimizer, its param_groups' sizes when it was last checked.
_checked_optimizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_check_installed = False


def _refuse_replaced_parameters() -> None:
    """Once per process: every optimizer's first step (and its first after
    its param_groups change) checks that it steps no parameter ``fully_shard``
    replaced."""
    global _check_installed
    if not _check_installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_check_optimizer)
        _check_installed = True


def _check_optimizer(optimizer, args, kwargs) -> None:
    groups = optimizer.param_groups
    shape = tuple(len(g["params"]) for g in groups)
    if _checked_optimizers.get(optimizer) == shape:
        return
    for g in groups:
        for p in g["params"]:
            fqn = getattr(p, "_pydist_replaced_as", None)
            if fqn is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} steps parameter {fqn} as it was before pydist.fully_shard, which "
                    "replaced it with a DTensor parameter (as torch's FSDP2 does): it gets no gradient and would "
                    "never train. Build the optimizer after fully_shard, from model.parameters()")
    _checked_optimizers[optimizer] = shape


def as_dtensor(local: torch.Tensor, spec):
    """``local`` as a DTensor of ``spec``, without autograd (torch FSDP2's
    ``_from_local_no_grad``: the constructor, none of ``from_local``'s checks)."""
    return _dtensor_maker()(_DTensor, local, spec, requires_grad=False)


def dtensor_parameter(local: torch.Tensor, spec, requires_grad: bool) -> nn.Parameter:
    """What ``nn.Parameter(as_dtensor(local, spec), requires_grad)`` gives (a
    DTensor leaf marked ``_is_param``, so ``isinstance(p, nn.Parameter)``),
    made directly: ``nn.Parameter`` would ``detach()`` the DTensor, a
    dispatch whose first sharding propagation per shape builds a fake-tensor
    mode that reads the source of every file on the stack into linecache
    (0.8 MB on the 400-unit model), and gives each parameter a spec of its own."""
    param = _dtensor_maker()(_DTensor, local, spec, requires_grad=requires_grad)
    param._is_param = True
    return param


def _dtensor_maker():
    """DTensor's constructor as ``make(DTensor, local, spec, requires_grad=)``.
    A gradient is made per parameter and step: where torch has it (2.13),
    its C++ ``__new__`` is called straight, skipping ``DTensor.__init__``
    (which does nothing but cost a dynamo-disabled Python call)."""
    global _DTensor, _MAKE_DTENSOR
    if _MAKE_DTENSOR is None:
        from torch.distributed.tensor import DTensor

        _DTensor = DTensor
        _MAKE_DTENSOR = getattr(torch.Tensor, "_dtensor__new__", None) or (
            lambda cls, local, spec, requires_grad: cls(local, spec, requires_grad=requires_grad))
    return _MAKE_DTENSOR


_DTensor = None
_MAKE_DTENSOR = None


def hand_out_dtensor_grads(params: Sequence[nn.Parameter], pieces: Sequence[torch.Tensor]) -> None:
    """Gives each sharded DTensor parameter ``params[i]`` its piece of a
    reduced output (a plain tensor in its local shape) as its ``.grad``: a
    DTensor sharing the parameter's spec object, or adds the piece to the
    local tensor of the ``.grad`` it has. The one writer of FSDP2's door's
    gradients; one loop for a whole reduce batch (a model of small
    parameters hands out thousands a step)."""
    make = _dtensor_maker()
    for p, piece in zip(params, pieces):
        grad = p.grad
        if grad is None:
            p.grad = make(_DTensor, piece, p._spec, requires_grad=False)
        else:
            grad._local_tensor.add_(piece)


def dtensor_spec(mesh, shape: torch.Size, dtype: torch.dtype):
    """The spec torch's FSDP2 gives a parameter of ``shape`` sharded on
    ``mesh``: ``(Shard(0),)`` on a 1-D mesh, ``(Replicate(), Shard(0))`` on a
    2-D ("replicate", "shard") one; contiguous strides. One object per mesh,
    shape and dtype while a parameter holds it, shared as torch's sharding
    propagation shares the specs of its cached outputs (a model of 400
    units of four parameters needs four, not 1,600)."""
    key = (id(mesh), tuple(shape), dtype)
    spec = _specs.get(key)
    if spec is None:  # a live spec holds its mesh, so the id is that mesh's
        _specs[key] = spec = _new_dtensor_spec(mesh, shape, dtype)
    return spec


# dtensor_spec's specs, each while something (a parameter, its gradient) holds it.
_specs: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _new_dtensor_spec(mesh, shape: torch.Size, dtype: torch.dtype):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, tuple(reversed(strides)), dtype))


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
                 shard: torch.Tensor, column, rank: int, spec=None):
        # Where the parameter is registered (more than one place when shared
        # within the unit); the unit swaps all of them (its _sharded_regs,
        # _unsharded_regs).
        self.module_infos = infos
        # Its name under the module fully_shard was called on, for errors and state dicts.
        self.fqn = fqn
        self.shape = param.shape
        self.numel = param.numel()
        self.requires_grad = param.requires_grad
        # Its first element's index in the unit's unsharded buffer, and the
        # column of the unit's layout it lies in (a _fsdp_param_group.Column:
        # see [Note: a unit's layout] in _fsdp_param_group.py).
        self.offset = offset
        self.column = column
        # This rank's part of it, [lo, hi) of its flattened elements: at
        # [local_start, local_end) of the unsharded buffer, and at
        # shard_offset of the unit's shard buffer.
        lo, hi = self.rank_range(rank)
        self.local_start = offset + lo
        self.local_end = offset + hi
        self.shard_offset = column.shard_offset + (offset - column.offset) + lo - rank * column.width
        if hi == lo:
            self.shard_offset = column.shard_offset
        # The shape of that part: 1-D in the flat layout; the rows it keeps
        # under the dim-0 layout (a parameter of dim 0 or without rows: 1-D).
        rows = column.rows
        self.local_shape = (torch.Size([min(max(self.shape[0] - rank * rows, 0), rows)]) + self.shape[1:]
                            if rows else torch.Size([hi - lo]))
        # The parameter the optimizer sees: a view of the shard buffer
        # (see [Note: what the optimizer sees]). Lives as long as the unit.
        # It is the module's own Parameter object, pointed at its piece, so
        # an optimizer built before fully_shard holds it (see [Note: the
        # Parameter objects stay]); a meta one is adopted at to_empty instead.
        view = self.local_view(shard)
        # FSDP2's door: the DTensor spec of the parameter and its gradient
        # (see [Note: DTensor parameters]); None: plain tensors.
        self.spec = spec
        if spec is not None:
            self.sharded_param = _replace(param, dtensor_parameter(view, spec, param.requires_grad),
                                          fqn)
        elif param.is_meta:
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

    def local_tensor(self) -> torch.Tensor:
        """The plain tensor the sharded parameter holds: this rank's piece."""
        p = self.sharded_param
        return p._local_tensor if self.spec is not None else p

    def set_local(self, local: torch.Tensor) -> None:
        """Points the sharded parameter at ``local`` (its piece of a new shard buffer)."""
        if self.spec is not None:
            self.sharded_param._local_tensor = local
        else:
            self.sharded_param.data = local

    def rank_range(self, r: int) -> tuple[int, int]:
        """The range of its flattened elements (within ``[0, numel]``) rank
        ``r`` keeps: what of its column's rank-``r`` cut falls on it."""
        col = self.column
        start = self.offset - col.offset  # where it starts in its column
        lo = min(max(r * col.width - start, 0), self.numel)
        hi = min(max((r + 1) * col.width - start, lo), self.numel)
        return lo, hi

    def local_view(self, shard: torch.Tensor) -> torch.Tensor:
        """Its part of ``shard`` (a buffer laid out as the unit's shard), in its local shape."""
        return shard.narrow(0, self.shard_offset, self.local_numel).view(self.local_shape)

    @property
    def local_numel(self) -> int:
        return self.local_end - self.local_start

    def full_view(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter in full, a view of ``flat``: a buffer laid out as
        the unit's unsharded buffer."""
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
        return f"FSDPParam({self.fqn}, shape={tuple(self.shape)}, local={tuple(self.local_shape)} at {self.shard_offset})"
