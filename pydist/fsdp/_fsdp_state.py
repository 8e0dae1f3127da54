"""The hooks one ``fully_shard`` call puts on its module, and what the root
does once per iteration.

[Note: the order of an iteration]
    root pre-forward     lazy init on the first call (the root opens the
                         transport all units share); last iteration's forward
                         order becomes this forward's gather plan
    unit pre-forward     unshard (with the units after it in the plan, one
                         collective) + wait; when it starts a batch, start the
                         next batch's all-gather; record the unit in the forward
                         order; start the all-gathers of set_modules_to_forward_prefetch;
                         join the previous unit's output hook, or wrap the inputs
                         that need grad, so the unit learns when its backward is
                         done (see [Note: how a unit learns its backward is done])
    unit post-forward    reshard (reshard_after_forward; never the root, whose
                         parameters are needed again at once); hook the outputs;
                         the root reshards what was gathered ahead and not used
    unit pre-backward    (first gradient reaching an output) the first one:
                         queue the root's final callback, plan the backward
                         (gathers and reduce batches, from this forward's order);
                         unshard (with the units after it in that plan) + wait;
                         when it starts a batch, start the next batch's all-gather
                         (and set_modules_to_backward_prefetch's) so it runs
                         while this unit computes
    unit post-backward   (gradients reach the unit's inputs) pack its gradients;
                         start the reduce-scatter (its batch's, once the batch's
                         last unit is packed); reshard
    final callback       post-backward for the units autograd never told (the
                         root, a first unit whose inputs need no grad), in
                         reverse forward order; launch what batches remain; sum
                         over the ranks which parameters had a gradient ([Note:
                         parameters without a gradient]); then
                         each batch waits for its reduce-scatter once and hands
                         its units' shards their .grad, and every unit reduced
                         alone does the same, so the optimizer sees finished
                         gradients when backward() returns
See [Note: gather and reduce plans] in _fsdp_schedule.py for the batches.
Every rank goes through the same steps in the same order for the same
model, so their collectives match (see [Note: which transport carries a
sharded unit]).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from pydist import _C
from pydist.fsdp import _fsdp_collectives as collectives
from pydist.fsdp._fsdp_common import Materializing, Phase, ShardedState, TrainingState, state_of
from pydist.fsdp._fsdp_param_group import FSDPParamGroup
from pydist.fsdp._fsdp_schedule import Schedule, default_batch_bytes

__all__ = ["FSDPState", "state_of"]


_requires_grad_of = operator.attrgetter("requires_grad")
_get_item = dict.get
_dtype_of = operator.attrgetter("dtype")
_local_of = operator.attrgetter("_local_tensor")

# The states the hooks' fast paths test by identity.
_IDLE, _FORWARD = TrainingState.IDLE, TrainingState.FORWARD
_PRE_BACKWARD, _POST_BACKWARD = TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD
_SHARDED = ShardedState.SHARDED


def _wrapping_difference(wrappings: list, root_class: str) -> str:
    """The error for ranks whose units differ (``wrappings[r]``: rank r's
    ``FSDPState._wrapping()``). See [Note: every rank wraps the same model]."""
    groups: dict[str, list[int]] = {}
    for rank, wrapping in enumerate(wrappings):
        groups.setdefault(json.dumps(wrapping), []).append(rank)
    (first, ranks), *others = [(json.loads(k), v) for k, v in groups.items()]

    def unit(place: str) -> str:
        return repr(place) if place else f"the root ({root_class})"

    lines = []
    for other, other_ranks in others:
        places, other_places = [u[0] for u in first], [u[0] for u in other]
        only = [p for p in places if p not in other_places]
        other_only = [p for p in other_places if p not in places]
        if only or other_only:
            lines.append(f"ranks {ranks} shard {len(places)} units, ranks {other_ranks} {len(other_places)}"
                         + (f"; units {', '.join(map(unit, only))} only on ranks {ranks}" if only else "")
                         + (f"; units {', '.join(map(unit, other_only))} only on ranks {other_ranks}"
                            if other_only else ""))
            continue
        if places != other_places:
            lines.append(f"ranks {ranks} and {other_ranks} shard the same units in another order: "
                         f"{', '.join(map(unit, places))} / {', '.join(map(unit, other_places))}")
            continue
        for a, b in zip(first, other):
            if a != b:
                params_a, params_b = {p[0]: p[1:] for p in a[2]}, {p[0]: p[1:] for p in b[2]}
                name = next((n for n in list(params_a) + list(params_b) if params_a.get(n) != params_b.get(n)), None)
                what = (f"parameter {name!r}: {_param_text(params_a.get(name))} on ranks {ranks}, "
                        f"{_param_text(params_b.get(name))} on ranks {other_ranks}") if name is not None else (
                        f"its parameters in another order on ranks {ranks} and {other_ranks}")
                lines.append(f"unit {unit(a[0])} holds {what}")
                break
    return ("pydist FSDP: the ranks sharded different units (fully_shard on other submodules, or a model with "
            "other parameters), so their units' collectives would not pair up: " + "; ".join(lines) + ". Build "
            "the same model and call fully_shard on the same submodules on every rank (a wrapping policy must not "
            "depend on the rank). See [Note: every rank wraps the same model] in pydist/fsdp/_fsdp_state.py")


def _param_text(entry) -> str:
    return "absent" if entry is None else f"shape {tuple(entry[0])} {entry[1]}"


class FSDPState:
    """One fully_shard'ed module: its unit (None when it manages no
    parameters) and its hooks. The root's state also drives the iteration."""

    def __init__(self, module: nn.Module, param_group: FSDPParamGroup | None, group, shm: bool | None, mp_policy=None,
                 replicate_group=None):
        self.module = module
        self.param_group = param_group
        self.group = group  # the process group the unit is sharded over
        # HSDP: the group its reduced shards are all-reduced over (None: not
        # HSDP). See [Note: HSDP].
        self.replicate_group = replicate_group
        self.shm = shm  # the root's choice of transport: see open_transport
        self.mp_policy = mp_policy  # torch's MixedPrecisionPolicy: input and output casts here, the rest in the unit
        # Decided at the first forward: the outermost state that runs forward
        # first is the root, and every state under it points at it.
        self.root: FSDPState | None = None
        self.is_root = False
        # set_modules_to_forward_prefetch / _backward_prefetch; None: implicit
        # (backward: the unit before this one in forward order; forward: none).
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] | None = None
        # Whether the hooks may take their fast path: see [Note: the hooks'
        # fast path]. Set by the root at each of its pre-forwards, with
        # whether the unit may be in a run (see [Note: runs of units]).
        self.plain = False
        self.run_ok = False
        # This forward gave the unit a post-backward point (it joined the
        # previous unit's output hook, or its inputs took the Function): a
        # run may start with it. See [Note: runs of units].
        self.signalled = False
        # Root only: the states under it, in module order; the units in the
        # order their forward ran this iteration; whether the final callback
        # is queued for this backward.
        self.all_states: list[FSDPState] = []
        self.forward_order: list[FSDPState] = []
        self.iteration = 0  # root forwards so far
        # Units: the root iteration whose forward ran this unit with grad
        # enabled (a second run in the same one is refused).
        self.forward_iteration = -1
        self._recomputing = False  # this forward is a recompute in backward: see _is_recompute
        self.final_callback_queued = False
        # Root only: its pre-forward ran and its post-forward has not yet (a
        # forward that raised leaves it set). See [Note: an iteration that raised].
        self._forward_open = False
        self.backward_end_ns = -1  # when autograd finished this iteration's backward (the final callback began)
        # Root: who is handed each iteration's records as its backward ends
        # (the overlap lab: see subscribe), and what only they need stamped.
        self.subscribers: list = []
        self.forward_start_ns = self.backward_start_ns = -1
        self.record_indices: dict = {}  # see _records.iteration_record
        # Root only, during its forward: the tensor a unit's post-forward hooked
        # last, and its hook (see [Note: how a unit learns its backward is
        # done]); dropped at the root's post-forward, so no tensor outlives it here.
        self._last_hooked: torch.Tensor | None = None
        self._last_hook: _OutputHook | None = None
        self._last_gate = None  # the _C.OutputGate _last_hook is called through
        # How many unsharded bytes the root's schedule sends as one
        # collective (set_collective_batch_bytes; read on the root only);
        # None: default_batch_bytes of the units' sharding ranks.
        self.batch_bytes: int | None = None
        # Root only, from its lazy init: its plans, reduce batches and unshard
        # pool (see [Note: gather and reduce plans] in _fsdp_schedule.py).
        self.schedule: Schedule | None = None
        # Root only: the states whose post-backward came from the final
        # callback last iteration (ids), which the reduce plan leaves alone.
        self.late_posters: set[int] = set()
        # Root only: the order check_forward_order last sent for a whole forward, and its row.
        self._checked_order: list[FSDPState] | None = None
        self._checked_row: torch.Tensor | None = None
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=False)

    # --- root -----------------------------------------------------------------

    def _lazy_init(self) -> None:
        """The root's one-time setup, with collectives (the transport, the
        checks): run eagerly, also where torch.compile calls the root first.
        Dynamo is touched only where the process has imported it already: a
        decorator at class definition would import it with pydist (a second
        per process, and it changes what is alive when the process exits)."""
        if "torch._dynamo" in sys.modules:
            torch._dynamo.disable(self._init_root)()
        else:
            self._init_root()

    def _init_root(self) -> None:
        from pydist.fsdp._state_dict import install_torch_checkpoint_api

        install_torch_checkpoint_api()  # torch's checkpoint helpers imported after fully_shard
        named = [(name, s) for name, m in self.module.named_modules() if (s := state_of(m)) is not None]
        # Checked before any state changes, so that a refused first forward
        # leaves the model as it was: the user fixes the cause and runs again.
        for name, state in named:
            if state is not self and state.root is not None:
                raise RuntimeError(
                    f"pydist.fully_shard: {name!r} ({type(state.module).__name__}) ran forward (or unshard()) on its "
                    f"own before its root {type(self.module).__name__}; run the root's forward first (FSDP2's rule too)"
                )
            if state.group is not self.group or state.replicate_group is not self.replicate_group:
                raise NotImplementedError(
                    "pydist.fully_shard: every unit under one root must shard over the same group (mesh)"
                )
            if state is not self and state.batch_bytes is not None:
                state.refuse_batch_bytes_off_root(self, name)
            if state.param_group is not None and state.param_group.materializing is Materializing.META:
                state.param_group.shard_materialized()  # raises: to_empty first
        for _, state in named:  # see [Note: a unit built on the meta device] in _fsdp_param_group.py
            if state.param_group is not None:
                state.param_group.shard_materialized()
        self.is_root = True
        self.all_states = [s for _, s in named]
        self._unit_names = [name for name, _ in named]  # each state's place under the root: see _check_wrapped_alike
        self._state_index = {id(s): i for i, s in enumerate(self.all_states)}  # what check_forward_order sends
        units = {name: s.param_group for name, s in named if s.param_group is not None and s is not self}
        # Per unit, the nearest unit around it, the root's aside: it computes around it.
        enclosing = {}
        for name, state in named:
            state.root = self
            if state.param_group is not None and state is not self:
                parts = name.split(".")
                enclosing[id(state)] = next(
                    (pg for i in range(len(parts) - 1, 0, -1) if (pg := units.get(".".join(parts[:i]))) is not None),
                    None)
        # One tensor of each dtype the units communicate in, so that a dtype
        # the shared-memory transport does not carry falls back to the group.
        devices = {s.param_group.device for s in self.all_states if s.param_group is not None}
        if len(devices) > 1:
            raise NotImplementedError(
                f"pydist.fully_shard: the units under root {type(self.module).__name__} are on "
                f"{sorted(map(str, devices))}; every unit of one root must be on one device")
        # Where the units live: the pool's memory, and the small collectives'
        # values (the group may carry only that device's tensors: NCCL).
        self.device = devices.pop() if devices else torch.device("cpu")
        samples = [torch.empty(0, dtype=dt, device=self.device) for s in self.all_states
                   if (pg := s.param_group) is not None for dt in {pg.dtype, pg.compute_dtype, pg.reduce_dtype}]
        from pydist.overlap import hooks as overlap_hooks  # the marked hook point (imported once, here)

        transport = collectives.open_transport(self.group, samples, self.shm)
        # [overlap hook] PYDIST_SIM_NET puts a simulated link in front
        transport = overlap_hooks.sharded_transport(transport)
        # See [Note: HSDP]: a group of one replica has nothing to all-reduce.
        replicate = None
        if self.replicate_group is not None and dist.get_world_size(self.replicate_group) > 1:
            replicate = overlap_hooks.sharded_transport(
                collectives.open_transport(self.replicate_group, samples, self.shm))
        self.schedule = Schedule(self.device)
        for name, state in named:
            if state.param_group is not None:  # records and errors name units by their place
                state.param_group.join_root(name, enclosing.get(id(state)), transport, replicate, self.schedule,
                                            state is self)
        self.transport = transport
        self.replicate_transport = replicate
        self._built_checked = False  # see [Note: every rank builds the same model]
        # What the optimizer steps on, and the requires_grad each unit has taken up.
        self._units = [s.param_group for s in self.all_states if s.param_group is not None]
        # The batch its plans use unless set_collective_batch_bytes says otherwise.
        self._default_batch_bytes = default_batch_bytes(max((pg.shard_world_size for pg in self._units), default=1))
        # (state, unit, whether its hooks never take the fast path: the
        # root's, or a MixedPrecisionPolicy that casts inputs or outputs) per
        # unit: what the root's pre-forward resets and decides the fast paths
        # from. States without a unit are never plain.
        self._unit_states = [(s, s.param_group, s is self or (s.mp_policy is not None and (
            s.mp_policy.param_dtype is not None or s.mp_policy.output_dtype is not None)))
                             for s in self.all_states if s.param_group is not None]
        self._take_up_params()
        self._units_changed = False  # see units_changed
        overlap_hooks.sharded_root(self)  # [overlap hook] PYDIST_TRACE subscribes

    def _take_up_params(self) -> None:
        """Root: what the optimizer steps on (each unit's sharded parameters),
        where each is registered first, and the requires_grad each unit has
        taken up: what the root's pre-forward checks against."""
        fsdp_params = [fp for pg in self._units for fp in pg.fsdp_params]
        self._sharded_params = [fp.sharded_param for fp in fsdp_params]
        self._param_dicts = [fp.module_infos[0].module._parameters for fp in fsdp_params]
        self._param_names = [fp.module_infos[0].name for fp in fsdp_params]
        self._requires_grad = [fp.requires_grad for fp in fsdp_params]
        # What the pre-forward finds a cast by (see [Note: a parameter
        # replaced inside a unit]): a DTensor parameter's local tensor (a cast
        # swaps it), a plain one's dtype.
        self._dtensor_params = [fp.sharded_param for fp in fsdp_params if fp.spec is not None]
        self._dtensor_locals = list(map(_local_of, self._dtensor_params))
        self._plain_params = [fp.sharded_param for fp in fsdp_params if fp.spec is None]
        self._plain_dtypes = list(map(_dtype_of, self._plain_params))

    # [Note: a parameter replaced inside a unit]
    # A unit's own ``_apply`` (``model.to(dtype)``, ``.double()`` on the unit's
    # module or above) reaches the unit (``FSDPParamGroup.after_apply``); one on
    # a submodule inside it (``block.attn.to(torch.bfloat16)``, where ``block``
    # is the unit), or an assignment of a new parameter there, does not, and
    # the next unshard would register the unit's own parameters over new
    # ones, or gather its shard for parameters whose local tensors
    # swap_tensors replaced (what _apply does to DTensor parameters): the
    # cast lost, and the optimizer stepping tensors no forward uses (torch's
    # FSDP2 loses it so). The root's pre-forward compares what each unit's
    # modules hold with its sharded parameters, and their local tensors
    # (DTensor) or dtypes (plain) with what it gave them, in C-level passes
    # (0.16 ms a step on 1,600 parameters), and has a unit that finds a
    # difference take them up as after a cast of its module, or refuse.
    def _take_up_replaced(self) -> None:
        changed = False
        for pg in self._units:
            if pg.sharded_state is ShardedState.SHARDED and pg.params_replaced():
                changed |= pg.after_apply("a cast or assignment on a submodule of a fully_shard'ed module "
                                          "(e.g. submodule.to(dtype))")
        if changed:
            self._take_up_changes()
        else:  # the units' own changes (a meta unit sharded at its first use): the next check passes
            self._take_up_params()

    def units_changed(self) -> None:
        """Root: a unit's parameter objects or dtype changed between
        iterations (``Module._apply`` cast it, ``load_state_dict(assign=True)``).
        Taken up at the next pre-forward, once however many units report it
        (a cast of the whole model reports every unit)."""
        self._units_changed = True

    def _take_up_changes(self) -> None:
        """Root: after ``units_changed``, what the root took from the units
        goes, and the plans, cut by dtype and bytes, are made afresh from this
        forward, as at the first."""
        self._units_changed = False
        self.schedule.forget_plans(self._units)
        self.forward_order = []
        self._take_up_params()

    def subscribe(self, subscriber) -> None:
        """Root: ``subscriber(record)`` is called at the end of every
        backward with that iteration's collectives, a
        ``pydist.ddp.records.IterationRecord`` (see [Note: one record schema]
        there). The overlap lab subscribes through pydist/overlap/hooks.py."""
        self.subscribers.append(subscriber)

    # [Note: every rank wraps the same model]
    # Every rank must call fully_shard on the same submodules, over the same
    # parameters: the units' collectives pair up across ranks by their order
    # alone. A wrapping that depends on the rank (a policy reading rank-local
    # state, a rank that shards only some blocks) would pair one rank's unit
    # with another's and fail, or train, on collectives of other sizes. So
    # the root's first forward, before comparing values (see [Note: every
    # rank builds the same model]), gathers a sha256 of each rank's units:
    # their places under the root and their parameters' names, shapes and
    # dtypes (one all-gather of 3 float64 values); where they differ, it
    # gathers every rank's list and raises the same message on every rank,
    # naming the units (or parameters) that differ and the ranks that have
    # them.
    def _wrapping(self) -> list:
        """This rank's units as [place, module class, [[name, shape, dtype], ...]]."""
        return [[name, type(s.module).__name__,
                 [[fp.fqn, list(fp.shape), str(s.param_group.dtype)] for fp in s.param_group.fsdp_params]
                 if s.param_group is not None else []]
                for name, s in zip(self._unit_names, self.all_states)]

    def _check_wrapped_alike(self) -> None:
        text = json.dumps(self._wrapping()).encode()
        digest = hashlib.sha256(text).digest()
        head = torch.tensor([len(text), int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")],
                            dtype=torch.float64)
        table = self._gather_small(head)  # (ranks, 3)
        if bool((table == table[0]).all()):
            return
        lengths = [int(n) for n in table[:, 0].tolist()]
        mine = torch.zeros(max(lengths), dtype=torch.float64)
        mine[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.float64)
        rows = self._gather_small(mine)
        wrappings = [json.loads(bytes(int(b) for b in row[:n].tolist())) for row, n in zip(rows, lengths)]
        raise RuntimeError(_wrapping_difference(wrappings, type(self.module).__name__))

    # [Note: every rank builds the same model]
    # fully_shard keeps each rank's shard of the values that rank built: no
    # broadcast, as in torch's FSDP2 (and FSDP1 without sync_module_states).
    # A DDP script seeds each rank differently before building the model
    # (nanoGPT: torch.manual_seed(1337 + rank)), which DDP's broadcast of
    # rank 0's values makes harmless; sharded, the model trained would be a
    # mix of the ranks' models (NO_SHARD: a different model on each rank),
    # silently, under torch's wrappers too. So each unit notes, when laid out
    # (_shard_of), a digest of every parameter's values, their places and
    # its shape (_digests: integer sums of weighted bit patterns, exact
    # whatever the threads; the same values transposed on one rank differ),
    # and the root's first forward, once the ranks' units agree (see
    # [Note: every rank wraps the same model]), gathers them (one small
    # all-gather) and raises on every rank, naming
    # the first parameter that differs and which ranks agree, before its
    # forward starts; it checks again at the next forward until it passes. A
    # state dict loaded into a unit since (a checkpoint, the usual cure;
    # state dict calls may come before the first forward, which is why the
    # check waits for it) replaces what was built, so that unit is not
    # checked; a unit some rank loaded is skipped on every rank.
    def _check_built_alike(self) -> None:
        units = [s.param_group for s in self.all_states if s.param_group is not None]
        rows = []
        for pg in units:
            known = pg.built_digests is not None
            digests = pg.built_digests if known else torch.zeros(len(pg.fsdp_params), dtype=torch.int64)
            # one float64 per value: the flag, then each digest split in two 32-bit halves (exact in float64)
            rows += [torch.tensor([float(known)], dtype=torch.float64),
                     (digests >> 32).to(torch.float64), (digests & 0xFFFFFFFF).to(torch.float64)]
        if not rows:
            return
        table = self._gather_small(torch.cat(rows))  # (ranks, values)
        start = 0
        for pg in units:
            n = len(pg.fsdp_params)
            flags = table[:, start]
            halves = table[:, start + 1:start + 1 + 2 * n]
            start += 1 + 2 * n
            if not bool((flags == 1).all()):
                continue
            columns = (halves != halves[0]).any(dim=0)  # the hi halves' columns, then the lo halves'
            differ = columns[:n] | columns[n:]  # per parameter
            if bool(differ.any()):
                i = int(differ.nonzero()[0])  # the first that differs
                fp = pg.fsdp_params[i]
                groups: dict = {}
                for rank, (hi, lo) in enumerate(halves[:, [i, n + i]].tolist()):
                    groups.setdefault((hi, lo), []).append(rank)
                where = f"unit {pg.label!r}" if pg.label else f"the root ({type(self.module).__name__})"
                raise RuntimeError(
                    f"pydist FSDP: the ranks built different values for parameter {fp.fqn!r} of {where} before "
                    f"sharding (groups of ranks that agree: {' / '.join(str(g) for g in groups.values())}). "
                    "Each rank keeps its shard of what it built, so the model would be a mix of the ranks' "
                    "models (torch's FSDP2 trains such a mix silently). Seed the same on every rank before "
                    "building the model (a DDP script's torch.manual_seed(seed + rank): seed per rank after it), "
                    "pass sync_module_states=True to FullyShardedDataParallel, or load a checkpoint after "
                    "fully_shard. See [Note: every rank builds the same model] in pydist/fsdp/_fsdp_state.py"
                )

    def _batch_bytes(self) -> int:
        """Root: the unsharded bytes its plans put in one collective."""
        return self._default_batch_bytes if self.batch_bytes is None else self.batch_bytes

    def refuse_batch_bytes_off_root(self, root: FSDPState, name: str) -> None:
        """``name``: this module's path under ``root``'s module."""
        raise ValueError(
            f"pydist.fully_shard: set_collective_batch_bytes was called on {name!r} "
            f"({type(self.module).__name__}), which is not a root: its root is the "
            f"{type(root.module).__name__} whose forward runs it, and the root plans every unit's collectives. "
            f"Call it on the root, and set {name!r} back to the default (None) or never call it there"
        )

    # [Note: an iteration that raised]
    # A training loop may catch an exception from forward or backward (a bad
    # batch, out of memory, a custom Function's backward) and go on with the
    # next batch. The iteration then stopped in the middle: units left in
    # FORWARD or PRE_BACKWARD, unsharded (in pool slots), gradients packed
    # into batches or reduce-scatters in flight, the final callback never
    # run (autograd runs queued callbacks only when backward succeeds). The
    # root notices at its next pre-forward, with one check (its forward is
    # still open, or its final callback still queued, and autograd is not
    # running: a recompute in backward is neither), and puts every unit back
    # as between iterations: it waits for every collective in flight (every
    # rank issued them, as every rank raised at the same place; one that
    # raised alone has diverged anyway), drops the gradients not yet reduced
    # (the failed backward's, and those accumulated without sync before it:
    # they cannot be told apart), reshards, frees the pool and plans the next
    # forward as a first one. The shards' .grad from earlier backwards are
    # left to the user's zero_grad. So the loop trains on as if the failed
    # iteration had not run. torch's FSDP2 does the same after a forward that
    # raised (bitwise), unless the optimizer steps before the next forward
    # (a micro-batch raised after another trained): it computes that forward
    # with the parameters the failed one gathered, before the step. After a
    # backward that raised, it takes the next forward of a unit left in
    # PRE_BACKWARD for a recompute and trains on differently. The hooks' fast
    # path is untouched: the check is on the root's own pre-forward.
    # ``load_state_dict`` between a failed iteration and the next forward
    # recovers the same way first (see _state_dict.py).

    def iteration_failed(self) -> bool:
        """Root: whether its last iteration raised before it finished.
        See [Note: an iteration that raised]."""
        return (self._forward_open or self.final_callback_queued) and torch._C._current_graph_task_id() == -1

    def recover_from_failed_iteration(self) -> None:
        """Root: puts every unit back as between iterations. See [Note: an
        iteration that raised]."""
        schedule = self.schedule
        schedule.abandon_iteration()
        for state in self.all_states:
            state._recomputing = False
            if state.param_group is not None:
                state.param_group.abandon_iteration()
        self._last_hooked = self._last_hook = self._last_gate = None
        self.forward_order = []  # the next forward gathers as a first one
        self.final_callback_queued = False
        self._forward_open = False
        schedule.pool.release()

    def _root_pre_forward(self) -> None:
        if not self._built_checked:
            self._check_wrapped_alike()  # raises with the model as it was
            self._check_built_alike()
            self._built_checked = True
        self._forward_open = True
        self.iteration += 1
        if self.subscribers:
            self.forward_start_ns, self.backward_start_ns = time.monotonic_ns(), -1
        if self._units_changed:
            self._take_up_changes()
        if (any(map(operator.is_not, map(_get_item, self._param_dicts, self._param_names), self._sharded_params))
                or any(map(operator.is_not, map(_local_of, self._dtensor_params), self._dtensor_locals))
                or list(map(_dtype_of, self._plain_params)) != self._plain_dtypes):
            self._take_up_replaced()  # (or a unit left unsharded since the last iteration)
        self.schedule.plan_forward(self.forward_order, self._batch_bytes(), self._units)
        self.forward_order = []
        self.final_callback_queued = False
        self.backward_end_ns = -1
        # requires_grad switched since the last forward: on model.parameters()
        # (one pass over them here), or on the unsharded parameters of a unit
        # left unsharded, which its module held. See sync_requires_grad.
        changed = list(map(_requires_grad_of, self._sharded_params)) != self._requires_grad
        synced = False
        for state, pg, never_plain in self._unit_states:
            if changed or (pg.sharded_state is not _SHARDED and pg.sharded):
                pg.sync_requires_grad()
                synced = True
            pg.begin_iteration()
            state.plain = plain = not never_plain and not state.forward_prefetch
            state.run_ok = plain and pg.sharded and state.backward_prefetch is None
        if synced:
            self._requires_grad = list(map(_requires_grad_of, self._sharded_params))

    def _root_post_backward_final_callback(self) -> None:
        """See [Note: the order of an iteration]."""
        self.backward_end_ns = time.monotonic_ns()  # autograd is done; what follows is exposed
        self.late_posters = late = set()
        for state in reversed(self.forward_order):
            # A unit used in forward whose backward autograd never reported
            # (its inputs need no grad) still reduces, zeros where no
            # gradient came, so every rank issues the same collectives.
            pg = state.param_group
            if pg.training_state is not _POST_BACKWARD:
                late.add(id(state))
                pg.post_backward()
        # A unit this forward skipped that holds gradients of earlier
        # backwards under set_requires_gradient_sync(False) reduces them
        # now, in this synced backward, as torch's FSDP2 does.
        ran = set(map(id, self.forward_order))
        for state in self.all_states:
            pg = state.param_group
            if pg is not None and id(state) not in ran and pg.requires_gradient_sync and pg.has_pending_grads():
                pg.post_backward()
        batches = self.schedule.take_grad_batches()
        for batch in batches:
            batch.launch()  # those some member never reached (a unit skipped this backward)
        if self.replicate_transport is not None:  # see [Note: HSDP]: every all-reduce starts before any is waited
            for batch in batches:
                batch.reduce_replicas()
            for pg in self._units:
                pg.reduce_replicas()
        all_trainable = self._agree_on_grads()
        for batch in batches:
            batch.finalize(all_trainable)  # one wait per batch; its members' shards get their .grad
        for pg in self._units:
            pg.finalize_backward()
        self.schedule.end_backward()
        self.schedule.pool.release()  # see [Note: the unsharded buffer's memory]
        self.final_callback_queued = False
        if self.subscribers and self.forward_start_ns >= 0:
            from pydist.fsdp._records import iteration_record

            record = iteration_record(self, time.monotonic_ns())
            for subscriber in self.subscribers:
                subscriber(record)

    def _agree_on_grads(self) -> bool:
        """Sums the units' had_grad flags over the ranks, so that every rank
        hands out the same parameters' .grad: see [Note: parameters without
        a gradient] in _fsdp_param_group.py. Returns whether every unit that
        reduced hands out exactly its trainable shards."""
        units = [pg for pg in self._units if pg.had_grad is not None]
        if not units:
            return False
        flags = torch.tensor(list(itertools.chain.from_iterable(pg.had_grad for pg in units)), dtype=torch.float32)
        counts = collectives.all_reduce_sum(self.transport, flags, self.device)
        if self.replicate_transport is not None:  # every replica hands out the same .grads
            counts = collectives.all_reduce_sum(self.replicate_transport, counts, self.device)
        counts = counts.tolist()
        if all(counts):  # every parameter had a gradient on some rank: the common case, in one pass
            all_trainable = True
            for pg in units:
                all_trainable &= pg.take_grads_everywhere()
            return all_trainable
        start = 0
        for pg in units:
            end = start + len(pg.fsdp_params)
            pg.take_grads_anywhere(counts[start:end])
            start = end
        return False

    # [Note: ranks that run different units]
    # Every rank must run the same units in the same order: their collectives
    # are paired by order alone. A rank that skips a unit the others run (a
    # mixture-of-experts layer routing no token to an expert on one rank, a
    # branch taken on some ranks) would pair one unit's all-gather with
    # another's: on shared memory the transport fails every rank at the first
    # pair that differs in size; on gloo, a size mismatch aborts the process
    # from gloo's own thread (torch's FSDP2 aborts the same way), and one of
    # equal size pairs silently. So the root checks, with one small all-gather
    # (the units run, as indices into all_states), that every rank ran the same
    # units in the same order, and raises on every rank naming the units that
    # differ, before any collective of backward:
    #     at its post-forward, each forward;
    #     before a unit gathers outside a plan (the first forward, or a unit
    #     not in last iteration's order), each such unit.
    # A forward plan (see [Note: gather and reduce plans] in _fsdp_schedule.py) issues the same
    # batches on every rank whichever of its units a rank skips: a unit
    # needing its batch past the last one issued first issues the batches
    # before it (GatherPlan.need), and every check first issues what is left
    # of the plan (GatherPlan.issue_rest). So every rank reaches a check
    # having issued the same collectives, and checks pair with checks. Units
    # gathered for a forward that did not come are resharded at the root's
    # post-forward, as before. Not covered: set_modules_to_forward_prefetch
    # targets (gathered when their source runs), and backwards whose graph
    # differs across ranks for the same units (the order is checked, not the
    # graph). After the error, the root's next forward recovers (see [Note:
    # an iteration that raised]) and checks each unit again.

    def check_forward_order(self, gathering: FSDPState | None) -> None:
        """Root: raises on every rank if the ranks ran different units in this
        forward so far (``gathering``: the unit about to gather outside a plan;
        None: the forward is done). See [Note: ranks that run different units]."""
        if self.schedule.forward_plan is not None:
            self.schedule.forward_plan.issue_rest()
        if gathering is None and self._checked_order == self.forward_order:
            row = self._checked_row  # a whole forward, the same units as last time: the same row
        else:
            row = self._order_row(gathering)
            if gathering is None:
                self._checked_order, self._checked_row = list(self.forward_order), row
        row[1] = self.iteration
        rows = self._gather_small(row).tolist()
        # The forward's number only explains a mismatch: ranks that run the
        # same units in the same order pair their collectives whatever it is.
        if all(r[:1] + r[2:] == rows[0][:1] + rows[0][2:] for r in rows):
            return
        raise RuntimeError(self._describe_orders(rows))

    def _gather_small(self, value: torch.Tensor) -> torch.Tensor:
        """Root: every rank's ``value`` (small, 1-D) stacked: the rows of the
        shard group, and under HSDP those of every replica, replica by
        replica (row ``replica * shard_size + shard_rank``: the global rank
        on a ("replicate", "shard") mesh laid out as init_device_mesh lays it)."""
        table = collectives.all_gather_small(self.transport, value, self.device)
        if self.replicate_transport is not None:
            table = collectives.all_gather_small(self.replicate_transport, table.reshape(-1), self.device)
            table = table.reshape(-1, value.numel())
        return table

    def _order_row(self, gathering: FSDPState | None) -> torch.Tensor:
        """What check_forward_order sends: [done, the root's forward number
        (set at each send), length, digest, the units run (indices into
        all_states), -1 padding]."""
        index = self._state_index
        order = [index[id(s)] for s in self.forward_order]
        if gathering is not None:
            order.append(index[id(gathering)])
        n = len(self.all_states)
        digest = 0  # the whole order, where it is longer than n (units run again under no_grad)
        if len(order) > n:
            for i in order:
                digest = (digest * 1000003 + i + 1) % (1 << 50)
        row = [float(gathering is None), 0.0, float(len(order)), float(digest)] + [float(i) for i in order[:n]]
        row += [-1.0] * (n + 4 - len(row))
        return torch.tensor(row, dtype=torch.float64)

    def _describe_orders(self, rows: list[list[float]]) -> str:
        def name(i: int) -> str:
            label = self.all_states[i].param_group.label
            return repr(label) if label else f"'' (the root, {type(self.module).__name__})"

        orders = [[int(i) for i in r[4:] if i >= 0] for r in rows]
        ran = [set(o) for o in orders]
        everywhere = set.intersection(*ran)
        differing = []
        for i in sorted(set.union(*ran) - everywhere):
            on = [q for q, units in enumerate(ran) if i in units]
            off = [q for q, units in enumerate(ran) if i not in units]
            differing.append(f"{name(i)} ran on rank{'s' * (len(on) > 1)} {', '.join(map(str, on))} and not on "
                             f"rank{'s' * (len(off) > 1)} {', '.join(map(str, off))}")
        what = "; ".join(differing) if differing else "the same units ran in different orders"
        listing = "; ".join(f"rank {q}: " + ", ".join(name(i) for i in o)
                            + (" (forward done)" if r[0] else " (forward not done)")
                            for q, (r, o) in enumerate(zip(rows, orders)))
        numbers = [int(r[1]) for r in rows]
        out_of_step = ""  # by whole forwards: one was begun on some ranks only
        if len(set(numbers)) > 1:
            out_of_step = (" The ranks are in different forwards of the root (" +
                           ", ".join(f"rank {q}: #{k}" for q, k in enumerate(numbers)) +
                           "): a forward ran, or raised and was caught, on some ranks only.")
        return (
            f"pydist FSDP: the ranks ran different fully_shard'ed units in this forward of "
            f"{type(self.module).__name__}: {what}. Units so far: {listing}.{out_of_step} Their all-gathers and "
            "reduce-scatters would pair one unit's with another's (torch's FSDP2 aborts on gloo or hangs there): "
            "every rank must run the same units in the same order. Run the unit on every rank (e.g. on an empty "
            "input, as mixture-of-experts layers do), or fully_shard a module that runs on every rank instead of the "
            "one that does not"
        )

    # --- hooks ----------------------------------------------------------------

    # [Note: the hooks' fast path]
    # A model of many small units (400 x Linear(64)+LayerNorm) runs these
    # hooks 400 times per forward and backward, so their Python is a real
    # part of its step. Most of what the general path checks cannot apply
    # to most units: lazy init and the root's pre-forward (the root only),
    # input and output casts (a MixedPrecisionPolicy with a param_dtype or
    # output_dtype), set_modules_to_forward_prefetch targets. The root
    # decides these once per forward for every state (``plain``); a plain
    # unit's pre-forward, in the common case (IDLE, grad enabled, its first
    # run this iteration), and its post-forward after such a pre-forward,
    # skip those checks and go straight to what every unit's hook does
    # (_unit_pre_forward, FSDPParamGroup.post_forward): one path, not a
    # second copy of it. Anything else (a recompute under activation
    # checkpointing: PRE_BACKWARD; a second run, which the general path
    # refuses; no_grad) takes the checks. Every unit calls GatherPlan.need,
    # unsharded already or not, so the plan's batches go out in order and
    # its last one before its units' post-forwards, which leave it kept for
    # backward (under set_reshard_after_backward(False) too). The backward
    # hooks have no such branch: a unit's pre-backward is
    # FSDPParamGroup.pre_backward behind a few tests (_pre_backward).

    def _pre_forward(self, module, args, kwargs):
        if (self.plain and self.param_group.training_state is _IDLE and self.forward_iteration != self.root.iteration
                and torch.is_grad_enabled()):
            # See [Note: the hooks' fast path]: none of the checks below applies.
            self.forward_iteration = self.root.iteration
            return self._unit_pre_forward(args, kwargs)
        if self.root is None:
            self._lazy_init()
        root = self.root
        pg = self.param_group
        if pg is not None and pg.training_state is TrainingState.SUMMONED:
            # Its full parameters are on the modules: see [Note: summoning full parameters].
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"pydist FSDP unit {pg.label!r}: a forward with grad inside summon_full_params; its backward "
                    "would reduce nothing and the optimizer would not see the gradients. Run it under "
                    "torch.no_grad() (generation, evaluation) or after the block"
                )
            return args, kwargs
        if self.is_root and self.iteration_failed():
            self.recover_from_failed_iteration()
        self._recomputing = self._is_recompute()
        if self._recomputing:
            # Activation checkpointing recomputing the forward in backward:
            # the unit needs its parameters (left unsharded for its backward,
            # which comes next), and nothing else of a forward applies
            # (order, reuse check, post-backward hooks, resharding). As
            # torch's FSDP2, which skips its input casts here too.
            if pg is not None:
                pg.wait_for_unshard(Phase.BACKWARD)
            return args, kwargs
        if self.is_root:
            self._root_pre_forward()
        mp = self.mp_policy
        if mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), mp.param_dtype)
        if pg is None:
            if torch.is_grad_enabled():
                self.forward_iteration = root.iteration
            return args, kwargs
        if torch.is_grad_enabled() and self.forward_iteration == root.iteration:
            raise RuntimeError(
                f"pydist FSDP unit {pg.label!r} ran forward a second time in one forward of its root (a module reused, "
                "e.g. weights shared across layers). Its gradients would be reduced after the first use's backward "
                "only, so this is not supported: fully_shard the module that contains every use instead"
            )
        if torch.is_grad_enabled():
            self.forward_iteration = root.iteration
        return self._unit_pre_forward(args, kwargs)

    def _unit_pre_forward(self, args, kwargs):
        """What every pre-forward of a unit does once the checks have passed:
        its parameters (gathered by the root's plan, or alone), its place in
        the forward order, its prefetch targets, its post-backward point."""
        root = self.root
        pg = self.param_group
        plan = root.schedule.forward_plan
        if plan is not None:
            plan.need(self)  # issues the plan's batches in order, up to this unit's (see GatherPlan.need)
        if pg.sharded_state is _SHARDED:  # no plan gathered it
            root.check_forward_order(self)
        pg.pre_forward()
        root.forward_order.append(self)
        for target in self.forward_prefetch:
            if target.param_group is not None:
                target.param_group.unshard(Phase.FORWARD_PREFETCH)
        if torch.is_grad_enabled():
            return self._join_or_register_post_backward(root, args, kwargs)
        return args, kwargs

    def _is_recompute(self) -> bool:
        """Whether this forward is activation checkpointing's recompute in
        backward: the unit is in its backward already, or it ran forward with
        grad in this iteration and autograd is running now (a checkpointed
        region holding several units recomputes them all at the first
        saved tensor it needs, before their backward). A reentrant
        checkpoint's first forward ran without grad, so its recompute is the
        unit's forward proper: it hooks the outputs the inner backward runs on."""
        pg = self.param_group
        if pg is not None and pg.training_state == TrainingState.PRE_BACKWARD:
            return True
        return self.forward_iteration == self.root.iteration and torch._C._current_graph_task_id() != -1

    def _join_or_register_post_backward(self, root: FSDPState, args, kwargs):
        """See [Note: how a unit learns its backward is done]."""
        if not kwargs and len(args) == 1 and args[0] is root._last_hooked:
            hook = root._last_hook
            if not hook.fired:
                hook.join(self.param_group)
                self.signalled = True
                if self.run_ok:
                    root.schedule.extend_run(hook, self)
                return args, kwargs
        return self._register_post_backward(args, kwargs)

    def _post_forward(self, module, args, output):
        pg = self.param_group
        if self.plain and pg.training_state is _FORWARD:
            pg.post_forward(pg.reshard_after_forward)  # see [Note: the hooks' fast path]: none of the checks below applies
        else:
            if self._recomputing:
                self._recomputing = False
                return output  # see _pre_forward
            if pg is not None and pg.training_state is TrainingState.SUMMONED:
                return output  # see _pre_forward
            if pg is not None:
                # The root keeps its parameters for backward, unless there is none.
                reshard = pg.reshard_after_forward and (not self.is_root or not torch.is_grad_enabled())
                pg.post_forward(reshard)
            if self.is_root:
                self.check_forward_order(None)
                self._forward_open = False
                self._last_hooked = self._last_hook = self._last_gate = None
                for state in self.all_states:  # gathered ahead for a forward that did not come
                    if state.param_group is not None and state.param_group.gathered_ahead:
                        state.param_group.reshard()
                if not torch.is_grad_enabled():
                    self.schedule.pool.release()  # no backward follows: see [Note: the unsharded buffer's memory]
            if self.mp_policy is not None and self.mp_policy.output_dtype is not None:
                output = _cast_floating(output, self.mp_policy.output_dtype)
        run = pg.run if pg is not None else None
        if torch.is_grad_enabled():
            if isinstance(output, torch.Tensor):
                if output.requires_grad:
                    root = self.root
                    before, gate_before = root._last_hook, root._last_gate
                    hook = self._hook_output(output)
                    if run is not None:
                        run.link(self, hook, before, gate_before)
                    return output
            else:
                flat, _ = tree_flatten(output)
                for t in flat:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        self._hook_output(t)
        if run is not None:
            run.drop(self)  # no one hooked output to hand on
        return output

    def _hook_output(self, t: torch.Tensor) -> _OutputHook:
        """Hooks one output tensor (through a _C.OutputGate: see [Note: runs
        of units]): see [Note: how a unit learns its backward is done]."""
        hook = _OutputHook(self)
        gate = _C.OutputGate(hook)
        gate.attach(t)
        if not self.is_root:  # the root's output feeds no unit; kept, it would outlive the forward
            root = self.root
            root._last_hooked, root._last_hook, root._last_gate = t, hook, gate
        return hook

    def _begin_backward(self) -> None:
        """Root, at the first backward hook of an iteration: the final callback and the plans."""
        if self.subscribers:
            self.backward_start_ns = time.monotonic_ns()
        self.final_callback_queued = True
        Variable._execution_engine.queue_callback(self._root_post_backward_final_callback)
        self.schedule.plan_backward(self.forward_order, self._batch_bytes(), self.late_posters)

    def _pre_backward(self) -> None:
        root = self.root
        if not root.final_callback_queued:
            root._begin_backward()
        pg = self.param_group
        if pg is None or pg.training_state is _PRE_BACKWARD:
            return
        if pg.training_state is _POST_BACKWARD:
            pg.pre_backward()  # raises: backward reached the unit again after its gradients were reduced
        plan = root.schedule.backward_plan
        if plan is not None and (pg.sharded_state is _SHARDED or id(pg) in plan.heads):
            plan.need(self)  # (nothing to do for a unit gathered with its batch that does not head one)
        if pg.pre_backward() and self.backward_prefetch is not None:
            for target in self.backward_prefetch:
                tpg = target.param_group
                if tpg is not None and tpg.training_state != TrainingState.POST_BACKWARD:
                    tpg.unshard(Phase.BACKWARD_PREFETCH)

    def _register_post_backward(self, args, kwargs):
        self.signalled = False
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            positions = [i for i, t in enumerate(args) if t.requires_grad]
            if not positions:
                return args, kwargs
            self.signalled = True
            outs = RegisterPostBackwardFunction.apply(self.param_group, *[args[i] for i in positions])
            args = list(args)
            for i, t in zip(positions, outs):
                args[i] = t
            return tuple(args), kwargs
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return args, kwargs
        self.signalled = True
        outs = RegisterPostBackwardFunction.apply(self.param_group, *[flat[i] for i in positions])
        for i, t in zip(positions, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)


