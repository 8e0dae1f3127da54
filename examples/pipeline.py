#!/usr/bin/env python3
"""Model parallelism, from the seeds' "very simple" split to pipelining.

    torchrun --standalone --nproc_per_node=2 examples/pipeline.py            # 2 stages
    torchrun --standalone --nproc_per_node=4 examples/pipeline.py --layers 8
    mpiexec -n 2 python examples/pipeline.py
    ... --torch          # the same script on torch.distributed.pipelining (the import is the only change)

A model of --layers blocks is split layer by layer across the ranks: rank r
holds blocks [r*L/S, (r+1)*L/S). Three trainings of --steps steps each, from
the same seed and data:

  1. naive model parallelism (the seeds' slide): one micro-batch per step.
     Rank 0 runs its layers and sends the activations to rank 1, ..., the
     last rank computes the loss and the gradients flow back the same way.
     Only one rank computes at a time: the bubble is (S-1)/S. Each rank
     checks that its layers end bitwise where one process training the
     whole model ends.
  2. GPipe with --microbatches M: all forwards, then all backwards; the
     bubble shrinks to (S-1)/(M+S-1).
  3. 1F1B with M micro-batches: the same bubble, at most S micro-batches'
     activations alive instead of M.

For each, the measured bubble (1 - time computing / step time, averaged
over the ranks and over the steps after the first) is printed beside
(S-1)/(M+S-1), and the parameters are checked against the one-process run
of the same micro-batches. The pipelines send activations and gradients
over shared memory when the ranks share a host (the process group
otherwise: --p2p process_group), on threads of their own.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="blocks in the model (a multiple of the ranks)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--p2p", default=None, choices=[None, "shm", "process_group"])
    p.add_argument("--torch", action="store_true", help="use torch.distributed.pipelining instead of pydist's")
    return p.parse_args(argv)


def build_model(layers: int, width: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers - 1)]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def data(steps: int, batch: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def one_process(args, n_microbatches: int) -> list[torch.Tensor]:
    """The whole model in this process, micro-batch by micro-batch: what every schedule computes."""
    model = build_model(args.layers, args.width, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in data(args.steps, args.batch, args.width, args.seed):
        opt.zero_grad()
        for xm, ym in zip(x.tensor_split(n_microbatches), y.tensor_split(n_microbatches)):
            nn.functional.cross_entropy(model(xm), ym).backward()
        for p in model.parameters():
            p.grad.div_(n_microbatches)
        opt.step()
    return [p.detach() for p in model.parameters()]


def train_pipeline(args, pp, schedule_cls, n_microbatches: int, rank: int, world: int) -> dict:
    """This rank's part of the model trained under ``schedule_cls``; returns
    its parameters, the mean loss of the last step and the measured bubble."""
    model = build_model(args.layers, args.width, args.seed)
    per = args.layers // world
    part = model[rank * per:(rank + 1) * per]
    extra = {} if args.torch else {"p2p": args.p2p}
    stage = pp.PipelineStage(part, rank, world, torch.device("cpu"), **extra)
    schedule = schedule_cls(stage, n_microbatches=n_microbatches, loss_fn=nn.functional.cross_entropy)
    opt = torch.optim.SGD(part.parameters(), lr=0.05)
    busy_s, step_s, last_loss = 0.0, 0.0, None
    timed = not args.torch  # torch's schedules keep no such records
    for step, (x, y) in enumerate(data(args.steps, args.batch, args.width, args.seed)):
        opt.zero_grad()
        losses = []
        if timed:
            schedule.clear_records()
            schedule.set_record_timing(step > 0)  # the first step opens the channels: not timed
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        elapsed = time.perf_counter() - start
        opt.step()
        if step > 0 and timed:
            step_s += elapsed
            busy_s += sum(r.end_ns - r.start_ns for r in schedule.records()
                          if r.action in ("forward", "backward")) / 1e9
        if losses:
            last_loss = float(torch.stack(losses).detach().mean())
    if timed:
        schedule.close()
    bubble = 1 - busy_s / step_s if step_s else float("nan")
    return {"params": [p.detach() for p in part.parameters()], "loss": last_loss, "bubble": bubble}


def run(rank: int, world: int, args) -> list[dict]:
    """The three trainings on this rank; returns one line's numbers each."""
    if args.torch:
        from torch.distributed import pipelining as pp
    else:
        from pydist import pipelining as pp
    if args.layers % world:
        raise SystemExit(f"--layers {args.layers} does not split evenly over {world} ranks")
    runs = [("naive (1 micro-batch)", pp.ScheduleGPipe, 1),
            (f"GPipe, {args.microbatches} micro-batches", pp.ScheduleGPipe, args.microbatches),
            (f"1F1B, {args.microbatches} micro-batches", pp.Schedule1F1B, args.microbatches)]
    rows = []
    per = args.layers // world
    for name, cls, m in runs:
        got = train_pipeline(args, pp, cls, m, rank, world)
        reference = one_process(args, m)
        per_param = len(list(build_model(args.layers, args.width, args.seed)[rank * per:(rank + 1) * per]
                             .parameters()))
        first = sum(len(list(build_model(args.layers, args.width, args.seed)[q * per:(q + 1) * per].parameters()))
                    for q in range(rank))
        mine = reference[first:first + per_param]
        diff = max(float((a - b).abs().max()) for a, b in zip(got["params"], mine))
        numbers = torch.tensor([diff, got["bubble"]], dtype=torch.float64)
        gathered = [torch.zeros_like(numbers) for _ in range(world)]
        dist.all_gather(gathered, numbers)
        loss = torch.tensor([got["loss"] if got["loss"] is not None else 0.0], dtype=torch.float64)
        dist.broadcast(loss, src=world - 1)
        rows.append({"name": name, "max_diff": max(float(g[0]) for g in gathered),
                     "bubble": sum(float(g[1]) for g in gathered) / world,
                     "ideal": (world - 1) / (m + world - 1), "loss": float(loss)})
    return rows


def main(argv=None):
    args = parse_args(argv)
    import pydist

    info = pydist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    rows = run(rank, world, args)
    if rank == 0:
        lib = "torch.distributed.pipelining" if args.torch else "pydist.pipelining"
        print(f"{lib}: {args.layers} blocks of width {args.width} on {world} ranks, batch {args.batch}, "
              f"{args.steps} steps")
        print(f"{'schedule':<28} {'last loss':>10} {'bubble':>8} {'(S-1)/(M+S-1)':>14} {'max |diff| vs 1 process':>24}")
        for r in rows:
            bubble = "n/a" if r["bubble"] != r["bubble"] else f"{r['bubble']:.2f}"
            print(f"{r['name']:<28} {r['loss']:>10.6f} {bubble:>8} {r['ideal']:>14.2f} {r['max_diff']:>24g}")
    dist.destroy_process_group()
    del info


if __name__ == "__main__":
    main()
