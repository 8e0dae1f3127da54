"""The per-bucket table and the one-step timeline of a trace.

    python -m pydist.overlap report traces/rank0.json            # or a merged trace
    python -m pydist.overlap report traces/merged.json --plot step.png [--step N] [--rank R]

The table is the one ``IterationRecord.report()`` prints for one step, over
every recorded step: per bucket the median of each time (ms from the start
of the step's backward), the median and worst exposed time (see [Note:
exposed communication]) and the step of the worst; then, per rank, the
bucket that stalls the steps: the one with the most exposed time in total,
with how often the step waited on it last. A sharded wrapper's "buckets"
are its collectives, named by kind, units and phase ("all_gather layers.0
(forward)"). Over a merged trace (or a directory of rank traces), the
stragglers (see [Note: stragglers]).
"""

from __future__ import annotations

import collections
from typing import NamedTuple

from pydist.overlap.analysis import median

__all__ = ["TraceStep", "steps_from_trace", "report_text", "report_json", "stragglers", "plot_step",
           "STRAGGLER_MS"]

STRAGGLER_MS = 1.0  # a rank whose gradients are ready this much later than all others' (median over steps) is named
STRAGGLER_SHARE = 0.75  # ... if it was that late in at least this share of the steps


class TraceStep(NamedTuple):
    rank: int
    wrapper: int
    step: int
    start_us: float  # in the trace's clock
    args: dict  # the step event's args
    buckets: dict  # bucket index -> the bucket event's args


# What the report reads from a step's and a bucket's event (trace.py writes them).
STEP_FIELDS = ("step", "exposed_ms", "backward_end_ms", "finalize_end_ms")
BUCKET_FIELDS = ("step", "bucket", "bytes", "first_grad_ms", "last_grad_ms", "launch_ms", "complete_ms", "done_ms",
                 "hidden_ms", "exposed_ms", "write_back_ms")


def steps_from_trace(document: dict) -> list[TraceStep]:
    """The steps a trace holds, read back from its events' args, ordered by
    rank, wrapper and step. Raises ``ValueError`` naming the first step or
    bucket event that lacks a field the report reads, or holds a non-number
    there (a trace that ``trace.load_trace`` has read)."""
    steps: dict[tuple, TraceStep] = {}
    buckets: dict[tuple, dict] = collections.defaultdict(dict)
    for i, e in enumerate(document["traceEvents"]):
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in ("step", "comm"):
            _check_fields(i, e, STEP_FIELDS if cat == "step" else BUCKET_FIELDS)
        key = (e["pid"], e["tid"] // 1000, e["args"].get("step"))
        if cat == "step":
            steps[key] = TraceStep(e["pid"], key[1], key[2], e["ts"], e["args"], {})
        elif cat == "comm":
            buckets[key][e["args"]["bucket"]] = e["args"]
    out = []
    for key in sorted(steps):
        out.append(steps[key]._replace(buckets=dict(sorted(buckets.get(key, {}).items()))))
    return out


def _check_fields(index: int, event: dict, fields: tuple) -> None:
    where = f"traceEvents[{index}] ({event.get('cat')} event {event.get('name')!r})"
    for key in ("pid", "tid"):
        if not isinstance(event.get(key), int) or isinstance(event.get(key), bool):
            raise ValueError(f"{where}: {key} is {event.get(key)!r}, not an integer")
    if event.get("cat") == "step" and "ts" not in event:
        raise ValueError(f"{where}: no ts")
    args = event.get("args")
    if not isinstance(args, dict):
        raise ValueError(f"{where}: no args object")
    for key in fields:
        value = args.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: args.{key} is {'missing' if key not in args else repr(value)}, "
                             "not a number")


def _fmt(x: float) -> str:
    return f"{x:9.2f}"


