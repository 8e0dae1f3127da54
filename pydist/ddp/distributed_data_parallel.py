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
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from pydist import _C
from pydist.ddp import buckets as bucketing
from pydist.ddp.records import IterationRecord
from pydist.ddp.shm_transport import open_shm_allreduce
from pydist.ddp.state_sync import broadcast_tensors, verify_same_model

__all__ = ["DistributedDataParallel"]

# torch DDP keywords pydist accepts only at their default: anything else
# raises NotImplementedError naming the keyword, never a silent ignore.
_UNSUPPORTED_KEYWORDS: dict[str, Any] = {
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "mixed_precision": None,
    "device_mesh": None,
    "skip_all_reduce_unused_params": False,
    "bucket_cap_mb_list": None,
    "batched_grad_copy": False,
    "forward_sync_buffers": None,
}


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism at module level, with torch DDP's constructor and
    behaviour. pydist-only keywords: ``first_bucket_cap_mb`` (size of the
    first, small bucket; default 1 MB when ``bucket_cap_mb`` is not given,
    else ``bucket_cap_mb``, as torch), ``allreduce_chunk_mb`` (all-reduce
    each bucket in pieces of about this size as its gradients arrive; 0 for
    whole buckets; see [Note: chunked launches] in csrc/reducer/reducer.h),
    ``shm_allreduce`` (None: gradients of a CPU model whose ranks share one
    host are all-reduced through shared memory instead of the process group,
    elsewhere on the group; True: shared memory or an error; False: always
    the group; see [Note: which transport]) and ``record_timing`` (keep
    per-bucket timings, read with ``last_iteration_record()``)."""

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
        first_bucket_cap_mb: float | None = None,
        allreduce_chunk_mb: float = 4.0,
        shm_allreduce: bool | None = None,
        record_timing: bool = False,
        **torch_keywords: Any,
    ):
        super().__init__()
        Joinable.__init__(self)
        _reject_unsupported(torch_keywords)
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call pydist.init_process_group() "
                "(or torch.distributed.init_process_group()) first"
            )
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.device = _module_device(module, device_ids)
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = True if broadcast_buffers is None else broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self._rank = dist.get_rank()

        # Gradients are synchronized unless inside no_sync(); buffers are
        # broadcast before a forward only when the previous forward synced.
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

        # Bucket sizes in bytes (torch's rule: a 1 MB first bucket only
        # when the cap is left at its default).
        cap_mb = bucketing.DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if first_bucket_cap_mb is None:
            first_bucket_cap_mb = bucketing.DEFAULT_FIRST_BUCKET_CAP_MB if bucket_cap_mb is None else cap_mb
        self.bucket_bytes_cap = int(cap_mb * bucketing.MB)
        self.first_bucket_bytes_cap = int(first_bucket_cap_mb * bucketing.MB)

        # The parameters the reducer owns: those that require grad, each once
        # (tied parameters are one parameter), in model order.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError("DistributedDataParallel: the module has no parameter that requires grad")
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffers_to_sync = [b for _, b in module.named_buffers()]

        if init_sync:
            verify_same_model(list(module.named_parameters()), self.process_group)
            states = [p for _, p in module.named_parameters()]
            if self.broadcast_buffers:
                states += self._buffers_to_sync
            broadcast_tensors(states, src=_global_rank(self.process_group, 0), group=self.process_group)

        # This rank's end of the shared-memory transport, or None: gradients
        # go through the process group. Lives as long as the reducer.
        self._shm = open_shm_allreduce(self._params, self.process_group, shm_allreduce)
        self.reducer = _C.Reducer(
            self._params,
            self._param_names,
            bucketing.initial_buckets(
                self._params, self.first_bucket_bytes_cap, self.bucket_bytes_cap, find_unused_parameters, static_graph
            ),
            self.process_group,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            record_timing=record_timing,
            chunk_bytes=int(allreduce_chunk_mb * bucketing.MB),
            transport=self._shm,  # None: the process group's
        )
        # static_graph: the first backward is reduced all at once at its end;
        # this flag records that the callback doing it has been queued.
        self._static_graph_delay_enqueued = False
        # join(divide_by_initial_world_size=...): average over the world size
        # (True, torch's default) or over the ranks not yet joined.
        self._divide_by_initial_world_size = True
        self._averaging_over_active_ranks = False

    # --- forward ------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        with torch.autograd.profiler.record_function("pydist.DistributedDataParallel.forward"):
            inputs, kwargs = self._pre_forward(*inputs, **kwargs)
            output = self.module(*inputs, **kwargs)
            return self._post_forward(output)

    def _pre_forward(self, *inputs, **kwargs):
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
        if torch.is_grad_enabled():
            self._maybe_rebuild_buckets()
        if self._will_sync_buffers():
            self._sync_buffers()
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs), self.device)
        return inputs, kwargs

    def _post_forward(self, output):
        if not (torch.is_grad_enabled() and self.require_backward_grad_sync):
            self.require_forward_param_sync = False
            return output
        self.require_forward_param_sync = True
        dynamic_unused = self.find_unused_parameters and not self.static_graph
        self.reducer.prepare_for_backward(_find_tensors(output) if dynamic_unused else [])
        if self.static_graph and not self._static_graph_delay_enqueued:
            output = _wrap_outputs_in_sink(self, output)
        return output

    def _maybe_rebuild_buckets(self) -> None:
        if not self.reducer.should_rebuild_buckets():
            return
        mine = bucketing.rebuilt_buckets(
            self._params, self.reducer.ready_order(), self.first_bucket_bytes_cap, self.bucket_bytes_cap
        )
        self.reducer.rebuild_buckets(bucketing.agree_on_buckets(mine, len(self._params), self.process_group))

    # --- buffers ------------------------------------------------------------

    def _will_sync_buffers(self) -> bool:
        return self.require_forward_param_sync and self.broadcast_buffers and bool(self._buffers_to_sync)

    def _sync_buffers(self, joined: bool = False) -> None:
        src = _global_rank(self.process_group, 0)
        if self._join_config.enable:
            src = self._find_common_rank(self._rank, not joined)
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

    def _set_static_graph(self) -> None:
        raise NotImplementedError("_set_static_graph: pass static_graph=True to the constructor instead")

    def last_iteration_record(self) -> IterationRecord | None:
        """Per-bucket timings of the last synchronized backward (requires
        ``record_timing=True``, or ``set_record_timing(True)``)."""
        return IterationRecord.from_reducer(self.reducer.last_record())

    def set_record_timing(self, on: bool) -> None:
        self.reducer.set_record_timing(on)

    @property
    def allreduce_transport(self) -> str:
        """Where gradient buckets are all-reduced: "shm" (shared memory) or
        "process_group". A comm hook does its own communication either way."""
        return "shm" if self._shm is not None else "process_group"

    def bucket_indices(self) -> list[list[int]]:
        """The current buckets as lists of parameter indices, in launch order."""
        return self.reducer.bucket_indices()

    # --- join (uneven inputs) -------------------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False):
        """Context manager for uneven inputs, as torch DDP's ``join``."""
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

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        src = self._find_common_rank(self._rank, is_last_joiner)
        states = [p for _, p in self.module.named_parameters()]
        if self.broadcast_buffers:
            states += self._buffers_to_sync
        broadcast_tensors(states, src=src, group=self.process_group)


class _DDPJoinHook(JoinHook):
    """A joined rank shadows the collectives of ranks still training, in the
    order they issue them (see DistributedDataParallel._pre_forward)."""

    def __init__(self, ddp: DistributedDataParallel):
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._maybe_rebuild_buckets()
        if ddp._will_sync_buffers():
            ddp._sync_buffers(joined=True)
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        ddp.reducer.match_all_reduce_for_bwd_pass()
        if ddp.find_unused_parameters and not ddp.static_graph:
            ddp.reducer.match_unused_params_allreduce()

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
