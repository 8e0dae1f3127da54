"""``pydist.FullyShardedDataParallel``: torch FSDP1's front door, mapped
onto the engine ``pydist.fully_shard`` drives.

    model = pydist.FullyShardedDataParallel(
        model, sharding_strategy=pydist.ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))

[Note: FSDP1 on the FSDP2 engine]
Each module the ``auto_wrap_policy`` picks (torch's ``ModuleWrapPolicy``,
``CustomPolicy``, or a function such as ``size_based_auto_wrap_policy``,
run as torch runs it) becomes a unit with ``fully_shard``, bottom-up, and
the wrapped module is the root unit. Unlike torch's FSDP1, nested units are
not replaced by wrapper modules: the module tree keeps its classes and
names, and only the outermost object is a ``FullyShardedDataParallel``
(``.module`` is the wrapped module). Strategies map as
  FULL_SHARD     -> reshard_after_forward=True
  SHARD_GRAD_OP  -> reshard_after_forward=False
  NO_SHARD       -> every rank keeps the whole unit; gradients all-reduced
FSDP1's ``forward_prefetch=True`` (gather the next unit while this one
computes, in the last iteration's forward order) is what the engine's
forward plan does in any case ([Note: gather and reduce plans] in
_fsdp_schedule.py), so either value is accepted; so is BACKWARD_PRE or None
for ``backward_prefetch`` (the backward plan gathers ahead), while
BACKWARD_POST, which trades that overlap for memory, is refused.
The parameters are the originals' local shards (``use_orig_params=True``
only; see [Note: what the optimizer sees]), ``state_dict()`` is the full
state dict (FSDP1's default ``FULL_STATE_DICT``) under the unwrapped keys.
``clip_grad_norm_`` is torch FSDP1's to the last bit, and so is torch's
``clip_grad_norm_`` on the wrapper's parameters (see [Note: the global norm
of sharded gradients] in _clip_grad.py).

[Note: FSDP1's state_dict_type on pydist]
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()          # full tensors on rank 0, {} elsewhere
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save(model.state_dict(), checkpoint_id=path)
FULL_STATE_DICT is ``pydist.fsdp.full_state_dict`` (``rank0_only`` as
torch's; ``offload_to_cpu`` changes nothing: the parameters are on the CPU).
SHARDED_STATE_DICT is the wrapped module's ``state_dict()``: torch's FSDP1
gives dim-0 ShardedTensors after an all-gather; pydist gives the
ShardedTensors of [Note: the sharded state dict] (this rank's flat piece,
no communication), which DCP reads into either. Keys are the wrapped
module's in both (torch's FSDP1 strips its wrapper names the same way).
The settings live on each pydist wrapper in ``module``; LOCAL_STATE_DICT
(FSDP1's flat parameters) is not implemented. ``FSDP.optim_state_dict`` /
``optim_state_dict_to_load`` follow the same settings: full tensors keyed
by parameter name (``pydist.fsdp.full_optimizer_state_dict``), or the
ShardedTensors of ``pydist.fsdp.get_optimizer_state_dict`` for DCP. FSDP1's
older API (``full_optim_state_dict``, ``shard_full_optim_state_dict``,
``scatter_full_optim_state_dict``, ``sharded_optim_state_dict``,
``flatten_sharded_optim_state_dict``, ``rekey_optim_state_dict``) gives and
takes the same dicts; a dict keyed by index (``optim.state_dict()``'s
keys) is rekeyed by name first.

[Note: FSDP1's mixed precision]
``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype, ...)`` becomes one
``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` per unit, so the casts
are those of [Note: mixed precision] (pydist/fsdp/_fsdp_param_group.py):
the fp32 shard is cast to ``param_dtype`` and all-gathered, forward and
backward run in it, gradients are cast to ``reduce_dtype`` and
reduce-scattered, and the reduced shard is cast back for ``.grad``. FSDP1
casts in the same places (its ``_mp_shard``, then ``flat_param.grad.to(
_reduce_dtype)`` before the reduce-scatter), with the same default
(``reduce_dtype=None`` reduces in ``param_dtype``), and divides by 2 before
the sum at two ranks (its predivide factor), exactly as ``g / N`` does: the
results are bitwise FSDP1's at two ranks. The rest of ``MixedPrecision``:
  cast_root_forward_inputs -> the root unit's ``cast_forward_inputs``
  cast_forward_inputs      -> every unit's
  buffer_dtype             -> floating buffers cast once, here (FSDP1 casts
                              them at the root's first forward);
                              state dicts give them back in the dtype
                              they had where torch's do (_buffers_cast_back)
  keep_low_precision_grads=True, and ``_module_classes_to_ignore`` modules
  (BatchNorm: FSDP1 gives them their own full-precision units) under an
  ``auto_wrap_policy``, raise ``NotImplementedError``.
One difference: under ``no_sync()`` FSDP1 accumulates the unsharded
gradients in ``param_dtype`` (bf16 += bf16, autograd's own accumulation),
while the engine, as FSDP2, accumulates them in ``reduce_dtype`` (fp32 +=
bf16), so accumulated steps differ from FSDP1's by bf16 rounding of the
running sum (and are FSDP2's bit for bit).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import types
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import StateDictSettings, StateDictType

from pydist.fsdp._fully_shard import fully_shard
from pydist.fsdp._fsdp_param_group import Layout
from pydist.fsdp._fsdp_state import state_of
from pydist.fsdp._state_dict import (
    full_optimizer_state_dict,
    full_state_dict,
    get_optimizer_state_dict,
    load_full_state_dict,
    optimizer_state_dict_to_load,
    rekey_optimizer_state_dict,
)
from pydist.fsdp._clip_grad import FSDP1Params, fsdp1_clip_grad_norm_, register_fsdp1_door
from pydist.fsdp._unshard_params import summon_full_params

__all__ = ["FullyShardedDataParallel", "ShardingStrategy", "MixedPrecision", "BackwardPrefetch", "CPUOffload"]

_RESHARD_AFTER_FORWARD = {ShardingStrategy.FULL_SHARD: True, ShardingStrategy.SHARD_GRAD_OP: False, ShardingStrategy.NO_SHARD: False,
                          ShardingStrategy.HYBRID_SHARD: True, ShardingStrategy._HYBRID_SHARD_ZERO2: False}
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def _refuse(condition, what: str) -> None:
    if condition:
        raise NotImplementedError(f"pydist.FullyShardedDataParallel: {what} is not implemented yet")


class FullyShardedDataParallel(nn.Module):
    """See [Note: FSDP1 on the FSDP2 engine]. ``shm`` (pydist's own) picks the
    transport: see ``pydist.fsdp._fsdp_collectives.open_transport``."""

    def __init__(self, module: nn.Module, process_group=None, sharding_strategy: ShardingStrategy | None = None,
                 cpu_offload: CPUOffload | None = None, auto_wrap_policy=None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules=None, param_init_fn=None,
                 device_id=None, sync_module_states: bool = False, forward_prefetch: bool = False,
                 limit_all_gathers: bool = True, use_orig_params: bool = True, ignored_states=None,
                 device_mesh=None, *, shm: bool | None = None):
        super().__init__()
        strategy = sharding_strategy if sharding_strategy is not None else ShardingStrategy.FULL_SHARD
        _refuse(strategy not in _RESHARD_AFTER_FORWARD, f"sharding_strategy={strategy}")
        _refuse(cpu_offload is not None and cpu_offload.offload_params, "cpu_offload=CPUOffload(offload_params=True)")
        ignored, ignored_params = _ignored(module, ignored_modules, ignored_states)
        _refuse(ignored_params and mixed_precision is not None, "ignored_modules or ignored_states with mixed_precision")
        _refuse(any(p.is_meta for p in ignored_params), "ignored_modules or ignored_states on the meta device")
        if param_init_fn is not None and not callable(param_init_fn):
            raise ValueError(f"pydist.FullyShardedDataParallel: param_init_fn must be callable, got {param_init_fn!r}")
        _refuse(backward_prefetch not in (None, BackwardPrefetch.BACKWARD_PRE), f"backward_prefetch={backward_prefetch}")
        _refuse(not use_orig_params, "use_orig_params=False")
        device = torch.device(device_id) if device_id is not None else None
        _refuse(device is not None and device.type not in ("cpu", "cuda"), f"device_id={device_id}")
        group, replicate_group = _groups(strategy, process_group, device_mesh)
        targets = _wrap_targets(module, auto_wrap_policy, ignored, ignored_params)
        _materialize(module, targets, param_init_fn, device or torch.device("cpu"))
        if device is not None:  # torch's FSDP1 moves the module's tensors to device_id before sharding
            module.to(device)
        if sync_module_states:
            _broadcast_module_states(module, group, ignored, ignored_params)
            if replicate_group is not None:  # as torch's FSDP1: then across the replicas
                _broadcast_module_states(module, replicate_group, ignored, ignored_params)
        unit_policy, root_policy = _mixed_precision_policies(mixed_precision, module, auto_wrap_policy)
        self._fsdp_wrapped_module = module
        self.sharding_strategy = strategy
        self.mixed_precision = mixed_precision
        buffer_orig_dtypes = _cast_buffers(module, mixed_precision)
        kwargs = dict(reshard_after_forward=_RESHARD_AFTER_FORWARD[strategy], shm=shm, ignored_params=ignored_params,
                      _sharded=strategy != ShardingStrategy.NO_SHARD, _process_group=group,
                      _replicate_group=replicate_group,
                      _zeros_for_unused=True,  # FSDP1's answer: see [Note: parameters without a gradient]
                      _layout=Layout.FLAT)  # FSDP1's: see [Note: a unit's layout]
        for m in reversed(list(module.modules())):  # children before their parents
            if m is not module and m in targets:
                fully_shard(m, mp_policy=unit_policy, **kwargs)
        fully_shard(module, mp_policy=root_policy, **kwargs)
        # The buffers state dicts give back in their dtype from before
        # buffer_dtype cast them (see [Note: FSDP1's mixed precision]).
        self._buffer_orig_dtypes = _buffers_cast_back(module, targets, buffer_orig_dtypes)
        if backward_prefetch is None:
            for m in module.modules():
                if (s := state_of(m)) is not None:
                    s.backward_prefetch = []
        # torch's clip_grad_norm_ on its gradients takes its order: see
        # [Note: the global norm of sharded gradients].
        register_fsdp1_door(self)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)

    def __getattr__(self, name: str):
        """What the wrapper lacks comes from the wrapped module, as with
        torch's FSDP1 (a Hugging Face model's ``.config``, ``.generate``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fsdp_wrapped_module":  # not set yet (inside __init__)
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        """The wrapped module's parameters (local shards) under its own names."""
        return self._fsdp_wrapped_module.named_parameters(prefix, recurse, remove_duplicate)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates gradients without reducing them; the
        first backward outside reduces the sum."""
        self._fsdp_wrapped_module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._fsdp_wrapped_module.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Collective: clips by the global norm of every rank's gradients and
        returns it, bitwise torch FSDP1's (its parameters in its order, its
        arithmetic: see [Note: the global norm of sharded gradients])."""
        params = self._fsdp1_clip_params()
        # NO_SHARD everywhere: torch's own, as FSDP1's. No transport yet (no
        # forward, so no sharded gradient on any rank): nothing to sum.
        if params is None or params.transport is None:
            return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)
        return fsdp1_clip_grad_norm_(params, max_norm, norm_type)

    def _fsdp1_clip_params(self) -> FSDP1Params | None:
        """The parameters as torch FSDP1's ``clip_grad_norm_`` takes them (its
        handles, our units, in pre-order: the root first); None where no unit
        is sharded."""
        units = [s.param_group for m in self._fsdp_wrapped_module.modules()
                 if (s := state_of(m)) is not None and s.param_group is not None]
        if not any(unit.sharded for unit in units):
            return None
        sharded, nonsharded = [], []
        for unit in units:
            (sharded if unit.sharded else nonsharded).extend(fp.sharded_param for fp in unit.fsdp_params)
        managed = {id(p) for p in itertools.chain(sharded, nonsharded)}
        nonsharded += [p for p in self.parameters() if id(p) not in managed]  # a zero-size unit's (see fully_shard)
        transport = next(unit for unit in units if unit.sharded).transport  # the root's, every unit's
        return FSDP1Params(sharded, nonsharded, transport)

    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                           offload_to_cpu: bool = False, with_grads: bool = False):
        """Context manager (collective): the full parameters on the modules of
        every unit under ``module``; see [Note: summoning full parameters]
        (_unshard_params.py). ``offload_to_cpu`` changes nothing here."""
        return summon_full_params(_wrapped(module), recurse=recurse, writeback=writeback, rank0_only=rank0_only,
                                  with_grads=with_grads)

    # --- state dicts: FSDP1's state_dict_type --------------------------------
    # See [Note: FSDP1's state_dict_type on pydist].

    def state_dict(self, *args, **kwargs):
        """Collective under FULL_STATE_DICT (the default): full tensors, on
        rank 0 only with ``FullStateDictConfig(rank0_only=True)``; under
        SHARDED_STATE_DICT the ShardedTensors of [Note: the sharded state
        dict], no communication. The unwrapped module's keys either way."""
        _refuse(args or kwargs, "state_dict arguments")
        settings = FullyShardedDataParallel.get_state_dict_type(self)
        if settings.state_dict_type == StateDictType.SHARDED_STATE_DICT:
            state_dict = self._fsdp_wrapped_module.state_dict()
        else:
            rank0_only = getattr(settings.state_dict_config, "rank0_only", False)
            state_dict = full_state_dict(self._fsdp_wrapped_module, rank0_only=rank0_only)
        for fqn, dtype in self._buffer_orig_dtypes.items():
            if fqn in state_dict:
                state_dict[fqn] = state_dict[fqn].to(dtype)
        return state_dict

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Full tensors (any world size saved them) or, under
        SHARDED_STATE_DICT, what ``state_dict()`` gave after
        ``torch.distributed.checkpoint.load`` into it."""
        _refuse(assign, "load_state_dict(assign=True)")
        settings = FullyShardedDataParallel.get_state_dict_type(self)
        if settings.state_dict_type == StateDictType.SHARDED_STATE_DICT:
            return self._fsdp_wrapped_module.load_state_dict(state_dict, strict=strict)
        return load_full_state_dict(self._fsdp_wrapped_module, state_dict, strict=strict)

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                            optim_state_dict_config=None) -> StateDictSettings:
        """Sets what ``state_dict()`` / ``load_state_dict`` of every pydist
        ``FullyShardedDataParallel`` in ``module`` (itself included) mean;
        returns the previous settings. FULL_STATE_DICT and SHARDED_STATE_DICT;
        LOCAL_STATE_DICT raises NotImplementedError."""
        from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig

        _refuse(state_dict_type not in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT),
                f"state_dict_type={state_dict_type}")
        if state_dict_config is None:
            full = state_dict_type == StateDictType.FULL_STATE_DICT
            state_dict_config = FullStateDictConfig() if full else ShardedStateDictConfig()
        _refuse(getattr(state_dict_config, "_use_dtensor", False), "ShardedStateDictConfig(_use_dtensor=True)")
        wrappers = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not wrappers:
            raise ValueError(f"pydist.FullyShardedDataParallel.set_state_dict_type: {type(module).__name__} holds "
                             "no pydist FullyShardedDataParallel")
        previous = FullyShardedDataParallel.get_state_dict_type(wrappers[0])
        for w in wrappers:
            w.__dict__["_pydist_state_dict_settings"] = StateDictSettings(state_dict_type, state_dict_config,
                                                                          optim_state_dict_config)
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The settings ``set_state_dict_type`` gave ``module`` (FULL_STATE_DICT by default)."""
        settings = module.__dict__.get("_pydist_state_dict_settings")
        if settings is None:
            from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

            settings = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())
        return settings

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict=None, group=None) -> dict:
        """The optimizer's state keyed by parameter name (torch FSDP1's
        layout): full tensors under FULL_STATE_DICT (collective; ``{}`` off
        rank 0 with ``FullOptimStateDictConfig(rank0_only=True)``), the
        ShardedTensors of ``pydist.fsdp.get_optimizer_state_dict`` under
        SHARDED_STATE_DICT."""
        _refuse(optim_state_dict is not None, "optim_state_dict(optim_state_dict=...)")
        _refuse(group is not None, "optim_state_dict(group=...)")
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        module = _wrapped(model)
        if settings.state_dict_type == StateDictType.SHARDED_STATE_DICT:
            return get_optimizer_state_dict(module, optim)
        rank0_only = getattr(settings.optim_state_dict_config, "rank0_only", False)
        return full_optimizer_state_dict(module, optim, rank0_only=rank0_only)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict,
                                 is_named_optimizer: bool = False, load_directly: bool = False, group=None) -> dict:
        """What ``optim.load_state_dict`` takes, from ``optim_state_dict``'s
        answer (full, saved at any world size, on every rank; or sharded,
        after ``dcp.load`` into it); loads it too with ``load_directly``."""
        _refuse(is_named_optimizer, "optim_state_dict_to_load(is_named_optimizer=True)")
        _refuse(group is not None, "optim_state_dict_to_load(group=...)")
        to_load = optimizer_state_dict_to_load(_wrapped(model), optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(to_load)
        return to_load

    # FSDP1's older optimizer-state API (deprecated by torch in favour of the
    # two above, still in its scripts): the same dicts, settings aside.

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input=None,
                              rank0_only: bool = True, group=None) -> dict:
        """Collective: the optimizer's state with full tensors, keyed by
        parameter name; ``{}`` off rank 0 with ``rank0_only`` (the default)."""
        _refuse(optim_input is not None, "full_optim_state_dict(optim_input=...)")
        _refuse(group is not None, "full_optim_state_dict(group=...)")
        return full_optimizer_state_dict(_wrapped(model), optim, rank0_only=rank0_only)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group=None) -> dict:
        """The optimizer's state as ShardedTensors, keyed by parameter name (copies, as torch's)."""
        _refuse(group is not None, "sharded_optim_state_dict(group=...)")
        return get_optimizer_state_dict(_wrapped(model), optim, copies=True)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict, model: nn.Module, optim_input=None,
                                    optim: torch.optim.Optimizer | None = None) -> dict:
        """What ``optim.load_state_dict`` takes, from a full dict every rank
        holds (saved at any world size); without ``optim``, as torch's, for
        one param group of ``model.parameters()``."""
        _refuse(optim_input is not None, "shard_full_optim_state_dict(optim_input=...)")
        return optimizer_state_dict_to_load(_wrapped(model), _optimizer_or_parameters(model, optim),
                                            _by_name(model, optim, full_optim_state_dict))

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict, model: nn.Module,
                                         optim: torch.optim.Optimizer) -> dict:
        """What ``optim.load_state_dict`` takes, from ``sharded_optim_state_dict``'s
        dict after ``torch.distributed.checkpoint.load`` into it."""
        return optimizer_state_dict_to_load(_wrapped(model), optim, sharded_optim_state_dict)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: dict | None, model: nn.Module, optim_input=None,
                                      optim: torch.optim.Optimizer | None = None, group=None) -> dict:
        """Collective: ``shard_full_optim_state_dict`` of the full dict rank 0
        holds (the others pass None), sent from rank 0 to every rank."""
        _refuse(optim_input is not None, "scatter_full_optim_state_dict(optim_input=...)")
        _refuse(group is not None, "scatter_full_optim_state_dict(group=...)")
        group = state_of(_wrapped(model)).group
        source = dist.get_rank(group) == 0  # rank 0 of the model's group
        if source and full_optim_state_dict is None:
            raise ValueError("pydist scatter_full_optim_state_dict: rank 0 must pass the full optimizer state dict")
        held = [full_optim_state_dict if source else None]
        dist.broadcast_object_list(held, group=group, group_src=0)
        return FullyShardedDataParallel.shard_full_optim_state_dict(held[0], model, optim=optim)

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict: dict, optim_state_key_type, model: nn.Module, optim_input=None,
                               optim: torch.optim.Optimizer | None = None) -> dict:
        """``optim_state_dict`` keyed by parameter name (OptimStateKeyType.PARAM_NAME)
        or by index in the optimizer's param_groups (PARAM_ID)."""
        from torch.distributed.fsdp import OptimStateKeyType

        _refuse(optim_input is not None, "rekey_optim_state_dict(optim_input=...)")
        return rekey_optimizer_state_dict(_wrapped(model), _optimizer_or_parameters(model, optim), optim_state_dict,
                                          to_ids=optim_state_key_type == OptimStateKeyType.PARAM_ID)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                        optim_state_dict_config=None):
        """``with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT): sd = model.state_dict()``:
        ``set_state_dict_type`` for the block, the previous settings after it."""
        previous = FullyShardedDataParallel.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                                optim_state_dict_config)
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(module, previous.state_dict_type, previous.state_dict_config,
                                                         previous.optim_state_dict_config)


