"""Process-group backends pydist adds to torch.distributed.

``mpi4py_backend``: an MPI backend over mpi4py for the PyPI torch, which has
none of its own. Importing this package imports neither MPI nor mpi4py.
"""
