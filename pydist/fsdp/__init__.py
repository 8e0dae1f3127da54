"""Sharded data parallelism (ZeRO-3) on pydist's transports.

    pydist.fully_shard(module)                       # FSDP2's front door
    pydist.FullyShardedDataParallel(module, ...)     # FSDP1's
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm (as pydist.clip_grad_norm_)
    model.state_dict()                               # sharded: ShardedTensors, for torch.distributed.checkpoint
    pydist.fsdp.full_state_dict(model)               # full tensors, unwrapped keys
    pydist.fsdp.get_optimizer_state_dict(model, opt) # the optimizer's, sharded like the parameters

One file per level, as torch's FSDP2 (torch/distributed/fsdp/_fully_shard/):
_fsdp_common.py (the states and phases, as enums; state_of),
_fsdp_param.py (one parameter), _fsdp_param_group.py (one unit),
_fsdp_schedule.py (the root's schedule: batched gathers, the unshard pool,
gather and reduce plans, runs of units),
_fsdp_collectives.py (the collectives, through pydist.transport only),
_fsdp_state.py (the hooks and the root's iteration), _fully_shard.py and
_fully_sharded_data_parallel.py (the two front doors), _state_dict.py
(sharded and full state dicts, the optimizer's, for torch.distributed.checkpoint),
_unshard_params.py (FSDP1's summon_full_params),
_clip_grad.py (clipping by the global norm, torch's clip_grad_norm_ included),
_grad_scaler.py (torch.amp.GradScaler's inf check over every rank's shards),
_utils.py (memory accounting, per-unit records).
"""

from pydist.fsdp._fsdp_param_group import FSDPParamGroup, ShardedState, TrainingState
from pydist.fsdp._fully_shard import fully_shard
from pydist.fsdp._state_dict import (
    full_optimizer_state_dict,
    full_state_dict,
    get_optimizer_state_dict,
    load_full_state_dict,
    set_optimizer_state_dict,
)
from pydist.fsdp._clip_grad import clip_grad_norm_, install as _install_global_norm
from pydist.fsdp._grad_scaler import install as _install_shared_found_inf
from pydist.fsdp._utils import last_iteration_record, persistent_bytes

# At import, before a script's own `from torch.nn.utils import get_total_norm`
# can bind torch's: see [Note: the global norm of sharded gradients]; and
# torch.amp.GradScaler's inf check over every rank's shards: see [Note: one
# found_inf for every rank] in _grad_scaler.py.
_install_global_norm()
_install_shared_found_inf()

__all__ = [
    "fully_shard",
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "MixedPrecision",
    "BackwardPrefetch",
    "CPUOffload",
    "FSDPModule",
    "UnshardHandle",
    "FSDPParamGroup",
    "TrainingState",
    "ShardedState",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "full_optimizer_state_dict",
    "persistent_bytes",
    "last_iteration_record",
]

# FSDP1's names come with torch.distributed.fsdp (seconds to import): only
# when asked for.
_FSDP1_NAMES = ("FullyShardedDataParallel", "ShardingStrategy", "MixedPrecision", "BackwardPrefetch", "CPUOffload")


# FSDP2's names are torch's own objects (see [Note: torch's FSDPModule] in _fully_shard.py).
_TORCH_FSDP2_NAMES = ("FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "MixedPrecisionPolicy",
                      "OffloadPolicy", "CPUOffloadPolicy")


def __getattr__(name):
    if name in _TORCH_FSDP2_NAMES:
        import torch.distributed.fsdp

        return getattr(torch.distributed.fsdp, name)
    if name in _FSDP1_NAMES:
        from pydist.fsdp import _fully_sharded_data_parallel

        return getattr(_fully_sharded_data_parallel, name)
    raise AttributeError(f"module 'pydist.fsdp' has no attribute {name!r}")
