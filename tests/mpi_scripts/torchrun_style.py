"""A torchrun-style training script, run unchanged by tests/test_mpi_launch.py
under torchrun and under ``mpiexec -n 2 python -m pydist.run``: it reads the
torchrun variables before any init (as nanoGPT does), joins through torch's
own env:// rendezvous, trains stock torch DDP a few steps, and writes its
losses and final parameters to OUT_DIR/rank<R>.pt.

    python torchrun_style.py OUT_DIR
"""

import os
import sys

import torch
import torch.distributed as dist

ddp = "RANK" in os.environ  # decided before any init
assert ddp, "not started as a distributed job"
rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
world_size, local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
assert __name__ == "__main__"
dist.init_process_group("gloo")
assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)

torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1000 + rank)
losses = []
for step in range(5):
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.detach())
torch.save(dict(argv=sys.argv[1:], env=(rank, local_rank, world_size, local_world_size), losses=torch.stack(losses),
                params=[p.detach() for p in model.parameters()]), os.path.join(sys.argv[1], f"rank{rank}.pt"))
dist.destroy_process_group()
