"""State dicts and checkpoints of pydist's sharded wrapper beside torch's
FSDP2 (``torch.distributed.fsdp.fully_shard``), on spawned gloo ranks:
``model.state_dict()`` as DTensors (``fully_shard``) and ShardedTensors
(FSDP1's door, and the flat layout's boxes) saved and loaded with
``torch.distributed.checkpoint`` (DCP) at the same world size, resharded
2 -> 1, 2 -> 4, 4 -> 2, moved both ways between pydist and torch FSDP2;
the optimizer's state through a checkpoint; torch's
``get/set_model_state_dict``; FSDP1's ``state_dict_type`` front door.
Every comparison is of full tensors, bitwise.

The checkpoints are written once per module (fixtures ``ckpt2``,
``ckpt4``): the 2-rank run saves, the 4-rank run loads it and saves its
own, the 1- and 2-rank runs load those. A test's pytest timeout counts the
fixtures it sets up (a spawn each), hence the larger first ones. The file
takes about 40 s on 2 shared cores (95 s at a load average of 12)."""

import os

import pytest
import torch

from fsdp_harness import MODELS, Scenario, make_batch, train_steps
from pydist.fsdp._state_dict import flat_range_boxes
from pydist.spawn import run_ranks

MODEL = "nested"  # 2-D weights split mid-row at 4 ranks, LayerNorm vectors, nested units


# --------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------


def _build(impl: str, seed: int, world_size: int, reshard_after_forward: bool = True):
    import pydist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(seed)
    model = MODELS[MODEL]()
    shard = torch_fully_shard if impl == "torch" else pydist.fully_shard
    kwargs = {"mesh": init_device_mesh("cpu", (world_size,))} if impl == "torch" else {}
    for m in model.units():
        shard(m, reshard_after_forward=reshard_after_forward, **kwargs)
    return shard(model, reshard_after_forward=reshard_after_forward, **kwargs)


def _load_pydist_optimizer(model, opt, path: str) -> None:
    """The DCP round: a template of pydist's layout, filled from ``path``, loaded."""
    import torch.distributed.checkpoint as dcp

    from pydist.fsdp import get_optimizer_state_dict, set_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt)
    dcp.load(osd, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, osd)


def _pydist_from_checkpoint(seed: int, world_size: int, path: str, optim_path: str | None = None):
    """A pydist model (other weights: ``seed``) and a fresh Adam, loaded from
    the DCP checkpoints at ``path`` (and ``optim_path``)."""
    import torch.distributed.checkpoint as dcp

    model = _build("pydist", seed, world_size)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd)
    if optim_path is not None:
        _load_pydist_optimizer(model, opt, optim_path)
    return model, opt


