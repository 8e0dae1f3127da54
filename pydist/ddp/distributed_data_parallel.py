"""pydist.DistributedDataParallel: torch's DDP interface over pydist's C++ reducer.

    from pydist import DistributedDataParallel as DDP
    model = DDP(model)            # every torch DDP argument keeps its meaning

What happens in one training step (see csrc/reducer/reducer.h for the C++ half):

    forward   _pre_forward:  join bookkeeping, the one-time bucket rebuild,
                             buffer broadcast from rank 0
              module(...)
              _post_forward: arm the reducer (prepare_for_backward)
    backward  C++ hooks fill buckets and launch their all-reduces in order;
              an autograd callback waits and writes averaged grads back

Python runs a few times per step, never per gradient.

The class subclasses torch's ``DistributedDataParallel`` so that library code
testing ``isinstance(model, torch.nn.parallel.DistributedDataParallel)``
(unwrap helpers, ``torch.distributed.checkpoint.state_dict``, Dynamo's
DDPOptimizer) treats it as one, but never runs torch's ``__init__``: there is
no torch reducer and no ``dist.Logger`` here. See [Note: the torch DDP
surface] for what every inherited method does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from pydist import _C
from pydist.ddp import buckets as bucketing
from pydist.ddp.overlap_optimizer import UPDATE_THREADS, OverlappedOptimizer, UpdateRecord
from pydist.ddp.records import IterationRecord
from pydist.ddp.state_sync import broadcast_tensors, verify_same_model
from pydist.transport import ProcessGroupTransport, lost_hosts_context, open_shm
from pydist.overlap import hooks as overlap_hooks

__all__ = ["DistributedDataParallel"]

# Iterations whose records a wrapper keeps unless set_record_timing says otherwise.
_DEFAULT_RECORDS_KEPT: int = _C.DEFAULT_RECORDS_KEPT

# torch DDP keywords pydist accepts only at their default: anything else
# raises NotImplementedError naming the keyword, never a silent ignore.
_UNSUPPORTED_KEYWORDS: dict[str, Any] = {
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "mixed_precision": None,
    "skip_all_reduce_unused_params": False,
    "bucket_cap_mb_list": None,
    "batched_grad_copy": False,
    "forward_sync_buffers": None,
}


# [Note: the torch DDP surface]
# pydist's wrapper is a torch DDP to isinstance, so every method it inherits
# must either do what torch's does, over pydist's state, or raise
# NotImplementedError naming itself: an inherited method that reached for
# torch's reducer would half-work. Implemented with torch's meaning:
# forward, no_sync, register_comm_hook, _register_builtin_comm_hook,
# _register_fused_optim (through register_comm_hook, as torch does),
# _set_static_graph (before the first forward), parameters_to_ignore and
# _set_params_and_buffers_to_ignore_for_model (inherited: it only marks the
# module), will_sync_module_buffers, _get_ddp_logging_data / logger (what
# pydist knows), join and its hooks, pickling and deepcopy, and the inherited
# helpers that only read attributes (scatter, gather, to_kwargs, train,
# _get_active_ddp_module, _inside_ddp_forward, _distributed_rank,
# _set_ddp_sink_clone, _get_data_parallel_params). Refused: the methods in
# _NOT_IMPLEMENTED below.
_NOT_IMPLEMENTED = {
    "_register_buffer_comm_hook": "buffer comm hooks",
    "_remove_autograd_hooks": "removing the reducer's hooks (dropping the wrapper removes them)",
    "_check_reducer_finalized": "the reducer-finalized check",
    "_set_sparse_metadata": "sparse gradients",
    "_update_process_group": "changing the process group of a live wrapper",
    "_set_ddp_runtime_logging_sample_rate": "sampled runtime logging (pydist records every iteration with record_timing=True)",
    "_ddp_init_helper": "torch's reducer construction",
    "_build_params_for_reducer": "torch's reducer construction",
    "_register_accum_grad_hook": "torch's compiled-autograd Python reducer",
    "_register_delay_all_reduce_hook": "delay_all_reduce_named_params",
    "_delayed_all_reduce_hook": "delay_all_reduce_named_params",
    "_setup_in_backward_optimizers": "optimizers applied in backward (_apply_optimizer_in_backward)",
    "_lazy_init": "optimizers applied in backward (_apply_optimizer_in_backward)",
    "_fire_reducer_autograd_hook": "torch's compiled-autograd Python reducer",
    "_root_copy_hook": "mixed_precision",
    "_module_wait_for_copy_hook": "mixed_precision",
    "_clear_grad_buffer": "delay_all_reduce_named_params",
}


def _not_implemented(name: str, what: str):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(
            f"DistributedDataParallel.{name}: pydist does not implement {what}; use torch.nn.parallel.DistributedDataParallel"
        )

    refuse.__name__ = name
    return refuse


# torch's class, bound once: Dynamo reads _active_ddp_module from it, and
# pydist.patch_torch() replaces the name torch.nn.parallel.DistributedDataParallel.
_TorchDDP = torch.nn.parallel.DistributedDataParallel


class DistributedDataParallel(_TorchDDP):
    """Data parallelism at module level, with torch DDP's constructor and
    behaviour. pydist-only keywords: ``first_bucket_cap_mb`` (size of the
    first, small bucket; default 1 MB when ``bucket_cap_mb`` is not given,
    else ``bucket_cap_mb``, as torch), ``allreduce_chunk_mb`` (all-reduce
    each bucket in pieces of about this size as its gradients arrive; 0 for
    whole buckets; see [Note: chunked launches] in csrc/reducer/reducer.h),
    ``shm_allreduce`` (None: gradients of a CPU model whose ranks share one
    host are all-reduced through shared memory instead of the process group;
    across hosts with two or more ranks on each, through shared memory
    inside each host and the group across them (docs/clusters.md);
    elsewhere on the group; True: shared memory or an error; False: always
    the group; see [Note: which transport]), ``record_timing`` (keep
    per-chunk and per-bucket records of the last iterations, read with
    ``iteration_records()`` / ``last_iteration_record()``; see
    ``set_record_timing`` and pydist/ddp/records.py) and ``sim_net`` (e.g.
    "10Gbps,20us": gradients go over a simulated link, as PYDIST_SIM_NET
    does; see pydist/overlap/network.py)."""

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool | None = True,
        init_sync: bool = True,
        process_group=None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,  # deprecated in torch, accepted and ignored as there
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        device_mesh=None,
        first_bucket_cap_mb: float | None = None,
        allreduce_chunk_mb: float = 4.0,
        shm_allreduce: bool | None = None,
        record_timing: bool = False,
        sim_net: str | None = None,
        **torch_keywords: Any,
    ):
        # Not torch DDP's __init__: it would build torch's reducer. See
        # [Note: the torch DDP surface].
        nn.Module.__init__(self)
        Joinable.__init__(self)
        _reject_unsupported(torch_keywords)
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call pydist.init_process_group() "
                "(or torch.distributed.init_process_group()) first"
            )
        self.module = module
        self.process_group = _group_of(process_group, device_mesh)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        # torch's parameters_to_ignore: qualified names of parameters and
        # buffers left out of every synchronization (construction broadcast,
        # gradient averaging, buffer broadcast), set on the module by
        # _set_params_and_buffers_to_ignore_for_model before wrapping.
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        _check_module_supported(module, self.parameters_to_ignore)
        self.device = _module_device(module, device_ids)
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = True if broadcast_buffers is None else broadcast_buffers
        self.forward_sync_buffers = self.broadcast_buffers  # torch >= 2.13's name for it
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self._rank = dist.get_rank()
        _set_torch_ddp_attributes(self)

        # Gradients are synchronized unless inside no_sync(); buffers are
        # broadcast before a forward only when the previous forward synced.
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

        self.first_bucket_bytes_cap, self.bucket_bytes_cap = bucketing.bucket_caps(bucket_cap_mb, first_bucket_cap_mb)
        # What the reducer is built from, kept so that _set_static_graph and
        # unpickling can build it again.
        self._record_timing = record_timing
        self._records_kept = _DEFAULT_RECORDS_KEPT
        self._chunk_bytes = int(allreduce_chunk_mb * bucketing.MB)
        self._sim_net = sim_net  # [overlap hook] read by overlap_hooks.transport_for

        self._collect_params()
        if not self._params:
            raise RuntimeError("DistributedDataParallel: the module has no parameter that requires grad")

        if init_sync:
            synced = self._synced_params()
            verify_same_model(synced, self.process_group)
            states = [p for _, p in synced]
            if self.broadcast_buffers:
                states += self._buffers_to_sync
            broadcast_tensors(states, src=_global_rank(self.process_group, 0), group=self.process_group)

        # This rank's end of the shared-memory transport, or None: gradients
        # go through the process group. Lives as long as the reducer.
        self._shm = open_shm(self.process_group, self._params, wanted=shm_allreduce,
                             owner="DistributedDataParallel", keyword="shm_allreduce")
        # On the plain group across hosts, a failed all-reduce names the other
        # hosts (pydist.transport.name_lost_hosts); "" on one host.
        self._lost_hosts = lost_hosts_context(self.process_group)
        self.reducer = self._make_reducer()
        # join(divide_by_initial_world_size=...): average over the world size
        # (True, torch's default) or over the ranks not yet joined.
        self._divide_by_initial_world_size = True
        self._averaging_over_active_ranks = False
        # Forwards run with gradients synchronized (torch's reducer counts the
        # same): _set_static_graph is refused after the first.
        self._num_sync_forwards = 0
        # (state, hook) given to register_comm_hook; re-registered when
        # _set_static_graph builds the reducer again.
        self._comm_hook: tuple | None = None
        # torch's `logger` (a dist.Logger there): what _get_ddp_logging_data reports.
        self.logger = DDPLogger(self)
        # overlap_optimizer's state (pydist/ddp/overlap_optimizer.py), or None.
        self._overlap: OverlappedOptimizer | None = None
        overlap_hooks.attach(self)  # [overlap hook] PYDIST_TRACE, PYDIST_RECORD_PLAN, overlap.record()

    def _collect_params(self) -> None:
        """The parameters the reducer owns: those that require grad and are
        not ignored, each once (tied parameters are one parameter), in model
        order; and the buffers to broadcast."""
        ignored = self.parameters_to_ignore
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and n not in ignored]
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # Where each of them is registered and its dtype, to notice a
        # parameter replaced after wrapping: see [Note: replaced parameters].
        self._param_slots = [_owner_slot(self.module, n) for n in self._param_names]
        self._param_dtypes = [p.dtype for p in self._params]
        self._param_owner_snapshots = _owner_snapshots(self._param_slots)
        self._assign_modules_buffers()

    def _synced_params(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter kept equal across ranks (requires grad or not), but the ignored."""
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    def _make_reducer(self) -> _C.Reducer:
        # static_graph: the first backward is reduced all at once at its end;
        # this flag records that the callback doing it has been queued.
        self._static_graph_delay_enqueued = False
        rebuild = bucketing.rebuilds_buckets(self.find_unused_parameters, self.static_graph)
        reducer = _C.Reducer(
            self._params,
            self._param_names,
            bucketing.initial_buckets(self._params, self.first_bucket_bytes_cap, self.bucket_bytes_cap, rebuild),
            self.process_group,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            rebuild_buckets=rebuild,
            record_timing=self._record_timing,
            records_kept=self._records_kept,
            chunk_bytes=self._chunk_bytes,
            # [overlap hook] PYDIST_SIM_NET / sim_net= put a simulated link in front
            transport=overlap_hooks.transport_for(self, self._shm),  # None: the process group's
        )
        overlap_hooks.reducer_made(self, reducer)  # [overlap hook] PYDIST_REPLAY
        if self._lost_hosts and isinstance(reducer.transport, ProcessGroupTransport):
            reducer.transport.failure_context = self._lost_hosts
        return reducer

    # --- pickling and deepcopy ------------------------------------------------

    def __getstate__(self):
        """As torch DDP: the process group, reducer and transport stay behind;
        __setstate__ builds them again on the default group."""
        self._check_default_group()
        self.wait_updates()
        state = dict(self.__dict__)
        # Dropped too: what _collect_params derives again in __setstate__.
        derived = ("_param_names", "_params", "_param_slots", "_param_dtypes", "_param_owner_snapshots")
        # overlap_optimizer stays behind too: the copy has no optimizer attached.
        for name in ("process_group", "reducer", "_shm", "logger", "_comm_hook", "_overlap", *derived):
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        nn.Module.__setstate__(self, state)
        self.process_group = dist.distributed_c10d._get_default_group()  # raises if there is none, as torch
        self._collect_params()
        # [Note: an unpickled wrapper reduces on the process group]
        # Opening the shared-memory transport is a collective, and torch
        # unpickles a DDP with none (torch.load on one rank must not wait for
        # the others), so the copy all-reduces on the group.
        self._shm = None
        self._lost_hosts = ""  # no collective here: see name_lost_hosts
        self._comm_hook = None  # torch does not carry comm hooks over either
        self._overlap = None
        self.reducer = self._make_reducer()
        self.logger = DDPLogger(self)

    def _check_default_group(self) -> None:
        if self.process_group is not dist.group.WORLD and self.process_group != dist.distributed_c10d._get_default_group():
            raise RuntimeError(
                "DistributedDataParallel: pickling and deepcopy are only supported with the default process group "
                "(as torch DDP): construct it without process_group= to copy it"
            )

    # --- forward ------------------------------------------------------------

    # [Note: DDP under torch.compile]
    # As torch does for its own DDP, Dynamo does not trace the wrapper's
    # bookkeeping: forward's own frame is skipped (recursive=False, so the
    # wrapped module's frames are still compiled), and _pre_forward /
    # _post_forward run eagerly with everything they call. While the module
    # runs, this wrapper is torch DDP's _active_ddp_module (what torch's
    # _inside_ddp_forward sets): Dynamo's DDPOptimizer splits the graphs it
    # compiles then at bucket_bytes_cap. Nothing the reducer does reaches a
    # guard, so the bucket rebuild after the first iteration recompiles
    # nothing. (Same graph breaks as torch DDP: 3 on a 3-layer MLP.)
    @torch._disable_dynamo(recursive=False)
    def forward(self, *inputs, **kwargs):
        with torch.autograd.profiler.record_function("pydist.DistributedDataParallel.forward"):
            inputs, kwargs = self._pre_forward(*inputs, **kwargs)
            # torch's _inside_ddp_forward, without its context manager's cost
            # (this frame is never traced, so it needs no Dynamo guard)
            torch_ddp = _TorchDDP  # torch's class, also while pydist.patch_torch() is active
            outer, torch_ddp._active_ddp_module = torch_ddp._active_ddp_module, self
            try:
                output = self.module(*inputs, **kwargs)
            finally:
                torch_ddp._active_ddp_module = outer
            return self._post_forward(output)

    @torch._disable_dynamo
    def _pre_forward(self, *inputs, **kwargs):
        if torch.is_grad_enabled():
            self._check_params_unchanged()
        work = Join.notify_join_context(self)
        if work is not None and not self._divide_by_initial_world_size:
            # Average over the ranks still training: the join context's
            # all-reduce of ones counts them.
            work.wait()
            self.reducer.set_average_divisor(int(work.result()[0].item()))
            self._averaging_over_active_ranks = True
        elif self._averaging_over_active_ranks:  # the join context has closed
            self.reducer.set_average_divisor(dist.get_world_size(self.process_group))
            self._averaging_over_active_ranks = False
        if self._overlap is not None:
            # See [Note: where overlap_optimizer waits].
            if not self.reducer.has_rebuilt_buckets and bucketing.rebuilds_buckets(self.find_unused_parameters, self.static_graph):
                self._overlap.wait_updates()  # the one-time rebuild needs every bucket finished
            elif self._overlap.opt_grads_pending():
                self._overlap.wait_updates()  # a backward nobody stepped on: its gradients are written back
        if torch.is_grad_enabled():
            self._maybe_rebuild_buckets()
            if self.require_backward_grad_sync:
                self._num_sync_forwards += 1
                self.logger.note_iteration()
        if self._will_sync_buffers():
            self._sync_buffers()
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs), self.device)
        return inputs, kwargs

    @torch._disable_dynamo
    def _post_forward(self, output):
        if self._overlap is not None:
            self._overlap.wait_updates()  # before any backward writes gradients again
        if not (torch.is_grad_enabled() and self.require_backward_grad_sync):
            self.require_forward_param_sync = False
            return output
        self.require_forward_param_sync = True
        # The reducer walks the graph from the outputs only where it looks
        # for unused parameters (find_unused_parameters without static_graph);
        # otherwise the output tree is not walked at all.
        self.reducer.prepare_for_backward(_find_tensors(output) if self.reducer.walks_outputs else [])
        if self.static_graph and not self._static_graph_delay_enqueued:
            output = _wrap_outputs_in_sink(self, output)
        return output

    # [Note: replaced parameters]
    # The reducer hooks the parameter tensors it was given. A parameter
    # replaced afterwards (module.to_empty(), or a .to() that makes new
    # Parameters) would train on without its gradient ever being averaged,
    # and one whose dtype changed (.double()) no longer fits its bucket. Both
    # are refused at the next forward, before any rank diverges. The check
    # compares, in C loops, each owning module's registered parameters by
    # identity with what was wrapped (every forward that computes
    # gradients), and the parameters' dtypes (the first such forward).
    def _check_params_unchanged(self) -> None:
        owners_unchanged = all(
            len(owner._parameters) == len(snapshot) and all(map(operator.is_, owner._parameters.values(), snapshot))
            for owner, snapshot in self._param_owner_snapshots
        )
        # dtypes cost a descriptor call each: checked on the first forward only
        if owners_unchanged and (self._num_sync_forwards or list(map(_DTYPE_OF, self._params)) == self._param_dtypes):
            return
        for (owner, key), p, dtype, name in zip(self._param_slots, self._params, self._param_dtypes, self._param_names):
            now = owner._parameters.get(key)
            if now is not p or p.dtype != dtype:
                what = "was replaced by another tensor" if now is not p else f"changed dtype from {dtype} to {p.dtype}"
                raise RuntimeError(
                    f"DistributedDataParallel: parameter '{name}' {what} after the module was wrapped "
                    "(module.to_empty(), load_state_dict(assign=True), .double() ...); its gradients would no longer "
                    "be averaged. Materialize, move and cast the module first, then wrap it in DistributedDataParallel."
                )
        self._param_owner_snapshots = _owner_snapshots(self._param_slots)  # another parameter changed: not ours

    def _maybe_rebuild_buckets(self) -> None:
        order = self.reducer.pending_rebuild_order()  # None: no rebuild due (see buckets.rebuilds_buckets)
        if order is None:
            return
        mine = bucketing.rebuilt_buckets(self._params, order, self.first_bucket_bytes_cap, self.bucket_bytes_cap)
        self.reducer.rebuild_buckets(bucketing.agree_on_buckets(mine, len(self._params), self.process_group, self.device))

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """torch's flag: the buckets were rebuilt from the gradient order."""
        return self.reducer.has_rebuilt_buckets

    # --- buffers ------------------------------------------------------------

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        """torch's name for the buffers DDP broadcasts."""
        return self._buffers_to_sync

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers from rank 0 (torch's meaning)."""
        return self._will_sync_buffers()

    def _will_sync_buffers(self) -> bool:
        return self.require_forward_param_sync and self.broadcast_buffers and bool(self._buffers_to_sync)

    def _check_and_sync_module_buffers(self) -> None:
        if self._will_sync_buffers():
            self._sync_buffers()

    def _assign_modules_buffers(self) -> None:
        """Collect the buffers to broadcast again, as torch does before each
        broadcast: a buffer the module reassigned (self.x = new tensor) is
        broadcast, not the one it dropped."""
        self._buffers_to_sync = [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def _sync_buffers(self, joined: bool = False) -> None:
        src = _global_rank(self.process_group, 0)
        if self._join_config.enable:
            src = self._find_common_rank(self._rank, not joined)
        self._assign_modules_buffers()
        preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
        guard = preserve(tuple(self._buffers_to_sync)) if preserve else contextlib.nullcontext()
        with torch.no_grad(), guard:
            broadcast_tensors(self._buffers_to_sync, src=src, group=self.process_group)

    # --- torch DDP's public surface ------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after leaving
        the context synchronizes the accumulated sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Run ``hook(state, bucket: dist.GradBucket) -> Future[Tensor]`` in
        place of the all-reduce, once per bucket (torch's contract: the
        hook receives the bucket's summed-to-be gradients undivided)."""
        if not callable(hook):
            raise TypeError("register_comm_hook: the hook must be callable")
        self.reducer.set_comm_hook(state, hook)
        self._comm_hook = (state, hook)
        self.logger.comm_hook = getattr(hook, "__qualname__", repr(hook))

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch's built-in hooks, as the Python hooks of the same meaning."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        if comm_hook_type not in hooks:
            raise NotImplementedError(f"_register_builtin_comm_hook: pydist does not know {comm_hook_type}")
        self.register_comm_hook(None, hooks[comm_hook_type])
        self.logger.comm_hook = str(comm_hook_type)

    def _set_static_graph(self) -> None:
        """static_graph=True after construction, before the first forward (torch's rule)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        if self._num_sync_forwards:
            raise RuntimeError(
                "DistributedDataParallel._set_static_graph() must be called before the first forward "
                f"({self._num_sync_forwards} have run); pass static_graph=True to the constructor instead"
            )
        self.static_graph = True
        self.reducer = None  # its destructor unhooks the parameters before the new one hooks them
        self.reducer = self._make_reducer()
        if self._overlap is not None:
            self.reducer.set_defer_finalize(True)
        if self._comm_hook is not None:
            self.reducer.set_comm_hook(*self._comm_hook)
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will detect "
                "unused parameters automatically, so you do not need to set find_unused_parameters=true, just be sure "
                "these unused parameters will not change during training loop while calling `_set_static_graph`.",
                stacklevel=2,
            )

    def _get_ddp_logging_data(self) -> dict:
        """torch's logging dictionary, with the entries pydist knows (see DDPLogger)."""
        data = self.logger._get_ddp_logging_data()
        return {**data.strs_map, **data.ints_map}

    def _log_and_throw(self, err_type, err_msg):
        raise err_type(err_msg)

    # --- records (pydist/ddp/records.py, csrc/reducer/records.h) ----------------

    def last_iteration_record(self) -> IterationRecord | None:
        """The record of the last synchronized backward, or None (requires
        ``record_timing=True``, or ``set_record_timing(True)``)."""
        return IterationRecord.from_reducer(self.reducer.last_record())

    def iteration_records(self) -> list[IterationRecord]:
        """The records of the last ``keep`` synchronized backwards (see
        ``set_record_timing``), oldest first."""
        return [IterationRecord.from_reducer(r) for r in self.reducer.iteration_records()]

    def clear_records(self) -> None:
        """Forget the records kept so far."""
        self.reducer.clear_records()

    def set_record_timing(self, on: bool, keep: int = _DEFAULT_RECORDS_KEPT) -> None:
        """Record (or stop recording) every synchronized backward from the
        next forward on, keeping the last ``keep`` iterations' records.
        Off, the reducer and its transport read no clock."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"set_record_timing: keep must be a positive int (iterations to keep), got {keep!r}")
        self.reducer.set_record_timing(on, keep)
        self._record_timing = on
        self._records_kept = keep

    @property
    def allreduce_transport(self) -> str:
        """Where gradient buckets are all-reduced: "shm" (shared memory, ranks
        on one host), "hierarchical" (shared memory inside each host and the
        process group across hosts) or "process_group". A comm hook does its
        own communication either way."""
        if self._shm is None:
            return "process_group"
        return "hierarchical" if self._shm.name.startswith("hierarchical") else "shm"

    def bucket_indices(self) -> list[list[int]]:
        """The current buckets as lists of parameter indices, in launch order."""
        return self.reducer.bucket_indices()

    # --- overlap_optimizer (pydist/ddp/overlap_optimizer.py) ---------------------

    # [Note: where overlap_optimizer waits]
    # After overlap_optimizer(opt), a backward leaves its buckets in flight
    # and opt.step() returns at once; updates land bucket by bucket. What
    # waits for them (pending updates, or a backward's gradients with no
    # opt.step() after it):
    #   - a forward: each module, before its forward, for the buckets of the
    #     parameters registered on it; the whole forward at its end, before
    #     a backward (synced or under no_sync) writes gradients again;
    #   - the forward that rebuilds the buckets (the first ones only);
    #   - model.state_dict() / load_state_dict() (of the wrapper or the
    #     wrapped module), opt.state_dict() / opt.load_state_dict(), pickling
    #     and deepcopy, join's hooks, model.zero_grad(), model.wait_updates();
    #   - opt.zero_grad() does not wait: each bucket's grads are zeroed right
    #     after its update.
    #   - torch's clip_grad_norm_ / get_total_norm and GradScaler.unscale_
    #     (see [Note: clipping and loss scaling wait for the gradients]).
    # Not intercepted: reading p.data / p.grad directly (call wait_updates()
    # or wait_grads() first), and a forward reading a parameter of a module
    # whose own forward has not run yet.

    def overlap_optimizer(self, opt: torch.optim.Optimizer, updates: str = "auto") -> None:
        """Apply ``opt`` bucket by bucket as each bucket's all-reduce lands.

        From now on ``loss.backward()`` returns when autograd is done,
        ``opt.step()`` returns at once, and each bucket's parameters are
        updated by ``opt`` (its own param_groups, state and
        hyperparameters as they were when ``step()`` was called) as soon as
        the bucket's all-reduce completes; the next forward's modules wait
        only for their own parameters. ``opt`` must be SGD, Adam or AdamW
        (element-wise: for-loop, foreach or fused). See
        docs/overlap-optimizer.md and [Note: where overlap_optimizer waits].

        ``updates`` says which thread applies them: "worker" (a thread of
        its own, each bucket as it lands, the next forward taking over the
        buckets it needs first), "forward" (the next forward's pre-hooks,
        which update whatever has landed before they wait: no second thread
        contending for the GIL) or "auto" (the default: "worker" where each
        rank of this host has a spare core, else "forward"). See [Note:
        which thread updates]."""
        if updates not in UPDATE_THREADS:
            raise ValueError(f"overlap_optimizer: updates={updates!r}; expected one of "
                             f"{', '.join(map(repr, UPDATE_THREADS))}")
        if opt is None:
            self._detach_overlap()
            return
        if self._overlap is not None:
            if self._overlap.opt is opt:
                return
            raise RuntimeError("overlap_optimizer: another optimizer is already attached to this model; "
                               "call model.overlap_optimizer(None) first to detach it")
        if self.reducer.state != "Idle":
            raise RuntimeError(f"overlap_optimizer: call it between iterations (the reducer is {self.reducer.state})")
        self._overlap = OverlappedOptimizer(self, opt, updates)

    def _detach_overlap(self) -> None:
        if self._overlap is not None:
            self._overlap.detach()
            self._overlap = None

    def wait_updates(self) -> None:
        """Wait until every update overlap_optimizer queued has landed (and
        the last backward's gradients are written back). No-op without it."""
        if self._overlap is not None:
            self._overlap.wait_updates()

    def wait_grads(self) -> None:
        """Wait until the last backward's gradients are averaged and in
        .grad, before opt.step(), for code that reads .grad itself
        (torch's clip_grad_norm_ and GradScaler.unscale_ wait by themselves).
        It gives up this step's overlap of communication with the
        optimizer (the updates still overlap the next forward)."""
        if self._overlap is not None:
            self._overlap.wait_grads()

    def update_records(self) -> list[UpdateRecord]:
        """overlap_optimizer's per-bucket records of the last steps (with
        record_timing on): when each update landed and how long the next
        forward waited for it."""
        return [] if self._overlap is None else list(self._overlap.records)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wait_updates()  # the updates in flight still read these gradients
        super().zero_grad(set_to_none)

    # --- join (uneven inputs) -------------------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False):
        """Context manager for uneven inputs, as torch DDP's ``join``."""
        self.logger.join_uneven_inputs = 1
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs) -> JoinHook:
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        if self._divide_by_initial_world_size:
            self.reducer.set_average_divisor(dist.get_world_size(self.process_group))
        return _DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool):
        flag = torch.ones(1) if (not is_joined_rank and self.require_backward_grad_sync) else torch.zeros(1)
        work = dist.all_reduce(flag.to(self.device), group=self.process_group, async_op=True)
        if is_joined_rank:
            work.wait()
            return flag.item() != 0
        return None

    def _find_common_rank(self, rank: int, candidate: bool) -> int:
        """The highest rank among the candidates (one collective)."""
        t = torch.tensor([rank if candidate else -1], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(t.item())

    def _match_all_reduce_for_bwd_pass(self) -> None:
        self.reducer.match_all_reduce_for_bwd_pass()

    def _match_unused_params_allreduce(self) -> None:
        self.reducer.match_unused_params_allreduce()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        self.wait_updates()
        src = self._find_common_rank(self._rank, is_last_joiner)
        states = [p for _, p in self._synced_params()]
        if self.broadcast_buffers:
            states += self._buffers_to_sync
        broadcast_tensors(states, src=src, group=self.process_group)


for _name, _what in _NOT_IMPLEMENTED.items():
    setattr(DistributedDataParallel, _name, _not_implemented(_name, _what))


class _DDPJoinHook(JoinHook):
    """A joined rank shadows the collectives of ranks still training, in the
    order they issue them (see DistributedDataParallel._pre_forward)."""

    def __init__(self, ddp: DistributedDataParallel):
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.wait_updates()
        ddp._maybe_rebuild_buckets()
        if ddp._will_sync_buffers():
            ddp._sync_buffers(joined=True)
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        ddp._match_all_reduce_for_bwd_pass()
        ddp._match_unused_params_allreduce()  # the reducer knows whether active ranks reduce a used map

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


class _StaticGraphSink(torch.autograd.Function):
    """Identity on the outputs whose backward runs first in the *outer*
    backward, where it queues the one-time reduction of static_graph's first
    iteration (a callback queued from a parameter hook could land in a
    reentrant checkpoint's inner backward and run too early)."""

    @staticmethod
    def forward(ctx, ddp, *outputs):
        ctx.ddp = ddp
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        ddp = ctx.ddp
        if not ddp._static_graph_delay_enqueued:
            torch.autograd.Variable._execution_engine.queue_callback(ddp.reducer.delay_all_reduce)
            ddp._static_graph_delay_enqueued = True
        return (None, *grads)


def _wrap_outputs_in_sink(ddp, output):
    flat, spec = torch.utils._pytree.tree_flatten(output)
    positions = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
    if not positions:
        return output
    passed = _StaticGraphSink.apply(ddp, *[flat[i] for i in positions])
    for i, t in zip(positions, passed):
        flat[i] = t
    return torch.utils._pytree.tree_unflatten(flat, spec)


def _find_tensors(obj) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _find_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _find_tensors(item)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _find_tensors(getattr(obj, f.name))]
    return []


def _to_device(obj, device):
    if torch.is_tensor(obj):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _module_device(module: nn.Module, device_ids) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"DistributedDataParallel: the module's parameters are on several devices ({sorted(map(str, devices))}); "
            "pydist supports single-device modules"
        )
    device = next(iter(devices)) if devices else torch.device("cpu")
    if device_ids is not None:
        if device.type == "cpu":
            raise ValueError(
                f"DistributedDataParallel: device_ids={device_ids} but the module is on the CPU; "
                "pass device_ids=None for CPU modules"
            )
        if len(device_ids) != 1:
            raise ValueError(f"DistributedDataParallel: device_ids must name one device, got {device_ids}")
        wanted = torch.device(device.type, device_ids[0]) if isinstance(device_ids[0], int) else torch.device(device_ids[0])
        if wanted != device:
            raise ValueError(f"DistributedDataParallel: device_ids={device_ids} but the module is on {device}")
    return device


def _group_of(process_group, device_mesh):
    """The group to synchronize over: torch DDP's choice among
    ``process_group``, a 1-D ``device_mesh``'s group and the default group,
    with its errors."""
    if device_mesh is None:
        return process_group if process_group is not None else dist.group.WORLD
    if process_group is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    if device_mesh._get_root_mesh() != device_mesh:
        # torch rewrites the module's DTensor parameters for DDP + tensor parallelism here.
        raise NotImplementedError(
            f"DistributedDataParallel: pydist does not implement a device_mesh sliced from a larger mesh "
            f"({device_mesh}, of {device_mesh._get_root_mesh()}: DDP beside tensor parallelism); use torch's DDP")
    return device_mesh.get_group(mesh_dim=0)


def _global_rank(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _reject_unsupported(keywords: dict[str, Any]) -> None:
    for name, value in keywords.items():
        if name not in _UNSUPPORTED_KEYWORDS:
            raise TypeError(f"DistributedDataParallel got an unexpected keyword argument '{name}'")
        if value != _UNSUPPORTED_KEYWORDS[name]:
            raise NotImplementedError(
                f"DistributedDataParallel: pydist does not implement the torch keyword '{name}' "
                f"(got {value!r}); leave it at {_UNSUPPORTED_KEYWORDS[name]!r} or use torch's DDP"
            )


# --------------------------------------------------------------------------
# Construction checks
# --------------------------------------------------------------------------


def _check_module_supported(module: nn.Module, ignored: set) -> None:
    """Refuse, naming the parameter or layer and what to do, a module pydist
    cannot reduce correctly. Local checks only: they run before any
    collective, so every rank with such a module raises at once."""
    for name, p in module.named_parameters():
        if name in ignored:
            continue
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                f"DistributedDataParallel: parameter '{name}' is uninitialized (a lazy module). Modules with "
                "uninitialized parameters can't be used with DistributedDataParallel: run a dummy forward pass "
                "to initialize them, then wrap the module"
            )
        if p.is_meta:
            raise RuntimeError(
                f"DistributedDataParallel: parameter '{name}' is on the meta device (deferred initialization). "
                "Materialize the module first, then wrap it: module.to_empty(device=...), initialize its "
                "parameters (e.g. reset_parameters() on each submodule), then DistributedDataParallel(module). "
                "Materializing after wrapping replaces the parameters DDP hooked."
            )
        if p.layout != torch.strided:
            raise NotImplementedError(
                f"DistributedDataParallel: parameter '{name}' has layout {p.layout}; pydist reduces dense "
                "(strided) parameters only. Use torch.nn.parallel.DistributedDataParallel for sparse parameters"
            )
        if p.is_complex():
            raise NotImplementedError(
                f"DistributedDataParallel: parameter '{name}' is {p.dtype}; pydist reduces real floating-point "
                "parameters only. Store it as a real tensor (torch.view_as_real, shape [..., 2]) and view it as "
                "complex in forward, or use torch.nn.parallel.DistributedDataParallel"
            )
    for name, b in module.named_buffers():
        if name not in ignored and b.is_meta:
            raise RuntimeError(
                f"DistributedDataParallel: buffer '{name}' is on the meta device. Materialize the module "
                "first (module.to_empty(device=...) and initialize it), then wrap it"
            )
    device_types = {p.device.type for n, p in module.named_parameters() if n not in ignored}
    for name, layer in module.named_modules():
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.sparse:
            if layer.weight.requires_grad and f"{name}.weight".lstrip(".") not in ignored:
                raise NotImplementedError(
                    f"DistributedDataParallel: '{name}' is a {type(layer).__name__}(sparse=True), whose weight gets "
                    "sparse gradients; pydist averages dense gradients only. Construct it with sparse=False, or "
                    "use torch.nn.parallel.DistributedDataParallel (which reduces sparse gradients)"
                )
        if isinstance(layer, nn.SyncBatchNorm) and "cpu" in device_types:
            # torch: ValueError("SyncBatchNorm layers only work with GPU modules")
            raise ValueError(
                f"DistributedDataParallel: SyncBatchNorm layers only work with GPU modules, and '{name}' is a "
                "SyncBatchNorm in a CPU module. Use torch.nn.BatchNorm* on CPU (DDP broadcasts rank 0's "
                "running statistics before every forward)"
            )


def _owner_slot(module: nn.Module, qualified_name: str) -> tuple[nn.Module, str]:
    """The submodule a parameter is registered on and its key there."""
    owner_name, _, key = qualified_name.rpartition(".")
    return module.get_submodule(owner_name), key


def _owner_snapshots(slots) -> list[tuple[nn.Module, tuple]]:
    """Per module owning some of the reducer's parameters, the parameters
    registered on it now: the fast path of _check_params_unchanged."""
    owners = {id(owner): owner for owner, _ in slots}
    return [(owner, tuple(owner._parameters.values())) for owner in owners.values()]


_DTYPE_OF = operator.attrgetter("dtype")


def _set_torch_ddp_attributes(ddp: DistributedDataParallel) -> None:
    """Attributes torch DDP's __init__ sets that inherited helpers and Dynamo
    read, with the values that describe pydist's wrapper."""
    ddp._use_python_reducer = False  # Dynamo's optimize_ddp="python_reducer" mode: not supported
    ddp._delay_all_reduce_params = []
    ddp._delay_all_reduce_all_params = False
    ddp._delay_grad_buffer = None
    ddp.mixed_precision = None
    ddp.device_type = ddp.device.type
    ddp.is_multi_device_module = False
    ddp._module_parameters = [p for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
    ddp.broadcast_bucket_size = 250 * 1024 * 1024
    ddp.use_side_stream_for_tensor_copies = False
    ddp.skip_all_reduce_unused_params = False
    ddp.batched_grad_copy = False
    ddp._comm_hooks = []
    ddp._lazy_init_ran = True
    ddp._ddp_sink_clone = True


# --------------------------------------------------------------------------
# torch's DDP logging data
# --------------------------------------------------------------------------


class DDPLoggingData(NamedTuple):
    """The shape of torch's ``dist.DDPLoggingData``: string and integer entries."""

    strs_map: dict
    ints_map: dict


class DDPLogger:
    """Stands where torch DDP keeps its ``dist.Logger``: ``ddp.logger``.

    ``_get_ddp_logging_data()`` gives the entries of torch's logging data
    that pydist knows, under torch's names and meanings: the construction
    arguments, the model (``num_parameter_tensors``, ``total_parameter_size_bytes``,
    ``dtypes``), the buckets (``bucket_sizes`` at construction,
    ``rebuilt_bucket_sizes`` and ``rebuilt_per_bucket_param_indices`` after the
    rebuild), ``iteration`` and, when ``record_timing`` is on, torch's
    backward averages in nanoseconds (``avg_backward_compute_time``: end of
    forward to end of autograd; ``avg_backward_comm_time``: first bucket
    launch to last completion; ``avg_backward_compute_comm_overlap_time``:
    first launch to end of autograd). Torch samples its runtime statistics
    (the first 10 iterations, then every 100th); pydist averages every
    iteration it recorded. Entries pydist does not measure (forward compute
    time, NCCL and environment details) are absent rather than invented."""

    def __init__(self, ddp: DistributedDataParallel):
        self._ddp = weakref.ref(ddp)  # no cycle: the wrapper's reducer must die with it
        self.comm_hook: str | None = None
        self.join_uneven_inputs = 0
        self.initial_bucket_sizes = self._bucket_sizes(ddp)
        # sums over the recorded iterations, folded in by note_iteration
        self._recorded = 0
        self._last_folded = -1
        self._sums = {"backward_compute_time": 0, "backward_comm_time": 0, "backward_compute_comm_overlap_time": 0}
        self._last = dict.fromkeys(self._sums, 0)

    @staticmethod
    def _bucket_sizes(ddp) -> list[int]:
        return [sum(ddp._params[i].numel() * ddp._params[i].element_size() for i in b) for b in ddp.reducer.bucket_indices()]

    def note_iteration(self) -> None:
        """Fold the reducer's last record into the averages (each once); called before each forward."""
        ddp = self._ddp()
        if ddp is None or not ddp._record_timing:
            return
        rec = ddp.reducer.last_record()
        if rec.iteration < 0 or rec.iteration == self._last_folded or not rec.buckets:
            return
        self._last_folded = rec.iteration
        first_launch = min(b.launch_ns for b in rec.buckets)
        last_complete = max(b.complete_ns for b in rec.buckets)
        self._last = {
            "backward_compute_time": rec.backward_end_ns,
            "backward_comm_time": max(0, last_complete - first_launch),
            "backward_compute_comm_overlap_time": max(0, rec.backward_end_ns - first_launch),
        }
        for k, v in self._last.items():
            self._sums[k] += v
        self._recorded += 1

    def _get_ddp_logging_data(self) -> DDPLoggingData:
        ddp = self._ddp()
        if ddp is None:
            raise RuntimeError("DDPLogger: its DistributedDataParallel is gone")
        self.note_iteration()
        params = ddp._params
        strs = {
            "backend_name": dist.get_backend(ddp.process_group),
            "bucket_sizes": ", ".join(map(str, self.initial_bucket_sizes)),
            "device_ids": ", ".join(map(str, ddp.device_ids or [])),
            "dtypes": ", ".join(sorted({_dtype_name(p.dtype) for p in params})),
            "module_name": type(ddp.module).__name__,
        }
        ints = {
            "broadcast_buffers": int(ddp.broadcast_buffers),
            "bucket_cap_bytes": ddp.bucket_bytes_cap,
            "find_unused_parameters": int(ddp.find_unused_parameters),
            "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in ddp.module.modules())),
            "is_multi_device_module": 0,
            "iteration": max(ddp._num_sync_forwards - 1, 0),
            "num_parameter_tensors": len(params),
            "output_device": -1 if ddp.output_device is None else int(ddp.output_device),
            "rank": dist.get_rank(ddp.process_group),
            "static_graph": int(ddp.static_graph),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "world_size": dist.get_world_size(ddp.process_group),
            "join_uneven_inputs": self.join_uneven_inputs,
        }
        if self.comm_hook is not None:
            strs["comm_hook"] = self.comm_hook
        if ddp._has_rebuilt_buckets:
            strs["rebuilt_bucket_sizes"] = ", ".join(map(str, self._bucket_sizes(ddp)))
            strs["rebuilt_per_bucket_param_indices"] = ", ".join(" ".join(map(str, b)) for b in ddp.reducer.bucket_indices())
            ints["has_rebuilt_buckets"] = 1
        if self._recorded:
            for k, v in self._sums.items():
                ints[f"avg_{k}"] = v // self._recorded
                ints[k] = self._last[k]
        return DDPLoggingData(strs, ints)

    # torch's dist.Logger methods that library code calls
    def _set_comm_hook_name(self, name: str) -> None:
        self.comm_hook = name

    def _set_uneven_input_join(self) -> None:
        self.join_uneven_inputs = 1

    def _set_static_graph(self) -> None:
        pass  # read from the wrapper

    def set_error_and_log(self, message: str) -> None:
        pass  # the error itself is raised; nothing is sent anywhere


def _dtype_name(dtype: torch.dtype) -> str:
    """torch's logging name of a dtype (c10's: "float", "double", "c10::BFloat16", ...)."""
    return {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )
