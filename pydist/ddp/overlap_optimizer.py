"""DistributedDataParallel.overlap_optimizer: each bucket's parameters are
updated as soon as that bucket's all-reduce lands, and the next forward waits
only for the updates of the parameters it uses.

    model = pydist.DistributedDataParallel(module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.overlap_optimizer(opt)
    for x in data:
        opt.zero_grad()
        model(x).sum().backward()   # returns when autograd is done
        opt.step()                  # returns at once: updates land bucket by bucket

The pipeline of one step (names in call order):

    backward ends      the reducer's end_backward: every bucket is in flight,
                       nothing waited for (reducer state Finishing)
    opt.step()         queue_updates: hyperparameters snapshotted, one job per
                       bucket queued in update_order
    update worker      run_jobs: the landed buckets first (the link decides the
                       order, see [Note: the worker follows the link]),
                       run_buckets: reducer.finish_bucket(b) for each (waits
                       for b's all-reduce, writes its averaged grads to .grad),
                       then one call of the user's optimizer on their
                       parameters only ([Note: one update for the buckets at
                       hand]); with updates="forward" (what "auto" picks
                       without a spare core per rank) there is no worker
                       ([Note: which thread updates])
    next forward       each module's forward pre-hook: wait_for_buckets of the
                       parameters registered on it (running a bucket's job on
                       the main thread if nobody has; with updates="forward",
                       every landed bucket first: [Note: the forward updates
                       what has landed])
    end of forward     wait_updates: every update landed before any backward
                       (synced or under no_sync) writes gradients again

See docs/overlap-optimizer.md for what waits and what is refused.
"""

from __future__ import annotations

import copy
import enum
import queue
import threading
import time
import types
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["OverlappedOptimizer", "UpdateState", "UpdateRecord", "BucketUpdate", "UPDATE_THREADS", "choose_update_thread",
           "wait_all_grads", "order_by_priority"]

# Optimizers whose update of a parameter reads only that parameter, its
# gradient and its own state, so updating bucket by bucket gives the same
# bits as one step over all parameters. See [Note: why element-wise only].
_ELEMENT_WISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)

# [Note: why element-wise only]
# overlap_optimizer runs the user's optimizer once per bucket, on a view of
# its param_groups holding that bucket's parameters. That equals one step
# over every parameter exactly when each parameter's update depends on its
# own gradient and state alone: SGD (momentum, nesterov, weight decay), Adam,
# AdamW, in their for-loop, foreach and fused forms (foreach and fused batch
# tensors but compute each element from the same operands). An optimizer that
# reads the whole model (LBFGS: a closure re-running the model and a line
# search over every parameter) or a step with a closure cannot be split, and
# is refused by name; other classes are refused as not known to be
# element-wise.


class UpdateState(enum.Enum):
    """Where the optimizer's updates stand (one per OverlappedOptimizer)."""

    IDLE = "idle"                        # parameters and optimizer state are current
    GRADS_IN_FLIGHT = "grads_in_flight"  # a backward ended with buckets in flight; opt.step() not called yet
    UPDATING = "updating"                # opt.step() queued the updates; buckets land one by one


@dataclass
class BucketUpdate:
    """One bucket's update in one step; times in ms since opt.step() was called."""

    index: int                  # the reducer's bucket index (launch order)
    num_params: int
    landed_ms: float = -1.0     # its all-reduce had completed and grads were written back
    update_start_ms: float = -1.0  # the optimizer began updating its parameters
    updated_ms: float = -1.0    # the optimizer had updated its parameters
    forward_wait_ms: float = 0.0  # how long the next forward's pre-hooks waited for it
    thread: str = ""            # "worker" or "forward" (the main thread needed it first)


@dataclass
class UpdateRecord:
    """What one opt.step() under overlap_optimizer did, per bucket, in update order."""

    step: int
    start_ns: int               # time.monotonic_ns() when opt.step() was called
    buckets: list[BucketUpdate] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"step {self.step}: bucket updates (ms since opt.step())",
                 f"{'bucket':>6} {'params':>6} {'landed':>8} {'updated':>8} {'fwd wait':>8} {'by':>7}"]
        for b in self.buckets:
            lines.append(f"{b.index:>6} {b.num_params:>6} {b.landed_ms:>8.2f} {b.updated_ms:>8.2f} "
                         f"{b.forward_wait_ms:>8.2f} {b.thread:>7}")
        return "\n".join(lines)


