"""What watching costs: a training step with the overlap lab's records on vs
off, for DDP and for the sharded wrapper (fully_shard), from one run.

    python benchmarks/bench_watch_cost.py [--ranks 2] [--rounds 8] [--steps 20]

DDP off: the reducer reads no clock (``overlap.stop``); on: ``overlap.record``
(the reducer stamps every bucket and chunk, and a StepLog copies each
step's record as its backward ends: what PYDIST_TRACE does). fully_shard
keeps its per-unit collective times always (tuples, see
_fsdp_param_group.py); on adds what the lab asks of it: the root stamps its
forward and backward and publishes an IterationRecord per step to a
subscriber (what PYDIST_TRACE does). Rounds alternate off and on within one
process so that machine load hits both alike; the figure is the median step
of each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(rank, world_size, rounds, steps, width, layers):
    import pydist
    from pydist import overlap
    from pydist.fsdp._fsdp_state import state_of
    from pydist.overlap.hooks import PublishedLog

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    ddp = pydist.DistributedDataParallel(model())
    sharded = model()
    for layer in sharded:
        pydist.fully_shard(layer)
    pydist.fully_shard(sharded)
    root = state_of(sharded)
    log = PublishedLog()

    def switch(kind, on):
        if kind == "ddp":
            (overlap.record if on else overlap.stop)(ddp)
        elif on:
            root.subscribe(log.take)
        else:
            root.subscribers.clear()

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(32, width, generator=gen)
    times = {(k, on): [] for k in ("ddp", "fully_shard") for on in (False, True)}
    for m in (ddp, sharded):  # warm up (DDP rebuilds its buckets after the first step)
        for _ in range(3):
            m(x).square().mean().backward()
    for r in range(rounds):
        for kind, m in (("ddp", ddp), ("fully_shard", sharded)):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                switch(kind, on)
                for _ in range(steps):
                    m.zero_grad()
                    torch.distributed.barrier()
                    start = time.perf_counter()
                    m(x).square().mean().backward()
                    times[(kind, on)].append(time.perf_counter() - start)
                switch(kind, False)
    return {f"{k}/{'on' if on else 'off'}": statistics.median(v) * 1e3 for (k, on), v in times.items()}


def main():
    from pydist.spawn import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    per_rank = run_ranks(_bench, args.ranks, args=(args.rounds, args.steps, args.width, args.layers), timeout=600)
    rank0 = per_rank[0]
    print(f"{args.ranks} ranks, {args.layers} x Linear({args.width}), batch 32, {args.rounds} rounds x {args.steps} "
          "steps, median forward+backward per step (rank 0)")
    print(f"{'wrapper':<12} {'off ms':>8} {'on ms':>8} {'on/off':>7}")
    for kind in ("ddp", "fully_shard"):
        off, on = rank0[f"{kind}/off"], rank0[f"{kind}/on"]
        print(f"{kind:<12} {off:>8.3f} {on:>8.3f} {on / off:>7.3f}")
    print(json.dumps(per_rank))


if __name__ == "__main__":
    main()
