"""``pydist.fully_shard``: torch FSDP2's front door on pydist's engine.

    for block in model.blocks:
        pydist.fully_shard(block)          # bottom-up: each block one unit
    pydist.fully_shard(model)              # then the root: what is left
    opt = torch.optim.AdamW(model.parameters())   # the local shards

Built on the meta device, as FSDP2's recipe: ``model.to_empty(device="cpu")``
and initialize it after the fully_shard calls, before the optimizer (see
[Note: a unit built on the meta device] in _fsdp_param_group.py).

See [Note: what the optimizer sees] (pydist/fsdp/_fsdp_param.py) for what
``model.parameters()`` holds, [Note: the unit's flat layout] for how a unit
is sharded and [Note: the order of an iteration] for the hooks.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules import module as _module_hooks

from pydist.fsdp._fsdp_param import ParamModuleInfo
from pydist.fsdp._fsdp_param_group import FSDPParamGroup, Layout
from pydist.fsdp._fsdp_state import FSDPState, state_of
from pydist.fsdp._optim_step import install_local_shard_step
from pydist.fsdp._state_dict import install_torch_checkpoint_api, register_state_dict_hooks

__all__ = ["fully_shard", "UnitModule", "fsdp2_mixin", "unshard_handle"]


def _torch_policies():
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    return MixedPrecisionPolicy, OffloadPolicy


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool = True, shard_placement_fn=None,
                mp_policy=None, offload_policy=None, ignored_params=None, shm: bool | None = None,
                _sharded: bool = True, _process_group=None, _replicate_group=None,
                _zeros_for_unused: bool = False, _layout: Layout = Layout.SHARD0) -> nn.Module:
    """Makes ``module``'s parameters not yet managed by a fully_shard'ed
    submodule one unit, sharded over ``mesh`` (a 1-D DeviceMesh; a 2-D one,
    ("replicate", "shard"), for HSDP: see [Note: HSDP]; None: the default
    group), and returns ``module``, its class now also an ``FSDPModule``.
    Call it on submodules first, then on the root.

    torch's ``MixedPrecisionPolicy()`` and ``OffloadPolicy()`` are accepted
    (``MixedPrecisionPolicy``: see [Note: mixed precision]), and
    ``CPUOffloadPolicy(pin_memory=False)`` for a unit on the CPU (what it
    asks for is so already); offload from a device, ``shard_placement_fn``,
    an int ``reshard_after_forward`` and meshes of more than two dimensions
    raise ``NotImplementedError`` naming them. ``ignored_params`` (a set of
    parameters) are left as torch's are: not sharded, their gradients not
    reduced, plain tensors in state dicts. ``shm`` (pydist's own) picks the
    transport: see ``open_transport``. torch's ``clip_grad_norm_`` clips the
    sharded gradients by their global norm (see [Note: the global norm of
    sharded gradients]).

    ``module`` may be a list of modules, as torch's: see [Note: a list of
    modules]."""
    if isinstance(module, (list, tuple)):
        for m in _list_of_units(module, _ignored_ids(ignored_params)):
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=shard_placement_fn, mp_policy=mp_policy, offload_policy=offload_policy,
                        ignored_params=ignored_params, shm=shm, _sharded=_sharded, _process_group=_process_group,
                        _replicate_group=_replicate_group, _zeros_for_unused=_zeros_for_unused, _layout=_layout)
        return module
    MixedPrecisionPolicy, OffloadPolicy = _torch_policies()
    _refuse(shard_placement_fn is not None, "shard_placement_fn")
    _refuse(not isinstance(reshard_after_forward, bool), f"reshard_after_forward={reshard_after_forward!r} (an int)")
    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if state_of(module) is not None:
        raise RuntimeError(f"pydist.fully_shard: {type(module).__name__} is already fully_shard'ed")
    from pydist.overlap import hooks as overlap_hooks

    overlap_hooks.sharded_made()  # [overlap hook] a PYDIST_SIM_NET it cannot read is refused here, as DDP does
    named = _managed_params(module, _ignored_ids(ignored_params))
    _refuse(not _offload_is_a_no_op(offload_policy, OffloadPolicy, mesh, named),
            f"offload_policy={offload_policy!r} (CPUOffloadPolicy only for parameters on the CPU, without pin_memory)")
    if _process_group is not None:
        group, replicate_group = _process_group, _replicate_group
    else:
        group, replicate_group = _groups_of(mesh)
        if mesh is None and _layout is Layout.SHARD0:
            mesh = _default_mesh([p for _, p, _ in named])
    for fqn, p, _ in named:
        # Its module's own Parameter object, which becomes the shard (see
        # [Note: the Parameter objects stay]): a registration of it outside
        # the unit (a weight tied across units) is refused.
        p._pydist_fsdp_taken_by = f"{type(module).__name__} (as {fqn})"
    param_group = None
    if any(p.numel() for _, p, _ in named):  # see [Note: a unit of zero-size parameters]
        param_group = FSDPParamGroup(
            named, dist.get_rank(group), dist.get_world_size(group), sharded=_sharded,
            reshard_after_forward=reshard_after_forward, label=type(module).__name__,
            param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
            zeros_for_unused=_zeros_for_unused, layout=_layout, mesh=mesh if _layout is Layout.SHARD0 else None,
        )
    module.__dict__["_pydist_fsdp_state"] = FSDPState(module, param_group, group, shm, mp_policy, replicate_group)
    register_state_dict_hooks(module)  # see [Note: the sharded state dict]
    if param_group is not None and param_group.dtensor:  # torch's reset after load_state_dict(assign=True)
        module.register_load_state_dict_post_hook(lambda *_: _after_apply(module, "load_state_dict(assign=True)"))
    install_torch_checkpoint_api()  # see [Note: torch's checkpoint helpers on pydist's shards]
    install_local_shard_step()  # see [Note: the optimizer step on local shards]
    # Libraries ask whether a module is FSDP-managed the way torch's
    # fully_shard marks it: Hugging Face's generate() then keeps every rank
    # stepping until all are done (synced_gpus); unmarked, a rank that
    # finished first left the others waiting in an all-gather.
    for managed in module.modules():
        managed._is_fsdp_managed_module = True
        managed._fsdp_use_orig_params = True
    cls = module.__class__
    if not isinstance(module, UnitModule):
        mixin = fsdp2_mixin() if _layout is Layout.SHARD0 else UnitModule
        if (mixin, cls) not in _FSDP_CLASSES:
            # See [Note: a unit's call]; a class with its own _call_impl keeps it.
            own_call = cls._call_impl is not nn.Module._call_impl
            _FSDP_CLASSES[mixin, cls] = type(f"FSDP{cls.__name__}", (mixin, cls),
                                             {} if own_call else {"_call_impl": _unit_call_impl})
        module.__class__ = _FSDP_CLASSES[mixin, cls]
    return module


_FSDP_CLASSES: dict[tuple[type, type], type] = {}


def _default_mesh(params: list):
    """torch's default for ``fully_shard(mesh=None)``: a 1-D mesh over the
    world, on the parameters' device type (a meta model's: CUDA where there
    is one, as torch's)."""
    from torch.distributed.device_mesh import init_device_mesh

    kind = _default_device_type(params)
    if kind not in _fallback_meshes:
        try:
            return init_device_mesh(kind, (dist.get_world_size(),))
        except RuntimeError as exc:
            if "name not set" not in str(exc):
                raise
            # A default group torch cannot name (pydist's mpi4py group, a
            # Python ProcessGroup): the DTensors' own collectives (a norm,
            # full_tensor) go over a gloo group of the same ranks; the
            # units' collectives still take the default group or shared memory.
            from torch.distributed.device_mesh import DeviceMesh

            _fallback_meshes[kind] = DeviceMesh.from_group(dist.new_group(backend="gloo"), kind)
    return _fallback_meshes[kind]


