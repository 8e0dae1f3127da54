"""overlap_optimizer over a real link: gloo between the hosts of an emulated
cluster (network namespaces, veth pairs shaped by ``tc tbf``;
pydist/cluster_emulator.py, needs root), no simulated link.

    python benchmarks/bench_overlap_tbf.py [--hosts 2] [--ranks-per-host 1] [--models deep]
                                           [--rates 1000,300] [--cap 0.25] [--optimizer adam]
                                           [--rounds 5] [--steps 10] [--json]

Per rate (Mbit/s) and model, three DistributedDataParallel wrappers train
the same model with the same optimizer, alternating in each round:

    plain      no overlap_optimizer: the optimizer steps after the whole
               all-reduce; gloo carries the buckets in launch order
    fifo       overlap_optimizer with the link left first in, first out
               (the "ordered" wrapper kept off: what overlap_optimizer did on
               a real link before [Note: priority on every link])
    ordered    overlap_optimizer as it is: the "ordered" wrapper in front of
               gloo, so the front layers' chunks, launched last in backward,
               overtake the back layers' chunks still waiting ([Note: ordering
               a real link] in csrc/transport/ordered_transport.cpp)

The quantity is bench_overlap.py's: ms per training iteration (zero_grad +
forward + backward + step, steady state), the slowest rank's, median over
rounds. Also printed: the leader's overtakes per iteration and how long
the next forward waited for the front layers' bucket (median over the
measured steps of rank 0's update records).

Models are bench_overlap.py's; every rank runs torch with one thread
(OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("plain", "fifo", "ordered")


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


# --- the ranks ------------------------------------------------------------------


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import pydist
    from bench_overlap import BATCH, build_model, in_features, timed_iterations
    from pydist.cluster_emulator import request_rate
    from pydist.ddp import overlap_optimizer

    pydist.init_process_group(timeout=300)
    rank = dist.get_rank()
    ordering = policy = overlap_optimizer.order_by_priority
    if args.inflight_mb is not None:  # another cap on bytes in flight than the policy's
        from pydist import transport

        def ordering(ddp):
            current = ddp.reducer.transport
            ddp.reducer.set_transport(transport.wrap("ordered", current, inflight_bytes=int(args.inflight_mb * 2**20)))
            return current

    def build(model_name, mode):
        ddp = pydist.DistributedDataParallel(build_model(model_name), bucket_cap_mb=args.cap, allreduce_chunk_mb=0)
        opt = (torch.optim.Adam(ddp.parameters(), lr=1e-4) if args.optimizer == "adam"
               else torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9))
        if mode != "plain":
            # fifo: overlap_optimizer without its "ordered" wrapper (the policy looked up at attach time)
            overlap_optimizer.order_by_priority = ordering if mode == "ordered" else (lambda ddp: None)
            try:
                ddp.overlap_optimizer(opt)
            finally:
                overlap_optimizer.order_by_priority = policy
            ddp.set_record_timing(True, keep=args.steps + 4)
        return ddp, opt

    def timed(ddp, opt, x):
        before = {}
        ms = torch.tensor([timed_iterations(ddp, opt, x, args.steps,
                                            when_warm=lambda: before.update(ddp.reducer.transport.stats()))])
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        overtakes = ddp.reducer.transport.stats().get("ordered_overtakes", 0) - before.get("ordered_overtakes", 0)
        front_waits = []
        for record in ddp.update_records()[-args.steps:]:
            front = max(record.buckets, key=lambda b: b.index, default=None)
            if front is not None:
                front_waits.append(front.forward_wait_ms)
        return {"ms": ms.item(), "overtakes": overtakes / args.steps,
                "front_wait_ms": statistics.median(front_waits) if front_waits else float("nan")}

    out: dict = {}
    for mbit in args.rates:
        if rank == 0:
            request_rate(f"{mbit:g}mbit")
        dist.barrier()
        for model_name in args.models:
            x = torch.randn(BATCH, in_features(model_name), generator=torch.Generator().manual_seed(rank))
            wrappers = {mode: build(model_name, mode) for mode in MODES}
            for r in range(args.rounds):
                order = MODES if r % 2 == 0 else MODES[::-1]
                for mode in order:
                    cell = timed(*wrappers[mode], x)
                    out.setdefault(json.dumps([model_name, mbit, mode]), []).append(cell)
            for mode in MODES:
                out[json.dumps([model_name, mbit, mode, "transport"])] = wrappers[mode][0].reducer.transport.name
            del wrappers
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


# --- the driver -----------------------------------------------------------------


def run(args) -> dict:
    from pydist.cluster_emulator import EmulatedCluster, why_unavailable

    why = why_unavailable()
    if why:
        raise SystemExit(f"bench_overlap_tbf: no emulated cluster here: {why}")
    base = tempfile.mkdtemp(prefix="bench_overlap_tbf_")
    out_path = os.path.join(base, "cells.json")
    argv = [os.path.abspath(__file__), "--worker", "--out", out_path, "--models", ",".join(args.models),
            "--rates", ",".join(f"{r:g}" for r in args.rates), "--cap", f"{args.cap:g}", "--optimizer", args.optimizer,
            "--rounds", str(args.rounds), "--steps", str(args.steps)]
    if args.inflight_mb is not None:
        argv += ["--inflight-mb", f"{args.inflight_mb:g}"]
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    with open(os.path.join(base, "log"), "w") as log:
        with EmulatedCluster(args.hosts, args.ranks_per_host, rate=f"{max(args.rates):g}mbit") as cluster:
            procs = cluster.launch_torchrun(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            codes = cluster.wait(procs, args.timeout)  # carrying out rank 0's rate requests
    if any(codes):
        with open(os.path.join(base, "log")) as f:
            raise SystemExit(f"bench_overlap_tbf: the job failed ({codes}):\n{f.read()[-4000:]}")
    with open(out_path) as f:
        raw = json.load(f)
    cells = []
    for model_name in args.models:
        for mbit in args.rates:
            row = {"model": model_name, "rate_mbit": mbit}
            for mode in MODES:
                runs = raw[json.dumps([model_name, mbit, mode])]
                row[f"{mode}_ms"] = statistics.median(c["ms"] for c in runs)
                row[f"{mode}_overtakes"] = statistics.median(c["overtakes"] for c in runs)
                row[f"{mode}_front_wait_ms"] = statistics.median(c["front_wait_ms"] for c in runs)
                row[f"{mode}_transport"] = raw[json.dumps([model_name, mbit, mode, "transport"])]
            row["ordered_vs_fifo"] = row["ordered_ms"] / row["fifo_ms"]
            row["ordered_vs_plain"] = row["ordered_ms"] / row["plain_ms"]
            cells.append(row)
    return {"hosts": args.hosts, "ranks_per_host": args.ranks_per_host, "cap_mb": args.cap,
            "optimizer": args.optimizer, "rounds": args.rounds, "steps": args.steps, "cells": cells}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--models", type=lambda s: s.split(","), default=["deep"])
    parser.add_argument("--rates", type=_floats, default=[1000.0, 300.0], help="tbf rates, Mbit/s")
    parser.add_argument("--cap", type=float, default=0.25, help="bucket cap, MB")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--inflight-mb", type=float, default=None,
                        help="the ordered wrapper's cap on bytes in flight (default: overlap_optimizer's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    started = time.perf_counter()
    result = run(args)
    result["seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.hosts} hosts x {args.ranks_per_host} ranks, gloo over veth shaped by tc tbf (no simulated link), "
          f"{args.optimizer}, cap {args.cap:g} MB; ms per training iteration (slowest rank, median of "
          f"{args.rounds} rounds x {args.steps} steps); front wait: the next forward's wait for the front bucket")
    print(f"{'model':<6} {'Mbit/s':>7} {'plain':>8} {'fifo':>8} {'ordered':>8} {'ord/fifo':>8} {'ord/plain':>9} "
          f"{'overtakes':>9} {'front wait fifo/ordered':>24}")
    for c in result["cells"]:
        print(f"{c['model']:<6} {c['rate_mbit']:>7g} {c['plain_ms']:>8.2f} {c['fifo_ms']:>8.2f} {c['ordered_ms']:>8.2f} "
              f"{c['ordered_vs_fifo']:>8.3f} {c['ordered_vs_plain']:>9.3f} {c['ordered_overtakes']:>9.1f} "
              f"{c['fifo_front_wait_ms']:>11.2f} / {c['ordered_front_wait_ms']:<10.2f}")
    print(f"transports: {result['cells'][0]['fifo_transport']} (fifo), {result['cells'][0]['ordered_transport']} "
          f"(ordered); ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
