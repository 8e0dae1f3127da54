"""Point-to-point channels between pipeline stages, off the compute thread.

    channels = open_channels(group, pairs, p2p=None, timeout_s=...)   # collective over the pp group
    ch = channels[(src_stage, dst_stage)]
    ch.send(tensors, mb)          # queued; the channel's thread moves it
    ch.post_recvs(n)              # the next n messages are received as they come
    tensors = ch.recv(mb)         # blocks (bounded by the timeout) until micro-batch mb is here
    ch.flush()                    # every queued send is out (raises a send's error)

[Note: pipeline channels]
A channel carries one direction between two stages: the activations stage s
sends stage s+1, or the gradients stage s+1 sends back to stage s. Within a
channel every schedule here moves micro-batches in increasing order (a
stage's forwards run 0, 1, ..., M-1 and so do its backwards, in GPipe, 1F1B
and interleaved 1F1B alike), so a channel is a FIFO and needs no tags: the
k-th message sent is the k-th received. Channels are separate because the
order *across* them differs between ranks (1F1B's stage 0 sends activation 1
before it receives gradient 0; stage 1 sends gradient 0 before it receives
activation 1), so one ordered stream per pair of ranks would deadlock.

Each end has a thread of its own that does the blocking transfers, so the
compute thread only queues a send and, for a receive, takes what the
receiving thread already has. A receiving end is told at the start of a step
how many messages to expect (``post_recvs``), so no transfer is left
pending between steps or at exit.

A message is a tuple of tensors (a stage's outputs, or the gradients of its
inputs, None where an input needs none). It travels as a header of
kHeaderSlots float64 values (number of tensors; per tensor: dtype code,
requires_grad, number of dims, dims; the payload's bytes), then the
payload: every tensor's bytes, concatenated. Bytes are copied, never
converted, so what arrives is bitwise what was sent, whatever the dtype.

Carriers (chosen once for all channels of a pipeline, see ``open_channels``):
  shm             a two-rank shared-memory segment per channel
                  (pydist.transport's ShmTransport); a transfer is one
                  all-gather of the header and one of the payload, in which
                  the receiver contributes an empty shard of the same size.
                  That moves the payload twice (a dedicated point-to-point
                  protocol in csrc/transport would halve it), still far less
                  than gloo's loopback TCP for activations of this size.
  process_group   torch.distributed send/recv over the pipeline's group
                  (gloo, or any backend with point-to-point), one tag per
                  channel.
  local           both stages on this rank: the tensors are handed over.
With PYDIST_SIM_NET set, the sending thread holds each message for the
simulated link's time (latency + bytes / bandwidth) before moving it; the
data are unchanged.

Failure: a channel's error (a peer gone, a timeout) is raised, naming the
stages and ranks, by the next ``recv``/``flush`` on the compute thread. A
rank whose step fails calls ``abort`` on its channels: every outgoing
channel then carries an abort message naming the failed stage, so the
peers waiting on it fail at once instead of after the timeout, and pass the
abort on (see [Note: nothing hangs] in pydist/pipelining/schedules.py).
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from pydist.overlap import hooks as overlap_hooks  # [overlap hook] PYDIST_SIM_NET on p2p transfers

__all__ = ["P2PError", "Carrier", "Channel", "open_channels", "encode", "decode"]

kHeaderSlots = 64
# Header slot 0 of an abort message; slot 1 is the failed stage.
_ABORT = -1.0

# dtype <-> code carried in a header (codes are this list's indices).
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_NONE = -1  # dtype code of a None entry


class P2PError(RuntimeError):
    """A transfer between pipeline stages failed or timed out; the message
    names the stages, the ranks and the micro-batch."""


class Carrier(enum.Enum):
    SHM = "shm"
    PROCESS_GROUP = "process_group"
    LOCAL = "local"


def encode(tensors: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload bytes) of a tuple of tensors (None allowed)."""
    slots: list[float] = [float(len(tensors))]
    pieces = []
    for t in tensors:
        if t is None:
            slots += [float(_NONE), 0.0, 0.0]
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pydist.pipelining: a stage sends only tensors (or None), got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"pydist.pipelining: cannot send a tensor of dtype {t.dtype}")
        slots += [float(_DTYPES.index(t.dtype)), float(t.requires_grad), float(t.dim()), *map(float, t.shape)]
        pieces.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
    payload = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    slots.append(float(payload.numel()))
    if len(slots) > kHeaderSlots:
        raise ValueError(f"pydist.pipelining: a message of {len(tensors)} tensors of these ranks does not fit the "
                         f"{kHeaderSlots}-slot header; send fewer, or flatter, tensors between stages")
    header = torch.zeros(kHeaderSlots, dtype=torch.float64)
    header[: len(slots)] = torch.tensor(slots, dtype=torch.float64)
    return header, payload


