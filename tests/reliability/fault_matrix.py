"""The fault matrix of issue 17: scenario x launcher x wrapper -> how the job ends.

    python tests/reliability/fault_matrix.py                 # the whole table (~36 jobs)
    python tests/reliability/fault_matrix.py --scenario kill9 --launcher mpiexec --json
    python tests/reliability/fault_matrix.py --wrapper pydist-fsdp-shm --where forward

Each cell runs a 2-rank job of fault_worker.py (gloo process group, timeout
TIMEOUT_S) in which rank 1 faults at step 5: ``kill9`` (SIGKILL), ``exception``
(uncaught RuntimeError), ``straggler`` (sleeps 10x the timeout), ``early_exit``
(``sys.exit(0)`` mid-training), ``caught`` (a RuntimeError the rank's training
loop catches, dropping that batch and training on). Launchers: ``manual``
(this script sets the torchrun variables and waits for the ranks one by one,
as hand-written launchers do), ``torchrun``, ``mpiexec``. Wrappers: pydist's DDP through
shared memory (``pydist-shm``), pydist's DDP through the gloo group
(``pydist-gloo``), and torch's DDP (``torch``), in the same situations; and
the sharded wrappers, each Linear a unit: ``pydist-fsdp-shm``,
``pydist-fsdp-gloo`` (pydist.fully_shard with shm=True / False) and
``torch-fsdp`` (torch's fully_shard). ``--where forward`` faults inside the
second Linear's forward instead of between steps, ``--where backward`` in the
first Linear's backward.

Columns: seconds from the fault to the end of the whole job (``hang`` past
the cap), the launcher's exit code, the first error a surviving rank printed,
and /dev/shm/pydist-* segments of the job left behind.
"""

import argparse
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "fault_worker.py")
SCENARIOS = ["kill9", "exception", "straggler", "early_exit", "caught"]
LAUNCHERS = ["manual", "torchrun", "mpiexec"]
WRAPPERS = ["pydist-shm", "pydist-gloo", "torch"]
FSDP_WRAPPERS = ["pydist-fsdp-shm", "pydist-fsdp-gloo", "torch-fsdp"]  # run when named with --wrapper
WHERE = ["step", "forward", "backward"]
TIMEOUT_S = 10  # the process group's timeout
CAP_S = 120  # a job still running this long after its fault counts as a hang
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(launcher, scenario, wrapper, out_dir, where="step"):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = [WORKER, scenario, wrapper, str(TIMEOUT_S), where]
    logs = []

    def popen(cmd, extra, name):
        out = open(os.path.join(out_dir, f"{name}.out"), "w+")
        logs.append(out)
        return subprocess.Popen(cmd, env=dict(env, **extra), stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    if launcher == "manual":
        port = str(free_port())
        procs = [popen([sys.executable, *args], dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port), f"rank{r}")
                 for r in range(2)]
    elif launcher == "torchrun":
        procs = [popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", *args], {}, "job")]
    else:
        procs = [popen(["mpiexec", "-n", "2", sys.executable, *args], {}, "job")]
    return procs, logs


def run_cell(launcher, scenario, wrapper, out_dir, where="step", cap_s=CAP_S):
    """``cap_s``: how long past start the job may run before it is killed as hung."""
    os.makedirs(out_dir, exist_ok=True)
    procs, logs = start(launcher, scenario, wrapper, out_dir, where)
    deadline = time.monotonic() + cap_s + 60
    hung = False
    for p in procs:  # one by one, as hand-written launchers wait
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
    end = time.time()
    if hung:
        for p in procs:
            p.kill()
            p.wait()
    text = ""
    for log in logs:
        log.seek(0)
        text += log.read()
        log.close()
    fault = re.search(r"^FAULT ([\d.]+)", text, re.M)
    pids = re.findall(r"^PID \d+ (\d+)", text, re.M)
    survivor = re.search(r"^SURVIVOR \d+ (.*)$", text, re.M)
    leftovers = [p for pid in pids for p in glob.glob(f"/dev/shm/pydist-{pid}-*")]
    for path in leftovers:  # clean up after reporting
        try:
            os.unlink(path)
        except OSError:
            pass
    if fault is None:
        seconds = None
    else:
        seconds = end - float(fault.group(1))
    message = survivor.group(1) if survivor else _launcher_message(text)
    return dict(scenario=scenario, launcher=launcher, wrapper=wrapper,
                seconds=None if hung or seconds is None else round(seconds, 1), hang=hung,
                rc=[p.returncode for p in procs], message=message, leftovers=len(leftovers))


def _launcher_message(text: str) -> str:
    for pattern in (r"\[pydist\][^\n]*", r"BAD TERMINATION[^\n]*", r"exitcode\s*:[^\n]*", r"Killed[^\n]*"):
        m = re.search(pattern, text)
        if m:
            return "(no survivor report) " + m.group(0)[:200]
    return "(no survivor report)"


def short(message: str, width: int = 110) -> str:
    message = re.sub(r"\s+", " ", message).replace("|", "/")
    return message if len(message) <= width else message[:width - 3] + "..."


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=SCENARIOS, action="append")
    parser.add_argument("--launcher", choices=LAUNCHERS, action="append")
    parser.add_argument("--wrapper", choices=WRAPPERS + FSDP_WRAPPERS, action="append")
    parser.add_argument("--where", choices=WHERE, default="step")
    parser.add_argument("--out", default="/tmp/pydist-fault-matrix")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    rows = []
    print("| scenario | launcher | wrapper | s to exit | rc | survivor's message | shm left |")
    print("|---|---|---|---|---|---|---|")
    for scenario in a.scenario or SCENARIOS:
        for launcher in a.launcher or LAUNCHERS:
            for wrapper in a.wrapper or WRAPPERS:
                row = run_cell(launcher, scenario, wrapper,
                               os.path.join(a.out, f"{scenario}-{launcher}-{wrapper}-{a.where}"), a.where)
                rows.append(row)
                took = f"hang (> {CAP_S})" if row["hang"] else row["seconds"]
                print(f"| {scenario} | {launcher} | {wrapper} | {took} | {','.join(map(str, row['rc']))} | "
                      f"{short(row['message'])} | {row['leftovers']} |", flush=True)
    if a.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
