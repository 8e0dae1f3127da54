"""``torch.amp.GradScaler`` on pydist's shards: every rank skips or steps together.

[Note: one found_inf for every rank]
``GradScaler.unscale_`` looks for infs and NaNs in the gradients the
optimizer holds; ``step`` skips the optimizer step if it found one, and
``update`` halves the scale. On pydist's shards each rank sees only its own
slice of every gradient, so an overflow in one element is found by the rank
holding it alone: that rank skips its step and halves its scale, the others
step and keep theirs, and from then on the ranks' parameters and scales part
without an error. (torch's ``ShardedGradScaler`` all-reduces ``found_inf``
over a process group for this; ``torch.amp.GradScaler`` does not.)
Importing pydist wraps the scaler's ``_unscale_grads_`` (``install``): after
torch's own check, when the optimizer holds sharded gradients (the mark
_clip_grad.py reads), this rank's findings are summed over each of their
transports, so every rank finds what one process would find in the whole
gradient. An optimizer with no sharded gradient (a DDP job's) costs one
attribute look-up per gradient and no collective. Like torch's
``ShardedGradScaler.unscale_``, it is a collective: every rank unscales the
same optimizer, with the same parameters, in the same order.
"""

from __future__ import annotations

import torch

from pydist.fsdp import _fsdp_collectives as collectives
from pydist.ddp.overlap_optimizer import wait_all_grads
from pydist.fsdp._clip_grad import split_by_transport

__all__ = ["install"]

# torch's own, taken before ``install`` replaces it.
_torch_unscale_grads = torch.amp.GradScaler._unscale_grads_


def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
    wait_all_grads()  # see [Note: clipping and loss scaling wait for the gradients]
    per_device = _torch_unscale_grads(self, optimizer, inv_scale, found_inf, allow_fp16)
    sharded, _ = split_by_transport(p.grad for group in optimizer.param_groups for p in group["params"]
                                    if p.grad is not None)
    if not sharded:
        return per_device
    # One value per rank, even for a rank holding no gradient on some device.
    found = sum((f.float().cpu() for f in per_device.values()), torch.zeros(1))
    for transport, grads in sharded:
        found = collectives.all_reduce_sum(transport, found, grads[0].device)
    anywhere = bool(found.item() > 0)
    for f in per_device.values():
        f.fill_(1.0 if anywhere else 0.0)
    return per_device


def install() -> None:
    """Makes ``torch.amp.GradScaler`` (and its subclasses that keep its
    ``_unscale_grads_``) find infs on every rank's shards. Idempotent."""
    if torch.amp.GradScaler._unscale_grads_ is _torch_unscale_grads:
        torch.amp.GradScaler._unscale_grads_ = _unscale_grads_
