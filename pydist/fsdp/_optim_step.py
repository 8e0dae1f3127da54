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
# (id, id) -> the two DeviceMesh objects (kept, so the ids stay theirs) found
# equal: gradients may hold another mesh object than their parameter (one per
# unit), and DeviceMesh.__eq__ costs microseconds a call.
_EQUAL_MESHES: dict = {}


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
    tensor, or None where the Note's conditions do not all hold."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if arguments.get("grad_scale") is not None or arguments.get("found_inf") is not None:
        return None
    if arguments.get("has_complex") or arguments.get("has_sparse_grad") or arguments.get("differentiable"):
        return None
    params = arguments["params"]
    if not params:
        return None
    lists = [arguments[name] for name in f.per_param if arguments[name]]  # params first
    if any(len(tensors) != len(params) for tensors in lists):
        return None
    columns = [[] for _ in lists]
    meshes = {}
    for i, p in enumerate(params):
        if type(p) is not DTensor or not hasattr(p, "_pydist_fsdp_param") or p.dtype.is_complex:
            return None  # (torch's own fully_shard steps as without pydist)
        spec = p._spec
        mesh, placements, shape = spec.mesh, spec.placements, spec.tensor_meta.shape
        for placement in placements:
            if type(placement) is not Shard and type(placement) is not Replicate:
                return None  # Partial (or any other kind): not the layout the Note argues about
        meshes[id(mesh)] = mesh
        for tensors, column in zip(lists, columns):
            t = tensors[i]
            if type(t) is not DTensor:  # None (a state still to be created), a plain tensor
                return None
            s = t._spec
            if s is not spec and not ((s.mesh is mesh or _same_mesh(s.mesh, mesh)) and s.tensor_meta.shape == shape
                                      and (s.placements is placements or s.placements == placements)):
                return None
            column.append(t._local_tensor)
    if not all(mesh._is_current_rank_part_of_mesh() for mesh in meshes.values()):
        return None
    local = dict(arguments)
    local.update((name, column) for name, column in zip((n for n in f.per_param if arguments[n]), columns))
    for name, value in arguments.items():  # step counts, lr, betas: plain tensors or numbers, passed as they are
        if name not in f.per_param and (isinstance(value, DTensor) or isinstance(value, (list, tuple)) and any(
                isinstance(t, DTensor) for t in value)):
            return None
    if arguments.get("foreach") is None and arguments.get("fused") is None:
        differentiable = bool(arguments.get("differentiable", False))
        if (_default_to_fused_or_foreach(params, differentiable, use_fused=False)
                != _default_to_fused_or_foreach(local["params"], differentiable, use_fused=False)):
            return None
    return local


def _same_mesh(a, b) -> bool:
    pair = _EQUAL_MESHES.get((id(a), id(b)))
    if pair is not None and pair[0] is a and pair[1] is b:
        return True
    if a != b:
        return False
    if len(_EQUAL_MESHES) > 4096:  # meshes made per step: keep the cache bounded
        _EQUAL_MESHES.clear()
    _EQUAL_MESHES[(id(a), id(b))] = (a, b)
    return True