def _full(value) -> torch.Tensor:
    """The full tensor behind a state-dict value (collective for sharded ones):
    a ShardedTensor's boxes from every rank put in place, a DTensor's
    full_tensor(), a plain tensor as it is."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().clone()
    if not isinstance(value, ShardedTensor):
        return value.detach().clone()
    mine = [(tuple(s.metadata.shard_offsets), s.tensor.clone()) for s in value.local_shards()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    md = value.metadata()
    full = torch.full(tuple(md.size), float("nan"), dtype=md.tensor_properties.dtype)
    for shards in everyone:
        for offsets, t in shards:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
    return full


def _full_sd(sd: dict) -> dict:
    return {k: _full(v) for k, v in sd.items()}


def _full_osd(osd: dict) -> dict:
    return {k: {n: _full(v) if isinstance(v, torch.Tensor) else v for n, v in per.items()}
            for k, per in osd["state"].items()}


def _torch_optim_full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return _full_osd(get_optimizer_state_dict(model, opt))


def _save_rank(rank, world_size, root):
    """2 ranks: pydist and torch train the same model; each saves its model
    and (pydist) optimizer state; pydist reloads its own at once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from pydist.fsdp import full_state_dict, get_optimizer_state_dict

    out = {}
    model = _build("pydist", 0, world_size)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_steps(model, opt, rank, 2, 0)
    sd = model.state_dict()
    shard_ptrs = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
    out["sharded_types"] = {k: type(v).__name__ for k, v in sd.items()}
    out["views"] = all(v.to_local().untyped_storage().data_ptr() in shard_ptrs
                       for v in sd.values() if isinstance(v, DTensor))
    dcp.save(sd, checkpoint_id=os.path.join(root, "pydist2"))
    dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=os.path.join(root, "pydist2_optim"))
    out["pydist_full"] = full_state_dict(model)
    out["pydist_optim"] = _full_osd(get_optimizer_state_dict(model, opt))

    # the same world size: another model and a fresh optimizer read both back
    again, opt2 = _pydist_from_checkpoint(7, world_size, os.path.join(root, "pydist2"),
                                          os.path.join(root, "pydist2_optim"))
    out["reloaded_full"] = full_state_dict(again)
    out["reloaded_optim"] = _full_osd(get_optimizer_state_dict(again, opt2))
    # ... and trains on exactly as the original does (Adam's moments and step came back)
    out["continued"] = (train_steps(model, opt, rank, 2, 2), train_steps(again, opt2, rank, 2, 2))
    out["continued_full"] = (full_state_dict(model), full_state_dict(again))

    # torch FSDP2 saves its own (model.state_dict(): DTensors; its
    # get_optimizer_state_dict), pydist resumes from it, and both train on
    # bitwise alike (see [Note: when the suite asserts bitwise equality])
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as torch_get_osd

    tmodel = _build("torch", 3, world_size)
    topt = torch.optim.Adam(tmodel.parameters(), lr=0.01)
    train_steps(tmodel, topt, rank, 2, 0)
    dcp.save(tmodel.state_dict(), checkpoint_id=os.path.join(root, "torch2"))
    dcp.save(torch_get_osd(tmodel, topt), checkpoint_id=os.path.join(root, "torch2_optim"))
    out["torch_full"] = _full_sd(tmodel.state_dict())
    out["torch_optim"] = _torch_optim_full(tmodel, topt)
    resumed, ropt = _pydist_from_checkpoint(8, world_size, os.path.join(root, "torch2"),
                                            os.path.join(root, "torch2_optim"))
    out["resumed"] = (train_steps(tmodel, topt, rank, 2, 2), train_steps(resumed, ropt, rank, 2, 2))
    out["resumed_full"] = (_full_sd(tmodel.state_dict()), full_state_dict(resumed))
    return out


CHECKPOINTS = ("pydist2", "torch2", "pydist4")  # the model checkpoints, in the order they are written


