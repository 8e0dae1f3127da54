#!/usr/bin/env python3
"""A data-parallel training job on pydist: the torchrun tutorial's Trainer,
with snapshots that resume bitwise, under any launcher.

    torchrun --standalone --nproc_per_node=2 examples/train.py --snapshot snap.pt
    mpiexec -n 2 python examples/train.py --snapshot snap.pt       # MPICH; Open MPI: mpirun -np 2
    srun python examples/train.py --snapshot snap.pt               # Slurm, one task per rank
    python -m torch.distributed.launch --nproc_per_node=2 examples/train.py   # legacy: passes --local-rank

torchrun sets OMP_NUM_THREADS=1 in its workers; under mpiexec or srun, set
it yourself when ranks share a host's cores.

Whatever started it, the job joins with ``pydist.init_process_group()`` and
takes rank, world size and local rank from its result (only torchrun puts
them in ``os.environ``). In order, ``main()``:

  1. joins the job; warnings from every rank are logged with a rank prefix,
     everything else is printed by rank 0 only;
  2. data: rank 0 generates the dataset (datautils.py) and broadcasts it to
     the others over the process group (``share_dataset``); no shared file
     system needed;
  3. builds the model and optimizer from ``--seed``, the same on every rank;
  4. snapshot: if ``--snapshot`` exists, rank 0 reads the file and
     broadcasts its bytes; every rank decodes them with
     ``torch.load(weights_only=True)``, verifies their digest and checks
     that they fit this job (snapshots.py; an empty or damaged file is
     refused, never trained over);
  5. ``Trainer.train``: wraps the model in pydist's (or torch's) DDP, or
     with ``--fsdp`` shards it with ``pydist.fully_shard`` (each block a unit,
     then the root; see ``shard_model``), runs
     epochs over a ``DistributedSampler`` (``set_epoch`` every epoch), shows a
     progress bar on rank 0, snapshots every ``--save-every`` epochs and
     after the last; a job restarted by ``torchrun --max-restarts`` resumes
     from the last snapshot and ends bitwise where an uninterrupted run ends;
  6. reports samples/s and pydist's record of the last step's overlap; with
     ``--compare-torch``, trains again from the same seed under torch's DDP
     and prints the largest parameter difference between the two.

[Note: the sharded job]
With ``--fsdp`` each rank keeps 1/N of the parameters, gradients and AdamW
state. The snapshot's MODEL_STATE is still the full state dict under the
bare model's keys (``pydist.fsdp.full_state_dict``, gathered by every rank,
written by rank 0), so it loads into the bare model as a DDP snapshot does;
OPTIMIZER_STATE is a list, rank r's optimizer state over its own shards
(the DTensors' local tensors: ``_local_state``, put back on the parameters'
meshes at load: ``_on_parameters``), so a sharded snapshot resumes at the
same world size only (as RNG states and sampler shards already require).
The optimizer is built after sharding: ``model.parameters()`` are then
FSDP2's DTensor parameters. At two ranks every
averaged gradient element is ``g_0/2 + g_1/2`` under both wrappers and AdamW
works element by element, so a sharded job ends bitwise where the DDP job
(pydist's or torch's) ends.

To make it yours, replace the models and data in datautils.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import pydist
from pydist.rendezvous import detect
from datautils import ModelConfig, build_model, corpus_vocabulary, loss_fn, make_dataset
from snapshots import SnapshotMismatch, capture_rng_state, check_fits, load_bytes, restore_rng_state, save_atomic

try:
    from tqdm import tqdm
except ImportError:  # the job runs without it, printing one line per epoch
    tqdm = None

log = logging.getLogger("train")

DEFAULTS = {  # per model: hidden width, depth, dataset size
    "mlp": {"width": 512, "depth": 4, "samples": 8192},
    "transformer": {"width": 64, "depth": 2, "samples": 2048},
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="data-parallel training job on pydist (see the module docstring)")
    parser.add_argument("--ddp", choices=("pydist", "torch"), default="pydist", help="which DDP wraps the model")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with pydist.fully_shard (each block a "
                        "unit, then the root) instead of wrapping it in DDP")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where each rank trains; auto: its own GPU when every rank on this host can have "
                        "one (and not --fsdp, which shards CPU parameters), else the CPU")
    parser.add_argument("--backend", default=None,
                        help="torch.distributed backend: gloo, nccl, mpi (default: nccl on CUDA, else gloo)")
    parser.add_argument("--epochs", type=int, default=3, help="total epochs (a resumed job runs the rest)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp",
                        help="mlp: classifier on synthetic points; transformer: character LM on a generated corpus")
    parser.add_argument("--width", type=int, default=None, help="hidden width (MLP) or d_model (transformer)")
    parser.add_argument("--depth", type=int, default=None, help="hidden layers (MLP) or blocks (transformer)")
    parser.add_argument("--samples", type=int, default=None, help="dataset size")
    parser.add_argument("--snapshot", type=Path, default=None,
                        help="snapshot file: resumed from if it exists, written every --save-every epochs")
    parser.add_argument("--save-every", type=int, default=1, help="epochs between snapshots (and after the last)")
    parser.add_argument("--amp", action="store_true", help="mixed precision: bf16 autocast on CPU, "
                        "fp16 autocast with a gradient scaler on CUDA")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size (default: torch's 25)")
    parser.add_argument("--compare-torch", action="store_true",
                        help="then train again under torch's DDP (no snapshots) and compare the final parameters")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds the rendezvous and each collective may wait for a peer")
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="legacy_local_rank",
                        help="set by the legacy `python -m torch.distributed.launch`; pydist reads it itself")
    args = parser.parse_args(argv)
    if args.fsdp and args.ddp == "torch":
        parser.error("--fsdp shards the model with pydist.fully_shard; --ddp torch does not apply to it")
    if args.fsdp and args.bucket_cap_mb is not None:
        parser.error("--bucket-cap-mb sizes DDP's buckets; a sharded unit (--fsdp) is reduce-scattered whole")
    for name, value in DEFAULTS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "cuda" and (args.fsdp or not torch.cuda.is_available()):
        parser.error("--device cuda needs a CUDA device, and --fsdp shards CPU parameters only")
    if args.save_every < 1 or args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs, --batch-size and --save-every must be at least 1")
    return args


# --- the job's place in the world ------------------------------------------------


class Job(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    device: torch.device  # where this rank computes
    comm_device: torch.device  # where tensors must be for the backend's collectives
    backend: str
    launcher: str


def pick_device(args: argparse.Namespace) -> str:
    """--device auto: a GPU per rank when this host has one for each of its
    ranks (NCCL refuses two ranks on one GPU), else the CPU."""
    if args.device != "auto":
        return args.device
    if args.fsdp or not torch.cuda.is_available():
        return "cpu"
    info = detect(required=False)
    ranks_here = (info.local_world_size or info.world_size or 1) if info else 1
    return "cuda" if ranks_here <= torch.cuda.device_count() else "cpu"


def join_job(args: argparse.Namespace) -> Job:
    """Join the process group under whatever launcher started us."""
    on = pick_device(args)
    backend = args.backend or ("nccl" if on == "cuda" else "gloo")
    result = pydist.init_process_group(backend=backend, timeout=args.timeout)
    if on == "cuda":  # pydist has set the current device from the local rank
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    comm_device = device if result.backend == "nccl" else torch.device("cpu")
    return Job(result.rank, result.world_size, result.local_rank, device, comm_device, result.backend, result.launcher)


def setup_logging(rank: int) -> None:
    """Warnings from every rank, prefixed with it (Python warnings included);
    rank 0 also logs info."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr, force=True,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)


