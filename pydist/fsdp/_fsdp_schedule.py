"""The root's schedule: what it plans and runs once per iteration for all
its units. The batched all-gathers (``unshard_units``) and their plans
(``GatherPlan``), the unshard pool (``UnshardPool``), the reduce batches
(``ReduceLayout``, ``GradBatch``) and the runs of units (``UnitRun``),
held by the root's ``Schedule``. One unit's own steps are in
_fsdp_param_group.py; the hooks that drive both, in _fsdp_state.py. Notes
cited here without a file are in one of those: [Note: the unsharded
buffer's memory] and [Note: HSDP] in _fsdp_param_group.py; [Note: the
order of an iteration], [Note: the hooks' fast path], [Note: how a unit
learns its backward is done] and [Note: ranks that run different units]
in _fsdp_state.py.

[Note: gather and reduce plans]
The root does not leave each unit to gather and reduce alone: it plans, in
the order the units will need their parameters, which go together as one
collective (see [Note: batched collectives] in _fsdp_collectives.py) and
which are gathered ahead.
    forward          the plan is last iteration's forward order (none on the
                     first: each unit gathers alone, as needed). A unit that
                     needs its parameters and has none gathers with it the
                     SHARDED units after it in the plan, up to batch_bytes of
                     unsharded parameters; when the first unit of a batch
                     starts, the next batch is issued ("forward_prefetch"),
                     so it travels while this one computes. A unit gathered
                     ahead whose forward does not come this time is
                     resharded at the root's post-forward.
    backward         the plan is this iteration's forward order reversed,
                     cut the same way ("backward", then "backward_prefetch").
                     When the forward ran as planned and no unit ran inside
                     another, the cut is the forward's batches, last first
                     (GatherPlan.backward_of), so a run of units ([Note:
                     runs of units]) is one gather both ways and no batch
                     is cut again per iteration.
                     The forward's last batch is the backward's first, so
                     it is not resharded after its forward but kept for it
                     (its memory held, the shards on the modules meanwhile),
                     and the backward's first hook sends the next batch
                     ahead at once. Not when a unit around one of its
                     members is outside the batch: that unit's backward
                     begins first and would gather ahead while the kept
                     batch still holds its slot. Kept units that no
                     backward used (a forward with grad and no backward)
                     are resharded at the root's next forward, since
                     their parameters may have changed in between.
    reduce-scatter   at the first backward hook, the units of the backward
                     plan that will reduce are cut into GradBatches of up to
                     batch_bytes; the last member's post-backward launches its
                     batch, so it overlaps the rest of backward. Units whose
                     post-backward came from the final callback last time
                     (the root, a first unit whose inputs need no grad) go
                     alone, so they hold no batch back until backward ends.
Every rank plans from the same orders, so their collectives still match.
With batch_bytes = 0 every batch is one unit: each gathers and reduces on
its own, one unit ahead.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from pydist import _C
from pydist.fsdp import _fsdp_collectives as collectives
from pydist.fsdp._fsdp_common import Phase, ShardedState, TrainingState
from pydist.fsdp._fsdp_param_group import FSDPParamGroup, ReplicaReduce, _hand_out_grads

__all__ = ["Schedule", "GatherPlan", "UnitRun", "unshard_units", "UnshardPool", "PoolSlot", "POOL_SLOTS",
           "ReduceLayout", "GradBatch", "ReduceInputs", "cut_reduce_layouts", "default_batch_bytes"]

# The states the hot paths test by identity.
_PRE_BACKWARD = TrainingState.PRE_BACKWARD
_SHARDED, _UNSHARDED = ShardedState.SHARDED, ShardedState.UNSHARDED

# Unsharded bytes of parameters (and of gradients) a root gathers (reduces)
# as one collective, unless set_collective_batch_bytes says otherwise.
# Larger batches mean fewer collectives, and a collective costs its ranks a
# rendezvous whatever it carries (on shared memory with more ranks than
# cores, a scheduling turn of every rank); but a backward holds about four
# batches' worth of unsharded memory at once (two pool slots, two reduce
# inputs: see [Note: the unsharded buffer's memory] and GradBatch), on top
# of what the shards hold. So the default grows with the ranks the
# collective joins: 256 KiB of each rank's shard, at most 2 MiB (half the
# DDP reducer's 4 MiB all-reduce chunk). Measured on the 400-unit model of
# benchmarks/bench_fsdp.py (2 cores): 2 ranks step as fast at 256 KiB-2 MiB
# and peak 10 MB lower at 512 KiB than at 2 MiB; 4 ranks (two a core) peak 8
# MB lower at 1 MiB than at 2 MiB and step up to ~10% slower, slower still
# at 512 KiB. Units larger than a batch go alone.
BATCH_BYTES_PER_RANK = 256 << 10
MAX_DEFAULT_BATCH_BYTES = 2 << 20


def default_batch_bytes(world_size: int) -> int:
    """The batch a root of ``world_size`` sharding ranks uses by default."""
    return min(BATCH_BYTES_PER_RANK * world_size, MAX_DEFAULT_BATCH_BYTES)


class Schedule:
    """The root's plans, made anew each iteration from the units' order, and
    what they keep across iterations: the forward and backward gather plans,
    the reduce batches and their layouts, the unshard pool. Made at the
    root's lazy init; the root's hooks call its methods at the points of
    an iteration (see [Note: the order of an iteration]), and the units'
    hooks read its plans. See [Note: gather and reduce plans]."""

    def __init__(self, device: torch.device):
        self.pool = UnshardPool(device)  # see [Note: the unsharded buffer's memory]
        # See [Note: reduce inputs on a device]; None on the CPU.
        self.reduce_inputs = ReduceInputs() if device.type != "cpu" else None
        # This iteration's forward and backward gather plans (None: none yet,
        # or no forward order to plan from).
        self.forward_plan: GatherPlan | None = None
        self.backward_plan: GatherPlan | None = None
        self._last_backward_plan: GatherPlan | None = None  # what the next backward plan may reuse
        # This backward's reduce batches, until the root's final callback takes them.
        self.grad_batches: list[GradBatch] = []
        # The reduce batches' layouts, kept while what they were cut from
        # stays the same (see plan_backward).
        self._reduce_layouts: tuple | None = None

    def plan_forward(self, order: list, batch_bytes: int, units: list[FSDPParamGroup]) -> None:
        """Root pre-forward: ``order`` (last iteration's forward order, [] on
        the first) becomes this forward's gather plan; no unit of ``units``
        is in a run yet (see [Note: runs of units])."""
        for pg in units:
            pg.run = None
        if self.forward_plan is not None:
            self.forward_plan.reshard_kept()  # no backward came for them
        self.forward_plan = GatherPlan(order, batch_bytes, Phase.FORWARD, self.forward_plan) if order else None
        self.backward_plan = None

    def forget_plans(self, units: list[FSDPParamGroup]) -> None:
        """Between iterations, after ``units`` changed (see
        FSDPState.units_changed): no plan, reduce layout or batch's gather
        lists is kept; the next forward plans as the first did."""
        if self.forward_plan is not None:
            self.forward_plan.reshard_kept()
        self.forward_plan = self.backward_plan = self._last_backward_plan = None
        self._reduce_layouts = None
        for pg in units:
            pg._gather_lists = None

    def take_grad_batches(self) -> list[GradBatch]:
        """Root final callback: this backward's reduce batches, handed over."""
        batches, self.grad_batches = self.grad_batches, []
        return batches

    def abandon_iteration(self) -> None:
        """After an iteration raised (see [Note: an iteration that raised] in
        _fsdp_state.py): waits for every reduce batch in flight (every rank
        issued them) and drops the backward's plan; the units reshard
        themselves after, and the root frees the pool."""
        for batch in self.take_grad_batches():
            batch.abandon()
        self.backward_plan = None
        self.end_backward()

    def end_backward(self) -> None:
        """The root, once every reduction of the backward is waited for:
        what it kept for them goes."""
        if self.reduce_inputs is not None:
            self.reduce_inputs.clear()

    def extend_run(self, hook, state) -> None:
        """At ``state``'s pre-forward (an FSDPState whose unit may be in a
        run): its unit took the one output ``hook`` hooks, of the unit before
        it. The unit joins the run that unit is last in (or starts with it),
        where the run may go on. See [Note: runs of units]."""
        prev = hook.state
        plan = self.forward_plan
        if not prev.run_ok or plan is None or plan.batches is None:
            return
        batch_of_state = plan.batch_of_state
        batch = batch_of_state.get(id(state))
        if batch is None or batch != batch_of_state.get(id(prev)):
            return  # a run lies in one gather batch
        run = prev.param_group.run
        if run is None:
            if not prev.signalled:
                return  # its post-backward comes from the final callback: no run starts with it
            run = prev.param_group.run = UnitRun(prev)
        elif run.members[-1] is not prev:
            return
        run.members.append(state)
        state.param_group.run = run
        state.param_group._run_link = hook

    def plan_backward(self, forward_order: list, batch_bytes: int, late: set[int]) -> None:
        """Root, at the first backward hook: the backward gather plan (from
        this iteration's ``forward_order``) and the reduce batches (``late``:
        ids of the states whose post-backward came from the final callback
        last iteration). See [Note: gather and reduce plans]."""
        forward = self.forward_plan
        if (forward is not None and forward.batches is not None and forward.flat
                and forward.order == forward_order):
            # The forward ran as planned, no unit inside another: its
            # batches, last first (so a run of units is one gather; see
            # [Note: runs of units]). (A unit around others begins its
            # backward before theirs, so reversed forward batches would
            # split it from them.)
            plan = GatherPlan.backward_of(forward, self._last_backward_plan)
        else:
            plan = GatherPlan(forward_order[::-1], batch_bytes, Phase.BACKWARD, self._last_backward_plan)
        self.backward_plan = plan
        self._last_backward_plan = plan
        plan.start()
        # Which units reduce: what the batches are cut from, with the plan's units.
        reduces = [pg.sharded and pg.requires_gradient_sync and bool(pg._trainable) and id(state) not in late
                   for state in plan.states if (pg := state.param_group) is not None]
        key = (plan.states, reduces, batch_bytes)
        cached = self._reduce_layouts
        if cached is None or cached[0] is not key[0] or cached[1:3] != key[1:]:
            self._reduce_layouts = cached = key + (cut_reduce_layouts(plan.states, reduces, batch_bytes),)
        batches = self.grad_batches = []
        for state in plan.states:
            state.param_group.join_grad_batch(None)
        for layout in cached[-1]:
            batch = GradBatch(layout, batches)
            for member in layout.members:
                member.join_grad_batch(batch)
            batches.append(batch)


