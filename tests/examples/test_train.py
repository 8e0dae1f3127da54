"""examples/train.py as users run it: whole jobs under torchrun, mpiexec, the
legacy launcher and a Slurm environment, checked from outside.

Every job trains the same tiny MLP (2 ranks, 4 epochs of 8 steps) on the same
seed, so each must end with parameters bitwise equal to one uninterrupted run
(the ``reference`` fixture, which also trains the model again under torch's
DDP and prints the difference): resumed after epoch 2, restarted by torchrun
after a rank was killed mid-epoch, started by another launcher. Runs are
shared across assertions where one run answers several questions. Every
subprocess has a timeout, and every job a process-group timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))

from datautils import ModelConfig, build_model  # noqa: E402
from snapshots import SnapshotMismatch, check_fits, content_digest, load_bytes, save_atomic  # noqa: E402

TINY = ["--samples", "256", "--batch-size", "16", "--width", "32", "--depth", "2", "--timeout", "60"]
TINY_CONFIG = ModelConfig("mlp", 32, 2)
STEPS_PER_EPOCH = 256 // 2 // 16
JOB_TIMEOUT = 240  # seconds for one job; a few under load on 2 cores
# First on every job's PYTHONPATH: a warning that pydist's or the example's own
# code makes torch (or Python) raise fails the job (its sitecustomize.py says how).
PYTHONPATH = os.pathsep.join([str(Path(__file__).with_name("warnings_are_errors")), str(REPO)])


def run_job(launcher: list[str], args: list, timeout: float = JOB_TIMEOUT, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRAIN_FAULT"}
    environment.update(PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", **env)
    command = [*launcher, str(EXAMPLES / "train.py"), *TINY, *map(str, args)]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def torchrun(args: list, nproc: int = 2, extra: tuple = (), **env) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra]
    return run_job(launcher, args, **env)


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"job failed (rc {done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def assert_same_training(ours: dict, reference: dict) -> None:
    """Bitwise equal parameters, optimizer state and RNG states, after the
    same number of epochs and steps."""
    assert (ours["EPOCHS_RUN"], ours["STEPS_RUN"]) == (reference["EPOCHS_RUN"], reference["STEPS_RUN"])
    assert ours["MODEL_STATE"].keys() == reference["MODEL_STATE"].keys()
    for name, tensor in reference["MODEL_STATE"].items():
        assert torch.equal(ours["MODEL_STATE"][name], tensor), f"parameter {name} differs from the uninterrupted run"
    for index, state in reference["OPTIMIZER_STATE"]["state"].items():
        for key, value in state.items():
            assert torch.equal(ours["OPTIMIZER_STATE"]["state"][index][key], value), f"optimizer {index}.{key}"
    for rank, state in enumerate(reference["RNG_STATES"]):
        assert torch.equal(ours["RNG_STATES"][rank]["torch"], state["torch"]), f"rank {rank}'s RNG state"


def epoch_losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^epoch \d+/\d+ \| loss ([0-9.]+)", stdout, re.MULTILINE)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, str]:
    """One uninterrupted run of 4 epochs, snapshot after each; then the same
    training under torch's DDP (--compare-torch, as `make demo`)."""
    path = tmp_path_factory.mktemp("reference") / "snapshot.pt"
    stdout = ok(torchrun(["--epochs", 4, "--snapshot", path, "--compare-torch"]))
    return path, stdout


def test_a_warning_from_this_repositorys_code_fails_a_job(tmp_path):
    """The hook every example job runs under: torch's deprecation warning for
    all_gather_into_tensor, which torch attributes to its own c10d_logger.py,
    is an error when a file of this repository made the call, and only a
    warning from a file elsewhere."""
    code = ("import os, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo', init_method='file://' + os.environ['STORE'], rank=0, world_size=1)\n"
            "dist.all_gather_into_tensor(torch.empty(2), torch.ones(2))\n")
    inside, outside = REPO / "build" / "warns_from_the_repository.py", tmp_path / "warns_from_elsewhere.py"
    inside.parent.mkdir(exist_ok=True)
    try:
        for script in (inside, outside):
            script.write_text(code)
        done = [subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                               env=dict(os.environ, PYTHONPATH=PYTHONPATH, STORE=str(tmp_path / f"store{i}")))
                for i, script in enumerate((inside, outside))]
    finally:
        inside.unlink()
    assert done[0].returncode != 0 and "RuntimeError: a warning from this repository's code" in done[0].stderr
    assert "all_gather_into_tensor` is deprecated" in done[0].stderr, done[0].stderr
    assert done[1].returncode == 0 and "FutureWarning" in done[1].stderr, done[1].stderr


def test_uninterrupted_run_is_torch_ddp_bitwise(reference):
    path, stdout = reference
    steps = 4 * STEPS_PER_EPOCH
    assert f"max |pydist - torch| over all parameters after {steps} steps, on any rank: 0\n" in stdout, stdout
    assert "max difference between replicas (rank 0 vs the others): pydist 0, torch 0\n" in stdout, stdout
    assert re.search(r"pydist DDP: 4 epochs on 2 ranks .* samples/s", stdout), stdout
    assert "rank 0, last step, as pydist's C++ reducer recorded it" in stdout
    assert re.search(rf"^iteration {steps - 1}: backward ended", stdout, re.MULTILINE), stdout
    losses = epoch_losses(stdout)
    assert len(losses) == 8 and losses[:4] == losses[4:], losses  # pydist's epochs, then torch's
    assert load(path)["EPOCHS_RUN"] == 4


def test_snapshot_loads_weights_only_into_the_bare_model(reference):
    snapshot = load(reference[0])
    assert {"MODEL_STATE", "EPOCHS_RUN", "STEPS_RUN", "OPTIMIZER_STATE", "SCALER_STATE", "RNG_STATES", "SAMPLER",
            "JOB"} <= snapshot.keys()
    model = build_model(TINY_CONFIG)
    model.load_state_dict(snapshot["MODEL_STATE"])  # strict: the unwrapped keys, no "module." prefix
    assert snapshot["SAMPLER"] == {"epoch": 4, "batches_done": 0, "seed": 0, "num_replicas": 2}
    assert snapshot["JOB"]["world_size"] == 2 and snapshot["JOB"]["model"] == TINY_CONFIG.as_dict()
    rng = snapshot["RNG_STATES"]
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"]), "each rank keeps its own RNG"


class NotAWeight:
    pass


def test_snapshot_reader_refuses_pickled_objects(tmp_path):
    """The job reads snapshots only through weights_only=True: an arbitrary
    object in the file is refused, not executed."""
    path = tmp_path / "evil.pt"
    torch.save({"MODEL_STATE": {}, "EPOCHS_RUN": 1, "JOB": {}, "RNG_STATES": [], "payload": NotAWeight()}, path)
    with pytest.raises(SnapshotMismatch, match=r"cannot be loaded with torch.load\(weights_only=True\)"):
        load_bytes(path.read_bytes(), path, torch.device("cpu"))


def test_resume_after_epoch_2_is_bitwise(reference, tmp_path):
    path = tmp_path / "snapshot.pt"
    ok(torchrun(["--epochs", 2, "--snapshot", path]))
    assert load(path)["EPOCHS_RUN"] == 2
    stdout = ok(torchrun(["--epochs", 4, "--snapshot", path]))
    assert f"resuming from snapshot {path}: 2 epochs, {2 * STEPS_PER_EPOCH} steps run" in stdout, stdout
    assert re.findall(r"^epoch (\d)/4 \|", stdout, re.MULTILINE) == ["3", "4"], stdout
    assert_same_training(load(path), load(reference[0]))


