"""Chrome trace JSON (Perfetto, chrome://tracing) from the wrappers' records:
DDP's reducer's, and a sharded root's (each collective a "bucket" of its
own, named by kind, units and phase; see [Note: one record schema] in
pydist/ddp/records.py).

    PYDIST_TRACE=traces/ torchrun --nproc_per_node=2 train.py   # any unchanged script
    python -m pydist.overlap merge traces/ -o traces/merged.json
    python -m pydist.overlap report traces/merged.json [--plot step.png]

One file per rank, ``DIR/rank{R}.json``, written when the process group is
destroyed, when the process exits, and on an uncaught exception (whatever
was recorded by then; under mpiexec the rank that raised writes its trace
before pydist aborts the job, and ranks the abort kills write none). One trace process per rank (pid = rank); its tracks
(tids), per wrapper w (tid = 1000 w + track):

    0  steps            one slice per step: prepare_for_backward to grads written back
    1  backward         prepare_for_backward to the end of autograd
    2  gradients ready  per bucket, its first to its last gradient becoming ready
    3  exposed wait     finalize waiting for a bucket's collective after autograd ended
    4  write-back       finalize writing a bucket's results back into .grad
    10+b  bucket b      its communication, launch to completion; its chunks as
                        async slices (they may overlap each other)

A pipeline schedule's records (pydist.pipelining, StageRecord) add three
tracks per stage s, tid = TRACK_STAGE0 + 10 s + k: k = 0 its forwards,
backwards and end-of-step gradient work ("F3", "B3", "reduce_grad"), 1 its
sends, 2 its receives (each on its channel's thread, "send F3 -> stage 2").

Times are microseconds on the steady clock (time.monotonic_ns), the
reducer's. Each event's args carry the step, bucket, bytes and the exposed
and hidden milliseconds of [Note: exposed communication]; the report reads
them back from there. ``otherData`` holds the rank, host, transport and a
(monotonic, realtime) pair read together, which ``merge`` uses to put ranks
on different hosts on one clock.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Iterable

from pydist.overlap.analysis import analyze_step, chunk_exposure

__all__ = ["ENV", "TRACK_STEPS", "step_events", "trace_document", "write_trace", "merge_traces", "load_trace"]

ENV = "PYDIST_TRACE"
FORMAT = "pydist.overlap/1"
TRACK_STEPS, TRACK_BACKWARD, TRACK_GRADS, TRACK_EXPOSED, TRACK_WRITE_BACK = 0, 1, 2, 3, 4
TRACK_BUCKET0 = 10
TRACK_STAGE0 = 900_000  # pipeline stages' tracks; see the module docstring
_TRACKS_PER_WRAPPER = 1000
_TRACK_NAMES = {
    TRACK_STEPS: "steps",
    TRACK_BACKWARD: "backward compute",
    TRACK_GRADS: "gradients ready",
    TRACK_EXPOSED: "exposed wait",
    TRACK_WRITE_BACK: "write-back",
}


def _slice(name, cat, pid, tid, start_us, end_us, args) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": start_us,
            "dur": max(0.0, end_us - start_us), "args": args}


def step_events(record, rank: int, wrapper: int = 0) -> list[dict]:
    """The events of one IterationRecord (see the module comment)."""
    base_us = record.start_ns / 1e3
    us = lambda ms: base_us + ms * 1e3  # noqa: E731
    tid = lambda track: wrapper * _TRACKS_PER_WRAPPER + track  # noqa: E731
    step = analyze_step(record)
    it = record.iteration
    backward_start = getattr(record, "backward_start_ms", 0.0)
    grads = [b.last_grad_ms for b in record.buckets if b.last_grad_ms >= 0]
    events = [
        _slice(f"step {it}", "step", rank, tid(TRACK_STEPS), us(0.0), us(record.finalize_end_ms), {
            "step": it, "bytes": sum(b.bytes for b in record.buckets),
            "backward_end_ms": record.backward_end_ms, "finalize_end_ms": record.finalize_end_ms,
            "exposed_ms": step.exposed_ms, "waited_last": step.waited_last, "stalling": step.stalling,
            "transport": getattr(record, "transport", ""), "rank": getattr(record, "rank", rank),
            # this rank's last gradient ready: where the report finds stragglers
            "grads_ready_ms": max(grads) if grads else record.backward_end_ms,
        }),
        _slice("backward", "compute", rank, tid(TRACK_BACKWARD), us(backward_start), us(record.backward_end_ms),
               {"step": it}),
    ]
    if backward_start > 0:  # a sharded wrapper's record starts at its forward
        events.append(_slice("forward", "compute", rank, tid(TRACK_BACKWARD), us(0.0), us(backward_start),
                             {"step": it}))
    by_index = {b.index: b for b in record.buckets}
    for o in step.buckets:
        b = by_index[o.index]
        common = {"step": it, "bucket": b.index, "bytes": b.bytes}
        if b.first_grad_ms >= 0:
            events.append(_slice(f"grads of bucket {b.index}", "grads", rank, tid(TRACK_GRADS),
                                 us(b.first_grad_ms), us(b.last_grad_ms), {**common, "num_params": b.num_params}))
        if b.launch_ms >= 0:
            events.append(_slice(bucket_name(b), "comm", rank, tid(TRACK_BUCKET0 + b.index), us(b.launch_ms),
                                 us(b.complete_ms), {
                                     **common, "num_params": b.num_params,
                                     "first_grad_ms": b.first_grad_ms, "last_grad_ms": b.last_grad_ms,
                                     "launch_ms": b.launch_ms, "complete_ms": b.complete_ms, "done_ms": b.done_ms,
                                     "exposed_ms": o.exposed_ms, "hidden_ms": o.hidden_ms,
                                     "write_back_ms": o.write_back_ms, "chunks": len(getattr(b, "chunks", ()) or ()),
                                     **_sharded_args(b), **_predictor_args(b),
                                 }))
        if o.exposed_ms > 0:
            events.append(_slice(f"wait bucket {b.index}", "exposed", rank, tid(TRACK_EXPOSED), us(o.wait_start_ms),
                                 us(o.wait_start_ms + o.exposed_ms), {**common, "exposed_ms": o.exposed_ms}))
        if b.done_ms >= 0:
            events.append(_slice(f"write-back bucket {b.index}", "write_back", rank, tid(TRACK_WRITE_BACK),
                                 us(b.done_ms - o.write_back_ms), us(b.done_ms), {**common, "write_back_ms": o.write_back_ms}))
        for k, (c, exposed) in enumerate(zip(getattr(b, "chunks", ()) or (), chunk_exposure(b, o.wait_start_ms))):
            ident = f"{rank}.{wrapper}.{it}.{b.index}.{k}"
            args = {**common, "chunk": k, "offset": c.offset, "bytes": c.bytes, "collective": c.collective,
                    "exposed_ms": exposed}
            name = f"bucket {b.index} chunk {k}"
            events.append({"name": name, "cat": "chunk", "ph": "b", "id": ident, "pid": rank,
                           "tid": tid(TRACK_BUCKET0 + b.index), "ts": us(c.launch_ms), "args": args})
            events.append({"name": name, "cat": "chunk", "ph": "e", "id": ident, "pid": rank,
                           "tid": tid(TRACK_BUCKET0 + b.index), "ts": us(c.complete_ms)})
    return events


def bucket_name(b) -> str:
    """A DDP bucket's name, or a sharded wrapper's collective's: kind, units, phase."""
    if not getattr(b, "phase", ""):
        return f"bucket {b.index}"
    return f"{b.chunks[0].collective if b.chunks else 'collective'} {b.unit or '(root)'} ({b.phase})"


