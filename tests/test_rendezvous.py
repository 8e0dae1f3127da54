"""Launcher detection and init_process_group, outside MPI.

Launcher environments are real input set with monkeypatch; the end-to-end
tests start real processes (torchrun itself, or ranks given torchrun's
variables) and check what they report, including the failures: a rank that
never arrives, a port in use.
"""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from pydist.rendezvous import LAUNCHERS, LauncherConflict, LauncherNotFound, detect, first_slurm_host, resolve_backend

# What init_process_group() joins with no backend named: gloo, and NCCL for
# CUDA tensors on a machine with CUDA.
DEFAULT_BACKEND = resolve_backend(None)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_VARS = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID", "SM_HOSTS", "SM_CURRENT_HOST", "SM_NUM_GPUS",
    "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_MCA_ess_base_jobid", "MPI_LOCALNRANKS",
    "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "TORCHELASTIC_RESTART_COUNT", "PYDIST_TORCHRUN_ENV_FROM",
]


@pytest.fixture
def launcher_env(monkeypatch):
    """Start from no launcher at all, then set the given variables."""
    for name in ALL_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_env(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, str(value))

    return set_env


# -- detection ---------------------------------------------------------------

def test_torchrun(launcher_env):
    launcher_env(RANK=3, WORLD_SIZE=8, LOCAL_RANK=1, MASTER_ADDR="10.0.0.5", MASTER_PORT=29400)
    info = detect(argv=[])
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("torchrun", 3, 8, 1)
    assert (info.master_addr, info.master_port, info.uses_mpi) == ("10.0.0.5", 29400, False)


@pytest.mark.parametrize("argv", [["--local_rank=2"], ["--local-rank", "2"], ["--lr", "0.1", "--local_rank", "2"]])
def test_legacy_launch_local_rank_argument(launcher_env, argv):
    launcher_env(RANK=2, WORLD_SIZE=4, MASTER_ADDR="h", MASTER_PORT=1234)
    assert detect(argv=argv).local_rank == 2


def test_openmpi(launcher_env):
    launcher_env(OMPI_COMM_WORLD_RANK=5, OMPI_COMM_WORLD_SIZE=6, OMPI_COMM_WORLD_LOCAL_RANK=2, PMIX_RANK=5)
    info = detect(argv=[])
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.uses_mpi) == ("openmpi", 5, 6, 2, True)
    assert info.master_addr is None  # rank 0 broadcasts it


def test_openmpi_job_id_gives_a_store_without_mpi(launcher_env):
    """Issue 18 item 8: every rank on one host and a job id: backends other
    than MPI can meet at 127.0.0.1 on a port derived from the job id."""
    launcher_env(OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_LOCAL_RANK=1,
                 OMPI_COMM_WORLD_LOCAL_SIZE=2, OMPI_MCA_ess_base_jobid=1893924865)
    info = detect(argv=[])
    assert (info.master_addr, info.master_port, info.local_world_size) == ("127.0.0.1", 20000 + 1893924865 % 20000, 2)


def test_openmpi_across_hosts_needs_mpi_for_the_address(launcher_env):
    launcher_env(OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_LOCAL_SIZE=2,
                 OMPI_MCA_ess_base_jobid=7)
    assert detect(argv=[]).master_addr is None
    launcher_env(MASTER_ADDR="n1")
    assert (detect(argv=[]).master_addr, detect(argv=[]).master_port) == ("n1", 20007)


def test_variables_pydist_exported_do_not_hide_the_launcher(launcher_env):
    """After init under mpiexec pydist sets RANK, MASTER_ADDR, ... and records
    where they came from; detect() still reports the MPI launcher."""
    launcher_env(RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=1234, PMI_RANK=1, PMI_SIZE=2,
                 PYDIST_TORCHRUN_ENV_FROM="mpich")
    assert detect(argv=[]).launcher == "mpich"
    launcher_env(PYDIST_TORCHRUN_ENV_FROM="slurm")  # recorded for another launcher: the variables are read
    assert detect(argv=[]).launcher == "torchrun"


def test_stale_torchrun_variables_under_mpiexec_are_named(launcher_env):
    """Issue 17 item 15: RANK and WORLD_SIZE left over from another launch."""
    launcher_env(RANK=0, WORLD_SIZE=4, PMI_RANK=1, PMI_SIZE=2, MPI_LOCALRANKID=1)
    with pytest.raises(LauncherConflict, match=r"mpich started this process \(PMI_RANK=1, PMI_SIZE=2, MPI_LOCALRANKID=1\) "
                                               r"but RANK=0, WORLD_SIZE=4 are also set.*unset RANK and WORLD_SIZE"):
        detect(argv=[])


