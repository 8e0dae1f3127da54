"""What needs the global view of sharded parameters: memory accounting,
per-unit records (gradient clipping is in _clip_grad.py, state dicts in
_state_dict.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from pydist.fsdp._fsdp_common import state_of

__all__ = ["persistent_bytes", "PersistentBytes", "last_iteration_record", "IterationRecord"]


def _root_state(module: nn.Module):
    """``module``'s FSDPState, its root's lazy init run."""
    state = state_of(module)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not fully_shard'ed; pass the root module")
    if state.root is None:
        state._lazy_init()  # collective: opens the transport, as a first forward would
    return state


def _units(module: nn.Module):
    return [s.param_group for m in module.modules() if (s := state_of(m)) is not None and s.param_group is not None]


class PersistentBytes(NamedTuple):
    """Bytes one rank holds between iterations, each storage counted once."""

    params: int  # the units' shard buffers (padding included) and unmanaged parameters
    grads: int  # the storages the parameters' .grad live in
    optimizer: int  # the optimizer's state tensors (0 without one)
    pools: int = 0  # the root's unshard pool (see [Note: the unsharded buffer's memory])

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.pools


class IterationRecord(NamedTuple):
    """The collectives of the last iteration of a root, per unit."""

    collectives: list  # CollectiveRecord, by unit in module order, each unit's in the order waited
    backward_end_ns: int  # autograd finished (the root's final callback began); -1 without backward

    def exposed_ns(self) -> int:
        """How long the compute thread waited for collectives: the union of
        the records' [needed, completed] spans. The members of one batched
        collective each record its one wait, so a sum would count it once
        per member."""
        spans = sorted((r.needed_ns, r.completed_ns) for r in self.collectives if r.completed_ns > r.needed_ns)
        total, reached = 0, None
        for start, end in spans:
            if reached is not None and end <= reached:
                continue
            total += end - (start if reached is None else max(start, reached))
            reached = end
        return total


def last_iteration_record(module: nn.Module) -> IterationRecord:
    """What ``module``'s units recorded in the root's last iteration (none
    before its first forward). Local: it starts no collective, so any rank
    may call it alone, e.g. from logging."""
    state = state_of(module)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not fully_shard'ed; pass the root module")
    if state.root is None:
        return IterationRecord([], -1)
    return IterationRecord([r for pg in _units(module) for r in pg.records], state.root.backward_end_ns)


def persistent_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> PersistentBytes:
    """What ``module`` (and ``optimizer``) keep on this rank between
    iterations: the sum of the distinct storages behind its parameters,
    their gradients and the optimizer's state, and the unshard pool of the
    units' root. The unsharded buffers hold no memory of their own then
    (see [Note: the unsharded buffer's memory])."""
    seen: set[int] = set()

    def storage_bytes(tensors) -> int:
        total = 0
        for t in tensors:
            t = getattr(t, "_local_tensor", t)  # a DTensor's bytes are its local tensor's
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    params = list(module.parameters())
    opt_state = []
    if optimizer is not None:
        for state in optimizer.state.values():
            opt_state.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    pools = {id(pg.pool): pg.pool for pg in _units(module) if pg.pool is not None}
    return PersistentBytes(storage_bytes(params), storage_bytes(p.grad for p in params), storage_bytes(opt_state),
                           sum(pool.nbytes for pool in pools.values()))