def _sharded_args(b) -> dict:
    if not getattr(b, "phase", ""):
        return {}
    return {"unit": b.unit, "phase": b.phase, "collective": b.chunks[0].collective if b.chunks else "",
            "needed_ms": b.needed_ms}


def _predictor_args(b) -> dict:
    """What the predictor (predict.py) replays a DDP bucket from: each
    parameter's gradient-ready time and each chunk's launch and completion."""
    if getattr(b, "phase", "") or not getattr(b, "param_indices", ()):
        return {}
    return {"param_indices": list(b.param_indices), "grad_ms": list(b.grad_ms),
            "chunk_times": [[c.offset, c.bytes, c.launch_ms, c.complete_ms] for c in b.chunks]}


def wrapper_info(ddp) -> dict:
    """A DDP wrapper's parameters (name, shape, dtype, as a plan lists them),
    bucket caps, chunk size, world size and simulated link: what the
    predictor needs to re-bucket and replay a trace (otherData.wrappers)."""
    from pydist.overlap import network

    spec = getattr(ddp, "_sim_net", None)
    link = network.parse_link(spec) if spec else network.link_from_env()
    return {
        "params": [[n, list(p.shape), str(p.dtype).replace("torch.", ""), str(p.device)]
                   for n, p in zip(ddp._param_names, ddp._params)],
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "first_bucket_cap_bytes": ddp.first_bucket_bytes_cap,
        "chunk_bytes": ddp._chunk_bytes,
        "world_size": ddp.reducer.transport.world_size,
        "link": None if link is None else [link.bandwidth_bps, link.latency_s],
    }