def update_order(bucket_indices: list[list[int]]) -> list[int]:
    """The order of urgency in which the worker considers buckets: the
    reverse of launch order, the order the next forward needs them in (the
    reducer's chunk_priority, which the link's queue follows: [Note: the
    worker follows the link])."""
    return list(range(len(bucket_indices)))[::-1]


# [Note: the worker follows the link]
# Which bucket lands when is decided in one place, the link's queue (on the
# simulated link, [Note: the link's queue] in csrc/transport/
# sim_net_transport.cpp), from the priority the reducer states per chunk
# (the later launched, the more urgent). The worker does not second-guess
# it: of the buckets not yet claimed, it updates one that has landed (the
# most urgent such), and when none has, waits for the most urgent one, which
# on a prioritizing link is the next to land. On a first-in-first-out link
# (gloo, shared memory) the buckets land in launch order and the worker
# takes them as they land all the same. The next forward's pre-hooks claim
# a bucket on the main thread when they need it before the worker got to it.


# [Note: which thread updates]
# updates="worker": a thread of its own applies each bucket's update as the
# bucket lands, so the updates of buckets the next forward needs later run
# while the forward computes, on a core the forward does not use. Both
# threads run Python (the optimizer's for-loop, the modules' forward), so
# they take turns on the GIL; torch's kernels release it, so with a spare
# core per rank the update's arithmetic runs beside the forward's. With no
# spare core (this 2-core machine, 2 ranks) there is nothing to run in
# parallel: each hand-over between the threads is a wake-up on a busy core,
# and the turns slow both.
# updates="forward": no worker; the main thread applies the updates, from
# the next forward's pre-hooks, and never idles while a bucket that has
# landed waits: see [Note: the forward updates what has landed].
# updates="auto" (the default) picks one when overlap_optimizer is called,
# from the cores this process may run on (os.sched_getaffinity) and the
# ranks sharing its host (LOCAL_WORLD_SIZE where a launcher sets it, else
# pydist.topology): "worker" when there are at
# least two cores per rank, else "forward". Either way a bucket is claimed
# once (run_buckets) and its update waits for its all-reduce.
UPDATE_THREADS = ("auto", "worker", "forward")


