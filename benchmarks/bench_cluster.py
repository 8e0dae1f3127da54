"""pydist against torch across hosts, on an emulated cluster (needs root).

    python benchmarks/bench_cluster.py                       # 2 hosts x 2 ranks, links of 1 and 10 Gbit/s
    python benchmarks/bench_cluster.py --rates 1gbit --rounds 5 --json out.json

Each host is a network + mount + UTS namespace (pydist.cluster_emulator) whose
link is shaped by tc tbf to the rate; torchrun runs on every host. In one job,
alternating rounds: pydist DDP against torch DDP (8 x Linear(512), 8.4 MB of
gradients, SGD), then pydist.fully_shard (FULL_SHARD, each Linear a unit)
against torch FSDP2 (fully_shard, same units, Adam), then both on a 2-D
("replicate", "shard") mesh of hosts x ranks per host (HSDP: sharded inside
each host, the reduced shards all-reduced across hosts). Per round each side
times --steps steps; the table gives the medians, the median of the paired
per-round ratios (pydist / torch: below 1 is faster), and the bytes host 0
sent over its link per step (its eth0 counter, every rank of the host
together).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import pydist

    pydist.init_process_group(timeout=120)
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])

    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)

    def timed(m, opt):
        dist.barrier()
        sent = _tx_bytes()
        start = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        dist.barrier()
        seconds = (time.perf_counter() - start) / args.steps
        sent = (_tx_bytes() - sent) / args.steps
        return seconds, sent

    results = {}
    ours = pydist.DistributedDataParallel(model())
    theirs = TorchDDP(model())
    pairs = {"ddp": ((ours, torch.optim.SGD(ours.parameters(), lr=1e-3)),
                     (theirs, torch.optim.SGD(theirs.parameters(), lr=1e-3)))}
    transport = ours.allreduce_transport
    if args.plain:  # pydist DDP on the bare process group (shm_allreduce=False), beside the same torch DDP
        plain = pydist.DistributedDataParallel(model(), shm_allreduce=False)
        pairs["ddp_plain"] = ((plain, torch.optim.SGD(plain.parameters(), lr=1e-3)), pairs["ddp"][1])
    fs_ours, fs_theirs = model(), model()
    for layer in fs_ours:
        pydist.fully_shard(layer)
    pydist.fully_shard(fs_ours)
    for layer in fs_theirs:
        torch_fully_shard(layer)
    torch_fully_shard(fs_theirs)
    pairs["full_shard"] = ((fs_ours, torch.optim.Adam(fs_ours.parameters(), lr=1e-3)),
                           (fs_theirs, torch.optim.Adam(fs_theirs.parameters(), lr=1e-3)))
    from torch.distributed.device_mesh import init_device_mesh

    hosts = dist.get_world_size() // int(os.environ["LOCAL_WORLD_SIZE"])
    shape, names = (hosts, int(os.environ["LOCAL_WORLD_SIZE"])), ("replicate", "shard")
    hs_ours, hs_theirs = model(), model()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for layer in hs_ours:
        pydist.fully_shard(layer, mesh=mesh)
    pydist.fully_shard(hs_ours, mesh=mesh)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)  # torch's own groups
    for layer in hs_theirs:
        torch_fully_shard(layer, mesh=mesh)
    torch_fully_shard(hs_theirs, mesh=mesh)
    pairs["hsdp"] = ((hs_ours, torch.optim.Adam(hs_ours.parameters(), lr=1e-3)),
                     (hs_theirs, torch.optim.Adam(hs_theirs.parameters(), lr=1e-3)))
    for name, (a, b) in pairs.items():
        timed(*a)  # warm-up: buckets rebuilt, segments mapped, connections made
        timed(*b)
        rows = []
        for round_ in range(args.rounds):
            first, second = (a, b) if round_ % 2 == 0 else (b, a)  # alternate who goes first
            t1 = timed(*first)
            t2 = timed(*second)
            mine, torch_ = (t1, t2) if round_ % 2 == 0 else (t2, t1)
            rows.append({"pydist_s": mine[0], "torch_s": torch_[0], "pydist_tx": mine[1], "torch_tx": torch_[1]})
        results[name] = rows
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"results": results, "transport": transport, "local_rank": local_rank}, f)
    dist.destroy_process_group()


def run_rate(rate: str | None, args) -> dict:
    from pydist.cluster_emulator import EmulatedCluster

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
        argv = [os.path.abspath(__file__), "--worker", "--out", out, "--steps", str(args.steps), "--rounds",
                str(args.rounds), "--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch)]
        argv += ["--plain"] if args.plain else []
        with EmulatedCluster(args.hosts, args.ranks_per_host, rate=rate) as cluster:
            procs = cluster.launch_torchrun(argv, env=env, stdout=subprocess.DEVNULL if not args.verbose else None,
                                            stderr=subprocess.DEVNULL if not args.verbose else None)
            codes = cluster.wait(procs, 1800)
        if any(codes):
            raise SystemExit(f"bench_cluster: the job at {rate} failed ({codes}); rerun with --verbose")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1gbit,10gbit", help="tc rates, comma-separated ('none': unshaped)")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--plain", action="store_true",
                        help="also pydist DDP with shm_allreduce=False (the bare process group) vs torch DDP")
    parser.add_argument("--json", default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    grads_mb = args.layers * (args.width * args.width + args.width) * 4 / 1e6
    print(f"# {args.hosts} hosts x {args.ranks_per_host} ranks, {args.layers} x Linear({args.width}) "
          f"({grads_mb:.1f} MB of gradients), batch {args.batch}, {args.rounds} alternated rounds of {args.steps} steps")
    print(f"{'link':>8} {'wrapper':>11} {'transport':>13} {'pydist ms':>10} {'torch ms':>9} {'ratio':>6} "
          f"{'pydist MB/step':>15} {'torch MB/step':>14}")
    table = {}
    for rate in args.rates.split(","):
        rate = None if rate == "none" else rate
        found = run_rate(rate, args)
        for name, rows in found["results"].items():
            ratio = statistics.median(r["pydist_s"] / r["torch_s"] for r in rows)
            line = {
                "pydist_ms": 1e3 * statistics.median(r["pydist_s"] for r in rows),
                "torch_ms": 1e3 * statistics.median(r["torch_s"] for r in rows),
                "ratio": ratio,
                "pydist_mb_per_step": statistics.median(r["pydist_tx"] for r in rows) / 1e6,
                "torch_mb_per_step": statistics.median(r["torch_tx"] for r in rows) / 1e6,
                "rounds": rows,
            }
            table[f"{rate or 'unshaped'}/{name}"] = line
            transport = {"ddp": found["transport"], "ddp_plain": "process_group"}.get(name, "(root's)")
            print(f"{rate or 'unshaped':>8} {name:>11} {transport:>13} {line['pydist_ms']:10.1f} {line['torch_ms']:9.1f} "
                  f"{ratio:6.2f} {line['pydist_mb_per_step']:15.2f} {line['torch_mb_per_step']:14.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