def _metadata(rank: int, wrappers: Iterable[int], buckets: dict[int, dict[int, str]]) -> list[dict]:
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
              {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
    for w in wrappers:
        prefix = f"ddp {w} " if w else ""
        names = dict(_TRACK_NAMES)
        names.update({TRACK_BUCKET0 + b: name for b, name in sorted(buckets.get(w, {}).items())})
        for track, name in names.items():
            tid = w * _TRACKS_PER_WRAPPER + track
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": prefix + name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    return events


def stage_events(records, rank: int) -> list[dict]:
    """Slices and track names of pipeline StageRecords (see the module docstring)."""
    events, tracks = [], {}
    letter = {"forward": "F", "backward": "B"}
    for r in records:
        kind = {"send": 1, "recv": 2}.get(r.action, 0)
        tid = TRACK_STAGE0 + 10 * r.stage + kind
        tracks[tid] = f"stage {r.stage} " + ("compute", "sends", "receives")[kind]
        if r.action in letter:
            name = f"{letter[r.action]}{r.microbatch}"
        elif r.action == "reduce_grad":
            name = "reduce_grad"
        else:
            moved = "F" if (r.peer > r.stage) == (r.action == "send") else "B"
            name = f"{r.action} {moved}{r.microbatch} {'->' if r.action == 'send' else '<-'} stage {r.peer}"
        events.append(_slice(name, "pipeline", rank, tid, r.start_ns / 1e3, r.end_ns / 1e3,
                             {"stage": r.stage, "microbatch": r.microbatch, "action": r.action, "peer": r.peer,
                              "bytes": r.bytes}))
    for tid, name in sorted(tracks.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    return events


def trace_document(logs: dict[int, list], rank: int, stage_records=(), wrappers: dict | None = None) -> dict:
    """A Chrome trace of one rank: ``logs`` maps a wrapper number to its
    IterationRecords; ``stage_records`` are pipeline StageRecords;
    ``wrappers`` maps a DDP wrapper's number to its ``wrapper_info``."""
    events: list[dict] = stage_events(stage_records, rank) if stage_records else []
    buckets: dict[int, dict[int, str]] = {}
    transports = set()
    for w, records in logs.items():
        for rec in records:
            events += step_events(rec, rank, w)
            buckets.setdefault(w, {}).update({b.index: bucket_name(b) for b in rec.buckets})
            transports.add(getattr(rec, "transport", ""))
    return {
        "traceEvents": _metadata(rank, logs.keys(), buckets) + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": FORMAT,
            "rank": rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "transport": ", ".join(sorted(t for t in transports if t)),
            # read together: merge maps this rank's steady clock onto the wall clock
            "clock_sync": {"monotonic_ns": time.monotonic_ns(), "realtime_ns": time.time_ns()},
            "wrappers": {str(w): info for w, info in (wrappers or {}).items()},
        },
    }


def write_trace(path: str, document: dict) -> None:
    """Atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(document, f)
    os.replace(tmp, path)


def load_trace(path: str) -> dict:
    """A trace file's document (the object form, or the bare array of
    events). Raises ``ValueError`` naming the file and what is wrong when it
    is not JSON (a truncated file) or not a Chrome trace: ``traceEvents``
    must be a list of objects whose ``ts`` and ``dur`` are numbers, ``args``
    and ``otherData`` objects. What the report reads beyond that is checked
    there (``report.steps_from_trace``)."""
    try:
        with open(path, "rb") as f:
            document = json.loads(f.read())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON, {exc.msg} at line {exc.lineno} column {exc.colno} "
                         f"(a truncated or damaged file?)") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a JSON text file ({exc.reason} at byte {exc.start})") from None
    if isinstance(document, list):  # the bare-array form of the format
        document = {"traceEvents": document}
    if not isinstance(document, dict) or "traceEvents" not in document:
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents)")
    events = document["traceEvents"]
    if not isinstance(events, list):
        raise ValueError(f"{path}: traceEvents is {_kind(events)}, not a list of events")
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise ValueError(f"{path}: traceEvents[{i}] is {_kind(e)}, not an event (an object)")
        for key in ("ts", "dur"):
            if key in e and not _is_number(e[key]):
                raise ValueError(f"{path}: traceEvents[{i}].{key} is {_kind(e[key])}, not a number")
        if "args" in e and not isinstance(e["args"], dict):
            raise ValueError(f"{path}: traceEvents[{i}].args is {_kind(e['args'])}, not an object")
    if not isinstance(document.get("otherData", {}), dict):
        raise ValueError(f"{path}: otherData is {_kind(document['otherData'])}, not an object")
    return document


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value) -> str:
    """How an error names a JSON value: its JSON type, and the value if short."""
    name = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)
    text = json.dumps(value)
    return f"{name} ({text})" if len(text) <= 40 else name


def merge_traces(paths: list[str]) -> dict:
    """One trace of several ranks' files on a common clock. Each rank's
    steady-clock times are mapped onto the wall clock through its own
    (monotonic, realtime) pair, so ranks on different hosts line up as well
    as their wall clocks agree (on one host the steady clock is already
    common and the mapping is the same for all); then everything is shifted
    so the earliest event is at 0."""
    documents = [load_trace(p) for p in paths]
    if not documents:
        raise ValueError("merge: no trace files given")
    shifts = []
    for path, doc in zip(paths, documents):
        sync = doc.get("otherData", {}).get("clock_sync")
        if sync is None:
            raise ValueError(f"merge: {path} has no otherData.clock_sync; was it written by pydist.overlap?")
        if not (isinstance(sync, dict) and all(_is_number(sync.get(k)) for k in ("realtime_ns", "monotonic_ns"))):
            raise ValueError(f"merge: {path}: otherData.clock_sync is {_kind(sync)}, not realtime_ns and "
                             "monotonic_ns numbers")
        shifts.append((sync["realtime_ns"] - sync["monotonic_ns"]) / 1e3)
    starts = [min((e["ts"] + s for e in d["traceEvents"] if "ts" in e), default=float("inf"))
              for d, s in zip(documents, shifts)]
    origin = min(starts)
    if origin == float("inf"):
        origin = 0.0
    merged: list[dict] = []
    ranks, hosts = [], []
    for doc, shift in zip(documents, shifts):
        for e in doc["traceEvents"]:
            e = dict(e)
            if "ts" in e:
                e["ts"] = e["ts"] + shift - origin
            merged.append(e)
        ranks.append(doc.get("otherData", {}).get("rank"))
        hosts.append(doc.get("otherData", {}).get("host"))
    return {
        "traceEvents": merged,
        "displayTimeUnit": "ms",
        "otherData": {"format": FORMAT, "merged_ranks": ranks,
                      "merged_hosts": hosts,  # each rank's hostname, in merged_ranks' order
                      "clock": "realtime, earliest event at 0",
                      "origin_realtime_us": origin, "sources": [os.path.abspath(p) for p in paths],
                      # the wrappers' parameters and settings (the same on every rank): see wrapper_info
                      "wrappers": next((d["otherData"]["wrappers"] for d in documents
                                        if d.get("otherData", {}).get("wrappers")), {})},
    }