def say(job: Job, *message) -> None:
    """Print on rank 0 only (the job's output); other ranks stay quiet."""
    if job.rank == 0:
        print(*message, flush=True)


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds CUDA
    random.seed(seed)


# --- collectives the job itself issues ------------------------------------------


def share_tensors(tensors: list[torch.Tensor] | None, job: Job) -> list[torch.Tensor]:
    """Rank 0's ``tensors`` on every rank (others pass None): their shapes
    and dtypes first, in one ``broadcast_object_list``, then each tensor."""
    meta = [[(t.shape, t.dtype) for t in tensors] if job.rank == 0 else None]
    dist.broadcast_object_list(meta, src=0)
    shared = []
    for i, (shape, dtype) in enumerate(meta[0]):
        if job.rank == 0:
            buffer = tensors[i].to(job.comm_device).contiguous()
        else:
            buffer = torch.empty(shape, dtype=dtype, device=job.comm_device)
        dist.broadcast(buffer, src=0)
        shared.append(buffer.cpu())
    return shared


def share_dataset(args: argparse.Namespace, job: Job) -> TensorDataset:
    """Only rank 0 prepares the data; the others receive it over the group."""
    tensors = list(make_dataset(args.model, args.samples, args.seed).tensors) if job.rank == 0 else None
    return TensorDataset(*share_tensors(tensors, job))