def _default_device_type(params: list) -> str:
    """The device type of ``fully_shard(mesh=None)``'s mesh: the parameters'
    one, or (a meta model, or several types) CUDA where there is one, as torch's."""
    types = {p.device.type for p in params} - {"meta"}
    return types.pop() if len(types) == 1 else ("cuda" if torch.cuda.is_available() else "cpu")


_fallback_meshes: dict = {}  # per device type, made once, collectively, at the first fully_shard

# [Note: a unit of zero-size parameters]
# A module whose parameters all have no elements (``nn.Linear(16, 0)``, a
# layer pruned to nothing) has nothing to shard, gather or reduce: its
# gradients are empty on every rank. fully_shard makes it a unit without a
# parameter group, as a module with no parameters: its parameters stay the
# plain (empty) tensors they are, which autograd and the optimizer handle
# as torch does, and no enclosing unit takes them (they are marked taken).
# A unit that also holds parameters with elements lays its zero-size ones
# out with the rest, as zero-length ranges.

# [Note: a unit's call]
# torch's Module._call_impl runs a module's hooks through a general dispatch
# (a closure, the global hook tables, each hook's kind tested per call):
# about as many interpreted steps per unit as the unit's own pre-forward, in
# a model of many small units a good part of the forward. A unit whose only
# forward hooks are the two its FSDPState registered, with no backward hooks
# and no global module hooks, outside JIT tracing and Dynamo, is called here:
# those two hooks around forward, in the order, with the arguments and the
# return handling of torch's dispatch. Anything else takes torch's dispatch,
# hooks and all.