def _cast_floating(tree, dtype: torch.dtype):
    flat, spec = tree_flatten(tree)
    flat = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t for t in flat]
    return tree_unflatten(flat, spec)


# [Note: how a unit learns its backward is done]
# A unit's post-backward (pack and reduce its gradients, reshard) must run
# once its backward is done, at the same point on every rank: when the
# gradients of its inputs exist. torch's FSDP2 wraps the inputs in an
# identity autograd Function (RegisterPostBackwardFunction below) whose
# backward is that point; applying one costs a Python autograd Function per
# unit per forward. Most units' one input is the previous unit's output,
# which already carries that unit's pre-backward hook (an _OutputHook: its
# gradient there is complete once every use of it has run its backward,
# this unit's included). Such a unit joins that hook's post_units instead:
# the hook runs their post-backward, then its own unit's pre-backward (as
# the Function's backward would run just before the previous unit's hook).
# The point is as deterministic (the graph's structure, the same on every
# rank) and no earlier than the Function's: later only where the tensor has
# other uses beyond the unit (a residual around it), whose backward then
# comes first. Inputs that are not one hooked tensor of this iteration (the
# first unit's, keyword arguments, several tensors, inputs cast by a
# MixedPrecisionPolicy) take the Function. The hook runs a joined unit's
# post-backward only once that unit's pre-backward has run: a unit whose
# input does not carry its backward (it uses the input through .detach() or
# only its shape) would otherwise be reduced when the input's other uses are
# done, before its own backward; it is left to the final callback instead,
# as the Function (never reached) leaves it. Every output hook sits behind
# a _C.OutputGate; inside a run of units the gate is closed and the run's
# first and last hooks do its units' work ([Note: runs of units]).