# [Note: priority on every link]
# The chunks the next forward needs first should cross the link first
# ([Note: transfer priority] in csrc/transport/transport.h). A simulated
# link orders its queue itself; a real one carries collectives in launch
# order. The "ordered" wrapper ([Note: ordering a real link] in
# csrc/transport/ordered_transport.cpp) lets rank 0 decide the order for
# every rank, at the price of one small all-reduce per chunk on the same
# transport. overlap_optimizer puts it in place of the reducer's transport,
# for as long as it is attached, where that price is paid beside the data:
# a gloo group whose ranks are on more than one host (gloo runs collectives
# on several threads of its own, so a decision does not wait behind a
# chunk's transfer). The wrapper issues collectives from completion
# callbacks, at moments of its own, so it gets a gloo group of the same
# ranks to itself (made at the wrapper's first attach, a collective over the
# world, and kept for its later ones): on the DDP
# group, the program's own collectives there (a buffer broadcast, the
# bucket rebuild's agreement, the user's) would interleave with them in a
# different order on different ranks. A DDP group smaller than the world
# keeps first in, first out (its fresh group would need every rank of the
# world to call this). It commits a chunk while fewer than two chunks' bytes
# are in flight (ByteScheduler's credit), so the next decision and start
# overlap the current transfer; one at a time, each decision's round trip
# idles the link.
#
# Not where the decisions would queue between the data: the hierarchical
# transport (one pipeline of legs per collective), the mpi4py group (one
# thread per group) or NCCL (one stream); nor on one host, where the link is
# memory or loopback and a decision costs about a chunk's transfer; nor a
# comm hook (its own communication) or a group of one. Measured on this
# 2-core machine (docs/overlap-optimizer.md, benchmarks/bench_overlap_tbf.py:
# deep model, 0.25 MB chunks, hosts emulated over tc-tbf veths), ordered /
# first in first out: gloo, 2 hosts x 1 rank 1.00-1.06x at 1 Gbit/s and
# 0.95-1.00x at 300 Mbit/s, the next forward's wait for the front bucket
# 31 -> 8 ms and 108 -> 19 ms (one chunk at a time 1.30-1.34x at 1 Gbit/s);
# hierarchical, 2 x 2: 1.22-1.36x at 1 Gbit/s whatever the credit; gloo on
# one host (loopback) 1.29x; shared memory within noise. Detaching puts the
# transport back.
ORDERED_CREDIT_CHUNKS = 2
# Each DDP wrapper's gloo group for the ordered wrapper, made at its first
# attach and kept for the next ones: a group made per attach would hold its
# sockets and threads to the end of the process.
_decision_transports: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def order_by_priority(ddp):
    """Puts the "ordered" wrapper in front of ``ddp``'s reducer's transport
    where [Note: priority on every link] says so; returns the transport it
    replaced, or None when it changed nothing."""
    from pydist import topology
    from pydist import transport as transports

    current, group = ddp.reducer.transport, ddp.process_group
    if not isinstance(current, transports.ProcessGroupTransport) or current.name != "gloo":
        return None
    if current.world_size != dist.get_world_size() or len(topology.of(group, build_groups=False).hosts) == 1:
        return None
    own = _decision_transports.get(ddp)
    if own is None:  # every rank attaches alike, so every rank makes it at its first attach
        own = transports.ProcessGroupTransport(dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                                              timeout=topology.timeout_of(group)))
        own.failure_context = current.failure_context
        _decision_transports[ddp] = own
    chunk = min(ddp._chunk_bytes or ddp.bucket_bytes_cap, ddp.bucket_bytes_cap)  # chunk_bytes 0: whole buckets
    ddp.reducer.set_transport(transports.wrap("ordered", own, inflight_bytes=ORDERED_CREDIT_CHUNKS * chunk))
    return current


# How often updates="forward" looks for landed buckets while the one it
# needs is in flight (each look: one landed_buckets() call, ~10 us).
_LANDED_POLL_S = 0.0002


def choose_update_thread(cores: int, ranks_on_host: int) -> str:
    """updates="auto" for a process that may run on ``cores`` cores, one of
    ``ranks_on_host`` ranks on its host: see [Note: which thread updates]."""
    return "worker" if cores >= 2 * ranks_on_host else "forward"


def _auto_update_thread(ddp) -> str:
    import os

    from pydist import topology

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")  # what launchers (pydist.run, torchrun) say
    if local.isdigit() and int(local) > 0:
        return choose_update_thread(cores, int(local))
    # Collective the first time for this group; a CPU model's wrapper has already asked.
    topo = topology.of(ddp.process_group, build_groups=False)
    return choose_update_thread(cores, len(topo.hosts[topo.host]))


# [Note: the forward updates what has landed]
# With updates="forward" one thread does everything between opt.step() and
# the end of the next forward: every bucket's update and the forward itself,
# which ends only when every update has landed (_post_forward). Their order
# does not change how much there is to do, so that forward ends soonest when
# the thread never waits for a bucket while another one has landed and is
# not updated. So when a module needs a bucket whose all-reduce is still in
# flight, its pre-hook first updates every bucket that has landed (one call
# of the optimizer: [Note: one update for the buckets at hand]) and looks
# again. While nothing has landed it looks again every _LANDED_POLL_S (the
# reducer offers a wait for one bucket, not for the first of several), so a
# back bucket that lands while the front one is still in flight is updated
# within that time; only when no other bucket is left does it wait on the
# one it needs. On a fast link (10 Gb/s here) the
# communication tail after backward, which plain DDP waits for before
# opt.step(), is spent updating the buckets that landed during backward.


# Every OverlappedOptimizer alive (weakly), for wait_all_grads.
_LIVE: "weakref.WeakSet[OverlappedOptimizer]" = weakref.WeakSet()


