"""``pydist.FullyShardedDataParallel`` against torch's FSDP1 (``device_id=cpu``,
``use_orig_params=True``), its ``sync_module_states``, and full state dicts
moved between pydist and torch FSDP2 in both directions, on spawned gloo ranks."""

import pytest
import torch
import torch.nn.functional as F

from fsdp_harness import MODELS, Scenario, assert_parity, make_batch, run_parity
from pydist.spawn import run_ranks


@pytest.mark.timeout(150)
def test_fsdp1_bitwise_at_two_ranks():
    scenarios = [
        Scenario(api="fsdp1", model="mlp", optimizer="sgd", shm=True),
        Scenario(api="fsdp1", model="nested", optimizer="adam", strategy="SHARD_GRAD_OP", shm=True),
        Scenario(api="fsdp1", model="frozen", strategy="NO_SHARD", micro_steps=2, shm=True),
        Scenario(api="fsdp1", model="badpad", optimizer="adam", micro_steps=2, shm=False),
        Scenario(api="fsdp1", model="nested", optimizer="sgd", policy="size", shm=True),
        Scenario(api="fsdp1", model="nested", optimizer="sgd", clip=0.05, steps=3, shm=False),
    ]
    results = run_parity(scenarios, 2, timeout=140)
    assert_parity(results, exact=True, scenarios=scenarios)
    assert results[0][-1]["pydist"].norms and all(n > 0.05 for n in results[0][-1]["pydist"].norms)


def _state_dict_rank(rank, world_size, _unused):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import pydist
    from pydist.fsdp import full_state_dict, load_full_state_dict

    def build(impl, seed):
        torch.manual_seed(seed)
        model = MODELS["nested"]()
        shard = torch_fully_shard if impl == "torch" else pydist.fully_shard
        kwargs = {"mesh": init_device_mesh("cpu", (world_size,))} if impl == "torch" else {}
        for m in model.units():
            shard(m, **kwargs)
        return shard(model, **kwargs)

    def torch_full(model):
        return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}

    def train(model, steps, offset):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)  # stateless: a fresh one is no different
        losses = []
        for step in range(steps):
            x, y = make_batch(Scenario(), rank, offset + step, 0)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    out = {}
    a = build("torch", 0)
    train(a, 2, 0)
    sd_torch = torch_full(a)
    b = build("pydist", 1)  # other weights: the load must replace every one
    load_full_state_dict(b, sd_torch)
    out["torch_to_pydist"] = full_state_dict(b)
    out["sd_torch"] = sd_torch
    out["losses"] = (train(a, 2, 2), train(b, 2, 2))
    out["after"] = (torch_full(a), full_state_dict(b))
    c = build("torch", 2)
    set_model_state_dict(c, full_state_dict(b), options=StateDictOptions(full_state_dict=True))
    out["pydist_to_torch"] = (full_state_dict(b), torch_full(c))
    # FSDP1's sync_module_states: every rank starts from rank 0's weights
    torch.manual_seed(rank)
    plain = MODELS["mlp"]()
    initial = {k: v.clone() for k, v in plain.state_dict().items()}
    synced = pydist.FullyShardedDataParallel(plain, sync_module_states=True, device_id=torch.device("cpu"))
    out["synced"] = (initial, synced.state_dict())
    return out


@pytest.mark.timeout(120)
def test_full_state_dict_moves_both_ways_with_torch_fsdp2():
    results = run_ranks(_state_dict_rank, 2, args=(None,), timeout=100)
    for rank, out in enumerate(results):
        sd = out["sd_torch"]
        assert list(out["torch_to_pydist"]) == list(sd), "pydist's full state dict keys are not the module's"
        for k in sd:
            assert torch.equal(out["torch_to_pydist"][k], sd[k]), f"rank {rank}: {k} did not load from torch"
        assert out["losses"][0] == out["losses"][1], f"rank {rank}: training after the load diverged"
        ref, got = out["after"]
        for k in ref:
            assert torch.equal(ref[k], got[k]), f"rank {rank}: {k} after training"
        mine, theirs = out["pydist_to_torch"]
        for k in mine:
            assert torch.equal(mine[k], theirs[k]), f"rank {rank}: {k} did not load into torch"
        rank0_initial = results[0]["synced"][0]
        for k, v in out["synced"][1].items():
            assert torch.equal(v, rank0_initial[k]), f"rank {rank}: {k} is not rank 0's after sync_module_states"
        if rank:
            assert any(not torch.equal(out["synced"][0][k], rank0_initial[k]) for k in rank0_initial)
