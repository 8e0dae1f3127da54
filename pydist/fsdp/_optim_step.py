"""The optimizer step on ``fully_shard``'s DTensor parameters, run on their
local shards: torch's own Adam, AdamW and SGD update, bit for bit what
DTensor dispatch gives, without DTensor dispatch's cost per op.

[Note: the optimizer step on local shards]
Under ``fully_shard`` (pydist's or torch's) every parameter, its gradient and
the optimizer's state tensors are DTensors of one spec (see [Note: DTensor
parameters] in _fsdp_param.py). Torch's Adam/AdamW and SGD update each
parameter element by element from its own gradient and state, and each op
they apply is pointwise (``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``,
``div``, ``add_``, ``addcdiv_`` and their ``_foreach_``/fused forms) or
touches only the plain scalar ``step`` tensors. For a pointwise op whose
DTensor operands share mesh, shape and placements (Shard or Replicate, no
Partial), DTensor dispatch computes the output placements (the same) and
runs the op once on the local tensors (``_dispatch.py``: ``local_args``);
a plain 0-dim tensor or a Python number goes to the local op unchanged. So
the update run directly on ``_local_tensor`` performs the same ops on the
same values: the same bits, written into the same storages (the in-place
ops update the DTensors' local tensors, which the DTensors keep). What it
skips is the dispatch itself: about ten ops a parameter on Adam's
single-tensor path, which torch takes on CPU (its foreach kernels do not
list the CPU), each a Python-level sharding propagation. On the 400-unit
model of benchmarks/bench_fsdp.py that is most of the step (see
docs/sharded.md).

How: torch's ``Adam.step`` (and AdamW's, its subclass) and ``SGD.step``
call the module-level functionals ``torch.optim.adam.adam`` and
``torch.optim.sgd.sgd`` with lists of the group's tensors. pydist puts a
wrapper in their place (listed in [Note: what importing pydist changes in
torch], installed by the first ``fully_shard``). The wrapper calls torch's
functional with the local tensors when, and only when, every condition of
the argument above holds; otherwise with its arguments unchanged:
  * not compiling or scripting, grad mode off (so not ``differentiable``,
    whose autograd graph must go through the DTensors), no GradScaler
    tensors (``grad_scale``/``found_inf``), no sparse or complex gradients;
  * every parameter is one of pydist's (``_pydist_fsdp_param``): torch's
    own FSDP2 parameters, and any other DTensors, step as without pydist;
  * every per-parameter tensor (parameter, gradient, each state list) at
    index i is a DTensor with parameter i's mesh, shape and placements,
    each Shard or Replicate (no Partial), and this rank is in the mesh
    (DTensor dispatch skips the op on a rank outside it);
  * no state tensor is still to be created: SGD fills a ``None`` momentum
    buffer with ``grad.clone()``, which must be the DTensor that DTensor
    dispatch makes, so that step (SGD's first) goes through the DTensors;
  * ``foreach``/``fused`` left to torch's default resolve alike for the
    DTensors and their locals (torch picks by the tensors' types; DTensor
    is in ``_foreach_supported_types`` once torch.distributed.tensor is
    imported, so they do), so the same kernel path runs.
Nothing is swapped into the optimizer: its param_groups, state (DTensors, as
torch's FSDP2 leaves them), hooks and ``state_dict`` are untouched, and an
error inside the step leaves every object where it was. Any other optimizer
(its own update code), or a group with any other tensor, never reaches the
wrapper's fast branch; a subclass whose step calls torch's functional gets it
on the same conditions, which are about the functional's arguments alone.
tests/fsdp/test_fsdp_optim_step.py checks the result bitwise against torch's
FSDP2 (which steps through DTensor dispatch) and that the fast branch ran.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import itertools
import operator

import torch

__all__ = ["install_local_shard_step", "LOCAL_SHARD_STEPS"]

# Calls of each functional that ran on local shards, by name ("adam", "sgd").
# For tests and benchmarks that need to know the fast branch ran.
LOCAL_SHARD_STEPS: collections.Counter = collections.Counter()


class _Functional:
    """One of torch's element-wise optimizer functionals and which of its
    arguments are per-parameter tensor lists."""

    def __init__(self, module: str, name: str, per_param: tuple):
        self.module, self.name = module, name
        # Lists indexed like params, each empty or all DTensors of the param's
        # spec; a None (a state the functional is to create) sends the call
        # through the DTensors (see the Note).
        self.per_param = per_param


_FUNCTIONALS = (
    _Functional("torch.optim.adam", "adam",
                ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")),
    _Functional("torch.optim.sgd", "sgd", ("params", "d_p_list", "momentum_buffer_list")),
)

_installed = False
# Specs already checked, so a step checks each tensor by identity (see
# _param_spec, _same_layout): id(spec) -> a parameter spec found fit;
# (id(state spec), id(param spec)) -> both, found alike.
_PARAM_SPECS: dict = {}
_EQUAL_LAYOUTS: dict = {}
_SPEC = operator.attrgetter("_spec")
_LOCAL = operator.attrgetter("_local_tensor")


def install_local_shard_step() -> None:
    """Once per process: torch's Adam/AdamW and SGD functionals step
    DTensor parameters on their local shards (see [Note: the optimizer step
    on local shards])."""
    global _installed
    if _installed:
        return
    for f in _FUNCTIONALS:
        module = importlib.import_module(f.module)
        setattr(module, f.name, _on_local_shards(getattr(module, f.name), f))
    _installed = True


def _on_local_shards(original, f: _Functional):
    signature = inspect.signature(original)

    def step_on_local_shards(*args, **kwargs):
        if torch.compiler.is_compiling() or torch.jit.is_scripting() or torch.is_grad_enabled():
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        local = _local_arguments(bound.arguments, f)
        if local is None:
            return original(*args, **kwargs)
        LOCAL_SHARD_STEPS[f.name] += 1
        return original(**local)

    step_on_local_shards.__name__ = original.__name__
    step_on_local_shards.__qualname__ = original.__qualname__
    step_on_local_shards.__doc__ = original.__doc__
    step_on_local_shards.__wrapped__ = original
    return step_on_local_shards


def _local_arguments(arguments: dict, f: _Functional) -> dict | None:
    """``arguments`` with each per-parameter DTensor replaced by its local
    tensor, or None where the Note's conditions do not all hold.

    Called once per group and step with thousands of tensors on a model of
    small parameters, so the per-tensor checks run as C-level maps: types,
    spec identities, and lookups of the (state spec, parameter spec) pairs
    already compared; the full checks run once per parameter spec and once
    per pair, and are remembered (see _same_layout)."""
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if arguments.get("grad_scale") is not None or arguments.get("found_inf") is not None:
        return None
    if arguments.get("has_complex") or arguments.get("has_sparse_grad") or arguments.get("differentiable"):
        return None
    params = arguments["params"]
    if not params:
        return None
    names = [name for name in f.per_param if arguments[name]]  # params first
    lists = [arguments[name] for name in names]
    if any(len(tensors) != len(params) for tensors in lists):
        return None
    # A None (a state still to be created) or a plain tensor anywhere: through the DTensors.
    if set(map(type, itertools.chain.from_iterable(lists))) != {DTensor}:
        return None
    if not all(map(hasattr, params, itertools.repeat("_pydist_fsdp_param"))):
        return None  # (torch's own fully_shard steps as without pydist)
    specs = list(map(_SPEC, params))
    if not all(map(_PARAM_SPECS.__contains__, map(id, specs))) and not all(map(_param_spec, specs)):
        return None
    for tensors in lists[1:]:
        state_specs = list(map(_SPEC, tensors))
        if not (all(map(operator.is_, state_specs, specs))
                or all(map(_EQUAL_LAYOUTS.__contains__, zip(map(id, state_specs), map(id, specs))))
                or all(map(_same_layout, state_specs, specs))):
            return None
    for name, value in arguments.items():  # step counts, lr, betas: plain tensors or numbers, passed as they are
        if name not in f.per_param and (isinstance(value, DTensor) or isinstance(value, (list, tuple)) and any(
                map(isinstance, value, itertools.repeat(DTensor)))):
            return None
    local = dict(arguments)
    local.update((name, list(map(_LOCAL, tensors))) for name, tensors in zip(names, lists))
    if arguments.get("foreach") is None and arguments.get("fused") is None:
        differentiable = bool(arguments.get("differentiable", False))
        if (_default_to_fused_or_foreach(params, differentiable, use_fused=False)
                != _default_to_fused_or_foreach(local["params"], differentiable, use_fused=False)):
            return None
    return local


def _param_spec(spec) -> bool:
    """Whether a parameter's ``spec`` is one the Note's argument covers: a
    real dtype, Shard and Replicate placements only (no Partial), on a mesh
    this rank is part of. A property of the spec alone (torch shares spec
    objects between equal DTensors, so a spec says nothing of whose
    parameter holds it), remembered per spec object."""
    if _PARAM_SPECS.get(id(spec)) is spec:
        return True
    from torch.distributed.tensor import Replicate, Shard

    if spec.tensor_meta is None or spec.tensor_meta.dtype.is_complex:
        return False
    if not all(type(placement) is Shard or type(placement) is Replicate for placement in spec.placements):
        return False
    if not spec.mesh._is_current_rank_part_of_mesh():
        return False
    _remember(_PARAM_SPECS, id(spec), spec)
    return True


def _same_layout(s, spec) -> bool:
    """Whether a state tensor's spec ``s`` has its parameter's ``spec``'s mesh,
    shape and placements. Gradients share their parameter's spec object; a
    state's (made by ``zeros_like``) is its own and lives as long as the state,
    so each pair is compared once (DeviceMesh.__eq__ costs microseconds)."""
    if s is spec or (id(s), id(spec)) in _EQUAL_LAYOUTS:
        return True
    if not (s.tensor_meta.shape == spec.tensor_meta.shape and s.placements == spec.placements
            and (s.mesh is spec.mesh or s.mesh == spec.mesh)):
        return False
    _remember(_EQUAL_LAYOUTS, (id(s), id(spec)), (s, spec))
    return True


def _remember(cache: dict, key, value) -> None:
    """``cache[key] = value``; the value holds the objects whose ids make the
    key, so no id is reused while it is cached. Bounded: specs made per step
    (a model rebuilt in a loop) cannot grow it without end."""
    if len(cache) > 65536:
        cache.clear()
    cache[key] = value
