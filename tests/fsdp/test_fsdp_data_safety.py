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
