"""pydist on an emulated cluster of 2 hosts x 2 ranks (pydist.cluster_emulator):
each host its own network, mount (/dev/shm) and UTS namespace on a bridge.

Every rank runs tests/cluster/cluster_job.py and writes what it saw to a JSON
file; these tests read them. Needs root (namespaces, veth, bridge): skipped
without, with the reason (CI runs as root).
"""

import glob
import json
import os
import shutil
import subprocess
import time

import pytest

from pydist import cluster_emulator
from pydist.cluster_emulator import EmulatedCluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "cluster", "cluster_job.py")

_why = cluster_emulator.why_unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"no emulated cluster here: {_why}")


def _env(**extra) -> dict:
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "JOB_TIMEOUT_S": "60"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _results(out_dir, world_size=4) -> list[dict]:
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.json")
        assert os.path.exists(path), f"rank {rank} wrote no result ({out_dir})"
        with open(path) as f:
            results.append(json.load(f))
    return results


def _run(cluster, launcher, mode, out_dir, timeout=120, **env):
    log = open(os.path.join(out_dir, "log"), "w")
    argv, kwargs = [JOB, mode, str(out_dir)], dict(env=_env(**env), stdout=log, stderr=subprocess.STDOUT)
    if launcher == "torchrun":
        procs = cluster.launch_torchrun(argv, **kwargs)
    elif launcher == "mpiexec":
        procs = cluster.launch_mpiexec(argv, **kwargs)
    else:
        procs = cluster.launch_slurm(argv, distribution="cyclic" if launcher == "slurm-cyclic" else "block", **kwargs)
    codes = cluster.wait(procs, timeout)
    log.close()
    with open(os.path.join(out_dir, "log")) as f:
        text = f.read()
    return codes, text


@pytest.fixture
def cluster():
    made = EmulatedCluster(hosts=2, ranks_per_host=2)
    with made:
        yield made
    assert made.leftovers() == [], "namespaces left behind"


@pytest.mark.timeout(150)
def test_collectives_and_ddp_across_hosts_under_torchrun(cluster, tmp_path):
    """Hierarchical all-reduce / reduce-scatter / all-gather exact on
    integer-valued data (odd sizes, bf16), then pydist DDP beside torch DDP:
    equal to rounding (the 4-term sum is (x0+x1)+(x2+x3), gloo's ring sums
    in its own order) and bitwise identical on every rank."""
    codes, log = _run(cluster, "torchrun", "collectives", tmp_path, PYDIST_VERBOSE=1)
    assert codes == [0, 0], log[-3000:]
    assert log.count("pydist: 2 hosts x 2 ranks: node0 (ranks 0, 1), node1 (ranks 2, 3)") == 1, log[-3000:]
    results = _results(tmp_path)
    for r in results:
        assert r["ok"], r.get("traceback")
        assert r["topology"] == "2 hosts x 2 ranks: node0 (ranks 0, 1), node1 (ranks 2, 3)"
        assert r["transport"].startswith("hierarchical"), r["transport"]
        assert all(r["checks"].values()), {k: v for k, v in r["checks"].items() if not v}
        assert r["ar_bits"] == results[0]["ar_bits"]
    ddp_dir = tmp_path / "ddp"
    ddp_dir.mkdir()
    codes, log = _run(cluster, "torchrun", "ddp", ddp_dir)
    assert codes == [0, 0], log[-3000:]
    results = _results(ddp_dir)
    for r in results:
        assert r["ok"], r.get("traceback")
        assert r["transport"] == "hierarchical"
        assert r["plain_transport"] == "process_group"  # shm_allreduce=False still forces the group
        assert r["max_diff_vs_torch"] < 1e-6
        assert r["max_diff_plain_vs_torch"] < 1e-6
        assert r["params_hash"] == results[0]["params_hash"]  # identical on every rank
        assert r["sim_net"] == ["hierarchical(shm+sim_net(gloo))", "hierarchical(shm+gloo)"]
        assert r["overlapped_transport"] == "ordered(gloo)", r["overlapped_transport"]
        assert r["overlapped_same_as_plain"], "overlap_optimizer through the ordered link differs from plain DDP"
        assert r["detached_transport"] == "gloo", r["detached_transport"]
        assert r["reattached"] == ["ordered(gloo)", 0], r["reattached"]
        assert r["hierarchical_overlapped"] == "hierarchical(shm+gloo)", r["hierarchical_overlapped"]
    assert cluster.shm_entries(0) == [] and cluster.shm_entries(1) == []
    assert results[0]["overlapped_commits"] >= 3, results[0]  # rank 0 decided the chunks


@pytest.mark.timeout(120)
def test_fully_shard_across_hosts_under_slurm_cyclic(cluster, tmp_path):
    """pydist.fully_shard (FULL_SHARD) beside torch FSDP2, launched as
    ``srun -m cyclic`` would (SLURM_* variables, rank t on host t % 2, so the
    hierarchical reduce-scatter and all-gather see interleaved hosts): equal
    to rounding, identical on every rank. Then HSDP, each host's ranks the
    shard group (shared memory), the hosts the replicas (gloo across):
    bitwise torch's HSDP on the same mesh."""
    codes, log = _run(cluster, "slurm-cyclic", "fsdp", tmp_path)
    assert codes == [0, 0, 0, 0], log[-3000:]
    results = _results(tmp_path)
    for r in results:
        assert r["ok"], r.get("traceback")
        assert r["topology"] == "2 hosts x 2 ranks: node0 (ranks 0, 2), node1 (ranks 1, 3)"
        assert r["init"]["launcher"] == "slurm" and r["init"]["local_world_size"] == 2
        assert r["transport"].startswith("hierarchical"), r["transport"]
        assert r["max_diff_vs_torch"] < 1e-6
        assert r["params_hash"] == results[0]["params_hash"]
        assert r["hsdp_transports"] == ["shm", "gloo"], r["hsdp_transports"]
        assert r["hsdp_max_diff_vs_torch"] == 0.0
        assert r["hsdp_params_hash"] == results[0]["hsdp_params_hash"]