def _unit_call_impl(self, *args, **kwargs):
    if (len(self._forward_pre_hooks) == 1 and len(self._forward_hooks) == 1
            and not (self._backward_hooks or self._backward_pre_hooks or _module_hooks._global_backward_pre_hooks
                     or _module_hooks._global_backward_hooks or _module_hooks._global_forward_hooks
                     or _module_hooks._global_forward_pre_hooks)
            and not torch._C._get_tracing_state() and not torch.compiler.is_compiling()):
        state = self.__dict__["_pydist_fsdp_state"]
        new = state._pre_forward(self, args, kwargs)
        if new is not None:
            args, kwargs = new
        return state._post_forward(self, args, self.forward(*args, **kwargs))
    return nn.Module._call_impl(self, *args, **kwargs)


def _refuse(condition, what: str) -> None:
    if condition:
        raise NotImplementedError(f"pydist.fully_shard: {what} is not implemented yet")


def _groups_of(mesh) -> tuple:
    """(the group to shard over, the group to all-reduce over or None): a
    1-D mesh's group; a 2-D mesh's dims are (replicate, shard), as torch's
    fully_shard reads them (HSDP)."""
    if mesh is None:
        return dist.group.WORLD, None
    if mesh.ndim == 1:
        return mesh.get_group(), None
    _refuse(mesh.ndim != 2, f"a {mesh.ndim}-D mesh")
    return mesh.get_group(1), mesh.get_group(0)


def _offload_is_a_no_op(policy, OffloadPolicy, mesh, named) -> bool:
    """Whether ``policy`` asks for nothing pydist would have to do: none, or
    torch's ``OffloadPolicy()``, or ``CPUOffloadPolicy(pin_memory=False)``
    for a unit on the CPU (a CPU mesh, no parameter elsewhere), whose shards,
    gradients and optimizer step are on the CPU already: torch's FSDP2 runs
    such a unit as without the policy. Offloading from a device is not
    implemented yet."""
    if policy is None or type(policy) is OffloadPolicy:
        return True
    from torch.distributed.fsdp import CPUOffloadPolicy

    if type(policy) is not CPUOffloadPolicy or policy.pin_memory:
        return False
    params = [p for _, p, _ in named]
    kind = mesh.device_type if mesh is not None else _default_device_type(params)
    return kind == "cpu" and all(p.device.type in ("cpu", "meta") for p in params)


