"""Ranks that built different values before sharding (a DDP script's
per-rank seed before building the model) are refused at the root's first
forward, on every rank, naming the parameter; a checkpoint loaded after
sharding, or FSDP1's sync_module_states, makes them one model, which then
trains bitwise as one built alike. See [Note: every rank builds the same
model] in pydist/fsdp/_fsdp_state.py."""

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Linear(8, 2))


def _shard(model: nn.Module, front: str, **kwargs) -> nn.Module:
    import pydist

    if front == "fully_shard":
        pydist.fully_shard(model[1])
        return pydist.fully_shard(model)
    return pydist.FullyShardedDataParallel(model, **kwargs)


def _train(model, rank: int) -> dict:
    import pydist

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(4, 8, generator=gen)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return pydist.fsdp.full_state_dict(getattr(model, "_fsdp_wrapped_module", model))


def _error(fn) -> str:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _ranks(rank, world_size, front):
    import pydist
    from pydist import ShardingStrategy

    out = {}
    model = _shard(_net(seed=rank), front)  # as nanoGPT seeds: 1337 + rank, before building
    out["refused"] = _error(lambda: model(torch.ones(1, 8)))
    out["refused_again"] = _error(lambda: model(torch.ones(1, 8)))  # not trained on after the error
    inner = getattr(model, "_fsdp_wrapped_module", model)
    pydist.fsdp.load_full_state_dict(inner, _net(seed=0).state_dict())  # the cure: a checkpoint
    out["loaded"] = _train(model, rank)
    out["alike"] = _train(_shard(_net(seed=0), front), rank)
    if front == "FullyShardedDataParallel":
        out["synced"] = _train(_shard(_net(seed=rank), front, sync_module_states=True), rank)
        model = _shard(_net(seed=rank), front, sharding_strategy=ShardingStrategy.NO_SHARD)
        out["no_shard_refused"] = _error(lambda: model(torch.ones(1, 8)))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("front", ["fully_shard", "FullyShardedDataParallel"])
def test_ranks_that_built_different_values_are_refused(front):
    for rank, out in enumerate(run_ranks(_ranks, 2, args=(front,), timeout=110)):
        for case in ("refused", "refused_again") + (("no_shard_refused",) if "synced" in out else ()):
            assert "the ranks built different values for parameter '0.weight'" in out[case], (rank, case, out[case])
            assert "groups of ranks that agree: [0] / [1]" in out[case], out[case]
        for case in ("loaded",) + (("synced",) if "synced" in out else ()):
            for k, ref in out["alike"].items():
                assert torch.equal(out[case][k], ref), f"rank {rank} {case}: {k} differs from a model built alike"
