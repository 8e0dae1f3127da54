"""What every level of pydist's FSDP shares: the states and phases of a
unit (the enums), and how a module's FSDP state is found. The lowest file
of pydist/fsdp besides the per-parameter one: it imports none of the others.
"""

from __future__ import annotations

import enum

import torch.nn as nn

__all__ = ["Phase", "Materializing", "TrainingState", "ShardedState", "state_of"]


def state_of(module: nn.Module):
    """The ``_fsdp_state.FSDPState`` that ``fully_shard`` put on ``module``, or None."""
    return module.__dict__.get("_pydist_fsdp_state")


class Phase(enum.Enum):
    """Why an all-gather was issued; records name the collective by its value."""

    FORWARD = "forward"  # a unit's forward needs its parameters (its batch's, under the root's plan)
    BACKWARD = "backward"  # a unit's backward needs them
    FORWARD_PREFETCH = "forward_prefetch"  # gathered ahead of the forward that needs them
    BACKWARD_PREFETCH = "backward_prefetch"  # gathered ahead of the backward that needs them
    EXPLICIT = "explicit"  # asked for outside the hooks: FSDPModule.unshard(), a recompute's wait

    @property
    def prefetch(self) -> "Phase":
        """FORWARD's or BACKWARD's ahead-of-need phase."""
        return _PREFETCH[self]

    @property
    def in_forward(self) -> bool:
        """FORWARD or FORWARD_PREFETCH: the unit reshards at its post-forward."""
        return self in _FORWARD_PHASES

    @property
    def in_backward(self) -> bool:
        """BACKWARD or BACKWARD_PREFETCH: the unit reshards at its post-backward."""
        return self in _BACKWARD_PHASES


_PREFETCH = {Phase.FORWARD: Phase.FORWARD_PREFETCH, Phase.BACKWARD: Phase.BACKWARD_PREFETCH}
_FORWARD_PHASES = frozenset((Phase.FORWARD, Phase.FORWARD_PREFETCH))
_BACKWARD_PHASES = frozenset((Phase.BACKWARD, Phase.BACKWARD_PREFETCH))


class Materializing(enum.Enum):
    """Where a unit built on the meta device is on its way to a shard (see
    [Note: a unit built on the meta device] in _fsdp_param_group.py); None
    once it has one."""

    META = enum.auto()  # full-size (FLAT) or DTensor meta parameters on the modules, a meta shard
    FULL = enum.auto()  # to_empty gave the modules full-size parameters, which the unit adopted
    LOCAL = enum.auto()  # DTensor units: to_empty gave each rank its local chunks, which the unit adopted


class TrainingState(enum.Enum):
    """Where a unit is in an iteration."""

    IDLE = enum.auto()  # between iterations (or not yet run this one)
    FORWARD = enum.auto()  # its module's forward is running
    PRE_BACKWARD = enum.auto()  # unsharded for its backward
    POST_BACKWARD = enum.auto()  # its gradients are reduced or being reduced this backward
    SUMMONED = enum.auto()  # full parameters on the modules for summon_full_params (_unshard_params.py)


class ShardedState(enum.Enum):
    """Where a unit's parameters are: which tensors its modules hold."""

    SHARDED = enum.auto()  # the shard only; the unsharded buffer has no memory
    UNSHARDING = enum.auto()  # all-gather in flight into the unsharded buffer
    UNSHARDED = enum.auto()  # full parameters registered on the modules
    # Gathered and kept from its forward for its backward, the shards on the
    # modules meanwhile (see [Note: gather and reduce plans] in _fsdp_schedule.py)
    KEPT = enum.auto()
