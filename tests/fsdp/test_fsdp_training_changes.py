"""What a training loop changes between steps, against torch's FSDP2 on the
same seeds and data at 2 ranks, bitwise: a unit that ran in a no-sync
micro-batch but not in the synced one (its accumulated gradient is reduced
in that step, as torch does), ``requires_grad`` switched on the
parameters ``model.parameters()`` gives, after ``fully_shard``, and
parameters no rank gives a gradient (``.grad`` left None, as FSDP2 leaves
it, so AdamW's weight decay skips them; zeros under FSDP1, as torch's)."""

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks


class Net(nn.Module):
    def __init__(self, d: int = 8, n: int = 3):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(n)])
        self.out = nn.Linear(d, 2)
        self.skip: tuple = ()

    def forward(self, x):
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = block(x)
        return self.out(x)


def _build(impl: str, world_size: int, mixed: bool, spare: bool = False):
    import pydist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    model = Net()
    if spare:  # parameters forward never uses: in a batched unit and in the root's
        model.blocks[1].register_parameter("spare", nn.Parameter(torch.randn(8)))
        model.spare = nn.Parameter(torch.randn(3))
    shard = torch_fully_shard if impl == "torch" else pydist.fully_shard
    kwargs = {"mesh": init_device_mesh("cpu", (world_size,))} if impl == "torch" else {}
    if mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        shard(block, **kwargs)
    return shard(model, **kwargs)


def _full(impl: str, model) -> dict:
    import pydist

    if impl == "torch":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {k: v.clone() for k, v in pydist.fsdp.full_state_dict(model).items()}


def _train(model, opt, rank: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=gen)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _assert_bitwise(results, theirs: str) -> None:
    """Each rank's {"torch": full parameters, "pydist": ...} equal key by key."""
    for rank, out in enumerate(results):
        for k, ref in out["torch"].items():
            assert torch.equal(out["pydist"][k], ref), f"rank {rank}: {k} differs from {theirs}"


# Each step: (what changes before it, micro-batches as (units skipped, sync)).
SCENARIOS = {
    "skipped_in_synced_micro_batch": [(None, [((), True)]), (None, [((), False), ((1,), True)]), (None, [((), True)])],
    "frozen_before_first_forward": [("freeze", [((), True)]), (None, [((), True)])],
    "frozen_after_a_step": [(None, [((), True)]), ("freeze", [((), True)]), (None, [((), True)])],
    "unfrozen_after_a_step": [("freeze_at_wrap", [((), True)]), ("unfreeze", [((), True)]), (None, [((), True)])],
    "unused_everywhere": [("spare", [((), True)]), (None, [((), True)]), (None, [((), False), ((), True)])],
    # frozen after the first micro-batch: what it accumulated is still reduced and stepped on
    "frozen_between_micro_batches": [("freeze_after_first", [((), False), ((), True)]), ("unfreeze", [((), True)]),
                                     (None, [((), True)])],
    # the same through the module while it is left unsharded between micro-batches
    # (set_reshard_after_backward(sync)): the module holds the unsharded parameter then
    "frozen_while_left_unsharded": [(None, [((), True)]), ("freeze_module_after_first", [((), False), ((), True)]),
                                    ("unfreeze_module", [((), False), ((), True)]), (None, [((), True)])],
}


def _run(rank, world_size, impl, scenario, mixed):
    steps = SCENARIOS[scenario]
    model = _build(impl, world_size, mixed, spare=steps[0][0] == "spare")
    weight = model.blocks[0][0].weight  # what model.parameters() gives for it
    if steps[0][0] == "freeze_at_wrap":
        weight.requires_grad_(False)
    if steps[0][0] == "spare":
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    log = []
    for change, micro_batches in steps:
        if change in ("freeze", "unfreeze"):
            weight.requires_grad_(change == "unfreeze")
        if change == "unfreeze_module":
            model.blocks[0][0].weight.requires_grad_(True)
        for i, (skip, sync) in enumerate(micro_batches):
            model.skip = skip
            model.set_requires_gradient_sync(sync)
            if scenario == "frozen_while_left_unsharded":
                model.set_reshard_after_backward(sync)
            model(torch.randn(4, 8, generator=gen)).float().pow(2).sum().backward()
            if change == "freeze_after_first" and i == 0:
                weight.requires_grad_(False)
            if change == "freeze_module_after_first" and i == 0:
                model.blocks[0][0].weight.requires_grad_(False)
        log.append(tuple(n for n, p in model.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
    return _full(impl, model), log


def _both(rank, world_size, scenario, mixed):
    return {impl: _run(rank, world_size, impl, scenario, mixed) for impl in ("torch", "pydist")}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scenario,mixed", [("skipped_in_synced_micro_batch", False),
                                            ("skipped_in_synced_micro_batch", True),
                                            ("frozen_before_first_forward", False), ("frozen_after_a_step", False),
                                            ("unfrozen_after_a_step", False), ("unused_everywhere", False),
                                            ("unused_everywhere", True), ("frozen_between_micro_batches", False),
                                            ("frozen_between_micro_batches", True),
                                            ("frozen_while_left_unsharded", False)])