def read_snapshot(path: Path, job: Job) -> dict | None:
    """Rank 0 reads the file (if any) and broadcasts whether it exists and
    its bytes; every rank decodes them with weights_only=True and verifies
    them (an existing empty file is refused). None when there is no file."""
    shared = None
    if job.rank == 0:
        exists = path.exists()
        data = path.read_bytes() if exists else b""
        shared = [torch.tensor([int(exists)], dtype=torch.uint8),
                  torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)]
    exists, raw = share_tensors(shared, job)
    return load_bytes(raw.numpy().tobytes(), path, job.device) if exists.item() else None


def all_gather_objects(obj, job: Job) -> list:
    gathered = [None] * job.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def global_sum(values: list[float], job: Job) -> list[float]:
    total = torch.tensor(values, dtype=torch.float64, device=job.comm_device)
    dist.all_reduce(total)
    return total.tolist()


def max_over_ranks(value: torch.Tensor, job: Job) -> float:
    value = value.detach().to(job.comm_device, torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def replica_spread(module: torch.nn.Module, job: Job) -> float:
    """Largest difference between any rank's parameters and rank 0's."""
    flat = torch.nn.utils.parameters_to_vector(module.parameters()).detach().to(job.comm_device)
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    return max_over_ranks((flat - reference).abs().max(), job)


# --- test-only fault injection ----------------------------------------------------

# [Note: test-only fault injection]
# tests/examples/test_train.py kills a rank where a real failure would, to
# check that the job recovers. TRAIN_FAULT=step:R:N sends SIGKILL to rank R
# after its Nth optimizer step; TRAIN_FAULT=save:0:E to rank 0 while it writes
# the snapshot after epoch E (bytes written, before fsync and rename). It fires
# only in a job's first attempt (TORCHELASTIC_RESTART_COUNT unset or 0), so a
# job restarted by torchrun runs through. Leave it unset.
_FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
_FAULT = os.environ.get("TRAIN_FAULT", "").split(":") if _FIRST_ATTEMPT else []


def inject_fault(where: str, rank: int, count: int) -> None:
    if len(_FAULT) == 3 and _FAULT[0] == where and int(_FAULT[1]) == rank and int(_FAULT[2]) == count:
        log.warning("TRAIN_FAULT=%s: killing this process (SIGKILL)", ":".join(_FAULT))
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


# --- the trainer -------------------------------------------------------------------


def shard_model(module: torch.nn.Module) -> torch.nn.Module:
    """``pydist.fully_shard`` bottom-up: each block its own unit (the MLP's
    hidden Linears, the transformer's encoder layers), then the root, which
    keeps what is left (embeddings, norm, head). In place; returns ``module``."""
    if hasattr(module, "blocks"):
        blocks = list(module.blocks.layers)
    else:
        blocks = [m for m in module.body if isinstance(m, torch.nn.Linear)]
    for block in blocks:
        pydist.fully_shard(block)
    return pydist.fully_shard(module)


def wrap_model(module: torch.nn.Module, ddp: str, job: Job, bucket_cap_mb: float | None) -> torch.nn.Module:
    """``ddp``: "pydist" or "torch" (DDP), or "fsdp" (sharded in place)."""
    device_ids = [job.device.index] if job.device.type == "cuda" else None
    if ddp == "fsdp":
        return shard_model(module)
    if ddp == "pydist":
        return pydist.DistributedDataParallel(module, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
    return TorchDDP(module, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)


def progress_bar(loader: DataLoader, job: Job, description: str):
    """tqdm on rank 0; it switches itself off when stderr is not a terminal."""
    if job.rank != 0 or tqdm is None:
        return loader
    return tqdm(loader, desc=description, unit="step", leave=False, dynamic_ncols=True, disable=None)


def _local_state(state_dict: dict) -> dict:
    """An optimizer's state dict with each DTensor replaced by its local
    tensor: this rank's piece, plain (see [Note: the sharded job])."""
    from torch.distributed.tensor import DTensor

    return {**state_dict, "state": {i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in per.items()}
                                    for i, per in state_dict["state"].items()}}


def _on_parameters(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``_local_state``'s dict with each local tensor shaped like its DTensor
    parameter's local tensor made a DTensor of that parameter's placements again."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, per in state_dict["state"].items():
        p = params[int(i)]
        state[i] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                          stride=p.stride())
                    if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.to_local().shape else v
                    for k, v in per.items()}
    return {**state_dict, "state": state}


