"""HSDP: each unit sharded over the "shard" dimension of a 2-D
("replicate", "shard") mesh and its reduced shards all-reduced over the
"replicate" dimension, through ``fully_shard(mesh=...)`` and FSDP1's
HYBRID_SHARD / _HYBRID_SHARD_ZERO2, at 4 ranks on gloo.

Against torch's own HSDP (bitwise: the gradient is the shard group's
2-term sum, halved, then the replicas' 2-term sum, halved, in both; see
[Note: HSDP] in pydist/fsdp/_fsdp_param_group.py), and against one process
on the global batch for every mesh shape, so that no shape can skip the
replicas' all-reduce and still pass: a (4, 1) mesh (nothing to
reduce-scatter, everything to all-reduce), (1, 4) (plain FSDP) and (2, 2)
(see [Note: the global-batch oracle] in test_fsdp_global_batch.py)."""

import pytest

from fsdp_harness import Scenario, assert_parity, run_parity
from test_fsdp_global_batch import ATOL, RTOL, train_global_batch
from fsdp_harness import assert_close
import torch


@pytest.mark.timeout(180)
def test_hsdp_is_bitwise_torch_hsdp_on_a_2x2_mesh():
    scenarios = [
        Scenario(mesh=(2, 2)),
        Scenario(mesh=(2, 2), model="nested", optimizer="adam", mixed=True),
        Scenario(mesh=(2, 2), model="nested", reshard_after_forward=False, micro_steps=2, steps=3),
        Scenario(mesh=(2, 2), model="nested", optimizer="adam", micro_steps=3, steps=2, accumulate="all_reduce"),
        Scenario(mesh=(2, 2), api="fsdp1", strategy="HYBRID_SHARD", optimizer="adam"),
        Scenario(mesh=(2, 2), api="fsdp1", strategy="_HYBRID_SHARD_ZERO2", model="nested"),
    ]
    results = run_parity(scenarios, 4, timeout=170)
    assert_parity(results, exact=True, scenarios=scenarios)


@pytest.mark.timeout(150)
def test_every_mesh_shape_synchronizes_the_replicas():
    scenarios = [Scenario(mesh=mesh, model="nested", optimizer="sgd", shm=shm)
                 for mesh, shm in (((4, 1), None), ((1, 4), None), ((2, 2), False))]
    results = run_parity(scenarios, 4, timeout=140, impls=("pydist",))
    for i, sc in enumerate(scenarios):
        ref = train_global_batch(sc, 4)
        for rank in range(4):
            got = results[rank][i]["pydist"]
            for k, v in ref.params.items():
                assert_close(v, got.params[k], False, f"mesh {sc.mesh} rank {rank} param {k}", rtol=RTOL, atol=ATOL)
