"""pydist FSDP beside torch FSDP2 and FSDP1: step time, persistent bytes,
padding and peak RSS on CPU ranks over gloo.

    python benchmarks/bench_fsdp.py [--nprocs 2|4] [--rounds 5] [--steps 3] [--models linear,transformer|all]
                                    [--modes torch,pydist,...] [--json]

Models (``--models``, comma-separated keys, or ``all``; the default runs
``linear,transformer``, about 3 minutes on 2 quiet cores):

    linear       8 x (Linear(1024) + ReLU)
    ln400        400 x (Linear(64) + LayerNorm): many small units
    transformer  4 x TransformerEncoderLayer(d_model 256, 4 heads, ffn 1024),
                 then LayerNorm + Linear(256) head; 8 sequences of 64 tokens

A step is zero_grad + forward + backward + Adam step on the shards, each
block (the Linear(+ReLU / +LayerNorm) pair, the encoder layer) one unit, the
root last. Modes, in one run and interleaved round by round (only ratios
within a run mean anything on these machines):

    torch       torch.distributed.fsdp.fully_shard (FSDP2)
    torch_fsdp1 torch.distributed.fsdp.FullyShardedDataParallel (FSDP1),
                device_id=cpu, use_orig_params=True, each block wrapped by
                ModuleWrapPolicy
    pydist      pydist.fully_shard, collectives through shared memory (its
                default here: every rank on this host)
    pydist_pg   the same with shm=False: collectives on the gloo group
    torch_ddp   torch.nn.parallel.DistributedDataParallel (every rank keeps everything)
    pydist_ddp  pydist.DistributedDataParallel
    torch_hsdp  torch's fully_shard on a 2 x N/2 ("replicate", "shard") mesh (HSDP)
    pydist_hsdp pydist.fully_shard on the same mesh

The HSDP modes run only when named (``--modes torch_hsdp,pydist_hsdp``, or
``--hsdp`` to add both to the default six); their "paired" is against
torch_hsdp.

"paired" is the median over rounds of a mode's step / torch FSDP2's within a
round, "vs fsdp1" the same against torch FSDP1's, and the line under each
table the same for pydist.fully_shard against pydist DDP. Every other round
runs the modes in reverse order. ``--modes`` builds and times only the modes
named (all six by default): ``--modes pydist,pydist_ddp`` times pydist's two
wrappers in processes that run nothing else, as a training job does (torch's
sharded modes stepping in the same processes slow pydist's sharded step more
than its DDP step; see benchmarks/RESULTS.md).
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
from typing import Callable, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from pydist.spawn import run_ranks  # noqa: E402


def _linear_relu():
    return nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(8)])


def _linear_ln():
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(400)])


class SmallTransformer(nn.Module):
    """Pre-norm encoder blocks (the units), then a norm and a head (the root's)."""

    def __init__(self, layers: int = 4, d_model: int = 256, heads: int = 4):
        super().__init__()
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, d_model)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).flatten(0, 1))  # 2-D: a 3-D Linear returns a view, which FSDP2 warns about


class Model(NamedTuple):
    name: str  # as the table prints it
    build: Callable[[], nn.Module]
    input_shape: tuple  # one rank's batch


MODELS = {
    "linear": Model("8x Linear(1024)+ReLU", _linear_relu, (64, 1024)),
    "ln400": Model("400x (Linear(64)+LayerNorm)", _linear_ln, (64, 64)),
    "transformer": Model("4x TransformerEncoderLayer(256, 4 heads)", SmallTransformer, (8, 64, 256)),
}
DEFAULT_MODELS = "linear,transformer"
MODES = ("torch", "torch_fsdp1", "pydist", "pydist_pg", "torch_ddp", "pydist_ddp")
HSDP_MODES = ("torch_hsdp", "pydist_hsdp")


def _blocks(model: nn.Module) -> list:
    """The units below the root: the encoder layers, or the Sequential's blocks."""
    return list(model.layers) if isinstance(model, SmallTransformer) else list(model)