def _load_rank(rank, world_size, root, save_as, names=CHECKPOINTS, full=None):
    """Any world size: pydist loads pydist's and torch's checkpoints (model
    and Adam state), torch loads pydist's; pydist saves its own under
    ``save_as``; pydist loads the ``full`` state dict another world size gave."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as torch_get_osd
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict as torch_set_osd

    from pydist.fsdp import full_state_dict, get_optimizer_state_dict

    out = {}
    if full is not None:
        model = _build("pydist", 13, world_size)
        model.load_state_dict(full)
        out["pydist<-full2"] = full_state_dict(model)
    for name in names:
        path = os.path.join(root, name)
        if not os.path.exists(path) or name == save_as:
            continue
        model, opt = _pydist_from_checkpoint(11, world_size, path)
        out[f"pydist<-{name}"] = full_state_dict(model)
        if name == "torch2":
            continue
        tmodel = _build("torch", 12, world_size)
        tsd = tmodel.state_dict()
        dcp.load(tsd, checkpoint_id=path)
        tmodel.load_state_dict(tsd)
        out[f"torch<-{name}"] = _full_sd(tmodel.state_dict())
        if name == "pydist2":
            _load_pydist_optimizer(model, opt, os.path.join(root, "pydist2_optim"))
            out["optim<-pydist2"] = _full_osd(get_optimizer_state_dict(model, opt))
            _load_pydist_optimizer(model, opt, os.path.join(root, "torch2_optim"))
            out["optim<-torch2"] = _full_osd(get_optimizer_state_dict(model, opt))
            topt = torch.optim.Adam(tmodel.parameters(), lr=0.01)
            tosd = torch_get_osd(tmodel, topt)
            dcp.load(tosd, checkpoint_id=os.path.join(root, "pydist2_optim"))
            torch_set_osd(tmodel, topt, tosd)
            out["torch_optim<-pydist2"] = _full_osd(torch_get_osd(tmodel, topt))
            if save_as:
                dcp.save(model.state_dict(), checkpoint_id=os.path.join(root, save_as))
    return out


def _two_ranks_rank(rank, world_size, root):
    """4 -> 2, torch's get/set_model_state_dict on a pydist model, FSDP1's
    state_dict_type front door."""
    return {**_load_rank(rank, world_size, root, None, names=("pydist4",)), **_torch_helpers_rank(rank, world_size, root)}


def _torch_helpers_rank(rank, world_size, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, ShardedStateDictConfig, StateDictType

    import pydist
    from pydist.fsdp import full_state_dict, get_optimizer_state_dict

    out = {}
    src = _build("pydist", 0, world_size)
    ref = full_state_dict(src)
    out["ref"] = ref
    # set_model_state_dict, full: every rank holds the full tensors
    a = _build("pydist", 1, world_size)
    set_model_state_dict(a, dict(ref), options=StateDictOptions(full_state_dict=True))  # (torch puts its values in it)
    out["set_full"] = full_state_dict(a)
    # get_model_state_dict, full: FSDP2's way to a full checkpoint (torch
    # gathers pydist's ShardedTensors; with cpu_offload on rank 0 only)
    out["get_full"] = get_model_state_dict(src, options=StateDictOptions(full_state_dict=True))
    out["get_full_offload"] = get_model_state_dict(src, options=StateDictOptions(full_state_dict=True,
                                                                                 cpu_offload=True))
    # A 3 x 4 weight at 2 ranks: each rank's first piece fits torch's own
    # dim-0 chunk, so torch's gather of it gave wrong values, not an error
    grid = torch.nn.Linear(4, 3, bias=False)
    grid.weight.data = torch.arange(12.0).view(3, 4)
    pydist.fully_shard(grid)
    out["grid_full"] = get_model_state_dict(grid, options=StateDictOptions(full_state_dict=True))["weight"]
    # get/set_model_state_dict, sharded: through DCP
    path = os.path.join(root, "helpers")
    dcp.save(get_model_state_dict(src, options=StateDictOptions(full_state_dict=False)), checkpoint_id=path)
    b = _build("pydist", 2, world_size)
    sd = get_model_state_dict(b, options=StateDictOptions(full_state_dict=False))
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(b, sd, options=StateDictOptions(full_state_dict=False))
    out["set_sharded"] = full_state_dict(b)
    # units left unsharded (reshard_after_forward=False, a no_grad forward):
    # state_dict() still gives the shards; load_state_dict reshards, loads, and
    # the next forward gathers the loaded values
    e = _build("pydist", 4, world_size, reshard_after_forward=False)
    x, _ = make_batch(Scenario(), rank, 9, 0)
    with torch.no_grad():
        e(x)
        out["unsharded_types"] = {k: type(v).__name__ for k, v in e.state_dict().items()}
        e.load_state_dict(ref)
        out["forward_after_load"] = (src(x), e(x))

    # torch's get/set_optimizer_state_dict on pydist's shards: full, and
    # sharded through DCP into another model's optimizer
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as torch_get_osd
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict as torch_set_osd
    from pydist.fsdp import full_optimizer_state_dict

    sopt = torch.optim.Adam(src.parameters(), lr=0.01)
    train_steps(src, sopt, rank, 1, 0)
    out["osd_ref"] = full_optimizer_state_dict(src, sopt)
    out["osd_full"] = torch_get_osd(src, sopt, options=StateDictOptions(full_state_dict=True))
    dcp.save(torch_get_osd(src, sopt), checkpoint_id=os.path.join(root, "helpers_optim"))
    f = _build("pydist", 5, world_size)
    fopt = torch.optim.Adam(f.parameters(), lr=0.01)
    osd = torch_get_osd(f, fopt)
    dcp.load(osd, checkpoint_id=os.path.join(root, "helpers_optim"))
    torch_set_osd(f, fopt, osd)
    out["osd_loaded"] = full_optimizer_state_dict(f, fopt)
    for name, flatten in (("osd_set_full", False), ("osd_set_flat", True)):  # full dicts, as saved by torch.save
        options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=flatten)
        h = _build("pydist", 6, world_size)
        hopt = torch.optim.Adam(h.parameters(), lr=0.01)
        torch_set_osd(h, hopt, torch_get_osd(src, sopt, options=options), options=options)
        out[name] = full_optimizer_state_dict(h, hopt)

    # FSDP1: FULL_STATE_DICT (rank0_only) and SHARDED_STATE_DICT, unwrapped keys
    FSDP = pydist.FullyShardedDataParallel
    torch.manual_seed(0)
    c = FSDP(MODELS["mlp"](), auto_wrap_policy=_linear_policy(), device_id=torch.device("cpu"))
    copt = torch.optim.Adam(c.parameters(), lr=0.01)
    train_steps(c, copt, rank, 1, 0)
    with FSDP.state_dict_type(c, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        out["fsdp1_full"] = c.state_dict()
    with FSDP.state_dict_type(c, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
        sd = c.state_dict()
        out["fsdp1_sharded_types"] = {k: type(v).__name__ for k, v in sd.items()}
        dcp.save(sd, checkpoint_id=os.path.join(root, "fsdp1"))
    out["fsdp1_default"] = c.state_dict()  # FULL_STATE_DICT on every rank again after the context
    torch.manual_seed(5)
    d = FSDP(MODELS["mlp"](), auto_wrap_policy=_linear_policy(), device_id=torch.device("cpu"))
    with FSDP.state_dict_type(d, StateDictType.SHARDED_STATE_DICT):
        sd = d.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(root, "fsdp1"))
        d.load_state_dict(sd)
    with FSDP.state_dict_type(d, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        out["fsdp1_loaded"] = d.state_dict()
    # FSDP1's optimizer helpers: full (rank0_only or not) and sharded through DCP
    out["fsdp1_optim_ref"] = _full_osd(get_optimizer_state_dict(c.module, copt))
    full_cfg = (FullStateDictConfig(rank0_only=False), FullOptimStateDictConfig(rank0_only=False))
    with FSDP.state_dict_type(c, StateDictType.FULL_STATE_DICT, *full_cfg):
        full_osd = FSDP.optim_state_dict(c, copt)
    out["fsdp1_optim_full"] = full_osd["state"]
    with FSDP.state_dict_type(c, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
                              FullOptimStateDictConfig(rank0_only=True)):
        out["fsdp1_optim_rank0"] = FSDP.optim_state_dict(c, copt)
    dopt = torch.optim.Adam(d.parameters(), lr=0.01)
    with FSDP.state_dict_type(d, StateDictType.FULL_STATE_DICT, *full_cfg):
        FSDP.optim_state_dict_to_load(d, dopt, full_osd, load_directly=True)
    out["fsdp1_optim_full_loaded"] = _full_osd(get_optimizer_state_dict(d.module, dopt))
    with FSDP.state_dict_type(c, StateDictType.SHARDED_STATE_DICT):
        dcp.save(FSDP.optim_state_dict(c, copt), checkpoint_id=os.path.join(root, "fsdp1_optim"))
    eopt = torch.optim.Adam(d.parameters(), lr=0.01)
    with FSDP.state_dict_type(d, StateDictType.SHARDED_STATE_DICT):
        osd = FSDP.optim_state_dict(d, eopt)
        dcp.load(osd, checkpoint_id=os.path.join(root, "fsdp1_optim"))
        FSDP.optim_state_dict_to_load(d, eopt, osd, load_directly=True)
    out["fsdp1_optim_sharded_loaded"] = _full_osd(get_optimizer_state_dict(d.module, eopt))
    try:
        with FSDP.state_dict_type(d, StateDictType.LOCAL_STATE_DICT):
            d.state_dict()
        out["local_refused"] = ""
    except NotImplementedError as e:
        out["local_refused"] = str(e)
    return out


def _linear_policy():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({torch.nn.Linear})


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def _lists(value):
    """``value`` with every tuple a list, recursively."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def _assert_same(ref: dict, got: dict, where: str) -> None:
    assert sorted(got) == sorted(ref), f"{where}: keys {sorted(got)} != {sorted(ref)}"
    for k in ref:
        r, g = ref[k], got[k]
        if isinstance(r, dict):
            _assert_same(r, g, f"{where} {k}")
            continue
        assert torch.is_tensor(g) and g.shape == r.shape and g.dtype == r.dtype, f"{where}: {k} is {g!r}"
        assert torch.equal(g, r), f"{where}: {k} differs (max abs diff {(g.double() - r.double()).abs().max():.3e})"


