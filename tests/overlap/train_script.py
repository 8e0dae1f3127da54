"""A training script that knows nothing of the overlap lab: the tests run it
unchanged under mpiexec with PYDIST_TRACE (and friends) in the environment.

    mpiexec -n 2 python tests/overlap/train_script.py {destroy|exit|raise} STEPS

destroy: ends with dist.destroy_process_group(); exit: just ends; raise:
rank 1 raises after training (an uncaught exception under mpiexec) while
rank 0 waits for it in a barrier, until the abort ends the job.
"""

import sys

import torch
import torch.distributed as dist


def train(rank: int, steps: int):
    from pydist import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1, allreduce_chunk_mb=0.04)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(16, 128, generator=gen)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


def spawned(rank, world_size, steps):
    """The same training under pydist.spawn.run_ranks."""
    return train(rank, steps)


if __name__ == "__main__":
    import pydist

    mode, steps = sys.argv[1], int(sys.argv[2])
    pydist.init_process_group(backend="gloo", timeout=60)
    train(dist.get_rank(), steps)
    if mode == "raise":
        if dist.get_rank() == 1:
            raise RuntimeError("the training script failed after its last step")
        dist.barrier()
    if mode == "destroy":
        dist.destroy_process_group()