@pytest.mark.timeout(90)
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs MPICH's mpiexec (pip install mpich)")
def test_ddp_across_hosts_under_mpiexec(cluster, tmp_path):
    """MPICH's mpiexec across the hosts (Hydra's proxies enter each host's
    namespaces): the same DDP parity as under torchrun."""
    codes, log = _run(cluster, "mpiexec", "ddp", tmp_path)
    assert codes == [0], log[-3000:]
    results = _results(tmp_path)
    for r in results:
        assert r["ok"], r.get("traceback")
        assert r["init"]["launcher"] == "mpich" and r["init"]["local_world_size"] == 2
        assert r["transport"] == "hierarchical"
        assert r["max_diff_vs_torch"] < 1e-6
        assert r["params_hash"] == results[0]["params_hash"]


def _fault(cluster, tmp_path, fault: str, wrapper: str, timeout_s: int = 8):
    """Trains until every rank has stepped, faults host 1, and returns host
    0's results and how long after the fault each rank ended."""
    log = open(os.path.join(tmp_path, "log"), "w")
    procs = cluster.launch_torchrun([JOB, "fault", str(tmp_path)], env=_env(JOB_TIMEOUT_S=timeout_s,
                                                                          FAULT_WRAPPER=wrapper),
                                    stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while len(glob.glob(os.path.join(tmp_path, "*.ready"))) < 4:
        assert time.monotonic() < deadline, "the job never got going"
        assert all(p.poll() is None for p in procs), open(os.path.join(tmp_path, "log")).read()[-3000:]
        time.sleep(0.2)
    faulted = time.time()
    {"kill": cluster.kill_host, "cut": cluster.cut_link, "stall": cluster.stall_host}[fault](1)
    cluster.wait(procs[:1], timeout_s + 15 + 10)  # host 0's torchrun ends once its ranks have
    results = [r for r in (json.load(open(p)) for p in sorted(glob.glob(os.path.join(tmp_path, "rank*.json"))))
               if r["rank"] in (0, 1)]
    assert len(results) == 2, open(os.path.join(tmp_path, "log")).read()[-3000:]
    return results, faulted, timeout_s


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault, wrapper", [("kill", "ddp"), ("cut", "fsdp"), ("stall", "ddp"), ("kill", "ddp_plain")])
def test_lost_host_is_named(cluster, tmp_path, fault, wrapper):
    """A host's ranks killed, its link cut, or all its processes stopped
    (SIGSTOP, named after the group's timeout): every surviving rank names the
    host and its ranks within the timeout plus 15 s, and leaves nothing in
    its host's /dev/shm (a killed host's own /dev/shm is empty too). On the
    hierarchical transport and on the bare group (``shm_allreduce=False``)."""
    results, faulted, timeout_s = _fault(cluster, tmp_path, fault, wrapper)
    for r in results:
        assert "unreachable host: node1 (ranks 2, 3)" in r["error"], r["error"]
        assert r["error_time"] - faulted < timeout_s + 15
    assert cluster.shm_entries(0) == []
    if fault == "kill":
        assert cluster.shm_entries(1) == []


@pytest.mark.timeout(60)
def test_loopback_hostnames_name_gloo_socket_ifname(tmp_path):
    """Hostnames that resolve to 127.0.1.1: every rank fails at init naming
    GLOO_SOCKET_IFNAME and the interface, instead of gloo's 'Connection refused'."""
    with EmulatedCluster(2, 2, loopback_hostnames=True) as cluster:
        codes, log = _run(cluster, "slurm", "ddp", tmp_path, timeout=50)
    assert codes == [1, 1, 1, 1], log[-3000:]
    assert log.count("Set GLOO_SOCKET_IFNAME=eth0") == 4, log[-3000:]
    assert "node1: 127.0.1.1 -> use eth0 (10.37.0.2)" in log


def test_emulator_tears_down_on_failure():
    with pytest.raises(ZeroDivisionError):
        with EmulatedCluster(2, 1) as cluster:
            names = cluster.leftovers()
            assert len(names) == 3  # two hosts and the switch
            assert cluster.run(1, ["hostname"]).stdout.strip() == "node1"
            1 / 0
    assert cluster.leftovers() == []


@pytest.mark.timeout(60)
def test_hosts_with_different_numbers_of_ranks_are_named(tmp_path):
    """2 ranks on node0, 1 on node1 (SLURM_TASKS_PER_NODE=2,1): every rank
    fails at init naming each host and its ranks."""
    with EmulatedCluster(2, [2, 1]) as cluster:
        codes, log = _run(cluster, "slurm", "ddp", tmp_path, timeout=50)
    assert codes == [1, 1, 1], log[-3000:]
    assert log.count("the hosts run different numbers of ranks: node0 has 2 (0, 1), node1 has 1 (2)") == 3, log[-3000:]