@pytest.mark.timeout(2 * JOB_TIMEOUT + 60)
def test_torchrun_restarts_a_killed_rank_from_the_last_snapshot(reference, tmp_path):
    """Rank 1 is SIGKILLed after step 20 (mid-epoch 3); torchrun restarts both
    ranks, which resume from the snapshot of epoch 2 and end where the
    uninterrupted run ends."""
    path = tmp_path / "snapshot.pt"
    kill_step = 2 * STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2
    done = torchrun(["--epochs", 4, "--snapshot", path], extra=("--max-restarts=1",),
                    TRAIN_FAULT=f"step:1:{kill_step}")
    stdout = ok(done)
    assert f"[rank 1] WARNING train: TRAIN_FAULT=step:1:{kill_step}: killing this process" in done.stderr
    assert f"resuming from snapshot {path}: 2 epochs, {2 * STEPS_PER_EPOCH} steps run" in stdout, stdout
    assert_same_training(load(path), load(reference[0]))


def test_snapshot_killed_mid_write_leaves_the_previous_one(reference, tmp_path):
    """Rank 0 is SIGKILLed while writing the snapshot of epoch 3, after the
    bytes and before fsync and rename: the file still holds epoch 2, whole."""
    path = tmp_path / "snapshot.pt"
    done = torchrun(["--epochs", 4, "--snapshot", path], TRAIN_FAULT="save:0:3")
    assert done.returncode != 0, done.stdout
    assert "epoch 2 | snapshot saved" in done.stdout and "epoch 3 | snapshot saved" not in done.stdout, done.stdout
    assert path.with_name(path.name + ".partial").exists()  # the write was under way
    snapshot = load(path)
    assert snapshot["EPOCHS_RUN"] == 2
    check_fits(snapshot, path, snapshot["JOB"], build_model(TINY_CONFIG))
    build_model(TINY_CONFIG).load_state_dict(snapshot["MODEL_STATE"])


