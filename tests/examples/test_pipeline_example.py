"""examples/pipeline.py as users run it (torchrun, 2 ranks, a tiny model):
the naive split, GPipe and 1F1B each end bitwise where one process
training the whole model on the same micro-batches ends, and each prints a
measured bubble beside (S-1)/(M+S-1)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(150)
def test_pipeline_example_matches_one_process():
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "examples" / "pipeline.py"), "--width", "32", "--batch", "16", "--microbatches", "4",
           "--steps", "3"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^(naive|GPipe|1F1B).*?\s(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$", done.stdout, re.M)
    assert [r[0] for r in rows] == ["naive", "GPipe", "1F1B"], done.stdout
    for name, loss, bubble, ideal, diff in rows:
        assert float(diff) == 0.0, done.stdout  # bitwise the one-process run
        assert 0.0 <= float(ideal) < 1.0 and bubble != "n/a"
    assert float(rows[0][3]) == 0.5 and float(rows[1][3]) == float(rows[2][3]) == 0.2  # (S-1)/(M+S-1)