# [Note: clipping and loss scaling wait for the gradients]
# Between loss.backward() and the updates, a bucket's .grad holds this rank's
# gradient until its all-reduce lands. torch's clip_grad_norm_ (its norm) and
# GradScaler.unscale_ (its inf check) read every gradient before the step, so
# on those gradients they would compute a wrong norm, or miss an overflow,
# silently. pydist already puts its own norm and inf check in torch's place
# (pydist/fsdp/_clip_grad.py, _grad_scaler.py); both call wait_all_grads
# first, which waits for every in-flight gradient of every live
# overlap_optimizer. What it costs: that step's communication tail is exposed
# as in plain DDP (the updates still overlap the next forward). With no
# overlap_optimizer alive it is one look at an empty set.
def wait_all_grads() -> None:
    """Every live overlap_optimizer's gradients are averaged and in .grad.
    See [Note: clipping and loss scaling wait for the gradients]."""
    for overlapped in list(_LIVE):
        if overlapped._state is not UpdateState.IDLE or overlapped.opt_grads_pending():
            overlapped.wait_grads()


class _Job:
    """One bucket's update in one step: claimed once, by the worker or the main thread."""

    __slots__ = ("bucket", "groups", "group_ids", "claimed", "updated", "done", "error", "record")

    def __init__(self, bucket: int, groups: list[dict], group_ids: list[int], record: BucketUpdate):
        self.bucket = bucket
        self.groups = groups        # the bucket's view of param_groups (hyperparameters as at opt.step())
        self.group_ids = group_ids  # the index in opt.param_groups of each of groups
        self.claimed = False        # guarded by OverlappedOptimizer._lock
        self.updated = False        # its update is applied (guarded by the lock: the deferred zero_grad reads it)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.record = record


