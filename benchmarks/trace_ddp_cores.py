"""What the two cores did in each phase of a DDP step, pydist beside torch.

    python benchmarks/trace_ddp_cores.py [--rounds 6] [--steps 5] [--model 8x|400x]

bench_ddp.py --cpu says how much of a step each rank spent in its autograd
thread, in its other threads (gloo's) and idle; this says *when*. It runs
pydist and torch DDP steps on 2 ranks (gloo, CPU, one torch thread each),
interleaved round by round, under `perf record -e sched:sched_switch`, and
cuts every step into phases from both ranks' timestamps:

    forward   first rank's zero_grad .. last rank's end of forward
    backward  both ranks in autograd
    drift     one rank done with autograd, the other still in it
    tail      both done with autograd, waiting for their communication

For each phase it gives, in ms per step (medians over steps), how long the
phase lasted and what the 2 cores did in it: idle, each rank's autograd
thread, each rank's other threads. A core idle while a collective is
outstanding is the time overlap could still win back; a core running gloo
while the other runs autograd is overlap bought with CPU. "Autograd end" is
stamped by an engine callback queued from a hook on the loss, which runs
before either wrapper's own end-of-backward callback.

It first checks the machine: how long one 64x1024 @ 1024x1024 GEMM (a layer
of the 8-layer model) takes on core 0 alone and while core 1 copies 16 MB
buffers. On a machine whose cores share little memory bandwidth, gloo's
loopback copies slow the autograd thread they overlap with; that is what
overlap costs there.

Needs perf with scheduler tracepoints (as root: `mount -t tracefs nodev
/sys/kernel/tracing` if `perf list sched:sched_switch` shows nothing) and
2 cores or more.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_ddp import BATCH, IN_FEATURES, MODELS  # noqa: E402
from pydist.spawn import run_ranks  # noqa: E402

PHASES = ("forward", "backward", "drift", "tail")
MODES = ("torch", "pydist")


# --- the machine check ------------------------------------------------------


def _copy_forever(stop) -> None:
    os.sched_setaffinity(0, {1})
    src, dst = torch.randn(4 << 20), torch.empty(4 << 20)
    while not stop.is_set():
        dst.copy_(src)


def _gemm_us() -> float:
    x, w = torch.randn(BATCH, 1024), torch.randn(1024, 1024)
    for _ in range(20):
        x @ w
    start, n = time.perf_counter(), 300
    for _ in range(n):
        x @ w
    return (time.perf_counter() - start) / n * 1e6


def memory_interference() -> tuple[float, float]:
    """One layer's GEMM on core 0, alone and beside a memcpy loop on core 1 (us)."""
    torch.set_num_threads(1)
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        alone = _gemm_us()
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        copier = ctx.Process(target=_copy_forever, args=(stop,))
        copier.start()
        time.sleep(0.5)
        beside = _gemm_us()
        stop.set()
        copier.join()
        return alone, beside
    finally:
        os.sched_setaffinity(0, mask)


# --- the ranks, run under perf ----------------------------------------------


def _rank_main(rank, world_size, model_name, rounds, steps):
    """Per mode, per step: wall-clock (CLOCK_MONOTONIC) start, end of
    forward, end of autograd, return from backward."""
    import pydist
    from torch.autograd import Variable
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch.manual_seed(0)
    wrapped = {"torch": TorchDDP(MODELS[model_name]()), "pydist": pydist.DistributedDataParallel(MODELS[model_name]())}
    x = torch.randn(BATCH, IN_FEATURES[model_name], generator=torch.Generator().manual_seed(rank))

    def step(model) -> tuple[float, float, float, float]:
        autograd_end = []
        start = time.perf_counter()
        model.zero_grad(set_to_none=False)
        loss = model(x).sum()
        forward_end = time.perf_counter()
        loss.register_hook(lambda g: Variable._execution_engine.queue_callback(lambda: autograd_end.append(time.perf_counter())))
        loss.backward()
        return start, forward_end, autograd_end[0], time.perf_counter()

    for model in wrapped.values():
        for _ in range(3):
            step(model)
    times = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            torch.distributed.barrier()
            times[mode] += [step(wrapped[mode]) for _ in range(steps)]
    return {"pid": os.getpid(), "times": times}


def _phases(rank0, rank1) -> dict[str, tuple[float, float]]:
    (s0, f0, a0, r0), (s1, f1, a1, r1) = rank0, rank1
    return {
        "forward": (min(s0, s1), max(f0, f1)),
        "backward": (max(f0, f1), min(a0, a1)),
        "drift": (min(a0, a1), max(a0, a1)),
        "tail": (max(a0, a1), max(r0, r1)),
    }


# --- the trace ----------------------------------------------------------------

_SWITCH = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):.*next_pid=(\d+)")


