"""PYDIST_TRACE=DIR on an unchanged script: one Chrome trace per rank, under
pydist.spawn and under mpiexec, written at destroy_process_group, at exit
and on an uncaught exception; merged and reported by the CLI."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from pydist.spawn import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "overlap", "train_script.py")
MPIEXEC = shutil.which("mpiexec")
STEPS = 4
PARAM_BYTES = 6 * (128 * 128 + 128) * 4


def _check_rank_trace(path, rank, steps=STEPS):
    with open(path) as f:
        doc = json.load(f)  # valid JSON
    events = doc["traceEvents"]
    assert doc["otherData"]["rank"] == rank and "clock_sync" in doc["otherData"]
    assert {e["pid"] for e in events} == {rank}
    step_events = [e for e in events if e.get("cat") == "step"]
    assert [e["args"]["step"] for e in step_events] == list(range(steps)), path
    for s in step_events:
        assert s["args"]["bytes"] == PARAM_BYTES
        comm = [e for e in events if e.get("cat") == "comm" and e["args"]["step"] == s["args"]["step"]]
        assert sum(e["args"]["bytes"] for e in comm) == PARAM_BYTES
        for e in comm:
            assert s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1, (s, e)
            assert e["args"]["exposed_ms"] >= 0 and e["args"]["chunks"] >= 1
        assert sum(e["args"]["exposed_ms"] for e in comm) == pytest.approx(s["args"]["exposed_ms"])
    backward = [e for e in events if e.get("cat") == "compute"]
    assert len(backward) == steps
    chunks = [e for e in events if e.get("cat") == "chunk"]
    assert len(chunks) % 2 == 0 and len([e for e in chunks if e["ph"] == "b"]) == len(chunks) // 2
    assert any(e.get("cat") == "write_back" for e in events) and any(e.get("cat") == "grads" for e in events)
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"steps", "backward compute", "gradients ready", "write-back", "bucket 0"} <= tracks
    return doc


@pytest.mark.timeout(180)
def test_trace_under_spawn_then_merge_and_report(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import train_script

    monkeypatch.setenv("PYDIST_TRACE", str(tmp_path / "traces"))
    run_ranks(train_script.spawned, 2, args=(STEPS,), timeout=150)
    docs = [_check_rank_trace(tmp_path / "traces" / f"rank{r}.json", r) for r in range(2)]
    assert docs[0]["otherData"]["transport"] == "shm"

    merged = tmp_path / "merged.json"
    cli = [sys.executable, "-m", "pydist.overlap"]
    env = dict(os.environ, PYTHONPATH=REPO)
    subprocess.run(cli + ["merge", str(tmp_path / "traces"), "-o", str(merged)], check=True, env=env, timeout=60)
    document = json.loads(merged.read_text())
    assert {e["pid"] for e in document["traceEvents"]} == {0, 1}
    # one host: once the ranks have met in an all-reduce (the first step's),
    # the same step starts within a few ms on both; the first step may not
    # (a step starts when backward is armed, and nothing syncs the ranks'
    # first forward). Generous for a loaded machine.
    starts = {}
    for e in document["traceEvents"]:
        if e.get("cat") == "step":
            starts.setdefault(e["args"]["step"], []).append(e["ts"])
    assert sorted(starts) == list(range(STEPS)) and all(len(v) == 2 for v in starts.values()), starts
    assert all(abs(a - b) < 100_000 for step, (a, b) in starts.items() if step >= 1), starts
    out = subprocess.run(cli + ["report", str(merged)], check=True, env=env, capture_output=True, text=True,
                         timeout=60).stdout
    assert f"rank 0 (shm): {STEPS} steps" in out and f"rank 1 (shm): {STEPS} steps" in out
    assert out.count("stalling bucket:") + out.count("no bucket stalled a step") == 2, out


def _mpiexec(tmp_path, mode, **env):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYDIST_TRACE=str(tmp_path), **env)
    return subprocess.run([MPIEXEC, "-n", "2", sys.executable, SCRIPT, mode, str(STEPS)], env=env, capture_output=True,
                          text=True, timeout=150, cwd=REPO)


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_trace_under_mpiexec(tmp_path, mode):
    """'exit': written at interpreter exit (no destroy_process_group).
    'raise': rank 1 raises; it writes its trace from the excepthook before
    pydist aborts the MPI job (rank 0, killed by the abort while waiting for
    it, writes none: an abort leaves the other ranks no time)."""
    done = _mpiexec(tmp_path, mode)
    if mode == "raise":
        # Not its stderr: a launcher may drop what a rank writes just before
        # MPI_Abort (the trace is a file, written before the abort).
        assert done.returncode != 0, done.stdout + done.stderr
    else:
        assert done.returncode == 0, done.stdout + done.stderr
    for r in (1,) if mode == "raise" else (0, 1):
        _check_rank_trace(tmp_path / f"rank{r}.json", r)