def cut_reduce_layouts(states: list, reduces: list[bool], batch_bytes: int) -> list[ReduceLayout]:
    """The reduce batches of a backward plan's units (``states``, FSDPStates;
    ``reduces``: which of them reduce): runs of consecutive units that
    reduce and batch with one another, up to ``batch_bytes`` of
    gradients (in the reduce dtype); a unit alone is no batch."""
    layouts: list[ReduceLayout] = []
    run: list[FSDPParamGroup] = []
    run_bytes = 0
    for state, reduce in zip(states, reduces):
        pg = state.param_group
        nbytes = pg.padded_numel * torch.finfo(pg.reduce_dtype).bits // 8
        if not reduce or (run and (run_bytes + nbytes > batch_bytes or not run[0].batches_with(pg))):
            if len(run) > 1:
                layouts.append(ReduceLayout(run))
            run, run_bytes = [], 0
        if reduce:
            run.append(pg)
            run_bytes += nbytes
    if len(run) > 1:
        layouts.append(ReduceLayout(run))
    return layouts



class GatherPlan:
    """The units in the order they are expected to need their parameters,
    gathered in batches one batch ahead. See [Note: gather and reduce plans]."""

    def __init__(self, order: list, batch_bytes: int, phase: Phase, last: GatherPlan | None = None):
        self._fields(order, batch_bytes, phase)
        if (last is not None and last.reusable and last.phase == phase and last.batch_bytes == batch_bytes
                and last.order == order):
            # The units of last iteration's plan in the same order: its
            # layout, which nothing changes once cut, saves a walk over every
            # unit per phase. Every rank decides alike: the orders are the
            # same on every rank (see [Note: ranks that run different units]).
            self.states, self.position = last.states, last.position
            self.batches, self.batch_of = last.batches, last.batch_of
            self.batch_of_state, self.flat, self.batch_groups = last.batch_of_state, last.flat, last.batch_groups
            self.reusable = True
            return
        seen: set[int] = set()
        self.states = []  # the units, each at its first place in ``order``
        for s in order:
            if s.param_group is not None and id(s) not in seen:
                seen.add(id(s))
                self.states.append(s)
        self.position = {id(s): i for i, s in enumerate(self.states)}
        # Whether the next plan of the same order may take this one's layout:
        # a backward plan's is the units alone; a forward plan's batches are
        # cut from the SHARDED units, so only when every unit was (a unit
        # left unsharded now would stay out of every batch after; a unit
        # unsharded at a later cut is left out of its batch at the issue).
        self.reusable = phase is not Phase.FORWARD or all(s.param_group.sharded_state is ShardedState.SHARDED
                                                  for s in self.states)
        if phase is Phase.FORWARD:
            self.flat = all(s.param_group.enclosing is None for s in self.states)
            self.batches = []
            start = 0
            while start < len(self.states):
                members, start = self._cut(start)
                if members:
                    for k in members:
                        self.batch_of[k] = len(self.batches)
                        self.batch_of_state[id(self.states[k])] = len(self.batches)
                    self.batches.append(members)
                    self.batch_groups.append([self.states[k].param_group for k in members])

    def _fields(self, order: list, batch_bytes: int, phase: Phase) -> None:
        """Every plan's state before its layout (states, position, batches) is made."""
        self.order = order
        self.batch_bytes = batch_bytes
        self.phase = phase  # FORWARD or BACKWARD: the collectives' phase (their prefetch phase ahead)
        self.cursor = 0  # every unit before it has been considered for a batch
        self.heads: set[int] = set()  # ids of the first units (param groups) of batches issued ahead: starting one issues the next
        self.kept: list[FSDPParamGroup] = []  # forward: the last batch, left unsharded for backward
        # Forward only: the batches, cut now from the units' states at the
        # root's pre-forward (the same on every rank), issued in this order
        # whichever units run; each unit's batch; how many are issued. See
        # [Note: ranks that run different units].
        self.batches: list[list[int]] | None = None
        self.batch_of: dict[int, int] = {}
        self.batch_of_state: dict[int, int] = {}  # forward: batch_of by id(state)
        self.batch_groups: list[list[FSDPParamGroup]] = []  # each batch's units (param groups)
        self.issued = 0
        self.made_from: list | None = None  # backward_of's: the forward batches it was made from
        self.flat = False  # forward: no unit of the plan lies inside another (the root aside)
        self.reusable = False

    @classmethod
    def backward_of(cls, forward: GatherPlan, last: GatherPlan | None) -> GatherPlan:
        """The backward plan of a forward that ran the units ``forward``
        planned, in its order: its batches, the last first, each from its
        last unit; the layout of ``last`` where it was made from the same
        forward batches (which a reused forward layout shares)."""
        plan = cls.__new__(cls)
        plan._fields(forward.order[::-1], forward.batch_bytes, Phase.BACKWARD)  # not reusable: __init__'s reuse is for its own cuts
        plan.made_from = forward.batches
        if last is not None and last.made_from is forward.batches:
            plan.states, plan.position, plan.batches, plan.batch_of = (last.states, last.position, last.batches,
                                                                      last.batch_of)
            plan.batch_groups = last.batch_groups
            return plan
        n = len(forward.states)
        plan.states = forward.states[::-1]
        plan.position = {id(s): i for i, s in enumerate(plan.states)}
        plan.batches = [[n - 1 - k for k in reversed(members)] for members in reversed(forward.batches)]
        plan.batch_of = {k: b for b, members in enumerate(plan.batches) for k in members}
        plan.batch_groups = [[plan.states[k].param_group for k in members] for members in plan.batches]
        return plan

    def start(self) -> None:
        """Backward, at its first hook: when the first units are unsharded
        already (the forward's last batch, kept), the first batch to gather
        goes out now, ahead, so it travels while they compute."""
        if self.batches is not None:
            if self.batches:
                self._issue_batch(self.phase)  # gathers nothing when the forward kept it
                if not self.heads and self.issued < len(self.batches):
                    self._issue_batch(self.phase.prefetch)
            return
        if self.states and self.states[0].param_group.sharded_state is not ShardedState.SHARDED:
            self._issue(0, self.phase.prefetch)

    def reshard_kept(self) -> None:
        """Reshards the units kept for a backward that did not come (a
        forward with grad and no backward): their parameters may have
        changed since they were gathered."""
        for pg in self.kept:
            if pg.sharded_state is ShardedState.KEPT or pg.keep_for_backward:
                pg.reshard()
        self.kept = []

    def need(self, state) -> None:
        """``state``'s unit is about to compute: gathers its batch if it has
        no parameters, and the next batch when it starts one (so nothing to
        do unless the unit is SHARDED or in ``heads``)."""
        i = self.position.get(id(state))
        if i is None:
            return  # not in the plan: the unit gathers alone
        if self.batches is not None:
            b = self.batch_of.get(i, -1)
            while self.issued <= b:  # with the batches of units this rank skipped before it
                self._issue_batch(self.phase)
            if id(state.param_group) in self.heads:
                self.heads.discard(id(state.param_group))
                if self.issued < len(self.batches):
                    self._issue_batch(self.phase.prefetch)
            return
        if state.param_group.sharded_state == ShardedState.SHARDED:
            self._issue(i, self.phase)
        if id(state.param_group) in self.heads:
            self.heads.discard(id(state.param_group))
            self._issue(self.cursor, self.phase.prefetch)

    def issue_rest(self) -> None:
        """Forward: issues the batches not issued yet (of units this rank
        skipped at the end). See [Note: ranks that run different units]."""
        while self.batches is not None and self.issued < len(self.batches):
            self._issue_batch(self.phase)

    def _issue_batch(self, phase: Phase) -> None:
        """Issues the next batch (its units still SHARDED)."""
        groups = [pg for pg in self.batch_groups[self.issued] if pg.sharded_state is _SHARDED]
        self.issued += 1
        self._gather(groups, phase)
        if self.phase is Phase.FORWARD and self.issued == len(self.batches) and groups and torch.is_grad_enabled():
            self._keep_for_backward(groups)

    def _keep_for_backward(self, groups: list[FSDPParamGroup]) -> None:
        """The forward's last batch is the backward's first: it stays
        unsharded, unless a unit around one of its members is outside it
        (that unit's backward begins first and would gather the next batch
        while the kept one still holds its slot)."""
        ids = {id(pg) for pg in groups}
        if all(pg.enclosing is None or id(pg.enclosing) in ids for pg in groups):
            self.kept = [pg for pg in groups if pg.reshard_after_forward and not pg.is_root]
            for pg in self.kept:
                pg.mark_gathered_ahead(keep_for_backward=True)

    def _cut(self, start: int) -> tuple[list[int], int]:
        """(the SHARDED units from ``start`` on, up to batch_bytes, that batch
        with the first; where the walk stopped)."""
        members: list[int] = []
        nbytes = 0
        k = start
        while k < len(self.states):
            pg = self.states[k].param_group
            if pg.sharded_state == ShardedState.SHARDED and pg.training_state != TrainingState.POST_BACKWARD:
                size = pg.unsharded_nbytes
                if members and (nbytes + size > self.batch_bytes
                                or not self.states[members[0]].param_group.batches_with(pg)):
                    break
                members.append(k)
                nbytes += size
            k += 1
        return members, k

    def _issue(self, start: int, phase: Phase) -> None:
        """Gathers the SHARDED units from ``start`` on, up to batch_bytes, as one collective."""
        members, k = self._cut(start)
        self.cursor = max(self.cursor, k)
        self._gather([self.states[k].param_group for k in members], phase)

    def _gather(self, groups: list[FSDPParamGroup], phase: Phase) -> None:
        """Starts the all-gather of ``groups`` (SHARDED units) as one collective."""
        if not groups:
            return
        for pg in groups:
            pg.mark_gathered_ahead()
        self.heads.add(id(groups[0]))
        unshard_units(groups, phase)


