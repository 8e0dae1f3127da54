"""Run by tests/test_mpi_launch.py under mpiexec -n 2: rank 1 is a straggler
(it sleeps past the group's timeout) while rank 0 communicates.

    python straggler.py MODE TIMEOUT_S

MODE:
  torch_ddp       torch's DDP on backend="mpi": the reducer waits on the
                  work's future (issue 17 item 6)
  pydist_hook     pydist's DDP with a comm hook on backend="mpi" (item 6)
  catch_and_exit  rank 0 catches the timeout and exits normally: MPI must be
                  aborted at exit, not finalized (item 11)
  uncaught        rank 1 raises at once instead; rank 0 waits in a collective
                  (item 8: the job must end within seconds)
"""

import os
import sys
import time

# What a rank writes just before MPI_Abort can be lost on its way through the
# launcher (mpiexec kills the job at the abort), so with STRAGGLER_LOG set each
# rank's stdout and stderr go straight to a file of its own the test reads.
if os.environ.get("STRAGGLER_LOG"):
    _log = os.open(f"{os.environ['STRAGGLER_LOG']}.rank{os.environ.get('PMI_RANK', 'x')}",
                   os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(_log, 1)
    os.dup2(_log, 2)

import torch
import torch.distributed as dist

import pydist

mode, timeout_s = sys.argv[1], float(sys.argv[2])
result = pydist.init_process_group(backend="gloo" if mode == "uncaught" else "mpi", timeout=timeout_s)
rank = result.rank
if mode == "uncaught" and rank == 1:
    raise ValueError("rank 1 fails on purpose")
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
if mode == "torch_ddp":
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
elif mode == "pydist_hook":
    wrapped = pydist.DistributedDataParallel(model)

    def allreduce_hook(state, bucket):
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    wrapped.register_comm_hook(None, allreduce_hook)
if rank == 1:  # the straggler, once the wrappers are built; the abort of rank 0 ends it
    time.sleep(timeout_s * 6)
    sys.exit(0)
start = time.monotonic()
if mode in ("torch_ddp", "pydist_hook"):
    print(f"[rank 0] training", flush=True)
    wrapped(torch.ones(2, 8)).sum().backward()  # raises once the group's timeout passes
elif mode == "catch_and_exit":
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        print(f"[rank 0] caught after {time.monotonic() - start:.1f} s: {exc}", flush=True)
    sys.exit(0)
else:
    dist.all_reduce(torch.ones(4))
print("[rank 0] the collective returned, which it must not", flush=True)
