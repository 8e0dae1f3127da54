"""The snapshot file of examples/train.py: what it holds, how it is written
and read. No collectives here: train.py decides which rank does what.

A snapshot is a dict saved with ``torch.save``:

    MODEL_STATE      the unwrapped module's state_dict (no "module." prefix):
                     loads into the bare model, e.g. for inference
    EPOCHS_RUN       epochs completed; a resumed job starts at this epoch
    STEPS_RUN        optimizer steps completed
    OPTIMIZER_STATE  optimizer.state_dict()
    SCALER_STATE     the GradScaler's state_dict (fp16 on CUDA), else None
    RNG_STATES       one entry per rank, index = rank: torch's CPU (and CUDA)
                     generator and Python's ``random`` state
    SAMPLER          where the DistributedSampler resumes: its epoch (set_epoch),
                     the batches of that epoch already run (0: snapshots are
                     taken at epoch ends), its seed and number of replicas
    JOB              what the job was: model config, world size, seed, batch
                     size, samples; checked when resuming
    DIGEST           sha256 of everything above (``content_digest``), written by
                     ``save_atomic`` and verified by ``load_bytes``: see
                     [Note: the snapshot's digest]

``MODEL_STATE`` and ``EPOCHS_RUN`` are the keys of the torchrun tutorial's
snapshots, so code written against those keeps working. Everything in it is
plain tensors, numbers, strings, tuples, lists and dicts: it loads with
``torch.load(..., weights_only=True)``, which is the only way it is read.

[Note: atomic snapshot]
A job can die at any instant, also while writing. ``save_atomic`` writes the
new snapshot to ``PATH.partial`` in the same directory, flushes and fsyncs
it, then renames it over ``PATH`` (atomic on POSIX within one file system)
and fsyncs the directory so the rename itself is durable. At every instant
``PATH`` holds either the previous complete snapshot or the new one, never a
torn file. A leftover ``PATH.partial`` is garbage from an interrupted write;
the next save overwrites it.

[Note: the snapshot's digest]
``torch.load`` checks nothing inside a tensor record: bytes damaged after
the write (a bad disk, a truncated or garbled copy) load as other numbers,
and a resumed job trains on them without a word. So ``save_atomic`` adds
``DIGEST``, a sha256 over the snapshot's contents (every tensor's dtype,
shape and bytes, every other value's type and repr, dicts in their order,
which pickling keeps), and ``load_bytes`` recomputes it and refuses a
snapshot whose contents do not match, naming the file. The digest covers
the decoded contents rather than the file's bytes, so the file stays a
plain ``torch.save`` dict that ``torch.load`` reads as before. A snapshot
written before digests (no ``DIGEST`` key) resumes with a warning. An
existing file of 0 bytes is refused as well, never taken for "no snapshot":
the job would train from epoch 0 and overwrite it.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import warnings
from pathlib import Path
from typing import Callable

import torch

__all__ = ["SnapshotMismatch", "save_atomic", "partial_path", "load_bytes", "check_fits", "content_digest",
           "capture_rng_state", "restore_rng_state"]

DIGEST_KEY = "DIGEST"


class SnapshotMismatch(RuntimeError):
    """The snapshot was written by a job this one cannot continue."""


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def save_atomic(snapshot: dict, path: Path, before_commit: Callable[[], None] | None = None) -> None:
    """Write ``snapshot`` to ``path`` atomically. See [Note: atomic snapshot].
    ``before_commit`` runs after the bytes are written, before fsync and rename
    (train.py's test-only fault injector kills the process there)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    snapshot = {**snapshot, DIGEST_KEY: content_digest(snapshot)}  # see [Note: the snapshot's digest]
    tmp = partial_path(path)
    with open(tmp, "wb") as f:
        torch.save(snapshot, f)
        f.flush()
        if before_commit is not None:
            before_commit()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def content_digest(snapshot: dict) -> str:
    """The sha256 (hex) of ``snapshot``'s contents, its ``DIGEST`` entry
    aside. See [Note: the snapshot's digest]."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in snapshot.items() if k != DIGEST_KEY})
    return h.hexdigest()


def _feed(h, value) -> None:
    """Adds ``value`` to the hash ``h``: a tensor's dtype, shape and bytes;
    containers tagged with their kind and length, then their items; any other
    value's type and repr (numbers, strings, None: what weights_only loads)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(f"dict {len(value)};".encode())
        for key, item in value.items():
            _feed(h, key)
            _feed(h, item)
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__} {len(value)};".encode())
        for item in value:
            _feed(h, item)
    else:
        h.update(f"{type(value).__name__} {value!r};".encode())