class OverlappedOptimizer:
    """Attaches ``opt`` to ``ddp`` (see the module docstring). Lives as long
    as the wrapper; ``ddp._overlap`` holds it."""

    def __init__(self, ddp, opt: torch.optim.Optimizer, updates: str = "worker"):
        _check_optimizer(opt)
        # "worker" or "forward" ("auto" resolved here): see [Note: which thread updates]
        self.updates = _auto_update_thread(ddp) if updates == "auto" else updates
        self._ddp = weakref.ref(ddp)  # no cycle: the wrapper owns this object
        _LIVE.add(self)  # see wait_all_grads
        self.opt = opt
        # The optimizer's own step, without its hooks (refused above) and
        # without the per-call profiling wrapper: run once per bucket.
        step = type(opt).step
        self._real_step = getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step
        self._real_zero_grad = type(opt).zero_grad
        # IDLE or UPDATING (set here); GRADS_IN_FLIGHT is read off the reducer (see `state`).
        self._state = UpdateState.IDLE
        # Guards the jobs' claims and the deferred zero_grad.
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}  # bucket index -> this step's job (UPDATING only)
        # zero_grad(set_to_none) called while UPDATING: applied to each bucket after its update.
        self._pending_zero: bool | None = None
        # Jobs of this step not yet updated (guarded by the lock): at 0 the
        # forward pre-hooks return at once. A failed job stays counted, so
        # the hooks go on to raise its error.
        self._open = 0
        self._steps = 0
        self.records: deque[UpdateRecord] = deque(maxlen=ddp._records_kept)
        # Bucket layout cache: (reducer layout key) -> per bucket, per group, its params.
        self._layout_key = None
        self._bucket_groups: list[list[tuple[int, list[torch.Tensor]]]] = []
        self._outside: list[tuple[int, list[torch.Tensor]]] = []  # opt params no bucket holds: updated at step()
        # Which buckets hold each parameter (by id), for the forward pre-hooks.
        self._bucket_of: dict[int, int] = {}
        # The link ordered where it pays, first (collective, and may raise): see [Note: priority on every link].
        self._unordered = order_by_priority(ddp)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        if updates == "worker":
            threading.Thread(target=_worker_loop, args=(weakref.ref(self), self._queue),
                             name="pydist-overlap-optimizer", daemon=True).start()
        self._hooks = self._install(ddp)
        ddp.reducer.set_defer_finalize(True)

    @property
    def state(self) -> UpdateState:
        if self._state is UpdateState.IDLE and self.opt_grads_pending():
            return UpdateState.GRADS_IN_FLIGHT
        return self._state

    # --- lifecycle: attach ---------------------------------------------------

    def _install(self, ddp) -> list:
        opt = self.opt
        me = weakref.ref(self)

        # Each replacement falls back to the optimizer's own method once the
        # wrapper (and this object with it) is gone.
        def step(opt_self, closure=None):
            if me() is None:
                return type(opt_self).step(opt_self, closure)
            if closure is not None:
                raise RuntimeError(
                    f"{type(opt_self).__name__}.step(closure): overlap_optimizer applies updates bucket by bucket "
                    "after opt.step() returns, so a closure re-evaluating the model cannot run; call step() without "
                    "a closure, or use DistributedDataParallel without overlap_optimizer")
            opt_self._opt_called = True  # what an LR scheduler's step-order check reads
            me().queue_updates()

        def zero_grad(opt_self, set_to_none: bool = True):
            if me() is None:
                return type(opt_self).zero_grad(opt_self, set_to_none)
            me().zero_grad(set_to_none)

        def state_dict(opt_self):
            if me() is not None:
                me().wait_updates()
            return type(opt_self).state_dict(opt_self)

        def load_state_dict(opt_self, state_dict):
            if me() is not None:
                me().wait_updates()
            return type(opt_self).load_state_dict(opt_self, state_dict)

        # The instance attributes replaced here (an LR scheduler's step
        # wrapper, say), put back by detach().
        self._replaced = {}
        for name, fn in (("step", step), ("zero_grad", zero_grad), ("state_dict", state_dict),
                         ("load_state_dict", load_state_dict)):
            if name in opt.__dict__:
                self._replaced[name] = opt.__dict__[name]
            setattr(opt, name, types.MethodType(fn, opt))
        # An LR scheduler checks that opt.step is still its wrapper; ours sets
        # the flag that wrapper would (_opt_called), so keep its mark.
        step._wrapped_by_lr_sched = getattr(self._replaced.get("step"), "_wrapped_by_lr_sched", False) or None
        if step._wrapped_by_lr_sched is None:
            del step._wrapped_by_lr_sched

        hooks = []
        for module in ddp.module.modules():
            own = [p for p in module.parameters(recurse=False)]
            if own:
                hooks.append(module.register_forward_pre_hook(_ForwardWait(me, own)))
        hooks.append(ddp.module.register_state_dict_pre_hook(_WaitAll(me)))
        hooks.append(ddp.module.register_load_state_dict_pre_hook(_WaitAll(me)))
        return hooks

    def detach(self) -> None:
        """Undo overlap_optimizer: wait for the updates, restore the
        optimizer's methods, remove the hooks, stop the worker."""
        self.wait_updates()
        for name in ("step", "zero_grad", "state_dict", "load_state_dict"):
            self.opt.__dict__.pop(name, None)
        self.opt.__dict__.update(self._replaced)
        for h in self._hooks:
            h.remove()
        self._queue.put(None)
        ddp = self._ddp()
        if ddp is not None:
            ddp.reducer.set_defer_finalize(False)
            if self._unordered is not None:
                ddp.reducer.set_transport(self._unordered)

    def __del__(self):
        self._queue.put(None)  # the worker ends

    # --- the step: queue_updates -> run_bucket -> wait_updates -------------------

    def _layout(self) -> None:
        """Per bucket, per param group, the bucket's parameters (cached until
        the buckets or the optimizer's param_groups change)."""
        ddp = self._ddp()
        groups = self.opt.param_groups
        key = (ddp.reducer.has_rebuilt_buckets, id(ddp.reducer),
               tuple(tuple(map(id, g["params"])) for g in groups))
        if key == self._layout_key:
            return
        buckets = ddp.reducer.bucket_indices()
        params = ddp._params
        bucket_of = {id(params[i]): b for b, indices in enumerate(buckets) for i in indices}
        self._bucket_of = bucket_of
        per_bucket: list[dict[int, list]] = [{} for _ in buckets]
        outside: dict[int, list] = {}
        for g_index, g in enumerate(groups):
            for p in g["params"]:
                b = bucket_of.get(id(p))
                (outside if b is None else per_bucket[b]).setdefault(g_index, []).append(p)
        self._bucket_groups = [sorted(d.items()) for d in per_bucket]
        self._outside = sorted(outside.items())
        self._layout_key = key

    def queue_updates(self) -> None:
        """opt.step(): snapshot the hyperparameters of every param group (an
        LR scheduler's change after this call applies to the next step, as
        with torch), update the parameters no bucket holds now, and queue one
        job per bucket."""
        ddp = self._ddp()
        if self._state is UpdateState.UPDATING:
            self.wait_updates()  # two steps on one backward: the second reads the first's results, as torch
        self._layout()
        hyper = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
                 for g in self.opt.param_groups]
        record = UpdateRecord(self._steps, time.monotonic_ns())
        self._steps += 1
        if ddp.reducer.state != "Finishing":
            # No backward left buckets in flight (a step after wait_grads(), a
            # second step, static_graph's first iteration): every gradient is
            # in .grad; one step over everything, now.
            self._step_on([dict(hyper[i], params=g["params"]) for i, g in enumerate(self.opt.param_groups)])
            return
        if self._outside:
            self._step_on([dict(hyper[g], params=ps) for g, ps in self._outside])
        jobs = {}
        for b in update_order(self._bucket_groups):
            groups = [dict(hyper[g], params=ps) for g, ps in self._bucket_groups[b]]
            rec = BucketUpdate(b, sum(len(ps) for _, ps in self._bucket_groups[b]))
            record.buckets.append(rec)
            jobs[b] = _Job(b, groups, [g for g, _ in self._bucket_groups[b]], rec)
        with self._lock:
            self._jobs = jobs
            self._pending_zero = None
            self._open = len(jobs)
        self._state = UpdateState.UPDATING
        if ddp._record_timing:
            self.records.append(record)
        self._record_start = record.start_ns
        if self.updates == "worker":
            self._queue.put(list(jobs.values()))  # in update_order

    def run_bucket(self, job: _Job, thread: str) -> None:
        """Wait for the bucket's all-reduce, then update its parameters: once
        per job, by whichever thread claims it first."""
        self.run_buckets([job], thread)

    def run_buckets(self, jobs: list[_Job], thread: str, then_landed: bool = False) -> None:
        """run_bucket for each of ``jobs`` not claimed yet, with one call of
        the optimizer over all of their parameters: see [Note: one update
        for the buckets at hand]. ``then_landed``: once those have landed,
        also take every bucket that landed meanwhile and nobody claimed."""
        with self._lock:
            mine = [job for job in jobs if not job.claimed]
            for job in mine:
                job.claimed = True
        if not mine:
            return
        try:
            ddp = self._ddp()
            for job in mine:
                ddp.reducer.finish_bucket(job.bucket)  # waits (GIL released) and writes grads back
                job.record.landed_ms = (time.monotonic_ns() - self._record_start) / 1e6
            if then_landed:
                landed = set(ddp.reducer.landed_buckets())
                with self._lock:
                    more = [job for job in self._jobs.values() if job.bucket in landed and not job.claimed]
                    for job in more:
                        job.claimed = True
                mine += more
                for job in more:
                    ddp.reducer.finish_bucket(job.bucket)  # landed: does not wait
                    job.record.landed_ms = (time.monotonic_ns() - self._record_start) / 1e6
            started = (time.monotonic_ns() - self._record_start) / 1e6
            groups = _merged_groups(mine)
            if groups:
                self._step_on(groups)
            updated = (time.monotonic_ns() - self._record_start) / 1e6
            with self._lock:
                for job in mine:
                    job.record.update_start_ms, job.record.updated_ms, job.record.thread = started, updated, thread
                    job.updated = True
                if self._pending_zero is not None and groups:
                    self._zero(groups, self._pending_zero)  # one call for the lot, as the update
                self._open -= len(mine)
        except BaseException as error:  # noqa: BLE001 - re-raised on the main thread by wait_*
            for job in mine:
                job.error = error
        finally:
            for job in mine:
                job.done.set()

    def run_jobs(self, jobs: list[_Job]) -> None:
        """The worker's share of one step: see [Note: the worker follows the link]."""
        ddp = self._ddp()
        if ddp is None:
            return
        pending = jobs
        while True:
            pending = [job for job in pending if not job.claimed]
            if not pending:
                return
            landed = set(ddp.reducer.landed_buckets())
            at_hand = [job for job in pending if job.bucket in landed]
            self.run_buckets(at_hand or pending[:1], "worker")

    def _step_on(self, groups: list[dict]) -> None:
        """The user's optimizer on a view holding ``groups`` (its state dict
        shared, so state created here is the optimizer's own)."""
        view = object.__new__(type(self.opt))
        view.__dict__.update(self.opt.__dict__)
        view.param_groups = groups
        self._real_step(view)

    def _zero(self, groups: list[dict], set_to_none: bool) -> None:
        view = object.__new__(type(self.opt))
        view.__dict__.update(self.opt.__dict__)
        view.param_groups = groups
        self._real_zero_grad(view, set_to_none)

    def wait_for_buckets(self, buckets) -> None:
        """The forward pre-hook's wait: these buckets' updates have landed
        (run on this thread when the worker has not started them)."""
        jobs = self._jobs
        for b in buckets:
            job = jobs.get(b)
            if job is None or job.done.is_set():
                continue
            start = time.monotonic_ns()
            if self.updates == "forward":
                self._update_until(job)
            else:
                self.run_bucket(job, "forward")
            job.done.wait()
            job.record.forward_wait_ms += (time.monotonic_ns() - start) / 1e6
            if job.error is not None:
                raise job.error

    def _update_until(self, job: _Job) -> None:
        """updates="forward": ``job`` is claimed, having updated whatever
        landed before it. See [Note: the forward updates what has landed]."""
        reducer = self._ddp().reducer
        while not job.claimed:
            landed = set(reducer.landed_buckets())
            unclaimed = [j for j in self._jobs.values() if j is not job and not j.claimed]
            others = [j for j in unclaimed if j.bucket in landed]
            if job.bucket in landed or not unclaimed:
                self.run_buckets([job, *others], "forward", then_landed=True)
            elif others:
                self.run_buckets(others, "forward")
            else:
                time.sleep(_LANDED_POLL_S)  # nothing landed yet: look again soon

    def wait_updates(self) -> None:
        """Every queued update has landed; with no opt.step() after the last
        backward, its gradients are written back (nothing updated)."""
        ddp = self._ddp()
        if self._state is UpdateState.UPDATING:
            self.run_buckets(list(self._jobs.values()), "forward")  # those nobody claimed: one call
            errors = []
            for job in self._jobs.values():
                job.done.wait()
                if job.error is not None:
                    errors.append(job.error)
            with self._lock:
                self._jobs = {}
                self._pending_zero = None
            self._state = UpdateState.IDLE
            if errors:
                raise errors[0]
        if ddp is not None and ddp.reducer.state == "Finishing":
            ddp.reducer.finish_all()
        self._state = UpdateState.IDLE

    def wait_grads(self) -> None:
        """The last backward's gradients are averaged and in .grad (before
        opt.step(): for clip_grad_norm_ or GradScaler.unscale_). Costs the
        overlap of communication with the optimizer for this step."""
        ddp = self._ddp()
        if self._state is UpdateState.UPDATING:
            self.wait_updates()
        if ddp.reducer.state == "Finishing":
            ddp.reducer.finish_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """opt.zero_grad(): while updates are in flight, each bucket's grads
        are zeroed right after its update (the update still reads them)."""
        if self._state is UpdateState.GRADS_IN_FLIGHT or self.opt_grads_pending():
            self.wait_grads()
        if self._state is not UpdateState.UPDATING:
            self._real_zero_grad(self.opt, set_to_none)
            return
        with self._lock:
            self._pending_zero = set_to_none
            groups = _merged_groups([job for job in self._jobs.values() if job.updated])
            if groups:
                self._zero(groups, set_to_none)
        if self._outside:
            self._zero([{"params": ps} for _, ps in self._outside], set_to_none)

    def opt_grads_pending(self) -> bool:
        """A backward ended and no opt.step() has queued its updates yet."""
        ddp = self._ddp()
        return self._state is not UpdateState.UPDATING and ddp is not None and ddp.reducer.state == "Finishing"


