"""What the sharded wrapper refuses so that no value is silently wrong, and
the edge shape it trains, on two spawned gloo ranks, beside stock torch:

* a full state dict tensor with the parameter's number of elements but
  another shape (a (7, 13) tensor for a (13, 7) weight) is refused on every
  load path with torch's own "size mismatch" words, and the shards keep
  their values (see [Note: shape-checked loads] in pydist/fsdp/_state_dict.py);
* a unit whose parameters are all zero-size (``nn.Linear(16, 0)``) trains,
  bitwise as plain torch on the same data (its gradients are empty: nothing
  to reduce);
* ranks that wrapped the model differently are told so, each naming the
  units that differ, before any check of values;
* ranks that built the same values in another order (a weight transposed
  on one rank) are refused like ranks that built other values (see [Note:
  every rank builds the same model] in pydist/fsdp/_fsdp_state.py); torch's
  FSDP2 trains either without a word.

Each group of cases runs in one spawn, every case catching its own error,
so one spawn answers several assertions."""

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# --------------------------------------------------------------------------
# Shape-checked loads
# --------------------------------------------------------------------------


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 2))


def _sharded(front: str = "fully_shard"):
    import pydist

    model = _net()
    if front == "fully_shard":
        pydist.fully_shard(model[0])
        return pydist.fully_shard(model)
    return pydist.FullyShardedDataParallel(model, auto_wrap_policy=lambda module, recurse, **kw:
                                           recurse or isinstance(module, nn.Linear))


def _loads_rank(rank, world_size):
    import pydist
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    good = _net().state_dict()
    bad = dict(good, **{"0.weight": good["0.weight"].t().contiguous()})  # (7, 13): 91 elements, as (13, 7)
    out = {"torch": _error(lambda: _net().load_state_dict(bad))}
    model = _sharded()
    before = pydist.fsdp.full_state_dict(model)
    out["load_state_dict"] = _error(lambda: model.load_state_dict(bad))
    out["load_full_state_dict"] = _error(lambda: pydist.fsdp.load_full_state_dict(model, bad, strict=True))
    out["set_model_state_dict"] = _error(lambda: set_model_state_dict(
        model, bad, options=StateDictOptions(full_state_dict=True)))
    out["kept"] = all(torch.equal(v, before[k]) for k, v in pydist.fsdp.full_state_dict(model).items())

    fsdp1 = _sharded("FullyShardedDataParallel")
    out["fsdp1_full"] = _error(lambda: fsdp1.load_state_dict(bad))
    with pydist.FullyShardedDataParallel.state_dict_type(fsdp1, StateDictType.SHARDED_STATE_DICT):
        out["fsdp1_sharded"] = _error(lambda: fsdp1.load_state_dict(bad))

    # The optimizer's state: a momentum buffer of the weight's size, transposed.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 7)).sum().backward()
    opt.step()
    osd = pydist.fsdp.full_optimizer_state_dict(model, opt)
    osd["state"]["0.weight"]["momentum_buffer"] = osd["state"]["0.weight"]["momentum_buffer"].t().contiguous()
    out["optimizer"] = _error(lambda: pydist.fsdp.set_optimizer_state_dict(model, opt, osd))
    fsdp1_opt = torch.optim.SGD(fsdp1.parameters(), lr=0.1, momentum=0.9)
    out["fsdp1_optimizer"] = _error(lambda: pydist.FullyShardedDataParallel.optim_state_dict_to_load(
        fsdp1, fsdp1_opt, osd))
    # Stock torch's optimizer takes such a state without a check.
    plain = _net()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain(torch.ones(2, 7)).sum().backward()
    plain_opt.step()
    plain_osd = plain_opt.state_dict()
    plain_osd["state"][0]["momentum_buffer"] = plain_osd["state"][0]["momentum_buffer"].t().contiguous()
    out["torch_optimizer"] = _error(lambda: plain_opt.load_state_dict(plain_osd))
    return out


@pytest.fixture(scope="module")
def loads():
    return run_ranks(_loads_rank, 2, timeout=100)


@pytest.mark.timeout(120)
def test_a_full_tensor_of_another_shape_is_refused_as_torch_refuses_it(loads):
    torch_words = ("size mismatch for 0.weight: copying a param with shape torch.Size([7, 13]) from checkpoint, "
                   "the shape in current model is torch.Size([13, 7]).")
    for rank, out in enumerate(loads):
        assert torch_words in out["torch"] and out["torch"].startswith("RuntimeError: Error(s) in loading")
        for path in ("load_state_dict", "load_full_state_dict", "set_model_state_dict", "fsdp1_full",
                     "fsdp1_sharded"):
            assert out[path].startswith("RuntimeError: Error(s) in loading state_dict"), (rank, path, out[path])
            assert torch_words in out[path], (rank, path, out[path])
        assert out["kept"], f"rank {rank}: a refused load changed the shards"


