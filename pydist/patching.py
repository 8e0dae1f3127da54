"""``pydist.patch_torch()``: torch's DDP and FSDP entry points resolve to pydist's.

    import pydist
    pydist.patch_torch()                 # before the framework builds its wrapper
    import pytorch_lightning as pl       # binds torch.nn.parallel.distributed.DistributedDataParallel: pydist's

    with pydist.patch_torch() as patch:  # undone at the end of the block
        accelerator.prepare(model, ...)
    patch.unreached                      # names bound to torch's before the call: they keep torch's

Frameworks (accelerate, Lightning, the HF Trainer) build torch's wrappers
themselves. This module is the one place where pydist replaces torch's
attributes; `[Note: what patch_torch reaches]` says which and why only those.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import warnings
from typing import NamedTuple

__all__ = ["TorchPatch", "patch_torch", "IMPORT_CHANGES"]

# [Note: what importing pydist changes in torch]
# Besides patch_torch (asked for), importing pydist, or using a door, changes
# these of torch's attributes. Each exists for FullyShardedDataParallel's
# door, whose gradients and state dicts are plain pieces of a flat layout
# and ShardedTensors rather than DTensors; each passes anything else (DTensors,
# fully_shard's modules, plain tensors, torch's own wrappers) to torch's own
# code unchanged, so fully_shard and DDP get torch's results unpatched. The
# optimizer functionals' wrappers serve fully_shard's door: they change how
# its DTensor parameters' update is computed, not one bit of it.
# tests/test_patching.py checks that this list is what is in place.
class _Change(NamedTuple):
    attribute: str  # "module:attribute" of torch's
    installed_by: str  # when it is put in place
    why: str


IMPORT_CHANGES = (
    _Change("torch.nn.utils.clip_grad:_get_total_norm", "import pydist",
            "clip_grad_norm_ counts every rank's FSDP1-door shards ([Note: the global norm of sharded gradients])"),
    _Change("torch.nn.utils:get_total_norm", "import pydist", "the same, for get_total_norm"),
    _Change("torch.amp.grad_scaler:GradScaler._unscale_grads_", "import pydist",
            "an inf in one rank's FSDP1-door shard is found on every rank ([Note: one found_inf for every rank])"),
    _Change("torch.distributed.checkpoint.state_dict:_get_optim_state_dict", "the first fully_shard",
            "get_optimizer_state_dict of FSDP1-door shards ([Note: torch's checkpoint helpers on pydist's shards])"),
    _Change("torch.distributed.checkpoint.state_dict:_load_optim_state_dict", "the first fully_shard",
            "set_optimizer_state_dict: FSDP1-door shards; broadcast_from_rank0, flattened dicts and shape checks "
            "for fully_shard's, where torch's own fails or takes a transposed tensor"),
    _Change("torch.distributed.checkpoint.state_dict:_load_model_state_dict", "the first fully_shard",
            "set_model_state_dict into a meta model, and broadcast_from_rank0 over gloo ([Note: resuming a model "
            "built on the meta device])"),
    _Change("torch.distributed._state_dict_utils:_all_gather_sharded_tensor", "a FSDP1-door state dict",
            "a full gather of pydist's ShardedTensors (torch's assumes its own dim-0 chunks)"),
    _Change("torch.optim.adam:adam", "the first fully_shard",
            "Adam's and AdamW's update of fully_shard's DTensor parameters runs on their local shards, bitwise "
            "what DTensor dispatch gives without its cost per op; anything else goes to torch's unchanged "
            "([Note: the optimizer step on local shards])"),
    _Change("torch.optim.sgd:sgd", "the first fully_shard", "the same, for SGD's update"),
    _Change("torch.optim.optimizer:register_optimizer_step_pre_hook", "the first fully_shard",
            "a global step pre-hook: an optimizer stepping parameters fully_shard replaced raises "
            "([Note: DTensor parameters])"),
)

# [Note: what patch_torch reaches]
# A name is looked up either when code runs (`torch.nn.parallel.DistributedDataParallel(model)`,
# accelerate's prepare) or once, when a module is imported (`from torch.nn.parallel.distributed
# import DistributedDataParallel`, Lightning's DDP strategy). Replacing the attribute on torch's
# modules reaches the first kind always and the second kind only for modules imported after the
# call. So every module that torch itself exports each entry point from is patched (the public
# package and the submodule that defines it, where `from ... import` statements look), and the
# names other modules bound before the call are found by scanning sys.modules and reported:
# rebinding them would change code pydist does not know. torch's own modules are left out of
# that report: the ones that bind torch's classes (the composable replicate, the checkpoint
# helpers) implement torch's wrappers and must keep them. pydist's DistributedDataParallel
# subclasses torch's and keeps torch's class in its own globals for what it sets on it
# (`_active_ddp_module`), so patching never makes pydist refer to itself.


class _Entry(NamedTuple):
    module: str  # where the attribute lives (imported by patch_torch)
    attribute: str
    replacement: str  # the pydist attribute that takes its place


_ENTRIES = (
    _Entry("torch.nn.parallel", "DistributedDataParallel", "DistributedDataParallel"),
    _Entry("torch.nn.parallel.distributed", "DistributedDataParallel", "DistributedDataParallel"),
    _Entry("torch.distributed.fsdp", "FullyShardedDataParallel", "FullyShardedDataParallel"),
    _Entry("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel",
           "FullyShardedDataParallel"),
    _Entry("torch.distributed.fsdp", "fully_shard", "fully_shard"),
    _Entry("torch.distributed.fsdp._fully_shard", "fully_shard", "fully_shard"),
    _Entry("torch.distributed.fsdp._fully_shard._fully_shard", "fully_shard", "fully_shard"),
    _Entry("torch.distributed._composable.fsdp", "fully_shard", "fully_shard"),  # FSDP2's old home
    _Entry("torch.distributed._composable.fsdp.fully_shard", "fully_shard", "fully_shard"),
)


@dataclasses.dataclass
class TorchPatch:
    """What one ``patch_torch()`` call did; a context manager that undoes it."""

    # "module.attribute" of each torch attribute this call replaced (empty when
    # an earlier, still active call had replaced them all).
    patched: list[str]
    # "module.name" of each global outside torch and pydist still bound to one
    # of torch's entry points: code that uses that name keeps torch's.
    unreached: list[str]
    # (module object, attribute, torch's value, pydist's value) to put back on undo().
    _undo: list = dataclasses.field(default_factory=list, repr=False)

    def undo(self) -> None:
        """Put torch's attributes back; one a later caller has replaced again is left alone."""
        for module, attribute, original, replacement in reversed(self._undo):
            if getattr(module, attribute, None) is replacement:
                setattr(module, attribute, original)
        self._undo.clear()

    def __enter__(self) -> "TorchPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