class Trainer:
    """The tutorial's Trainer (``_run_batch``, ``_run_epoch``, snapshots with
    ``MODEL_STATE`` and ``EPOCHS_RUN``), wrapping its model in pydist's DDP
    (or torch's: ``ddp="torch"``), or sharding it (``ddp="fsdp"``: see
    [Note: the sharded job]). ``make_optimizer`` builds the optimizer over
    the parameters once the model is wrapped."""

    def __init__(self, model: torch.nn.Module, train_data: DataLoader, make_optimizer, job: Job,
                 job_record: dict, *, ddp: str = "pydist", amp: bool = False, snapshot_path: Path | None = None,
                 save_every: int = 1, bucket_cap_mb: float | None = None):
        self.job = job
        self.device = job.device
        self.module = model.to(job.device)  # the bare model (sharded in place under fsdp): what snapshots hold
        self.sharded = ddp == "fsdp"
        self.train_data = train_data
        self.job_record = job_record  # the snapshot's JOB entry: what a resuming job must match
        self.snapshot_path = snapshot_path
        self.save_every = save_every
        # --amp: bf16 autocast on CPU needs no loss scaling (bf16 has fp32's
        # exponent range); fp16 on CUDA does, so a GradScaler comes with it.
        cuda = job.device.type == "cuda"
        self.amp_dtype = (torch.float16 if cuda else torch.bfloat16) if amp else None
        self.scaler = torch.amp.GradScaler("cuda") if amp and cuda else None
        self.epochs_run = 0  # completed epochs: the next epoch to run
        self.steps_run = 0  # completed optimizer steps, over all epochs
        self.samples_run = 0  # samples this rank trained on in this process (for samples/s)
        self.train_seconds = 0.0  # time in epochs, snapshots excluded
        self.epoch_losses: list[float] = []  # global mean loss of each epoch this process ran
        self._rng_to_restore = None  # this rank's RNG state from the snapshot, applied as train() starts
        snapshot = read_snapshot(snapshot_path, job) if snapshot_path is not None else None
        if snapshot is not None:
            self._check_snapshot(snapshot)
            self.module.load_state_dict(snapshot["MODEL_STATE"])  # the full weights, into the bare model
        self.model = wrap_model(self.module, ddp, job, bucket_cap_mb)
        self.optimizer = make_optimizer(self.model.parameters())  # under fsdp: the local shards
        if snapshot is not None:
            self._load_snapshot(snapshot)

    def _check_snapshot(self, snapshot: dict) -> None:
        for warning in check_fits(snapshot, self.snapshot_path, self.job_record, self.module):
            if self.job.rank == 0:
                log.warning(warning)
        if snapshot["SAMPLER"]["batches_done"] != 0:
            raise SnapshotMismatch(f"snapshot {self.snapshot_path} was taken mid-epoch; this job resumes only "
                                   f"from epoch ends")
        theirs = snapshot["JOB"].get("fsdp", False)
        if theirs != self.sharded:
            raise SnapshotMismatch(
                f"snapshot {self.snapshot_path} was written by a {'sharded (--fsdp)' if theirs else 'DDP'} job, "
                f"this job is {'sharded (--fsdp)' if self.sharded else 'DDP'}: their optimizer states are laid out "
                f"differently. Start afresh from its weights (MODEL_STATE) under another --snapshot path")

    def _load_snapshot(self, snapshot: dict) -> None:
        """The rest of the snapshot, once the optimizer exists (see [Note: the sharded job])."""
        optimizer_state = snapshot["OPTIMIZER_STATE"]
        self.optimizer.load_state_dict(_on_parameters(self.optimizer, optimizer_state[self.job.rank])
                                       if self.sharded else optimizer_state)
        if self.scaler is not None and snapshot["SCALER_STATE"] is not None:
            self.scaler.load_state_dict(snapshot["SCALER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        self.steps_run = snapshot["STEPS_RUN"]
        self._rng_to_restore = snapshot["RNG_STATES"][self.job.rank]
        say(self.job, f"resuming from snapshot {self.snapshot_path}: {self.epochs_run} epochs, "
                      f"{self.steps_run} steps run")

    def _save_snapshot(self) -> None:
        rng_states = all_gather_objects(capture_rng_state(self.device), self.job)  # every rank takes part
        if self.sharded:  # collectives too: see [Note: the sharded job]
            model_state = pydist.fsdp.full_state_dict(self.module)
            optimizer_state = all_gather_objects(_local_state(self.optimizer.state_dict()), self.job)
        else:
            model_state, optimizer_state = self.module.state_dict(), self.optimizer.state_dict()
        if self.job.rank != 0:
            return
        sampler = self.train_data.sampler
        snapshot = {
            "MODEL_STATE": model_state,
            "EPOCHS_RUN": self.epochs_run,
            "STEPS_RUN": self.steps_run,
            "OPTIMIZER_STATE": optimizer_state,
            "SCALER_STATE": self.scaler.state_dict() if self.scaler is not None else None,
            "RNG_STATES": rng_states,
            "SAMPLER": {"epoch": self.epochs_run, "batches_done": 0, "seed": sampler.seed,
                        "num_replicas": sampler.num_replicas},
            "JOB": self.job_record,
        }
        save_atomic(snapshot, self.snapshot_path, before_commit=lambda: inject_fault("save", 0, self.epochs_run))
        say(self.job, f"epoch {self.epochs_run} | snapshot saved at {self.snapshot_path}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Zeroing instead of freeing keeps each .grad alive across steps, so
        # pydist's reducer can keep it inside its bucket (resident gradients)
        # instead of copying it in and out every step.
        self.optimizer.zero_grad(set_to_none=False)
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            loss = loss_fn(self.model(source), targets)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch: int, max_epochs: int) -> None:
        self.train_data.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        steps = len(self.train_data)
        loss_sum, samples = torch.zeros((), dtype=torch.float64, device=self.device), 0
        started = time.perf_counter()
        bar = progress_bar(self.train_data, self.job, f"epoch {epoch + 1}/{max_epochs}")
        for i, (source, targets) in enumerate(bar):
            if epoch == max_epochs - 1 and i == steps - 1 and hasattr(self.model, "set_record_timing"):
                self.model.set_record_timing(True)  # pydist records the job's last step
            source, targets = source.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            loss = self._run_batch(source, targets)
            self.steps_run += 1
            inject_fault("step", self.job.rank, self.steps_run)
            loss_sum += loss * len(source)
            samples += len(source)
            if bar is not self.train_data and i % 10 == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}")
        seconds = time.perf_counter() - started
        self.train_seconds += seconds
        self.samples_run += samples
        total_loss, total_samples = global_sum([loss_sum.item(), samples], self.job)
        self.epoch_losses.append(total_loss / total_samples)
        say(self.job, f"epoch {epoch + 1}/{max_epochs} | loss {self.epoch_losses[-1]:.4f} | {steps} steps x "
                      f"{self.job.world_size} ranks | {total_samples / seconds:,.0f} samples/s")

    def train(self, max_epochs: int) -> None:
        if self._rng_to_restore is not None:
            restore_rng_state(self._rng_to_restore, self.device)
        if self.epochs_run >= max_epochs:
            say(self.job, f"the snapshot has {self.epochs_run} epochs run already; nothing to train "
                          f"(ask for more with --epochs)")
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch, max_epochs)
            self.epochs_run = epoch + 1  # the tutorial saves the epoch index and resumes by rerunning it
            last = self.epochs_run == max_epochs
            if self.snapshot_path is not None and (self.epochs_run % self.save_every == 0 or last):
                self._save_snapshot()