@pytest.mark.parametrize("spec, node, size", [("4", 0, 4), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1)])
def test_slurm_local_world_size(launcher_env, spec, node, size):
    launcher_env(SLURM_PROCID=0, SLURM_NTASKS=7, SLURM_JOB_NODELIST="n[1-4]", SLURM_TASKS_PER_NODE=spec,
                 SLURM_NODEID=node)
    assert detect(argv=[]).local_world_size == size


def test_pmix_alone_has_no_size(launcher_env):
    launcher_env(PMIX_RANK=1)
    info = detect(argv=[])
    assert (info.launcher, info.rank, info.world_size) == ("pmix", 1, None)


def test_mpich_hydra(launcher_env):
    launcher_env(PMI_RANK=1, PMI_SIZE=2, MPI_LOCALRANKID=1)
    info = detect(argv=[])
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.uses_mpi) == ("mpich", 1, 2, 1, True)


@pytest.mark.parametrize("nodelist, first", [
    ("node07", "node07"), ("gpu[003-005,9],cpu1", "gpu003"), ("a[1,3]", "a1"), ("n1,n2", "n1"),
    ("rack1-[12-14]", "rack1-12"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_slurm(launcher_env):
    launcher_env(SLURM_PROCID=3, SLURM_NTASKS=4, SLURM_LOCALID=1, SLURM_JOB_NODELIST="gpu[010-011]", SLURM_JOB_ID=123)
    info = detect(argv=[])
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("slurm", 3, 4, 1)
    assert (info.master_addr, info.master_port) == ("gpu010", 20123)


def test_sagemaker(launcher_env):
    launcher_env(SM_HOSTS='["algo-2", "algo-1"]', SM_CURRENT_HOST="algo-2", SM_NUM_GPUS=0)
    info = detect(argv=[])
    assert (info.launcher, info.rank, info.world_size, info.master_addr) == ("sagemaker", 1, 2, "algo-1")


def test_inner_launcher_wins_over_allocation(launcher_env):
    """mpirun inside sbatch: the ranks inherit the batch step's SLURM_PROCID=0."""
    launcher_env(SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_JOB_NODELIST="n1", PMI_RANK=1, PMI_SIZE=2)
    assert detect(argv=[]).launcher == "mpich"


def test_torchrun_agent_renumbers_outer_launcher(launcher_env):
    """srun torchrun: Slurm numbers the agents, torchrun the workers."""
    launcher_env(SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_JOB_NODELIST="n[1-2]", OMPI_COMM_WORLD_RANK=0,
                 RANK=5, WORLD_SIZE=8, MASTER_ADDR="n1", MASTER_PORT=29500, TORCHELASTIC_RUN_ID="job")
    info = detect(argv=[])
    assert (info.launcher, info.rank, info.world_size) == ("torchrun", 5, 8)


# -- bad input -----------------------------------------------------------------

def test_nothing_found_lists_what_was_looked_for(launcher_env):
    with pytest.raises(LauncherNotFound) as err:
        detect(argv=[])
    for name in ["RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID", "SM_HOSTS", "--local_rank"]:
        assert name in str(err.value)
    assert detect(argv=[], required=False) is None


def test_contradicting_launchers_are_named(launcher_env):
    launcher_env(RANK=0, WORLD_SIZE=2, MASTER_ADDR="h", MASTER_PORT=1, OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2)
    with pytest.raises(LauncherConflict, match=r"rank: torchrun \(RANK.*says 0 but openmpi \(OMPI_COMM_WORLD_RANK.*says 1"):
        detect(argv=[])


def test_contradicting_mpi_families(launcher_env):
    launcher_env(OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=4, PMI_RANK=0, PMI_SIZE=2)
    with pytest.raises(LauncherConflict, match="world size.*OMPI_COMM_WORLD_SIZE.*says 4.*PMI_SIZE.*says 2"):
        detect(argv=[])


def test_local_rank_env_contradicts_argument(launcher_env):
    launcher_env(RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, MASTER_ADDR="h", MASTER_PORT=1)
    with pytest.raises(LauncherConflict, match="LOCAL_RANK=1 contradicts .*--local_rank=0"):
        detect(argv=["--local_rank=0"])


@pytest.mark.parametrize("variables, message", [
    (dict(RANK=4, WORLD_SIZE=4, MASTER_ADDR="h", MASTER_PORT=1), "rank 4 is not below the world size 4"),
    (dict(RANK="one", WORLD_SIZE=4, MASTER_ADDR="h", MASTER_PORT=1), "RANK='one' is not an integer"),
    (dict(RANK=0, WORLD_SIZE=2), "MASTER_ADDR and MASTER_PORT is not"),
    (dict(SM_HOSTS="algo-1", SM_CURRENT_HOST="algo-1"), "SM_HOSTS='algo-1' is not a JSON list"),
    (dict(SM_HOSTS='["a"]', SM_CURRENT_HOST="b"), "SM_CURRENT_HOST='b' is not in SM_HOSTS"),
])
def test_bad_variables_are_named(launcher_env, variables, message):
    launcher_env(**variables)
    with pytest.raises((LauncherConflict, LauncherNotFound), match=message):
        detect(argv=[])


def test_every_launcher_family_is_tested():
    assert set(LAUNCHERS) == {"torchrun", "openmpi", "pmix", "mpich", "slurm", "sagemaker"}


# -- real launches ---------------------------------------------------------------

RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    import pydist
    result = pydist.init_process_group(timeout=float(sys.argv[1]))
    t = torch.tensor([float(result.rank + 1)])
    dist.all_reduce(t)
    env = {k: os.environ.get(k) for k in pydist.rendezvous.TORCHRUN_VARIABLES}
    print(json.dumps(dict(result._asdict(), total=t.item(), env=env)))
    dist.destroy_process_group()
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks, world_size, port, timeout_s=30, extra_env=None):
    """Start the given ranks with torchrun's variables; return (rc, stdout, stderr) per rank."""
    procs = []
    for rank in ranks:
        env = {k: v for k, v in os.environ.items() if k not in ALL_VARS}
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=REPO, OMP_NUM_THREADS="1", **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(timeout_s)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout_s + 60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, stdout, stderr))
    return out


