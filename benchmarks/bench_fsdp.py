"""pydist FSDP beside torch FSDP2: step time, persistent bytes, padding and
peak RSS on CPU ranks over gloo.

    python benchmarks/bench_fsdp.py [--world-size 2] [--rounds 5] [--steps 3] [--models all] [--json]

A step is zero_grad + forward + backward + Adam step on the shards, each
Linear (or Linear+LayerNorm pair) one unit, the root last. Modes, in one run
and interleaved round by round (only ratios within a run mean anything on
these machines):

    torch      torch.distributed.fsdp.fully_shard (FSDP2)
    pydist     pydist.fully_shard, collectives through shared memory (its
               default here: every rank on this host)
    pydist_pg  the same with shm=False: collectives on the gloo group
    torch_ddp  torch.nn.parallel.DistributedDataParallel (every rank keeps everything)
    pydist_ddp pydist.DistributedDataParallel

"paired" is the median over rounds of a mode's step / torch FSDP2's within a round.
Persistent bytes are the distinct storages of the parameters, their
gradients and Adam's state on one rank after a step (torch: the DTensors'
local tensors); "ideal" is 16 Psi / N. Padding is the elements a rank's
shards hold beyond Psi / N. Peak RSS comes from separate spawns per mode
(ru_maxrss of a fresh rank after warm-up and the timed steps), so the modes
do not share a heap.
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


def _linear_relu():
    return nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(8)])


def _linear_ln():
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(400)])


MODELS = {"8x Linear(1024)+ReLU": (_linear_relu, 1024), "400x (Linear(64)+LayerNorm)": (_linear_ln, 64)}
MODES = ("torch", "pydist", "pydist_pg", "torch_ddp", "pydist_ddp")
BATCH = 64


def _build(mode: str, model_name: str, world_size: int):
    torch.manual_seed(0)
    model = MODELS[model_name][0]()
    if mode.endswith("_ddp"):
        import pydist

        ddp = torch.nn.parallel.DistributedDataParallel if mode == "torch_ddp" else pydist.DistributedDataParallel
        model = ddp(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    if mode == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        kwargs = {"mesh": init_device_mesh("cpu", (world_size,))}
    else:
        from pydist import fully_shard

        kwargs = {"shm": mode == "pydist"}
    for block in model:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _persistent(model, opt) -> int:
    """Bytes of the distinct storages of the parameters, their grads and Adam's state."""
    seen, total = set(), 0
    tensors = [_local(p) for p in model.parameters()]
    tensors += [_local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _step_fn(model, opt, x):
    def step():
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    return step


def _time_rank(rank, world_size, model_name, rounds, steps):
    x = torch.randn(BATCH, MODELS[model_name][1], generator=torch.Generator().manual_seed(rank))
    built = {mode: _build(mode, model_name, world_size) for mode in MODES}
    steps_fn = {mode: _step_fn(model, opt, x) for mode, (model, opt) in built.items()}
    for fn in steps_fn.values():
        for _ in range(2):
            fn()
    times = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, fn in steps_fn.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[mode].append((time.perf_counter() - t0) / steps)
    psi = sum(p.numel() for p in MODELS[model_name][0]().parameters())
    memory = {}
    for mode, (model, opt) in built.items():
        nbytes = _persistent(model, opt)
        if mode.endswith("_ddp"):
            local_numel = psi / world_size  # replicated: no padding, and no sharding
        elif mode == "torch":  # DTensor local shards are padded per parameter on dim 0
            local_numel = sum(_local(p).untyped_storage().nbytes() // 4 for p in model.parameters())
        else:
            local_numel = sum(u.shard_numel for m in model.modules()
                              if (s := m.__dict__.get("_pydist_fsdp_state")) and (u := s.param_group))
        memory[mode] = {"persistent_bytes": nbytes, "padding_elems": local_numel - psi / world_size}
    from pydist.fsdp import last_iteration_record

    record = last_iteration_record(built["pydist"][0])
    exposed = record.exposed_ns() / 1e6
    return {"times": times, "memory": memory, "psi": psi, "pydist_exposed_ms": exposed}


def _rss_rank(rank, world_size, model_name, mode, steps):
    x = torch.randn(BATCH, MODELS[model_name][1], generator=torch.Generator().manual_seed(rank))
    model, opt = _build(mode, model_name, world_size)
    fn = _step_fn(model, opt, x)
    for _ in range(steps + 2):
        fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(model_name: str, world_size: int, rounds: int, steps: int) -> dict:
    per_rank = run_ranks(_time_rank, world_size, args=(model_name, rounds, steps), timeout=300)
    slower = {m: [max(r["times"][m][i] for r in per_rank) for i in range(rounds)] for m in MODES}
    out = {"model": model_name, "world_size": world_size, "psi": per_rank[0]["psi"]}
    for m in MODES:
        out[f"{m}_ms"] = statistics.median(slower[m]) * 1e3
        out[f"{m}_persistent_MB"] = max(r["memory"][m]["persistent_bytes"] for r in per_rank) / 2**20
        out[f"{m}_padding_elems"] = max(r["memory"][m]["padding_elems"] for r in per_rank)
        rss = run_ranks(_rss_rank, world_size, args=(model_name, m, steps), timeout=300)
        out[f"{m}_peak_rss_MB"] = max(rss) / 2**20
    out["ideal_persistent_MB"] = 16 * out["psi"] / world_size / 2**20
    out["pydist_exposed_ms"] = max(r["pydist_exposed_ms"] for r in per_rank)
    for m in MODES[1:]:
        out[f"{m}_paired"] = statistics.median(p / t for p, t in zip(slower[m], slower["torch"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", choices=("first", "all"), default="first")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = list(MODELS) if args.models == "all" else list(MODELS)[:1]
    results = [run(n, args.world_size, args.rounds, args.steps) for n in names]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        print(f"\n{r['model']}  ({r['world_size']} ranks, Psi = {r['psi']:,}; ideal persistent 16 Psi/N = "
              f"{r['ideal_persistent_MB']:.2f} MB; pydist's last step waited {r['pydist_exposed_ms']:.1f} ms "
              "on its collectives)")
        print(f"{'mode':<10} {'step(ms)':>9} {'vs torch':>9} {'paired':>7} {'persist(MB)':>12} {'padding':>8} {'peakRSS(MB)':>12}")
        for m in MODES:
            ratio = r[f"{m}_ms"] / r["torch_ms"]
            paired = f"{r[m + '_paired']:.2f}" if m != "torch" else "-"
            print(f"{m:<10} {r[m + '_ms']:>9.1f} {ratio:>9.2f} {paired:>7} {r[m + '_persistent_MB']:>12.2f} "
                  f"{r[m + '_padding_elems']:>8.0f} {r[m + '_peak_rss_MB']:>12.1f}")


if __name__ == "__main__":
    main()