def payload_bytes(header: torch.Tensor) -> int:
    """The payload size a header announces."""
    h = header.tolist()
    i = 1
    for _ in range(int(h[0])):
        code, ndim = int(h[i]), int(h[i + 2])
        i += 3 + (ndim if code != _NONE else 0)
    return int(h[i])


def decode(header: torch.Tensor, payload: torch.Tensor) -> tuple:
    """The tuple ``encode`` made; tensors that required grad come back as
    leaves that require grad (a stage's received activations)."""
    h = header.tolist()
    out = []
    i, offset = 1, 0
    for _ in range(int(h[0])):
        code, requires_grad, ndim = int(h[i]), bool(h[i + 1]), int(h[i + 2])
        if code == _NONE:
            out.append(None)
            i += 3
            continue
        shape = [int(d) for d in h[i + 3: i + 3 + ndim]]
        i += 3 + ndim
        dtype = _DTYPES[code]
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        t = torch.empty(shape, dtype=dtype)
        t.reshape(-1).view(torch.uint8).copy_(payload[offset: offset + nbytes])
        offset += nbytes
        out.append(t.requires_grad_(requires_grad))
    return tuple(out)


class _Link:
    """Moves one encoded message, blocking, on a channel's thread."""

    def send(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        raise NotImplementedError

    def recv(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _ShmLink(_Link):
    """A two-rank ShmTransport: the sender is its rank 0 (see [Note: pipeline channels])."""

    def __init__(self, shm, sender: bool):
        self.shm = shm
        self.sender = sender

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        out = torch.empty(2 * mine.numel(), dtype=mine.dtype)
        self.shm.all_gather(mine, out).wait()
        return out[: mine.numel()]  # rank 0's shard: the sender's

    def send(self, header, payload):
        self._gather(header)
        if payload.numel():
            self._gather(_as_f64(payload))

    def recv(self):
        header = self._gather(torch.zeros(kHeaderSlots, dtype=torch.float64))
        n = payload_bytes(header) if header[0].item() != _ABORT else 0
        if not n:
            return header, torch.empty(0, dtype=torch.uint8)
        words = self._gather(torch.zeros((n + 7) // 8, dtype=torch.float64))
        return header, words.view(torch.uint8)[:n]

    def close(self):
        self.shm.close()


def _as_f64(payload: torch.Tensor) -> torch.Tensor:
    """The payload's bytes as float64 words (the shared-memory transport's
    dtypes), padded to a whole word; only copied, never summed."""
    pad = (-payload.numel()) % 8
    if pad:
        payload = torch.cat([payload, torch.zeros(pad, dtype=torch.uint8)])
    return payload.view(torch.float64)


class _GroupLink(_Link):
    def __init__(self, group, peer: int, tag: int):
        self.group, self.peer, self.tag = group, peer, tag

    def send(self, header, payload):
        dist.send(header, group=self.group, group_dst=self.peer, tag=self.tag)
        if payload.numel():
            dist.send(payload, group=self.group, group_dst=self.peer, tag=self.tag)

    def recv(self):
        header = torch.empty(kHeaderSlots, dtype=torch.float64)
        dist.recv(header, group=self.group, group_src=self.peer, tag=self.tag)
        n = payload_bytes(header) if header[0].item() != _ABORT else 0
        payload = torch.empty(n, dtype=torch.uint8)
        if n:
            dist.recv(payload, group=self.group, group_src=self.peer, tag=self.tag)
        return header, payload


class _Failure:
    """A transfer's error, delivered in place of a message."""

    def __init__(self, error: BaseException):
        self.error = error


class Channel:
    """One direction between two stages; see [Note: pipeline channels].
    Lives as long as the stages' pipeline (closed by ``close``)."""

    def __init__(self, src_stage: int, dst_stage: int, src_rank: int, dst_rank: int, my_rank: int,
                 link: _Link | None, timeout_s: float, delay: Callable[[int], float] | None = None,
                 on_transfer: Callable[[str, int, int, int, int], None] | None = None):
        self.src_stage, self.dst_stage = src_stage, dst_stage
        self.src_rank, self.dst_rank = src_rank, dst_rank
        self.sending = my_rank == src_rank  # this rank's end: the sender's, or the receiver's (both when local)
        self.receiving = my_rank == dst_rank
        self.kind = "activations" if dst_stage > src_stage else "gradients"
        self.carrier = Carrier.LOCAL if link is None else (
            Carrier.SHM if isinstance(link, _ShmLink) else Carrier.PROCESS_GROUP)
        self.timeout_s = timeout_s
        self._link = link
        self._delay = delay  # the simulated link's seconds for a payload of n bytes, or None
        self._on_transfer = on_transfer  # records hook: (what, mb, start_ns, end_ns, bytes)
        self._arrived: queue.Queue = queue.Queue()  # (mb, tuple) or (mb, _Failure), in order
        self._jobs: queue.Queue = queue.Queue()  # this end's thread's work, in order
        self._sends_pending = 0
        self._send_error: BaseException | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._next_recv_mb = 0  # the micro-batch the next posted receive will be labelled with

    # --- naming, for errors ------------------------------------------------
    def describe(self) -> str:
        return (f"{self.kind} of stage {self.src_stage} (rank {self.src_rank}) -> stage {self.dst_stage} "
                f"(rank {self.dst_rank}) over {self.carrier.value}")

    # --- the compute thread's side -------------------------------------------
    def send(self, tensors: tuple, mb: int) -> None:
        """Queues ``tensors`` (micro-batch ``mb``); returns at once."""
        self._raise_send_error()
        if self._link is None:
            self._arrived.put((mb, tuple(t.detach().requires_grad_(t.requires_grad) if t is not None else None
                                         for t in tensors)))
            return
        header, payload = encode(tensors)
        with self._lock:
            self._sends_pending += 1
        self._submit(lambda: self._send_now(header, payload, mb))

    def post_recvs(self, n: int, first_mb: int = 0) -> None:
        """The next ``n`` messages (micro-batches first_mb, first_mb+1, ...)
        are received by this end's thread as they come."""
        self._next_recv_mb = first_mb
        if self._link is None:
            return
        for i in range(n):
            self._submit(lambda mb=first_mb + i: self._recv_now(mb))

    def recv(self, mb: int) -> tuple:
        """Micro-batch ``mb``'s tensors, waiting at most the timeout."""
        try:
            got_mb, got = self._arrived.get(timeout=self.timeout_s)
        except queue.Empty:
            raise P2PError(f"pydist.pipelining: waited {self.timeout_s:g}s for the {self.describe()} of "
                           f"micro-batch {mb}: stage {self.src_stage} on rank {self.src_rank} did not send it "
                           f"(stalled, or not running the same schedule)") from None
        if isinstance(got, _Failure):
            raise got.error
        if got_mb != mb:
            raise P2PError(f"pydist.pipelining: expected micro-batch {mb} of the {self.describe()}, got {got_mb}: "
                           f"the ranks run different schedules or micro-batch counts")
        return got

    def flush(self) -> None:
        """Waits until every queued send is out; raises the first send's error."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while self._sends_pending and self._send_error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise P2PError(f"pydist.pipelining: the {self.describe()} did not go out within "
                                   f"{self.timeout_s:g}s: stage {self.dst_stage} on rank {self.dst_rank} did not "
                                   f"receive it")
                self._idle.wait(left)
        self._raise_send_error()

    def abort(self, failed_stage: int, reason: str) -> None:
        """Tells the receiving peer that ``failed_stage`` failed (an abort
        message after what is queued), so it fails now instead of after the
        timeout. Only the sending end of a remote channel sends one."""
        if not self.sending or self._link is None or self._closed:
            return
        header = torch.zeros(kHeaderSlots, dtype=torch.float64)
        codes = reason.encode()[: 8 * (kHeaderSlots - 3)]
        header[0], header[1], header[2] = _ABORT, float(failed_stage), float(len(codes))
        text = torch.frombuffer(bytearray(codes.ljust(8 * (kHeaderSlots - 3), b"\0")), dtype=torch.float64)
        header[3:] = text
        self._submit(lambda: self._link.send(header, torch.empty(0, dtype=torch.uint8)), abort=True)

    def close(self, wait_s: float = 1.0) -> None:
        """Stops this end's thread and drops the link. A sending end first
        gives its queued sends (an abort among them) at most ``wait_s``; a
        receiving end's pending receives are dropped."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(wait_s if self.sending else 0.0)
        if self._link is not None:
            self._link.close()

    # --- this end's thread ---------------------------------------------------
    def _submit(self, job, abort: bool = False) -> None:
        if self._closed:
            raise P2PError(f"pydist.pipelining: the {self.describe()} is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"pydist-pp-{self.src_stage}to{self.dst_stage}")
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        failed = False
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if failed:
                continue  # after an error, only what the compute thread raises matters
            try:
                job()
            except BaseException as exc:  # delivered to the compute thread, never lost
                failed = True
                self._fail(exc)

    def _where(self) -> str:
        if self.carrier is Carrier.SHM:  # the segment numbers its two ranks itself
            return (f" (in the channel's segment rank 0 is rank {self.src_rank}, the sender, and rank 1 is rank "
                    f"{self.dst_rank})")
        return ""

    def _send_now(self, header, payload, mb) -> None:
        start = time.monotonic_ns()
        if self._delay is not None:
            time.sleep(self._delay(payload.numel()))
        try:
            self._link.send(header, payload)
        except Exception as exc:
            raise P2PError(f"pydist.pipelining: sending the {self.describe()} of micro-batch {mb} failed: {exc}"
                           f"{self._where()}") from exc
        if self._on_transfer is not None:
            self._on_transfer("send", mb, start, time.monotonic_ns(), payload.numel())
        with self._lock:
            self._sends_pending -= 1
            self._idle.notify_all()

    def _recv_now(self, mb) -> None:
        start = time.monotonic_ns()
        try:
            header, payload = self._link.recv()
        except Exception as exc:
            raise P2PError(f"pydist.pipelining: receiving the {self.describe()} of micro-batch {mb} failed: "
                           f"{exc}{self._where()}") from exc
        if header[0].item() == _ABORT:
            n = int(header[2].item())
            reason = header[3:].contiguous().view(torch.uint8)[:n].numpy().tobytes().decode(errors="replace")
            raise P2PError(f"pydist.pipelining: stage {int(header[1].item())} failed, so stage {self.dst_stage} "
                           f"(rank {self.dst_rank}) stops: {reason}")
        self._arrived.put((mb, decode(header, payload)))
        if self._on_transfer is not None:
            self._on_transfer("recv", mb, start, time.monotonic_ns(), payload.numel())

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.sending and self._send_error is None:
                self._send_error = exc
            self._idle.notify_all()
        if self.receiving:
            self._arrived.put((-1, _Failure(exc)))

    def _raise_send_error(self) -> None:
        if self._send_error is not None:
            raise self._send_error


# How many times each group opened channels: every rank of a group opens the
# same pipelines in the same order (open_channels is collective), so the
# count agrees across ranks and goes into the tags. Messages a failed
# pipeline left in flight then never match a later pipeline's receives.
_generations: dict = {}


def _tag(generation: int, num_stages: int, src: int, dst: int) -> int:
    """The process-group tag of channel src -> dst: distinct per directed stage pair and per generation."""
    return 1000 + 2 * num_stages * generation + 2 * min(src, dst) + (1 if dst < src else 0)


def choose_carrier(p2p: str | None) -> str | None:
    if p2p not in (None, "shm", "process_group"):
        raise ValueError(f"pydist.pipelining: p2p={p2p!r}; pass None (shared memory where every rank can map it, "
                         f"else the process group), 'shm' or 'process_group'")
    return p2p


def open_channels(group, stage_ranks: dict[int, int], num_stages: int, p2p: str | None, timeout_s: float,
                  on_transfer=None) -> tuple[dict[tuple[int, int], Channel], str]:
    """Collective over ``group`` (every rank of the pipeline, same arguments):
    the channels this rank has an end of, by (src_stage, dst_stage), and the
    carrier that runs between ranks. ``stage_ranks``: group rank of each
    stage. ``p2p``: None takes shared memory when every pair of ranks can
    map a segment, else the process group; "shm" requires it (raises, on
    every rank, saying why not); "process_group" keeps to the group."""
    choose_carrier(p2p)
    me = dist.get_rank(group)
    verdicts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, p2p, group=group)
    if len(set(verdicts)) > 1:
        raise ValueError("pydist.pipelining: p2p differs across ranks ("
                         + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(verdicts)) + "); pass the same")
    directed = []
    for s in range(num_stages - 1):
        directed += [(s, s + 1), (s + 1, s)]
    remote = [(a, b) for a, b in directed if stage_ranks[a] != stage_ranks[b]]
    shm_ends = None
    why_not = ""
    if p2p != "process_group" and remote:
        from pydist.transport import shm_segment

        shm_ends, why_not = shm_segment.map_pair_segments(
            group, [(stage_ranks[a], stage_ranks[b]) for a, b in remote], timeout_s)
        if shm_ends is None and p2p == "shm":
            raise RuntimeError(f"pydist.pipelining(p2p='shm'): the stages cannot exchange tensors through shared "
                               f"memory ({why_not}). Pass p2p=None to fall back to the process group.")
    key = getattr(group, "group_name", None) or id(group)
    generation = _generations[key] = _generations.get(key, -1) + 1
    delay = overlap_hooks.p2p_delay()  # [overlap hook] PYDIST_SIM_NET: None when unset
    channels = {}
    for src, dst in directed:
        a, b = stage_ranks[src], stage_ranks[dst]
        if me not in (a, b):
            continue
        if a == b:
            link = None
        elif shm_ends is not None:
            link = _ShmLink(shm_ends[remote.index((src, dst))], sender=(me == a))
        else:
            link = _GroupLink(group, b if me == a else a, tag=_tag(generation, num_stages, src, dst))
        on = (lambda what, mb, t0, t1, n, s=src, d=dst: on_transfer(s, d, what, mb, t0, t1, n)) if on_transfer else None
        channels[(src, dst)] = Channel(src, dst, a, b, me, link, timeout_s, delay=delay, on_transfer=on)
    carrier = "local" if not remote else ("shm" if shm_ends is not None else "process_group")
    return channels, carrier