def _ignored_ids(ignored_params) -> set[int]:
    """The ids of ``ignored_params`` (None, or parameters), checked."""
    ids = set()
    for p in ignored_params or ():
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"pydist.fully_shard: ignored_params holds a {type(p).__name__}, not a parameter")
        ids.add(id(p))
    return ids


# [Note: a list of modules]
# torch's fully_shard([a, b, ...]) makes the modules one group: one
# all-gather and one reduce-scatter for their parameters together, unsharded
# from the first one's forward to the end of the last one's. torchtitan and
# the scripts that follow it group the final norm and the output layer so
# (``fully_shard([model.norm, model.output], reshard_after_forward=False)``),
# and accelerate's FSDP2 plugin likewise. pydist makes each module of the
# list a unit of its own, with the same arguments: each parameter is
# sharded, gathered and reduced element by element as in torch's group, so
# training gives the same values bit for bit (tests/fsdp/test_fsdp2_contract.py
# runs its script so); what differs is that each module gathers and reduces
# on its own (one collective more per extra module) and that ``unshard()``,
# ``reshard()`` and the ``set_*`` methods of one module act on its unit only.
# What a group is needed for is refused, before anything is sharded: a
# parameter two modules of the list share (tied weights, which torch's
# group holds once) and modules nested in one another.
def _list_of_units(modules, ignored: set[int]) -> list[nn.Module]:
    """The modules of a list ``fully_shard`` was given, checked: see [Note:
    a list of modules]."""
    modules = list(modules)
    where = f"pydist.fully_shard(a list of {len(modules)} modules)"
    bad = [type(m).__name__ for m in modules if not isinstance(m, nn.Module)]
    if not modules or bad:
        raise ValueError(f"{where}: expects modules, got {bad or 'an empty list'}")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError(f"{where}: a module appears twice in the list")
    for i, outer in enumerate(modules):
        for j, inner in enumerate(modules):
            if i != j and any(m is inner for m in outer.modules()):
                raise NotImplementedError(
                    f"{where}: module {j} ({type(inner).__name__}) is inside module {i} ({type(outer).__name__}); "
                    "pydist makes each module of a list a unit of its own (see [Note: a list of modules]): list "
                    "modules that do not contain one another, or call fully_shard on the inner one first")
    owners: dict[int, int] = {}
    for i, m in enumerate(modules):
        for fqn, p, _ in _managed_params(m, ignored):
            j = owners.setdefault(id(p), i)
            if j != i:
                raise NotImplementedError(
                    f"{where}: parameter {fqn} of module {i} ({type(m).__name__}) is also module {j}'s "
                    f"({type(modules[j]).__name__}): a weight tied between modules of a list is not implemented "
                    "yet (pydist makes each module of a list a unit of its own: see [Note: a list of modules]); "
                    "call fully_shard on a module that holds every use of it (their lowest common ancestor)")
    return modules


def _managed_params(module: nn.Module, ignored: set[int]) -> list[tuple[str, nn.Parameter, list[ParamModuleInfo]]]:
    """(fqn, parameter, where it is registered) for the parameters of
    ``module`` not managed by a fully_shard'ed submodule nor ``ignored`` (ids),
    in registration order."""
    by_id: dict[int, tuple[str, nn.Parameter, list[ParamModuleInfo]]] = {}

    def visit(prefix: str, m: nn.Module, top: bool):
        if not top and state_of(m) is not None:
            return
        for name, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            if hasattr(p, "_pydist_fsdp_taken_by"):
                raise NotImplementedError(
                    f"pydist.fully_shard({type(module).__name__}): parameter {prefix + name} is the same tensor as "
                    f"one a unit fully_shard'ed before manages, {p._pydist_fsdp_taken_by}: a weight tied across two "
                    "units would train as two. Call fully_shard on a module that holds every use of it (their "
                    "lowest common ancestor), not on the one that holds only some, as torch's FSDP2 requires"
                )
            if hasattr(p, "_pydist_fsdp_param"):
                continue
            entry = by_id.setdefault(id(p), (prefix + name, p, []))
            entry[2].append(ParamModuleInfo(m, name))
        for child_name, child in m._modules.items():
            if child is not None:
                visit(f"{prefix}{child_name}.", child, False)

    visit("", module, True)
    return list(by_id.values())