def test_two_ranks_with_torchrun_variables():
    """Without LOCAL_WORLD_SIZE (a hand-written launch) it is counted from the
    hosts the ranks checked in from, and exported with the other variables."""
    port = free_port()
    results = launch([0, 1], 2, port)
    for rank, (rc, stdout, stderr) in enumerate(results):
        assert rc == 0, stderr
        got = json.loads(stdout.strip().splitlines()[-1])
        env = got.pop("env")
        assert got == dict(rank=rank, world_size=2, local_rank=rank, backend=DEFAULT_BACKEND, launcher="torchrun",
                           total=3.0, local_world_size=2)
        assert env == dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def test_impossible_local_world_size_is_named():
    (rc, _, stderr), = launch([0], 1, free_port(), extra_env=dict(LOCAL_WORLD_SIZE="5"))
    assert rc != 0
    assert "local rank 0 and local world size 5 do not fit a world of 1" in stderr


def test_contradicting_variable_is_not_overwritten(monkeypatch):
    """Values pydist found are exported; one that contradicts is named with both values."""
    from pydist.rendezvous import export_torchrun_env, process_group

    # A private environment: what this test exports must not reach later tests' launches.
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in ALL_VARS})
    monkeypatch.setattr(process_group, "_exported", {})
    os.environ["LOCAL_RANK"] = "3"
    with pytest.raises(LauncherConflict, match="LOCAL_RANK='3' is set but pydist found LOCAL_RANK='1'"):
        export_torchrun_env({"LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2}, "here")
    assert "LOCAL_WORLD_SIZE" not in os.environ  # nothing is set when one value contradicts
    export_torchrun_env({"LOCAL_RANK": 3, "LOCAL_WORLD_SIZE": 4, "MASTER_ADDR": None}, "here")
    assert os.environ["LOCAL_WORLD_SIZE"] == "4"


@pytest.mark.timeout(120)
def test_duplicate_rank_is_named():
    """Issue 17 item 14: two processes with RANK=1 (and none with RANK=2) fail
    every rank fast, naming the duplicated rank and both processes."""
    start = time.monotonic()
    results = launch([0, 1, 1], 3, free_port(), timeout_s=60)
    elapsed = time.monotonic() - start
    assert all(rc != 0 for rc, _, _ in results)
    for rc, _, stderr in results:
        assert "rank 1 was claimed by more than one process" in stderr, stderr[-2000:]
    assert elapsed < 40, f"the ranks took {elapsed:.0f} s to fail (timeout 60 s)"


@pytest.mark.timeout(120)
def test_missing_rank_named_beside_duplicates():
    """Counting distinct ranks: 0, 1, 1 of a world of 3 never completes, even
    if the duplicate's error were lost; a lone rank 0 of 3 names 1 and 2."""
    (rc, _, stderr), = launch([0], 3, free_port(), timeout_s=3)
    assert rc != 0 and "ranks [1, 2] of 3 did not arrive within 3 s" in stderr


@pytest.mark.timeout(120)
def test_foreign_service_on_master_port_is_named():
    """Issue 17 item 9: a service that accepts and never answers; rank 1 gives
    up after the timeout and says which process holds the port."""
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen(16)
        port = foreign.getsockname()[1]
        start = time.monotonic()
        (rc, _, stderr), = launch([1], 2, port, timeout_s=5)
        elapsed = time.monotonic() - start
    assert rc != 0
    assert f"something at 127.0.0.1:{port} accepted the connection but did not answer as a torch TCPStore" in stderr
    assert f"process {os.getpid()} (" in stderr  # this test process holds the port
    assert "sends nothing" in stderr
    assert elapsed < 30, f"{elapsed:.0f} s"


def test_real_torchrun(tmp_path):
    """torchrun's agent hosts the store itself (TORCHELASTIC_USE_AGENT_STORE)."""
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ALL_VARS}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(script), "30"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Both workers share torchrun's stdout, so their lines can run together.
    reports = [json.loads(obj) for obj in re.findall(r"\{[^{}]*\{[^{}]*\}\}", done.stdout)]
    assert sorted((r["rank"], r["launcher"], r["total"]) for r in reports) == [(0, "torchrun", 3.0), (1, "torchrun", 3.0)]


def test_missing_rank_times_out_naming_it():
    (rc, _, stderr), = launch([0], 2, free_port(), timeout_s=3)
    assert rc != 0
    assert "RendezvousTimeout: rank 0: ranks [1] of 2 did not arrive within 3 s" in stderr


def test_missing_rank_zero_times_out_naming_it():
    (rc, _, stderr), = launch([1], 2, free_port(), timeout_s=3)
    assert rc != 0
    assert "RendezvousTimeout" in stderr and "missing ranks: [0]" in stderr


def test_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (rc, _, stderr), = launch([0], 1, port, timeout_s=10)
    assert rc != 0
    assert f"PortInUse: init_process_group under torchrun: rank 0 cannot listen on port {port}" in stderr


def test_init_method_without_launcher(tmp_path):
    """No launcher variables, a file:// URL with rank and size in its query."""
    env = {k: v for k, v in os.environ.items() if k not in ALL_VARS}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    code = textwrap.dedent(f"""
        import json, pydist, torch.distributed as dist
        result = pydist.init_process_group(init_method="file://{tmp_path}/store?rank=0&world_size=1", timeout=30)
        print(json.dumps(result._asdict()))
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == dict(rank=0, world_size=1, local_rank=0,
                                                            backend=DEFAULT_BACKEND, launcher="init_method",
                                                            local_world_size=1)


def test_importing_pydist_does_not_start_mpi():
    """Only backend="mpi" or an MPI launcher imports mpi4py (which initializes MPI)."""
    code = "import sys, pydist; pydist.rendezvous.detect(required=False); print('mpi4py' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k not in ALL_VARS}
    env.update(PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def run_python(code, **env):
    clean = {k: v for k, v in os.environ.items() if k not in ALL_VARS and k != "MPI4PY_LIBMPI"}
    clean.update(PYTHONPATH=REPO, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=clean, capture_output=True, text=True,
                          timeout=120)


def test_missing_mpi4py_under_an_mpi_launcher_says_what_to_install():
    """Issue 18 item 7: not a raw ModuleNotFoundError."""
    done = run_python("""
        import sys
        sys.modules["mpi4py"] = None  # as if it were not installed
        import pydist
        pydist.init_process_group(timeout=5)
    """, PMI_RANK="0", PMI_SIZE="2")
    assert done.returncode != 0
    assert "MPINotAvailable: init_process_group under mpich: this process was started by an MPI launcher" in done.stderr
    assert "pip install 'pydist[mpi]'" in done.stderr


def test_open_mpi_launch_without_open_mpi_library_says_what_to_set():
    """Issue 18 item 8: under Open MPI's launcher with only the pip MPICH, refuse
    before MPICH aborts every rank, naming MPI4PY_LIBMPI."""
    done = run_python("""
        from pydist.rendezvous import mpi_runtime
        mpi_runtime._OPENMPI_DIRS = ()  # a machine without Open MPI's library
        mpi_runtime.load_mpi("here")
    """, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2")
    assert done.returncode != 0
    assert "MPINotAvailable: here: this job was started by Open MPI's mpirun" in done.stderr
    assert "Set MPI4PY_LIBMPI=/path/to/openmpi/lib/libmpi.so.40" in done.stderr


@pytest.mark.skipif(not os.path.exists("/usr/lib/x86_64-linux-gnu/libmpi.so.40"), reason="needs Open MPI's library")
def test_open_mpi_library_is_chosen_for_mpi4py():
    done = run_python("""
        import os
        from pydist.rendezvous import mpi_runtime
        mpi_runtime._choose_libmpi("here")
        print(os.environ["MPI4PY_LIBMPI"])
    """, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "/usr/lib/x86_64-linux-gnu/libmpi.so.40"


def test_no_backend_named_is_gloo_plus_nccl_for_cuda_tensors(monkeypatch):
    """torch's own default where CUDA is available: a CPU job on a GPU
    machine gets a group that takes CPU tensors (NCCL alone refuses them)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend(None) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend(None) == "cpu:gloo,cuda:nccl"
