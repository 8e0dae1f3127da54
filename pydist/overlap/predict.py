"""What-if: a DDP step under another simulated link, bucket cap or chunk
size, predicted from one recorded run.

    PYDIST_TRACE=traces PYDIST_SIM_NET=10Gbps,20us torchrun --nproc_per_node=2 train.py
    python -m pydist.overlap predict traces --link 1Gbps,20us --bucket-cap-mb 4 --json
    python -m pydist.overlap predict traces --link 1Gbps,20us --recommend 0.25,1,4,25  # [Note: the recommended cap]
    # a run across hosts over a real 1 Gb/s link (no simulated one), predicted at 0.1 Gb/s:
    python -m pydist.overlap predict traces --recorded-link 1Gbps --link 0.1Gbps --bucket-cap-mb 4

[Note: the what-if predictor]
A trace holds, per step and rank, when each parameter's gradient became
ready, when each chunk was launched and completed, when autograd ended and
when each bucket was written back. The predictor replays every recorded
step under the new settings and takes the median:

1. Buckets. The new cap re-buckets the parameters with the reducer's own
   function (``pydist.ddp.buckets.rebuilt_buckets``, the order being the one
   gradients became ready in on rank 0, as the reducer rebuilds from), and
   each bucket is cut into chunks as the reducer cuts it (``chunk_slots``,
   the rule of ``split_into_chunks`` in csrc/reducer/bucket.cpp). A chunk
   launches in the hook of its last gradient, once every chunk before it
   (in bucket order) has launched.
2. Compute. The gaps between consecutive gradients are the backward's
   compute, slowed by the launches the recording made in them: a launch
   copies the gradients into the bucket on the compute thread, and the
   transport then reduces them on cores the backward shares. The slowdown
   is taken as ``slowdown`` ms per launched byte, measured from the
   recording: gaps of parameters of the same kind (name pattern and shape,
   and the same for the gradient before) are compared with and without a
   launch in them (a least-squares fit within each kind). The gaps are
   freed of the recorded launches and charged with the new ones. Beyond
   that, the transport's work on a collective preempts the backward in
   whichever later gap it runs beside: ``contention`` ms per ms the
   transport is busy, measured from the gaps' tails ([Note: contention]).
3. Link. For a real link (``--recorded-link``), see [Note: simulated and
   real links]. A simulated one as it models it ([Note: simulated network] in
   csrc/transport/sim_net_transport.cpp, ``network.model_seconds``): one
   transfer at a time per rank, in launch order, each taking the
   alpha-beta time of a ring all-reduce; a chunk completes at the later of
   its modelled end and when the transport behind the link (shared memory)
   finished it, which needs every rank's launch and then ``inner_fixed``
   ms per collective plus ``inner`` ms per byte, plus ``completion_delay``
   (the timer thread waking late: the median lateness of recorded chunks
   against the recorded link's model). See [Note: the transport's fixed
   cost] for how the two inner costs are measured.
4. Finalize. After autograd, buckets are waited for in order and written
   back at ``write_back`` ms per byte (measured): the step ends when the
   last is written back ([Note: exposed communication] in analysis.py).

``step_ms`` is what the trace calls a step: from the end of forward (the
reducer armed) to the gradients written back, the median over steps of the
ranks' mean. Forward and the optimizer are not in the records and do not
depend on the link or the cap.
"""

from __future__ import annotations

import math
import re
import statistics
from enum import Enum
from typing import NamedTuple, Sequence

from pydist.overlap import network

__all__ = ["LinkKind", "LinkTime", "Settings", "Calibration", "fit_fixed_and_per_byte", "Prediction",
           "BucketPrediction", "Recording", "load_recording", "chunk_slots",
           "rebucket", "calibrate", "settings_for", "predict", "recommend", "prediction_error", "choose_cap",
           "DEFAULT_RECOMMEND_CAPS_MB", "recorded_step_ms", "predict_json", "predict_text"]

MB = 1024 * 1024
# The caps ``predict`` weighs for its recommendation when none are given
# (bench_overlap.py's), beside the recorded cap and the one asked about.
DEFAULT_RECOMMEND_CAPS_MB = (0.25, 1.0, 4.0, 25.0)
# Lateness (ms) beyond which a recorded chunk counts as finished by the
# transport behind the link rather than by the link's model.
_INNER_BOUND_MS = 0.3
# Two recorded chunks whose sizes differ by at least this factor measure
# the transport's cost per byte apart from its fixed cost per collective.
_INNER_SIZE_RATIO = 1.5


# [Note: simulated and real links]
# The recorded run's collectives crossed one of two kinds of link, and the
# link predicted is of the same kind:
#
# - SIMULATED: pydist's simulated link (PYDIST_SIM_NET, ``sim_net=``; the
#   trace names it), or none. The wrapper holds each completion until the
#   link's alpha-beta model allows, while the transport behind it moves the
#   data meanwhile: the two overlap, and a chunk completes at the later of
#   the two. The model's ring is the transport's (the world size).
# - REAL: a network the transport's own transfers cross, which pydist does
#   not simulate (gloo between hosts over a ``tc tbf``-shaped link): the
#   trace cannot say what it was, so the user names it (``--recorded-link``,
#   the rate the link is shaped or rated to). Moving the bytes over it is
#   part of the transport's own time, so its modelled time adds to the
#   transport's cost rather than overlapping it: calibration takes the
#   recorded link's time off the recorded collectives before fitting the
#   transport's fixed and per-byte cost (what is left is CPU work: copies,
#   the reduction, gloo's cost per message; [Note: collectives that share a
#   real link] says how), and a prediction adds the new link's time back.
#   No completion is held (no completion delay). The
#   ring is the hosts' (ranks on one host do not cross the link; the merged
#   trace's ``merged_hosts`` says which ranks share one): the hierarchical
#   transport's cross-host streams share their host's link and carry each
#   bucket across once between them, as one ring of the hosts would.
#
# Either way a rank sends 2 (n - 1) / n of an all-reduce's bytes over the
# link, at its bandwidth, with its latency per hop (``network.model_seconds``).
# What a real link costs beyond that is not modelled: packet headers (a
# shaper counts frames: at MTU 1500, 1514 bytes per 1448 of payload), TCP's
# ramp after idle, the shaper's burst. They fall into the per-byte cost
# fitted at the recorded rate, which does not scale with the link's rate.
class LinkKind(Enum):
    """What the recorded run's link was: see [Note: simulated and real links]."""

    SIMULATED = "simulated"  # pydist's simulated link (or none): it holds completions
    REAL = "real"            # crossed by the transport's own transfers: it takes time inside the transport