def report_text(document: dict) -> str:
    steps = steps_from_trace(document)
    if not steps:
        return "no recorded steps in this trace (was record_timing on, and did a synchronized backward run?)"
    lines = []
    groups = collections.defaultdict(list)
    for s in steps:
        groups[(s.rank, s.wrapper)].append(s)
    for (rank, wrapper), group in sorted(groups.items()):
        transport = group[-1].args.get("transport", "")
        title = f"rank {rank}" + (f", wrapper {wrapper}" if wrapper else "") + f" ({transport}): {len(group)} steps"
        exposed = [s.args["exposed_ms"] for s in group]
        worst = max(group, key=lambda s: s.args["exposed_ms"])
        lines += [
            title,
            f"  step: backward {median([s.args['backward_end_ms'] for s in group]):.2f} ms, grads ready "
            f"{median([s.args['finalize_end_ms'] for s in group]):.2f} ms, exposed communication median "
            f"{median(exposed):.2f} ms, worst {worst.args['exposed_ms']:.2f} ms (step {worst.step})  [medians over steps]",
            f"  {'bucket':>6} {'MB':>8} {'chunks':>6} {'1st grad':>9} {'last grad':>9} {'launch':>9} {'complete':>9} "
            f"{'done':>9} {'hidden':>9} {'exposed':>9} {'worst':>9} {'at step':>7}",
        ]
        per_bucket = collections.defaultdict(list)
        for s in group:
            for b, a in s.buckets.items():
                per_bucket[b].append((s.step, a))
        total_exposed, names = {}, {}
        for b, entries in sorted(per_bucket.items()):
            col = lambda k: median([a[k] for _, a in entries])  # noqa: E731
            worst_step, worst_args = max(entries, key=lambda e: e[1]["exposed_ms"])
            total_exposed[b] = sum(a["exposed_ms"] for _, a in entries)
            names[b] = _bucket_label(b, entries[-1][1])
            lines.append(
                f"  {b:>6} {entries[-1][1]['bytes'] / 2**20:>8.2f} {entries[-1][1].get('chunks', 0):>6}"
                + "".join(_fmt(col(k)) for k in ("first_grad_ms", "last_grad_ms", "launch_ms", "complete_ms", "done_ms",
                                                 "hidden_ms", "exposed_ms"))
                + f"{worst_args['exposed_ms']:9.2f} {worst_step:>7}"
                + (f"  {names[b]}" if names[b] != f"bucket {b}" else "")
            )
        waited_last = collections.Counter(s.args.get("waited_last") for s in group)
        if not total_exposed or max(total_exposed.values()) <= 0:
            lines.append("  no bucket stalled a step: all communication was hidden behind backward")
        else:
            stall = max(total_exposed, key=total_exposed.get)
            lines.append(
                f"  stalling bucket: {stall}{'' if names[stall] == f'bucket {stall}' else ' = ' + names[stall]} "
                f"({total_exposed[stall] / len(group):.2f} ms exposed per step on average, "
                f"{100 * total_exposed[stall] / max(sum(total_exposed.values()), 1e-12):.0f}% of all exposed time); "
                f"the step waited on it last in {waited_last.get(stall, 0)} of {len(group)} steps"
            )
        lines.append("")
    if len({s.rank for s in steps}) > 1:
        lines.append(_straggler_line(stragglers(steps)))
    else:
        lines.append("stragglers: need every rank's trace (report the PYDIST_TRACE directory, or a merged trace)")
    return "\n".join(lines).rstrip() + "\n"


def _bucket_label(index: int, args: dict) -> str:
    """How the report names a bucket: DDP's by index, a sharded wrapper's
    collective by kind, units and phase."""
    if "phase" not in args:
        return f"bucket {index}"
    return f"{args.get('collective', 'collective')} {args.get('unit') or '(root)'} ({args['phase']})"


# [Note: stragglers]
# A rank that is slow in backward makes every rank's step slow: the others
# wait for its gradients in the collectives, so each rank's step and
# backward time look alike. When its gradients became ready does not: each
# step event carries ``grads_ready_ms``, this rank's last gradient ready
# (DDP: its buckets' last_grad_ms; a sharded wrapper: its last reduction
# issued), which a merged trace puts on one clock. Per step (matched by
# wrapper and step number across ranks), rank r's *lead* is how much later
# its gradients were ready than every other rank's, 0 when some rank was
# later still: that is how long it held the others. A rank whose median lead
# over the steps all ranks recorded is at least ``threshold_ms``, and who
# held the others that long in at least STRAGGLER_SHARE of those steps, is
# a straggler: ``delay_ms`` that median, ``steps`` the number of steps it
# held the others by at least ``threshold_ms``. Balanced ranks take turns
# at being last by noise, so their medians stay near 0, and a rank that an
# oversubscribed machine happens to slow now and then is not last in three
# steps of four. Traces of one rank name none.
def stragglers(steps: list[TraceStep], threshold_ms: float = STRAGGLER_MS) -> list[dict]:
    """Most delaying first: see [Note: stragglers]."""
    ready: dict[tuple, dict[int, float]] = collections.defaultdict(dict)
    for s in steps:
        grads = s.args.get("grads_ready_ms", s.args["backward_end_ms"])
        ready[(s.wrapper, s.step)][s.rank] = s.start_us / 1e3 + grads
    ranks = sorted({s.rank for s in steps})
    if len(ranks) < 2:
        return []
    leads: dict[tuple, list[float]] = collections.defaultdict(list)  # (rank, wrapper) -> per step
    for (wrapper, _), per_rank in sorted(ready.items()):
        if len(per_rank) != len(ranks):
            continue  # a step some rank did not record
        for r, t in per_rank.items():
            leads[(r, wrapper)].append(max(0.0, t - max(u for q, u in per_rank.items() if q != r)))
    found = []
    for (r, wrapper), values in leads.items():
        delay = median(values)
        held = sum(v >= threshold_ms for v in values)
        if delay >= threshold_ms and held >= STRAGGLER_SHARE * len(values):
            found.append({"rank": r, "delay_ms": round(delay, 3), "steps": held,
                          "of_steps": len(values), "wrapper": wrapper})
    return sorted(found, key=lambda f: -f["delay_ms"])


