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
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as _torch_clip_grad

from pydist.ddp.overlap_optimizer import wait_all_grads
from pydist.fsdp import _fsdp_collectives as collectives

__all__ = ["clip_grad_norm_", "total_norm", "mark_shard_grads", "split_by_transport", "install"]

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
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return total


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


def install() -> None:
    """Makes torch's ``clip_grad_norm_`` (however it was imported) and
    ``torch.nn.utils.get_total_norm`` use ``total_norm``. Idempotent."""
    if _torch_clip_grad._get_total_norm is _torch_total_norm:
        _torch_clip_grad._get_total_norm = total_norm  # the name clip_grad_norm_ looks up at each call
    if torch.nn.utils.get_total_norm is _torch_total_norm:
        torch.nn.utils.get_total_norm = total_norm
