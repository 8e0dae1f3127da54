"""pydist.fully_shard beside torch's fully_shard (FSDP2) on one GPU: step
time and peak device memory on bench_fsdp.py's three models.

    python benchmarks/bench_fsdp_cuda.py [--backend nccl|gloo] [--rounds 5] [--steps 10]
                                         [--models linear,ln400,transformer] [--json]

``--backend nccl`` (the default) runs one rank: no bytes cross a link, so
the step is the wrappers' own cost on the GPU (their launches, copies and
host work around the collectives); ``--backend gloo`` runs two ranks sharing
the GPU, their collectives staged through host memory by gloo (for both
wrappers alike). A step is zero_grad + forward + backward + Adam step, each
block one unit, the root last, as in bench_fsdp.py. The modes alternate
round by round in one process per rank; "ratio" is the median over rounds
of pydist's step / torch's within a round. Peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps of each mode,
reset before them, rank 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_fsdp import MODELS, _blocks, _step_fn  # noqa: E402
from pydist.spawn import run_ranks  # noqa: E402

MODES = ("torch", "pydist")


def _build(mode: str, model_key: str, world_size: int):
    torch.manual_seed(0)
    model = MODELS[model_key].build().cuda()
    if mode == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        kwargs = {"mesh": init_device_mesh("cuda", (world_size,))}
    else:
        from pydist import fully_shard

        kwargs = {}
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _time_rank(rank, world_size, model_key, rounds, steps):
    x = torch.randn(*MODELS[model_key].input_shape, generator=torch.Generator().manual_seed(rank)).cuda()
    built = {mode: _build(mode, model_key, world_size) for mode in MODES}
    fns = {mode: _step_fn(model, opt, x) for mode, (model, opt) in built.items()}
    for fn in fns.values():  # warm-up: lazy init, the allocator's pools, cuBLAS handles
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    times = {mode: [] for mode in MODES}
    peaks = {mode: 0 for mode in MODES}
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            for _ in range(steps):
                fns[mode]()
            torch.cuda.synchronize()
            times[mode].append((time.perf_counter() - t0) / steps * 1e3)
            peaks[mode] = max(peaks[mode], torch.cuda.max_memory_allocated() - base)
    return {"times_ms": times, "peak_bytes": peaks}


def run(model_key: str, backend: str, rounds: int, steps: int) -> dict:
    world_size = 1 if backend == "nccl" else 2
    per_rank = run_ranks(_time_rank, world_size, args=(model_key, rounds, steps), backend=backend, timeout=600)
    times = per_rank[0]["times_ms"]
    ratios = [p / t for p, t in zip(times["pydist"], times["torch"])]
    return {
        "model": MODELS[model_key].name, "backend": backend, "ranks": world_size,
        "torch_ms": statistics.median(times["torch"]), "pydist_ms": statistics.median(times["pydist"]),
        "ratio": statistics.median(ratios),
        "torch_peak_mb": per_rank[0]["peak_bytes"]["torch"] / 2**20,
        "pydist_peak_mb": per_rank[0]["peak_bytes"]["pydist"] / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", default="linear,ln400,transformer")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fsdp_cuda.py: needs a CUDA device")
    rows = [run(key, args.backend, args.rounds, args.steps) for key in args.models.split(",")]
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}))
        return
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.backend}, "
          f"{rows[0]['ranks']} rank(s), {args.rounds} rounds x {args.steps} steps")
    print(f"{'model':<44} {'torch ms':>9} {'pydist ms':>10} {'ratio':>6} {'torch peak MB':>14} {'pydist peak MB':>15}")
    for r in rows:
        print(f"{r['model']:<44} {r['torch_ms']:>9.2f} {r['pydist_ms']:>10.2f} {r['ratio']:>6.2f} "
              f"{r['torch_peak_mb']:>14.1f} {r['pydist_peak_mb']:>15.1f}")


if __name__ == "__main__":
    main()
