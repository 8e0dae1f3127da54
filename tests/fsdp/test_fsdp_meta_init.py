"""A model built on the meta device, as FSDP2's recipe builds one too large
for a device (``with torch.device("meta")``, ``fully_shard`` bottom-up,
``to_empty(device="cpu")``, initialize, then the optimizer), trains bitwise
as torch's FSDP2 trains it (the initialization runs on DTensors, each rank
its chunks, as torch's); resumes from checkpoints; and what is refused on
the way names what to do. pydist.FullyShardedDataParallel materializes a
meta model as torch's FSDP1 does, bitwise. Spawned gloo ranks. See [Note:
DTensor parameters] in pydist/fsdp/_fsdp_param.py, [Note: a unit built on
the meta device] in _fsdp_param_group.py and [Note: FSDP1's meta-device
init] in _fully_sharded_data_parallel.py."""

import os
import sys

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fsdp_harness import IN, Nested  # noqa: E402


class TiedLM(nn.Module):
    """Input and output embeddings one Parameter (in the root's unit), a block between."""

    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.block(self.embed(x)))

    def units(self):
        return [self.block]

    def reset_parameters(self):
        """Every parameter once, the tied one as the embedding (not as the head's Linear)."""
        self.embed.reset_parameters()
        self.block[0].reset_parameters()


def _shard(model: nn.Module, on_meta: bool, impl: str = "pydist", **kwargs) -> nn.Module:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from pydist import fully_shard

    shard = fully_shard if impl == "pydist" else torch_fully_shard
    for unit in model.units():
        shard(unit, **kwargs)
    shard(model, **kwargs)
    if on_meta:
        model.to_empty(device="cpu")
        _initialize(model)
    return model


def _initialize(model: nn.Module) -> None:
    torch.manual_seed(0)
    if isinstance(model, TiedLM):
        model.reset_parameters()
        return
    for m in model.modules():  # the order Nested's constructor initialized them in
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def _build(on_meta: bool, cls=Nested, impl: str = "pydist", **kwargs) -> nn.Module:
    if on_meta:
        with torch.device("meta"):
            model = cls()
    else:
        torch.manual_seed(0)
        model = cls()
        if cls is TiedLM:
            _initialize(model)  # as the meta build will (the constructor also drew the head's own init)
    return _shard(model, on_meta, impl, **kwargs)


def _train(model: nn.Module, rank: int):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    params = list(opt.param_groups[0]["params"])
    losses = []
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        x = torch.randint(0, 16, (4, 3)) if isinstance(model, TiedLM) else torch.randn(4, IN)
        loss = model(x).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # The optimizer stepped on the parameters the modules hold (DTensors, as torch's).
    shards = {id(p) for p in model.parameters()}
    on_shards = all(id(p) in shards for p in params) and len(params) == len(shards)
    return losses, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), on_shards