# --- one training run, and what it reports ----------------------------------------


def prepare_dataloader(dataset: TensorDataset, batch_size: int, job: Job, seed: int) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, pin_memory=job.device.type == "cuda")


def model_config(args: argparse.Namespace) -> ModelConfig:
    vocab = len(corpus_vocabulary()) if args.model == "transformer" else 0
    return ModelConfig(args.model, args.width, args.depth, vocab)


def run_training(args: argparse.Namespace, job: Job, dataset: TensorDataset, ddp: str, snapshot_path: Path | None):
    config = model_config(args)
    seed_everything(args.seed)  # the same initial parameters on every rank
    model = build_model(config)
    seed_everything(args.seed + job.rank)  # this rank's own dropout masks
    job_record = {"model": config.as_dict(), "world_size": job.world_size, "seed": args.seed,
                  "batch_size": args.batch_size, "samples": args.samples, "amp": args.amp}
    if ddp == "fsdp":
        job_record["fsdp"] = True
    trainer = Trainer(model, prepare_dataloader(dataset, args.batch_size, job, args.seed),
                      lambda params: torch.optim.AdamW(params, lr=args.lr), job, job_record,
                      ddp=ddp, amp=args.amp, snapshot_path=snapshot_path, save_every=args.save_every,
                      bucket_cap_mb=args.bucket_cap_mb)
    trainer.train(args.epochs)
    return trainer


