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
import math
from typing import NamedTuple

from pydist.overlap.analysis import median

__all__ = ["TraceStep", "steps_from_trace", "report_text", "report_json", "stragglers", "plot_step",
           "STRAGGLER_MS", "STRAGGLER_NOISE_K", "STRAGGLER_SHARE"]

STRAGGLER_MS = 1.0  # the least median excess a straggler has (see [Note: stragglers])
STRAGGLER_NOISE_K = 3.0  # ... and at least this many standard errors of the median above 0
STRAGGLER_SHARE = 0.75  # ... and at least half that in this share of the steps


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
# backward time look alike. How long it took to make its gradients does
# not: each step event carries ``grads_ready_ms``, this rank's last gradient
# ready (DDP: its buckets' last_grad_ms; a sharded wrapper: its last
# reduction issued), counted from the start of its own step record. Per step
# (matched by wrapper and step number across ranks, every rank present),
# rank r's *excess* is that span less the median of the other ranks' spans:
# about 0 for balanced ranks, the extra time for the slow one.
#
# Spans, not the ready times on the merged clock: the collective that ends
# one step releases the ranks a little apart, and on a shared machine a rank
# is descheduled now and then before its step record begins, so one-clock
# ready times carry a per-rank offset of a millisecond or two that can last
# a whole run (measured: a 2 ms straggler read as 3.4-3.9 ms in one run and
# as -7 to +2 ms in another, a balanced rank as 1 ms late in every step).
# The span is immune to both; the one-clock lead (how much later than every
# other rank its gradients were ready, 0 when some rank was later still) is
# reported beside it as ``held_ms``.
#
# Evidence over steps: a rank is a straggler when its median excess is at
# least the noise floor and its excess reached half that floor in at least
# STRAGGLER_SHARE of the steps (a rank the scheduler happened to delay in a
# few steps is not slow in three steps of four). The floor is the larger of
# STRAGGLER_MS and STRAGGLER_NOISE_K standard errors of a median over the
# steps, 1.2533 * noise / sqrt(steps): ``noise`` is the ranks' typical
# step-to-step spread of their excess (the median over ranks, each from the
# shortest interval holding half its steps, so that a run in which half the
# steps were disturbed still reads the undisturbed half's spread). The
# standard error, not the spread itself: with two ranks the spread of the
# excess is also the straggler's own, and a busy machine that preempts a
# slow rank stretches its delay by 0 to 40 ms from step to step; its median
# still stands many standard errors above a balanced rank's 0.
#
# ``delay_ms`` is where the straggler's excess clusters: the median of the
# densest half of its steps. Preemption on a busy machine only ever adds to
# a step, so the excess has a long tail on one side (a 10 ms delay read as
# 10-11 ms in most steps and 15-48 ms in the rest, at 2-4 ranks on 2 shared
# cores); the densest half is the rank's own slowness, which the median of
# all steps overstates once a third of them are stretched. ``median_ms`` is
# the median over all steps, ``steps`` the steps whose excess reached the
# floor. A warm-up step or a descheduled one moves none of these.
# Traces of one rank name none.
def stragglers(steps: list[TraceStep], threshold_ms: float = STRAGGLER_MS) -> list[dict]:
    """Most delaying first: see [Note: stragglers]."""
    spans: dict[tuple, dict[int, float]] = collections.defaultdict(dict)
    ready: dict[tuple, dict[int, float]] = collections.defaultdict(dict)
    for s in steps:
        grads = s.args.get("grads_ready_ms", s.args["backward_end_ms"])
        spans[(s.wrapper, s.step)][s.rank] = grads
        ready[(s.wrapper, s.step)][s.rank] = s.start_us / 1e3 + grads
    ranks = sorted({s.rank for s in steps})
    if len(ranks) < 2:
        return []
    excess: dict[tuple, list[float]] = collections.defaultdict(list)  # (rank, wrapper) -> per step
    held: dict[tuple, list[float]] = collections.defaultdict(list)
    for key, per_rank in sorted(spans.items()):
        if len(per_rank) != len(ranks):
            continue  # a step some rank did not record
        for r, span in per_rank.items():
            excess[(r, key[0])].append(span - median([v for q, v in per_rank.items() if q != r]))
            at = ready[key]
            held[(r, key[0])].append(max(0.0, at[r] - max(u for q, u in at.items() if q != r)))
    found = []
    for wrapper in sorted({w for _, w in excess}):
        mine = {r: values for (r, w), values in excess.items() if w == wrapper}
        noise = median([_spread(values) for values in mine.values()])
        count = median([len(values) for values in mine.values()])
        floor = max(threshold_ms, STRAGGLER_NOISE_K * 1.2533 * noise / math.sqrt(max(count, 1)))
        for r, values in sorted(mine.items()):
            delay = median(values)
            consistent = sum(v >= floor / 2 for v in values)
            if delay >= floor and consistent >= STRAGGLER_SHARE * len(values):
                found.append({"rank": r, "delay_ms": round(_densest_half(values), 3), "median_ms": round(delay, 3),
                              "steps": sum(v >= floor for v in values),
                              "of_steps": len(values), "wrapper": wrapper,
                              "held_ms": round(median(held[(r, wrapper)]), 3), "noise_ms": round(noise, 3)})
    return sorted(found, key=lambda f: -f["delay_ms"])


def _densest_half(values: list[float]) -> float:
    """The median of the half of the values that lie closest together: where
    they cluster, which a tail on one side does not move."""
    ordered = sorted(values)
    half = (len(ordered) + 1) // 2
    if half < 2:
        return median(ordered)
    first = min(range(len(ordered) - half + 1), key=lambda i: ordered[i + half - 1] - ordered[i])
    return median(ordered[first:first + half])


def _spread(values: list[float]) -> float:
    """A standard deviation that half the steps can lie outside of: the
    width of the shortest interval holding half the values (the middle
    half of a normal distribution is 1.349 of its deviations wide)."""
    ordered = sorted(values)
    half = (len(ordered) + 1) // 2
    if half < 2:
        return 0.0
    return min(b - a for a, b in zip(ordered, ordered[half - 1:])) / 1.349


def _straggler_line(found: list[dict]) -> str:
    if not found:
        return "stragglers: none (no rank took longer to make its gradients than the others by a margin, median over steps)"
    return "stragglers: " + "; ".join(
        f"rank {f['rank']} made the others wait {f['delay_ms']:.2f} ms per step ({f['steps']} of "
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
