"""Record a run's bucket plan, replay it (pydist/overlap/plans.py): with the
plan replayed, runs under different bucket caps, chunk sizes and a simulated
network reduce every gradient in the same grouping and order, so their
parameters are bitwise equal. Three ranks on gloo (the shared-memory
transport sums in rank order whatever the layout), random (not integer)
data: there gloo's ring sums each element in an order that depends on where
it sits in its bucket, so without the plan the same runs differ at rounding
level; the test checks they do, so that the equality under the plan means
something."""

import os

import pytest
import torch
import torch.distributed as dist

from pydist.spawn import run_ranks

STEPS = 4


def _train(rank, plan_env=None, record_env=None, **ddp_kwargs):
    from pydist import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(5)])
    for key, value in (("PYDIST_REPLAY", plan_env), ("PYDIST_RECORD_PLAN", record_env)):
        if value:
            os.environ[key] = value
    try:
        ddp = DDP(model, shm_allreduce=False, **ddp_kwargs)
    finally:
        os.environ.pop("PYDIST_REPLAY", None)
        os.environ.pop("PYDIST_RECORD_PLAN", None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        opt.zero_grad()
        ddp(torch.randn(12, 96, generator=gen)).tanh().sum().backward()
        opt.step()
    return ddp, [p.detach().clone() for p in ddp.parameters()]


def _replays(rank, world_size, plan_path):
    from pydist import DistributedDataParallel as DDP
    from pydist import overlap

    # Recorded: small buckets, rebuilt from the gradient order after step 1.
    recorded, _ = _train(rank, record_env=plan_path, bucket_cap_mb=0.05)
    dist.barrier()  # rank 0 wrote the plan at the first forward after the rebuild
    plan = overlap.load_plan(plan_path)
    assert plan.buckets == recorded.bucket_indices() and len(plan.buckets) > 2
    assert plan.world_size == world_size

    # Another bucket cap, left alone: another grouping.
    own, params_own = _train(rank, bucket_cap_mb=25)
    assert own.bucket_indices() != plan.buckets

    # Replayed three ways, under different policies: the plan from the start, the same parameters.
    by_env, params_env = _train(rank, plan_env=plan_path, bucket_cap_mb=25)
    by_sim, params_sim = _train(rank, plan_env=plan_path, bucket_cap_mb=1, sim_net="5Gbps,10us")
    assert by_env.bucket_indices() == by_sim.bucket_indices() == plan.buckets
    for i, (a, b) in enumerate(zip(params_env, params_sim)):
        assert torch.equal(a, b), f"rank {rank}: parameter {i} differs between two replays of the same plan"

    # The API form, and its check of the model.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(4)])
    ddp = DDP(model)
    with pytest.raises(RuntimeError, match="the plan has 10 parameters, this model 8"):
        overlap.replay(ddp, plan_path)
    dist.barrier()
    return sum(not torch.equal(a, b) for a, b in zip(params_own, params_env))


@pytest.mark.timeout(150)
def test_parameters_bitwise_equal_across_replays(tmp_path):
    results = run_ranks(_replays, 3, args=(str(tmp_path / "plan.json"),), timeout=130)
    assert all(differ > 0 for differ in results), f"no parameter differs without the plan: {results}"