@pytest.fixture(scope="module")
def ckpt2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_ranks(_save_rank, 2, args=(root,), timeout=60)


@pytest.fixture(scope="module")
def ckpt4(ckpt2):
    root, saved = ckpt2
    return run_ranks(_load_rank, 4, args=(root, "pydist4", CHECKPOINTS, saved[0]["pydist_full"]), timeout=90)


def test_flat_range_boxes_cover_the_range_in_order():
    for shape in [(5,), (4, 6), (2, 3, 4), (3, 1, 2, 5), ()]:
        numel = torch.Size(shape).numel()
        index = torch.arange(numel).reshape(shape)
        for start in range(numel + 1):
            for end in range(start, numel + 1):
                boxes = flat_range_boxes(shape, start, end)
                assert len(boxes) <= max(1, 2 * len(shape) - 1)
                got = [index[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))].reshape(-1) for b in boxes]
                got = torch.cat(got) if got else torch.empty(0, dtype=index.dtype)
                assert torch.equal(got, torch.arange(start, end)), f"{shape} [{start}, {end}): {boxes}"
                assert all(b.flat_start == int(g[0]) for b, g in zip(boxes, got.split([b.numel for b in boxes])))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_every_rank_piece_together_covers_each_parameter_once(world_size):
    """The ranges the ShardedTensor metadata declares per rank (``_rank_range``)
    are the ranges the units hold (``FSDPParam.local_start/end``), and over
    the ranks they cover each parameter exactly once."""
    import torch.nn as nn

    from pydist.fsdp._fsdp_param import ParamModuleInfo
    from pydist.fsdp._fsdp_param_group import FSDPParamGroup
    from pydist.fsdp._state_dict import _rank_range

    model = nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3), nn.Linear(3, 7), nn.Conv2d(2, 3, 2))
    named = [(n, p, [ParamModuleInfo(model[int(n.split(".")[0])], n.split(".")[1])]) for n, p in model.named_parameters()]
    for rank in range(world_size):
        pg = FSDPParamGroup(named, rank, world_size, sharded=True, reshard_after_forward=True, label="m")
        for fp in pg.fsdp_params:
            lo, hi = _rank_range(fp, rank)
            assert (lo, hi) == (fp.local_start - fp.offset, fp.local_end - fp.offset) or fp.local_numel == hi - lo == 0
            pieces = [_rank_range(fp, r) for r in range(world_size)]
            assert all(0 <= a <= b <= fp.numel for a, b in pieces), f"{fp}: ranks hold {pieces}"
            covered = torch.cat([torch.arange(a, b) for a, b in pieces])
            assert torch.equal(covered, torch.arange(fp.numel)), f"{fp}: ranks hold {pieces}"