def _optimizer_or_parameters(model: nn.Module, optim: torch.optim.Optimizer | None):
    """``optim``, or what torch FSDP1's older optimizer-state API assumes
    without one: a single param group of ``model.parameters()``."""
    return optim if optim is not None else types.SimpleNamespace(param_groups=[{"params": list(model.parameters())}])


def _by_name(model: nn.Module, optim: torch.optim.Optimizer | None, optim_state_dict: dict) -> dict:
    """``optim_state_dict`` keyed by parameter name (one keyed by index, as
    ``optim.state_dict()`` keys it, is rekeyed)."""
    return rekey_optimizer_state_dict(_wrapped(model), _optimizer_or_parameters(model, optim), optim_state_dict,
                                      to_ids=False)


def _wrapped(model: nn.Module) -> nn.Module:
    """The module a pydist FullyShardedDataParallel wraps (``model`` itself otherwise)."""
    return model.module if isinstance(model, FullyShardedDataParallel) else model


def _ignored(root: nn.Module, ignored_modules, ignored_states) -> tuple[set, set]:
    """(the modules, the parameters) FSDP1's ``ignored_modules`` or
    ``ignored_states`` (parameters or modules) leave out, as torch's FSDP1
    reads them: a module's whole subtree, none of it wrapped, none of its
    parameters sharded or reduced."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("Cannot pass both ignored_modules and ignored_states at the same time. "
                         "Please just pass ignored_states.")
    given = list(ignored_modules if ignored_modules is not None else ignored_states or ())
    if given and all(isinstance(x, nn.Parameter) for x in given):
        return set(), set(given)
    if not all(isinstance(x, nn.Module) for x in given):
        raise TypeError("pydist.FullyShardedDataParallel: ignored_modules is an iterable of nn.Modules, "
                        "ignored_states one of parameters or of modules, not mixed; got "
                        f"{sorted({type(x).__name__ for x in given})}")
    if root in given:
        raise ValueError("pydist.FullyShardedDataParallel: the module being wrapped is among ignored_modules: "
                         "there would be nothing to shard")
    modules = {m for top in given for m in top.modules()}
    return modules, {p for m in modules for p in m.parameters(recurse=False)}


def _wrap_targets(root: nn.Module, policy, ignored: set, ignored_params: set) -> set:
    """The modules torch's FSDP1 would wrap under ``policy`` (the root aside),
    ``ignored`` modules and ``ignored_params`` left out as it leaves them."""
    if policy is None:
        return set()
    from torch.distributed.fsdp.wrap import _Policy

    if isinstance(policy, _Policy):
        return set(policy._run_policy(root, ignored, {})) - ignored
    targets: set = set()

    def recurse(module: nn.Module) -> int:
        # torch.distributed.fsdp.wrap._recursive_wrap, without the wrapping:
        # returns the number of parameters wrapped in module's subtree.
        if module in ignored:
            return 0
        nonwrapped = sum(p.numel() for p in module.parameters() if p not in ignored_params)
        if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
            return 0
        wrapped = sum(recurse(child) for child in module.children())
        if module is not root and policy(module=module, recurse=False, nonwrapped_numel=nonwrapped - wrapped):
            targets.add(module)
            return nonwrapped
        return wrapped

    recurse(root)
    return targets


def _groups(strategy: ShardingStrategy, process_group, device_mesh) -> tuple:
    """(the group to shard over, the group to all-reduce over or None), as
    torch's FSDP1 reads its arguments: for HYBRID_SHARD and
    _HYBRID_SHARD_ZERO2 a (shard, replicate) pair of groups, a 2-D
    (replicate, shard) device_mesh, or neither: each host's ranks shard, the
    hosts replicate (pydist.topology finds the hosts; torch counts GPUs per
    node). See [Note: HSDP] in _fsdp_param_group.py."""
    hybrid = strategy in _HYBRID
    if device_mesh is not None:
        _refuse(device_mesh.ndim not in ((1, 2) if hybrid else (1,)), f"a {device_mesh.ndim}-D device_mesh with "
                f"sharding_strategy={strategy}")
        if device_mesh.ndim == 2:
            return device_mesh.get_group(1), device_mesh.get_group(0)
        return device_mesh.get_group(), None
    if isinstance(process_group, tuple):
        if not hybrid or len(process_group) != 2:
            raise ValueError(f"pydist.FullyShardedDataParallel: a tuple process_group is a (shard, replicate) pair "
                             f"for HYBRID_SHARD and _HYBRID_SHARD_ZERO2, got {len(process_group)} groups with "
                             f"sharding_strategy={strategy}")
        return process_group
    group = process_group if process_group is not None else dist.group.WORLD
    if not hybrid:
        return group, None
    from pydist import topology

    topo = topology.of(group)
    if not topo.spans_hosts:
        return group, None  # one host: shard over it, nothing to replicate across
    if not topo.uniform:
        raise ValueError(f"pydist.FullyShardedDataParallel({strategy}): the hosts have different numbers of ranks "
                         f"({topo.uneven_hosts()}); pass process_group=(shard_group, replicate_group)")
    return topo.local_group, topo.cross_group


# [Note: FSDP1's meta-device init]
# torch's FSDP1 materializes a module built on the meta device as it wraps
# it, on device_id (the CPU where none is given): each wrapped module's subtree, children
# wrapped first (post-order, as its auto-wrap walks), then the root's rest,
# each subtree breadth first and stopping at modules wrapped already; every
# module visited either goes to param_init_fn(module), where one is given
# (all of them: llama-recipes' ``lambda m: m.to_empty(device=..., recurse=
# False)``), or, holding parameters or buffers of its own, is to_empty'd
# (recurse=False) and its reset_parameters() called. pydist does the same
# walk before it shards anything, so the reset_parameters calls draw from the
# random generator in torch's order and the model starts bitwise as torch's
# FSDP1 starts it; sync_module_states then broadcasts rank 0's values, as
# torch's does after materializing.
def _materialize(root: nn.Module, targets: set, param_init_fn, device: torch.device) -> None:
    """See [Note: FSDP1's meta-device init]; nothing without meta tensors."""
    if not any(t.is_meta for t in itertools.chain(root.parameters(), root.buffers())):
        return
    done: set = set()
    for unit in [m for m in _post_order(root) if m in targets] + [root]:
        modules = _breadth_first(unit, done)
        done.add(unit)
        if not any(t.is_meta for m in modules for t in _own_tensors(m)):
            continue  # torch's FSDP1 materializes a wrapped module only when it holds meta tensors
        for m in modules:
            if param_init_fn is not None:
                param_init_fn(m)
            elif next(_own_tensors(m), None) is not None:
                with torch.no_grad():
                    m.to_empty(device=device, recurse=False)
                    m.reset_parameters()


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _breadth_first(unit: nn.Module, done: set) -> list:
    order, queue, seen = [], collections.deque([unit]), {unit}
    while queue:
        m = queue.popleft()
        order.append(m)
        for child in m.children():
            if child not in seen and child not in done:
                seen.add(child)
                queue.append(child)
    return order


def _mixed_precision_policies(mixed_precision: MixedPrecision | None, module: nn.Module, auto_wrap_policy):
    """(the nested units' MixedPrecisionPolicy, the root's) for FSDP1's
    ``mixed_precision``: see [Note: FSDP1's mixed precision]. (None, None)
    without one: the engine's full precision."""
    if mixed_precision is None:
        return None, None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _refuse(mixed_precision.keep_low_precision_grads, "MixedPrecision(keep_low_precision_grads=True)")
    if auto_wrap_policy is not None and mixed_precision.param_dtype is not None:
        ignored = tuple(mixed_precision._module_classes_to_ignore)
        for name, m in module.named_modules():
            _refuse(ignored and isinstance(m, ignored),
                    f"mixed_precision with auto_wrap_policy and {type(m).__name__} module {name!r} (FSDP1 gives "
                    f"_module_classes_to_ignore={ignored} full-precision units of their own)")

    def policy(cast_inputs: bool):
        return MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype, reduce_dtype=mixed_precision.reduce_dtype,
                                    output_dtype=None, cast_forward_inputs=cast_inputs)

    cast = mixed_precision.cast_forward_inputs
    return policy(cast), policy(cast or mixed_precision.cast_root_forward_inputs)


