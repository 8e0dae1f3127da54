"""Issue 39's straggler targets: a busy-wait of DELAY ms injected into one
rank's backward is named by ``python -m pydist.overlap report DIR --json``
with the right rank, its delay within 25%, in at least 19 of 20 runs, at 2
and 4 ranks; a balanced run names no straggler in 20 of 20.

    python benchmarks/bench_stragglers.py [--runs 20] [--ranks 2 4] [--delays-ms 10 2] [--wrapper ddp|fully_shard]
                                          [--save DIR | --load DIR]

--save DIR keeps each run's merged trace; --load DIR scores those traces
again (another detection rule, the same runs) without running anything.

Each run is a fresh set of ranks (pydist.spawn) training a small model for
--steps steps under PYDIST_TRACE; the slow rank is the last one (a busy
wait, so it holds its CPU as slow compute does). Timing-sensitive: on a
machine with fewer free cores than ranks the waiting ranks take the slow
one's CPU and the measured delay stretches (say so when quoting).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _run(rank, world_size, directory, delay_s, wrapper, steps):
    import pydist
    from pydist.overlap import hooks

    os.environ["PYDIST_TRACE"] = directory
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    # every rank runs the hook (its own cost is then alike); the last one waits in it
    wait = delay_s if rank == world_size - 1 else 0.0
    model[-1].register_full_backward_hook(lambda *_: _busy_wait(wait))
    if wrapper == "ddp":
        model = pydist.DistributedDataParallel(model)
    else:
        for layer in model:
            pydist.fully_shard(layer)
        model = pydist.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 128, generator=gen)).square().mean().backward()
        opt.step()
    hooks.TraceSession.get(directory).write()


def main():
    from pydist.overlap import report, trace
    from pydist.overlap.__main__ import _rank_files
    from pydist.spawn import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[10.0, 2.0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--wrapper", choices=("ddp", "fully_shard"), default="ddp")
    parser.add_argument("--save", metavar="DIR", help="keep each run's merged trace in DIR (to re-score later)")
    parser.add_argument("--load", metavar="DIR", help="score the merged traces a --save run kept, running nothing")
    args = parser.parse_args()
    if args.save:
        os.makedirs(args.save, exist_ok=True)
    print(f"{args.wrapper}, {args.runs} runs per row, {args.steps} steps each; hit = the right rank alone, "
          "delay within 25%")
    print(f"{'ranks':>5} {'injected ms':>11} {'hits':>6} {'false':>6} {'median found ms':>15}")
    for ranks in args.ranks:
        for delay in [*args.delays_ms, 0.0]:
            hits = false = 0
            found_delays = []
            for i in range(args.runs):
                name = f"{args.wrapper}_r{ranks}_d{delay:g}_{i}.json"
                if args.load:
                    document = trace.load_trace(os.path.join(args.load, name))
                else:
                    with tempfile.TemporaryDirectory(prefix="bench_stragglers_") as directory:
                        run_ranks(_run, ranks, args=(directory, delay / 1e3, args.wrapper, args.steps), timeout=300)
                        document = trace.merge_traces(_rank_files([directory]))
                    if args.save:
                        trace.write_trace(os.path.join(args.save, name), document)
                found = report.report_json(document)["stragglers"]
                if delay == 0:
                    false += bool(found)
                    continue
                right = [f for f in found if f["rank"] == ranks - 1]
                if right:
                    found_delays.append(right[0]["delay_ms"])
                hits += (len(found) == 1 and bool(right) and abs(right[0]["delay_ms"] - delay) <= 0.25 * delay)
                false += any(f["rank"] != ranks - 1 for f in found)
            middle = sorted(found_delays)[len(found_delays) // 2] if found_delays else float("nan")
            print(f"{ranks:>5} {delay:>11.1f} {hits if delay else '-':>6} {false:>6} {middle:>15.2f}", flush=True)


if __name__ == "__main__":
    main()