# [Note: runs of units]
# A unit's output hook is its pre-backward and the post-backward of the
# unit that took that output as its one input (see [Note: how a unit learns
# its backward is done]): in a model of many small units, a Python call per
# unit per backward, plus each unit's bookkeeping. A run is consecutive
# units of one gather batch (see [Note: gather and reduce plans]), each after
# the first taking the one output of the one before it, all plain
# ([Note: the hooks' fast path]), sharded and without backward prefetch
# targets, the first with a post-backward point of its own (a joined hook,
# or the Function on its inputs). Autograd then runs the run's backward in
# one stretch, last unit first: every unit's backward waits for the one
# after it, and the first unit's post-backward point waits for them all.
# So:
#   the last unit's output hook (run start) does the pre-backward of every
#        unit of the run (its own first: it heads the gather of the batch),
#        then closes the _C.OutputGate of every other unit's output hook;
#        a closed gate returns in C++ without taking the GIL, having packed
#        the gradients of the unit after it (whose backward has just ended:
#        its hook would have) into that unit's reduce batch, while they are
#        hot in cache (csrc/fsdp/output_gate.h);
#   the first unit's post-backward (run finish) does the rest of every
#        unit's post-backward (its own in full): arrival in the reduce
#        batch, which launches it, and reshard.
# The work per unit is what its own hooks would have done, in the same
# collectives and order on every rank (the runs are cut from the same
# forward on every rank), so the results are bitwise the same; what goes is
# a Python call and its checks per unit. The forward finds the runs: a unit
# continues the run of the unit before it at its pre-forward (extend_run),
# and at its post-forward hands the gates collected so far to its own
# output hook (UnitRun.link), so the run's last hook holds them all; a unit
# that then turns out not to continue the run (another unit ran inside it,
# or its output needs no hooking) leaves it (UnitRun.drop). A gate stays
# open where the hook has other units to tell (more than one unit took the
# output), and every gate stays open if the run never starts (its last
# unit's output got no gradient while another output of the run did): the
# hooks then do their work one by one, as without runs.