class LinkTime(NamedTuple):
    """One collective's time on a link: see [Note: simulated and real links]."""

    held_ms: float      # a simulated link's hold on the completion (from the transfer's start)
    transfer_ms: float  # a real link's share of the transport's own time


class Settings(NamedTuple):
    """A configuration to predict: link, caps and chunk size, in bytes."""

    link: network.Link
    first_cap_bytes: int
    cap_bytes: int
    chunk_bytes: int

    def describe(self) -> dict:
        # caps are whole bytes (int(mb * MB), as the wrapper takes them): 4 decimals give the MB asked for back
        return {"link": str(self.link), "bucket_cap_mb": round(self.cap_bytes / MB, 4),
                "first_bucket_cap_mb": round(self.first_cap_bytes / MB, 4), "chunk_mb": round(self.chunk_bytes / MB, 4)}


class Calibration(NamedTuple):
    """What the recording says about this machine (see [Note: the what-if predictor])."""

    slowdown_ms_per_byte: float    # compute time a launch during backward costs, per byte launched
    inner_ms_per_byte: float       # the transport behind the link, per byte all-reduced
    completion_delay_ms: float     # a held completion's lateness
    write_back_ms_per_byte: float  # finalize writing a bucket back
    inner_fixed_ms: float = 0.0    # the transport behind the link, per collective (see [Note: the transport's fixed cost])
    contention: float = 0.0        # backward ms lost per ms the transport works beside it (see [Note: contention])

    def inner_ms(self, nbytes: int) -> float:
        """The transport's time for one collective of ``nbytes``."""
        return self.inner_fixed_ms + self.inner_ms_per_byte * nbytes

    def describe(self) -> dict:
        return {"slowdown_ms_per_mb": self.slowdown_ms_per_byte * MB, "inner_fixed_ms": self.inner_fixed_ms,
                "inner_ms_per_mb": self.inner_ms_per_byte * MB,
                "completion_delay_ms": self.completion_delay_ms,
                "write_back_ms_per_mb": self.write_back_ms_per_byte * MB, "contention": self.contention}


class _Chunk(NamedTuple):
    bucket: int
    bytes: int
    launch_ms: float
    complete_ms: float


class _RankStep(NamedTuple):
    """One rank's record of one step, times in ms from its own start."""

    rank: int
    step: int
    start_ms: float              # on the merged clock: aligns ranks
    grad_ms: dict[int, float]    # parameter index -> ready
    backward_end_ms: float
    finalize_end_ms: float
    chunks: list[_Chunk]         # in launch order
    write_back: list[tuple[int, float]]  # per bucket: bytes, ms written back
    layout: tuple[tuple[int, ...], ...]  # the buckets' parameter indices


class Recording(NamedTuple):
    params: list[tuple[str, tuple[int, ...], str, str]]  # name, shape, dtype, device
    settings: Settings           # settings.link: the recorded link (infinite bandwidth: none)
    world_size: int
    ready_order: list[int]       # parameter indices, as gradients became ready on rank 0
    steps: dict[int, list[_RankStep]]  # step -> every rank's record of it
    link_kind: LinkKind = LinkKind.SIMULATED  # settings.link's kind, and so any predicted link's
    hosts: int = 1               # hosts the ranks ran on (the ring a real link carries)

    def param_bytes(self, index: int) -> int:
        _, shape, dtype, _ = self.params[index]
        return math.prod(shape) * _itemsize(dtype)

    def link_time(self, link: network.Link, nbytes: int) -> LinkTime:
        """An all-reduce of ``nbytes`` over ``link``, a link of this
        recording's kind: the one place that decides how a link acts on a
        collective ([Note: simulated and real links])."""
        if math.isinf(link.bandwidth_bps):
            return LinkTime(0.0, 0.0)
        if self.link_kind is LinkKind.REAL:
            return LinkTime(0.0, network.model_seconds("all_reduce", nbytes, self.hosts, link) * 1e3)
        return LinkTime(network.model_seconds("all_reduce", nbytes, self.world_size, link) * 1e3, 0.0)


def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


# --- reading a recording --------------------------------------------------------


