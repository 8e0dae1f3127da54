"""Data parallelism: the DistributedDataParallel wrapper and its parts
(bucket assignment, replica sync, timing records)."""

from pydist.ddp.distributed_data_parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