class UnitRun:
    """Units whose backward is handled as one. See [Note: runs of units]."""

    __slots__ = ("members", "started")

    def __init__(self, first):
        self.members = [first]  # FSDPStates, in forward order
        self.started = False  # its last unit's hook ran the run start

    def link(self, state, hook, before, gate_before) -> None:
        """``state`` (the run's last unit so far) hooked its output with
        ``hook``; ``before`` and ``gate_before`` were the last output hook
        and gate before it. Hands the gates collected so far on to ``hook``,
        or takes ``state`` out of the run when a unit ran inside it."""
        pg = state.param_group
        link, pg._run_link = pg._run_link, None
        if link is not before or self.members[-1] is not state:
            self.drop(state)
            return
        closes = link.closes or []
        link.closes = None
        closes.append((gate_before, link))
        hook.closes = closes

    def drop(self, state) -> None:
        """Takes ``state`` (the last unit) out of the run."""
        state.param_group._run_link = None
        if self.members[-1] is state:
            self.members.pop()
        state.param_group.run = None

    def start(self, closes: list) -> None:
        """The run's last unit's hook: every unit's pre-backward, the last
        unit's first (it heads the batch's gather); then the other units'
        hooks are closed."""
        self.started = True
        members = self.members
        members[-1]._pre_backward()
        plan = members[-1].root.schedule.backward_plan
        for state in members[-2::-1]:
            pg = state.param_group
            if pg.sharded_state is _UNSHARDED and id(pg) not in plan.heads:
                pg.pre_backward()  # all that _pre_backward does for it (a run's units have no prefetch targets)
            else:
                state._pre_backward()
        for gate, hook in closes:
            if hook.more_post_units is None:
                gate.close(hook.post_unit.aimed_grad_pack() if hook.post_unit is not None else None)
                hook.fired = True

    def finish(self) -> None:
        """The run's first unit's post-backward point: every unit's post-backward, last unit first."""
        self.started = False
        for state in reversed(self.members):
            pg = state.param_group
            pg.run = None
            if pg.training_state is _PRE_BACKWARD and not pg.finish_packed():
                pg.post_backward()


