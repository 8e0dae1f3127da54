"""pydist.patch_torch() under the frameworks that build torch's DDP themselves:
accelerate's multi-CPU path, Lightning's DDP strategy and the HF Trainer
(which prepares through accelerate; installed with
--no-deps beside this torch: requirements-frameworks.txt), each trained on
pydist's DDP through the patch and, after its undo, on torch's DDP, in one
job of 2 ranks under torchrun (about 40 s on 2 cores); the final parameters
must be bitwise equal (pydist's DDP sums in torch's order on 2 ranks).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="pip install --no-deps -r requirements-frameworks.txt")
pytest.importorskip("pytorch_lightning", reason="pip install --no-deps -r requirements-frameworks.txt")

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("framework_job.py")
PYDIST_DDP = "pydist.ddp.distributed_data_parallel.DistributedDataParallel"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("frameworks")
    env = {k: v for k, v in os.environ.items()}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(JOB), "--out", str(out)], env=env, capture_output=True, text=True, timeout=200, cwd=out)
    assert done.returncode == 0, f"the job failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return torch.load(out / "results.pt", weights_only=False)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("framework", ["accelerate", "lightning", "hf_trainer"])
def test_framework_builds_pydist_ddp_and_trains_bitwise_as_torch_ddp(runs, framework):
    if framework == "hf_trainer":
        pytest.importorskip("transformers", reason="pip install --no-deps -r requirements-frameworks.txt")
    torch_wrapper, torch_params = runs["torch"][framework]
    pydist_wrapper, pydist_params = runs["pydist"][framework]
    assert torch_wrapper == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert pydist_wrapper == PYDIST_DDP
    assert pydist_params.keys() == torch_params.keys()
    for name, tensor in torch_params.items():
        assert torch.equal(pydist_params[name], tensor), f"{framework}: parameter {name} differs from torch DDP's"


@pytest.mark.timeout(240)
def test_patch_reports_a_name_bound_before_it(runs):
    assert runs["unreached"] == ["__main__.BoundBeforeThePatch", "__main__.TORCH_DDP"]  # the job's own two
    assert "torch.nn.parallel.distributed.DistributedDataParallel" in runs["patched"]