def load_bytes(data: bytes, path: Path, device: torch.device) -> dict:
    """Decode a snapshot's bytes (those of an existing file) with
    ``weights_only=True`` and verify its digest; ``path`` is for error
    messages only (rank 0 read the file, the others got the bytes)."""
    if not data:  # see [Note: the snapshot's digest]
        raise SnapshotMismatch(
            f"snapshot {path} exists but is empty (0 bytes): a write that never finished (a full disk, an "
            f"interrupted copy), not a snapshot. Restore it from a good copy, or remove it to start afresh; "
            f"this job neither trains from scratch nor overwrites it")
    try:
        snapshot = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do
        raise SnapshotMismatch(
            f"snapshot {path} cannot be loaded with torch.load(weights_only=True): {exc}\n"
            f"It is not a snapshot of examples/train.py (or it is damaged); move it away or pass another --snapshot."
        ) from exc
    required = ("MODEL_STATE", "EPOCHS_RUN", "JOB", "RNG_STATES")
    missing = [k for k in required if k not in snapshot] if isinstance(snapshot, dict) else list(required)
    if missing:
        raise SnapshotMismatch(f"snapshot {path} lacks the keys {missing}: it was not written by examples/train.py")
    saved = snapshot.get(DIGEST_KEY)
    if saved is None:
        warnings.warn(f"snapshot {path} has no {DIGEST_KEY} (written before snapshots carried one): "
                      f"its contents cannot be verified", stacklevel=2)
    elif (actual := content_digest(snapshot)) != saved:
        raise SnapshotMismatch(
            f"snapshot {path} is damaged: its contents do not match the digest written with it (sha256 "
            f"{str(saved)[:16]}..., the contents hash to {actual[:16]}...). It changed after it was written (a bad "
            f"disk, a garbled copy); resuming would train on wrong values. Restore it from a good copy, or move it "
            f"away to start afresh")
    return snapshot


def check_fits(snapshot: dict, path: Path, job: dict, module: torch.nn.Module) -> list[str]:
    """Raise ``SnapshotMismatch`` naming the difference if this job cannot
    continue the one that wrote ``snapshot``: another model (name, shape
    config, or parameter shapes) or another world size. Returns warnings for
    differences that let it resume but make it a different run than an
    uninterrupted one (seed, batch size, samples)."""
    theirs = snapshot["JOB"]
    if theirs["model"] != job["model"]:
        raise SnapshotMismatch(
            f"snapshot {path} was written for model {_describe(theirs['model'])}, but this job trains model "
            f"{_describe(job['model'])} (mismatched: {_differences(theirs['model'], job['model'])}); pass the same "
            f"--model/--width/--depth, or another --snapshot path to start afresh"
        )
    if theirs["world_size"] != job["world_size"]:
        raise SnapshotMismatch(
            f"snapshot {path} was written by a job of world size {theirs['world_size']}, but this job has world size "
            f"{job['world_size']}: the snapshot's RNG states and sampler shards are per rank. Resume with "
            f"{theirs['world_size']} ranks, or start afresh from its weights (torch.load(path, weights_only=True)"
            f"['MODEL_STATE'] into the bare model) under another --snapshot path"
        )
    ours = module.state_dict()
    for name, tensor in snapshot["MODEL_STATE"].items():
        if name not in ours or ours[name].shape != tensor.shape:
            have = tuple(ours[name].shape) if name in ours else "no such entry"
            raise SnapshotMismatch(
                f"snapshot {path}: MODEL_STATE[{name!r}] has shape {tuple(tensor.shape)}, this model has {have}"
            )
    return [
        f"snapshot {path} was written with {key}={theirs.get(key)}, this job has {key}={job.get(key)}: it resumes, "
        f"but will not match an uninterrupted run"
        for key in ("seed", "batch_size", "samples", "amp")
        if theirs.get(key) != job.get(key)
    ]


def _describe(config: dict) -> str:
    return f"{config['name']} (" + ", ".join(f"{k} {v}" for k, v in config.items() if k != "name" and v) + ")"


def _differences(a: dict, b: dict) -> str:
    return ", ".join(f"{k} {a.get(k)} vs {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def capture_rng_state(device: torch.device) -> dict:
    """This rank's random state: what dropout, DataLoader seeds and any other
    draw will produce next."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
    }


def restore_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    random.setstate(state["python"])
