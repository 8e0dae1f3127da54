"""pydist.overlap's arithmetic on records built by hand ([Note: exposed
communication] in pydist/overlap/analysis.py), the Chrome trace written from
them, the merge onto one clock, and the report CLI on a written trace. The
same code on records of real runs: test_trace.py."""

import json
import subprocess
import sys

import pytest

from pydist.ddp.records import BucketTiming, ChunkTiming, IterationRecord
from pydist.overlap import analyze_step, trace
from pydist.overlap.report import report_text, steps_from_trace


def _record(iteration=0, rank=0, start_ns=10**12, b1_complete=12.0):
    # backward ends at 10 ms; finalize then waits for bucket 1 (until
    # b1_complete) and writes every bucket back for 0.5 ms each.
    b0 = BucketTiming(0, 2, 4096, 0.5, 1.5, 2.0, 5.0, 10.5,
                      (ChunkTiming(0, 2048, "all_reduce", 2.0, 3.0), ChunkTiming(512, 2048, "all_reduce", 2.5, 5.0)))
    b1 = BucketTiming(1, 3, 8192, 3.0, 6.0, 6.0, b1_complete, b1_complete + 0.5,
                      (ChunkTiming(0, 8192, "all_reduce", 6.0, b1_complete),))
    b2 = BucketTiming(2, 1, 1024, 7.0, 9.0, 9.0, 11.0, b1_complete + 1.0, ())
    return IterationRecord(iteration, rank, "sim_net(shm)", start_ns, 10.0, b1_complete + 1.0, [b0, b1, b2])


def test_exposed_time_per_bucket_and_the_bucket_waited_on_last():
    step = analyze_step(_record())
    b0, b1, b2 = step.buckets
    assert (b0.exposed_ms, b0.write_back_ms, b0.hidden_ms) == (0.0, 0.5, 3.0)
    assert (b1.wait_start_ms, b1.exposed_ms, b1.write_back_ms, b1.hidden_ms) == (10.5, 1.5, 0.5, 4.0)
    assert (b2.wait_start_ms, b2.exposed_ms, b2.write_back_ms) == (12.5, 0.0, 0.5)
    assert step.exposed_ms == 1.5
    assert step.finalize_ms == pytest.approx(step.exposed_ms + sum(b.write_back_ms for b in step.buckets))
    assert step.waited_last == step.stalling == 1
    assert step.step_comm_ms == 10.0
    # every collective done before autograd: nothing exposed, nothing waited on
    buckets = [BucketTiming(i, 1, 64, i, i, i, i + 0.5, 10.2 + 0.2 * i) for i in range(3)]
    hidden = analyze_step(IterationRecord(0, 0, "gloo", 0, 10.0, 10.6, buckets))
    assert hidden.exposed_ms == 0 and hidden.waited_last is None and hidden.stalling is None


def _events(document, cat):
    return [e for e in document["traceEvents"] if e.get("cat") == cat]


def test_trace_events_carry_bytes_and_exposed_time(tmp_path):
    records = [_record(i, start_ns=10**12 + i * 20_000_000, b1_complete=12.0 + i) for i in range(3)]
    document = trace.trace_document({0: records}, rank=0)
    path = tmp_path / "rank0.json"
    trace.write_trace(str(path), document)
    loaded = json.loads(path.read_text())
    steps = _events(loaded, "step")
    assert [e["args"]["step"] for e in steps] == [0, 1, 2]
    assert [e["args"]["exposed_ms"] for e in steps] == [1.5, 2.5, 3.5]
    assert steps[1]["ts"] == (10**12 + 20_000_000) / 1e3  # microseconds on the steady clock
    comm = _events(loaded, "comm")
    assert len(comm) == 9 and {e["args"]["bytes"] for e in comm} == {4096, 8192, 1024}
    assert [e["args"]["exposed_ms"] for e in comm if e["args"]["bucket"] == 1] == [1.5, 2.5, 3.5]
    assert len(_events(loaded, "exposed")) == 3 and len(_events(loaded, "write_back")) == 9
    chunks = _events(loaded, "chunk")
    assert len(chunks) == 2 * 3 * 3 and {e["ph"] for e in chunks} == {"b", "e"}
    names = {e["args"]["name"] for e in loaded["traceEvents"] if e.get("name") == "thread_name"}
    assert {"backward compute", "write-back", "exposed wait", "bucket 0", "bucket 2"} <= names


def test_merge_puts_ranks_on_one_clock(tmp_path):
    # rank 1 on "another host": its steady clock is 5 s ahead of rank 0's,
    # its (monotonic, realtime) pair says so; the same step lines up.
    paths = []
    for rank, skew in ((0, 0), (1, 5 * 10**9)):
        document = trace.trace_document({0: [_record(0, rank, start_ns=10**12 + skew)]}, rank)
        sync = document["otherData"]["clock_sync"]
        sync["monotonic_ns"] = 2 * 10**12 + skew
        sync["realtime_ns"] = 1_700_000_000 * 10**9
        paths.append(str(tmp_path / f"rank{rank}.json"))
        trace.write_trace(paths[-1], document)
    out = tmp_path / "merged.json"
    subprocess.run([sys.executable, "-m", "pydist.overlap", "merge", str(tmp_path), "-o", str(out)], check=True,
                   capture_output=True, text=True, timeout=60)
    merged = json.loads(out.read_text())
    starts = {e["pid"]: e["ts"] for e in _events(merged, "step")}
    assert starts == {0: 0.0, 1: 0.0}
    assert merged["otherData"]["merged_ranks"] == [0, 1]
    assert {s.rank for s in steps_from_trace(merged)} == {0, 1}


def test_report_cli_names_the_stalling_bucket(tmp_path):
    records = [_record(i, start_ns=10**12 + i * 20_000_000, b1_complete=12.0 + i) for i in range(5)]
    path = tmp_path / "rank0.json"
    trace.write_trace(str(path), trace.trace_document({0: records}, rank=0))
    result = subprocess.run([sys.executable, "-m", "pydist.overlap", "report", str(path)], check=True,
                            capture_output=True, text=True, timeout=60)
    out = result.stdout
    assert "rank 0 (sim_net(shm)): 5 steps" in out
    assert "exposed communication median 3.50 ms, worst 5.50 ms (step 4)" in out
    assert "stalling bucket: 1 (3.50 ms exposed per step on average, 100% of all exposed time); " \
           "the step waited on it last in 5 of 5 steps" in out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["1"])
    assert row[-3:] == ["3.50", "5.50", "4"]  # median exposed, worst, at step
    assert out == report_text(json.loads(path.read_text()))


def test_plot_draws_a_step_or_says_matplotlib_is_missing(tmp_path):
    path = tmp_path / "rank0.json"
    trace.write_trace(str(path), trace.trace_document({0: [_record(0), _record(1, b1_complete=14.0)]}, rank=0))
    png = tmp_path / "step.png"
    result = subprocess.run([sys.executable, "-m", "pydist.overlap", "report", str(path), "--plot", str(png)],
                            capture_output=True, text=True, timeout=60)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result.returncode == 2 and "needs matplotlib, which is not installed" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert "drew rank 0, step 1" in result.stdout  # the worst step by default
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
