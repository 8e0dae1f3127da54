"""Run by tests/test_mpi_launch.py under mpiexec -n 2: join with pydist on
the backend given (``again``: destroy the group and join a second time), then print (rank 0) the torchrun variables each rank sees
and the address the rendezvous store listens on (issue 17 item 16, issue 18
item 3)."""

import json
import os
import sys

import torch
import torch.distributed as dist

import pydist


def listening_addresses(port: int) -> list[str]:
    """Local addresses in LISTEN state on ``port``, from /proc/net/tcp{,6}."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if int(p, 16) == port and state == "0A":
                    found.append(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(addr) == 8
                                 else addr)
    return found


result = pydist.init_process_group(backend=sys.argv[1], timeout=60)
if "again" in sys.argv[2:]:  # destroy and join again: the variables pydist set are its own to update
    first_port = os.environ["MASTER_PORT"]
    dist.destroy_process_group()
    result = pydist.init_process_group(backend=sys.argv[1], timeout=60)
    assert result.launcher != "torchrun", result
env = {k: os.environ.get(k) for k in pydist.rendezvous.TORCHRUN_VARIABLES}
report = dict(result._asdict(), env=env)
if result.rank == 0:
    report["listening"] = listening_addresses(int(env["MASTER_PORT"]))
reports = [None] * result.world_size
dist.all_gather_object(reports, report)
t = torch.ones(2)
dist.all_reduce(t)
if result.rank == 0:
    print(json.dumps(dict(reports=reports, total=t.tolist())), flush=True)
dist.destroy_process_group()
