"""pydist: a readable data-parallel training runtime for PyTorch.

    from pydist import DistributedDataParallel as DDP

The compiled runtime lives in ``pydist._C`` (built by ``pip install
--no-build-isolation -e .``); the fused flatten ops are ``pydist.ops``;
``pydist.init_process_group()`` joins a job under any launcher
(``pydist.rendezvous``), with an MPI backend over mpi4py
(``pydist.backends.mpi4py_backend``).
"""

__version__ = "0.1.0"

from .rendezvous import init_process_group  # noqa: E402, F401  (imports torch.distributed, never MPI)