def test_bitwise_torch_fsdp2(scenario, mixed):
    for rank, out in enumerate(run_ranks(_both, 2, args=(scenario, mixed), timeout=140)):
        (ref, ref_log), (got, got_log) = out["torch"], out["pydist"]
        assert got_log == ref_log, f"rank {rank}: parameters without .grad per step: torch {ref_log}, pydist {got_log}"
        for k in ref:
            assert torch.equal(got[k], ref[k]), f"rank {rank}: {k} differs by {(got[k] - ref[k]).abs().max().item()}"


class Checkpointed(nn.Module):
    """Each block under activation checkpointing: its forward runs again in
    backward, where the block is a unit, holds two (the recompute reaches
    both before either's backward, from the LayerNorm after them), or both."""

    def __init__(self, reentrant: bool, d: int = 8):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.LayerNorm(d))
                                     for _ in range(3)])

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def _checkpointed(rank, world_size, layout, reentrant):
    import pydist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    for impl in ("torch", "pydist"):
        torch.manual_seed(0)
        model = Checkpointed(reentrant)
        shard = torch_fully_shard if impl == "torch" else pydist.fully_shard
        kwargs = {"mesh": init_device_mesh("cpu", (world_size,))} if impl == "torch" else {}
        for block in model.blocks:
            if layout in ("inner", "both"):
                shard(block[0], **kwargs)
                shard(block[2], **kwargs)
            if layout in ("block", "both"):
                shard(block, **kwargs)
        shard(model, **kwargs)
        _train(model, torch.optim.SGD(model.parameters(), lr=0.05), rank, 3)
        out[impl] = _full(impl, model)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout,reentrant", [("block", False), ("inner", False), ("both", False), ("block", True)])
def test_activation_checkpointing_around_units_bitwise_torch_fsdp2(layout, reentrant):
    _assert_bitwise(run_ranks(_checkpointed, 2, args=(layout, reentrant), timeout=110), "torch FSDP2's")


def _fsdp1_unused(rank, world_size):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType

    import pydist

    out = {}
    for impl, cls in (("torch", TorchFSDP), ("pydist", pydist.FullyShardedDataParallel)):
        torch.manual_seed(0)
        model = Net()
        model.spare = nn.Parameter(torch.randn(3))
        kwargs = {"device_id": torch.device("cpu"), "use_orig_params": True} if impl == "torch" else {}
        model = cls(model, **kwargs)
        _train(model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1), rank, 2)
        with cls.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            out[impl] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


@pytest.mark.timeout(120)
def test_fsdp1_front_door_gives_unused_parameters_zeros_as_torch_fsdp1():
    _assert_bitwise(run_ranks(_fsdp1_unused, 2, timeout=110), "torch FSDP1's")


