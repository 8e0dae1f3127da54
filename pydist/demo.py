"""The pydist demo: multi-rank data-parallel training on CPU, with the overlap report.

    python -m pydist.demo [--ranks 2] [--steps 30]

Spawns N ranks on this machine (gloo over loopback), trains the same small
MLP twice from the same seed, on different data per rank, once wrapped in
pydist.DistributedDataParallel and once in torch's, and prints:

- the loss curve (they coincide: same numerics),
- the largest parameter difference between the two at the end,
- pydist's per-bucket record of the last backward: when each bucket's
  gradients became ready, when its all-reduce launched, and how much of it
  ran while autograd was still computing (the overlap).

The ranks share this host, so pydist all-reduces its buckets through shared
memory, torch's DDP through gloo's loopback TCP (``--transport
process_group`` puts pydist on gloo too).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from pydist.spawn import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(512, 1))


def _train(rank: int, world_size: int, wrapper: str, steps: int, transport: str):
    import pydist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    model = _model()
    if wrapper == "pydist":
        ddp = pydist.DistributedDataParallel(
            model, bucket_cap_mb=2, record_timing=True, shm_allreduce=None if transport == "auto" else transport == "shm"
        )
    else:
        ddp = TorchDDP(model, bucket_cap_mb=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank sees its own shard
    target_w = torch.randn(512, 1, generator=torch.Generator().manual_seed(7)) / 512**0.5
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 512, generator=data)
        loss = nn.functional.mse_loss(ddp(x), x @ target_w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = [p.detach().clone() for p in model.parameters()]
    report = ddp.last_iteration_record().report() if wrapper == "pydist" else None
    return losses, params, report, getattr(ddp, "allreduce_transport", "process_group")


def main() -> None:
    parser = argparse.ArgumentParser(description="pydist demo: DDP training on CPU ranks")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--transport", choices=("auto", "shm", "process_group"), default="auto",
                        help="where pydist all-reduces its buckets (auto: shared memory where it can)")
    args = parser.parse_args()

    print(f"training a 7-layer MLP on {args.ranks} CPU ranks (gloo), {args.steps} steps, pydist and torch DDP")
    ours = run_ranks(_train, args.ranks, args=("pydist", args.steps, args.transport), timeout=300)
    theirs = run_ranks(_train, args.ranks, args=("torch", args.steps, args.transport), timeout=300)
    print(f"pydist all-reduced its buckets on: {ours[0][3]}; torch DDP on: {theirs[0][3]} (gloo)")

    print(f"\n{'step':>5} {'pydist loss (rank 0)':>22} {'torch loss (rank 0)':>21}")
    for step in range(0, args.steps, max(1, args.steps // 10)):
        print(f"{step:>5} {ours[0][0][step]:>22.6f} {theirs[0][0][step]:>21.6f}")
    diff = max((a - b).abs().max().item() for a, b in zip(ours[0][1], theirs[0][1]))
    replicas = max((a - b).abs().max().item() for r in ours[1:] for a, b in zip(ours[0][1], r[1]))
    print(f"\nmax |pydist - torch| over all parameters after {args.steps} steps: {diff:.3g}")
    print(f"max difference between pydist replicas (rank 0 vs others): {replicas:.3g}")
    print("\nrank 0, last backward, as recorded by pydist's C++ reducer (ms since the end of forward):")
    print(ours[0][2])
    print("'complete' = when the bucket's last all-reduce finished; 'done' = when finalize wrote it back;")
    print("'hidden' = how long the bucket's communication ran while autograd still computed.")


if __name__ == "__main__":
    main()