# [Note: one update for the buckets at hand]
# Every call of the optimizer's step has a fixed cost in Python (the
# decorators, one pass over its param groups, the foreach grouping), paid
# once per bucket when buckets are updated one by one: about 3 ms a step for
# the 16 buckets of bench_overlap.py's deep model, against a link that at
# 10 Gb/s leaves only a millisecond of communication to hide. So whoever
# takes a bucket also takes every other bucket that has landed and nobody
# claimed, and updates them all with one call. That is still exactly one
# step over every parameter ([Note: why element-wise only]): which
# parameters share a call changes no element's arithmetic.
def _merged_groups(jobs: list[_Job]) -> list[dict]:
    """The param groups of ``jobs`` merged by optimizer param group, in job order."""
    if not jobs:
        return []
    if len(jobs) == 1:
        return jobs[0].groups
    merged: dict[int, dict] = {}
    for job in jobs:
        for g, group in zip(job.group_ids, job.groups):
            if g in merged:
                merged[g]["params"] = merged[g]["params"] + group["params"]
            else:
                merged[g] = dict(group)
    return [merged[g] for g in sorted(merged)]


def _gone():
    return None


class _Hook:
    """A hook of the wrapped module holding the OverlappedOptimizer weakly. A
    pickled or deep-copied module carries it inert (the copy has no
    optimizer attached): a weak reference cannot be pickled."""

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_owner"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._owner = _gone

    def __deepcopy__(self, memo):
        copied = copy.copy(self)
        copied._owner = _gone
        return copied