def _build(mode: str, model_key: str, world_size: int):
    torch.manual_seed(0)
    model = MODELS[model_key].build()
    if mode == "torch_fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({type(_blocks(model)[0])})  # the root is wrapped anyway
        model = FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                                         use_orig_params=True)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    if mode.endswith("_ddp"):
        import pydist

        ddp = torch.nn.parallel.DistributedDataParallel if mode == "torch_ddp" else pydist.DistributedDataParallel
        model = ddp(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    from torch.distributed.device_mesh import init_device_mesh

    if mode.startswith("torch"):
        from torch.distributed.fsdp import fully_shard
    else:
        from pydist import fully_shard
    if mode.endswith("_hsdp"):
        kwargs = {"mesh": init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))}
    elif mode == "torch":
        kwargs = {"mesh": init_device_mesh("cpu", (world_size,))}
    else:
        kwargs = {"shm": mode == "pydist"}
    for block in _blocks(model):
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


def _input(model_key: str, rank: int) -> torch.Tensor:
    return torch.randn(*MODELS[model_key].input_shape, generator=torch.Generator().manual_seed(rank))


def _fsdp1_local_numel(model) -> int:
    """Elements of FSDP1's local flat-parameter shards (padding included)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return sum(m._handle.flat_param.numel() for m in FullyShardedDataParallel.fsdp_modules(model) if m._handle)


def _time_rank(rank, world_size, model_key, rounds, steps, modes):
    x = _input(model_key, rank)
    built = {mode: _build(mode, model_key, world_size) for mode in modes}
    steps_fn = {mode: _step_fn(model, opt, x) for mode, (model, opt) in built.items()}
    for fn in steps_fn.values():
        for _ in range(2):
            fn()
    times = {mode: [] for mode in modes}
    for i in range(rounds):
        # Every other round in reverse (A B .. B A): a mode that runs late in
        # one round runs early in the next, so whatever a position costs (the
        # heap and caches the mode before it leaves, drift over the round)
        # falls on every mode alike and cancels in the per-round ratios.
        for mode in modes if i % 2 == 0 else modes[::-1]:
            fn = steps_fn[mode]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[mode].append((time.perf_counter() - t0) / steps)
    psi = sum(p.numel() for p in MODELS[model_key].build().parameters())
    memory = {}
    for mode, (model, opt) in built.items():
        nbytes = _persistent(model, opt)
        if mode in ("pydist", "pydist_pg", "pydist_hsdp"):  # and the unshard pool, memory it keeps between steps
            from pydist.fsdp import persistent_bytes

            nbytes += persistent_bytes(model).pools
        if mode.endswith("_ddp"):
            local_numel = psi / world_size  # replicated: no padding, and no sharding
        elif mode in ("torch", "torch_hsdp"):  # DTensor local shards are padded per parameter on dim 0
            local_numel = sum(_local(p).untyped_storage().nbytes() // 4 for p in model.parameters())
        elif mode == "torch_fsdp1":
            local_numel = _fsdp1_local_numel(model)
        else:
            local_numel = sum(u.shard_numel for m in model.modules()
                              if (s := m.__dict__.get("_pydist_fsdp_state")) and (u := s.param_group))
        shard_ranks = world_size // 2 if mode.endswith("_hsdp") else world_size  # HSDP shards over half
        memory[mode] = {"persistent_bytes": nbytes, "padding_elems": local_numel - psi / shard_ranks}
    from pydist.fsdp import last_iteration_record

    exposed = last_iteration_record(built["pydist"][0]).exposed_ns() / 1e6 if "pydist" in built else float("nan")
    return {"times": times, "memory": memory, "psi": psi, "pydist_exposed_ms": exposed}


def _rss_rank(rank, world_size, model_key, mode, steps):
    x = _input(model_key, rank)
    model, opt = _build(mode, model_key, world_size)
    fn = _step_fn(model, opt, x)
    for _ in range(steps + 2):
        fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(model_key: str, world_size: int, rounds: int, steps: int, modes: tuple = MODES) -> dict:
    per_rank = run_ranks(_time_rank, world_size, args=(model_key, rounds, steps, modes), timeout=600)
    slower = {m: [max(r["times"][m][i] for r in per_rank) for i in range(rounds)] for m in modes}
    out = {"model": MODELS[model_key].name, "world_size": world_size, "psi": per_rank[0]["psi"], "modes": modes}
    for m in modes:
        out[f"{m}_ms"] = statistics.median(slower[m]) * 1e3
        out[f"{m}_persistent_MB"] = max(r["memory"][m]["persistent_bytes"] for r in per_rank) / 2**20
        out[f"{m}_padding_elems"] = max(r["memory"][m]["padding_elems"] for r in per_rank)
        rss = run_ranks(_rss_rank, world_size, args=(model_key, m, steps), timeout=300)
        out[f"{m}_peak_rss_MB"] = max(rss) / 2**20
    out["ideal_persistent_MB"] = 16 * out["psi"] / world_size / 2**20
    out["pydist_exposed_ms"] = max(r["pydist_exposed_ms"] for r in per_rank)
    def paired(m, base):
        return statistics.median(p / t for p, t in zip(slower[m], slower[base])) if base in slower else None

    for m in modes:
        out[f"{m}_paired"] = paired(m, "torch_hsdp" if m == "pydist_hsdp" else "torch")
        out[f"{m}_paired_fsdp1"] = paired(m, "torch_fsdp1")
        if m in ("pydist", "pydist_pg"):  # issue #14's second step-time target
            out[f"{m}_paired_pydist_ddp"] = paired(m, "pydist_ddp")
    return out


def _model_keys(text: str) -> list:
    keys = list(MODELS) if text == "all" else [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in MODELS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(f"unknown model(s) {unknown}: pick from {', '.join(MODELS)}, or all")
    return keys


def _modes(text: str) -> tuple:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES + HSDP_MODES]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"modes {text!r}: pick each at most once from "
                                         f"{', '.join(MODES + HSDP_MODES)}")
    return modes


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", "--world-size", type=int, default=2, dest="nprocs",
                        help="ranks (2 or 4 here; one process each, sharing the host's cores)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", type=_model_keys, default=DEFAULT_MODELS,
                        help=f"comma-separated: {', '.join(MODELS)}; or all (default: {DEFAULT_MODELS})")
    parser.add_argument("--modes", type=_modes, default=MODES,
                        help=f"comma-separated, timed in this order: {', '.join(MODES + HSDP_MODES)} "
                        f"(default: {', '.join(MODES)})")
    parser.add_argument("--hsdp", action="store_true", help="add torch_hsdp,pydist_hsdp (an even --nprocs >= 4)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.nprocs < 2:
        parser.error(f"--nprocs {args.nprocs}: sharding needs at least 2 ranks")
    if args.hsdp:
        args.modes += tuple(m for m in HSDP_MODES if m not in args.modes)
    if any(m in HSDP_MODES for m in args.modes) and (args.nprocs < 4 or args.nprocs % 2):
        parser.error(f"--nprocs {args.nprocs}: HSDP's 2 x N/2 mesh needs an even number of ranks, at least 4")
    results = [run(k, args.nprocs, args.rounds, args.steps, args.modes) for k in args.models]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        print(f"\n{r['model']}  ({r['world_size']} ranks, Psi = {r['psi']:,}; ideal persistent 16 Psi/N = "
              f"{r['ideal_persistent_MB']:.2f} MB; pydist's last step waited {r['pydist_exposed_ms']:.1f} ms "
              "on its collectives)")
        print(f"{'mode':<11} {'step(ms)':>9} {'vs torch':>9} {'paired':>7} {'vs fsdp1':>8} {'persist(MB)':>12} "
              f"{'padding':>8} {'peakRSS(MB)':>12}")
        for m in r["modes"]:
            ratio = f"{r[m + '_ms'] / r['torch_ms']:.2f}" if "torch_ms" in r else "-"
            paired = _ratio(r[m + "_paired"]) if m not in ("torch", "torch_hsdp") else "-"
            paired1 = _ratio(r[m + "_paired_fsdp1"]) if m != "torch_fsdp1" else "-"
            print(f"{m:<11} {r[m + '_ms']:>9.1f} {ratio:>9} {paired:>7} {paired1:>8} {r[m + '_persistent_MB']:>12.2f} "
                  f"{r[m + '_padding_elems']:>8.0f} {r[m + '_peak_rss_MB']:>12.1f}")
        against_ddp = [f"{r[m + '_paired_pydist_ddp']:.2f} ({transport})"
                       for m, transport in (("pydist", "shm"), ("pydist_pg", "gloo"))
                       if r.get(m + "_paired_pydist_ddp") is not None]
        if against_ddp:
            print("pydist.fully_shard / pydist DDP, paired per round: " + ", ".join(against_ddp))


if __name__ == "__main__":
    main()
