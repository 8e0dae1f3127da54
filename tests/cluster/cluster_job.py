"""What each rank runs in tests/cluster (under torchrun or Slurm-style
launches on pydist.cluster_emulator). ``python cluster_job.py MODE OUT_DIR``
writes ``OUT_DIR/rank{R}.json``.

Modes:
  collectives  all-reduce, reduce-scatter and all-gather on the transport
               pydist picks, integer-valued data (the exact answer known),
               odd sizes (padding), bf16; against gloo's on the same data
  ddp          pydist DDP and torch DDP, same seeds and data, 3 SGD steps
  fsdp         pydist.fully_shard (FULL_SHARD) and torch FSDP2, 3 Adam steps
  fault        pydist DDP (FAULT_WRAPPER=ddp_plain: on the bare group; fsdp: the sharded wrapper)
               stepping until the test faults a host; records the error
  predict      pydist DDP recorded (PYDIST_TRACE=OUT_DIR/trace) at the cluster's link rate; then
               rank 0 asks for SLOW_RATE (cluster_emulator.request_rate) and every rank times
               steps at another bucket cap: what the predictor is held to
"""

import hashlib
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

import pydist
from pydist import topology
from pydist import transport as transports


def model_of(seed: int, width: int = 64, depth: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


def batch(step: int, rank: int, width: int = 64):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def run_collectives(out: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    t = transports.open_shm(dist.group.WORLD, wanted=None)
    out["transport"] = t.name if t is not None else "process_group"
    checks = {}
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (4096, 4099, 6):
            x = (torch.arange(numel) % 7 + rank).to(dtype)
            want = sum((torch.arange(numel) % 7 + r) for r in range(world)).to(dtype) * 0.5
            got = x.clone()
            t.all_reduce(got, 0.5).wait()
            checks[f"all_reduce/{dtype}/{numel}"] = bool(torch.equal(got, want))
            out.setdefault("ar_bits", []).append(got.float().sum().item())
        shard = 1000
        inp = (torch.arange(shard * world) % 11 + 3 * rank).to(dtype)
        res = torch.empty(shard, dtype=dtype)
        t.reduce_scatter(inp, res, 1.0).wait()
        full = sum((torch.arange(shard * world) % 11 + 3 * r) for r in range(world)).to(dtype)
        checks[f"reduce_scatter/{dtype}"] = bool(torch.equal(res, full[rank * shard:(rank + 1) * shard]))
        mine = (torch.arange(shard) + 10000 * rank).to(torch.float32).to(dtype)
        gathered = torch.empty(shard * world, dtype=dtype)
        t.all_gather(mine, gathered).wait()
        want = torch.cat([(torch.arange(shard) + 10000 * r).to(torch.float32).to(dtype) for r in range(world)])
        checks[f"all_gather/{dtype}"] = bool(torch.equal(gathered, want))
    # all_gather_many (the sharded wrapper's batched gathers): the base class's path
    ins = [torch.full((3,), float(rank)), torch.full((5,), float(10 + rank))]
    outs = [[torch.empty(3), torch.empty(5)] for _ in range(world)]
    t.all_gather_many(ins, outs).wait()
    checks["all_gather_many"] = all(torch.equal(outs[q][0], torch.full((3,), float(q))) and
                                    torch.equal(outs[q][1], torch.full((5,), float(10 + q))) for q in range(world))
    out["checks"] = checks
    out["stats"] = t.stats()


def run_ddp(out: dict) -> None:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    rank = dist.get_rank()
    ours = pydist.DistributedDataParallel(model_of(0), bucket_cap_mb=0.01)
    plain = pydist.DistributedDataParallel(model_of(0), bucket_cap_mb=0.01, shm_allreduce=False)
    theirs = TorchDDP(model_of(0), bucket_cap_mb=0.01)
    # On gloo across hosts overlap_optimizer orders the link ([Note: priority on every link]).
    overlapped = pydist.DistributedDataParallel(model_of(0), bucket_cap_mb=0.01, shm_allreduce=False)
    out["transport"] = ours.allreduce_transport
    out["plain_transport"] = plain.allreduce_transport
    models = (ours, plain, theirs, overlapped)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    overlapped.overlap_optimizer(opts[-1])
    out["overlapped_transport"] = overlapped.reducer.transport.name
    for step in range(3):
        x, y = batch(step, rank)
        for m, opt in zip(models, opts):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    a, b = flat_params(ours.module), flat_params(theirs.module)
    out["max_diff_vs_torch"] = (a - b).abs().max().item()
    overlapped.wait_updates()
    # the same sums as plain's, in another order of launches
    out["overlapped_same_as_plain"] = torch.equal(flat_params(overlapped.module), flat_params(plain.module))
    out["overlapped_commits"] = overlapped.reducer.transport.stats().get("ordered_commits", 0)
    overlapped.overlap_optimizer(None)
    out["detached_transport"] = overlapped.reducer.transport.name
    groups = len(dist.distributed_c10d._world.pg_map)
    overlapped.overlap_optimizer(opts[-1])  # again: the ordered link's group is made once per wrapper
    out["reattached"] = [overlapped.reducer.transport.name, len(dist.distributed_c10d._world.pg_map) - groups]
    overlapped.overlap_optimizer(None)
    ours.overlap_optimizer(opts[0])  # the hierarchical transport stays as it is
    out["hierarchical_overlapped"] = ours.reducer.transport.name
    ours.overlap_optimizer(None)
    out["max_diff_plain_vs_torch"] = (flat_params(plain.module) - b).abs().max().item()
    # A simulated link goes on the cross-host leg only: the reducer's transport
    # stays hierarchical, its cross leg is the sim_net wrapper over the stream.
    simulated = pydist.DistributedDataParallel(model_of(0), sim_net="100Gbps,1us")
    out["sim_net"] = [simulated.reducer.transport.name, ours.reducer.transport.name]
    x, y = batch(0, rank)
    nn.functional.mse_loss(simulated(x), y).backward()
    out["params_sum"] = a.double().sum().item()
    out["params_hash"] = digest(a)


def _sharded_beside_torch(mesh=None) -> tuple:
    """pydist.fully_shard and torch's, each Linear a unit then the root, on
    ``mesh`` (None: the world; a callable: a fresh mesh per wrapper), 3 Adam
    steps on the same batches: (pydist's model, its full state dict, the
    largest difference from torch's)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from pydist.fsdp import full_state_dict

    rank = dist.get_rank()
    ours, theirs = model_of(0), model_of(0)
    for wrap, m in ((pydist.fully_shard, ours), (torch_fully_shard, theirs)):
        kwargs = {"mesh": mesh()} if mesh is not None else {}
        for block in m:
            wrap(block, **kwargs)
        wrap(m, **kwargs)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (ours, theirs)]
    for step in range(3):
        x, y = batch(step, rank)
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    mine = full_state_dict(ours)
    torch_full = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    return ours, mine, max((mine[k] - torch_full[k]).abs().max().item() for k in torch_full)


def run_fsdp(out: dict) -> None:
    """FULL_SHARD across hosts, then HSDP with each host's ranks as the shard
    group (the mesh's rows are the hosts, whatever order the launcher
    numbered the ranks in), each beside torch's on the same mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    from pydist import topology
    from pydist.fsdp._utils import _root_state

    ours, mine, out["max_diff_vs_torch"] = _sharded_beside_torch()
    out["transport"] = _root_state(ours).transport.name
    out["params_hash"] = digest(torch.cat([mine[k].reshape(-1) for k in sorted(mine)]))
    hosts = torch.tensor(topology.of().hosts)  # (replicas, shards): row h is host h's ranks
    ours, mine, out["hsdp_max_diff_vs_torch"] = _sharded_beside_torch(
        lambda: DeviceMesh("cpu", hosts, mesh_dim_names=("replicate", "shard")))
    root = _root_state(ours)
    out["hsdp_transports"] = [root.transport.name, root.replicate_transport.name]
    out["hsdp_params_hash"] = digest(torch.cat([mine[k].reshape(-1) for k in sorted(mine)]))


def run_fault(out: dict, out_path: str) -> None:
    rank = dist.get_rank()
    wrapper = os.environ.get("FAULT_WRAPPER", "ddp")
    if wrapper == "fsdp":
        model = model_of(0, width=256)
        for block in model:
            pydist.fully_shard(block)
        pydist.fully_shard(model)
    else:  # "ddp", or "ddp_plain": the bare process group (shm_allreduce=False)
        model = pydist.DistributedDataParallel(model_of(0, width=256), shm_allreduce=wrapper != "ddp_plain")
        out["transport"] = model.allreduce_transport
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    started = None
    try:
        while True:
            x, y = batch(step, rank, 256)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            step += 1
            if step == 3:
                with open(out_path + ".ready", "w") as f:
                    f.write(str(time.time()))
            time.sleep(0.05)
    except Exception as exc:  # noqa: BLE001 - the test reads what the rank said
        out["error"] = str(exc)
        out["error_time"] = time.time()
        out["steps"] = step


def run_predict(out: dict, out_dir: str) -> None:
    from pydist import cluster_emulator, overlap
    from pydist.overlap import hooks

    rank = dist.get_rank()
    x, y = batch(0, rank, 256)

    def step(ddp):
        ddp.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()

    # 4 x Linear(256, 256): 1.05 MB of gradients; buckets of unlike sizes (first cap below the cap)
    directory = os.path.join(out_dir, "trace")
    os.environ["PYDIST_TRACE"] = directory
    try:
        recorded = pydist.DistributedDataParallel(model_of(0, width=256), bucket_cap_mb=0.3, first_bucket_cap_mb=0.1)
    finally:
        del os.environ["PYDIST_TRACE"]
    for _ in range(int(os.environ.get("RECORD_STEPS", "6"))):
        dist.barrier()
        step(recorded)
    hooks.TraceSession.get(directory).write()
    if rank == 0:
        cluster_emulator.request_rate(os.environ["SLOW_RATE"])
    dist.barrier()
    measured = pydist.DistributedDataParallel(model_of(0, width=256), bucket_cap_mb=float(os.environ["MEASURE_CAP_MB"]))
    overlap.record(measured)
    for _ in range(2):  # the first rebuilds the buckets
        step(measured)
    overlap.reset(measured)
    for _ in range(int(os.environ.get("MEASURE_STEPS", "4"))):
        dist.barrier()
        step(measured)
    out["measured_ms"] = [r.finalize_end_ms for r in overlap.records(measured)]


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    timeout = float(os.environ.get("JOB_TIMEOUT_S", "60"))
    result = pydist.init_process_group(timeout=timeout)
    rank = dist.get_rank()
    out = {"rank": rank, "init": result._asdict(), "topology": topology.of().describe()}
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        if mode == "collectives":
            run_collectives(out)
        elif mode == "ddp":
            run_ddp(out)
        elif mode == "fsdp":
            run_fsdp(out)
        elif mode == "fault":
            run_fault(out, path)
        elif mode == "predict":
            run_predict(out, out_dir)
        out["ok"] = True
    except Exception:
        out["traceback"] = traceback.format_exc()
        out["ok"] = False
    with open(path, "w") as f:
        json.dump(out, f)
    if mode == "fault":
        os._exit(3 if "error" in out else 0)  # a peer is gone: do not wait on it at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
