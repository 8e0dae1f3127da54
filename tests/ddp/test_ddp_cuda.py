"""pydist DDP on CUDA against stock torch DDP, as far as one GPU allows.

Two kinds of group reach a CUDA model on a machine with one GPU:

* gloo with two ranks sharing cuda:0 (gloo all-reduces CUDA tensors
  through host staging): the multi-rank path, bitwise at two ranks as on
  the CPU (see [Note: when the suite asserts bitwise equality] in
  ddp_harness);
* NCCL with one rank: NCCL's own launches and the collectives pydist issues
  besides the buckets' (the bucket-order agreement after the first
  iteration, the unused-parameter map), which NCCL refuses on CPU tensors.

Two NCCL ranks cannot share one GPU, so the multi-rank NCCL path is not
tested here. Skipped without a CUDA device (tests/conftest.py).
"""

import pytest

from ddp_harness import Scenario, assert_parity, assert_ranks_agree, run_parity

pytestmark = pytest.mark.cuda

GPU = dict(device="cuda")


def _check(scenarios, world_size, backend):
    results = run_parity(scenarios, world_size, backend=backend)
    assert_parity(results, exact=True, scenarios=scenarios)
    for rank in range(world_size):
        for i in range(len(scenarios)):
            assert results[rank][i]["pydist"].allreduce_transport == "process_group"
    return results


@pytest.mark.timeout(180)
def test_gloo_two_ranks_on_one_gpu():
    scenarios = [
        Scenario(**GPU),
        Scenario(**GPU, optimizer="adam", seed=1),
        Scenario(**GPU, micro_steps=3, steps=3),
        Scenario(**GPU, ddp_kwargs={"gradient_as_bucket_view": True}, optimizer="adam"),
        Scenario(**GPU, model="branch", branch_schedule=True, steps=5, ddp_kwargs={"find_unused_parameters": True}),
        Scenario(**GPU, model="many_tiny", steps=3, optimizer="adam", ddp_kwargs={"bucket_cap_mb": 0.0001}),
        Scenario(**GPU, init_seed_per_rank=True, model="batchnorm", perturb_buffers=True, steps=3),
        Scenario(**GPU, autocast_bf16=True, optimizer="adam"),
    ]
    results = _check(scenarios, 2, "gloo")
    for i in range(len(scenarios)):
        assert_ranks_agree(results, "pydist", i)


@pytest.mark.timeout(180)
def test_nccl_one_rank():
    scenarios = [
        Scenario(**GPU, optimizer="adam"),
        Scenario(**GPU, model="many_tiny", steps=3, ddp_kwargs={"bucket_cap_mb": 0.0001}),
        Scenario(**GPU, model="branch", branch_schedule=True, steps=5, ddp_kwargs={"find_unused_parameters": True}),
        Scenario(**GPU, model="checkpointed", ddp_kwargs={"static_graph": True}, steps=4),
        Scenario(**GPU, model="batchnorm", steps=3),
        Scenario(**GPU, micro_steps=2, steps=3, ddp_kwargs={"gradient_as_bucket_view": True}),
    ]
    _check(scenarios, 1, "nccl")