def _decay_matrices(params) -> list:
    """nanoGPT's configure_optimizers: weight decay for the parameters of 2 or
    more dimensions only, chosen by ``p.dim()``."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _optimizer_first(rank, world_size, front):
    """AdamW built on the model before it is sharded (DDP scripts' order),
    against torch's own way: FSDP2's built after fully_shard, its groups by
    the DTensors' dims; FSDP1's built before too (use_orig_params=True keeps
    the Parameter objects, as pydist does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import pydist

    out = {}
    for impl in ("torch", "pydist"):
        torch.manual_seed(0)
        model = Net()
        before = list(model.parameters())
        opt = None if impl == "torch" and front == "fully_shard" else torch.optim.AdamW(_decay_matrices(before), lr=0.05)
        if front == "fully_shard":
            shard = torch_fully_shard if impl == "torch" else pydist.fully_shard
            kwargs = {"mesh": init_device_mesh("cpu", (world_size,))} if impl == "torch" else {}
            for block in model.blocks:
                shard(block, **kwargs)
            shard(model, **kwargs)
        else:
            cls = TorchFSDP if impl == "torch" else pydist.FullyShardedDataParallel
            kwargs = {"device_id": torch.device("cpu"), "use_orig_params": True} if impl == "torch" else {}
            model = cls(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), **kwargs)
        if impl == "pydist" and front == "fully_shard":
            # New DTensor parameters, as torch's: the optimizer built before
            # would never train, so its first step raises, naming one.
            try:
                _train(model, opt, rank, 1)
                out["stale_optimizer"] = "no error"
            except RuntimeError as exc:
                out["stale_optimizer"] = str(exc)
            model.zero_grad(set_to_none=True)  # the iteration's gradients; no parameter was stepped
            opt = None
        elif impl == "pydist":
            assert {id(p) for p in model.parameters()} == {id(p) for p in before}, "new Parameter objects"
        opt = opt or torch.optim.AdamW(_decay_matrices(model.parameters()), lr=0.05)
        _train(model, opt, rank, 3)
        if front == "fully_shard":
            out[impl] = _full(impl, model)
        else:
            with cls.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                out[impl] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("front", ["fully_shard", "FullyShardedDataParallel"])
def test_optimizer_built_before_sharding_steps_the_shards(front):
    """FSDP1's door: the module's own Parameter objects become the shards,
    so an optimizer built before sharding trains the model, with nanoGPT's
    groups by ``p.dim()`` taken while the shapes were full (see [Note: the
    Parameter objects stay] in pydist/fsdp/_fsdp_param.py). fully_shard:
    new DTensor parameters, as torch's FSDP2; an optimizer built before
    raises at its first step, naming a parameter, where under torch it
    silently never trains; one built after is bitwise torch's."""
    theirs = "torch FSDP2's (optimizer built after)" if front == "fully_shard" else "torch FSDP1's"
    results = run_ranks(_optimizer_first, 2, args=(front,), timeout=110)
    if front == "fully_shard":
        for out in results:
            message = out.pop("stale_optimizer")
            assert "Build the optimizer after fully_shard" in message and "inp.weight" in message, message
    _assert_bitwise(results, theirs)


class Branchy(nn.Module):
    """An embedding only rank 0 looks up, rows 0 and 1: the averaged
    gradient of the rows rank 1 keeps is exactly zero, but rank 0 had one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(8, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x, ids=None):
        h = self.lin(x)
        return h if ids is None else h + self.emb(ids).sum(0)


def _branchy_inputs(rank: int):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    return x, (torch.tensor([0, 1]) if rank == 0 else None)


def _branchy(rank, world_size, front):
    import pydist

    model = Branchy()
    model = pydist.fully_shard(model) if front == "fully_shard" else pydist.FullyShardedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(2):
        model(*_branchy_inputs(rank)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return pydist.fsdp.full_state_dict(getattr(model, "_fsdp_wrapped_module", model))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("front", ["fully_shard", "FullyShardedDataParallel"])
def test_parameter_used_on_some_ranks_steps_as_the_global_batch(front):
    """Every rank's shard of it gets a .grad (AdamW decays it everywhere), as
    one process on the global batch: torch's FSDP2 cannot reduce this case."""
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(2):
        for rank in range(2):
            (model(*_branchy_inputs(rank)).pow(2).sum() / 2).backward()
        opt.step()
        opt.zero_grad()
    for rank, got in enumerate(run_ranks(_branchy, 2, args=(front,), timeout=110)):
        for k, ref in model.state_dict().items():
            assert torch.equal(got[k], ref), f"rank {rank}: {k} differs from the global batch by " \
                                              f"{(got[k] - ref).abs().max().item()}"


def _unshard_first(rank, world_size):
    out = {}
    for impl in ("torch", "pydist"):
        model = _build(impl, world_size, mixed=False)
        model.unshard()  # before any forward: the root initializes here, as FSDP2's lazy init
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        _train(model, opt, rank, steps=2)
        out[impl] = _full(impl, model)
    return out


@pytest.mark.timeout(90)
def test_unshard_before_the_first_forward_as_torch_fsdp2():
    _assert_bitwise(run_ranks(_unshard_first, 2, timeout=80), "torch FSDP2")