def flip_tensor_bytes(path: Path, count: int = 64) -> str:
    """Inverts ``count`` bytes in the middle of the largest tensor record of
    the snapshot's zip (headers, central directory and pickle left intact,
    so ``torch.load`` still reads it); returns the record's name."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    header = info.header_offset
    name_length = int.from_bytes(data[header + 26:header + 28], "little")
    extra_length = int.from_bytes(data[header + 28:header + 30], "little")
    start = header + 30 + name_length + extra_length + info.file_size // 2 - count // 2
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return info.filename


@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_an_empty_snapshot_file_is_refused_not_restarted(tmp_path):
    """An existing 0-byte snapshot (a full disk, an interrupted copy) is no
    snapshot to resume, but not "no snapshot" either: both ranks refuse it,
    naming it, and it is left as it was (not trained over from epoch 0)."""
    path = tmp_path / "snapshot.pt"
    path.write_bytes(b"")
    done = torchrun(["--epochs", 1, "--snapshot", path])
    assert done.returncode != 0, done.stdout
    assert f"snapshot {path} exists but is empty (0 bytes)" in done.stderr, done.stderr
    assert "epoch 1/1" not in done.stdout and path.read_bytes() == b""


def test_snapshot_digest_covers_every_value(tmp_path):
    """save_atomic writes a digest of the contents; load_bytes verifies it
    and names the file when one value changed (a tensor element, a number,
    a shape), and takes a snapshot written before digests with a warning."""
    path = tmp_path / "snapshot.pt"
    snapshot = {"MODEL_STATE": {"w": torch.arange(6.0).view(2, 3)}, "EPOCHS_RUN": 2, "JOB": {"seed": 0},
                "RNG_STATES": [{"python": (3, (1, 2), None)}]}
    save_atomic(snapshot, path)
    loaded = load_bytes(path.read_bytes(), path, torch.device("cpu"))
    assert loaded["DIGEST"] == content_digest(snapshot) and torch.equal(loaded["MODEL_STATE"]["w"],
                                                                        snapshot["MODEL_STATE"]["w"])
    for change in (lambda s: s["MODEL_STATE"]["w"].view(-1)[4].add_(2.0 ** -20),
                   lambda s: s.update(EPOCHS_RUN=3),
                   lambda s: s["MODEL_STATE"].update(w=s["MODEL_STATE"]["w"].view(3, 2))):
        changed = torch.load(path, weights_only=True)
        change(changed)
        torch.save(changed, path.with_suffix(".changed"))
        with pytest.raises(SnapshotMismatch, match=rf"snapshot {path} is damaged: its contents do not match"):
            load_bytes(path.with_suffix(".changed").read_bytes(), path, torch.device("cpu"))
    torch.save(snapshot, path)  # as train.py wrote them before digests
    with pytest.warns(UserWarning, match="has no DIGEST"):
        load_bytes(path.read_bytes(), path, torch.device("cpu"))


@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_a_damaged_snapshot_is_refused_naming_it(reference, tmp_path):
    """64 bytes inverted inside a tensor record: torch.load reads the file
    without a word (another number in a weight), the job refuses it on its
    digest and leaves it as it was."""
    path = tmp_path / "snapshot.pt"
    shutil.copy(reference[0], path)
    flip_tensor_bytes(path)
    damaged = path.read_bytes()
    torch.load(path, weights_only=True)  # what torch checks: nothing inside a record
    done = torchrun(["--epochs", 5, "--snapshot", path])
    assert done.returncode != 0, done.stdout
    assert f"snapshot {path} is damaged: its contents do not match the digest written with it" in done.stderr, (
        done.stderr)
    assert "resuming from snapshot" not in done.stdout and path.read_bytes() == damaged


def test_snapshot_of_another_world_size_is_refused(reference):
    path = reference[0]
    before = path.read_bytes()
    # One rank, started as torchrun would start it, without the agent.
    done = run_job([sys.executable], ["--epochs", 5, "--snapshot", path], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    assert done.returncode != 0
    assert "was written by a job of world size 2, but this job has world size 1" in done.stderr, done.stderr
    assert path.read_bytes() == before


def test_snapshot_of_another_model_is_refused(reference):
    snapshot = load(reference[0])
    wider = ModelConfig("mlp", 64, 2)
    job = dict(snapshot["JOB"], model=wider.as_dict())
    expected = (r"written for model mlp \(width 32, depth 2\), but this job trains model mlp \(width 64, depth 2\) "
                r"\(mismatched: width 32 vs 64\)")
    with pytest.raises(SnapshotMismatch, match=expected):
        check_fits(snapshot, reference[0], job, build_model(wider))
    lm = ModelConfig("transformer", 32, 2, vocab=30)
    with pytest.raises(SnapshotMismatch, match=r"mismatched: name mlp vs transformer, vocab 0 vs 30"):
        check_fits(snapshot, reference[0], dict(snapshot["JOB"], model=lm.as_dict()), build_model(lm))


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (pip install mpich)")
def test_job_under_mpiexec_matches_torchrun(reference, tmp_path):
    path = tmp_path / "snapshot.pt"
    stdout = ok(run_job([shutil.which("mpiexec"), "-n", "2", sys.executable], ["--epochs", 4, "--snapshot", path]))
    assert "launched by mpich" in stdout, stdout
    assert_same_training(load(path), load(reference[0]))


@pytest.mark.parametrize("launcher", ["legacy", "slurm"])
def test_job_under_legacy_launcher_and_slurm_matches_torchrun(reference, tmp_path, launcher):
    """`python -m torch.distributed.launch` passes --local-rank; Slurm's srun
    is imitated by starting the ranks with the variables srun sets."""
    path = tmp_path / "snapshot.pt"
    args = ["--epochs", 4, "--snapshot", path]
    if launcher == "legacy":
        stdout = ok(run_job([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2"], args))
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRAIN_FAULT")}
        env.update(PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", SLURM_NTASKS="2", SLURM_NNODES="1",
                   SLURM_JOB_ID="1", SLURM_JOB_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
        command = [sys.executable, str(EXAMPLES / "train.py"), *TINY, *map(str, args)]
        ranks = [subprocess.Popen(command, env=dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)), cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        try:
            outputs = [rank.communicate(timeout=JOB_TIMEOUT) for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()
        for rank, (out, err) in zip(ranks, outputs):
            assert rank.returncode == 0, f"{out}\n{err}"
        stdout = outputs[0][0]
        assert "launched by slurm" in stdout, stdout
    assert_same_training(load(path), load(reference[0]))


def test_amp_trains_in_bf16_and_its_loss_decreases(reference, tmp_path):
    path = tmp_path / "snapshot.pt"
    stdout = ok(torchrun(["--epochs", 4, "--snapshot", path, "--amp"]))
    losses = epoch_losses(stdout)
    assert len(losses) == 4 and all(a > b for a, b in zip(losses, losses[1:])), losses
    ours, fp32 = load(path), load(reference[0])
    assert ours["JOB"]["amp"] is True
    weight = ours["MODEL_STATE"]["head.weight"]
    assert weight.dtype == torch.float32  # autocast computes in bf16, the parameters stay fp32
    assert not torch.equal(weight, fp32["MODEL_STATE"]["head.weight"]), "same bits as fp32: autocast did nothing"


def test_transformer_lm_trains(tmp_path):
    stdout = ok(torchrun(["--model", "transformer", "--epochs", 2, "--lr", "3e-3"]))
    losses = epoch_losses(stdout)
    assert len(losses) == 2 and losses[1] < losses[0], losses


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory) -> tuple[Path, str]:
    """The reference run sharded (--fsdp: each hidden Linear a unit, then the
    root), then again under torch's DDP."""
    path = tmp_path_factory.mktemp("fsdp_reference") / "snapshot.pt"
    stdout = ok(torchrun(["--fsdp", "--epochs", 4, "--snapshot", path, "--compare-torch"]))
    return path, stdout


