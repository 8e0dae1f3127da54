"""pydist: a readable data-parallel training runtime for PyTorch.

    from pydist import DistributedDataParallel as DDP

``pydist.init_process_group()`` joins a job under any launcher (torchrun,
mpirun, srun, SageMaker; ``pydist.rendezvous``), with an MPI backend over
mpi4py (``pydist.backends.mpi4py_backend``). The compiled runtime lives in
``pydist._C`` (built by ``pip install --no-build-isolation -e .``); the fused
flatten ops are ``pydist.ops``.
"""

from pydist.ddp import DistributedDataParallel
from pydist.fsdp import clip_grad_norm_, fully_shard  # sharded data parallelism (pydist/fsdp)
from pydist.patching import patch_torch  # for frameworks that build torch's wrappers themselves
from pydist.rendezvous import init_process_group  # imports torch.distributed, never MPI

__all__ = [
    "DistributedDataParallel",
    "init_process_group",
    "fully_shard",
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "clip_grad_norm_",
    "patch_torch",
]
__version__ = "0.1.0"


# FSDP2's policies and types are torch's own objects (fully_shard takes them
# as torch passes them; its modules are torch's FSDPModule); CPUOffloadPolicy
# is refused by fully_shard, naming it.
_TORCH_FSDP2_NAMES = ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "FSDPModule", "UnshardHandle",
                      "register_fsdp_forward_method")


def __getattr__(name):  # FSDP1's front door imports torch.distributed.fsdp: only when used
    if name in ("FullyShardedDataParallel", "ShardingStrategy", "MixedPrecision"):
        import pydist.fsdp

        return getattr(pydist.fsdp, name)
    if name in _TORCH_FSDP2_NAMES:
        import torch.distributed.fsdp

        return getattr(torch.distributed.fsdp, name)
    raise AttributeError(f"module 'pydist' has no attribute {name!r}")
