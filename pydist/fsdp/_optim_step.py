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

[Note: adjacent shards stepped as one tensor]
On local shards (and on FSDP1's door's plain shards: ``_PLAIN``) the
single-tensor path (torch's CPU default) still runs its ten-odd ops once per
parameter, about 20 us of Python and dispatch each whatever the size: on a
model of many small parameters (norms, biases) that is most of the step. A
unit's local shards lie one after another in its shard buffer and their
gradients in its reduce output, in the same order, so a run of adjacent
shards can be stepped as one flat tensor, with the same result element for
element, when:
  * every op is element-wise and reads one element of each list and the
    run's shared scalars (lr, betas, and the bias corrections of the step
    count): all of them, with every ``state_steps`` value of the run equal;
  * each element goes through the same kernel code in both: ATen's CPU
    loops process whole blocks of two vectors and the tail element by
    element, and the two can round differently (reduced-precision dtypes do:
    measured, bf16 tails differ). Every shard of a run but its last is a
    whole number of ``_RUN_BYTES`` (two 64-byte vectors, the widest CPU
    capability ATen builds for x86 and the SVE256 one), so the run's tail is
    its last shard's tail and every other element is in a block, run or not;
    other capabilities get no runs. Float32 shards are exempt where a check
    (once per configuration: ``_tails_alike``) found a buffer cut into
    pieces of every tail length stepped bit for bit as the buffer uncut, so
    that the two codes agree on this machine for this configuration
    (measured with torch 2.13 on AVX512: float32 tails never differed,
    bf16 ones did under ``add(alpha=)``, so only float32 is checked). That
    is what lets a layout of small shards (a norm's 16 floats at 4 ranks)
    make one run of a whole unit;
  * a run is at most ``_RUN_MAX`` elements, ATen's grain size: intra-op
    threads split longer tensors at places that would make tails;
  * the path is the single-tensor one on the CPU, or torch's multi-tensor
    one where it stands in for it (see below; not fused, not capturable).
The optimizer's state tensors are made one per parameter (``zeros_like``);
the first step that finds a run of shards moves the state of each run into
one buffer laid out like the shards (copied, then ``set_`` onto it: the
state's objects, DTensors and local tensors, stay the same and keep their
values); so do Adam's step counts, into one buffer of the group's. The
plan (the runs, their flat views) is cached on the state and checked each
step: the same tensor objects, the shards' data where it was. Gradients
are new each step, so their adjacency is checked each step and any break
sends the call down the per-parameter path. The call gets each run's first
step count; the others are counted up after it in one op, as the
per-parameter path counts each. tests/fsdp/test_fsdp_optim_step.py checks
it bitwise against torch's FSDP2 and that runs were stepped, and
tests/fsdp/test_fsdp1_and_state.py against torch's FSDP1.

[Note: torch's foreach ops in place of its per-parameter loop]
Left to torch's default (``foreach`` and ``fused`` None) on the CPU, Adam,
AdamW and SGD take the single-tensor path: a Python loop running each op
once per tensor, some 20 us a tensor whatever its size, where a model of
many small parameters (or the runs above, cut short by a bias's 16-float
shard at 4 ranks) has hundreds. Torch's multi-tensor path applies the same
ops to the same elements, list by list (``_foreach_lerp_`` where the loop
calls ``lerp_``, ...), and on the CPU each ``_foreach_`` op is ATen's loop
over the list calling that same per-tensor op: the same kernels on the
same values, without the Python per tensor. So the local-shard step calls
torch's functional with ``foreach=True`` where the call would take the
single-tensor path on the CPU, with float hyperparameters (the multi-tensor
path refuses a Tensor lr), when, for its configuration (the functional,
the flags that choose its ops, the dtypes), a check run once per process
found both paths bitwise alike on small tensors of odd sizes over a few
steps, gradients left as they were included (SGD's multi-tensor Nesterov
update adds into the gradients in place, which the check catches: that
configuration keeps the loop). The check is what ties this to the torch
at hand, not a reading of one version's code. The multi-tensor path makes
each op's result for the whole list at once (Adam's denominators: a copy of
the state's size), so calls are cut into pieces of at most
``_FOREACH_ELEMENTS`` elements: its transient memory stays that, or one
tensor's as in the loop. An explicit ``foreach=False`` is kept.
tests/fsdp/test_fsdp_optim_step.py checks the step bitwise torch FSDP2's
(through DTensor dispatch, on its per-parameter path) with the default.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import itertools
import operator

import torch

__all__ = ["install_local_shard_step", "LOCAL_SHARD_STEPS", "LOCAL_SHARD_RUNS", "LOCAL_SHARD_FOREACH"]

# Calls of each functional that ran on local shards, by name ("adam", "sgd"),
# and runs of adjacent shards stepped as one tensor in them (by name, plus
# " over float32 tails" where the runs could go past float32 shards' tails).
# For tests and benchmarks that need to know the fast branches ran.
LOCAL_SHARD_STEPS: collections.Counter = collections.Counter()
LOCAL_SHARD_RUNS: collections.Counter = collections.Counter()
# Calls that torch's multi-tensor path stepped in place of its loop, by name.
LOCAL_SHARD_FOREACH: collections.Counter = collections.Counter()


class _Functional:
    """One of torch's element-wise optimizer functionals and which of its
    arguments are per-parameter tensor lists."""

    def __init__(self, module: str, name: str, per_param: tuple, scalars: tuple, flags: tuple):
        self.module, self.name = module, name
        # Lists indexed like params, each empty or all DTensors of the param's
        # spec; a None (a state the functional is to create) sends the call
        # through the DTensors (see the Note).
        self.per_param = per_param
        # Every list indexed like params (the step counts too), in order.
        self.lists = per_param + ("state_steps",) * (name == "adam")
        # Hyperparameters the multi-tensor path takes as Python numbers only,
        # and the arguments that choose which ops run (see [Note: torch's
        # foreach ops in place of its per-parameter loop]).
        self.scalars, self.flags = scalars, flags


_FUNCTIONALS = (
    _Functional("torch.optim.adam", "adam",
                ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"),
                ("lr", "beta1", "beta2", "weight_decay", "eps"),
                ("amsgrad", "maximize", "decoupled_weight_decay")),
    _Functional("torch.optim.sgd", "sgd", ("params", "d_p_list", "momentum_buffer_list"),
                ("lr", "weight_decay", "momentum", "dampening"), ("nesterov", "maximize")),
)

_installed = False
# Specs already checked, so a step checks each tensor by identity (see
# _param_spec, _same_layout): id(spec) -> a parameter spec found fit;
# (id(state spec), id(param spec)) -> both, found alike.
_PARAM_SPECS: dict = {}
_EQUAL_LAYOUTS: dict = {}
_SPEC = operator.attrgetter("_spec")
_LOCAL = operator.attrgetter("_local_tensor")
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr


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
        lists = _pydist_lists(bound.arguments, f)
        if lists is None:
            return original(*args, **kwargs)
        local = _local_arguments(bound.arguments, f, *lists)
        if local is not None:
            LOCAL_SHARD_STEPS[f.name] += 1
        elif lists[2] <= _PLAIN:  # FSDP1's door (see [Note: what the optimizer sees]): plain shards already
            local = bound.arguments
        else:
            return original(*args, **kwargs)
        config = _config(f, local)
        dtypes = frozenset(map(_DTYPE, local["params"]))  # (runs keep them: a run is of one dtype)
        runs = _in_runs(local, f, _tails_alike(original, f, local, config, dtypes))
        arguments, plan = runs if runs is not None else (local, None)
        if _foreach_alike(original, f, arguments, config, dtypes):
            LOCAL_SHARD_FOREACH[f.name] += 1
            _call_in_pieces(original, f, arguments)
            result = None
        else:
            result = original(**arguments)
        if plan is not None:
            plan.count_up()
        return result

    step_on_local_shards.__name__ = original.__name__
    step_on_local_shards.__qualname__ = original.__qualname__
    step_on_local_shards.__doc__ = original.__doc__
    step_on_local_shards.__wrapped__ = original
    return step_on_local_shards


def _pydist_lists(arguments: dict, f: _Functional):
    """(the names of the per-parameter lists given, the lists, the types of
    their elements) where a call steps pydist's parameters only, with none
    of what keeps both fast paths out (GradScaler tensors, sparse or complex
    gradients, ``differentiable``); else None. Parameters first."""
    if arguments.get("grad_scale") is not None or arguments.get("found_inf") is not None:
        return None
    if arguments.get("has_complex") or arguments.get("has_sparse_grad") or arguments.get("differentiable"):
        return None
    params = arguments["params"]
    if not params or not all(map(hasattr, params, itertools.repeat("_pydist_fsdp_param"))):
        return None  # (torch's own fully_shard steps as without pydist)
    names = [name for name in f.per_param if arguments[name]]
    lists = [arguments[name] for name in names]
    if any(len(tensors) != len(params) for tensors in lists):
        return None
    return names, lists, set(map(type, itertools.chain.from_iterable(lists)))


# The types of FSDP1's door's shards, gradients and state (a None, a state
# still to be created, is not one).
_PLAIN = {torch.Tensor, torch.nn.Parameter}


def _local_arguments(arguments: dict, f: _Functional, names: list, lists: list, types: set) -> dict | None:
    """``arguments`` (``_pydist_lists``'s ``names``, ``lists`` and
    ``types`` of it) with each per-parameter DTensor replaced by its local
    tensor, or None where the Note's conditions do not all hold.

    Called once per group and step with thousands of tensors on a model of
    small parameters, so the per-tensor checks run as C-level maps: types,
    spec identities, and lookups of the (state spec, parameter spec) pairs
    already compared; the full checks run once per parameter spec and once
    per pair, and are remembered (see _same_layout)."""
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import _default_to_fused_or_foreach

    # A None (a state still to be created) or a plain tensor anywhere: through the DTensors.
    if types != {DTensor}:
        return None
    params = arguments["params"]
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


# See [Note: adjacent shards stepped as one tensor].
_RUN_BYTES = 128
_RUN_MAX = 32768  # at::internal::GRAIN_SIZE
_RUN_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512", "SVE256")


class _Runs:
    """A group's runs of adjacent shards: ``spans`` (start, end, numel) over
    the parameter lists (each end - start >= 2), the lists with each run as
    one flat tensor for the parameters and each state list (the tensor the
    plan hangs on left out: at ``key_at`` of the first state list, or
    None), and what the step's own lists are checked against (ids of the
    tensors planned for, all held but the one the plan hangs on, and where
    the shards' data was)."""

    __slots__ = ("ids", "ptrs", "held", "spans", "flat", "key_at", "dtypes", "adjacent", "sizes", "grad_layout",
                 "steps", "head_steps", "rest", "ones", "tails")

    def __init__(self, everything, held, spans, flat, key_at, params, steps, tails):
        self.tails = tails  # the dtypes whose shards' tails the runs may cross
        self.ids, self.ptrs = list(map(id, everything)), list(map(_DATA_PTR, params))
        self.held, self.spans, self.flat, self.key_at = held, spans, flat, key_at
        # What the step's gradients are checked against, in few lists (a
        # step's garbage collections grow with the objects made): each
        # gradient's dtype, its shard's; (head, member, bytes between) for
        # each member of a run after its first; (index, numel) of each run's
        # last; and per tensor the call gets, (the gradient's index, the
        # run's numel or None for a shard on its own).
        self.dtypes = list(map(_DTYPE, params))
        self.adjacent, self.sizes, self.grad_layout, start = [], [], [], 0
        for s, e, numel in spans:
            self.grad_layout += [(i, None) for i in range(start, s)]
            self.grad_layout.append((s, numel))
            offset = 0
            for i in range(s, e - 1):
                offset += params[i].numel() * params[i].element_size()
                self.adjacent.append((s, i + 1, offset))
            self.sizes.append((e - 1, params[e - 1].numel()))
            start = e
        self.grad_layout += [(i, None) for i in range(start, len(params))]
        # Adam's step counts, moved into one buffer (``steps``): the call
        # gets the count of each tensor it is given (a run's first's); the
        # runs' later members' are counted up after it.
        self.steps = self.head_steps = self.rest = self.ones = None
        if steps is not None:
            self.steps = _gather_steps(steps)
            self.head_steps = [steps[i] for i, _ in self.grad_layout]
            self.rest = torch.tensor([member for _, member, _ in self.adjacent], dtype=torch.long)
            self.ones = torch.ones(len(self.adjacent), dtype=self.steps.dtype)

    def count_up(self) -> None:
        """After the call: the step counts it did not get count one up, as
        the per-parameter path counts each."""
        if self.steps is not None:
            self.steps.index_add_(0, self.rest, self.ones)


# Plans by the first state tensor of their group: they go with the state.
_PLANS = None


def _plans():
    global _PLANS
    if _PLANS is None:
        from torch.utils.weak import WeakIdKeyDictionary

        _PLANS = WeakIdKeyDictionary()
    return _PLANS


def _in_runs(local: dict, f: _Functional, tails: frozenset):
    """``local`` with each run of adjacent shards as one tensor in every
    per-parameter list, and the plan (whose ``count_up`` follows the call); None
    where no run applies (see [Note: adjacent shards stepped as one
    tensor]). ``tails``: the dtypes whose shards may end in a tail inside a run."""
    if local.get("capturable") or local.get("fused") or local.get("foreach"):
        return None  # (foreach None: torch's default, the single-tensor path on the CPU; checked below)
    params = local["params"]
    if params[0].device.type != "cpu" or torch.backends.cpu.get_cpu_capability() not in _RUN_CAPABILITIES:
        return None
    grad_name, state_names = f.per_param[1], [name for name in f.per_param[2:] if local[name]]
    if not state_names:
        return None
    plans = _plans()
    key = local[state_names[0]][0]
    steps = local.get("state_steps")
    planned = list(itertools.chain(params, *(local[name] for name in state_names), steps or ()))
    plan = plans.get(key)
    # The same tensors, the shards where they were (pydist re-points none
    # with set_, which keeps an id, but a user may; the state is ours).
    if (plan is None or plan.tails != tails or plan.ids != list(map(id, planned))
            or plan.ptrs != list(map(_DATA_PTR, params))):
        plan = _plan(params, [local[name] for name in state_names], steps, key, tails)
        plans[key] = plan
    if not plan.spans:
        return None
    if plan.steps is not None and not bool(plan.steps.eq(plan.steps[0]).all()):
        return None  # a run's shards at other steps (set by hand): each on its own
    grads = _flat_grads(local[grad_name], plan)
    if grads is None:
        return None
    arguments = dict(local)
    arguments.update(zip(["params"] + state_names, plan.flat))
    if plan.key_at is not None:
        arguments[state_names[0]] = first = list(plan.flat[1])
        first[plan.key_at] = key
    arguments[grad_name] = grads
    if plan.steps is not None:
        arguments["state_steps"] = plan.head_steps
    LOCAL_SHARD_RUNS[f.name + " over float32 tails" if plan.tails else f.name] += len(plan.spans)
    return arguments, plan


def _plan(params: list, states: list, steps: list | None, key: torch.Tensor, tails: frozenset) -> _Runs:
    """The runs of ``params`` (local shards) and the states moved to lie
    like them: see [Note: adjacent shards stepped as one tensor]."""
    n = len(params)
    if steps is not None and (len(steps) != n or {(s.dim(), s.dtype, s.device.type) for s in steps}
                              != {(0, steps[0].dtype, "cpu")}):
        return _Runs([], [], [], [], None, [], None, tails)  # step counts of other kinds: no runs
    # A shard can be in a run; a whole one (of whole blocks) can be followed in it.
    fits = [p.is_contiguous() and all(s[i].dtype == p.dtype and s[i].shape == p.shape and s[i].is_contiguous()
                                      for s in states) for i, p in enumerate(params)]
    whole = [f and ((p.numel() * p.element_size()) % _RUN_BYTES == 0 or p.dtype in tails)
             for f, p in zip(fits, params)]
    ptrs = [p.data_ptr() for p in params]
    spans, i = [], 0
    while i < n:
        end, size = i + 1, params[i].numel()
        while (whole[end - 1] and end < n and fits[end] and params[end].dtype == params[i].dtype
               and ptrs[end] == ptrs[end - 1] + params[end - 1].numel() * params[end - 1].element_size()
               and size + params[end].numel() < _RUN_MAX):
            size += params[end].numel()
            end += 1
        if end - i >= 2 and size and _one_buffer(params[i:end], size):
            spans.append((i, end, size))
        i = end
    for s, e, size in spans:
        numels = [p.numel() for p in params[s:e]]
        for state in states:
            _gather_state(state[s:e], numels, size)
    # The lists with the runs made flat; the tensor the plan hangs on left
    # out (None), put back each step (a plan holding it would never go).
    flat = [_with_runs(tensors, spans) for tensors in [params] + states]
    key_at = next((i for i, t in enumerate(flat[1]) if t is key), None)
    if key_at is not None:
        flat[1][key_at] = None
    everything = [t for tensors in [params] + states + ([steps] if steps is not None else []) for t in tensors]
    held = [t for t in everything if t is not key]
    return _Runs(everything, held, spans, flat, key_at, params, steps, tails)


def _one_buffer(tensors: list, total: int) -> bool:
    """Whether ``tensors``, adjacent in memory, are ``total`` elements of the
    first one's storage (which ``_flat`` needs: ``set_`` would grow a
    storage too small rather than refuse)."""
    first, last = tensors[0], tensors[-1]
    storage = first.untyped_storage()
    return (last.untyped_storage().data_ptr() == storage.data_ptr()
            and (first.storage_offset() + total) * first.element_size() <= storage.nbytes())


def _gather_state(tensors: list, numels: list, total: int) -> None:
    """Moves a run's state tensors into one buffer, in order, unless they
    lie so already; each keeps its object and values (``set_``)."""
    first = tensors[0]
    offsets = list(itertools.accumulate(numels[:-1], initial=0))
    if (all(t.data_ptr() == first.data_ptr() + offset * first.element_size() for t, offset in zip(tensors, offsets))
            and _one_buffer(tensors, total)):
        return
    buffer = torch.empty(total, dtype=first.dtype, device=first.device)
    for t, numel, offset in zip(tensors, numels, offsets):
        buffer[offset:offset + numel].copy_(t.reshape(-1))
        with torch.no_grad():
            t.set_(buffer.untyped_storage(), offset, t.shape, t.stride())


def _gather_steps(steps: list) -> torch.Tensor:
    """Moves the step counts (0-dim tensors of one dtype) into one buffer,
    element i step i's, each keeping its object and value (``set_``); the
    buffer."""
    buffer = torch.stack([s.detach() for s in steps])
    with torch.no_grad():
        for i, s in enumerate(steps):
            s.set_(buffer.untyped_storage(), i, (), ())
    return buffer


def _flat(first: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D tensor over ``numel`` elements of ``first``'s storage from
    ``first`` on (bounds checked against the storage), not a view of
    ``first`` (the plan must not hold the tensor it hangs on)."""
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (numel,))


def _with_runs(tensors: list, spans: list) -> list:
    out, start = [], 0
    for s, e, numel in spans:
        out += tensors[start:s]
        out.append(_flat(tensors[s], numel))
        start = e
    return out + tensors[start:]


def _flat_grads(grads: list, plan: _Runs):
    """The step's gradients with each run as one tensor, or None where a
    run's gradients do not lie like its shards."""
    if not all(map(torch.Tensor.is_contiguous, grads)) or list(map(_DTYPE, grads)) != plan.dtypes:
        return None
    ptrs = list(map(_DATA_PTR, grads))
    if not (all(ptrs[member] - ptrs[head] == offset for head, member, offset in plan.adjacent)
            and all(grads[i].numel() == numel for i, numel in plan.sizes)):
        return None
    try:  # as_strided checks the storage's bounds
        return [grads[i] if numel is None else grads[i].as_strided((numel,), (1,)) for i, numel in plan.grad_layout]
    except RuntimeError:  # beyond its storage: not one buffer
        return None


# See [Note: torch's foreach ops in place of its per-parameter loop].
_FOREACH_ELEMENTS = 1 << 20
# What the checks found, by configuration (``_config``) and dtypes: whether
# torch's two paths step alike; whether a shard's tail steps as the rest.
_FOREACH_ALIKE: dict = {}
_TAILS_ALIKE: dict = {}
# The tensors the tail check cuts its buffer into: every length under a
# float32 block (all tail), blocks with tails, whole blocks; under _RUN_MAX.
_TAIL_PIECES = (*range(1, 33), *range(33, 64, 3), 64, 300) * 3


def _config(f: _Functional, arguments: dict):
    """What chooses the ops a call runs (the functional, its flags, which of
    weight decay or momentum are on), or None where a hyperparameter is not
    a Python number (a Tensor lr: the multi-tensor path refuses it)."""
    if not all(type(arguments[name]) in (float, int) for name in f.scalars):
        return None
    return (f.name, tuple(bool(arguments.get(name)) for name in f.flags),
            tuple(arguments[name] == 0 for name in f.scalars))


def _foreach_alike(original, f: _Functional, arguments: dict, config, dtypes: frozenset) -> bool:
    """Whether this call (its parameters of ``dtypes``), which would take
    torch's single-tensor path on the CPU, can take its multi-tensor path
    instead (checked once per configuration and dtypes)."""
    if (config is None or arguments.get("foreach") is not None or arguments.get("fused") is not None
            or arguments.get("capturable") or arguments.get("differentiable")
            or arguments["params"][0].device.type != "cpu"):
        return False
    if list(map(_DTYPE, arguments[f.per_param[1]])) != list(map(_DTYPE, arguments["params"])):
        return False  # gradients of other dtypes: what each path does with them is not checked
    key = (config, dtypes)
    alike = _FOREACH_ALIKE.get(key)
    if alike is None:
        pieces, ordered = (1, 5, 37, 64, 300), sorted(dtypes, key=str)
        alike = _FOREACH_ALIKE[key] = _same(_synthetic_steps(original, f, arguments, ordered, pieces, False),
                                            _synthetic_steps(original, f, arguments, ordered, pieces, True))
    return alike


def _tails_alike(original, f: _Functional, arguments: dict, config, dtypes: frozenset) -> frozenset:
    """Of this call's parameters' ``dtypes``, those whose shards a run may go
    on past though they end in a tail: float32, where a check (once per
    configuration) found tensors cut into pieces of every tail length
    stepped bit for bit as the one uncut tensor (ATen's loops compute tails
    element by element; reduced precision dtypes round them differently:
    measured). See [Note: adjacent shards stepped as one tensor]."""
    if config is None or torch.float32 not in dtypes:
        return frozenset()
    alike = _TAILS_ALIKE.get(config)
    if alike is None:
        whole = (sum(_TAIL_PIECES),)
        alike = _TAILS_ALIKE[config] = _same(
            _synthetic_steps(original, f, arguments, (torch.float32,), whole, False)[:-1],  # (not the step counts:
            _synthetic_steps(original, f, arguments, (torch.float32,), _TAIL_PIECES, False)[:-1])  # one per piece)
    return frozenset((torch.float32,)) if alike else frozenset()


def _synthetic_steps(original, f: _Functional, arguments: dict, dtypes: tuple, pieces: tuple,
                     foreach: bool) -> list:
    """Three steps of ``original``, with ``arguments``' hyperparameters and
    ``foreach``, on random buffers (one per list the call has and dtype,
    ``sum(pieces)`` elements) cut into ``pieces``: the gradients after each
    step (neither path may change them), then every buffer, the step counts'
    last. The same values for the same dtypes and total."""
    g = torch.Generator().manual_seed(0)
    n = len(pieces)
    lists = {name: [] for name in f.lists}
    buffers, steps = [], []
    for dtype in dtypes:
        for name in f.lists:
            if name == "state_steps":
                counts = torch.zeros(n, dtype=arguments["state_steps"][0].dtype)
                lists[name] += list(counts.unbind())
                steps.append(counts)
            elif arguments[name]:  # (the lists the call has: max_exp_avg_sqs under amsgrad)
                buffer = torch.randn(sum(pieces), generator=g).to(dtype)
                if name.endswith("sqs"):
                    buffer.abs_()
                lists[name] += list(buffer.split(pieces))
                buffers.append((name, buffer))
    grads = [buffer for name, buffer in buffers if name == f.per_param[1]]
    seen = []
    for _ in range(3):
        for grad in grads:
            grad.copy_(torch.randn(grad.numel(), generator=g).to(grad.dtype))
        original(**{**arguments, **lists, "foreach": foreach})
        seen += [grad.clone() for grad in grads]
    return seen + [buffer for _, buffer in buffers] + [torch.cat(steps) if steps else torch.zeros(0)]


def _same(mine: list, theirs: list) -> bool:
    """Bit for bit."""
    return len(mine) == len(theirs) and all(
        a.shape == b.shape and a.dtype == b.dtype
        and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)) for a, b in zip(mine, theirs))


def _call_in_pieces(original, f: _Functional, arguments: dict) -> None:
    """``original`` on torch's multi-tensor path, the lists cut into pieces
    of at most ``_FOREACH_ELEMENTS`` elements (a tensor larger is a piece
    of its own)."""
    names = [name for name in f.lists if arguments.get(name)]
    params = arguments["params"]
    cuts, total = [0], 0
    for i, numel in enumerate(map(torch.Tensor.numel, params)):
        if total and total + numel > _FOREACH_ELEMENTS:
            cuts.append(i)
            total = 0
        total += numel
    cuts.append(len(params))
    for start, end in zip(cuts, cuts[1:]):
        piece = {name: arguments[name][start:end] for name in names}
        original(**{**arguments, **piece, "foreach": True})