@pytest.mark.timeout(120)
def test_an_optimizer_state_of_another_shape_is_refused(loads):
    for rank, out in enumerate(loads):
        assert out["torch_optimizer"] == "no error"  # torch's optimizer checks no shapes
        for path in ("optimizer", "fsdp1_optimizer"):
            assert ("size mismatch for '0.weight' state 'momentum_buffer': a tensor of shape (7, 13), the "
                    "parameter is (13, 7)") in out[path], (rank, path, out[path])


# --------------------------------------------------------------------------
# A unit of zero-size parameters; ranks that wrapped or built differently
# --------------------------------------------------------------------------


def _pruned() -> nn.Sequential:
    """A layer pruned to nothing: m[1]'s parameters and m[2]'s weight have no elements."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 0), nn.Linear(0, 4), nn.Linear(4, 3))


def _train_pruned(model, rank, sync_by_hand: bool) -> None:
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(4, 16, generator=gen)).pow(2).sum().backward()
        if sync_by_hand:  # the oracle: each gradient summed over the ranks and halved
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= 2
        opt.step()
        opt.zero_grad()
    return opt


def _units_rank(rank, world_size):
    import pydist

    out = {}
    model = _pruned()
    pydist.fully_shard(model[1])
    pydist.fully_shard(model)
    try:
        opt = _train_pruned(model, rank, sync_by_hand=False)
        out["pruned"] = pydist.fsdp.full_state_dict(model)
        sharded = model.state_dict()  # the sharded state dict, as dcp.save takes it
        out["pruned_keys"] = {k: tuple(v.shape) for k, v in sharded.items()}
        model.load_state_dict(out["pruned"])
        pydist.fsdp.set_optimizer_state_dict(model, opt, pydist.fsdp.full_optimizer_state_dict(model, opt))
        pydist.fsdp.get_optimizer_state_dict(model, opt)
        out["pruned_error"] = "no error"
    except Exception as exc:  # noqa: BLE001 - reported by the test
        out["pruned_error"] = f"{type(exc).__name__}: {exc}"
    plain = _pruned()
    _train_pruned(plain, rank, sync_by_hand=True)
    out["oracle"] = plain.state_dict()

    # Rank 1 shards every other block only, and (as a DDP script seeds) built other values too.
    torch.manual_seed(rank)
    blocks = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    for i, block in enumerate(blocks):
        if rank == 0 or i % 2 == 0:
            pydist.fully_shard(block)
    pydist.fully_shard(blocks)
    out["wrapping"] = _error(lambda: blocks(torch.ones(2, 8)))

    # Rank 1 holds the same weight as a (7, 13) parameter, then as a (13, 7) one with its values transposed.
    for case in ("shape", "transposed"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 2))
        if rank == 1:
            weight = model[0].weight.detach().t().contiguous()
            model[0].weight = nn.Parameter(weight if case == "shape" else weight.view(13, 7))
        pydist.fully_shard(model[0])
        pydist.fully_shard(model)
        out[case] = _error(lambda: model(torch.ones(2, 7)))
    return out


@pytest.fixture(scope="module")
def units():
    return run_ranks(_units_rank, 2, timeout=100)


@pytest.mark.timeout(120)
def test_a_unit_of_zero_size_parameters_trains_as_plain_torch(units):
    """torch's FSDP2 raises in the backward of this model (torch 2.13:
    "_chunk_cat expects non-empty tensor"); the oracle is plain torch with
    each gradient summed over the ranks and halved, bitwise at two ranks."""
    for rank, out in enumerate(units):
        assert out["pruned_error"] == "no error", (rank, out["pruned_error"])
        assert out["pruned"].keys() == out["oracle"].keys()
        for key, value in out["oracle"].items():
            assert out["pruned"][key].shape == value.shape and torch.equal(out["pruned"][key], value), (rank, key)
        assert out["pruned_keys"]["1.weight"] == (0, 16) and out["pruned_keys"]["2.weight"] == (4, 0)


@pytest.mark.timeout(120)
def test_ranks_that_wrapped_differently_are_told_so_first(units):
    for rank, out in enumerate(units):
        message = out["wrapping"]
        assert message.startswith("RuntimeError: pydist FSDP: the ranks sharded different units"), (rank, message)
        assert "ranks [0] shard 5 units, ranks [1] 3; units '1', '3' only on ranks [0]" in message, message
        assert "built different values" not in message
    assert units[0]["wrapping"] == units[1]["wrapping"], "every rank names the same difference"
    for rank, out in enumerate(units):
        assert ("unit '0' holds parameter 'weight': shape (13, 7) torch.float32 on ranks [0], shape (7, 13) "
                "torch.float32 on ranks [1]") in out["shape"], (rank, out["shape"])


@pytest.mark.timeout(120)
def test_ranks_that_built_the_same_values_in_other_places_are_refused(units):
    for rank, out in enumerate(units):
        assert ("the ranks built different values for parameter 'weight' of unit '0' before sharding (groups of "
                "ranks that agree: [0] / [1])") in out["transposed"], (rank, out["transposed"])