def _cast_buffers(module: nn.Module, mixed_precision: MixedPrecision | None) -> dict:
    """Casts ``module``'s floating buffers to ``mixed_precision.buffer_dtype``
    in place, as FSDP1's root does; returns {fqn: dtype before} of those cast."""
    dtype = mixed_precision.buffer_dtype if mixed_precision is not None else None
    if dtype is None:
        return {}
    before = {}
    for fqn, buf in module.named_buffers():
        if torch.is_floating_point(buf) and buf.dtype != dtype:
            before[fqn] = buf.dtype
            buf.data = buf.data.to(dtype)
    return before


def _buffers_cast_back(root: nn.Module, targets: set, orig_dtypes: dict) -> dict:
    """The part of {fqn: dtype before buffer_dtype} that torch's FSDP1 state
    dicts (full and sharded) give back in that dtype: a buffer is cast back
    by the state-dict hook of each wrapper around it that manages parameters
    of its own, and a wrapper without (a root whose parameters are all in
    nested units) returns its state dict early, leaving its buffers in
    buffer_dtype."""
    owners = [name for name, m in root.named_modules()
              if (m is root or m in targets) and (s := state_of(m)) is not None and s.param_group is not None]
    return {fqn: dtype for fqn, dtype in orig_dtypes.items()
            if any(not name or fqn.startswith(name + ".") for name in owners)}


def _broadcast_module_states(module: nn.Module, group, ignored: set, ignored_params: set) -> None:
    """Rank 0's parameters and buffers to the group, those ignored left out (as torch's FSDP1)."""
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    buffers = list({id(b): b for m in module.modules() if m not in ignored for b in m.buffers(recurse=False)}.values())
    with torch.no_grad():
        for t in [p for p in module.parameters() if p not in ignored_params] + buffers:
            dist.broadcast(t.data, src=src, group=group)