def _straggler_line(found: list[dict]) -> str:
    if not found:
        return "stragglers: none (no rank's gradients were ready last by a margin, median over steps)"
    return "stragglers: " + "; ".join(
        f"rank {f['rank']} held the others {f['delay_ms']:.2f} ms per step (median; {f['steps']} of "
        f"{f['of_steps']} steps)" + (f", wrapper {f['wrapper']}" if f["wrapper"] else "") for f in found)


def report_json(document: dict) -> dict:
    """The report as one JSON object: per rank and wrapper the steps and the
    stalling bucket (its name, exposed ms per step), and the stragglers."""
    steps = steps_from_trace(document)
    groups = collections.defaultdict(list)
    for s in steps:
        groups[(s.rank, s.wrapper)].append(s)
    ranks = []
    for (rank, wrapper), group in sorted(groups.items()):
        total, names = collections.Counter(), {}
        for s in group:
            for b, a in s.buckets.items():
                total[b] += a["exposed_ms"]
                names[b] = _bucket_label(b, a)
        stall = max(total, key=total.get) if total and max(total.values()) > 0 else None
        ranks.append({
            "rank": rank, "wrapper": wrapper, "transport": group[-1].args.get("transport", ""), "steps": len(group),
            "exposed_ms_median": median([s.args["exposed_ms"] for s in group]),
            "stalling": None if stall is None else {"bucket": stall, "name": names[stall],
                                                    "exposed_ms_per_step": total[stall] / len(group)},
        })
    return {"ranks": ranks, "stragglers": stragglers(steps)}


def plot_step(document: dict, out_png: str, step: int | None = None, rank: int | None = None) -> TraceStep:
    """Draws one step's timeline (default: the first rank's worst step by
    exposed time): backward as a bar, each bucket's communication as a bar,
    its exposed part hatched in red, write-back after it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "pydist.overlap report --plot needs matplotlib, which is not installed: pip install matplotlib "
            "(it is in requirements-dev.txt and pydist's [dev] extra)"
        ) from exc
    steps = steps_from_trace(document)
    if rank is None and steps:
        rank = steps[0].rank
    candidates = [s for s in steps if s.rank == rank and (step is None or s.step == step)]
    if not candidates:
        raise ValueError(f"report --plot: no step {'' if step is None else step} of rank {rank} in this trace")
    chosen = max(candidates, key=lambda s: s.args["exposed_ms"])
    a = chosen.args
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * (len(chosen.buckets) + 1)))
    rows = ["backward"] + [f"bucket {b}" for b in chosen.buckets]
    labelled = set()

    def bar(y, start, length, height, label, **style):
        ax.broken_barh([(start, max(length, 0.01))], (y - height / 2, height),
                       label=None if label in labelled else label, **style)
        labelled.add(label)

    bar(0, 0, a["backward_end_ms"], 0.7, "backward compute", color="tab:blue")
    for y, ba in enumerate(chosen.buckets.values(), 1):
        if ba["first_grad_ms"] >= 0:
            bar(y - 0.3, ba["first_grad_ms"], ba["last_grad_ms"] - ba["first_grad_ms"], 0.12, "gradients ready",
                color="tab:gray")
        bar(y, ba["launch_ms"], ba["complete_ms"] - ba["launch_ms"], 0.5, "communication", color="tab:green")
        if ba["exposed_ms"] > 0:
            bar(y, ba["complete_ms"] - ba["exposed_ms"], ba["exposed_ms"], 0.5, "exposed (finalize waits)",
                facecolor="none", edgecolor="tab:red", hatch="///")
        if ba["write_back_ms"] > 0:
            bar(y, ba["done_ms"] - ba["write_back_ms"], ba["write_back_ms"], 0.5, "write-back", color="tab:orange")
    ax.axvline(a["backward_end_ms"], color="k", lw=0.8, ls="--")
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's backward began")
    ax.set_title(f"rank {chosen.rank}, step {chosen.step}: exposed communication {a['exposed_ms']:.2f} ms"
                 + (f", stalled on bucket {a['stalling']}" if a.get("stalling") is not None else ""))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return chosen
