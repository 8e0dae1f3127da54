"""pydist: a readable data-parallel training runtime for PyTorch.

    from pydist import DistributedDataParallel as DDP

The compiled runtime lives in ``pydist._C`` (built by ``pip install
--no-build-isolation -e .``); the fused flatten ops are ``pydist.ops``.
"""

from pydist.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
__version__ = "0.1.0"
