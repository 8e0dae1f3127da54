"""pydist's sharded wrapper on CUDA parameters, beside torch's FSDP2 and
FSDP1 on the same GPU, seeds and batches.

Two kinds of group reach a CUDA model on a machine with one GPU (as in
tests/ddp/test_ddp_cuda.py):

* gloo with two ranks sharing cuda:0: gloo all-gathers CUDA tensors and
  reduce-scatters them as an all-reduce, both through host staging. torch's
  wrappers take the same path, so the runs are bitwise at two ranks, as on
  the CPU (a sum of two terms is the same either way round). torch 2.11's
  functional all-gather of a CUDA DTensor over gloo dies (SIGSEGV in
  ``full_tensor()``), so torch's parameters are gathered on the CPU
  (fsdp_harness._full_tensor), and clipping, whose DTensor norm torch
  reduces through the same functional collectives, is compared over NCCL;
* NCCL with one rank: NCCL's own launches and streams, and the small
  collectives pydist runs besides the units' (the wrapping and built-model
  checks, the gradient flags), which NCCL refuses on CPU tensors.

Two NCCL ranks cannot share one GPU, so the multi-rank NCCL path is not
tested here. Skipped without a CUDA device (tests/conftest.py).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_harness import MODELS, Scenario, _full_tensor, assert_parity, make_batch, make_optimizer, run_parity
from test_fsdp_global_batch import train_global_batch

pytestmark = pytest.mark.cuda

GPU = dict(device="cuda")


@pytest.mark.timeout(300)
def test_gloo_two_ranks_on_one_gpu():
    scenarios = [
        Scenario(**GPU),
        Scenario(**GPU, model="nested", optimizer="adam", seed=1),
        Scenario(**GPU, mixed=True, optimizer="adam"),
        Scenario(**GPU, reshard_after_forward=False, micro_steps=3, steps=3),
        Scenario(**GPU, model="nested", prefetch=True),
        Scenario(**GPU, model="badpad", optimizer="adam"),
        Scenario(**GPU, api="fsdp1", optimizer="adam"),
        Scenario(**GPU, api="fsdp1", strategy="SHARD_GRAD_OP", mixed=True),
        Scenario(**GPU, api="fsdp1", strategy="NO_SHARD", model="nested"),
    ]
    results = run_parity(scenarios, 2, timeout=240)
    assert_parity(results, exact=True, scenarios=scenarios, transport="gloo")


@pytest.mark.timeout(240)
def test_hsdp_on_a_2x1_mesh_on_one_gpu():
    """Two replicas of one shard each on cuda:0 over gloo: the reduce-scatter
    over a group of one, then the replicas' all-reduce. ``fully_shard``
    beside torch's HSDP, bitwise. FSDP1's HYBRID_SHARD against one process
    on the global batch instead: torch's FSDP1 turns a shard group of one
    into NO_SHARD ("since the world size is 1") and then never all-reduces
    over the replicas, so its two ranks drift apart (4e-2 from the global
    batch after 4 steps on the CPU, where pydist's is within 3e-8)."""
    scenarios = [
        Scenario(**GPU, mesh=(2, 1), model="nested", optimizer="adam"),
        Scenario(**GPU, mesh=(2, 1), mixed=True),
    ]
    results = run_parity(scenarios, 2, timeout=110)
    assert_parity(results, exact=True, scenarios=scenarios)
    sc = Scenario(**GPU, mesh=(2, 1), api="fsdp1", strategy="HYBRID_SHARD", model="nested")
    ref = train_global_batch(sc, 2)  # one process, on the CPU
    for rank, per_rank in enumerate(run_parity([sc], 2, timeout=110, impls=("pydist",))):
        got = per_rank[0]["pydist"]
        for k, v in ref.params.items():
            torch.testing.assert_close(got.params[k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {k}: {m}")


@pytest.mark.timeout(240)
def test_nccl_one_rank():
    scenarios = [
        Scenario(**GPU, optimizer="adam"),
        Scenario(**GPU, model="nested", mixed=True),
        Scenario(**GPU, model="nested", prefetch=True, micro_steps=2),
        Scenario(**GPU, api="fsdp1", optimizer="adam"),
        Scenario(**GPU, clip=0.05),
    ]
    results = run_parity(scenarios, 1, timeout=200, backend="nccl")
    assert_parity(results, exact=True, scenarios=scenarios, transport="nccl")


def _moves_between_devices(rank: int, world_size: int) -> dict:
    """Trains a CUDA model, loads its full state dict into a CPU model and
    back into a fresh CUDA one; builds one on the meta device and
    materializes it on CUDA. Returns what the parent compares."""
    import pydist
    from pydist.fsdp import full_state_dict

    def build(device, meta=False, shard=pydist.fully_shard):
        torch.manual_seed(0)
        with torch.device("meta" if meta else device):
            model = MODELS["nested"]()
        for m in model.units():
            shard(m)
        shard(model)
        if meta:
            model.to_empty(device=device)
            torch.manual_seed(0)
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        return model

    def train(model, device, steps, offset, optimizer="adam"):
        opt = make_optimizer(optimizer, model.parameters())
        for step in range(steps):
            x, y = (t.to(device) for t in make_batch(Scenario(), rank, offset + step, 0))
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()

    def full(model):
        return {k: v.detach().cpu().clone() for k, v in full_state_dict(model).items()}

    out = {}
    on_gpu = build("cuda")
    assert all(p.is_cuda for p in on_gpu.parameters())
    train(on_gpu, "cuda", 2, 0)
    saved = full(on_gpu)
    on_cpu = build("cpu")
    on_cpu.load_state_dict(saved)
    out["cpu_after_load"] = full(on_cpu)
    back = build("cuda")
    back.load_state_dict(full_state_dict(on_cpu))
    out["saved"], out["cuda_after_round_trip"] = saved, full(back)
    # The same step from the loaded state on each device: equal on both
    # CUDA models (the same kernels), within rounding on the CPU one (SGD:
    # no division by a second moment that would magnify that rounding).
    train(on_gpu, "cuda", 1, 2, "sgd")
    train(back, "cuda", 1, 2, "sgd")
    train(on_cpu, "cpu", 1, 2, "sgd")
    out["trained_on"], out["trained_back"], out["trained_cpu"] = full(on_gpu), full(back), full(on_cpu)
    # On the meta device, initialized through DTensors: torch FSDP2's values.
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch_meta = build("cuda", meta=True, shard=torch_fully_shard)
    out["meta"] = full(build("cuda", meta=True))
    out["torch_meta"] = {n: _full_tensor(p.detach()).view(p.shape) for n, p in torch_meta.named_parameters()}
    dist.barrier()
    return out


@pytest.mark.timeout(180)
def test_state_dicts_move_between_cuda_and_cpu():
    from pydist.spawn import run_ranks

    for out in run_ranks(_moves_between_devices, 2, timeout=150):
        for k, v in out["saved"].items():
            assert torch.equal(out["cpu_after_load"][k], v), f"{k}: the CPU model did not load the CUDA one's values"
            assert torch.equal(out["cuda_after_round_trip"][k], v), f"{k}: changed on the way CUDA -> CPU -> CUDA"
            assert torch.equal(out["trained_on"][k], out["trained_back"][k]), f"{k}: a resumed CUDA run diverged"
            torch.testing.assert_close(out["trained_cpu"][k], out["trained_on"][k], rtol=1e-4, atol=1e-5)
            assert torch.equal(out["meta"][k], out["torch_meta"][k]), f"{k}: meta-device init on CUDA is not FSDP2's"