def unshard_units(groups: Sequence[FSDPParamGroup], phase: Phase) -> None:
    """Starts the all-gather of the SHARDED units among ``groups`` (which
    ``batches_with`` one another) as one collective; one unit alone takes
    ``unshard``. See [Note: batched collectives] in _fsdp_collectives.py."""
    groups = [g for g in groups if g.sharded_state is _SHARDED]
    if len(groups) <= 1:
        for g in groups:
            g.unshard(phase, pooled=True)
        return
    first = groups[0]
    if first.transport is None:
        first._check_transport("unshard")
    # The members that may borrow (see may_borrow) share one slot, end to
    # end, each aligned; the others own their memory. See [Note: the
    # unsharded buffer's memory].
    borrowers, offsets, nbytes = [], [], 0
    if first.pool is not None:
        forward = phase.in_forward
        backward = phase.in_backward
        for g in groups:
            if (g.reshard_after_forward and not g.is_root) if forward else (backward and g.reshard_after_backward):
                borrowers.append(g)
                offsets.append(nbytes)
                nbytes += -(-g.unsharded_nbytes // _SLOT_ALIGN) * _SLOT_ALIGN
    cached = first._gather_lists  # see below
    if cached is not None and cached[0] != groups:
        cached = None
    slot = first.pool.take(nbytes) if borrowers else None
    if slot is not None:
        slot.place_all(borrowers, offsets,
                       cached[2] if cached is not None and len(borrowers) == len(groups) else None)
    issue = (time.monotonic_ns(), phase.value)
    placed = {id(g) for g in borrowers} if slot is not None else ()
    for g in groups:
        g.begin_unshard(issue, slot if id(g) in placed else None, batched=True)
    # The same units gather as one batch every iteration: their tensors'
    # lists are made once (the shards, buffers and views are the units' for good).
    if cached is None:
        cached = first._gather_lists = (groups, [cut for g in groups for cut in g.shard_views],
                                        tuple(g.unsharded for g in groups),
                                        collectives.rank_major([g.rank_views for g in groups], first.world_size))
    future = collectives.all_gather_units(first.transport, cached[1], cached[2], cached[3], first.compute_dtype)
    future.members = groups  # the first wait unshards them all: see _wait_all_gather
    for g in groups:
        g.gathering(future)


# The unshard pool's slots: prefetch depth + 1 (the batch computing and the
# one gathered ahead). See [Note: the unsharded buffer's memory].
POOL_SLOTS = 2
# Where in a slot each unit of a batch starts: a multiple of this many bytes
# (a cache line, and any dtype's element size).
_SLOT_ALIGN = 64


class PoolSlot:
    """One slot of an ``UnshardPool``: memory that the unsharded buffers of
    one batch of units point into while unsharded. Taken whole (``take``)
    while no unit points into it; each unit is placed at its offset
    (``place``) and gives its part back at reshard (``give_back``); free
    again once the last has. See [Note: the unsharded buffer's memory]."""

    def __init__(self, index: int, device: torch.device):
        self.index = index
        self.device = device  # the root's units' device
        self.memory: torch.Tensor | None = None  # uint8; grows within an iteration; freed by UnshardPool.release
        self.base = 0  # the memory's address
        # The units pointing into it now: id -> (unit, offset in bytes).
        self.users: dict[int, tuple[FSDPParamGroup, int]] = {}
        self.taken = False  # handed out by the pool, not yet free again
        # Where the last unit placed since the take ends: a batch's units are
        # placed end to end, in order, so a placement before it overlaps one.
        self.placed_end = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.memory is None else self.memory.numel()

    def take(self, nbytes: int) -> None:
        if self.taken or self.users:
            raise RuntimeError(
                f"pydist FSDP unshard pool: slot {self.index} handed out again while units "
                f"{[pg.label for pg, _ in self.users.values()]} still point into it; their parameters would be "
                "overwritten by another unit's. This is a bug in pydist: please report it"
            )
        if self.nbytes < nbytes:
            self.memory = None  # no unit points into it: free the old memory first
            self.memory = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.base = self.memory.data_ptr()
        self.taken = True
        self.placed_end = 0

    def place(self, pg: FSDPParamGroup, offset: int) -> None:
        """Points ``pg``'s unsharded buffer at ``[offset, offset + its bytes)``."""
        end = offset + pg.unsharded_nbytes
        if not self.taken or offset < self.placed_end:
            raise RuntimeError(
                f"pydist FSDP unshard pool: unit {pg.label!r} placed at bytes [{offset}, {end}) of slot "
                f"{self.index}, " + (f"before the end of the last unit placed ({self.placed_end})" if self.taken
                                     else "which is not taken") + "; this is a bug in pydist"
            )
        _C.point_storage_into(pg.unsharded, self.memory, offset)
        self.placed_end = end
        self.users[id(pg)] = (pg, offset)

    def place_all(self, groups: list[FSDPParamGroup], offsets: list[int], buffers=None) -> None:
        """``place`` of each of ``groups`` at its offset (ascending), in one
        C++ call; ``buffers``: their unsharded buffers, where the caller has them."""
        if not self.taken or (offsets and offsets[0] < self.placed_end):
            raise RuntimeError(
                f"pydist FSDP unshard pool: units {[pg.label for pg in groups]} placed in slot {self.index} "
                + ("before the end of the last unit placed" if self.taken else "which is not taken")
                + "; this is a bug in pydist"
            )
        _C.point_storages_into(buffers or [pg.unsharded for pg in groups], self.memory, offsets)
        users = self.users
        for pg, offset in zip(groups, offsets):
            users[id(pg)] = (pg, offset)
        self.placed_end = offsets[-1] + groups[-1].unsharded_nbytes

    def give_back(self, pg: FSDPParamGroup) -> None:
        """``pg`` reshards: its storage holds nothing again; the slot is free
        once no unit is left in it."""
        _, offset = self.users.pop(id(pg))
        expected = self.base + offset
        actual = _C.point_storage_at_nothing(pg.unsharded)
        if not self.users:
            self.taken = False
        if actual != expected:
            raise RuntimeError(
                f"pydist FSDP unit {pg.label!r}: its unsharded storage was re-pointed (at {actual:#x}, its place in "
                f"unshard pool slot {self.index} is {expected:#x}) while unsharded; something outside pydist "
                "resized or swapped the storage of an unsharded parameter"
            )


class UnshardPool:
    """The memory a root's units unshard into: POOL_SLOTS ``PoolSlot``s.
    See [Note: the unsharded buffer's memory]."""

    def __init__(self, device: torch.device = torch.device("cpu"), num_slots: int = POOL_SLOTS):
        self.slots = [PoolSlot(i, device) for i in range(num_slots)]

    def take(self, nbytes: int) -> PoolSlot | None:
        """A free slot of at least ``nbytes`` (one that already is, else a
        free one grown), or None when every slot is taken."""
        free = [slot for slot in self.slots if not slot.taken]
        if not free:
            return None
        slot = next((s for s in free if s.nbytes >= nbytes), free[0])
        slot.take(nbytes)
        return slot

    def release(self) -> None:
        """Frees the memory of every slot no unit points into: the root calls
        it when an iteration's unsharding is over (the end of backward; a
        forward without grad), so the pool holds nothing between iterations."""
        for slot in self.slots:
            if not slot.taken:
                slot.memory = None
                slot.base = 0

    @property
    def nbytes(self) -> int:
        """What the slots hold now."""
        return sum(slot.nbytes for slot in self.slots)


class ReduceLayout:
    """Where the units of one reduce batch lie in its rank-major input (see
    [Note: batched collectives]): each member's column in a row, and the
    row's length. The root's reduce plan keeps it across iterations while
    the batches it cuts stay the same (see Schedule.plan_backward),
    with what finalize hands out in the common case."""

    __slots__ = ("members", "columns", "row", "hand_out")

    def __init__(self, members: list[FSDPParamGroup]):
        self.members = members
        self.columns: dict[int, int] = {}
        row = 0
        for pg in members:
            self.columns[id(pg)] = row
            row += pg.shard_numel
        self.row = row
        # (FSDPParamGroup.trainable_epoch, then the shards and offsets that
        # _hand_out_grads gives them): when every member arrived and hands
        # its trainable shards a .grad, while no unit's trainable list changed.
        self.hand_out: tuple | None = None

    def trainable_hand_out(self) -> tuple[list, list]:
        """The shards and offsets when every member hands out its trainable shards."""
        cached = self.hand_out
        if cached is None or cached[0] != FSDPParamGroup.trainable_epoch:
            params, offsets = [], []
            for pg in self.members:
                pg.grads_to_hand_out(params, offsets, self.columns[id(pg)])
            self.hand_out = cached = (FSDPParamGroup.trainable_epoch, params, offsets)
        return cached[1], cached[2]


class ReduceInputs:
    """A root's reductions on a device, holding their inputs only as long as needed.

    [Note: reduce inputs on a device]
    A reduction's input (a batch's rank-major input, a lone unit's packed
    gradients) is needed until its collective has read it. On the CPU the
    collective is done when the transport says so, and a reduce batch takes
    a done sibling's input (``GradBatch``). On a device a collective is
    "done" on the host once issued (NCCL's work completes with its stream's
    events) while its stream may still read the input, and the process
    group keeps the input (NCCL stashes it) until the work is waited on;
    left to the end of backward, the inputs add up to a whole unsharded
    gradient. Here, a root's reductions on a device, in launch
    order: each launch waits for every reduction launched before the
    previous one and lets go of their inputs. NCCL's wait makes the compute
    stream wait for the collective's end (no host wait) and hands the input
    back to the caching allocator, which reuses it in stream order; gloo's
    blocks until its staged copy is done (gloo's work keeps its tensors
    until the handle goes, so there the memory is not freed before the end
    of backward). The wait falls on a reduction that had at least one
    unit's compute to overlap with, as FSDP2's post-backward waits for the
    previous unit's reduce-scatter; about two inputs stay alive."""

    def __init__(self):
        self._in_flight: list = []  # (future, let_go), in launch order; inputs still held

    def launched(self, future, let_go) -> None:
        """A reduction started: ``future`` its transport future, ``let_go``
        drops the references to its input."""
        for earlier, drop in self._in_flight[:-1]:
            earlier.wait()
            drop()
        self._in_flight = self._in_flight[-1:] + [(future, let_go)]

    def clear(self) -> None:
        self._in_flight = []


class GradBatch:
    """Units whose gradients are reduce-scattered as one collective in one
    backward, laid out by a ``ReduceLayout`` the root's reduce plan chose
    (see [Note: gather and reduce plans]). Its input is
    rank-major, each member a column of every rank's row (see [Note:
    batched collectives]); each member's ``post_backward`` packs its
    gradients into its column; the last one to arrive launches the
    collective. ``launch`` early (the root's final callback, for a batch
    some member never reached) sends the collective as planned, zeros in
    the columns of the members that did not arrive; a later one then goes
    alone. ``finalize`` waits once and hands every arrived member's shards
    their ``.grad``.

    Its input is needed only until its collective is done: a batch whose
    first member arrives takes the input of an earlier batch of the same
    backward (``siblings``) whose collective is done, where one is large
    enough, rather than new memory. So a backward holds about two inputs at
    a time, not one per batch, and writes into memory the process already
    has, where fresh memory (above glibc's mmap threshold, or given back to
    the kernel at the end of the last iteration) costs a page fault per
    page at its first write. On the CPU only: see [Note: reduce inputs on
    a device] for a device's."""

    def __init__(self, layout: ReduceLayout, siblings: list["GradBatch"]):
        self.layout = layout
        self.members = layout.members
        self.columns = layout.columns
        self.row = layout.row
        self.siblings = siblings  # this backward's batches (this one among them once planned)
        first = layout.members[0]
        self.world_size = first.shard_world_size
        transport = first.transport
        self.copy_scale = collectives.copy_scale(transport)  # see [Note: where the 1/N goes]
        self.transport_scale = collectives.transport_scale(transport)
        self.input: torch.Tensor | None = None  # allocated at the first member's arrival
        self.arrived: list[FSDPParamGroup] = []  # arrival order
        self.launched = False
        self.issued_ns = 0
        self.future = None  # the collective, once launched
        self.output: torch.Tensor | None = None
        self.replica: ReplicaReduce | None = None  # HSDP: the all-reduce over the replicas, once started

    def add(self, pg: FSDPParamGroup, grads: list) -> None:
        pg.pack_grads(grads, self.input_for(pg), self.world_size, self.columns[id(pg)], self.copy_scale)
        self.arrive(pg)

    def add_params(self, pg: FSDPParamGroup) -> list[bool]:
        """``add`` of the .grads on ``pg``'s unsharded parameters, which are
        cleared; returns which parameters had one."""
        had = pg.pack_param_grads(self.input if self.input is not None else self.input_for(pg), self.world_size,
                                  self.columns[id(pg)], self.copy_scale)
        self.arrive(pg)
        return had

    def input_for(self, pg: FSDPParamGroup) -> torch.Tensor:
        """The batch's rank-major input, allocated (or taken from a done
        sibling: see the class's docstring) at the first member's packing."""
        if self.input is None:
            numel = self.world_size * self.row
            for other in self.siblings if pg.device.type == "cpu" else ():
                spare = other.input
                if (other.launched and spare is not None and spare.numel() >= numel and spare.dtype == pg.reduce_dtype
                        and other.future.done()):
                    other.input = None  # its collective is done with it: see the class's docstring
                    self.input = spare.narrow(0, 0, numel)
                    return self.input
            self.input = torch.empty(numel, dtype=pg.reduce_dtype, device=pg.device)
        return self.input

    def arrive(self, pg: FSDPParamGroup) -> None:
        """``pg`` packed its gradients into its column; the last member's arrival launches the batch."""
        self.arrived.append(pg)
        if len(self.arrived) == len(self.members):
            self.launch()

    def abandon(self) -> None:
        """After an iteration raised: waits for its collectives in flight
        (every rank issued them); their results are the failed backward's."""
        if self.replica is not None:  # HSDP: its all-reduce too
            self.replica.wait()
        elif self.future is not None:
            self.future.wait()

    def launch(self) -> None:
        if self.launched or not self.arrived:
            return
        self.launched = True
        if len(self.arrived) < len(self.members):
            rows = self.input.view(self.world_size, self.row)
            arrived = {id(pg) for pg in self.arrived}
            for pg in self.members:
                if id(pg) not in arrived:
                    column = self.columns[id(pg)]
                    rows[:, column:column + pg.shard_numel].zero_()
        transport = self.arrived[0].transport
        self.output = torch.empty(self.row, dtype=self.input.dtype, device=self.input.device)
        self.issued_ns = time.monotonic_ns()
        self.future = transport.reduce_scatter(self.input, self.output, self.transport_scale)
        if self.arrived[0].reduce_inputs is not None:
            self.arrived[0].reduce_inputs.launched(self.future, self._let_go_of_input)

    def _let_go_of_input(self) -> None:
        self.input = None

    def reduce_replicas(self) -> None:
        """HSDP: once the batch's reduce-scatter is done, starts the
        all-reduce of its output over the replicas. See [Note: HSDP]."""
        replicate = self.arrived[0].replicate_transport if self.arrived else None
        if replicate is not None and self.future is not None and self.replica is None:
            self.replica = ReplicaReduce(replicate, self.future, self.issued_ns, self.output,
                                         [(pg, self.columns[id(pg)]) for pg in self.arrived])

    def finalize(self, all_trainable: bool = False) -> None:
        """Waits for the collective (and the replicas' all-reduce, HSDP);
        records it for every arrived member and hands their shards their
        ``.grad``. ``all_trainable``: every unit hands out its trainable
        shards (no unit's ``_grads_for`` is set)."""
        self.siblings = None  # the list holds this batch: leave no cycle for the garbage collector
        if self.future is None:
            return
        self.reduce_replicas()
        held = False
        if self.replica is not None:
            records, held = self.replica.wait(), self.replica.held
        else:
            needed = time.monotonic_ns()
            records = [("reduce_scatter", Phase.BACKWARD.value, self.issued_ns, needed, self.future.wait())]
        self.future = self.replica = None
        arrived = self.arrived
        if held:  # set_requires_all_reduce(False): the shards wait in the units' _partial, no .grad now
            for pg in arrived:
                pg.record(records)
            self.input = self.output = None
            return
        for pg in arrived:
            if pg.all_reduce_hook is not None:
                pg.all_reduce_hook(self.output.narrow(0, self.columns[id(pg)], pg.shard_numel))
        # The arrived members' parts, each at its column, in one C++ call.
        if len(arrived) == len(self.members) and (all_trainable or all(pg._grads_for is None for pg in arrived)):
            _hand_out_grads(self.output, arrived[0], *self.layout.trainable_hand_out())
        else:
            params, offsets = [], []
            for pg in arrived:
                pg.grads_to_hand_out(params, offsets, self.columns[id(pg)])
            _hand_out_grads(self.output, arrived[0], params, offsets)
        for pg in arrived:
            pg.record(records)
        self.input = self.output = None
