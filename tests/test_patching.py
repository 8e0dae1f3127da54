"""pydist.patch_torch(): what it replaces, what it reports, and its undo (one
process; the frameworks' own use is tests/frameworks)."""

import importlib
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp
import torch.nn.parallel

import pydist

TORCH_DDP = torch.nn.parallel.DistributedDataParallel
TORCH_FSDP = torch.distributed.fsdp.FullyShardedDataParallel
TORCH_FULLY_SHARD = torch.distributed.fsdp.fully_shard


def lookups():
    """Each entry point as code written after the patch finds it."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as submodule_fsdp
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.parallel.distributed import DistributedDataParallel as submodule_ddp

    return [DistributedDataParallel, submodule_ddp, FullyShardedDataParallel, submodule_fsdp, fully_shard]


PYDIST = [pydist.DistributedDataParallel, pydist.DistributedDataParallel, pydist.FullyShardedDataParallel,
          pydist.FullyShardedDataParallel, pydist.fully_shard]
TORCH = [TORCH_DDP, TORCH_DDP, TORCH_FSDP, TORCH_FSDP, TORCH_FULLY_SHARD]


def test_context_manager_replaces_every_entry_point_and_undoes_it():
    assert lookups() == TORCH
    with pydist.patch_torch(warn=False) as patch:
        assert lookups() == PYDIST
        assert importlib.import_module("torch.distributed._composable.fsdp").fully_shard is pydist.fully_shard
        assert "torch.nn.parallel.distributed.DistributedDataParallel" in patch.patched
    assert lookups() == TORCH
    assert importlib.import_module("torch.distributed._composable.fsdp").fully_shard is TORCH_FULLY_SHARD


def test_nested_patches_undo_in_order():
    outer = pydist.patch_torch(warn=False)
    try:
        with pydist.patch_torch(warn=False) as inner:
            assert inner.patched == []  # the outer call's replacements are still active
        assert lookups() == PYDIST  # the inner block does not undo the outer call
    finally:
        outer.undo()
    assert lookups() == TORCH


def test_names_bound_before_the_call_are_reported_and_keep_torchs():
    early = types.ModuleType("user_code_imported_early")
    early.DDP, early.shard = TORCH_DDP, TORCH_FULLY_SHARD  # `from torch.nn.parallel import ... as DDP`
    sys.modules[early.__name__] = early
    try:
        with pytest.warns(UserWarning, match="user_code_imported_early.DDP, user_code_imported_early.shard"):
            with pydist.patch_torch() as patch:
                assert "user_code_imported_early.DDP" in patch.unreached
                assert "test_patching.TORCH_DDP" in patch.unreached  # this file's own, bound at its import
                assert not any(name.startswith(("torch.", "pydist.")) for name in patch.unreached)
                assert early.DDP is TORCH_DDP
    finally:
        del sys.modules[early.__name__]


@pytest.mark.timeout(60)
def test_pydist_ddp_under_the_patch_marks_torchs_class_as_the_active_ddp_module(tmp_path):
    """Dynamo's DDPOptimizer reads torch DDP's _active_ddp_module: pydist's
    forward sets it on torch's class, also while the name is pydist's."""
    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            seen.append(TORCH_DDP._active_ddp_module)
            return super().forward(x)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pydist.patch_torch(warn=False):
            model = torch.nn.parallel.DistributedDataParallel(Probe(4, 4))
            assert type(model) is pydist.DistributedDataParallel
            model(torch.ones(2, 4)).sum().backward()
        assert seen == [model] and TORCH_DDP._active_ddp_module is None
        assert "_active_ddp_module" not in vars(pydist.DistributedDataParallel)
    finally:
        dist.destroy_process_group()


def test_import_changes_list_what_pydist_puts_in_torchs_place():
    """[Note: what importing pydist changes in torch]: each attribute listed
    is pydist's once its installer ran, and nothing else of torch's names is."""
    import importlib

    import torch.distributed.checkpoint.state_dict  # noqa: F401  (the helpers are replaced once imported)

    import pydist
    from pydist.fsdp import _optim_step, _state_dict
    from pydist.patching import IMPORT_CHANGES

    _state_dict.install_torch_checkpoint_api()
    _state_dict._install_full_gather()
    _optim_step.install_local_shard_step()
    for change in IMPORT_CHANGES:
        module_name, attribute = change.attribute.split(":")
        if attribute == "register_optimizer_step_pre_hook":
            continue  # a hook torch keeps in its own table, not an attribute
        value = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
        assert value.__module__.startswith("pydist."), f"{change.attribute} is {value.__module__}'s"
    assert pydist.fully_shard.__module__.startswith("pydist.")