def report_throughput(trainer: Trainer, label: str, job: Job) -> float:
    """Print and return the job's samples/s over the epochs this process ran."""
    [samples] = global_sum([trainer.samples_run], job)
    seconds = max_over_ranks(torch.tensor(trainer.train_seconds), job)
    rate = samples / seconds if seconds else 0.0
    say(job, f"{label}: {count(len(trainer.epoch_losses), 'epoch')} on {job.world_size} ranks ({job.backend}, "
             f"{job.launcher}): {samples:,.0f} samples in {seconds:.2f} s, {rate:,.0f} samples/s")
    return rate


def report_sharded_overlap(trainer: Trainer, job: Job) -> None:
    """Per unit, rank 0's last step: its collectives and how long the compute thread waited for them."""
    record = pydist.fsdp.last_iteration_record(trainer.module)
    units: dict[str, list] = {}
    for r in record.collectives:
        units.setdefault(r.unit or "(root)", []).append(r)
    say(job, "\nrank 0, last step, per sharded unit (all-gathers / reduce-scatters, ms the compute thread waited):")
    for unit, records in units.items():
        gathers = sum(r.kind == "all_gather" for r in records)
        exposed = sum(r.exposed_ns for r in records) / 1e6
        say(job, f"  {unit:<24} {gathers} / {len(records) - gathers}  exposed {exposed:.3f} ms")