@pytest.mark.timeout(120)
def test_sharded_state_dict_round_trip_same_world_size(ckpt2):
    _, results = ckpt2
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        assert out["views"], f"{where}: the DTensors' local tensors are not views of the shards"
        kinds = set(out["sharded_types"].values())
        assert kinds == {"DTensor"}, f"{where}: state_dict() holds {out['sharded_types']}"
        _assert_same(out["pydist_full"], out["reloaded_full"], f"{where} params reloaded")
        _assert_same(out["pydist_optim"], out["reloaded_optim"], f"{where} Adam state reloaded")
        assert out["continued"][0] == out["continued"][1], f"{where}: training after the reload diverged"
        _assert_same(*out["continued_full"], f"{where} params after 2 more steps")
        assert out["resumed"][0] == out["resumed"][1], f"{where}: pydist resumed from torch's checkpoint diverged"
        _assert_same(*out["resumed_full"], f"{where} params, torch and pydist resumed from torch's checkpoint")
    assert results[0]["pydist_full"].keys() == results[0]["torch_full"].keys()


@pytest.mark.timeout(180)
def test_checkpoints_move_2_to_4_and_between_pydist_and_torch(ckpt2, ckpt4):
    _, saved = ckpt2
    pydist2, torch2, optim2 = saved[0]["pydist_full"], saved[0]["torch_full"], saved[0]["pydist_optim"]
    for rank, out in enumerate(ckpt4):
        _assert_same(pydist2, out["pydist<-pydist2"], f"4 ranks, rank {rank}: pydist from pydist's 2-rank")
        _assert_same(pydist2, out["pydist<-full2"], f"4 ranks, rank {rank}: pydist from pydist's 2-rank full state dict")
        _assert_same(pydist2, out["torch<-pydist2"], f"4 ranks, rank {rank}: torch from pydist's 2-rank")
        _assert_same(torch2, out["pydist<-torch2"], f"4 ranks, rank {rank}: pydist from torch's 2-rank")
        _assert_same(optim2, out["optim<-pydist2"], f"4 ranks, rank {rank}: Adam state from pydist's 2-rank")
        _assert_same(saved[0]["torch_optim"], out["optim<-torch2"], f"4 ranks, rank {rank}: Adam state from torch's 2-rank")
        _assert_same(optim2, out["torch_optim<-pydist2"], f"4 ranks, rank {rank}: torch's Adam state from pydist's 2-rank")