def load_recording(document: dict, wrapper: int | None = None,
                   recorded_link: "str | network.Link | None" = None) -> Recording:
    """The steps of DDP wrapper ``wrapper`` (None: the first the trace
    holds) in a merged trace (every rank). ``recorded_link``: the real link
    the run crossed, which pydist did not simulate ([Note: simulated and
    real links]); None: the trace's simulated link, or none. Raises
    ``ValueError`` naming what the trace lacks."""
    from pydist.overlap.report import steps_from_trace

    infos = document.get("otherData", {}).get("wrappers", {})
    if wrapper is None:
        numbers = sorted(int(w) for w in infos if str(w).isdigit()) if isinstance(infos, dict) else []
        if not numbers:
            raise ValueError("no DDP wrapper's settings in otherData.wrappers (a trace from before the predictor, "
                             "or of no DDP wrapper); record it again with PYDIST_TRACE")
        wrapper = numbers[0]
    info = infos.get(str(wrapper)) if isinstance(infos, dict) else None
    if not isinstance(info, dict):
        raise ValueError(f"no settings of DDP wrapper {wrapper} in otherData.wrappers (a trace from before the "
                         "predictor, or not a DDP wrapper's); record it again with PYDIST_TRACE")
    try:
        params = [(str(n), tuple(int(d) for d in shape), str(dtype), str(device))
                  for n, shape, dtype, device in info["params"]]
        link = info["link"]
        settings = Settings(network.Link(float(link[0]), float(link[1])) if link else network.Link(math.inf, 0.0),
                            int(info["first_bucket_cap_bytes"]), int(info["bucket_cap_bytes"]), int(info["chunk_bytes"]))
        world_size = int(info["world_size"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"otherData.wrappers[{wrapper!r}] is damaged ({type(exc).__name__}: {exc})") from None
    named = document.get("otherData", {}).get("merged_hosts")
    # a trace merged before hosts were kept: every rank taken for a host of its own
    hosts = len(set(named)) if isinstance(named, list) and named and None not in named else world_size
    kind = LinkKind.SIMULATED
    if recorded_link is not None:
        if link:
            raise ValueError(f"--recorded-link {recorded_link}: the recorded run had a simulated link "
                             f"({settings.link}), which the trace names; --recorded-link names the real link of a "
                             "run without one")
        if hosts < 2:
            raise ValueError(f"--recorded-link {recorded_link}: every rank of the recording ran on one host "
                             f"({named[0] if named else '?'}); a real link lies between hosts")
        settings = settings._replace(link=network.parse_link(recorded_link))
        kind = LinkKind.REAL
    by_step: dict[int, list[_RankStep]] = {}
    for s in steps_from_trace(document):
        if s.wrapper != wrapper or not s.buckets:
            continue
        if any("grad_ms" not in b for b in s.buckets.values()):
            raise ValueError(f"rank {s.rank} step {s.step}: its buckets carry no per-parameter gradient times "
                             "(grad_ms); record it again with this pydist")
        try:
            by_step.setdefault(s.step, []).append(_rank_step(s))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"rank {s.rank} step {s.step}: a bucket's grad_ms, param_indices or chunk_times "
                             f"is damaged ({type(exc).__name__}: {exc})") from None
    complete = {k: v for k, v in by_step.items() if len(v) == world_size}
    if not complete:
        raise ValueError(f"no step of DDP wrapper {wrapper} recorded by all {world_size} ranks (pass the "
                         "PYDIST_TRACE directory with every rank's file)")
    # Steps with the final layout (the first iteration runs with the initial
    # buckets, before they are rebuilt from the gradient order), after a warm-up one.
    last = complete[max(complete)]
    layout = last[0].layout
    usable = sorted(k for k, v in complete.items() if all(r.layout == layout for r in v))
    if len(usable) > 2:
        usable = usable[1:]
    first = min(complete[usable[0]], key=lambda r: r.rank)
    order = sorted(first.grad_ms, key=lambda p: first.grad_ms[p])
    order += [p for p in range(len(params)) if p not in first.grad_ms]
    return Recording(params, settings, world_size, order, {k: complete[k] for k in usable}, kind, hosts)


def _rank_step(s) -> _RankStep:
    grads: dict[int, float] = {}
    chunks: list[_Chunk] = []
    write_back = []
    layout = []
    for index, b in s.buckets.items():
        layout.append(tuple(int(p) for p in b["param_indices"]))
        for p, t in zip(b["param_indices"], b["grad_ms"]):
            if t >= 0:
                grads[int(p)] = float(t)
        for _offset, nbytes, launch, complete in b["chunk_times"]:
            chunks.append(_Chunk(index, int(nbytes), float(launch), float(complete)))
        write_back.append((int(b["bytes"]), float(b["write_back_ms"])))
    chunks.sort(key=lambda c: c.launch_ms)
    a = s.args
    return _RankStep(s.rank, s.step, s.start_us / 1e3, grads, float(a["backward_end_ms"]), float(a["finalize_end_ms"]),
                     chunks, write_back, tuple(layout))


# --- the reducer's layout at other settings ---------------------------------------


def rebucket(recording: Recording, first_cap_bytes: int, cap_bytes: int) -> list[list[int]]:
    """The buckets the reducer builds at these caps, from the recorded
    gradient order: its own assignment function, on meta tensors."""
    import torch

    from pydist.ddp.buckets import rebuilt_buckets

    metas = [torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for _, shape, dtype, _ in recording.params]
    return rebuilt_buckets(metas, recording.ready_order, first_cap_bytes, cap_bytes)


def chunk_slots(param_bytes: Sequence[int], chunk_bytes: int) -> list[range]:
    """A bucket's chunks as ranges of its slots: a chunk closes once it
    holds ``chunk_bytes`` or more, or at the bucket's end (0: one chunk).
    The rule of ``split_into_chunks`` in csrc/reducer/bucket.cpp, which the
    tests hold this to through the reducer's records."""
    out, first, held = [], 0, 0
    for slot, nbytes in enumerate(param_bytes):
        held += nbytes
        if slot + 1 == len(param_bytes) or (chunk_bytes > 0 and held >= chunk_bytes):
            out.append(range(first, slot + 1))
            first, held = slot + 1, 0
    return out