# id -> object, for every torch entry point patch_torch() has replaced in this
# process: what the scan for names bound elsewhere looks for, also while an
# earlier call is still active.
_TORCH_OBJECTS: dict[int, object] = {}


def _bound_elsewhere(originals: dict[int, object]) -> list[str]:
    """Globals of modules outside torch and pydist that hold one of torch's entry points."""
    found, seen = [], set()
    for name, module in list(sys.modules.items()):
        if module is None or id(module) in seen or name.split(".")[0] in ("torch", "pydist"):
            continue
        seen.add(id(module))  # one name per module (__mp_main__ is __main__ under multiprocessing)
        try:
            items = list(vars(module).items())
        except TypeError:  # a module-like object without a __dict__
            continue
        found.extend(f"{name}.{key}" for key, value in items
                     if id(value) in originals and value is originals[id(value)])
    return sorted(found)


def patch_torch(*, warn: bool = True) -> TorchPatch:
    """Make torch's DDP and FSDP entry points resolve to pydist's.

    After the call, ``torch.nn.parallel.DistributedDataParallel`` (and
    ``torch.nn.parallel.distributed.DistributedDataParallel``),
    ``torch.distributed.fsdp.FullyShardedDataParallel`` (and
    ``torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel``)
    and ``torch.distributed.fsdp.fully_shard`` (and the submodules it is
    defined in) are pydist's, for every lookup made after the call, including
    ``from ... import`` in modules imported later. Names that modules outside
    torch bound before the call keep torch's: they are listed in the result's
    ``unreached`` and, with ``warn=True``, in a warning.
    Returns a :class:`TorchPatch`; ``with pydist.patch_torch():`` undoes it at
    the end of the block. See [Note: what patch_torch reaches].
    """
    import pydist

    patch = TorchPatch(patched=[], unreached=[])
    # Every module first: importing one (the old FSDP2 home) binds names from another.
    modules = {}
    for entry in _ENTRIES:
        try:
            modules[entry.module] = importlib.import_module(entry.module)
        except ImportError:  # a torch without this module (the old FSDP2 home): nothing to reach there
            pass
    for entry in _ENTRIES:
        if entry.module not in modules:
            continue
        module = modules[entry.module]
        replacement = getattr(pydist, entry.replacement)
        original = getattr(module, entry.attribute, None)
        if original is None:
            raise RuntimeError(f"pydist.patch_torch: torch {getattr(sys.modules['torch'], '__version__', '?')} "
                               f"has no {entry.module}.{entry.attribute} to replace")
        if original is replacement:
            continue  # an earlier patch_torch() that is still active
        _TORCH_OBJECTS[id(original)] = original
        setattr(module, entry.attribute, replacement)
        patch._undo.append((module, entry.attribute, original, replacement))
        patch.patched.append(f"{entry.module}.{entry.attribute}")
    patch.unreached = _bound_elsewhere(_TORCH_OBJECTS)
    if warn and patch.unreached:
        warnings.warn(f"pydist.patch_torch: these names were bound to torch's wrappers before the call and keep "
                      f"them: {', '.join(patch.unreached)}. Call pydist.patch_torch() before importing the "
                      f"modules that define them.", stacklevel=2)
    return patch
