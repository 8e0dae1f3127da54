"""Pipeline schedules: which stage runs which micro-batch's forward or
backward when, on every rank.

    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    schedule = ScheduleInterleaved1F1B([stage_a, stage_b], n_microbatches=4, loss_fn=loss_fn)
    out = schedule.step(x, target=y, losses=losses)   # first stage: x; last: target (and losses)

The names, arguments and results are torch.distributed.pipelining's. Each
schedule is a list of actions per rank (``pipeline_order``, torch's IR:
``_Action(stage_index, computation_type, microbatch_index)``, written "1F0",
"0B3"); one runtime executes any such list (``_run_actions``), so a list
recorded or written by hand (``_dump_csv`` / ``_load_csv``, torch's CSV form)
replays unchanged. Which list a schedule executes is ``execution_order``:
for GPipe and 1F1B the order torch's ``_step_microbatches`` runs (which for
1F1B has one warm-up forward more than torch's drawn ``pipeline_order``);
for interleaved 1F1B torch's ``pipeline_order`` itself.

Sends and receives are not in the lists: a stage's forward receives its
input from the previous stage's channel and sends its output down the next;
its backward does the same the other way (see [Note: pipeline channels] in
_p2p.py). The bits do not depend on the schedule: see [Note: the same bits
as torch's pipelining] in stage.py.

[Note: nothing hangs]
Every wait is bounded by the stage's timeout (default: the group's), and
every failure ends every rank, naming the stage:
  - a stage that raises (forward, backward, the loss) re-raises naming its
    stage, action and micro-batch, after sending an abort down every
    outgoing channel: the peers waiting on it fail at once with the same
    name and pass the abort on;
  - a stage whose process dies: shared-memory peers see the process gone at
    once, process-group peers when the connection drops or at the timeout;
  - a stage that stalls in its own code: its peers' receives give up after
    the timeout, naming it; its own watchdog ends its process (exit code
    kStallExitCode) once one action has run for the timeout, as torch's NCCL
    watchdog does, printing the stage, action and micro-batch.
After a failure the stages' channels are closed; build new stages and
schedule to continue.

[Note: data parallel stages]
A stage wrapped by DDP (pydist's or torch's) accumulates micro-batch
gradients without syncing (its forwards and all backwards but the last run
under ``no_sync``) and reduces once: the stage arms the reducer for the last
micro-batch's backward, whose buckets all-reduce as they fill and are
written back when autograd ends (torch's stage does the same with torch's
DDP). A ``pydist.fully_shard`` stage skips the reduce-scatter in every
backward but the last, in which each unit reduce-scatters as its gradients
are ready, during the 1F1B cool-down rather than after it (torch's stage runs
a fully_shard'ed module's post-backward once the last backward is done).
``perform_reduce_grad`` then only divides by n_microbatches.
"""

from __future__ import annotations

import collections
import csv
import enum
import os
import sys
import threading
import time
import weakref
from collections import defaultdict
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from pydist.overlap import hooks as overlap_hooks  # [overlap hook] PYDIST_TRACE records the stages
from pydist.pipelining import _p2p
from pydist.pipelining.stage import PipelineStage, StageState

__all__ = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "PipelineScheduleSingle",
           "PipelineScheduleMulti", "_Action", "_ComputationType", "StageRecord", "PipelineError",
           "kStallExitCode"]

# Exit code of a process the stall watchdog ends (see [Note: nothing hangs]).
kStallExitCode = 86
# Records a schedule keeps (the newest): about 2 per action and transfer, so hundreds of steps.
kRecordsKept = 100_000


class PipelineError(RuntimeError):
    """A stage failed; the message names the stage, rank, action and micro-batch."""


class _ComputationType(str, enum.Enum):
    """torch's action kinds (the letters of its CSV form)."""

    FORWARD = "F"
    FULL_BACKWARD = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE_GRAD = "REDUCE_GRAD"


F = _ComputationType.FORWARD
B = _ComputationType.FULL_BACKWARD
REDUCE_GRAD = _ComputationType.REDUCE_GRAD
_KINDS = {k.value: k for k in _ComputationType}


