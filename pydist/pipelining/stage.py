"""One pipeline stage: a submodule, its place in the pipeline, and what it
keeps between a micro-batch's forward and its backward.

    stage = PipelineStage(submodule, stage_index, num_stages, device, group=pp_group)

The signature is torch.distributed.pipelining.PipelineStage's (input_args,
output_args, output_grads, input_grads and get_mesh are accepted; shapes
travel with each message, so none is needed). A schedule drives it:
``forward_one_chunk`` and ``backward_one_chunk`` per micro-batch, then
``perform_reduce_grad`` once per step, as torch's schedules do, with the
same arithmetic (see [Note: the same bits as torch's pipelining]).

[Note: the same bits as torch's pipelining]
torch's schedules, and these, compute per micro-batch i (split with torch's
own ``split_args_kwargs_into_chunks`` / ``tensor_split`` on dim 0):
  forward    the first stage runs on its chunk, every other stage on the
             received activations (leaves that require grad), the last
             computes loss_i = loss_fn(output_i, target_i);
  backward   ``torch.autograd.backward`` of loss_i (last stage) or of the
             stage's outputs with the received gradients, which accumulates
             into each parameter's .grad; the gradients of the stage's
             inputs (their .grad) go back to the previous stage;
  step end   every .grad divided by n_microbatches (scale_grads=True).
Every stage runs its backwards in micro-batch order 0..M-1 in GPipe, 1F1B
and interleaved 1F1B alike, so each .grad is ((g_0 + g_1) + ...) / M in
every schedule, and equal to one process that runs the whole model on the
micro-batches in order and divides at the end: the bits depend on the
micro-batches and their order, not on the schedule or on what carries the
tensors (transfers copy bytes).
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from pydist.pipelining import _p2p

__all__ = ["PipelineStage", "StageState"]


class StageState(enum.Enum):
    IDLE = "idle"          # between steps
    RUNNING = "running"    # inside a schedule's step
    FAILED = "failed"      # a step raised; the channels are aborted, the stage is unusable


def _as_tuple(output: Any) -> tuple:
    if isinstance(output, torch.Tensor):
        return (output,)
    if isinstance(output, (tuple, list)):
        return tuple(output)
    raise TypeError(f"pydist.pipelining: a stage's forward must return a tensor or a tuple of tensors, "
                    f"got {type(output).__name__}")


def _flat_tensors(args: tuple, kwargs: dict) -> list:
    from torch.utils._pytree import tree_flatten

    return [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]


class PipelineStage:
    """A stage of a pipeline; see the module docstring. ``group``: the
    pipeline's process group (default: the world), whose rank r holds the
    stages r, r + size, r + 2 size, ... (torch's layout). pydist adds
    ``p2p`` (None: shared memory between ranks where every pair can map a
    segment, else the group; "shm" requires it; "process_group") and
    ``timeout`` (seconds, or a timedelta; default the group's timeout):
    how long a stage waits for a peer before it fails naming that peer."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device,
                 input_args=None, output_args=None, output_grads=None, input_grads=None,
                 group: dist.ProcessGroup | None = None, dw_builder=None, get_mesh=None, *,
                 p2p: str | None = None, timeout=None):
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"PipelineStage: submodule must be an nn.Module, got {type(submodule).__name__}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index {stage_index} is out of range of num_stages {num_stages}")
        if dw_builder is not None:
            raise NotImplementedError("PipelineStage: dw_builder (split weight backward, for zero-bubble schedules) "
                                      "is not implemented by pydist.pipelining")
        _p2p.choose_carrier(p2p)
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group
        self.group_rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        if self.group_size > num_stages:
            raise RuntimeError(f"PipelineStage: the pipeline group has {self.group_size} ranks but only {num_stages} "
                               f"stages; every rank needs a stage")
        if stage_index % self.group_size != self.group_rank:
            raise ValueError(f"PipelineStage: stage {stage_index} belongs on group rank "
                             f"{stage_index % self.group_size} (stage % group size), not on rank {self.group_rank}")
        self.stage_index_to_group_rank = {i: i % self.group_size for i in range(num_stages)}
        self.p2p = p2p
        if timeout is None:
            from pydist.transport import shm_segment

            timeout = shm_segment.group_timeout(group if group is not None else dist.group.WORLD)
        self.timeout_s = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
        self.has_backward = False  # set by the schedule (it has a loss_fn)
        self.state = StageState.IDLE
        # Per step: micro-batch -> (outputs tuple, input tensors) from forward until its backward.
        self.fwd_cache: dict[int, tuple[tuple, list]] = {}
        # Per step: the last stage's outputs, merged into step()'s return value.
        self.output_chunks: list = []
        # Set by the schedule's set-up (_attach_channels): this stage's incoming and outgoing channels.
        self._fwd_in: _p2p.Channel | None = None
        self._fwd_out: _p2p.Channel | None = None
        self._bwd_in: _p2p.Channel | None = None
        # Called around each receive: the schedule's stall watchdog times compute, not waits (set by it).
        self._wait_begins = lambda: None
        self._waited = lambda: None
        self._bwd_out: _p2p.Channel | None = None

    def __repr__(self) -> str:
        return f"PipelineStage(stage {self.stage_index} of {self.num_stages}, group rank {self.group_rank})"

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def channels(self) -> list:
        return [c for c in (self._fwd_in, self._fwd_out, self._bwd_in, self._bwd_out) if c is not None]

    def _attach_channels(self, channels: dict) -> None:
        s = self.stage_index
        self._fwd_in = channels.get((s - 1, s))
        self._bwd_out = channels.get((s, s - 1))
        self._fwd_out = channels.get((s, s + 1))
        self._bwd_in = channels.get((s + 1, s))

    def clear_runtime_states(self) -> None:
        self.fwd_cache.clear()
        self.output_chunks.clear()

    # --- per micro-batch -------------------------------------------------------
    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None,
                          save_forward_output: bool = True):
        """Forward of micro-batch ``fwd_chunk_id``: the first stage on
        ``args``, the others on the activations received from the previous
        stage. Returns the submodule's output (what the loss sees)."""
        if self.is_first:
            composite_args = tuple(args)
        else:
            self._wait_begins()
            composite_args = self._fwd_in.recv(fwd_chunk_id)
            self._waited()
        kwargs = kwargs or {}
        output = self._forward(*composite_args, **kwargs)
        outputs = _as_tuple(output)
        if self.is_last and save_forward_output:
            self.output_chunks.append(output)
        self.fwd_cache[fwd_chunk_id] = (outputs, _flat_tensors(composite_args, kwargs))
        if not self.is_last:
            self._fwd_out.send(outputs, fwd_chunk_id)
        return output

    def _forward(self, *args, **kwargs):
        """The submodule's forward; under a DDP wrapper without a gradient
        sync (see [Note: data parallel stages] in schedules.py)."""
        no_sync = getattr(self.submod, "no_sync", None)
        if no_sync is not None and isinstance(self.submod, nn.parallel.DistributedDataParallel):
            with no_sync():
                return self.submod(*args, **kwargs)
        return self.submod(*args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        """Backward of micro-batch ``bwd_chunk_id``: from ``loss`` on the
        last stage, else from the gradients received from the next stage;
        accumulates the parameters' .grad and sends the inputs' gradients
        back. See [Note: the same bits as torch's pipelining]."""
        if not self.has_backward:
            return
        if not full_backward:
            raise NotImplementedError("pydist.pipelining: split input/weight backward (zero-bubble) is not implemented")
        if bwd_chunk_id not in self.fwd_cache:
            raise RuntimeError(f"pydist.pipelining: stage {self.stage_index} has no forward of micro-batch "
                               f"{bwd_chunk_id} to run backward through")
        outputs, inputs = self.fwd_cache.pop(bwd_chunk_id)
        if self.is_last:
            roots, grads = [loss], [None]
        else:
            self._wait_begins()
            received = self._bwd_in.recv(bwd_chunk_id)
            self._waited()
            roots, grads = [], []
            for out, g in zip(outputs, received):
                if isinstance(out, torch.Tensor) and (out.requires_grad or out.grad_fn is not None):
                    roots.append(out)
                    grads.append(g)
        self._backward(roots, grads, last_backward)
        if not self.is_first:
            self._bwd_out.send(tuple(t.grad if t.requires_grad else None for t in inputs), bwd_chunk_id)
        if self.is_last and not self.is_first:
            for t in outputs:  # only the merged output needs them now: free the graph behind them
                if isinstance(t, torch.Tensor) and not t._is_view():
                    t.detach_()

    def _backward(self, roots: list, grads: list, last_backward: bool) -> None:
        """``torch.autograd.backward``; a DDP or fully_shard'ed stage
        reduces its gradients in the last micro-batch's backward only (see
        [Note: data parallel stages] in schedules.py)."""
        if isinstance(self.submod, nn.parallel.DistributedDataParallel):
            if last_backward:
                self.submod.reducer.prepare_for_backward(
                    list(nn.parallel.distributed._find_tensors(roots)))
                torch.autograd.backward(roots, grad_tensors=grads)
            else:
                with self.submod.no_sync():
                    torch.autograd.backward(roots, grad_tensors=grads)
            return
        if hasattr(self.submod, "set_requires_gradient_sync"):  # fully_shard'ed: reduce-scatter in the last only
            self.submod.set_requires_gradient_sync(last_backward)
        torch.autograd.backward(roots, grad_tensors=grads)

    # --- per step ---------------------------------------------------------------
    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divides every parameter's .grad by ``grad_scale_factor`` (the
        number of micro-batches when the loss averages)."""
        if grad_scale_factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """Once per step, after every backward: scales the gradients. A
        data-parallel wrapper has reduced them already, in the last
        micro-batch's backward (see [Note: data parallel stages] in
        schedules.py), so they are scaled after the reduction, as torch's are."""
        self.scale_grads(grad_scale_factor)
