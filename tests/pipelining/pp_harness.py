"""What the pipelining tests run on each rank: the same model, seeds and
data under torch.distributed.pipelining and under pydist.pipelining, and the
single-process reference that runs the micro-batches in order."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

SEED = 1234
WIDTH = 16


def make_layers(n_layers: int, seed: int = SEED) -> list[nn.Module]:
    """n_layers blocks (Linear + Tanh), the last a bare Linear to 4 outputs."""
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n_layers - 1)]
    layers.append(nn.Linear(WIDTH, 4))
    return layers


def split(layers: list[nn.Module], num_stages: int) -> list[nn.Module]:
    """Layer by layer into num_stages consecutive parts."""
    per = len(layers) // num_stages
    return [nn.Sequential(*layers[i * per:(i + 1) * per]) for i in range(num_stages)]


def batches(steps: int, batch: int = 8, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, WIDTH, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(steps)]


def loss_fn(out, target):
    return nn.functional.mse_loss(out, target)


def reference(n_layers: int, n_microbatches: int, steps: int, lr: float = 0.1):
    """One process, the whole model, micro-batches in order, gradients
    divided by their count at the end (what a pipeline schedule computes)."""
    model = nn.Sequential(*make_layers(n_layers))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], None
    for step, (x, y) in enumerate(batches(steps)):
        opt.zero_grad()
        step_losses = []
        for xm, ym in zip(torch.tensor_split(x, n_microbatches), torch.tensor_split(y, n_microbatches)):
            loss = loss_fn(model(xm), ym)
            loss.backward()
            step_losses.append(loss.detach())
        for p in model.parameters():
            p.grad.div_(n_microbatches)
        if step == 0:
            grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        losses.append(step_losses)
    return {"losses": losses, "grads": grads, "params": [p.detach().clone() for p in model.parameters()]}


def run_pipeline(rank: int, world: int, lib: str, schedule: str, n_layers: int, stages_per_rank: int,
                 n_microbatches: int, steps: int, p2p=None, lr: float = 0.1, group=None, timeout=None):
    """This rank's stages under ``lib`` ("torch" or "pydist"). Returns, per
    local stage index, its first step's grads and last params (flattened in
    the whole model's parameter order), and the last stage's losses."""
    if lib == "torch":
        from torch.distributed import pipelining as pp
        extra = {}
    else:
        from pydist import pipelining as pp
        extra = {"p2p": p2p}
        if timeout is not None:
            extra["timeout"] = timeout
    num_stages = world * stages_per_rank
    parts = split(make_layers(n_layers), num_stages)
    mine = [s for s in range(num_stages) if s % world == rank]
    stages = [pp.PipelineStage(parts[s], s, num_stages, torch.device("cpu"), group=group, **extra) for s in mine]
    opt = torch.optim.SGD([p for s in mine for p in parts[s].parameters()], lr=lr)
    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "interleaved": pp.ScheduleInterleaved1F1B}[schedule]
    sched = cls(stages if schedule == "interleaved" else stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    all_losses, grads, first_output = [], {}, None
    for step, (x, y) in enumerate(batches(steps)):
        opt.zero_grad()
        losses = []
        kwargs = {}
        if num_stages - 1 in mine:
            kwargs = {"target": y, "losses": losses}
        args = (x,) if 0 in mine else ()
        merged = sched.step(*args, **kwargs)
        if merged is not None and step == 0:
            first_output = merged.detach()
        if step == 0:
            grads = {s: [p.grad.clone() for p in parts[s].parameters()] for s in mine}
        opt.step()
        if losses:
            all_losses.append([l.detach() for l in losses])
    params = {s: [p.detach().clone() for p in parts[s].parameters()] for s in mine}
    out = {"grads": grads, "params": params, "losses": all_losses, "output": first_output,
           "order": {r: [str(a) if a is not None else "" for a in acts] for r, acts in sched.pipeline_order.items()}}
    if lib == "pydist":
        out["carrier"] = sched.p2p_carrier
        sched.close()
    return out


def compare_job(rank: int, world: int, cases: list[tuple], n_layers: int, n_microbatches: int, steps: int,
                then_raise_at: int | None = None):
    """Every case (lib, schedule, stages_per_rank, p2p) in one job; results
    in case order. With ``then_raise_at``, one more pipeline (GPipe, shared
    memory) whose stage ``then_raise_at`` raises in its second forward: the
    last entry is what this rank raised (the processes survive a raise, so
    the same job can check it)."""
    results = []
    for lib, schedule, spr, p2p in cases:
        results.append(run_pipeline(rank, world, lib, schedule, n_layers, spr, n_microbatches, steps, p2p=p2p))
        dist.barrier()
    if then_raise_at is not None:
        import pp_failures

        try:
            pp_failures.faulty_job(rank, world, [(list(range(world)), "shm")], "gpipe", then_raise_at, "raise", 10.0)
            results.append("finished")
        except Exception as exc:
            results.append(f"{type(exc).__name__}: {exc}")
    return results


def run_2d(rank: int, world: int, lib: str, schedule: str, wrapper: str, n_layers: int, n_microbatches: int,
           steps: int, lr: float = 0.1):
    """(pp=2, dp=2): each stage wrapped by ``wrapper`` ("ddp": the library's
    own DDP; "fsdp": pydist.fully_shard), each dp rank on its half of the batch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    pp_rank, dp_rank = dist.get_rank(pp_group), dist.get_rank(dp_group)
    # lib: "torch" (torch's pipelining and DDP), "pydist" (pydist's), or "pydist+torch_ddp".
    if lib == "torch":
        from torch.distributed import pipelining as pp
        from torch.nn.parallel import DistributedDataParallel as DDP
    elif lib == "pydist+torch_ddp":
        from pydist import pipelining as pp
        from torch.nn.parallel import DistributedDataParallel as DDP
    else:
        from pydist import pipelining as pp
        from pydist import DistributedDataParallel as DDP
    parts = split(make_layers(n_layers), 2)
    part = parts[pp_rank]
    if wrapper == "ddp":
        module = DDP(part, process_group=dp_group)
    else:
        import pydist

        module = pydist.fully_shard(part, mesh=mesh["dp"])
    stage = pp.PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=pp_group)
    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    all_losses, grads = [], None
    for step, (x, y) in enumerate(batches(steps, batch=16)):
        x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        opt.zero_grad()
        losses = []
        if pp_rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        if step == 0 and wrapper == "ddp":  # a sharded wrapper's are flat shards: its parameters are compared
            grads = [p.grad.clone() for p in module.parameters()]
        opt.step()
        if losses:
            all_losses.append([l.detach() for l in losses])
    if wrapper == "ddp":
        params = [p.detach().clone() for p in module.parameters()]
    else:
        import pydist.fsdp

        params = [t.clone() for t in pydist.fsdp.full_state_dict(module).values()]
    return {"pp_rank": pp_rank, "dp_rank": dp_rank, "grads": grads, "params": params, "losses": all_losses}