class _Action(NamedTuple):
    """One action of a rank's list, as torch writes it: "1F0" is stage 1's
    forward of micro-batch 0, "0REDUCE_GRAD" stage 0's end of step."""

    stage_index: int
    computation_type: _ComputationType
    microbatch_index: int | None = None

    def __repr__(self) -> str:
        mb = "" if self.microbatch_index is None else str(self.microbatch_index)
        return f"{self.stage_index}{self.computation_type.value}{mb}"

    __str__ = __repr__

    @staticmethod
    def from_str(text: str) -> "_Action | None":
        import re

        text = text.strip()
        if not text:
            return None
        found = re.fullmatch(r"(\d+)(F|B|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)", text)
        if found is None:
            raise ValueError(f"pydist.pipelining: cannot read the action {text!r}: expected [stage][F|B|SEND_F|"
                             f"RECV_F|SEND_B|RECV_B|REDUCE_GRAD][micro-batch], e.g. 2F0 (I and W, split "
                             f"backward, are not implemented)")
        stage, kind, mb = found.groups()
        return _Action(int(stage), _KINDS[kind], int(mb) if mb else None)


class StageRecord(NamedTuple):
    """One action on a rank's timeline: forward/backward/send/recv of a
    stage and micro-batch, on the steady clock (``time.monotonic_ns``), the
    clock of pydist DDP's records. ``peer`` is the other stage of a
    send/recv (-1 for compute); ``bytes`` its payload."""

    rank: int
    stage: int
    action: str        # "forward", "backward", "send", "recv", "reduce_grad"
    microbatch: int
    start_ns: int
    end_ns: int
    peer: int = -1
    bytes: int = 0


# --- the action lists (torch's algorithms) ---------------------------------------

def _add_reduce_grad(actions: list, n_microbatches: int) -> list:
    """Drops the bubbles (None) and puts a REDUCE_GRAD after each stage's last backward (torch's lowering)."""
    out, count = [], defaultdict(int)
    for a in actions:
        if a is None:
            continue
        out.append(a)
        if a.computation_type == B:
            count[a.stage_index] += 1
            if count[a.stage_index] == n_microbatches:
                out.append(_Action(a.stage_index, REDUCE_GRAD, None))
    return out


def gpipe_order(stage_index: int, n_microbatches: int) -> list[_Action]:
    """GPipe: every forward, then every backward."""
    return ([_Action(stage_index, F, i) for i in range(n_microbatches)]
            + [_Action(stage_index, B, i) for i in range(n_microbatches)])


