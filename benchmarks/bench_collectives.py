"""Collective bandwidth, nccl-tests style: gloo vs pydist's MPI backend (and
nccl where CUDA is present), same ranks, same run, and pydist's
shared-memory transport (backend "shm", what DDP all-reduces its buckets
with when every rank shares the host: csrc/transport/shm_transport.h).
Every backend is driven through the pydist.transport object DDP's reducer
would use (ProcessGroupTransport, ShmTransport); broadcast, which
transports do not carry, goes to the process group.

    mpiexec -n 2 python benchmarks/bench_collectives.py [--json out.json]
    python benchmarks/bench_collectives.py          # re-launches itself under mpiexec -n 2

One table per collective and backend, one row per size (bytes of the whole
buffer, as nccl-tests counts them), then the MPI/gloo busbw ratio per size:

    size(B)  count  type  time(us)  algbw(GB/s)  busbw(GB/s)  #wrong

time is the slowest rank's mean over the timed iterations; algbw = size/time;
busbw = algbw * 2(n-1)/n for all_reduce, (n-1)/n for all_gather and
reduce_scatter, 1 for broadcast. Every buffer holds small integers, so the
exact result is known and #wrong counts the elements that differ from it
(checked once per size after timing, on freshly filled buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pydist  # noqa: E402
from pydist.rendezvous import detect  # noqa: E402

COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}
PATTERN = 13  # element i of rank r holds (i % PATTERN) + r + 1


@dataclass
class Row:
    collective: str
    backend: str
    size: int  # bytes of the whole buffer (nccl-tests' convention)
    count: int  # elements of the whole buffer
    dtype: str
    time_us: float
    algbw: float  # GB/s
    busbw: float  # GB/s
    wrong: int


def _fill(n, rank, device):
    return (torch.arange(n, device=device) % PATTERN + rank + 1).to(torch.float32)


class Case:
    """Buffers of one collective at one size, the op, and its exact answer."""

    def __init__(self, collective, count, rank, ws, device, transport, group):
        self.collective, self.rank, self.ws, self.transport, self.group = collective, rank, ws, transport, group
        self.count, self.device = count, device
        per_rank = count // ws
        if collective in ("all_reduce", "broadcast"):
            self.buf = _fill(count, rank, device)
        elif collective == "all_gather":
            self.inp, self.buf = _fill(per_rank, rank, device), torch.empty(count, device=device)
        else:  # reduce_scatter
            self.inp, self.buf = _fill(count, rank, device), torch.empty(per_rank, device=device)

    def refill(self):
        if self.collective in ("all_reduce", "broadcast"):
            self.buf.copy_(_fill(self.count, self.rank, self.device))

    def run(self):
        t, g = self.transport, self.group
        if self.collective == "all_reduce":
            t.all_reduce(self.buf).wait()
        elif self.collective == "broadcast":
            dist.broadcast(self.buf, src=dist.get_global_rank(g, 0) if g is not None else 0, group=g)
        elif self.collective == "all_gather":
            t.all_gather(self.inp, self.buf).wait()
        else:
            t.reduce_scatter(self.inp, self.buf).wait()

    def expected(self):
        ws, n = self.ws, self.count
        base = (torch.arange(n, device=self.device) % PATTERN).to(torch.float32)
        if self.collective == "all_reduce":
            return base * ws + ws * (ws + 1) / 2
        if self.collective == "broadcast":
            return base + 1  # root is rank 0
        per_rank = n // ws
        if self.collective == "all_gather":
            piece = torch.arange(n, device=self.device) // per_rank  # source rank of each element
            return (torch.arange(n, device=self.device) % per_rank % PATTERN).to(torch.float32) + piece + 1
        mine = base[self.rank * per_rank:(self.rank + 1) * per_rank]
        return mine * ws + ws * (ws + 1) / 2

    def wrong(self):
        self.refill()
        self.run()
        return int((self.buf != self.expected()).sum().item())


def iterations(nbytes):
    return max(3, min(100, (64 << 20) // max(nbytes, 1)))


def measure(collective, backend, transport, group, nbytes, rank, ws, device, comm):
    count = max(ws, nbytes // 4) // ws * ws
    case = Case(collective, count, rank, ws, device, transport, group)
    iters = iterations(nbytes)
    for _ in range(3):  # warm-up: the first calls on a fresh buffer can be several times slower
        case.run()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        case.run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / iters
    elapsed = comm.allreduce(elapsed, op=_mpi_max())  # the slowest rank sets the time
    wrong = comm.allreduce(case.wrong())
    size = count * 4
    algbw = size / elapsed / 1e9
    return Row(collective, backend, size, count, "float", elapsed * 1e6, algbw, algbw * BUS_FACTOR[collective](ws), wrong)


def _mpi_max():
    from mpi4py import MPI

    return MPI.MAX


def print_table(rows, collective, backend, ws):
    print(f"\n# {collective} on {backend}, {ws} ranks")
    print(f"{'size(B)':>12} {'count':>11} {'type':>6} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}")
    for r in rows:
        print(f"{r.size:>12} {r.count:>11} {r.dtype:>6} {r.time_us:>11.1f} {r.algbw:>12.3f} {r.busbw:>12.3f} {r.wrong:>7}")


def print_ratios(rows, collective, over, base):
    mine = {r.size: r for r in rows if r.collective == collective and r.backend == over}
    ref = {r.size: r for r in rows if r.collective == collective and r.backend == base}
    print(f"\n# {collective}: busbw {over} / {base}")
    print(f"{'size(B)':>12} {over + '(GB/s)':>14} {base + '(GB/s)':>13} {'ratio':>7}")
    for size in sorted(mine):
        if size in ref:
            print(f"{size:>12} {mine[size].busbw:>14.3f} {ref[size].busbw:>13.3f} {mine[size].busbw / ref[size].busbw:>7.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minbytes", type=int, default=8)
    parser.add_argument("--maxbytes", type=int, default=256 << 20)
    parser.add_argument("--factor", type=int, default=2, help="size multiplier between rows")
    parser.add_argument("--collectives", nargs="+", default=COLLECTIVES, choices=COLLECTIVES)
    parser.add_argument("--backends", nargs="+", default=None, help="default: gloo shm mpi4py (+ nccl with CUDA)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks to launch when not already under mpiexec")
    parser.add_argument("--json", metavar="PATH", help="also write every row as JSON ('-' for stdout)")
    args = parser.parse_args()

    info = detect(required=False)
    if info is None or not info.uses_mpi:  # re-launch under mpiexec: the MPI backend needs MPI ranks
        mpiexec = shutil.which("mpiexec") or sys.exit("bench_collectives: needs mpiexec (pip install mpich)")
        os.execv(mpiexec, [mpiexec, "-n", str(args.ranks), sys.executable, os.path.abspath(__file__), *sys.argv[1:]])

    from mpi4py import MPI

    torch.set_num_threads(1)  # one core per rank on the 2-core CI machine
    world = pydist.init_process_group(backend="mpi", timeout=600)
    rank, ws = world.rank, world.world_size
    comm = MPI.COMM_WORLD
    backends = args.backends or (["gloo", "shm", "mpi4py"] + (["nccl"] if torch.cuda.is_available() else []))
    from pydist import transport

    groups = {b: (dist.group.WORLD if b == "mpi4py" else dist.new_group(backend=b)) for b in backends if b != "shm"}
    transports = {b: transport.ProcessGroupTransport(g) for b, g in groups.items()}
    if "shm" in backends:
        transports["shm"] = transport.open_shm(dist.group.WORLD)
        groups["shm"] = None
    devices = {b: torch.device("cuda", torch.cuda.current_device()) if b == "nccl" else torch.device("cpu")
               for b in backends}
    sizes = []
    size = args.minbytes
    while size <= args.maxbytes:
        sizes.append(size)
        size *= args.factor

    rows = []
    for collective in args.collectives:
        for backend in backends:
            if groups[backend] is None and collective == "broadcast":
                continue  # a transport without a group does not broadcast
            mine = [measure(collective, backend, transports[backend], groups[backend], s, rank, ws, devices[backend],
                            comm) for s in sizes]
            rows += mine
            if rank == 0:
                print_table(mine, collective, backend, ws)
                sys.stdout.flush()
    if rank == 0:
        if "gloo" in backends and "shm" in backends:
            for collective in args.collectives:
                if collective != "broadcast":
                    print_ratios(rows, collective, "shm", "gloo")
        if "gloo" in backends and "mpi4py" in backends:
            for collective in args.collectives:
                print_ratios(rows, collective, "mpi4py", "gloo")
            ratios = [(r.size, m.busbw / r.busbw) for r in rows if r.collective == "all_reduce" and r.backend == "gloo"
                      for m in rows if m.collective == "all_reduce" and m.backend == "mpi4py" and m.size == r.size
                      and r.size >= 1 << 20]
            if ratios:
                worst = min(ratios, key=lambda x: x[1])
                verdict = "met" if worst[1] >= 3 else "NOT met"
                print(f"\ntarget all_reduce busbw mpi4py >= 3x gloo from 1 MiB: {verdict} "
                      f"(lowest ratio {worst[1]:.2f} at {worst[0]} B)")
        total_wrong = sum(r.wrong for r in rows)
        print(f"\n# total #wrong: {total_wrong}")
        if args.json:
            text = json.dumps([asdict(r) for r in rows], indent=1)
            if args.json == "-":
                print(text)
            else:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
    dist.destroy_process_group()
    if rank == 0 and sum(r.wrong for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
