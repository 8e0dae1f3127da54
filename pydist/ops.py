"""Fused flatten / unflatten: one flat buffer from many tensors and back.

These are the copies gradient buckets and parameter shards are made of. The
kernels are ``torch.ops.pydist.*`` (schemas in csrc/module.cpp); this module
adds the Python conveniences and the fake-tensor rules, and keeps the
obviously-correct reference (``reference_*``) that the tests compare against.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pydist import _C  # noqa: F401  (loads the library that registers torch.ops.pydist)

__all__ = ["flatten", "unflatten", "unflatten_into"]


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """Copy ``tensors`` (one dtype, one device) into one 1-D tensor, in order.

    With ``out`` (a preallocated bucket: the case that matters) the copy lands
    there and ``out`` is returned; with ``scale``, each element is multiplied
    on the way. Bitwise equal to ``torch._utils._flatten_dense_tensors``.

    Without ``out`` the result is differentiable (its backward hands each
    input its segment of the gradient, as ``torch.cat``'s does). With ``out``
    it is an in-place copy outside autograd: a tensor that requires grad is
    an error unless grad mode is off (``torch.no_grad()``), and ``out``'s
    version counter is bumped. An input that shares memory with ``out`` is
    an error, unless it is exactly its own segment of ``out``.
    """
    tensors = list(tensors)
    if out is None and scale != 1.0 and tensors:
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            # flatten_into is not differentiable; flatten then mul_ is, and
            # rounds the same (see csrc/ops/scaled_copy.h).
            return torch.ops.pydist.flatten(tensors).mul_(scale)
        out = tensors[0].new_empty(sum(t.numel() for t in tensors))
    if out is not None:
        torch.ops.pydist.flatten_into(tensors, out, float(scale))
        return out
    if not tensors:
        return torch.empty(0)
    return torch.ops.pydist.flatten(tensors)


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (no copy)."""
    total = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() != total:
        raise RuntimeError(
            f"unflatten: `flat` has shape {tuple(flat.shape)} but the tensors hold {total} elements"
        )
    views, offset = [], 0
    for t in tensors:
        views.append(flat.narrow(0, offset, t.numel()).view_as(t))
        offset += t.numel()
    return views


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Copy consecutive segments of ``flat`` back into ``tensors``, times ``scale``.

    An in-place copy outside autograd, as ``flatten(out=)``: tensors that
    require grad need ``torch.no_grad()``; every target's version counter is
    bumped. Targets must not share memory with each other, nor with ``flat``
    except as exactly their own segment of it.
    """
    torch.ops.pydist.unflatten_into(flat, list(tensors), float(scale))


# --- the oracle the tests compare against ------------------------------------


def reference_flatten(tensors: Sequence[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
    return flat.mul_(scale) if scale != 1.0 else flat


def reference_unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        if scale != 1.0:
            t.mul_(scale)
        offset += t.numel()


# --- fake-tensor rules, so the ops trace under torch.compile / opcheck ------
# Argument checks run before these on the meta device (csrc/ops/flatten.cpp,
# [Note: the layers of a flatten op]).


@torch.library.register_fake("pydist::flatten")
def _flatten_fake(tensors):
    return tensors[0].new_empty(sum(t.numel() for t in tensors))


@torch.library.register_fake("pydist::flatten_into")
def _flatten_into_fake(tensors, out, scale=1.0):
    return None


@torch.library.register_fake("pydist::unflatten_into")
def _unflatten_into_fake(flat, tensors, scale=1.0):
    return None