class _OutputHook:
    """The hook on a tensor a unit returned: the unit's pre-backward, after
    the post-backward of the units that took the tensor as their one input.
    See [Note: how a unit learns its backward is done]."""

    __slots__ = ("state", "post_unit", "more_post_units", "fired", "closes")

    def __init__(self, state: FSDPState):
        self.state = state  # the unit that returned the tensor
        # A run's last unit's hook: the (gate, hook) of the other units'
        # outputs, which the run start closes (see [Note: runs of units]).
        self.closes: list | None = None
        # The units whose one input the tensor is: the first, then a list of
        # the others (usually none: one object fewer per unit and iteration).
        self.post_unit: FSDPParamGroup | None = None
        self.more_post_units: list[FSDPParamGroup] | None = None
        self.fired = False  # once fired, units joining would never be told

    def join(self, pg: FSDPParamGroup) -> None:
        if self.post_unit is None:
            self.post_unit = pg
        elif self.more_post_units is None:
            self.more_post_units = [pg]
        else:
            self.more_post_units.append(pg)

    def __call__(self):
        self.fired = True
        state = self.state
        if not state.root.final_callback_queued:
            state.root._begin_backward()  # the reduce plan must exist before a post-backward packs
        pg = self.post_unit
        if pg is not None:
            if pg.training_state is _PRE_BACKWARD:  # its backward ran: see the note
                pg.post_backward()
            if self.more_post_units is not None:
                for pg in self.more_post_units:
                    if pg.training_state is _PRE_BACKWARD:
                        pg.post_backward()
        pg = state.param_group
        if pg is not None and pg.run is not None and self.closes is not None:
            closes, self.closes = self.closes, None
            pg.run.start(closes)
            return
        state._pre_backward()


class RegisterPostBackwardFunction(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the gradients of
    the unit's inputs exist, i.e. once the unit's backward is done."""

    @staticmethod
    def forward(ctx, param_group: FSDPParamGroup, *inputs: torch.Tensor):
        ctx.param_group = param_group
        return inputs

    @staticmethod
    def backward(ctx, *grads: Any):
        ctx.param_group.post_backward()
        return (None,) + grads