@pytest.mark.timeout(90)
def test_checkpoints_move_2_to_1_and_4_to_1(ckpt2, ckpt4):
    root, saved = ckpt2
    pydist2, torch2, optim2 = saved[0]["pydist_full"], saved[0]["torch_full"], saved[0]["pydist_optim"]
    out = run_ranks(_load_rank, 1, args=(root, None, CHECKPOINTS, pydist2), timeout=60)[0]
    _assert_same(pydist2, out["pydist<-full2"], "1 rank: pydist from pydist's 2-rank full state dict")
    _assert_same(pydist2, out["pydist<-pydist4"], "1 rank: pydist from pydist's 4-rank")
    _assert_same(pydist2, out["torch<-pydist4"], "1 rank: torch from pydist's 4-rank")
    _assert_same(pydist2, out["pydist<-pydist2"], "1 rank: pydist from pydist's 2-rank")
    _assert_same(pydist2, out["torch<-pydist2"], "1 rank: torch from pydist's 2-rank")
    _assert_same(torch2, out["pydist<-torch2"], "1 rank: pydist from torch's 2-rank")
    _assert_same(optim2, out["optim<-pydist2"], "1 rank: Adam state from pydist's 2-rank")
    _assert_same(saved[0]["torch_optim"], out["optim<-torch2"], "1 rank: Adam state from torch's 2-rank")
    _assert_same(optim2, out["torch_optim<-pydist2"], "1 rank: torch's Adam state from pydist's 2-rank")


