"""Gradient clipping by the global norm of sharded gradients, for
``torch.nn.utils.clip_grad_norm_`` as much as for ``pydist.clip_grad_norm_``.

[Note: the global norm of sharded gradients]
A shard's ``.grad`` holds this rank's piece of the gradient, so the norm
torch's ``clip_grad_norm_`` computes over ``model.parameters()`` is this
rank's alone: each rank would clip by a different coefficient. torch's FSDP2
gets the global norm because its gradients are DTensors, whose norm is a
partial value the ranks reduce (``x^p``, summed over the ranks, ``^(1/p)``;
the maximum for ``p = inf``). pydist's gradients are plain tensors; what
marks them is the reduced output they are views of (``mark_shard_grads``,
called where a sharded unit hands its gradients out), which carries the
transport that reduced it. ``total_norm`` splits the tensors it is given
into those of each transport and the rest (NO_SHARD units' gradients,
parameters fully_shard does not manage: the same on every rank, counted
once), takes torch's own norm of each part on this rank, reduces the
sharded parts over their transports as FSDP2 does, and combines the parts.
Importing pydist puts it in place of the function torch's
``clip_grad_norm_`` and ``torch.nn.utils.get_total_norm`` compute with
(``install``, from pydist/fsdp/__init__.py), so a script whose only change
is the import clips as it did under FSDP2, and a ``get_total_norm`` it
imports by name after pydist is this one; tensors without a mark go to
torch's function unchanged (a DDP-only job pays one attribute look-up per
tensor).
Like FSDP2's, the norm of sharded gradients is a collective: every rank
calls it, with the same parameters in the same order.

Each door's norm is its torch API's to the last bit where the shards allow,
because a norm one ulp off scales every gradient by another coefficient
once clipping is active, and the runs drift apart (issue #36):
- FSDP1's door (``pydist.FullyShardedDataParallel``): torch FSDP1's
  ``clip_grad_norm_``, step by step (``fsdp1_clip_grad_norm_``): its
  parameters in its order (its handles in pre-order, the root's first, each
  one's in registration order: ``FullyShardedDataParallel._fsdp1_clip_params``),
  each gradient's norm in float32, those stacked into one float32 norm for
  the sharded gradients and one for the rest, ``sharded^p`` summed over
  the ranks plus ``rest^p``, ``^(1/p)`` (inf: the maximum), then
  ``clip_coef = max_norm / (norm + 1e-6)`` clamped to 1, cast to each
  gradient's dtype. The shards are torch's ``use_orig_params=True`` ones
  (the same flat layout, cut evenly) wherever every parameter's numel is a
  multiple of torch's 16-byte alignment (4 float32 elements, 8 under a
  bf16 ``param_dtype``); torch pads the others to it and pydist does not,
  so there a shard's boundary, and the norm's last bit, can differ (the
  unclipped updates stay bitwise: they work element by element). Bitwise
  at two ranks; at more, the ranks' sum may be taken in another order.
  ``model.clip_grad_norm_`` computes it, and so does torch's
  ``clip_grad_norm_`` / ``get_total_norm`` on a door's gradients, in any
  order (``total_norm`` finds the door and sorts them into torch's): on
  torch's own FSDP1 that call takes each rank's norm alone, a pitfall
  torch's documentation warns of and pydist does not copy. torch's
  ``use_orig_params=False`` (which the door refuses) norms one flat shard
  per handle, padding included: another rounding.
- FSDP2's door (``pydist.fully_shard``): torch's ``get_total_norm`` per
  transport, reduced as a DTensor's norm, parts combined by torch's norm.
  torch's FSDP2 norms each parameter's dim-0 chunk, pydist a piece of the
  unit's flat layout: other elements on each rank, so the norm agrees to
  about an ulp, not bitwise, until that door has FSDP2's layout.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
import weakref
from typing import Iterable, NamedTuple

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as _torch_clip_grad

from pydist.ddp.overlap_optimizer import wait_all_grads
from pydist.fsdp import _fsdp_collectives as collectives

__all__ = ["clip_grad_norm_", "total_norm", "FSDP1Params", "fsdp1_clip_grad_norm_", "register_fsdp1_door",
           "mark_shard_grads", "split_by_transport", "install"]

# The attribute of a reduced output whose views are sharded gradients: the
# transport it was reduced over. See [Note: the global norm of sharded gradients].
_MARK = "_pydist_shard_grads_of"

# torch's own, taken before ``install`` replaces it.
_torch_total_norm = _torch_clip_grad._get_total_norm


def mark_shard_grads(output: torch.Tensor, transport) -> None:
    """``output``'s views are shards' gradients, reduced over ``transport``."""
    setattr(output, _MARK, transport)


def transport_of(grad: torch.Tensor):
    """The transport that reduced ``grad`` if it is a shard's gradient, else None."""
    base = grad._base
    return getattr(base if base is not None else grad, _MARK, None)