def _meta_rank(rank, world_size):
    """torch's FSDP2 and pydist's, on the same model built on the meta device
    and initialized through DTensors (each rank its chunks, as torch's
    DTensor init does on the CPU), and on the CPU."""
    out = {}
    for impl in ("torch", "pydist"):
        out["cpu", impl] = _train(_build(False, impl=impl), rank)
        out["meta", impl] = _train(_build(True, impl=impl), rank)
        # A weight tied across two modules of one unit, computing in bf16.
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        tied = _build(True, TiedLM, impl=impl, mp_policy=mp)
        out["tied_is_tied", impl] = tied.head.weight is tied.embed.weight
        out["tied_meta", impl] = _train(tied, rank)

    def message(fn):
        try:
            fn()
        except (RuntimeError, NotImplementedError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    # A forward before to_empty names the cure (and is refused on every rank alike: no collective ran).
    with torch.device("meta"):
        unmaterialized = Nested()
    for unit in unmaterialized.units():
        from pydist import fully_shard

        fully_shard(unit)
    fully_shard(unmaterialized)
    out["forward_on_meta"] = message(lambda: unmaterialized(torch.randn(2, IN)))
    # Moving a sharded module where it is changes nothing; a cast recasts its units (tests/fsdp/test_fsdp_cast.py).
    out["same_device"] = message(lambda: _build(on_meta=False).to("cpu").float())
    out["cast"] = {p.dtype for p in _build(on_meta=False).to(torch.float64).parameters()}
    return out


@pytest.mark.timeout(150)
def test_meta_device_build_trains_bitwise_as_torchs_fsdp2():
    for rank, out in enumerate(run_ranks(_meta_rank, 2, timeout=130)):
        for flow in ("cpu", "meta", "tied_meta"):
            (ref_losses, ref_sd, _), (losses, sd, on_shards) = out[flow, "torch"], out[flow, "pydist"]
            assert losses == ref_losses, (rank, flow, losses, ref_losses)
            assert sd.keys() == ref_sd.keys()
            for key in ref_sd:
                assert torch.equal(sd[key], ref_sd[key]), (rank, flow, key)
            assert on_shards, (rank, flow)
        assert out["meta", "pydist"][0] != out["cpu", "pydist"][0]  # DTensor init draws per chunk: another model
        assert out["tied_is_tied", "pydist"] == out["tied_is_tied", "torch"], rank
        assert "still on the meta device" in out["forward_on_meta"] and "to_empty(device='cpu')" in out["forward_on_meta"]
        assert out["cast"] == {torch.float64}, out["cast"]
        assert out["same_device"] == "no error", out["same_device"]


def _fsdp1_rank(rank, world_size):
    """torch's FSDP1 and pydist's, each on a model built on the meta device
    (materialized by the wrapper's reset_parameters walk) and on the CPU;
    and pydist's on llama-recipes' flow: rank 0 builds on the CPU, the others
    on meta with a to_empty param_init_fn, and sync_module_states broadcasts
    rank 0's values (torch's FSDP1 refuses sync_module_states on the CPU)."""
    import pydist
    from fsdp_harness import Block, Scenario, _full_params, make_batch
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    sc = Scenario(api="fsdp1", model="nested")
    out = {}
    for flow in ("meta", "cpu", "init_fn"):
        for impl in ("torch", "pydist") if flow != "init_fn" else ("pydist",):
            torch.manual_seed(0)
            kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({Block, nn.Sequential}), device_id=torch.device("cpu"),
                          use_orig_params=True)
            if flow == "meta" or (flow == "init_fn" and rank != 0):
                with torch.device("meta"):
                    model = Nested()
            else:
                model = Nested()
            if flow == "init_fn":
                kwargs["sync_module_states"] = True
                if rank != 0:
                    kwargs["param_init_fn"] = lambda m: m.to_empty(device=torch.device("cpu"), recurse=False)
            cls = FullyShardedDataParallel if impl == "torch" else pydist.FullyShardedDataParallel
            model = cls(model, **kwargs)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            losses = []
            for step in range(3):
                x, y = make_batch(sc, rank, step, 0)
                loss = (model(x) - y).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out[flow, impl] = (losses, _full_params(impl, sc, model))
    return out


@pytest.mark.timeout(120)
def test_fsdp1_materializes_a_meta_model_as_torchs_fsdp1():
    for rank, out in enumerate(run_ranks(_fsdp1_rank, 2, timeout=100)):
        # llama-recipes' flow starts from rank 0's CPU build: the CPU flow's model.
        for flow, ref in (("meta", ("meta", "torch")), ("cpu", ("cpu", "torch")), ("init_fn", ("cpu", "torch"))):
            (ref_losses, ref_params), (losses, params) = out[ref], out[flow, "pydist"]
            assert losses == ref_losses, (rank, flow, losses, ref_losses)
            assert params.keys() == ref_params.keys(), (rank, flow)
            for key in params:
                assert torch.equal(params[key], ref_params[key]), (rank, flow, key)
        assert out["meta", "pydist"][0] != out["cpu", "pydist"][0]  # two different initializations