def report_overlap(trainer: Trainer, job: Job) -> None:
    if trainer.sharded:
        report_sharded_overlap(trainer, job)
        return
    record = trainer.model.last_iteration_record() if hasattr(trainer.model, "last_iteration_record") else None
    if record is None:
        return
    say(job, f"\nrank 0, last step, as pydist's C++ reducer recorded it (ms since the end of forward; "
             f"buckets all-reduced on {trainer.model.allreduce_transport}):")
    say(job, record.report())
    say(job, "'complete' = when the bucket's last all-reduce finished; 'done' = when finalize wrote it back;\n"
             "'hidden' = how long the bucket's communication ran while autograd still computed.")


def compare_with_torch(args: argparse.Namespace, job: Job, dataset: TensorDataset, ours: Trainer,
                       our_rate: float) -> None:
    say(job, "\nthe same training under torch.nn.parallel.DistributedDataParallel (no snapshots):")
    theirs = run_training(args, job, dataset, "torch", snapshot_path=None)
    their_rate = report_throughput(theirs, "torch DDP", job)
    say(job, f"\n{'epoch':>5} {'pydist loss':>12} {'torch loss':>12}")
    first = args.epochs - len(ours.epoch_losses)
    for i, loss in enumerate(ours.epoch_losses):
        say(job, f"{first + i + 1:>5} {loss:>12.6f} {theirs.epoch_losses[first + i]:>12.6f}")
    full = pydist.fsdp.full_state_dict(ours.module) if ours.sharded else dict(ours.module.named_parameters())
    pairs = [(full[name], p) for name, p in theirs.module.named_parameters()]
    difference = max_over_ranks(torch.stack([(a - b).abs().max() for a, b in pairs]).max(), job)
    ours_spread = "sharded" if ours.sharded else f"{replica_spread(ours.module, job):.3g}"
    say(job, f"\nmax |pydist - torch| over all parameters after {ours.steps_run} steps, on any rank: {difference:.3g}")
    say(job, f"max difference between replicas (rank 0 vs the others): pydist {ours_spread}, "
             f"torch {replica_spread(theirs.module, job):.3g}")
    if their_rate:
        say(job, f"samples/s, pydist / torch: {our_rate / their_rate:.2f} (one short run; "
                 f"benchmarks/bench_ddp.py measures)")


def main(argv=None) -> int:
    args = parse_args(argv)
    job = join_job(args)
    setup_logging(job.rank)
    wrapper = "fsdp" if args.fsdp else args.ddp
    label = "pydist FSDP (fully_shard per block)" if args.fsdp else f"{args.ddp} DDP"
    say(job, f"training {args.model} with {label} on {job.world_size} ranks ({job.backend} on {job.device}, "
             f"launched by {job.launcher}), {count(args.epochs, 'epoch')} of {args.samples} samples, "
             f"batch {args.batch_size} per rank{', amp' if args.amp else ''}")
    try:
        dataset = share_dataset(args, job)
        trainer = run_training(args, job, dataset, wrapper, args.snapshot)
        rate = report_throughput(trainer, "pydist FSDP" if args.fsdp else f"{args.ddp} DDP", job)
        report_overlap(trainer, job)
        if args.compare_torch:
            compare_with_torch(args, job, dataset, trainer, rate)
    except SnapshotMismatch as exc:  # every rank raises it; rank 0 says why
        if job.rank == 0:
            log.error("%s", exc)
        dist.destroy_process_group()
        return 2
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