def assert_same_sharded_training(ours: dict, reference: dict) -> None:
    """assert_same_training for sharded snapshots: OPTIMIZER_STATE is one state per rank."""
    assert len(ours["OPTIMIZER_STATE"]) == len(reference["OPTIMIZER_STATE"]) == 2
    for rank in range(2):
        assert_same_training(dict(ours, OPTIMIZER_STATE=ours["OPTIMIZER_STATE"][rank]),
                             dict(reference, OPTIMIZER_STATE=reference["OPTIMIZER_STATE"][rank]))


def test_fsdp_job_ends_bitwise_where_the_ddp_job_ends(reference, fsdp_reference):
    """See [Note: the sharded job] in examples/train.py: at two ranks sharding
    changes no bit of the training, against torch's DDP and pydist's."""
    path, stdout = fsdp_reference
    steps = 4 * STEPS_PER_EPOCH
    assert "with pydist FSDP (fully_shard per block) on 2 ranks" in stdout, stdout
    assert f"max |pydist - torch| over all parameters after {steps} steps, on any rank: 0\n" in stdout, stdout
    assert re.search(r"pydist FSDP: 4 epochs on 2 ranks .* samples/s", stdout), stdout
    for unit in ("(root)", "body.0", "body.3"):  # the units' records of the last step
        assert re.search(rf"^  {re.escape(unit)} +\d+ / 1  exposed [0-9.]+ ms$", stdout, re.MULTILINE), stdout
    losses = epoch_losses(stdout)
    assert len(losses) == 8 and losses[:4] == losses[4:] == epoch_losses(reference[1])[:4], losses
    ours, ddp = load(path), load(reference[0])
    assert ours["JOB"]["fsdp"] is True and ours["EPOCHS_RUN"] == 4
    assert ours["MODEL_STATE"].keys() == ddp["MODEL_STATE"].keys()
    for name, tensor in ddp["MODEL_STATE"].items():
        assert torch.equal(ours["MODEL_STATE"][name], tensor), f"{name}: the sharded job's differs from DDP's"
    build_model(TINY_CONFIG).load_state_dict(ours["MODEL_STATE"])  # the full weights, unwrapped keys
    for rank in range(2):  # each rank's AdamW state covers its own shards only
        shard_numel = sum(s["exp_avg"].numel() for s in ours["OPTIMIZER_STATE"][rank]["state"].values())
        full_numel = sum(t.numel() for t in ddp["MODEL_STATE"].values())
        assert 0 < shard_numel <= full_numel // 2 + 3, (rank, shard_numel, full_numel)  # + each unit's padding
    for rank in range(2):
        assert torch.equal(ours["RNG_STATES"][rank]["torch"], ddp["RNG_STATES"][rank]["torch"]), "dropout masks"