def job_2d(rank: int, world: int, cases: list[tuple], n_layers: int, n_microbatches: int, steps: int):
    out = []
    for lib, schedule, wrapper in cases:
        out.append(run_2d(rank, world, lib, schedule, wrapper, n_layers, n_microbatches, steps))
        dist.barrier()
    return out


def reference_2d(n_layers: int, n_microbatches: int, steps: int, lr: float = 0.1, dp: int = 2):
    """One process: each dp rank's half of the batch run micro-batch by
    micro-batch into its own accumulated gradient S_k, then the DDP average
    sum_k S_k * (1/dp) (a two-term sum at dp=2), then / n_microbatches."""
    model = nn.Sequential(*make_layers(n_layers))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], None
    for step, (x, y) in enumerate(batches(steps, batch=16)):
        sums = []
        step_losses = []
        for k in range(dp):
            opt.zero_grad()
            xk, yk = x.chunk(dp)[k], y.chunk(dp)[k]
            for xm, ym in zip(torch.tensor_split(xk, n_microbatches), torch.tensor_split(yk, n_microbatches)):
                loss = loss_fn(model(xm), ym)
                loss.backward()
                step_losses.append((k, loss.detach()))
            sums.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = sums[0][i] * (1.0 / dp)
            for k in range(1, dp):
                total = total + sums[k][i] * (1.0 / dp)
            p.grad = total.div_(n_microbatches)
        if step == 0:
            grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        losses.append(step_losses)
    return {"losses": losses, "grads": grads, "params": [p.detach().clone() for p in model.parameters()]}


def lab_job(rank: int, world: int, csv_dir: str):
    """Records, the trace and torch's CSV form on one 2-rank pipeline."""
    from pydist import pipelining as pp

    out = {}
    parts = split(make_layers(4), 2)
    stage = pp.PipelineStage(parts[rank], rank, 2, torch.device("cpu"))
    sched = pp.Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    (x, y), = batches(1)
    args, kwargs = ((x,), {}) if rank == 0 else ((), {"target": y})
    sched.step(*args, **kwargs)
    out["records"] = sched.records()  # PYDIST_TRACE turned recording on
    out["carrier"] = sched.p2p_carrier
    # torch's CSV form: write the running order, replay it (and a GPipe order written by hand) in new schedules
    path = f"{csv_dir}/1f1b.csv"
    if rank == 0:
        sched._dump_csv(path, format="compute_comms")
    dist.barrier()
    out["csv"] = open(path).read()
    sched.close()
    grads = {}
    for name, source in (("replayed", path), ("gpipe_by_hand", f"{csv_dir}/gpipe.csv")):
        parts = split(make_layers(4), 2)
        stage = pp.PipelineStage(parts[rank], rank, 2, torch.device("cpu"))
        replay = pp.Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
        replay._load_csv(source, format="compute_comms" if name == "replayed" else "compute_only")
        replay.clear_records()
        replay.step(*args, **kwargs)
        out[name + "_order"] = [(r.action, r.microbatch) for r in replay.records() if r.action in ("forward", "backward")]
        grads[name] = [p.grad.clone() for p in parts[rank].parameters()]
        replay.close()
    # PYDIST_SIM_NET: every message held for the link's time (latency + bytes / bandwidth); the bits unchanged
    import os
    import time

    os.environ["PYDIST_SIM_NET"] = "100Gbps,20ms"
    parts = split(make_layers(4), 2)
    stage = pp.PipelineStage(parts[rank], rank, 2, torch.device("cpu"))
    slow = pp.ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    dist.barrier()
    start = time.perf_counter()
    slow.step(*args, **kwargs)
    out["sim_net_step_s"] = time.perf_counter() - start
    grads["sim_net"] = [p.grad.clone() for p in parts[rank].parameters()]
    slow.close()
    del os.environ["PYDIST_SIM_NET"]
    out["grads"] = grads
    return out