class _UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` it
    (made an instance of torch's ``UnshardHandle``: ``unshard_handle``)."""

    def __init__(self, param_group: FSDPParamGroup | None):
        self._param_group = param_group

    def wait(self) -> None:
        if self._param_group is not None:
            self._param_group.wait_for_unshard()
            self._param_group = None


class UnitModule:
    """Mixed into a fully_shard'ed module's class: FSDP2's module methods on
    pydist's engine (FSDP1's door's inner units have this alone;
    ``fully_shard``'s have ``FSDP2Module``, torch's type too)."""

    def _apply(self, fn, recurse: bool = True):
        """``to_empty``, ``.to()``, ``.float()``...: a unit built on the meta
        device takes up the parameters this leaves on its modules (see [Note:
        a unit built on the meta device] in _fsdp_param_group.py); another
        unit raises if its parameters were replaced."""
        out = super()._apply(fn, recurse)
        _after_apply(self)
        return out

    def __deepcopy__(self, memo):
        # As torch's FSDP classes (which raise this AssertionError): a copy
        # would share the transports and hold shards of the live model.
        raise AssertionError(
            f"pydist.fully_shard({type(self).__name__}): a sharded module cannot be deep-copied (its parameters are "
            "this rank's shards, its units share transports with the other ranks). Copy the model before "
            "fully_shard (an EMA copy, a reference model), or use a state dict for serialization")

    def _fsdp_states(self, recurse: bool):
        modules = self.modules() if recurse else [self]
        return [s for m in modules if (s := state_of(m)) is not None]

    def _param_groups(self, recurse: bool):
        return [s.param_group for s in self._fsdp_states(recurse) if s.param_group is not None]

    def unshard(self, async_op: bool = False):
        """All-gathers this module's unit (not its children's). Before any
        forward, this module becomes the root (as FSDP2's lazy init)."""
        state = state_of(self)
        if state.root is None:
            state._lazy_init()
        pg = state.param_group
        if pg is not None:
            pg.unshard()
        handle = unshard_handle()(pg)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        pg = state_of(self).param_group
        if pg is not None:
            pg.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients without reducing
        them (gradient accumulation); the next backward with True reduces the sum."""
        for pg in self._param_groups(recurse):
            pg.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for pg in self._param_groups(recurse):
            pg.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for pg in self._param_groups(recurse):
            pg.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        state_of(self).forward_prefetch = [_state_or_raise(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        state_of(self).backward_prefetch = [_state_or_raise(m) for m in modules]

    def set_collective_batch_bytes(self, nbytes: int | None) -> None:
        """pydist's own, on the root: how many unsharded bytes of consecutive
        units' parameters (and gradients) go as one all-gather (reduce-scatter);
        0: every unit alone; None: the default, 256 KiB per sharding rank up
        to 2 MiB. See [Note: gather and reduce plans]
        (pydist/fsdp/_fsdp_schedule.py). Takes effect from the next forward."""
        if nbytes is not None and nbytes < 0:
            raise ValueError(f"set_collective_batch_bytes: nbytes must be >= 0 or None, got {nbytes}")
        state = state_of(self)
        if state.root is not None and state.root is not state and nbytes is not None:
            root = state.root
            state.refuse_batch_bytes_off_root(root, next(n for n, m in root.module.named_modules() if m is self))
        state.batch_bytes = None if nbytes is None else int(nbytes)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        raise NotImplementedError("pydist.fully_shard: set_is_last_backward is not implemented yet")

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether a synced backward all-reduces over the replicas.
        False (accumulating micro-batches): each backward still
        reduce-scatters, its shards are summed and held, and the next
        backward with True adds them to its own before the all-reduce; no
        ``.grad`` is handed out meanwhile, as under torch. See [Note: HSDP]."""
        for pg in self._param_groups(recurse):
            pg.requires_all_reduce = requires_all_reduce

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """``hook(reduce_output)`` once this unit's gradients are reduced (the
        reduce-scatter's output; under HSDP, after the replicas' all-reduce),
        before they become ``.grad``, on the thread that waits for them; it
        may change the tensor in place. The tensor is this unit's flat shard
        (pydist's layout, not FSDP2's per-parameter padded chunks), so a hook
        that works element by element sees what torch's would. ``stream`` is
        for CUDA streams, which this hook does not take."""
        _refuse(stream is not None, "set_all_reduce_hook(stream=...)")
        state = state_of(self)
        if state.param_group is not None:
            state.param_group.all_reduce_hook = hook


def _state_or_raise(module: nn.Module) -> FSDPState:
    state = state_of(module)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not fully_shard'ed; only FSDPModules can be prefetched")
    return state


# [Note: torch's FSDPModule]
# ``fully_shard``'s modules are instances of torch's ``FSDPModule``, so
# scripts and libraries that check it (``isinstance(m, FSDPModule)``,
# torch's state-dict helpers) take them for FSDP2's. torch's class reaches
# its state through ``fully_shard.state(module)``, which pydist's modules do
# not have, so the mixin puts pydist's engine behind every method torch's
# class has: ``UnitModule``'s where pydist has one, and for the rest an
# error naming the method. ``pydist.FSDPModule`` is torch's class itself.
# The mixin is made at the first fully_shard (torch.distributed.fsdp takes
# seconds to import; ``import pydist`` does not pay it).


@functools.cache
def fsdp2_mixin() -> type:
    """``fully_shard``'s mixin: pydist's methods, torch's type. See [Note: torch's FSDPModule]."""
    from torch.distributed.fsdp import FSDPModule

    try:  # torch's module, for its disable_fsdp_module_new_init flag (a private path)
        from torch.distributed.fsdp._fully_shard import _fully_shard as torch_fully_shard
    except ImportError:
        torch_fully_shard = None

    def __new__(cls, *args, **kwargs):
        # As torch's FSDPModule.__new__ (slicing a container, copy.deepcopy,
        # unpickling): the wrapped class (the one after torch's FSDPModule in
        # the MRO) without the FSDP class, initialized unless torch's
        # disable_fsdp_module_new_init() is on (torch 2.13; 2.11 has no such flag).
        mro = cls.__mro__
        orig_cls = mro[mro.index(FSDPModule) + 1]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        if getattr(torch_fully_shard, "_enable_fsdp_module_new_init", True):
            self.__init__(*args, **kwargs)
        return self

    def _apply(self, fn, recurse: bool = True):
        self.reshard()  # as torch's: the sharded parameters are the ones registered, and the ones cast
        out = super(FSDPModule, self)._apply(fn, recurse)  # the wrapped class's, past torch's own
        _after_apply(self)
        return out

    methods = {"__new__": __new__, "_apply": _apply, "__doc__": fsdp2_mixin.__doc__}
    for name, value in vars(FSDPModule).items():
        if callable(value) and not name.startswith("__") and name not in vars(UnitModule):
            methods[name] = _not_implemented(name)
    return type("FSDP2Module", (UnitModule, FSDPModule), methods)


@functools.cache
def unshard_handle() -> type:
    """pydist's unshard handle, a subclass of torch's ``UnshardHandle``."""
    from torch.distributed.fsdp import UnshardHandle

    return type("UnshardHandle", (_UnshardHandle, UnshardHandle), {})


def _after_apply(module: nn.Module, *what: str) -> None:
    """``FSDPParamGroup.after_apply`` of the module's unit (``what``: what
    changed its parameters, where not ``Module._apply``), told to its root."""
    state = state_of(module)
    if state is not None and state.param_group is not None and state.param_group.after_apply(*what) and state.root:
        state.root.units_changed()


def _not_implemented(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"pydist.fully_shard: FSDPModule.{name} is not implemented on pydist's engine")

    method.__name__ = name
    return method
