"""How much of DDP's communication backward hides, over simulated links:
step time and exposed communication per bucket cap x chunk size x link
bandwidth x model, on 2 CPU ranks.

    python benchmarks/bench_overlap.py [--bandwidths 1,10,100] [--caps 0.25,1,4,25] [--chunks 0,1]
                                       [--latency 20us] [--rounds 3] [--steps 3] [--json] [--plot PNG]

Every gradient collective goes over a simulated link (pydist.overlap.sim_net
in front of the shared-memory transport: [Note: simulated network] in
csrc/transport/sim_net_transport.cpp), so a laptop shows what a cluster link
of that bandwidth would do to the step. The whole sweep runs --rounds
times, each cell built afresh every round, so a slow stretch of this shared
machine lands on a few steps of many cells rather than on all of one. Per
cell, medians over the rounds' --steps steps, each after two warm-up steps
(the first rebuilds the buckets):

    step       zero_grad + forward + backward with pydist DDP (grads averaged)
    exposed    communication the step waited for after autograd ended
               ([Note: exposed communication] in pydist/overlap/analysis.py)
    baseline   no overlap at all: the same step under no_sync, then one flat
               all-reduce of every gradient over the same simulated link
    step / baseline   below 1: overlap pays

"chunk 0" all-reduces whole buckets; "chunk 1" in 1 MB pieces as gradients
arrive ([Note: chunked launches] in csrc/reducer/reducer.h). The plot draws
step time against bucket cap, one panel per model, one colour per bandwidth,
with each bandwidth's no-overlap baseline dashed. Records are on in every
cell (the exposed column needs them); their cost per step is measured last,
on the plain transport, records off and on in alternating rounds.

With --optimizer adam (or sgd) the sweep times whole training iterations
instead (opt.zero_grad + forward + backward + opt.step, steady state: --steps
iterations back to back after a barrier, then a wait for the last updates,
divided by --steps), per model x bandwidth x cap, two columns alternating
within each round on the same link:

    plain ms              pydist DDP, then opt.step() after backward
    overlap_optimizer ms  model.overlap_optimizer(opt): each bucket updated as
                          its all-reduce lands, the next forward waiting only
                          for its own layers, the front layers' chunks first
                          on the link (docs/overlap-optimizer.md)
    ratio                 overlap_optimizer / plain

overlap_optimizer's update thread and the main thread share the GIL; on a
machine with no spare core per rank, Python's default switch interval (5 ms)
can hold a landed bucket's update (or the forward) for that long:
--switch-interval 0.0002 shows the schedule without that convoy, and
--updates forward|worker sets the thread that applies the updates (the
default, auto, picks the worker only with a spare core per rank). --plot
draws the two columns per model and link.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pydist.spawn import run_ranks  # noqa: E402

BATCH = 32


def build_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "wide":  # 8 x Linear(512,512): 8.4 MB of gradients in 16 tensors
        layers = []
        for _ in range(8):
            layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)
    if name == "deep":  # 64 x (Linear(128,128)+LayerNorm): 4.3 MB in 256 tensors
        layers = []
        for _ in range(64):
            layers += [torch.nn.Linear(128, 128), torch.nn.LayerNorm(128)]
        return torch.nn.Sequential(*layers)
    raise ValueError(f"unknown model {name!r}: wide or deep")


def in_features(name: str) -> int:
    return 512 if name == "wide" else 128


def _step(ddp, x):
    ddp.zero_grad(set_to_none=False)
    ddp(x).square().mean().backward()


def _timed_steps(ddp, x, steps):
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        _step(ddp, x)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _cell(model_name, bandwidth_gbps, latency, cap_mb, chunk_mb, steps, rank):
    from pydist import DistributedDataParallel as DDP
    from pydist import overlap

    ddp = DDP(build_model(model_name), bucket_cap_mb=cap_mb, allreduce_chunk_mb=chunk_mb,
              sim_net=f"{bandwidth_gbps}Gbps,{latency}")
    overlap.record(ddp)
    x = torch.randn(BATCH, in_features(model_name), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        _step(ddp, x)
    overlap.reset(ddp)
    times = _timed_steps(ddp, x, steps)
    return {"step_ms": times, "steps": overlap.steps(ddp), "buckets": len(ddp.bucket_indices())}


def _baseline(model_name, bandwidth_gbps, latency, steps, rank, world_size):
    """no_sync compute, then one flat all-reduce over the same link."""
    from pydist import DistributedDataParallel as DDP
    from pydist import overlap, transport

    ddp = DDP(build_model(model_name))
    link = overlap.sim_net(transport.transport_of(ddp), f"{bandwidth_gbps}Gbps,{latency}")
    x = torch.randn(BATCH, in_features(model_name), generator=torch.Generator().manual_seed(rank))
    params = [p for p in ddp.parameters() if p.requires_grad]
    times = []
    for i in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        with ddp.no_sync():
            _step(ddp, x)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        link.all_reduce(flat, 1.0 / world_size).wait()
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def _records_cost(model_name, rounds, steps, rank):
    """Step time with records off and on, alternating rounds, plain transport."""
    from pydist import DistributedDataParallel as DDP

    ddp = DDP(build_model(model_name))
    x = torch.randn(BATCH, in_features(model_name), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        _step(ddp, x)
    off, on = [], []
    for _ in range(rounds):
        for record, out in ((False, off), (True, on)):
            ddp.set_record_timing(record)
            _step(ddp, x)  # records apply from the next backward
            out.append(statistics.median(_timed_steps(ddp, x, steps)))
    return statistics.median(off), statistics.median(on)


_PICKED: set = set()  # the update threads the overlap_optimizer cells ran with


def _optimizer_cell(model_name, bandwidth_gbps, latency, cap_mb, chunk_mb, steps, rank, optimizer, overlapped,
                    updates="worker"):
    """ms per training iteration, steady state (see the module docstring)."""
    from pydist import DistributedDataParallel as DDP

    ddp = DDP(build_model(model_name), bucket_cap_mb=cap_mb, allreduce_chunk_mb=chunk_mb,
              sim_net=f"{bandwidth_gbps}Gbps,{latency}")
    opt = (torch.optim.Adam(ddp.parameters(), lr=1e-4) if optimizer == "adam"
           else torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9))
    if overlapped:
        ddp.overlap_optimizer(opt, updates=updates)
        _PICKED.add(ddp._overlap.updates)  # what updates="auto" chose
    x = torch.randn(BATCH, in_features(model_name), generator=torch.Generator().manual_seed(rank))
    return timed_iterations(ddp, opt, x, steps)


def timed_iterations(ddp, opt, x, steps, when_warm=None) -> float:
    """This rank's ms per training iteration (zero_grad + forward + backward
    + step), steady state: three warm-up iterations (the first rebuilds the
    buckets), then ``steps`` timed ones until every update has landed.
    ``when_warm()`` runs once between the two."""
    def iteration():
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()

    for _ in range(3):
        iteration()
    ddp.wait_updates()
    if when_warm is not None:
        when_warm()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        iteration()
    ddp.wait_updates()
    return (time.perf_counter() - start) * 1e3 / steps


def optimizer_sweep(rank, world_size, args):
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)  # both columns alike
    times: dict = {}
    for _ in range(args.rounds):
        for model_name in args.models:
            for bw in args.bandwidths:
                for cap in args.caps:
                    for overlapped in (False, True):
                        key = (model_name, bw, cap, overlapped)
                        times.setdefault(key, []).append(_optimizer_cell(
                            model_name, bw, args.latency, cap, args.chunks[0], args.steps, rank, args.optimizer,
                            overlapped, args.updates))
    cells = []
    for (m, bw, cap, overlapped), t in times.items():
        if overlapped:
            continue
        plain, over = statistics.median(t), statistics.median(times[(m, bw, cap, True)])
        cells.append({"model": m, "bandwidth_gbps": bw, "cap_mb": cap, "chunk_mb": args.chunks[0],
                      "plain_ms": plain, "overlap_optimizer_ms": over, "ratio": over / plain})
    updates = args.updates if args.updates != "auto" else f"auto: {'/'.join(sorted(_PICKED))}"
    return {"optimizer": args.optimizer, "updates": updates, "optimizer_cells": cells}


def print_optimizer_table(result, latency):
    print(f"2 ranks, simulated link latency {latency}, {result['optimizer']}, updates={result['updates']!r}; "
          "ms per training iteration "
          "(zero_grad + forward + backward + step, steady state), medians over rounds; rank 0")
    print(f"{'model':<6} {'Gb/s':>6} {'cap MB':>7} {'chunk MB':>8} {'plain ms':>9} {'overlap_optimizer ms':>20} "
          f"{'ratio':>6}")
    for c in result["optimizer_cells"]:
        print(f"{c['model']:<6} {c['bandwidth_gbps']:>6g} {c['cap_mb']:>7g} {c['chunk_mb']:>8g} {c['plain_ms']:>9.2f} "
              f"{c['overlap_optimizer_ms']:>20.2f} {c['ratio']:>6.3f}")


def plot_optimizer(result, path, latency):
    """One panel per model: ms per iteration at each bandwidth, plain DDP
    beside overlap_optimizer (first cap of the sweep), the ratio on top."""
    plt = _pyplot()
    cells = result["optimizer_cells"]
    models = list(dict.fromkeys(c["model"] for c in cells))
    cap = cells[0]["cap_mb"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.8 * len(models), 3.8), squeeze=False)
    for ax, model_name in zip(axes[0], models):
        mine = sorted((c for c in cells if c["model"] == model_name and c["cap_mb"] == cap),
                      key=lambda c: c["bandwidth_gbps"])
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [c["plain_ms"] for c in mine], 0.4, label="plain DDP + opt.step()")
        ax.bar([x + 0.2 for x in xs], [c["overlap_optimizer_ms"] for c in mine], 0.4,
               label=f"overlap_optimizer (updates={result['updates']})")
        for x, c in zip(xs, mine):
            ax.text(x + 0.2, c["overlap_optimizer_ms"], f"{c['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [f"{c['bandwidth_gbps']:g} Gb/s" for c in mine])
        ax.set_ylabel("ms per iteration (fwd + bwd + step)")
        ax.set_title(f"{model_name}, {result['optimizer']}, {cap:g} MB buckets")
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"pydist DDP, 2 CPU ranks, simulated link ({latency} latency)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("bench_overlap.py --plot needs matplotlib, which is not installed: pip install matplotlib")
    return plt


def sweep(rank, world_size, args):
    base_times: dict = {}
    cell_times: dict = {}
    for _ in range(args.rounds):
        for model_name in args.models:
            for bw in args.bandwidths:
                key = (model_name, bw)
                base_times.setdefault(key, []).extend(
                    _baseline(model_name, bw, args.latency, args.steps, rank, world_size))
                for cap in args.caps:
                    for chunk in args.chunks:
                        cell = _cell(model_name, bw, args.latency, cap, chunk, args.steps, rank)
                        into = cell_times.setdefault((model_name, bw, cap, chunk), {"step_ms": [], "steps": []})
                        into["step_ms"] += cell["step_ms"]
                        into["steps"] += cell["steps"]
                        into["buckets"] = cell["buckets"]
    baselines = [{"model": m, "bandwidth_gbps": bw, "baseline_ms": statistics.median(t)}
                 for (m, bw), t in base_times.items()]
    cells = []
    for (m, bw, cap, chunk), c in cell_times.items():
        stalls = [s.stalling for s in c["steps"]]
        cells.append({"model": m, "bandwidth_gbps": bw, "cap_mb": cap, "chunk_mb": chunk, "buckets": c["buckets"],
                      "step_ms": statistics.median(c["step_ms"]),
                      "exposed_ms": statistics.median(s.exposed_ms for s in c["steps"]),
                      "stalling": statistics.mode(stalls) if stalls else None})
    cost = {m: _records_cost(m, args.cost_rounds, args.steps, rank) for m in args.models}
    return {"cells": cells, "baselines": baselines, "records_cost": cost}


def print_table(result, latency):
    base = {(b["model"], b["bandwidth_gbps"]): b["baseline_ms"] for b in result["baselines"]}
    print(f"2 ranks, simulated link latency {latency}; medians; rank 0")
    print(f"{'model':<6} {'Gb/s':>6} {'cap MB':>7} {'chunk MB':>8} {'buckets':>7} {'step ms':>8} {'exposed ms':>10} "
          f"{'stall':>5} {'baseline ms':>11} {'step/base':>9}")
    for c in result["cells"]:
        b = base[(c["model"], c["bandwidth_gbps"])]
        print(f"{c['model']:<6} {c['bandwidth_gbps']:>6g} {c['cap_mb']:>7g} {c['chunk_mb']:>8g} {c['buckets']:>7} "
              f"{c['step_ms']:>8.2f} {c['exposed_ms']:>10.2f} {str(c['stalling']):>5} {b:>11.2f} "
              f"{c['step_ms'] / b:>9.3f}")
    for model_name, (off, on) in result["records_cost"].items():
        print(f"records on vs off ({model_name}, no simulated link): {off:.2f} -> {on:.2f} ms per step "
              f"({on - off:+.2f} ms, {100 * (on - off) / off:+.1f}%; noise on this machine is about as large)")


def plot(result, path, latency):
    plt = _pyplot()
    models = sorted({c["model"] for c in result["cells"]}, key=[c["model"] for c in result["cells"]].index)
    bandwidths = sorted({c["bandwidth_gbps"] for c in result["cells"]})
    chunks = sorted({c["chunk_mb"] for c in result["cells"]})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, model_name in zip(axes[0], models):
        for i, bw in enumerate(bandwidths):
            colour = colours[i % len(colours)]
            for chunk, style in zip(chunks, ("-o", "-s", "-^")):
                cells = sorted((c for c in result["cells"] if c["model"] == model_name and c["bandwidth_gbps"] == bw
                                and c["chunk_mb"] == chunk), key=lambda c: c["cap_mb"])
                ax.plot([c["cap_mb"] for c in cells], [c["step_ms"] for c in cells], style, color=colour,
                        alpha=1.0 if chunk == chunks[0] else 0.55, ms=4,
                        label=f"{bw:g} Gb/s, " + ("whole buckets" if chunk == 0 else f"{chunk:g} MB chunks"))
            baseline = next(b["baseline_ms"] for b in result["baselines"]
                            if b["model"] == model_name and b["bandwidth_gbps"] == bw)
            ax.axhline(baseline, color=colour, ls="--", lw=0.9)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bucket cap (MB)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{model_name}: step time vs bucket size\n(dashed: no overlap, same link)")
        ax.legend(fontsize=7)
    fig.suptitle(f"pydist DDP, 2 CPU ranks, simulated ring link ({latency} latency)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def add_grid_arguments(parser, chunks: list[float], chunks_help: str) -> None:
    """The grid's options (models, links, caps, chunk sizes), which
    bench_predict.py measures too."""
    parser.add_argument("--models", type=lambda s: s.split(","), default=["wide", "deep"])
    parser.add_argument("--bandwidths", type=floats, default=[1.0, 10.0, 100.0], help="Gb/s")
    parser.add_argument("--caps", type=floats, default=[0.25, 1.0, 4.0, 25.0], help="bucket_cap_mb values")
    parser.add_argument("--chunks", type=floats, default=chunks, help=chunks_help)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grid_arguments(parser, [0.0, 1.0], "allreduce_chunk_mb values (0: whole buckets)")
    parser.add_argument("--latency", default="20us")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per cell per round")
    parser.add_argument("--cost-rounds", type=int, default=15)
    parser.add_argument("--optimizer", choices=["adam", "sgd"],
                        help="time training iterations, plain vs overlap_optimizer (first --chunks value)")
    parser.add_argument("--updates", choices=["auto", "worker", "forward"], default="auto",
                        help="overlap_optimizer's updates= (docs/overlap-optimizer.md)")
    parser.add_argument("--switch-interval", type=float, metavar="S",
                        help="sys.setswitchinterval in each rank (--optimizer sweep; Python's default is 0.005)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", metavar="PNG", help="e.g. benchmarks/bench_overlap.png (with --optimizer: "
                        "plain vs overlap_optimizer per model and link, e.g. benchmarks/bench_overlap_optimizer.png)")
    args = parser.parse_args()
    started = time.perf_counter()
    result = run_ranks(optimizer_sweep if args.optimizer else sweep, 2, args=(args,), timeout=900)[0]
    result["seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(result, indent=1))
    elif args.optimizer:
        print_optimizer_table(result, args.latency)
        print(f"({result['seconds']:.0f} s)")
    else:
        print_table(result, args.latency)
        print(f"({result['seconds']:.0f} s)")
    if args.plot:
        (plot_optimizer if args.optimizer else plot)(result, args.plot, args.latency)


if __name__ == "__main__":
    main()
