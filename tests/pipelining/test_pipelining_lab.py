"""The lab sees the pipeline: with PYDIST_TRACE, each stage's forward,
backward, send and receive on one clock per rank, in the rank's trace file
(python -m pydist.overlap merge puts the ranks side by side); schedules
written and read as torch's CSV action lists, and a list replayed (or
written by hand) runs as written, with the same gradients; PYDIST_SIM_NET
delays every message by the simulated link's time and changes no bit."""

import json

import pytest
import torch

import pp_harness as h
from pydist.overlap import trace as trace_module
from pydist.spawn import run_ranks


@pytest.mark.timeout(90)
def test_records_trace_and_csv_replay(tmp_path, monkeypatch):
    (tmp_path / "gpipe.csv").write_text("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3\n")
    monkeypatch.setenv("PYDIST_TRACE", str(tmp_path / "traces"))
    results = run_ranks(h.lab_job, 2, args=(str(tmp_path),), timeout=70)

    # records: every action of the step, compute after its receive, on the steady clock
    for rank, out in enumerate(results):
        recs = out["records"]
        computes = [(r.action, r.microbatch) for r in recs if r.action in ("forward", "backward")]
        want = {0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
                1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]}[rank]
        assert [("F" if a == "forward" else "B") + str(m) for a, m in computes] == want
        recv_end = {(r.peer, r.microbatch): r.end_ns for r in recs if r.action == "recv"}
        for r in recs:
            if rank == 1 and r.action == "forward":
                assert recv_end[(0, r.microbatch)] <= r.start_ns
            if rank == 0 and r.action == "backward":
                assert recv_end[(1, r.microbatch)] <= r.start_ns
        assert sum(r.action == "send" for r in recs) == 4 and sum(r.action == "recv" for r in recs) == 4
        assert all(r.start_ns <= r.end_ns for r in recs)

    # the trace files hold the stages' tracks
    for rank in range(2):
        doc = json.load(open(tmp_path / "traces" / f"rank{rank}.json"))
        names = {e["name"] for e in doc["traceEvents"] if e.get("cat") == "pipeline"}
        assert {"F0", "B3", "reduce_grad"} <= names
        assert any(n.startswith("send") for n in names) and any(n.startswith("recv") for n in names)
    merged = trace_module.merge_traces([str(tmp_path / "traces" / f"rank{r}.json") for r in range(2)])
    assert {e["pid"] for e in merged["traceEvents"] if e.get("cat") == "pipeline"} == {0, 1}

    # torch's CSV form: one row per rank, receives before and sends after
    rows = results[0]["csv"].strip().splitlines()
    assert rows[0].split(",")[:3] == ["0F0", "0SEND_F0", "0F1"] and rows[1].split(",")[:2] == ["1RECV_F0", "1F0"]
    assert results[0]["replayed_order"] == [(("forward" if a[1] == "F" else "backward"), int(a[2:]))
                                            for a in rows[0].split(",") if a[1] in "FB" and "_" not in a]
    # a GPipe list loaded into a 1F1B schedule runs as GPipe; the gradients do not depend on the order
    for out in results:
        assert out["gpipe_by_hand_order"] == [("forward", i) for i in range(4)] + [("backward", i) for i in range(4)]
        for a, b in zip(out["grads"]["replayed"], out["grads"]["gpipe_by_hand"]):
            assert torch.equal(a, b)
    # over a simulated 20 ms link: GPipe's 4 activations, then its 4 gradients, one after another on
    # each channel's thread: rank 0 ends >= 8 x 20 ms after it starts; the bits unchanged
    assert results[0]["sim_net_step_s"] >= 0.16, results[0]["sim_net_step_s"]
    for out in results:
        for a, b in zip(out["grads"]["replayed"], out["grads"]["sim_net"]):
            assert torch.equal(a, b)