@pytest.mark.timeout(90)
def test_4_to_2_torch_state_dict_helpers_and_fsdp1_state_dict_type(ckpt2, ckpt4):
    root, saved = ckpt2
    results = run_ranks(_two_ranks_rank, 2, args=(root,), timeout=60)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        _assert_same(saved[0]["pydist_full"], out["pydist<-pydist4"], f"2 ranks, {where}: pydist from pydist's 4-rank")
        _assert_same(saved[0]["pydist_full"], out["torch<-pydist4"], f"2 ranks, {where}: torch from pydist's 4-rank")
        _assert_same(out["ref"], out["set_full"], f"{where} set_model_state_dict(full_state_dict=True)")
        assert list(out["get_full"]) == list(out["ref"]), f"{where}: {list(out['get_full'])}"
        _assert_same(out["ref"], out["get_full"], f"{where} get_model_state_dict(full_state_dict=True)")
        assert torch.equal(out["grid_full"], torch.arange(12.0).view(3, 4)), f"{where}: {out['grid_full']}"
        for got in ("osd_full", "osd_loaded", "osd_set_full", "osd_set_flat"):
            _assert_same(out["osd_ref"]["state"], out[got]["state"], f"{where} torch's {got}")
            # (torch's load of a full dict gives tuples such as betas back as lists: the same values)
            assert _lists(out[got]["param_groups"]) == _lists(out["osd_ref"]["param_groups"]), f"{where} {got}"
        if rank == 0:
            _assert_same(out["ref"], out["get_full_offload"], f"{where} get_model_state_dict(full, cpu_offload)")
        else:
            assert out["get_full_offload"] == {}, f"{where}: cpu_offload gave {sorted(out['get_full_offload'])}"
        _assert_same(out["ref"], out["set_sharded"], f"{where} get/set_model_state_dict(full_state_dict=False) + DCP")
        assert set(out["unsharded_types"].values()) == {"DTensor"}, out["unsharded_types"]
        _assert_same(*[{"out": t} for t in out["forward_after_load"]], f"{where} forward after a load into unsharded units")
        fsdp1_ref = results[0]["fsdp1_full"]
        assert sorted(fsdp1_ref) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "fc3.bias", "fc3.weight"]
        if rank == 0:
            assert all(type(v) is torch.Tensor for v in fsdp1_ref.values())
        else:
            assert out["fsdp1_full"] == {}, f"{where}: rank0_only gave {sorted(out['fsdp1_full'])}"
        assert set(out["fsdp1_sharded_types"].values()) == {"ShardedTensor"}
        assert sorted(out["fsdp1_sharded_types"]) == sorted(fsdp1_ref)
        _assert_same(fsdp1_ref, out["fsdp1_default"], f"{where} FSDP1 state_dict() after the context")
        _assert_same(fsdp1_ref, out["fsdp1_loaded"], f"{where} FSDP1 SHARDED_STATE_DICT through DCP")
        assert "LOCAL_STATE_DICT" in out["local_refused"], out["local_refused"]
        optim_ref = out["fsdp1_optim_ref"]
        assert sorted(optim_ref) == sorted(fsdp1_ref) and all("exp_avg" in v for v in optim_ref.values())
        _assert_same(optim_ref, out["fsdp1_optim_full"], f"{where} FSDP.optim_state_dict, FULL")
        if rank:
            assert out["fsdp1_optim_rank0"] == {}, f"{where}: rank0_only optimizer state on rank {rank}"
        else:
            _assert_same(optim_ref, out["fsdp1_optim_rank0"]["state"], f"{where} FSDP.optim_state_dict, rank0_only")
        _assert_same(optim_ref, out["fsdp1_optim_full_loaded"], f"{where} FSDP.optim_state_dict_to_load, FULL")
        _assert_same(optim_ref, out["fsdp1_optim_sharded_loaded"], f"{where} FSDP optimizer state, SHARDED through DCP")