def _core_intervals(perf_data: str, rank_pids: list[int]) -> list[tuple[float, float, str]]:
    """(start, end, who) for every stretch a core ran one task: "idle", "rN
    autograd" (the rank's main thread, where CPU backward runs), "rN other"
    or "else"."""
    script = subprocess.run(["perf", "script", "-i", perf_data, "-F", "cpu,pid,tid,time,trace"],
                            capture_output=True, text=True, check=True).stdout
    process_of = {0: 0}
    switches = []
    for line in script.splitlines():
        m = _SWITCH.match(line)
        if m:
            process_of[int(m[2])] = int(m[1])
            switches.append((float(m[4]), int(m[3]), int(m[5])))

    def who(tid: int) -> str:
        if tid == 0:
            return "idle"
        for rank, pid in enumerate(rank_pids):
            if process_of.get(tid) == pid:
                return f"r{rank} autograd" if tid == pid else f"r{rank} other"
        return "else"

    intervals, running = [], {}
    for t, cpu, next_tid in switches:
        if cpu in running:
            intervals.append((running[cpu][0], t, who(running[cpu][1])))
        running[cpu] = (t, next_tid)
    return intervals


def _core_time(intervals, start: float, end: float) -> dict[str, float]:
    spent: dict[str, float] = {}
    for i0, i1, who in intervals:
        overlap = min(i1, end) - max(i0, start)
        if overlap > 0:
            spent[who] = spent.get(who, 0.0) + overlap
    return spent


def summarize(intervals, times) -> dict[str, dict[str, dict[str, float]]]:
    """mode -> phase -> {"length", "idle", "r0 autograd", ...}, and mode ->
    "step" -> {"length"} for the whole step: medians over steps, in ms."""
    whos = ("idle", "r0 autograd", "r1 autograd", "r0 other", "r1 other")
    result = {}
    for mode in MODES:
        per_phase = {phase: {key: [] for key in ("length",) + whos} for phase in PHASES}
        per_phase["step"] = {"length": []}
        for rank0, rank1 in zip(times[0][mode], times[1][mode]):
            per_phase["step"]["length"].append(max(rank0[3], rank1[3]) - min(rank0[0], rank1[0]))
            for phase, (start, end) in _phases(rank0, rank1).items():
                spent = _core_time(intervals, start, end)
                per_phase[phase]["length"].append(max(0.0, end - start))
                for who in whos:
                    per_phase[phase][who].append(spent.get(who, 0.0))
        result[mode] = {
            phase: {key: statistics.median(values) * 1e3 for key, values in cols.items()} for phase, cols in per_phase.items()
        }
    return result


def _inner(args) -> None:
    per_rank = run_ranks(_rank_main, 2, args=(args.model_name, args.rounds, args.steps), timeout=600, threads=1)
    with open(args.inner, "w") as f:
        json.dump({"pids": [r["pid"] for r in per_rank], "times": [r["times"] for r in per_rank]}, f)


def _require_perf() -> None:
    if shutil.which("perf") is None:
        sys.exit("trace_ddp_cores: needs `perf` on PATH")
    listed = subprocess.run(["perf", "list", "sched:sched_switch"], capture_output=True, text=True).stdout
    if "sched_switch" not in listed:
        sys.exit("trace_ddp_cores: perf sees no sched:sched_switch tracepoint; as root, "
                 "`mount -t tracefs nodev /sys/kernel/tracing` and run again")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", choices=("8x", "400x"), default="8x")
    parser.add_argument("--inner", help=argparse.SUPPRESS)  # run the ranks, write their times here
    args = parser.parse_args()
    args.model_name = next(name for name in MODELS if name.startswith(args.model))
    if args.inner:
        _inner(args)
        return
    _require_perf()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("trace_ddp_cores: needs 2 cores")

    alone, beside = memory_interference()
    print(f"machine: a {BATCH}x1024 @ 1024x1024 GEMM on core 0 takes {alone:.0f} us alone, "
          f"{beside:.0f} us while core 1 copies memory ({beside / alone:.2f}x)\n")

    with tempfile.TemporaryDirectory() as tmp:
        perf_data, times_file = os.path.join(tmp, "perf.data"), os.path.join(tmp, "times.json")
        inner = [sys.executable, os.path.abspath(__file__), "--inner", times_file, "--model", args.model,
                 "--rounds", str(args.rounds), "--steps", str(args.steps)]
        subprocess.run(["perf", "record", "-q", "-e", "sched:sched_switch", "-k", "mono", "-a", "-o", perf_data, "--", *inner],
                       check=True)
        with open(times_file) as f:
            ran = json.load(f)
        table = summarize(_core_intervals(perf_data, ran["pids"]), ran["times"])

    print(f"{args.model_name}, 2 ranks, gloo; ms per step, medians of {args.rounds * args.steps} steps; "
          f"core time summed over the 2 cores")
    print(f"{'mode':<7} {'phase':<9} {'length':>7} {'idle':>7} {'r0 autograd':>12} {'r1 autograd':>12} {'r0 other':>9} {'r1 other':>9}")
    for mode in MODES:
        for phase in PHASES:
            row = table[mode][phase]
            print(f"{mode:<7} {phase:<9} {row['length']:>7.2f} {row['idle']:>7.2f} {row['r0 autograd']:>12.2f} "
                  f"{row['r1 autograd']:>12.2f} {row['r0 other']:>9.2f} {row['r1 other']:>9.2f}")
        print(f"{mode:<7} {'step':<9} {table[mode]['step']['length']:>7.2f}")
    print(f"\npydist / torch step (medians): {table['pydist']['step']['length'] / table['torch']['step']['length']:.3f}")


if __name__ == "__main__":
    main()
