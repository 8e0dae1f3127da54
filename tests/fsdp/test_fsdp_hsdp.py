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
    # FSDP1's door too, where torch's FSDP1 turns HYBRID_SHARD with a shard
    # group of one into NO_SHARD and never all-reduces over the replicas.
    scenarios.append(Scenario(mesh=(4, 1), api="fsdp1", strategy="HYBRID_SHARD", model="nested", optimizer="sgd"))
    results = run_parity(scenarios, 4, timeout=140, impls=("pydist",))
    for i, sc in enumerate(scenarios):
        ref = train_global_batch(sc, 4)
        for rank in range(4):
            got = results[rank][i]["pydist"]
            for k, v in ref.params.items():
                assert_close(v, got.params[k], False, f"mesh {sc.mesh} rank {rank} param {k}", rtol=RTOL, atol=ATOL)


def _hooked_rank(rank, world_size):
    """torch's and pydist's HSDP with one all-reduce hook on every unit that
    changes the reduced gradients in place (an element-wise clamp and a
    count of its calls); the parameters after 3 SGD steps."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import pydist
    from fsdp_harness import MODELS, make_batch
    from pydist.fsdp import full_state_dict

    out = {}
    for name, wrap in (("torch", torch_fully_shard), ("pydist", pydist.fully_shard)):
        torch.manual_seed(0)
        model = MODELS["nested"]()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        calls = []

        def hook(reduced, calls=calls):
            calls.append(1)
            reduced.clamp_(-1e-3, 1e-3)

        for m in model.units() + [model]:
            wrap(m, mesh=mesh)
            m.set_all_reduce_hook(hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = make_batch(Scenario(), rank, step, 0)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        sd = full_state_dict(model) if name == "pydist" else {k: v.full_tensor() for k, v in model.state_dict().items()}
        out[name] = ({k: v.clone() for k, v in sd.items()}, len(calls))
    return out


@pytest.mark.timeout(120)
def test_all_reduce_hook_changes_the_gradients_as_torchs():
    from pydist.spawn import run_ranks

    for out in run_ranks(_hooked_rank, 4, timeout=100):
        (ref, ref_calls), (got, got_calls) = out["torch"], out["pydist"]
        assert got_calls == ref_calls == 3 * 7, (got_calls, ref_calls)  # 7 units, once per backward each
        for k, v in ref.items():
            assert torch.equal(got[k], v), f"{k}: max abs diff {(got[k] - v).abs().max()}"


def _dcp_rank(rank, world_size, path):
    """An HSDP model (uneven shards: Linear(8, 13)) trained a step, saved with
    torch.distributed.checkpoint (every replica holds the same shards: DCP
    keeps one copy) and loaded into another built from another seed."""
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import pydist
    from pydist.fsdp import full_state_dict

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 13), nn.Linear(13, 4))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            pydist.fully_shard(layer, mesh=mesh)
        return pydist.fully_shard(model, mesh=mesh)

    trained = build(0)
    g = torch.Generator().manual_seed(rank)
    F.mse_loss(trained(torch.randn(4, 8, generator=g)), torch.randn(4, 4, generator=g)).backward()
    torch.optim.SGD(trained.parameters(), lr=0.1).step()
    dcp.save(trained.state_dict(), checkpoint_id=path)
    loaded = build(1)
    sd = loaded.state_dict()
    dcp.load(sd, checkpoint_id=path)
    loaded.load_state_dict(sd)
    want, got = full_state_dict(trained), full_state_dict(loaded)
    return {k: (want[k], got[k]) for k in want}


@pytest.mark.timeout(120)
def test_dcp_checkpoint_round_trips_under_hsdp(tmp_path):
    from pydist.spawn import run_ranks

    for out in run_ranks(_dcp_rank, 4, args=(str(tmp_path / "ckpt"),), timeout=100):
        for k, (want, got) in out.items():
            assert torch.equal(got, want), f"{k}: not the saved values"
