"""pydist.pipelining beside torch.distributed.pipelining: step time and
bubble of GPipe, 1F1B and interleaved 1F1B on 2 CPU ranks.

    python benchmarks/bench_pipelining.py [--rounds 5] [--steps 4] [--microbatches 8] [--json]

Two models, each split layer by layer over the stages (2 stages on 2 ranks;
4 stages, 2 per rank, for the interleaved schedule):

    mlp          8 blocks Linear(1024, 1024) + GELU, batch 256
    transformer  4 nn.TransformerEncoderLayer (d_model 256, 4 heads, ff 1024), batch 32 x 64 tokens

Per model and schedule, pydist's schedules (over shared memory, its default
on one host, and over the gloo group, as torch's) and torch's run in the same
process tree, interleaved round by round (these machines swing between
runs; only ratios within a run mean anything). A round is --steps steps
after one untimed step; the step time is the median over rounds of the
slower rank's mean step.

bubble = 1 - compute / step, per rank, within the same timed steps: compute
is the time the rank spent in its stages' forwards and backwards (pydist:
the schedule's records, which start once the input has arrived; torch: its
stages' forward_one_chunk / backward_one_chunk, timed by wrapping them, which
torch's schedules call once the input has arrived), step the wall time of
the steps. Median over rounds, mean over the ranks, beside the ideal
(S-1)/(M+S-1), S the number of ranks (interleaving v stages per rank:
(S-1)/(v M + S - 1)). Compute and step are read in the same window on the
same clock, so a machine slowed by other work slows both; step times are
only comparable within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.nn as nn

from pydist.spawn import run_ranks


def make_model(kind: str):
    torch.manual_seed(0)
    if kind == "mlp":
        blocks = [nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)]
        x = torch.randn(256, 1024)
        y = torch.randn(256, 1024)
    else:
        blocks = [nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True) for _ in range(4)]
        x = torch.randn(32, 64, 256)
        y = torch.randn(32, 64, 256)
    return blocks, x, y


# pydist over shared memory (its default on one host), pydist over the gloo group (as torch), torch.
LIBS = ("pydist", "pydist_pg", "torch")


def loss_fn(out, target):
    return nn.functional.mse_loss(out, target)


def _parts(blocks, n):
    per = len(blocks) // n
    return [nn.Sequential(*blocks[i * per:(i + 1) * per]) for i in range(n)]


class _ComputeTimer:
    """Seconds a torch stage spends in forward_one_chunk / backward_one_chunk
    (torch's schedules call them once the input has arrived)."""

    def __init__(self, stages):
        self.seconds = 0.0
        for st in stages:
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(st, name, self._timed(getattr(st, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return run


def job(rank, world, kinds, schedules, rounds, steps, M):
    results = {}
    for kind in kinds:
        blocks, x, y = make_model(kind)
        for sched_name in schedules:
            spr = 2 if sched_name == "interleaved" else 1
            n = world * spr
            if len(blocks) % n:
                continue
            mine = [s for s in range(n) if s % world == rank]
            times = {lib: [] for lib in LIBS}
            busy = {lib: [] for lib in LIBS}
            for r in range(rounds):
                for lib in (LIBS if r % 2 == 0 else LIBS[::-1]):
                    if lib == "torch":
                        from torch.distributed import pipelining as pp
                        extra = {}
                    else:
                        from pydist import pipelining as pp
                        extra = {"p2p": "process_group" if lib == "pydist_pg" else None}
                    parts = _parts(make_model(kind)[0], n)
                    stages = [pp.PipelineStage(parts[s], s, n, torch.device("cpu"), **extra) for s in mine]
                    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
                           "interleaved": pp.ScheduleInterleaved1F1B}[sched_name]
                    sched = cls(stages if spr == 2 else stages[0], n_microbatches=M, loss_fn=loss_fn)
                    args = (x,) if 0 in mine else ()
                    kwargs = {"target": y} if n - 1 in mine else {}
                    sched.step(*args, **kwargs)  # untimed: set-up, shapes
                    timer = _ComputeTimer(stages) if lib == "torch" else None
                    if lib != "torch":
                        sched.set_record_timing(True)
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(steps):
                        sched.step(*args, **kwargs)
                    elapsed = time.perf_counter() - start
                    dist.barrier()
                    times[lib].append(elapsed / steps)
                    if lib != "torch":
                        busy[lib].append(sum(rec.end_ns - rec.start_ns for rec in sched.records()
                                             if rec.action in ("forward", "backward")) / 1e9 / steps)
                        sched.close()
                    else:
                        busy[lib].append(timer.seconds / steps)
            results[(kind, sched_name)] = {"busy": busy, "times": times, "ideal": (world - 1) / (spr * M + world - 1)}
    return results


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    per_rank = run_ranks(job, 2, args=(a.models.split(","), a.schedules.split(","), a.rounds, a.steps,
                                       a.microbatches), timeout=1800)
    rows = []
    for key in per_rank[0]:
        step = {lib: statistics.median(max(per_rank[r][key]["times"][lib][i] for r in range(2))
                                       for i in range(a.rounds)) for lib in LIBS}

        def paired(lib):  # median over rounds of lib / torch within the round
            return statistics.median(max(per_rank[r][key]["times"][lib][i] for r in range(2))
                                     / max(per_rank[r][key]["times"]["torch"][i] for r in range(2))
                                     for i in range(a.rounds))
        # per rank and round: 1 - compute / step in the same steps; median over rounds, mean over ranks
        bubble = {lib: sum(statistics.median(1 - c / t for c, t in zip(per_rank[r][key]["busy"][lib],
                                                                         per_rank[r][key]["times"][lib]))
                           for r in range(2)) / 2 for lib in LIBS}
        rows.append({"model": key[0], "schedule": key[1], "pydist_ms": step["pydist"] * 1e3,
                     "pydist_pg_ms": step["pydist_pg"] * 1e3, "torch_ms": step["torch"] * 1e3,
                     "paired_ratio": paired("pydist"), "paired_ratio_pg": paired("pydist_pg"),
                     "pydist_bubble": bubble["pydist"], "pydist_pg_bubble": bubble["pydist_pg"],
                     "torch_bubble": bubble["torch"], "ideal_bubble": per_rank[0][key]["ideal"]})
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"2 ranks, {a.microbatches} micro-batches, {a.rounds} rounds x {a.steps} steps (medians)")
    print("step ms: median; /torch: median over rounds of the ratio within a round; bubble: 1 - compute/step")
    print(f"{'model':<12} {'schedule':<12} {'pydist shm':>10} {'pydist pg':>10} {'torch':>8} {'shm/torch':>9} "
          f"{'pg/torch':>8} {'bubble shm':>10} {'bubble pg':>9} {'bubble torch':>12} {'ideal':>6}")
    for r in rows:
        print(f"{r['model']:<12} {r['schedule']:<12} {r['pydist_ms']:>10.1f} {r['pydist_pg_ms']:>10.1f} "
              f"{r['torch_ms']:>8.1f} {r['paired_ratio']:>9.2f} {r['paired_ratio_pg']:>8.2f} "
              f"{r['pydist_bubble']:>10.2f} {r['pydist_pg_bubble']:>9.2f} {r['torch_bubble']:>12.2f} "
              f"{r['ideal_bubble']:>6.2f}")


if __name__ == "__main__":
    main()