# --- calibration ------------------------------------------------------------------


def _pattern(name: str) -> str:
    return re.sub(r"\d+", "#", name)


def _gaps(r: _RankStep, order: list[int]) -> tuple[list[float], list[int]]:
    """Per position in ``order`` (and one more, the tail to the end of
    autograd): the compute gap before it and the bytes launched in it."""
    times = [r.grad_ms[p] for p in order] + [r.backward_end_ms]
    gaps = [times[0]] + [b - a for a, b in zip(times, times[1:])]
    launched = [0] * len(times)
    for c in r.chunks:
        if c.launch_ms > r.backward_end_ms:
            continue
        # the first gradient stamped after the launch: the launch ran in its gap
        pos = next((i for i, t in enumerate(times) if t >= c.launch_ms), len(times) - 1)
        launched[pos] += c.bytes
    return gaps, launched


def calibrate(recording: Recording) -> Calibration:
    """See [Note: the what-if predictor]: slowdown, inner cost, completion
    delay and write-back, from the recorded steps."""
    order = [p for p in recording.ready_order if all(p in r.grad_ms for v in recording.steps.values() for r in v)]
    # Compute slowdown: per position, the median gap and launched bytes over steps and ranks.
    per_pos_gap = [[] for _ in range(len(order) + 1)]
    per_pos_x = [[] for _ in range(len(order) + 1)]
    for ranks in recording.steps.values():
        for r in ranks:
            gaps, launched = _gaps(r, order)
            for i, (g, x) in enumerate(zip(gaps, launched)):
                per_pos_gap[i].append(g)
                per_pos_x[i].append(x)
    y = [statistics.median(v) for v in per_pos_gap]
    x = [statistics.median(v) for v in per_pos_x]
    kinds: dict[tuple, list[int]] = {}
    for i in range(1, len(order)):
        here, before = recording.params[order[i]], recording.params[order[i - 1]]
        kinds.setdefault((_pattern(here[0]), here[1], _pattern(before[0]), before[1]), []).append(i)
    sxy = sxx = 0.0
    for members in kinds.values():
        if len(members) < 2:
            continue
        mx = statistics.fmean(x[i] for i in members)
        my = statistics.fmean(y[i] for i in members)
        sxy += sum((x[i] - mx) * (y[i] - my) for i in members)
        sxx += sum((x[i] - mx) ** 2 for i in members)
    slowdown = max(0.0, sxy / sxx) if sxx > 0 else 0.0

    # The link: replay the recorded chunks against the recorded link's model.
    link = recording.settings.link
    lateness, inner, stretches = [], [], []  # stretches: over a real link
    for ranks in recording.steps.values():
        launches: dict[int, list[float]] = {}
        for r in ranks:
            for k, c in enumerate(r.chunks):
                launches.setdefault(k, []).append(r.start_ms + c.launch_ms)
        for r in ranks:
            if recording.link_kind is LinkKind.REAL:  # no completion held: every chunk is the transport's
                starts = [max(launches[k]) - r.start_ms for k in range(len(r.chunks))]
                stretches += _busy_stretches(recording, r, starts)
                continue
            free, previous = -math.inf, -math.inf
            for k, c in enumerate(r.chunks):
                due = max(c.launch_ms, free) + recording.link_time(link, c.bytes).held_ms
                free = due
                late = c.complete_ms - due
                lateness.append(late)
                if late > _INNER_BOUND_MS and c.bytes > 0:
                    # the transport starts it once every rank launched it and it finished the one before
                    start = max(max(launches[k]) - r.start_ms, previous)
                    inner.append((c.complete_ms - start, c.bytes))
                previous = c.complete_ms
    if stretches:  # a real link: see [Note: collectives that share a real link]
        by_size: dict[int, list[float]] = {}
        for t, b in stretches:
            by_size.setdefault(b, []).append(t)
        # each size's lower quarter, every sample of it: a size recorded often weighs more than one seen twice
        inner = [(t, b) for b, ts in by_size.items() for t in sorted(ts)[:(len(ts) + 3) // 4]]
    if not stretches and len(inner) * 4 < len(lateness):
        # Fewer than a quarter of the chunks came late: those are hiccups (a
        # thread woken late), not the transport's cost, which never showed
        # behind this link; fitted on them alone, it would charge each chunk
        # a hiccup's whole time.
        inner = []
    early = [v for v in lateness if v <= _INNER_BOUND_MS]
    delay = max(0.0, statistics.median(early)) if early else 0.0
    inner_fixed, inner_per_byte = fit_fixed_and_per_byte([(t - delay, b) for t, b in inner])
    # the median, not the ratio of sums: a write-back the scheduler interrupted is an outlier, not a cost
    write_back = [t / b for v in recording.steps.values() for r in v for b, t in r.write_back if b > 0]
    cal = Calibration(slowdown, inner_per_byte, delay, statistics.median(write_back) if write_back else 0.0,
                      inner_fixed)
    return cal._replace(contention=_contention(recording, order, y, cal))


# [Note: contention]
# On cores the backward shares, the transport's work on a collective (its
# thread woken, the copies and the reduction, the peers met) takes CPU time
# from the backward while it runs. Little of that shows in the gap a launch
# falls in, which the per-byte slowdown reads from medians: it lands as a
# preemption in some gap the collective is busy beside, a different one
# each step, so in the tail of each position's gaps, which the medians
# leave out, and not in the gap of the launch. So the calibration compares,
# per position, the mean gap's excess over its median with the mean time
# the transport was busy beside that gap (each rank's collectives served
# one after another from its launches, ``inner_ms`` each), and with the
# median gap itself: other work on a shared machine stretches every gap
# in proportion to its compute, collectives or not. The least-squares
# coefficient of the busy time is ``contention``, backward ms lost per ms
# the transport works beside it, at most 1 (a rank's backward cannot lose
# more than the time its transport works). A gap counts at most its median
# plus the longest recorded collective's ``inner_ms``: a preemption the
# transport causes lasts no longer than its work, and a longer stretch is
# other work on the machine (without the bound a loaded machine's long
# preemptions read as contention: 1 on every loaded recording kept here).
#
# The replay takes each gap's share of the recorded contention off (the
# coefficient times the recorded busy time in it) and stretches the
# compute by the coefficient times the busy time the new layout puts
# beside it. So a layout whose one bucket launches at the end of the
# backward costs less backward than one with collectives throughout it,
# which the per-byte slowdown alone charges the same. Measured on the deep
# model of bench_overlap.py (2 ranks on 2 shared cores, caps interleaved
# step by step in one run, at 10 and at 100 Gb/s): the backward took 6.2
# and 6.0 ms with one bucket, 7.4 and 6.6 ms with 4 of 1 MB, 8.9 and 7.7 ms
# with 16 of 0.25 MB.
# What it cannot tell from a recording whose buckets are all one size is a
# collective's fixed cost apart from its cost per byte, and so the busy
# time of many small collectives: see [Note: the recommended cap].
def _busy(launches: Sequence[tuple[float, int]], cal: "Calibration") -> list[tuple[float, float]]:
    """One rank's transport busy intervals, its collectives served in launch order."""
    out, free = [], -math.inf
    for at, nbytes in sorted(launches):
        start = max(free, at)
        free = start + cal.inner_ms(nbytes)
        out.append((start, free))
    return out


def _overlaps(busy: list[tuple[float, float]], edges: list[float]) -> list[float]:
    """Per interval between consecutive ``edges`` (ascending, from 0), the
    busy time in it; ``busy``: ascending intervals that do not overlap."""
    out, low, first = [], 0.0, 0
    for high in edges:
        while first < len(busy) and busy[first][1] <= low:  # over before this interval: over for every later one
            first += 1
        total, k = 0.0, first
        while k < len(busy) and busy[k][0] < high:
            total += max(0.0, min(busy[k][1], high) - max(busy[k][0], low))
            k += 1
        out.append(total)
        low = max(low, high)
    return out


def _recorded_busy(r: _RankStep, order: list[int], cal: Calibration) -> list[float]:
    """Per gap of ``r``'s backward (as ``_gaps`` cuts it), the time its
    transport was busy beside it with the collectives launched in backward."""
    times = [r.grad_ms[p] for p in order] + [r.backward_end_ms]
    return _overlaps(_busy([(c.launch_ms, c.bytes) for c in r.chunks if c.launch_ms <= r.backward_end_ms], cal), times)


def _contention(recording: Recording, order: list[int], medians: list[float], cal: Calibration) -> float:
    """See [Note: contention]."""
    n = len(order) + 1
    longest = max((cal.inner_ms(c.bytes) for v in recording.steps.values() for r in v for c in r.chunks), default=0.0)
    sum_gap = [0.0] * n
    sum_busy = [0.0] * n
    count = 0
    for ranks in recording.steps.values():
        for r in ranks:
            gaps, _ = _gaps(r, order)
            for i, (g, b) in enumerate(zip(gaps, _recorded_busy(r, order, cal))):
                sum_gap[i] += min(g, medians[i] + longest)
                sum_busy[i] += b
            count += 1
    if not count:
        return 0.0
    # per position (the first gap holds the loss's backward, no gradient's compute): the mean gap's excess
    # over the median, against the median (other work on the machine stretches all compute alike) and the
    # mean busy time beside it; least squares through the origin
    rows = [(sum_gap[i] / count - medians[i], medians[i], sum_busy[i] / count) for i in range(1, n)]
    saa = sum(a * a for _, a, _ in rows)
    sbb = sum(b * b for _, _, b in rows)
    sab = sum(a * b for _, a, b in rows)
    sya = sum(y * a for y, a, _ in rows)
    syb = sum(y * b for y, _, b in rows)
    det = saa * sbb - sab * sab
    if det <= 0 or sbb <= 0:
        return 0.0
    f = (saa * syb - sab * sya) / det
    return min(1.0, max(0.0, f))


def _busy_stretches(recording: Recording, r: _RankStep, starts: list[float]) -> list[tuple[float, int]]:
    """One rank's recorded chunks over a real link as (ms, bytes) samples of
    the transport's cost: one per busy stretch, its average collective's
    (see [Note: collectives that share a real link]). ``starts``: per chunk,
    when every rank had launched it."""
    samples = []
    stretch: list[_Chunk] = []
    begin = end = -math.inf
    for c, start in sorted(zip(r.chunks, starts), key=lambda cs: cs[1]) + [(None, math.inf)]:
        if start > end and stretch:  # the link went idle: the stretch is over
            nbytes = sum(x.bytes for x in stretch)
            if nbytes > 0:
                on_link = sum(recording.link_time(recording.settings.link, x.bytes).transfer_ms for x in stretch)
                samples.append(((end - begin - on_link) / len(stretch), nbytes // len(stretch)))
            stretch = []
        if c is None:
            break
        if not stretch:
            begin, end = start, -math.inf
        stretch.append(c)
        end = max(end, c.complete_ms)
    return samples


# [Note: collectives that share a real link]
# gloo runs up to two collectives at once (ProcessGroupGloo's two worker
# threads), over one connection per peer: two buckets in flight share the
# link, and the one launched second can finish first. What one collective
# costs alone is then not in the records, and a chunk's time from its start
# to its completion is no sample of it. What a busy stretch of the link
# costs is: while collectives keep the link busy, however they share it,
# the last of a stretch ends when their summed costs have passed since the
# first one started. So over a real link the calibration cuts each rank's
# recorded chunks into busy stretches (a chunk that starts, every rank
# having launched it, after everything before it completed begins a new
# one), takes off each stretch's time the modelled link time of its bytes,
# and takes what is left per collective (the stretch's average) against the
# average collective's bytes. Interference only adds to that: collectives in
# flight together lose time to each other, and on cores the backward
# shares, to its compute (2 to 25 ms a collective on the shared 2-core
# machine, while most collectives that ran alone fit the link's model within
# about 2 ms). So, as a microbenchmark takes its faster runs, the fastest
# quarter of each size's samples is kept (all of them: a size recorded 40
# times weighs more than one the recording split off twice), and those are
# fitted as [Note: the transport's fixed cost] fits single collectives. The replay serves
# collectives one at a time in launch order, which ends a busy stretch at
# the same time; a bucket's own completion within a stretch may come in
# another order than recorded.


# [Note: the transport's fixed cost]
# A collective costs the transport behind the link a fixed time (a worker
# thread waking, the ranks meeting, the result handed back) plus a time
# per byte. Folded into one cost per byte, as a ratio measured at one size,
# the fixed part is charged again for every megabyte: measured at 1 MB
# buckets, one 25 MB bucket is predicted to cost what 25 buckets of 1 MB
# do, and fewer, larger buckets look worse than they are. So the recorded
# collectives that the transport, not the link, finished (each one's time
# from when every rank had launched it and the one before it was done, to
# its completion) are fitted as ``fixed + per_byte * bytes`` by Theil-Sen:
# the per-byte cost is the median slope over every pair of collectives
# whose sizes differ by at least _INNER_SIZE_RATIO, the fixed cost the
# median of what the per-byte cost leaves. Medians, because a collective the
# scheduler held up is an outlier, not a cost. When the recorded sizes are
# too alike for any such pair (a recording whose buckets are all one size),
# the two cannot be told apart from it: the fixed cost is then 0 and the
# per-byte cost the median ratio, as before; record with buckets of unlike
# sizes (a first bucket cap below the cap, or chunks) to measure both.
def fit_fixed_and_per_byte(samples: Sequence[tuple[float, int]]) -> tuple[float, float]:
    """(fixed ms, ms per byte) from (ms, bytes) samples: see [Note: the transport's fixed cost]."""
    samples = [(t, b) for t, b in samples if b > 0]
    if not samples:
        return 0.0, 0.0
    # Pairs from the samples sorted by size: at most a few thousand, taken evenly, bound the work.
    ordered = sorted(samples, key=lambda s: s[1])
    step = max(1, len(ordered) // 200)
    picked = ordered[::step]
    slopes = [(tj - ti) / (bj - bi) for i, (ti, bi) in enumerate(picked) for tj, bj in picked[i + 1:]
              if bj >= _INNER_SIZE_RATIO * bi]
    if not slopes:
        return 0.0, max(0.0, statistics.median(t / b for t, b in samples))
    per_byte = max(0.0, statistics.median(slopes))
    fixed = statistics.median(t - per_byte * b for t, b in samples)
    if fixed < 0.0:  # a negative fixed cost is noise: through the origin instead
        return 0.0, max(0.0, statistics.median(t / b for t, b in samples))
    return fixed, per_byte


# --- the replay -----------------------------------------------------------------


class BucketPrediction(NamedTuple):
    bucket: int
    params: int
    bytes: int
    chunks: int
    exposed_ms: float


class Prediction(NamedTuple):
    settings: Settings
    step_ms: float
    backward_ms: float
    exposed_ms: float
    buckets: list[BucketPrediction]

    def as_json(self) -> dict:
        return {"step_ms": self.step_ms, "backward_ms": self.backward_ms, "exposed_ms": self.exposed_ms,
                **self.settings.describe(),
                "buckets": [{"bucket": b.bucket, "params": b.params, "bytes": b.bytes, "chunks": b.chunks,
                             "exposed_ms": b.exposed_ms} for b in self.buckets]}


def predict(recording: Recording, settings: Settings, calibration: Calibration | None = None) -> Prediction:
    """The step under ``settings``: see [Note: the what-if predictor]."""
    cal = calibration or calibrate(recording)
    buckets = rebucket(recording, settings.first_cap_bytes, settings.cap_bytes)
    order = [p for p in recording.ready_order if all(p in r.grad_ms for v in recording.steps.values() for r in v)]
    position = {p: i for i, p in enumerate(order)}
    tail = len(order)  # a parameter without a gradient: its chunk launches at the end of autograd
    # The new chunks, in launch order: bytes, bucket, and the position whose hook launches them.
    chunks: list[tuple[int, int, int]] = []
    latest = 0
    for b, params in enumerate(buckets):
        sizes = [recording.param_bytes(p) for p in params]
        for slots in chunk_slots(sizes, settings.chunk_bytes):
            latest = max(latest, max(position.get(params[s], tail) for s in slots))
            chunks.append((sum(sizes[s] for s in slots), b, latest))
    launched_new = [0] * (len(order) + 1)
    for nbytes, _, pos in chunks:
        launched_new[min(pos + 1, len(order))] += nbytes
    on_link = [recording.link_time(settings.link, nbytes) for nbytes, _, _ in chunks]
    launched_at: list[list[int]] = [[] for _ in range(len(order) + 1)]
    for nbytes, _, pos in chunks:
        launched_at[min(pos, len(order))].append(nbytes)
    steps, backwards, exposed_total = [], [], []
    exposed_per_bucket = [[] for _ in buckets]
    for ranks in recording.steps.values():
        ready_at, launch_at = {}, {}
        for r in ranks:
            gaps, launched = _gaps(r, order)
            recorded_busy = _recorded_busy(r, order, cal)
            times, t, free = [], 0.0, -math.inf
            for i, (g, x_old, x_new) in enumerate(zip(gaps, launched, launched_new)):
                # the gap's compute: the recorded launches' slowdown and contention off, the new launches' on
                compute = max(0.0, g - cal.slowdown_ms_per_byte * x_old - cal.contention * recorded_busy[i])
                compute += cal.slowdown_ms_per_byte * x_new
                t += _stretched(compute, free - t, cal.contention)
                times.append(t)
                for nbytes in launched_at[i]:  # launched in the hook of this position's gradient
                    free = max(free, t) + cal.inner_ms(nbytes)
            ready_at[r.rank] = times
            launch_at[r.rank] = [r.start_ms + times[min(pos, len(order))] for _, _, pos in chunks]
        inner_done, inner_free = [], -math.inf
        for k, (nbytes, _, _) in enumerate(chunks):
            start = max(max(launch_at[r.rank][k] for r in ranks), inner_free)
            inner_free = start + cal.inner_ms(nbytes) + on_link[k].transfer_ms
            inner_done.append(inner_free)
        step_ms, exposed_sum, backward = [], 0.0, []
        per_bucket = [0.0] * len(buckets)
        for r in ranks:
            free = -math.inf
            complete = [-math.inf] * len(buckets)
            for k, (nbytes, b, _) in enumerate(chunks):
                due = max(launch_at[r.rank][k], free) + on_link[k].held_ms
                free = due
                complete[b] = max(complete[b], max(due, inner_done[k]) + cal.completion_delay_ms)
            end = r.start_ms + ready_at[r.rank][-1]
            done = end
            for b, params in enumerate(buckets):
                ready = max(end, done)
                wait = max(0.0, complete[b] - ready)
                per_bucket[b] += wait / len(ranks)
                exposed_sum += wait / len(ranks)
                nbytes = sum(recording.param_bytes(p) for p in params)
                done = max(ready, complete[b]) + cal.write_back_ms_per_byte * nbytes
            step_ms.append(done - r.start_ms)
            backward.append(ready_at[r.rank][-1])
        steps.append(statistics.fmean(step_ms))
        backwards.append(statistics.fmean(backward))
        exposed_total.append(exposed_sum)
        for b, v in enumerate(per_bucket):
            exposed_per_bucket[b].append(v)
    out_buckets = []
    for b, params in enumerate(buckets):
        sizes = [recording.param_bytes(p) for p in params]
        out_buckets.append(BucketPrediction(b, len(params), sum(sizes), len(chunk_slots(sizes, settings.chunk_bytes)),
                                            statistics.median(exposed_per_bucket[b])))
    return Prediction(settings, statistics.median(steps), statistics.median(backwards),
                      statistics.median(exposed_total), out_buckets)


def _stretched(compute: float, busy_ms: float, contention: float) -> float:
    """How long ``compute`` ms of backward take when the transport works for
    the next ``busy_ms`` ms beside it (see [Note: contention])."""
    if busy_ms <= 0.0 or contention <= 0.0:
        return compute
    if compute >= busy_ms * (1.0 - contention):  # the transport finishes first
        return compute + contention * busy_ms
    return compute / (1.0 - contention)


def recorded_step_ms(recording: Recording) -> float:
    """The recorded steps, as ``predict`` reports its own: median over steps of the ranks' mean."""
    return statistics.median(statistics.fmean(r.finalize_end_ms for r in v) for v in recording.steps.values())


def settings_for(recording: Recording, link: "str | network.Link | None" = None, bucket_cap_mb: float | None = None,
                 first_bucket_cap_mb: float | None = None, chunk_mb: float | None = None) -> Settings:
    """``recording``'s settings with what is given replaced; a cap given
    alone sets the first bucket's cap too (the wrapper's rule,
    ``pydist.ddp.buckets.bucket_caps``)."""
    from pydist.ddp.buckets import bucket_caps

    base = recording.settings
    first, cap = base.first_cap_bytes, base.cap_bytes
    if bucket_cap_mb is not None or first_bucket_cap_mb is not None:
        first, cap = bucket_caps(bucket_cap_mb if bucket_cap_mb is not None else base.cap_bytes / MB,
                                 first_bucket_cap_mb)
    return Settings(network.parse_link(link) if link is not None else base.link, first, cap,
                    int(chunk_mb * MB) if chunk_mb is not None else base.chunk_bytes)


# [Note: the recommended cap]
# ``recommend`` predicts the step at each cap offered and names the cap to
# use. A cap whose predicted step is within the predictor's own error of
# the fastest prediction is as good as the fastest, as far as the
# recording can tell; among those it names the one nearest the recorded
# cap (on a log scale; the larger of two as near), whose prediction
# replays the most of what was measured. The further a cap lies from the
# recorded one, the more its prediction rests on costs the recording shows
# only folded together: a recording whose buckets are all one size cannot
# tell a collective's fixed cost from its cost per byte ([Note: the
# transport's fixed cost]), and so prices many small buckets too low and
# few large ones too high. So the advice leaves the recorded cap only for
# a predicted gain larger than the predictor can vouch for.
#
# The error is in ms, measured from the recording: the larger of how far
# the prediction at the recorded settings lies from the recorded step, and
# the standard error of the recorded median step (1.2533 times the steps'
# spread over the square root of their count). In ms rather than a share
# of the step, because what the predictor is unsure of is the costs it
# measured on this machine, not the link's modelled time: a step ten times
# longer behind a slower link is no less certain to within those costs.
def prediction_error(recording: Recording, calibration: Calibration | None = None) -> float:
    """The predictor's own error on ``recording``, in ms (see [Note: the
    recommended cap])."""
    cal = calibration or calibrate(recording)
    recorded = recorded_step_ms(recording)
    own = abs(predict(recording, recording.settings, cal).step_ms - recorded)
    steps = sorted(statistics.fmean(r.finalize_end_ms for r in v) for v in recording.steps.values())
    half = (len(steps) + 1) // 2
    spread = min(b - a for a, b in zip(steps, steps[half - 1:])) / 1.349 if half >= 2 else 0.0
    return max(own, 1.2533 * spread / math.sqrt(len(steps)))


def recommend(recording: Recording, settings: Settings, caps_mb: Sequence[float],
              calibration: Calibration | None = None) -> dict:
    """The cap to use among ``caps_mb`` (the first bucket takes the same
    cap), at ``settings``' link and chunks: the one nearest the recorded cap
    among those whose predicted step is within the predictor's own error
    of the shortest (see [Note: the recommended cap])."""
    from pydist.ddp.buckets import bucket_caps

    cal = calibration or calibrate(recording)
    by_cap = {}
    for cap in caps_mb:
        first, cap_bytes = bucket_caps(cap)
        by_cap[cap] = predict(recording, settings._replace(first_cap_bytes=first, cap_bytes=cap_bytes), cal).step_ms
    error = prediction_error(recording, cal)
    recorded_mb = recording.settings.cap_bytes / MB
    best, tied = choose_cap(by_cap, recorded_mb, error)
    return {"cap_mb": best, "step_ms": by_cap[best], "fastest_cap_mb": min(by_cap, key=by_cap.get),
            "error_ms": error, "tied_caps_mb": tied, "recorded_cap_mb": round(recorded_mb, 4),
            "by_cap": [{"cap_mb": c, "step_ms": t} for c, t in by_cap.items()]}


def choose_cap(step_by_cap: dict[float, float], recorded_cap_mb: float, error_ms: float) -> tuple[float, list[float]]:
    """(the cap to use, the caps tied with the fastest) from predicted steps
    (ms) by cap: see [Note: the recommended cap]."""
    fastest = min(step_by_cap.values())
    tied = sorted(c for c, t in step_by_cap.items() if t <= fastest + error_ms)
    return min(tied, key=lambda c: (abs(math.log(c / recorded_cap_mb)), -c)), tied


def _link_text(link: network.Link, kind: LinkKind) -> str:
    if kind is LinkKind.REAL:
        return f"{link} (real)"
    return "no simulated link" if math.isinf(link.bandwidth_bps) else str(link)


def predict_json(document: dict, link=None, bucket_cap_mb=None, first_bucket_cap_mb=None, chunk_mb=None,
                 recommend_caps: Sequence[float] | None = None, wrapper: int | None = None,
                 recorded_link=None) -> dict:
    """What ``python -m pydist.overlap predict --json`` prints."""
    recording = load_recording(document, wrapper, recorded_link)
    cal = calibrate(recording)
    settings = settings_for(recording, link, bucket_cap_mb, first_bucket_cap_mb, chunk_mb)
    out = predict(recording, settings, cal).as_json()
    out["link"] = _link_text(settings.link, recording.link_kind)
    out["link_kind"] = recording.link_kind.value
    out["recorded"] = {"step_ms": recorded_step_ms(recording), "steps": len(recording.steps),
                       "ranks": recording.world_size, "hosts": recording.hosts, **recording.settings.describe(),
                       "link": _link_text(recording.settings.link, recording.link_kind)}
    out["calibration"] = cal.describe()
    if not recommend_caps:  # bench_overlap.py's caps, the recorded one and the one asked about
        recommend_caps = sorted({*DEFAULT_RECOMMEND_CAPS_MB, round(recording.settings.cap_bytes / MB, 4),
                                 round(settings.cap_bytes / MB, 4)})
    out["recommend"] = recommend(recording, settings, recommend_caps, cal)
    return out


def predict_text(result: dict) -> str:
    rec = result["recorded"]
    lines = [
        f"recorded: {rec['link']}, cap {rec['bucket_cap_mb']:g} MB, chunks {rec['chunk_mb']:g} MB: "
        f"step {rec['step_ms']:.2f} ms (median of {rec['steps']} steps, {rec['ranks']} ranks)",
        f"predicted: {result['link']}, cap {result['bucket_cap_mb']:g} MB, chunks {result['chunk_mb']:g} MB: "
        f"step {result['step_ms']:.2f} ms (backward {result['backward_ms']:.2f}, exposed {result['exposed_ms']:.2f})",
        f"{'bucket':>6} {'params':>6} {'MB':>8} {'chunks':>6} {'exposed ms':>10}",
    ]
    for b in result["buckets"]:
        lines.append(f"{b['bucket']:>6} {b['params']:>6} {b['bytes'] / MB:>8.2f} {b['chunks']:>6} {b['exposed_ms']:>10.2f}")
    if "recommend" in result:
        r = result["recommend"]
        caps = ", ".join(f"{c['cap_mb']:g} MB {c['step_ms']:.2f}" for c in r["by_cap"])
        lines.append(f"recommended cap: {r['cap_mb']:g} MB ({caps} ms; within the predictor's error of "
                     f"{r['error_ms']:.2f} ms: {', '.join(f'{c:g}' for c in r['tied_caps_mb'])} MB, the one "
                     f"nearest the recorded {r['recorded_cap_mb']:g} MB named)")
    return "\n".join(lines) + "\n"