def one_f_one_b_order(stage_index: int, num_stages: int, n_microbatches: int) -> list[_Action]:
    """What torch's Schedule1F1B._step_microbatches runs: num_stages -
    stage_index warm-up forwards, then backward/forward pairs, then the
    cool-down's backwards."""
    warmup = min(n_microbatches, num_stages - stage_index)
    actions = [_Action(stage_index, F, i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        actions.append(_Action(stage_index, B, bwd))
        bwd += 1
        if fwd == n_microbatches:
            break
        actions.append(_Action(stage_index, F, fwd))
        fwd += 1
    actions += [_Action(stage_index, B, i) for i in range(bwd, n_microbatches)]
    return actions


def interleaved_order(rank: int, pp_size: int, n_local_stages: int, n_microbatches: int) -> list[_Action | None]:
    """torch's ScheduleInterleaved1F1B._calculate_single_rank_operations
    (with its _get_warmup_ops and _get_1f1b_rank_ops), bubbles as None."""
    rounds = max(1, n_microbatches // pp_size)
    per_round = n_microbatches // rounds
    if n_microbatches % rounds:
        raise ValueError(f"ScheduleInterleaved1F1B: n_microbatches ({n_microbatches}) must be a multiple of the "
                         f"number of rounds ({rounds})")
    warmup = min((n_local_stages - 1) * per_round + 2 * (pp_size - 1 - rank), n_microbatches * n_local_stages)
    mb_ops = n_local_stages * n_microbatches
    fwd_bwd = mb_ops - warmup
    cooldown = mb_ops - fwd_bwd

    def forward_stage(step):
        return ((step // per_round) % n_local_stages) * pp_size + rank

    def backward_stage(step):
        return (n_local_stages - 1 - ((step - warmup) // per_round) % n_local_stages) * pp_size + rank

    fwd_mb, bwd_mb = defaultdict(int), defaultdict(int)
    ops: list[_Action | None] = [None] * rank
    post_warmup = (n_local_stages * pp_size + 2 * (pp_size - 1 - rank)) - (warmup + rank)
    for op in range(warmup + fwd_bwd + cooldown):
        if op < warmup:
            s = forward_stage(op)
            ops.append(_Action(s, F, fwd_mb[s]))
            fwd_mb[s] += 1
            if op == warmup - 1:
                ops.extend([None] * post_warmup)
        elif op < warmup + fwd_bwd:
            s = forward_stage(op)
            ops.append(_Action(s, F, fwd_mb[s]))
            fwd_mb[s] += 1
            s = backward_stage(op)
            ops.append(_Action(s, B, bwd_mb[s]))
            bwd_mb[s] += 1
        else:
            ops.append(None)
            s = backward_stage(op)
            ops.append(_Action(s, B, bwd_mb[s]))
            bwd_mb[s] += 1
    return ops


# --- the runtime ------------------------------------------------------------------

class _PipelineSchedule:
    """What every schedule shares: splitting the batch, the channels, the
    runtime that executes this rank's action list, the losses, the records."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True):
        if n_microbatches < 1:
            raise ValueError(f"{type(self).__name__}: n_microbatches must be >= 1, got {n_microbatches}")
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{type(self).__name__}: stages must be pydist.pipelining.PipelineStage objects "
                            f"(a torch PipelineStage does not run on pydist's channels)")
        self._stages = list(stages)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._has_backward = loss_fn is not None
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        first = self._stages[0]
        self._group = first.group
        self._num_stages = first.num_stages
        self._rank = first.group_rank
        self._pp_size = first.group_size
        for s in self._stages[1:]:
            if s.num_stages != self._num_stages or s.group is not self._group:
                raise ValueError(f"{type(self).__name__}: the stages of one schedule need one num_stages and group")
        self.stage_index_to_group_rank = {i: i % self._pp_size for i in range(self._num_stages)}
        self._internal_losses: list[torch.Tensor] = []
        self._channels: dict | None = None  # opened at the first step (collective over the group)
        self.p2p_carrier: str | None = None  # "shm", "process_group" or "local", once opened
        # Records (see StageRecord): kept when set_record_timing(True), the newest kRecordsKept.
        self._recording = False
        self._records: collections.deque[StageRecord] = collections.deque(maxlen=kRecordsKept)
        self._current: tuple[str, int, int, float] | None = None  # (action, stage, mb, monotonic start)
        self._action_t0 = 0  # when the running action's compute began (after its receive), for its record
        self._watchdog: threading.Thread | None = None  # the stall watchdog, from the first step to close()
        self._watch_stop: threading.Event | None = None
        self.pipeline_order: dict[int, list] = {}
        self.execution_order: dict[int, list] = {}
        overlap_hooks.attach_pipeline(self)  # [overlap hook] PYDIST_TRACE

    # --- records -----------------------------------------------------------------
    def set_record_timing(self, on: bool = True) -> None:
        """Records every forward, backward, send and receive from the next
        step on (see StageRecord); ``records()`` returns them."""
        self._recording = on

    def records(self) -> list[StageRecord]:
        return list(self._records)

    def clear_records(self) -> None:
        self._records.clear()

    def _on_transfer(self, src, dst, what, mb, t0, t1, nbytes) -> None:
        if self._recording:
            mine, peer = (src, dst) if what == "send" else (dst, src)
            self._records.append(StageRecord(self._rank, mine, what, mb, t0, t1, peer, nbytes))

    # --- set-up ------------------------------------------------------------------
    def _ensure_channels(self) -> None:
        if self._channels is not None:
            return
        first = self._stages[0]
        for s in self._stages:
            if s.state is StageState.FAILED:
                raise PipelineError(f"pydist.pipelining: stage {s.stage_index} failed in an earlier step; build new "
                                    f"stages and a new schedule")
        channels, carrier = _p2p.open_channels(first.group if first.group is not None else dist.group.WORLD,
                                               self.stage_index_to_group_rank, self._num_stages, first.p2p,
                                               first.timeout_s, on_transfer=self._on_transfer)
        self._channels, self.p2p_carrier = channels, carrier
        for s in self._stages:
            s._attach_channels(channels)
            s._wait_begins = self._stop_stall_clock
            s._waited = self._restart_stall_clock

    def close(self) -> None:
        """Closes the channels (every rank should); the stages can be given to a new schedule."""
        self._stop_watchdog()
        for ch in (self._channels or {}).values():
            ch.close()
        self._channels = None

    # --- step ----------------------------------------------------------------------
    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict[str, Any] | None = None, **kwargs):
        """One step on the whole batch: split into n_microbatches (dim 0,
        or the chunk specs), run this rank's actions, then scale each
        stage's gradients. The first stage takes ``args``/``kwargs``, the
        last ``target`` (and fills ``losses`` with each micro-batch's loss);
        the last returns the merged output."""
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() requires gradients to be enabled; under torch.no_grad() call eval() instead")
        return self._run_step(args, kwargs, target, losses, return_outputs, loss_kwargs, backward=self._has_backward)

    def eval(self, *args, target=None, losses: list | None = None, **kwargs):
        """Forward only (no gradients): the merged output on the last stage, and the losses when a target is given."""
        with torch.no_grad():
            return self._run_step(args, kwargs, target, losses, True, None, backward=False)

    def _run_step(self, args, kwargs, target, losses, return_outputs, loss_kwargs, backward: bool):
        if backward and target is None and any(s.is_last for s in self._stages):
            raise ValueError(f"{type(self).__name__}.step on rank {self._rank}: this rank holds the last stage, "
                             f"whose loss_fn needs target=")
        self._ensure_channels()
        for s in self._stages:
            s.has_backward = backward
            s.clear_runtime_states()
            s.state = StageState.RUNNING
        M = self._n_microbatches
        arg_mbs, kwarg_mbs = self._split_inputs(args, kwargs)
        target_mbs = list(torch.tensor_split(target, M, 0)) if target is not None else None
        self._internal_losses = []
        actions = [a for a in self.execution_order[self._rank] if a is not None]
        if not backward:
            actions = [a for a in actions if a.computation_type == F]
        for s in self._stages:  # every receive of this step, posted now (see [Note: pipeline channels])
            if s._fwd_in is not None:
                s._fwd_in.post_recvs(M)
            if backward and s._bwd_in is not None:
                s._bwd_in.post_recvs(M)
        self._start_watchdog()
        try:
            self._run_actions(actions, arg_mbs, kwarg_mbs, target_mbs, return_outputs, loss_kwargs, backward)
            self._current = ("flush", -1, -1, time.monotonic())
            for ch in self._channels.values():
                if ch.sending:
                    ch.flush()
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._current = None
        for s in self._stages:
            s.state = StageState.IDLE
        if any(s.is_last for s in self._stages):
            if losses is not None and self._loss_fn is not None and target_mbs is not None:
                losses.clear()
                losses.extend(self._internal_losses)
            self._internal_losses = []
            last = next(s for s in self._stages if s.is_last)
            if return_outputs:
                return self._merge_outputs(last.output_chunks)
        return None

    # [Note: micro-batches]
    # Without chunk specs, every tensor in the inputs (at any depth) is cut
    # with torch.tensor_split(t, n_microbatches, 0) and everything else is
    # passed to every micro-batch, and the last stage's outputs are
    # concatenated on dim 0: what torch's split_args_kwargs_into_chunks and
    # merge_chunks do by default, the same views and so the same bits, without
    # importing torch.distributed.pipelining (seconds of start-up per rank).
    # With args_chunk_spec / kwargs_chunk_spec / output_merge_spec (torch's
    # TensorChunkSpec), torch's own functions do it.
    def _split_inputs(self, args: tuple, kwargs: dict) -> tuple[list, list]:
        M = self._n_microbatches
        if not args and not kwargs:
            return [()] * M, [{}] * M
        if self._args_chunk_spec is not None or self._kwargs_chunk_spec is not None:
            from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

            return split_args_kwargs_into_chunks(args, kwargs, M, self._args_chunk_spec, self._kwargs_chunk_spec)
        leaves, spec = tree_flatten((args, kwargs))
        columns = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.size(0) < M:
                    raise ValueError(f"{type(self).__name__}.step: an input's dim 0 has {leaf.size(0)} rows, fewer "
                                     f"than n_microbatches={M}")
                chunks = torch.tensor_split(leaf, M, 0)
                if leaf.requires_grad and leaf.is_leaf:
                    for c in chunks:
                        c.retain_grad()
                columns.append(chunks)
            else:
                columns.append([leaf] * M)
        split = [tree_unflatten([col[i] for col in columns], spec) for i in range(M)]
        return [a for a, _ in split], [k for _, k in split]

    def _merge_outputs(self, chunks: list):
        if self._output_merge_spec is not None:
            from torch.distributed.pipelining.microbatch import merge_chunks

            return merge_chunks(chunks, self._output_merge_spec)
        flat = [tree_flatten(c) for c in chunks]
        spec = flat[0][1]
        merged = []
        for i, first in enumerate(flat[0][0]):
            if isinstance(first, torch.Tensor):
                merged.append(torch.cat([f[0][i] for f in flat], dim=0))
            else:
                merged.append(first)
        return tree_unflatten(merged, spec)

    def _run_actions(self, actions, arg_mbs, kwarg_mbs, target_mbs, return_outputs, loss_kwargs, backward) -> None:
        stages = {s.stage_index: s for s in self._stages}
        M = self._n_microbatches
        for a in actions:
            stage = stages.get(a.stage_index)
            if stage is None:
                raise PipelineError(f"pydist.pipelining: rank {self._rank}'s action list names stage {a.stage_index}, "
                                    f"which rank {self.stage_index_to_group_rank.get(a.stage_index)} holds")
            kind, mb = a.computation_type, a.microbatch_index
            if kind in (_ComputationType.SEND_F, _ComputationType.RECV_F, _ComputationType.SEND_B,
                        _ComputationType.RECV_B):
                continue  # the channels move the tensors; see the module docstring
            self._action_t0 = time.monotonic_ns()
            if kind == F:
                self._current = ("forward", a.stage_index, mb, time.monotonic())
                output = self._guard(stage, "forward", mb, lambda: stage.forward_one_chunk(
                    mb, arg_mbs[mb], kwarg_mbs[mb], save_forward_output=return_outputs))
                if stage.is_last and self._loss_fn is not None and target_mbs is not None:
                    loss = self._guard(stage, "loss", mb, lambda: self._loss_fn(output, target_mbs[mb],
                                                                                **(loss_kwargs or {})))
                    if len(self._internal_losses) != mb:
                        raise PipelineError(f"pydist.pipelining: the last stage's forwards must run in micro-batch "
                                            f"order; got {mb} after {len(self._internal_losses)} losses")
                    self._internal_losses.append(loss)
                self._record(a.stage_index, "forward", mb, self._action_t0)
            elif kind == B:
                self._current = ("backward", a.stage_index, mb, time.monotonic())
                loss = self._internal_losses[mb] if stage.is_last else None
                self._guard(stage, "backward", mb, lambda: stage.backward_one_chunk(
                    mb, loss=loss, last_backward=(mb == M - 1)))
                self._record(a.stage_index, "backward", mb, self._action_t0)
            elif kind == REDUCE_GRAD:
                pass  # done once every action ran, below
            else:
                raise PipelineError(f"pydist.pipelining: cannot run the action {a}")
        if backward:
            for s in self._stages:
                t0 = time.monotonic_ns()
                self._current = ("reduce_grad", s.stage_index, -1, time.monotonic())
                self._guard(s, "reduce_grad", -1, lambda s=s: s.perform_reduce_grad(M if self.scale_grads else 1))
                self._record(s.stage_index, "reduce_grad", -1, t0)

    def _stop_stall_clock(self) -> None:
        """A receive begins: its wait is bounded by the channel's timeout, not the watchdog's."""
        current = self._current
        if current is not None:
            self._current = (current[0], current[1], current[2], None)

    def _restart_stall_clock(self) -> None:
        """A receive returned: the stall watchdog counts the action's compute from now."""
        current = self._current
        if current is not None:
            self._current = (current[0], current[1], current[2], time.monotonic())
        self._action_t0 = time.monotonic_ns()  # a record times the compute, not the wait before it

    def _record(self, stage: int, action: str, mb: int, t0: int) -> None:
        if self._recording:
            self._records.append(StageRecord(self._rank, stage, action, mb, t0, time.monotonic_ns()))

    def _guard(self, stage: PipelineStage, what: str, mb: int, fn):
        try:
            return fn()
        except (_p2p.P2PError, PipelineError):
            raise
        except Exception as exc:
            where = f" of micro-batch {mb}" if mb >= 0 else ""
            raise PipelineError(f"pydist.pipelining: stage {stage.stage_index} (rank {self._rank}) raised in its "
                                f"{what}{where}: {type(exc).__name__}: {exc}") from exc

    def _fail(self, exc: BaseException) -> None:
        """See [Note: nothing hangs]: abort the outgoing channels, close them all."""
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        failed_stage = self._stages[0].stage_index
        if self._current is not None and self._current[1] >= 0:
            failed_stage = self._current[1]
        for s in self._stages:
            s.state = StageState.FAILED
        channels = self._channels or {}
        for ch in channels.values():
            try:
                ch.abort(failed_stage, reason[:400])
            except Exception:
                pass
        for ch in channels.values():
            ch.close(wait_s=min(5.0, self._stages[0].timeout_s))  # time for the abort to go out
        self._channels = None
        self._stop_watchdog()

    def _start_watchdog(self) -> None:
        """The stall watchdog of [Note: nothing hangs]: one thread per
        schedule, until ``close`` (or a failure); it holds the schedule weakly."""
        if self._watchdog is not None and self._watchdog.is_alive():
            return
        timeout = self._stages[0].timeout_s
        stop = self._watch_stop = threading.Event()
        me = weakref.ref(self)

        def watch():
            while not stop.wait(min(0.5, timeout / 4)):
                schedule = me()
                if schedule is None:
                    return
                current, rank = schedule._current, schedule._rank
                del schedule
                if current is None or current[0] == "flush" or current[3] is None:
                    continue  # between steps, or waiting on a channel (bounded by its own timeout)
                action, stage, mb, start = current
                if time.monotonic() - start > timeout:
                    print(f"pydist.pipelining: stage {stage} (rank {rank}) stalled in its {action} of "
                          f"micro-batch {mb} for more than {timeout:g}s; ending the process (exit code "
                          f"{kStallExitCode}) so that no rank waits on it", file=sys.stderr, flush=True)
                    os._exit(kStallExitCode)

        self._watchdog = threading.Thread(target=watch, daemon=True, name="pydist-pp-watchdog")
        self._watchdog.start()

    def _stop_watchdog(self) -> None:
        if self._watch_stop is not None:
            self._watch_stop.set()

    # --- torch's CSV form ----------------------------------------------------------
    def _dump_csv(self, filename: str, format: str = "compute_only") -> None:
        """Every rank's action list, one CSV row per rank (torch's form; a
        bubble is an empty cell). "compute_only": ``pipeline_order``;
        "compute_comms": what this runtime executes, with the receive before
        and the send after each action that moves tensors."""
        if format == "compute_only":
            rows = self.pipeline_order
        elif format == "compute_comms":
            rows = {r: self._with_comms(acts) for r, acts in self.execution_order.items()}
        else:
            raise ValueError(f"_dump_csv: format must be 'compute_only' or 'compute_comms', got {format!r}")
        with open(filename, "w", newline="") as f:
            writer = csv.writer(f)
            for r in sorted(rows):
                writer.writerow(["" if a is None else str(a) for a in rows[r]])

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        """Replaces the action lists with a CSV's (torch's form, one row per
        rank); the next step executes them. Communication actions are
        accepted and skipped: the channels place them."""
        if format not in ("compute_only", "compute_comms"):
            raise ValueError(f"_load_csv: format must be 'compute_only' or 'compute_comms', got {format!r}")
        with open(filename, newline="") as f:
            rows = {r: [_Action.from_str(c) for c in row] for r, row in enumerate(csv.reader(f))}
        if len(rows) != self._pp_size:
            raise ValueError(f"_load_csv: {filename} has {len(rows)} rows; the pipeline has {self._pp_size} ranks")
        for r, acts in rows.items():
            for a in acts:
                if a is not None and self.stage_index_to_group_rank.get(a.stage_index) != r:
                    raise ValueError(f"_load_csv: {filename} row {r} has {a}, but stage {a.stage_index} is on rank "
                                     f"{self.stage_index_to_group_rank.get(a.stage_index)}")
            self._check_complete(r, acts, filename)
        self.pipeline_order = rows
        self.execution_order = {r: [a for a in acts if a is not None and a.computation_type in (F, B, REDUCE_GRAD)]
                                for r, acts in rows.items()}

    def _check_complete(self, rank: int, acts: list, where: str) -> None:
        M = self._n_microbatches
        for s in [i for i in range(self._num_stages) if self.stage_index_to_group_rank[i] == rank]:
            for kind in (F, B):
                mbs = [a.microbatch_index for a in acts if a is not None and a.stage_index == s
                       and a.computation_type == kind]
                if mbs != list(range(M)):
                    raise ValueError(f"{where}: stage {s}'s {kind.value} actions run micro-batches {mbs}; a "
                                     f"schedule runs each of 0..{M - 1} once, in order")

    def _with_comms(self, actions: list) -> list:
        out = []
        for a in actions:
            if a is None:
                continue
            s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
            if kind == F and s > 0:
                out.append(_Action(s, _ComputationType.RECV_F, mb))
            if kind == B and s < self._num_stages - 1:
                out.append(_Action(s, _ComputationType.RECV_B, mb))
            out.append(a)
            if kind == F and s < self._num_stages - 1:
                out.append(_Action(s, _ComputationType.SEND_F, mb))
            if kind == B and s > 0:
                out.append(_Action(s, _ComputationType.SEND_B, mb))
        return out


class PipelineScheduleSingle(_PipelineSchedule):
    """A schedule with one stage per rank."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True):
        super().__init__([stage], n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        if self._num_stages != self._pp_size:
            raise ValueError(f"{type(self).__name__}: one stage per rank, but {self._num_stages} stages on "
                             f"{self._pp_size} ranks; use ScheduleInterleaved1F1B for several stages per rank")
        self._stage = stage
        self.execution_order = {r: self._rank_order(r) for r in range(self._pp_size)}
        self.pipeline_order = {r: _add_reduce_grad(self._drawn_order(r), n_microbatches) for r in range(self._pp_size)}

    def _rank_order(self, rank: int) -> list:
        raise NotImplementedError

    def _drawn_order(self, rank: int) -> list:
        return self._rank_order(rank)


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: all forwards, then all backwards (fill, drain)."""

    def _rank_order(self, rank):
        return gpipe_order(rank, self._n_microbatches)


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: after the warm-up, one forward and one backward in turn."""

    def __init__(self, stage, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads: bool = True):
        if n_microbatches < stage.num_stages:
            raise ValueError(f"Schedule1F1B: the number of microbatches ({n_microbatches}) must be greater than or "
                             f"equal to the number of stages ({stage.num_stages})")
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)

    def _rank_order(self, rank):
        return one_f_one_b_order(rank, self._num_stages, self._n_microbatches)

    def _drawn_order(self, rank):
        # torch's Schedule1F1B._get_pipeline_order, as torch draws it (one warm-up forward fewer than it
        # runs; on the last rank the first forward drawn is micro-batch 1): a picture, not run.
        S, M = self._num_stages, self._n_microbatches
        acts: list = [None] * rank
        num_forward = S - 1 - rank
        forward_mb = 0
        for i in range(num_forward):
            acts.append(_Action(rank, F, i))
            forward_mb = i
        acts += [None] * max(0, 2 * (S - 1 - rank))
        backward_mb, remaining = 0, M - num_forward
        while remaining > 0:
            forward_mb += 1
            acts.append(_Action(rank, F, forward_mb))
            remaining -= 1
            acts.append(_Action(rank, B, backward_mb))
            backward_mb += 1
        while backward_mb < M:
            acts += [None, _Action(rank, B, backward_mb)]
            backward_mb += 1
        return acts


class PipelineScheduleMulti(_PipelineSchedule):
    """A schedule with several stages per rank (stage s on group rank s % size)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True):
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Interleaved 1F1B (Narayanan et al. 2021, torch's variant): several
    stages per rank, depth first."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False):
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        self.n_local_stages = len(stages)
        if self._num_stages != self.n_local_stages * self._pp_size:
            raise ValueError(f"ScheduleInterleaved1F1B: {self._num_stages} stages on {self._pp_size} ranks, but this "
                             f"rank passed {self.n_local_stages}; every rank passes num_stages / group size stages")
        self.pipeline_order = {r: interleaved_order(r, self._pp_size, self.n_local_stages, n_microbatches)
                               for r in range(self._pp_size)}
        self.execution_order = {r: _add_reduce_grad(acts, n_microbatches) for r, acts in self.pipeline_order.items()}