class _WaitAll(_Hook):
    """state_dict / load_state_dict pre-hook: every update has landed."""

    def __init__(self, owner):
        self._owner = owner

    def __call__(self, *args, **kwargs):
        overlapped = self._owner()
        if overlapped is not None:
            overlapped.wait_updates()


class _ForwardWait(_Hook):
    """Forward pre-hook of a module owning parameters: wait for their buckets."""

    def __init__(self, owner, params):
        self._owner = owner
        self._param_ids = [id(p) for p in params]
        self._buckets = (None, [])  # (the layout key they were read for, the buckets holding the params)

    def __call__(self, module, args):
        overlapped = self._owner()
        if overlapped is None or overlapped._state is not UpdateState.UPDATING or not overlapped._open:
            return None
        key, buckets = self._buckets
        if key is not overlapped._layout_key:
            bucket_of = overlapped._bucket_of
            buckets = sorted({bucket_of[i] for i in self._param_ids if i in bucket_of})
            self._buckets = (overlapped._layout_key, buckets)
        overlapped.wait_for_buckets(buckets)
        return None


def _worker_loop(owner_ref, jobs: queue.SimpleQueue) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        owner = owner_ref()
        if owner is None:
            return
        owner.run_jobs(item)
        del owner


def _check_optimizer(opt) -> None:
    """Refuse, naming the reason, an optimizer that cannot be split by bucket."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"overlap_optimizer: expected a torch.optim.Optimizer, got {type(opt).__name__}")
    if isinstance(opt, torch.optim.LBFGS):
        raise ValueError(
            "overlap_optimizer: LBFGS is not element-wise: its step takes a closure that re-evaluates the whole "
            "model and a line search over every parameter, so it cannot be applied bucket by bucket")
    if type(opt) not in _ELEMENT_WISE:
        raise ValueError(
            f"overlap_optimizer: {type(opt).__name__} is not one of the optimizers known to update each parameter "
            f"from its own gradient and state ({', '.join(t.__name__ for t in _ELEMENT_WISE)}); see [Note: why "
            "element-wise only] in pydist/ddp/overlap_optimizer.py")
    from torch.optim import optimizer as optim_module

    hooks = [*opt._optimizer_step_pre_hooks.values(), *opt._optimizer_step_post_hooks.values(),
             *optim_module._global_optimizer_pre_hooks.values(), *optim_module._global_optimizer_post_hooks.values()]
    if hooks:
        raise ValueError(
            f"overlap_optimizer: the optimizer has {len(hooks)} step hook(s); they would run once per bucket, "
            "after opt.step() returned. Remove them (or run their work before opt.step())")
    if any(g.get("differentiable", False) for g in opt.param_groups):
        raise ValueError("overlap_optimizer: differentiable=True optimizers are not supported (the update runs "
                         "off the autograd graph, on another thread)")