def _resume_rank(rank, world_size, path):
    """Resuming from a DCP checkpoint into a model built on the meta device:
    to_empty, then ``sd = model.state_dict(); dcp.load(sd); model.load_state_dict(sd)``
    (the state dict shards the unit: its shard is what dcp.load writes into)."""
    import torch.distributed.checkpoint as dcp
    from pydist.fsdp import full_state_dict

    trained = _build(on_meta=False)
    _train(trained, rank)
    dcp.save(trained.state_dict(), checkpoint_id=path)
    with torch.device("meta"):
        resumed = Nested()
    resumed = _shard(resumed, on_meta=False)  # fully_shard on meta; no init: the checkpoint is the init
    resumed.to_empty(device="cpu")
    sd = resumed.state_dict()
    dcp.load(sd, checkpoint_id=path)
    resumed.load_state_dict(sd)
    expected, got = full_state_dict(trained), full_state_dict(resumed)
    x = torch.randn(3, IN)
    out = [expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected),
           torch.equal(trained(x), resumed(x))]
    # A full state dict loaded straight after to_empty: the load lays the unit
    # out from what to_empty left, and must not take those values for the
    # ones built (the first forward refused them as built differently)
    with torch.device("meta"):
        direct = Nested()
    direct = _shard(direct, on_meta=False)
    direct.to_empty(device="cpu")
    direct.load_state_dict(expected)
    out.append(torch.equal(trained(x), direct(x)))
    return tuple(out)


@pytest.mark.timeout(120)
def test_meta_device_build_resumes_from_a_checkpoint(tmp_path):
    assert run_ranks(_resume_rank, 2, args=(str(tmp_path / "ckpt"),), timeout=100) == [(True, True, True)] * 2


def _broadcast_resume_rank(rank, world_size):
    """FSDP2's documented resume, under torch's fully_shard and pydist's: a
    model built on the meta device and sharded gets a full model and
    optimizer state dict held by rank 0 alone (broadcast_from_rank0), pydist's
    with no to_empty or init in between (see [Note: resuming a model built
    on the meta device]); both then train on, from torch's checkpoint."""
    import copy

    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import pydist

    def build(wrap, meta, **kwargs):
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            model = Nested()
        for m in model.units():
            wrap(m, **kwargs)
        wrap(model, **kwargs)
        return model

    def train(model, opt, steps):
        for step in steps:
            g = torch.Generator().manual_seed(rank * 1000 + step)
            F.mse_loss(model(torch.randn(8, IN, generator=g)), torch.randn(8, 4, generator=g)).backward()
            opt.step()
            opt.zero_grad()

    full = StateDictOptions(full_state_dict=True)
    mesh = init_device_mesh("cpu", (world_size,))
    trained = build(torch_fully_shard, False, mesh=mesh)
    opt = torch.optim.AdamW(trained.parameters(), lr=0.01)
    train(trained, opt, range(2))
    msd, osd = get_model_state_dict(trained, options=full), get_optimizer_state_dict(trained, opt, options=full)
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    out = {}
    for name, wrap, kwargs in (("torch", torch_fully_shard, {"mesh": mesh}), ("pydist", pydist.fully_shard, {})):
        model = build(wrap, True, **kwargs)
        if name == "torch":
            # torch 2.13's broadcast_from_rank0 into FSDP2's DTensors fails on
            # gloo (c10d.broadcast_ has no DTensor sharding strategy): torch
            # loads the full dicts on every rank, after to_empty.
            # (Both loaders put their own values into the dict they are given: each gets a copy.)
            model.to_empty(device="cpu")
            set_model_state_dict(model, copy.deepcopy(msd), options=full)
            resumed = torch.optim.AdamW(model.parameters(), lr=0.01)
            set_optimizer_state_dict(model, resumed, copy.deepcopy(osd), options=full)
        else:
            set_model_state_dict(model, copy.deepcopy(msd) if rank == 0 else {}, options=broadcast)
            resumed = torch.optim.AdamW(model.parameters(), lr=0.01)
            set_optimizer_state_dict(model, resumed, copy.deepcopy(osd) if rank == 0 else {}, options=broadcast)
        train(model, resumed, range(2, 4))
        out[name] = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    return out


@pytest.mark.timeout(120)
def test_meta_model_resumes_from_rank0_broadcast_as_torchs():
    """See _broadcast_resume_rank; pydist's run lands bitwise on torch's."""
    for out in run_ranks(_broadcast_resume_rank, 2, timeout=100):
        assert sorted(out["pydist"]) == sorted(out["torch"])
        for k, v in out["torch"].items():
            assert torch.equal(out["pydist"][k], v), f"{k}: max abs diff {(out['pydist'][k] - v).abs().max()}"
