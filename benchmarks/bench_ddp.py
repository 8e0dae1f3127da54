"""pydist DDP beside torch DDP: step time on 2 CPU ranks over gloo.

    python benchmarks/bench_ddp.py [--rounds 7] [--steps 5] [--json] [--chunk-ab] [--set-to-none] [--records] [--cpu]

For each model, in one run and interleaved round by round (these machines
swing 2x between runs, so only ratios within a run mean anything):

    torch      torch.nn.parallel.DistributedDataParallel step
    pydist     pydist.DistributedDataParallel step (its default: buckets
               all-reduced through shared memory, the ranks sharing this host)
    pydist_pg  the same with shm_allreduce=False: buckets all-reduced on the
               gloo process group, as torch's are
    compute    the same step under no_sync (no communication at all)
    allreduce  one flat gloo all-reduce of all the model's gradients

See [Note: which transport] in csrc/reducer/reducer.h.

--chunk-ab adds pydist with 1 MB all-reduce chunks and with whole buckets
(allreduce_chunk_mb=0) beside the default 4 MB chunks (see [Note: chunked
launches] in csrc/reducer/reducer.h).

--cpu splits each mode's step into CPU time of the autograd thread, CPU
time of the rank's other threads (gloo's) and idle time (wall minus both:
none of the rank's threads running, blocked or waiting for a core). With 2
ranks on 2 cores, communication that overlap hides must show up as less
idle; CPU work can only move, not vanish. It also gives each thread class's
time in the kernel (gloo's loopback TCP copies are mostly that), the
autograd thread's minor page faults (fresh memory the allocator had given
back) and the rank's context switches.

Beside pydist / torch (the ratio of the two medians) the table gives
"paired": the median over rounds of pydist / torch within a round, where the
two ran back to back, so a stretch of slow machine weighs on both.
pydist/compute is the DDP step against the same step under no_sync (the
project's goal: within 1.05x), again as the ratio of medians and paired.

--records prints, for each model, the reducer's per-bucket record of one
backward on each rank, with whole-bucket and with 4 MB chunked launches:
where the time goes, when each bucket's communication really completed, how
much is exposed after autograd ends, and how far the ranks drift apart (a
collective completes only once the slower rank has launched it).

A step is zero_grad + forward + backward (the optimizer step is the same
for both wrappers and left out). zero_grad keeps the grads
(set_to_none=False), so pydist's gradients live in their buckets (see
[Note: resident gradients] in csrc/reducer/reducer.h); --set-to-none drops
them every step instead (torch's default zero_grad), where pydist copies
each gradient in and out as torch does. Medians over rounds; "exposed" is a DDP
step minus compute: the communication (and overhead) it failed to hide.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from pydist.spawn import run_ranks  # noqa: E402

MODELS = {
    "8x Linear(1024,1024)+ReLU": lambda: nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())]),
    "400x (Linear(64,64)+LayerNorm(64))": lambda: nn.Sequential(
        *[m for _ in range(400) for m in (nn.Linear(64, 64), nn.LayerNorm(64))]
    ),
}
IN_FEATURES = {"8x Linear(1024,1024)+ReLU": 1024, "400x (Linear(64,64)+LayerNorm(64))": 64}
BATCH = 64


# What _time_steps measures per step, in this order; the *_ms fields in seconds
# until the parent turns them into ms.
FIELDS = ("wall_ms", "cpu_autograd_ms", "cpu_other_ms", "cpu_autograd_sys_ms", "cpu_other_sys_ms", "autograd_faults", "switches")


def _usage() -> tuple[float, ...]:
    """Wall clock, then CPU (user+sys), sys and minor page faults of this
    (the autograd) thread and of the whole process, and the process's context
    switches. getrusage splits user from sys at the kernel's tick
    resolution but keeps their sum exact."""
    me = resource.getrusage(resource.RUSAGE_THREAD)
    proc = resource.getrusage(resource.RUSAGE_SELF)
    return (
        time.perf_counter(),
        me.ru_utime + me.ru_stime,
        proc.ru_utime + proc.ru_stime,
        me.ru_stime,
        proc.ru_stime,
        me.ru_minflt,
        proc.ru_nvcsw + proc.ru_nivcsw,
    )


def _time_steps(step, steps: int) -> tuple[float, ...]:
    """Per step, FIELDS: wall time; CPU time of this (the autograd) thread
    and of every other thread of the rank (gloo's, for DDP modes); the sys
    part of each; the autograd thread's minor page faults; the rank's
    context switches."""
    dist.barrier()
    before = _usage()
    for _ in range(steps):
        step()
    wall, me, proc, me_sys, proc_sys, faults, switches = (b - a for a, b in zip(before, _usage()))
    return tuple(v / steps for v in (wall, me, proc - me, me_sys, proc_sys - me_sys, faults, switches))


def _rank_main(rank, world_size, model_name, rounds, steps, chunk_ab, set_to_none):
    import pydist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch.manual_seed(0)
    wrapped = {
        "torch": TorchDDP(MODELS[model_name]()),
        "pydist": pydist.DistributedDataParallel(MODELS[model_name](), shm_allreduce=True),
        "pydist_pg": pydist.DistributedDataParallel(MODELS[model_name](), shm_allreduce=False),
    }
    if chunk_ab:
        wrapped["pydist_1mb"] = pydist.DistributedDataParallel(MODELS[model_name](), allreduce_chunk_mb=1)
        wrapped["pydist_whole"] = pydist.DistributedDataParallel(MODELS[model_name](), allreduce_chunk_mb=0)
    x = torch.randn(BATCH, IN_FEATURES[model_name], generator=torch.Generator().manual_seed(rank))

    def ddp_step(model):
        model.zero_grad(set_to_none=set_to_none)
        model(x).sum().backward()

    def compute_step():
        model = wrapped["pydist"]
        with model.no_sync():
            ddp_step(model)

    grads = torch.zeros(sum(p.numel() for p in wrapped["torch"].parameters()))
    modes = {name: (lambda m=model: ddp_step(m)) for name, model in wrapped.items()}
    modes["compute"] = compute_step
    modes["allreduce"] = lambda: dist.all_reduce(grads)
    for step in modes.values():  # warm up; buckets get rebuilt here
        for _ in range(3):
            step()
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, step in modes.items():
            times[name].append(_time_steps(step, steps))
    return times


def _summarize(name: str, per_rank: list[dict[str, list[tuple[float, ...]]]]) -> dict:
    """One model's figures from every rank's per-round FIELDS.

    A mode's step time is the median over rounds of the slower rank's time
    (the slower rank sets the pace). The CPU figures are each rank's medians,
    averaged over ranks. ``paired`` is the median over rounds of pydist / torch
    within the round: the two run back to back, so a machine that slows down
    for a while slows both, and the ratio keeps less of that noise than the
    ratio of the medians does."""
    result = {"model": name}
    slower: dict[str, list[float]] = {}  # mode -> per round, the slower rank's wall time
    for mode in per_rank[0]:
        fields = [list(zip(*r[mode])) for r in per_rank]  # rank -> field -> per-round values
        slower[mode] = [max(walls) for walls in zip(*(f[0] for f in fields))]
        result[f"{mode}_ms"] = statistics.median(slower[mode]) * 1e3
        mean = {field: statistics.mean(statistics.median(f[i]) for f in fields) for i, field in enumerate(FIELDS)}
        for field in FIELDS[1:]:
            result[f"{mode}_{field}"] = mean[field] * (1e3 if field.endswith("_ms") else 1)
        result[f"{mode}_idle_ms"] = (mean["wall_ms"] - mean["cpu_autograd_ms"] - mean["cpu_other_ms"]) * 1e3
    for mode in [m for m in slower if m.startswith("pydist")]:
        result[f"{mode}_paired"] = statistics.median(p / t for p, t in zip(slower[mode], slower["torch"]))
        result[f"{mode}_vs_compute"] = statistics.median(p / c for p, c in zip(slower[mode], slower["compute"]))
    return result


def _records_main(rank, world_size, model_name, steps):
    import pydist

    reports = {}
    for chunk_mb in (0, 4):
        torch.manual_seed(0)
        model = pydist.DistributedDataParallel(MODELS[model_name](), allreduce_chunk_mb=chunk_mb, record_timing=True)
        x = torch.randn(BATCH, IN_FEATURES[model_name], generator=torch.Generator().manual_seed(rank))
        for _ in range(steps):
            model.zero_grad(set_to_none=False)
            model(x).sum().backward()
        reports[chunk_mb] = model.last_iteration_record().report()
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print machine-readable results only")
    parser.add_argument("--chunk-ab", action="store_true", help="also time pydist with 1 MB chunks and whole buckets")
    parser.add_argument("--set-to-none", action="store_true", help="zero_grad(set_to_none=True) in every step")
    parser.add_argument("--records", action="store_true", help="print per-bucket records instead of timing steps")
    parser.add_argument("--cpu", action="store_true", help="also print where each mode's CPU time went")
    args = parser.parse_args()

    if args.records:
        for name in MODELS:
            per_rank = run_ranks(_records_main, 2, args=(name, 6), timeout=600, threads=1)
            for chunk_mb in per_rank[0]:
                launches = "whole buckets" if chunk_mb == 0 else f"{chunk_mb} MB chunks"
                for rank, reports in enumerate(per_rank):
                    print(f"# {name}, {launches}, rank {rank}\n{reports[chunk_mb]}\n")
        return

    results = []
    for name in MODELS:
        per_rank = run_ranks(_rank_main, 2, args=(name, args.rounds, args.steps, args.chunk_ab, args.set_to_none), timeout=600, threads=1)
        results.append(_summarize(name, per_rank))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"2 ranks, gloo, CPU, 1 thread/rank, batch {BATCH}, zero_grad(set_to_none={args.set_to_none}); "
        f"medians of {args.rounds} rounds x {args.steps} steps (ms); pydist: shared memory, pydist_pg: gloo"
    )
    header = (
        f"{'model':<36} {'torch':>8} {'pydist':>8} {'pydist_pg':>9} {'compute':>8} {'allred':>8} {'pydist/torch':>13} "
        f"{'paired':>7} {'pydist_pg/torch':>16} {'torch/(c+a)':>12} {'pydist/(c+a)':>13} {'pydist/compute':>15} {'paired':>7}"
    )
    print(header)
    for r in results:
        serial = r["compute_ms"] + r["allreduce_ms"]
        print(
            f"{r['model']:<36} {r['torch_ms']:>8.2f} {r['pydist_ms']:>8.2f} {r['pydist_pg_ms']:>9.2f} {r['compute_ms']:>8.2f} "
            f"{r['allreduce_ms']:>8.2f} {r['pydist_ms'] / r['torch_ms']:>13.3f} {r['pydist_paired']:>7.3f} "
            f"{r['pydist_pg_ms'] / r['torch_ms']:>16.3f} {r['torch_ms'] / serial:>12.3f} {r['pydist_ms'] / serial:>13.3f} "
            f"{r['pydist_ms'] / r['compute_ms']:>15.3f} {r['pydist_vs_compute']:>7.3f}"
        )
    if args.cpu:
        print("\nCPU per step, mean over ranks of each rank's medians (ms): the autograd thread and the")
        print("rank's other threads (gloo's), each with its part in the kernel (sys); idle: wall time with")
        print("none of them running (blocked, or waiting for a core); the autograd thread's minor page")
        print("faults and the rank's context switches, per step")
        print(
            f"{'model':<36} {'mode':<13} {'autograd':>9} {'(sys)':>7} {'other':>8} {'(sys)':>7} {'idle':>8} "
            f"{'faults':>7} {'switches':>9}"
        )
        for r in results:
            for mode in [k[: -len("_idle_ms")] for k in r if k.endswith("_idle_ms")]:
                print(
                    f"{r['model']:<36} {mode:<13} {r[f'{mode}_cpu_autograd_ms']:>9.2f} {r[f'{mode}_cpu_autograd_sys_ms']:>7.2f} "
                    f"{r[f'{mode}_cpu_other_ms']:>8.2f} {r[f'{mode}_cpu_other_sys_ms']:>7.2f} {r[f'{mode}_idle_ms']:>8.2f} "
                    f"{r[f'{mode}_autograd_faults']:>7.0f} {r[f'{mode}_switches']:>9.0f}"
                )
    if args.chunk_ab:
        print("\npydist / torch by all-reduce chunk size (same run)")
        print(f"{'model':<36} {'4 MB (default)':>15} {'1 MB':>8} {'whole':>8}")
        for r in results:
            t = r["torch_ms"]
            print(f"{r['model']:<36} {r['pydist_ms'] / t:>15.3f} {r['pydist_1mb_ms'] / t:>8.3f} {r['pydist_whole_ms'] / t:>8.3f}")


if __name__ == "__main__":
    main()