def test_fsdp_resume_after_epoch_2_is_bitwise(fsdp_reference, tmp_path):
    path = tmp_path / "snapshot.pt"
    ok(torchrun(["--fsdp", "--epochs", 2, "--snapshot", path]))
    stdout = ok(torchrun(["--fsdp", "--epochs", 4, "--snapshot", path]))
    assert f"resuming from snapshot {path}: 2 epochs, {2 * STEPS_PER_EPOCH} steps run" in stdout, stdout
    assert_same_sharded_training(load(path), load(fsdp_reference[0]))


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (pip install mpich)")
def test_fsdp_job_under_mpiexec_matches_torchrun(fsdp_reference, tmp_path):
    path = tmp_path / "snapshot.pt"
    launcher = [shutil.which("mpiexec"), "-n", "2", sys.executable]
    stdout = ok(run_job(launcher, ["--fsdp", "--epochs", 4, "--snapshot", path]))
    assert "launched by mpich" in stdout, stdout
    assert_same_sharded_training(load(path), load(fsdp_reference[0]))


def test_fsdp_refuses_a_ddp_snapshot_and_ddp_options(reference, tmp_path, capsys):
    import train

    for extra in (["--ddp", "torch"], ["--bucket-cap-mb", "1"]):
        with pytest.raises(SystemExit) as exit_info:
            train.parse_args(["--fsdp", *extra])
        assert exit_info.value.code == 2
        assert f"{extra[0]}" in capsys.readouterr().err
    path = tmp_path / "snapshot.pt"
    shutil.copy(reference[0], path)
    done = torchrun(["--fsdp", "--epochs", 5, "--snapshot", path])
    assert done.returncode != 0
    assert "was written by a DDP job, this job is sharded (--fsdp)" in done.stderr, done.stderr
    assert path.read_bytes() == reference[0].read_bytes()


def test_fsdp_transformer_lm_trains():
    stdout = ok(torchrun(["--fsdp", "--model", "transformer", "--epochs", 2, "--lr", "3e-3"]))
    losses = epoch_losses(stdout)
    assert len(losses) == 2 and losses[1] < losses[0], losses
    assert re.search(r"^  blocks\.layers\.1 +\d+ / 1", stdout, re.MULTILINE), stdout


@pytest.mark.cuda
def test_amp_on_cuda_uses_fp16_and_a_grad_scaler(tmp_path):
    """On CUDA, --amp is fp16 autocast with a GradScaler, whose state the
    snapshot keeps. (Skipped without a GPU.)"""
    path = tmp_path / "snapshot.pt"
    stdout = ok(torchrun(["--epochs", 3, "--snapshot", path, "--amp"], nproc=min(2, torch.cuda.device_count())))
    losses = epoch_losses(stdout)
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    scaler = load(path)["SCALER_STATE"]
    assert scaler is not None and scaler["scale"] > 0, scaler