def split_by_transport(tensors: Iterable[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
    """``tensors`` as [(transport, its sharded gradients)], transports in
    first appearance (the same order on every rank), and the rest."""
    sharded: dict[int, tuple[object, list[torch.Tensor]]] = {}
    rest = []
    for t in tensors:
        transport = transport_of(t)
        if transport is None:
            rest.append(t)
        else:
            sharded.setdefault(id(transport), (transport, []))[1].append(t)
    return list(sharded.values()), rest


@torch.no_grad()
def total_norm(tensors: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0,
               error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` with the sharded gradients among
    ``tensors`` counted over every rank. See [Note: the global norm of
    sharded gradients]."""
    wait_all_grads()  # see [Note: clipping and loss scaling wait for the gradients]
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    sharded, rest = split_by_transport(tensors)
    if not sharded:
        return _torch_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise NotImplementedError(
            f"pydist: the {norm_type}-norm of sharded gradients is not implemented (torch's norm of per-tensor norms "
            "is no norm of the whole gradient for it); use a positive p or inf"
        )
    if len(sharded) == 1 and (in_order := _in_fsdp1_order(*sharded[0])) is not None:
        total = _fsdp1_total_norm(in_order, rest, sharded[0][0], norm_type)
        _check_finite(total, norm_type, error_if_nonfinite)
        return total.to(functools.reduce(torch.promote_types, [t.dtype for t in tensors]))
    parts = []
    for transport, grads in sharded:
        # A shard may hold no element of a parameter (torch's inf-norm
        # refuses an empty tensor); a rank with nothing still takes part.
        held = [g for g in grads if g.numel()]
        local = (_torch_total_norm(held, norm_type, False, foreach) if held else grads[0].new_zeros(())).reshape(1)
        if math.isinf(norm_type):
            parts.append(collectives.all_gather_small(transport, local).max())
        else:  # as torch's _NormPartial reduces a DTensor's norm
            parts.append(collectives.all_reduce_sum(transport, local ** norm_type).reshape(()) ** (1.0 / norm_type))
    if rest:
        parts.append(_torch_total_norm(rest, norm_type, False, foreach))
    total = parts[0] if len(parts) == 1 else _torch_total_norm(parts, norm_type, False, foreach)
    _check_finite(total, norm_type, error_if_nonfinite)
    return total


def _check_finite(total: torch.Tensor, norm_type: float, error_if_nonfinite: bool) -> None:
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` by the *global* norm: every rank's
    shards together (one small collective per transport), plus the
    gradients of parameters fully_shard does not manage, counted once.
    Returns the total norm, the same on every rank. With pydist imported,
    torch's ``clip_grad_norm_`` computes the same."""
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm = total_norm([p.grad for p in parameters if p.grad is not None], norm_type, error_if_nonfinite, foreach)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach)
    return norm


class FSDP1Params(NamedTuple):
    """A ``pydist.FullyShardedDataParallel``'s parameters as torch FSDP1's
    ``clip_grad_norm_`` takes them: its handles in pre-order (the root
    first), each one's parameters in registration order."""

    sharded: list  # this rank's shards
    nonsharded: list  # the same on every rank (NO_SHARD units, parameters of no unit): counted once
    transport: object  # the sharded gradients were reduced over it


# The live FSDP1 doors (objects with ``_fsdp1_clip_params() -> FSDP1Params | None``,
# registered by their __init__): torch's clip_grad_norm_ on their gradients
# takes their order. See [Note: the global norm of sharded gradients].
_FSDP1_DOORS: "weakref.WeakSet" = weakref.WeakSet()


def register_fsdp1_door(door) -> None:
    _FSDP1_DOORS.add(door)


def _in_fsdp1_order(transport, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """``grads`` in torch FSDP1's order if they are all sharded gradients of
    one FSDP1 door (the one reduced over ``transport``), else None."""
    for door in list(_FSDP1_DOORS):
        params = door._fsdp1_clip_params()
        if params is None or params.transport is not transport:
            continue
        place = {id(p.grad): i for i, p in enumerate(params.sharded) if p.grad is not None}
        if all(id(g) in place for g in grads):
            return sorted(grads, key=lambda g: place[id(g)])
    return None


def _fsdp1_local_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """torch FSDP1's ``_get_grad_norm``: each gradient's norm in float32,
    stacked in order, their norm in float32; 0 without gradients."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads]),
        norm_type, dtype=torch.float32)


def _fsdp1_total_norm(sharded_grads: list[torch.Tensor], nonsharded_grads: list[torch.Tensor], transport,
                      norm_type: float) -> torch.Tensor:
    """torch FSDP1's total norm (float32) of this rank's ``sharded_grads``,
    summed over ``transport``, and ``nonsharded_grads`` counted once, each
    list in torch's order."""
    norm_type = float(norm_type)
    # torch gives the shard of a parameter with no element on this rank no
    # .grad: an empty one would move the others in the stacked norms.
    local_sharded = _fsdp1_local_norm([g for g in sharded_grads if g.numel()], norm_type)
    local_nonsharded = _fsdp1_local_norm(nonsharded_grads, norm_type) if nonsharded_grads else None
    if math.isinf(norm_type):
        local = local_sharded if local_nonsharded is None else torch.maximum(local_sharded, local_nonsharded)
        return collectives.all_gather_small(transport, local).max()
    total = collectives.all_reduce_sum(transport, (local_sharded ** norm_type).reshape(1)).reshape(())
    if local_nonsharded is not None:  # summed over the ranks it would count world-size times
        total += local_nonsharded ** norm_type
    return total ** (1.0 / norm_type)


@torch.no_grad()
def fsdp1_clip_grad_norm_(params: FSDP1Params, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch FSDP1's ``FullyShardedDataParallel.clip_grad_norm_`` on
    ``params``: the total norm, every step as torch takes it for its
    rounding; scales the gradients. See [Note: the global norm of sharded
    gradients]."""
    wait_all_grads()  # see [Note: clipping and loss scaling wait for the gradients]
    total = _fsdp1_total_norm([p.grad for p in params.sharded if p.grad is not None],
                              [p.grad for p in params.nonsharded if p.grad is not None], params.transport, norm_type)
    clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    grads = [p.grad for p in itertools.chain(params.sharded, params.nonsharded) if p.grad is not None]
    for grad in grads:
        grad.mul_(clip_coef.to(grad.device, grad.dtype))
    if not grads:  # torch's dtype and warning
        warnings.warn(f"pydist FullyShardedDataParallel.clip_grad_norm_: no gradients on this rank; the total norm "
                      f"is returned as {total.dtype}", stacklevel=3)
        return total
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))


def install() -> None:
    """Makes torch's ``clip_grad_norm_`` (however it was imported) and
    ``torch.nn.utils.get_total_norm`` use ``total_norm``. Idempotent."""
    if _torch_clip_grad._get_total_norm is _torch_total_norm:
        _torch_clip_grad._get_total_norm = total_norm  # the name clip_grad_norm_ looks up at each call
    if torch.nn.utils.get_total_norm is _torch_total_norm:
        torch.nn.utils.get_total_norm = total_norm
