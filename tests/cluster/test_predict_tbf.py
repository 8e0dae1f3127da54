"""The what-if predictor over a real link it does not model: gloo between 2
emulated hosts (1 rank each) over veths shaped by ``tc tbf``, no simulated
link ([Note: simulated and real links] in pydist/overlap/predict.py). One
run is recorded at 200 Mbit/s; the job then has the links reshaped to
50 Mbit/s and times steps at another bucket cap; ``predict --recorded-link``
must land near them (a loose bound: the machine is shared; the accuracy
figures are benchmarks/bench_predict_tbf.py's). Needs root: skipped
without, with the reason."""

import json
import os
import statistics
import subprocess

import pytest

from pydist import cluster_emulator
from pydist.cluster_emulator import EmulatedCluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "cluster", "cluster_job.py")
_why = cluster_emulator.why_unavailable()


def _cli(*argv):
    import contextlib
    import io

    from pydist.overlap.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["predict", *argv])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.timeout(60)
@pytest.mark.skipif(_why is not None, reason=f"no emulated cluster here: {_why}")
def test_prediction_from_a_real_link_at_a_4x_slower_rate(tmp_path):
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "JOB_TIMEOUT_S": "40", "SLOW_RATE": "50mbit", "MEASURE_CAP_MB": "1"}
    log = open(tmp_path / "log", "w")
    with EmulatedCluster(hosts=2, ranks_per_host=1, rate="200mbit") as cluster:
        procs = cluster.launch_torchrun([JOB, "predict", str(tmp_path)], env=env, stdout=log, stderr=subprocess.STDOUT)
        codes = cluster.wait(procs, 45)  # carries out rank 0's request for 50mbit
        shaped = [subprocess.run(["tc", "-n", h.netns, "qdisc", "show", "dev", "eth0"], capture_output=True,
                                 text=True).stdout for h in cluster.hosts]
    assert cluster.leftovers() == []
    log.close()
    text = open(tmp_path / "log").read()
    assert codes == [0, 0], text[-3000:]
    assert all("rate 50Mbit" in s for s in shaped), shaped
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert all(r["ok"] for r in results), [r.get("traceback") for r in results]
    measured = statistics.median(statistics.fmean(s) for s in zip(*(r["measured_ms"] for r in results)))

    trace = str(tmp_path / "trace")
    code, out, err = _cli(trace, "--recorded-link", "200Mbps", "--link", "50Mbps", "--bucket-cap-mb", "1", "--json")
    assert code == 0, err
    slow = json.loads(out)
    assert slow["link_kind"] == "real" and slow["recorded"]["hosts"] == 2, slow
    recorded = slow["recorded"]["step_ms"]
    # a predictor that ignored the link would predict about the recorded step; 4x less bandwidth is about 4x its
    # link time (1.05 MB at 50 Mbit/s: 168 ms a step)
    assert slow["step_ms"] > 2.5 * recorded, (slow["step_ms"], recorded)
    assert abs(slow["step_ms"] - measured) <= 0.25 * measured, (slow["step_ms"], measured, recorded)
    # the recorded settings predict about the recorded step
    code, out, err = _cli(trace, "--recorded-link", "200Mbps", "--json")
    assert code == 0, err
    same = json.loads(out)
    assert abs(same["step_ms"] - recorded) <= 0.25 * recorded, (same["step_ms"], recorded)
    assert same["link"] == "0.2Gbps,0us (real)"
    # a run with a simulated link names its link itself: --recorded-link is refused for it (see test_predict.py)


def test_recorded_link_refused_for_one_host(tmp_path):
    """A real link lies between hosts: a recording whose ranks all ran on one host is refused, naming it."""
    from pydist.overlap import predict

    document = {"otherData": {"merged_hosts": ["box", "box"], "wrappers": {"0": {
        "params": [["w", [4], "float32", "cpu"]], "link": None, "first_bucket_cap_bytes": 16,
        "bucket_cap_bytes": 16, "chunk_bytes": 0, "world_size": 2}}}, "traceEvents": []}
    with pytest.raises(ValueError, match=r"every rank of the recording ran on one host \(box\)"):
        predict.load_recording(document, recorded_link="1Gbps")
    document["otherData"]["wrappers"]["0"]["link"] = [1e9, 2e-5]
    with pytest.raises(ValueError, match=r"had a simulated link \(1Gbps,20us\)"):
        predict.load_recording(document, recorded_link="1Gbps")


def test_rate_requests_refused_where_they_cannot_work(monkeypatch):
    monkeypatch.delenv(cluster_emulator.CONTROL_ENV, raising=False)
    with pytest.raises(RuntimeError, match=cluster_emulator.CONTROL_ENV):
        cluster_emulator.request_rate("100mbit")
    made = EmulatedCluster(2, 1)  # not started: the rate is refused before anything is shaped
    try:
        with pytest.raises(ValueError, match="'fast' is not a tc rate"):
            made.set_rate("fast")
    finally:
        made.close()
