"""pydist.patch_torch() under the frameworks that build torch's DDP themselves:
accelerate's multi-CPU path and Lightning's DDP strategy (installed with
--no-deps beside this torch: requirements-frameworks.txt), each trained once on
torch's DDP and once on pydist's through the patch, 2 ranks under torchrun;
the final parameters must be bitwise equal (pydist's DDP sums in torch's order
on 2 ranks). Two jobs in all, about 20 s each on 2 cores.
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
    results = {}
    for impl in ("torch", "pydist"):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(JOB), "--impl", impl, "--out", str(out)],
                              env=env, capture_output=True, text=True, timeout=150, cwd=out)
        assert done.returncode == 0, f"{impl} job failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        results[impl] = torch.load(out / f"{impl}.pt", weights_only=False)
    return results


@pytest.mark.timeout(330)
@pytest.mark.parametrize("framework", ["accelerate", "lightning"])
def test_framework_builds_pydist_ddp_and_trains_bitwise_as_torch_ddp(runs, framework):
    torch_wrapper, torch_params = runs["torch"][framework]
    pydist_wrapper, pydist_params = runs["pydist"][framework]
    assert torch_wrapper == "torch.nn.parallel.distributed.DistributedDataParallel"
    assert pydist_wrapper == PYDIST_DDP
    assert pydist_params.keys() == torch_params.keys()
    for name, tensor in torch_params.items():
        assert torch.equal(pydist_params[name], tensor), f"{framework}: parameter {name} differs from torch DDP's"


@pytest.mark.timeout(330)
def test_patch_reports_a_name_bound_before_it(runs):
    assert runs["pydist"]["unreached"] == ["__main__.BoundBeforeThePatch"]
    assert "torch.nn.parallel.distributed.DistributedDataParallel" in runs["pydist"]["patched"]
