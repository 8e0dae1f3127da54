"""One rank of a fault-matrix job (see fault_matrix.py); not a test module.

    python fault_worker.py SCENARIO WRAPPER TIMEOUT_S [WHERE]

Every rank joins with ``pydist.init_process_group(backend="gloo")``, wraps a
small MLP in WRAPPER and trains; at step FAULT_STEP rank FAULT_RANK does
SCENARIO, WHERE: ``step`` (between steps, the default), ``forward``
(inside the second Linear's forward: under a sharded wrapper the others are
then waiting in a gather of that forward's plan, collectives in flight) or
``backward`` (in the first Linear's backward, after the second's gradients
went out).
Lines on stdout, for the driver:
  PID <rank> <pid>             at start (to find this job's /dev/shm segments)
  FAULT <unix time>            on the faulting rank, just before the fault
  SURVIVOR <rank> <message>    on a rank that saw an error, before re-raising
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import pydist

FAULT_RANK, FAULT_STEP, STEPS = 1, 5, 40

scenario, wrapper, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
where = sys.argv[4] if len(sys.argv) > 4 else "step"
result = pydist.init_process_group(backend="gloo", timeout=timeout_s)
rank = result.rank
print(f"PID {rank} {os.getpid()}", flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))  # 0.5M params
if wrapper == "torch":
    model = torch.nn.parallel.DistributedDataParallel(model)
elif wrapper == "torch-fsdp":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (result.world_size,))  # FSDP2 takes the GPU where one is visible
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
elif wrapper.startswith("pydist-fsdp"):
    for layer in (model[0], model[2]):
        pydist.fully_shard(layer, shm=(wrapper == "pydist-fsdp-shm"))
    pydist.fully_shard(model, shm=(wrapper == "pydist-fsdp-shm"))
else:
    model = pydist.DistributedDataParallel(model, shm_allreduce=(wrapper == "pydist-shm"))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0


def fault():
    print(f"FAULT {time.time():.3f}", flush=True)
    if scenario == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    elif scenario in ("exception", "caught"):
        raise RuntimeError(f"rank {rank} fails on purpose")
    elif scenario == "straggler":
        time.sleep(timeout_s * 10)
    elif scenario == "early_exit":
        sys.exit(0)



def fault_in_forward(module, args):
    if rank == FAULT_RANK and step == FAULT_STEP:
        fault()


def fault_in_backward(module, grad_output):
    if rank == FAULT_RANK and step == FAULT_STEP:
        fault()


if where in ("forward", "backward"):
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if where == "forward":
        layers[1].register_forward_pre_hook(fault_in_forward)
    else:
        layers[0].register_full_backward_pre_hook(fault_in_backward)


def train_step():
    if rank == FAULT_RANK and step == FAULT_STEP and where == "step":
        fault()
    x = torch.randn(32, 256)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


try:
    for step in range(STEPS):
        try:
            train_step()
        except RuntimeError:
            # ``caught``: the faulting rank drops the batch and trains on, as
            # a loop that skips a bad batch does; the others never faulted.
            if not (scenario == "caught" and rank == FAULT_RANK and step == FAULT_STEP):
                raise
            print(f"CAUGHT {rank}", flush=True)
        time.sleep(0.02)
except BaseException as exc:
    if rank != FAULT_RANK and not isinstance(exc, SystemExit):
        text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        print(f"SURVIVOR {rank} {text[:600]}", flush=True)
    raise
dist.destroy_process_group()
