"""``python -m pydist.overlap report`` / ``merge`` on a file that is not a
whole trace (truncated, garbled, another program's JSON): a message on
stderr naming the file and what is wrong, exit status 2, no traceback.
Hand-written traces of one step and one bucket (the fields trace.py
writes), damaged one way each; the CLI runs in-process (``main``), and once
as a command."""

import json
import subprocess
import sys

import pytest

from pydist.overlap.__main__ import main

STEP = {"name": "step 0", "cat": "step", "ph": "X", "pid": 0, "tid": 0, "ts": 10.0, "dur": 5.0,
        "args": {"step": 0, "bytes": 64, "backward_end_ms": 1.0, "finalize_end_ms": 2.0, "exposed_ms": 0.5,
                 "waited_last": 0, "stalling": 0, "transport": "gloo"}}
BUCKET = {"name": "bucket 0", "cat": "comm", "ph": "X", "pid": 0, "tid": 10, "ts": 11.0, "dur": 1.0,
          "args": {"step": 0, "bucket": 0, "bytes": 64, "num_params": 2, "first_grad_ms": 0.1, "last_grad_ms": 0.2,
                   "launch_ms": 0.3, "complete_ms": 0.9, "done_ms": 1.0, "exposed_ms": 0.5, "hidden_ms": 0.1,
                   "write_back_ms": 0.1, "chunks": 1}}


def _trace(**changes) -> dict:
    return {"traceEvents": [STEP, BUCKET], "otherData": {"rank": 0, "clock_sync": {"monotonic_ns": 1,
                                                                                    "realtime_ns": 2}}, **changes}


WHOLE = json.dumps(_trace())
DAMAGED = {
    "truncated": (WHOLE[:len(WHOLE) // 2], "not valid JSON, Unterminated string starting at at line 1 column"),
    "empty": ("", "not valid JSON, Expecting value at line 1 column 1 (a truncated or damaged file?)"),
    "not utf-8": (b"\x80\x81garbage", "not a JSON text file (invalid start byte at byte 0)"),
    "not a trace": (json.dumps({"hello": 1}), "not a Chrome trace (no traceEvents)"),
    "events an object": (json.dumps(_trace(traceEvents={"a": 1})), 'traceEvents is an object ({"a": 1}), not a list'),
    "an event a number": (json.dumps(_trace(traceEvents=[STEP, 3])), "traceEvents[1] is a number (3), not an event"),
    "ts a string": (json.dumps(_trace(traceEvents=[dict(STEP, ts="10")])), 'traceEvents[0].ts is a string ("10"), '
                                                                            "not a number"),
}
REPORT_ONLY = {
    "a field missing": (json.dumps(_trace(traceEvents=[STEP, dict(BUCKET, args={"step": 0, "bucket": 0})])),
                        "traceEvents[1] (comm event 'bucket 0'): args.bytes is missing, not a number"),
    "a field a string": (json.dumps(_trace(traceEvents=[dict(STEP, args=dict(STEP["args"], exposed_ms="x"))])),
                         "traceEvents[0] (step event 'step 0'): args.exposed_ms is 'x', not a number"),
}
MERGE_ONLY = {
    "no clock": (json.dumps(_trace(otherData={"rank": 0})), "has no otherData.clock_sync"),
    "a bad clock": (json.dumps(_trace(otherData={"rank": 0, "clock_sync": [1, 2]})),
                    "otherData.clock_sync is an array ([1, 2]), not realtime_ns and monotonic_ns numbers"),
}


def _write(path, content) -> str:
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return str(path)


def test_a_whole_hand_written_trace_reports_and_merges(tmp_path, capsys):
    path = _write(tmp_path / "rank0.json", WHOLE)
    assert main(["report", path]) == 0
    assert "rank 0 (gloo): 1 steps" in capsys.readouterr().out
    assert main(["merge", str(tmp_path), "-o", str(tmp_path / "merged.json")]) == 0


@pytest.mark.parametrize("case", list(DAMAGED) + list(REPORT_ONLY))
def test_report_names_the_file_and_what_is_wrong(tmp_path, capsys, case):
    content, expected = {**DAMAGED, **REPORT_ONLY}[case]
    path = _write(tmp_path / "trace.json", content)
    assert main(["report", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pydist.overlap report: {path}: ") and expected in err, err


@pytest.mark.parametrize("case", list(DAMAGED) + list(MERGE_ONLY))
def test_merge_names_the_file_and_what_is_wrong(tmp_path, capsys, case):
    content, expected = {**DAMAGED, **MERGE_ONLY}[case]
    good = _write(tmp_path / "rank0.json", WHOLE)
    bad = _write(tmp_path / "rank1.json", content)
    assert main(["merge", good, bad, "-o", str(tmp_path / "merged.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pydist.overlap merge: ") and bad in err and expected in err, err
    assert not (tmp_path / "merged.json").exists()


@pytest.mark.timeout(60)
def test_the_command_exits_2_without_a_traceback(tmp_path):
    """(merge's exit status and stderr are checked in-process above: main
    returns 2 where it raised before.)"""
    path = _write(tmp_path / "rank0.json", WHOLE[:-40])
    done = subprocess.run([sys.executable, "-m", "pydist.overlap", "report", path], capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"pydist.overlap report: {path}: not valid JSON"), done.stderr
