"""An emulated cluster on one Linux machine: H hosts of L ranks each.

    python -m pydist.cluster_emulator --hosts 2 --ranks-per-host 2 --rate 1gbit -- train.py --epochs 1
    python -m pydist.cluster_emulator --launcher slurm -- train.py        # srun's environment instead
    python -m pydist.cluster_emulator --launcher mpiexec -- train.py      # MPICH's mpiexec across the hosts

    with EmulatedCluster(hosts=2, ranks_per_host=2, rate="1gbit") as cluster:
        procs = cluster.launch_torchrun(["train.py"])      # one torchrun agent per host
        cluster.wait(procs, timeout=120)
        cluster.shm_entries(1)                             # what host 1's /dev/shm holds
        cluster.set_rate("100mbit")                        # reshape every link while it runs

    cluster_emulator.request_rate("100mbit")   # inside a host: ask the driver (its wait() serves it)

Each host is a network namespace (its own interface ``eth0`` with an
address on a private subnet), a mount namespace (its own tmpfs ``/dev/shm``
and an ``/etc/hosts`` that names every host by its address) and a UTS
namespace (its own hostname, ``node0``, ``node1``, ...). The hosts' interfaces
are veth pairs whose other ends sit on a bridge in a switch namespace of
their own; with ``rate`` each end is shaped by ``tc tbf`` (both directions
of every host's link). Nothing is created outside these namespaces, and
every namespace name carries this process's pid, so several clusters (other
users' tests) run side by side. Everything goes on ``close()``, on the way
out of the ``with`` block, on SIGTERM and at interpreter exit: the processes
still running inside, then the namespaces (which takes the veths and the
bridge with them).

A host lives as long as a small agent process (``sleep``) that holds its
mount and UTS namespaces; commands enter the host with ``nsenter`` into the
agent's namespaces. Faults for tests: ``kill_host`` (SIGKILL every process in
the host), ``cut_link`` (the host's interface down), ``stall_host``
(SIGSTOP every process in it).

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); ``why_unavailable()`` says what
is missing. ``tc netem`` is not assumed: a link's latency comes from pydist's
simulated link (``PYDIST_SIM_NET``), which the hierarchical transport puts on
its cross-host leg only.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from typing import NamedTuple, Sequence

__all__ = ["EmulatedCluster", "ClusterUnavailable", "why_unavailable", "HostInfo", "request_rate", "CONTROL_ENV",
           "main"]

_NS_PREFIX = "pdc"  # every namespace this module makes: pdc<pid>x<cluster>h<host> / ...s
# What launched processes find their cluster's control directory in: see request_rate.
CONTROL_ENV = "PYDIST_CLUSTER_CONTROL"


class ClusterUnavailable(RuntimeError):
    """This machine cannot emulate a cluster (not root, no namespaces); the message says why."""


class HostInfo(NamedTuple):
    index: int
    hostname: str  # inside the host's UTS namespace
    address: str  # of its eth0 on the cluster's subnet
    netns: str  # the network namespace's name (ip netns)
    agent_pid: int  # holds the mount and UTS namespaces


def why_unavailable() -> str | None:
    """Why an emulated cluster cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "an emulated cluster needs root (network, mount and UTS namespaces, veth pairs, a bridge)"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"an emulated cluster needs `{tool}` (iproute2 / util-linux) on PATH"
    probe = f"{_NS_PREFIX}{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_live: "weakref.WeakSet[EmulatedCluster]" = weakref.WeakSet()
_counter = 0


def _close_live() -> None:
    for cluster in list(_live):
        cluster.close()


atexit.register(_close_live)


def _on_sigterm(signum, frame):  # a killed test run still tears its cluster down
    _close_live()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


class EmulatedCluster:
    """``hosts`` hosts of ``ranks_per_host`` ranks on a bridge; see the module
    docstring. ``rate``: a tc rate ("1gbit", "10gbit") each host's link is
    shaped to, None for unshaped. ``loopback_hostnames``: every host's
    ``/etc/hosts`` maps its own hostname to 127.0.1.1, as many distribution
    images do (gloo then binds loopback unless GLOO_SOCKET_IFNAME is set);
    the other hosts' names still map to their addresses.
    ``subnet``: the first three octets of the hosts' addresses (host i is .i+1)."""

    def __init__(self, hosts: int = 2, ranks_per_host: int | Sequence[int] = 2, rate: str | None = None,
                 loopback_hostnames: bool = False, subnet: str = "10.37.0", shm_size: str = "512m"):
        global _counter
        if hosts < 1:
            raise ValueError(f"EmulatedCluster: hosts must be >= 1, got {hosts}")
        counts = [ranks_per_host] * hosts if isinstance(ranks_per_host, int) else list(ranks_per_host)
        if len(counts) != hosts or any(c < 1 for c in counts):
            raise ValueError(f"EmulatedCluster: ranks_per_host must be a positive int or one per host, got {ranks_per_host!r}")
        self.ranks_per_host = counts  # ranks on each host, in host order
        self.rate = rate
        self.loopback_hostnames = loopback_hostnames
        self.subnet = subnet
        self.shm_size = shm_size
        _counter += 1
        self.tag = f"{_NS_PREFIX}{os.getpid()}x{_counter}"  # every name this cluster makes starts with it
        self.switch = f"{self.tag}s"
        self.hosts: list[HostInfo] = []
        self._num_hosts = hosts
        self._agents: list[subprocess.Popen] = []
        self._launched: list[subprocess.Popen] = []
        self._tmp = tempfile.mkdtemp(prefix=f"{self.tag}-")
        # request_rate's files: a launched process writes "request", wait() answers in "done"
        self._control = os.path.join(self._tmp, "control")
        os.makedirs(self._control)
        self._served = ""  # the last request wait() carried out
        self._closed = False
        self._started = False

    # --- lifecycle ------------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        return sum(self.ranks_per_host)

    def start(self) -> "EmulatedCluster":
        why = why_unavailable()
        if why:
            raise ClusterUnavailable(why)
        _live.add(self)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)
        self._started = True
        try:
            self._ip("netns", "add", self.switch)
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
            names = [f"node{i}" for i in range(self._num_hosts)]
            addresses = [f"{self.subnet}.{i + 1}" for i in range(self._num_hosts)]
            for i in range(self._num_hosts):
                netns = f"{self.tag}h{i}"
                self._ip("netns", "add", netns)
                # The veth is made straight into the two namespaces: no name in the root namespace.
                self._ip("link", "add", "eth0", "netns", netns, "type", "veth", "peer", "name", f"port{i}",
                         "netns", self.switch)
                self._ip("-n", netns, "addr", "add", f"{addresses[i]}/24", "dev", "eth0")
                self._ip("-n", netns, "link", "set", "eth0", "up")
                self._ip("-n", netns, "link", "set", "lo", "up")
                self._ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
                self._ip("-n", self.switch, "link", "set", f"port{i}", "up")
                if self.rate:
                    self._shape(netns, "eth0", self.rate)
                    self._shape(self.switch, f"port{i}", self.rate)
                hosts_file = os.path.join(self._tmp, f"hosts{i}")
                with open(hosts_file, "w") as f:
                    f.write("127.0.0.1 localhost\n")
                    for j in range(self._num_hosts):
                        own_loopback = self.loopback_hostnames and j == i
                        f.write(f"{'127.0.1.1' if own_loopback else addresses[j]} {names[j]}\n")
                agent = subprocess.Popen(
                    ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--propagation", "private",
                     "sh", "-c",
                     f"mount -t tmpfs -o size={self.shm_size} tmpfs /dev/shm && mount --bind {hosts_file} /etc/hosts"
                     f" && hostname {names[i]} && echo up && exec sleep 1000000"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
                self._agents.append(agent)
                line = agent.stdout.readline()
                if line.strip() != "up":
                    raise ClusterUnavailable(f"host {names[i]}: its namespaces could not be set up: "
                                             f"{agent.stderr.read() if agent.poll() is not None else line}")
                # The agent is `sleep` now, exec'd in the host's namespaces.
                self.hosts.append(HostInfo(i, names[i], addresses[i], netns, agent.pid))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Ends every process inside the hosts, then removes the namespaces
        (their veths and the bridge go with them). Idempotent."""
        if self._closed or not self._started:
            if not self._closed:
                shutil.rmtree(self._tmp, ignore_errors=True)  # made in __init__, never started
            self._closed = True
            return
        self._closed = True
        for netns in self._namespaces():
            for pid in self._pids_in(netns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._launched + self._agents:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for netns in self._namespaces():
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        shutil.rmtree(self._tmp, ignore_errors=True)
        _live.discard(self)

    def leftovers(self) -> list[str]:
        """Namespaces of this cluster still present (empty after close())."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
        return [line.split()[0] for line in listed if line.strip() and line.split()[0].startswith(self.tag)]

    def _namespaces(self) -> list[str]:
        return [f"{self.tag}h{i}" for i in range(self._num_hosts)] + [self.switch]

    @staticmethod
    def _pids_in(netns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise ClusterUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")

    def set_rate(self, rate: str | None) -> None:
        """Shapes every host's link, both ends, to ``rate`` ("300mbit"; None:
        unshaped) while the cluster runs: what runs inside keeps its
        connections."""
        if rate is not None:
            _rate_bits(rate)  # refused before anything changes
        for host in self.hosts:
            for netns, dev in ((host.netns, "eth0"), (self.switch, f"port{host.index}")):
                if rate is None:
                    subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
                else:
                    self._shape(netns, dev, rate)
        self.rate = rate

    def _shape(self, netns: str, dev: str, rate: str) -> None:
        """tbf at ``rate`` on ``dev``'s egress (replacing what shaped it): a
        bucket of about 2 ms of the rate (at least 256 KB: veth hands over
        64 KB GSO packets)."""
        bits = _rate_bits(rate)
        burst = max(256 * 1024, int(bits / 8 * 0.002))
        done = subprocess.run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                               "burst", str(burst), "latency", "100ms"], capture_output=True, text=True)
        if done.returncode != 0:
            raise ClusterUnavailable(f"tc tbf on {dev} in {netns} failed: {done.stderr.strip()}")

    # --- running things on a host ---------------------------------------------

    def enter(self, host: int) -> list[str]:
        """The command prefix that runs a command inside host ``host``."""
        return ["nsenter", "-t", str(self.hosts[host].agent_pid), "-m", "-u", "-n", f"--wd={os.getcwd()}", "--"]

    def popen(self, host: int, argv: Sequence[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Starts ``argv`` inside host ``host`` (in a session of its own);
        close() ends it if it is still running."""
        proc = subprocess.Popen(self.enter(host) + list(argv), env=env, start_new_session=True, **kwargs)
        self._launched.append(proc)
        return proc

    def run(self, host: int, argv: Sequence[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.enter(host) + list(argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def shm_entries(self, host: int) -> list[str]:
        """What host ``host``'s /dev/shm holds."""
        return sorted(self.run(host, ["ls", "-A", "/dev/shm"]).stdout.split())

    def launch_torchrun(self, script_argv: Sequence[str], env: dict | None = None, master_port: int = 29400,
                        torchrun_args: Sequence[str] = (), **popen_kwargs) -> list[subprocess.Popen]:
        """One ``torchrun --nnodes H --node_rank i`` per host, the master on host 0."""
        if len(set(self.ranks_per_host)) != 1:
            raise ValueError("launch_torchrun: torchrun starts the same number of ranks on every node; "
                             f"this cluster has {self.ranks_per_host}")
        procs = []
        for host in self.hosts:
            argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(self.hosts)}",
                    f"--nproc_per_node={self.ranks_per_host[0]}", f"--node_rank={host.index}",
                    f"--master_addr={self.hosts[0].address}", f"--master_port={master_port}", *torchrun_args,
                    *script_argv]
            procs.append(self.popen(host.index, argv, env=self._env(env), **popen_kwargs))
        return procs

    def launch_slurm(self, script_argv: Sequence[str], env: dict | None = None, job_id: int = 3737,
                     distribution: str = "block", **popen_kwargs) -> list[subprocess.Popen]:
        """Every rank as ``srun`` would start it: ``python script`` with the
        SLURM_* variables of a job on nodes node[0-(H-1)], one process per
        task. ``distribution``: "block" (tasks 0..L-1 on node0, ...) or
        "cyclic" (task t on node t % H, as ``srun -m cyclic``; every host
        the same number of ranks)."""
        if distribution not in ("block", "cyclic"):
            raise ValueError(f"launch_slurm: distribution must be 'block' or 'cyclic', got {distribution!r}")
        if distribution == "cyclic" and len(set(self.ranks_per_host)) != 1:
            raise ValueError(f"launch_slurm: cyclic needs the same ranks on every host, not {self.ranks_per_host}")
        procs = []
        nodelist = f"node[0-{len(self.hosts) - 1}]" if len(self.hosts) > 1 else "node0"
        tasks_per_node = ",".join(str(c) for c in self.ranks_per_host)
        block_rank = 0
        for host in self.hosts:
            for local in range(self.ranks_per_host[host.index]):
                rank = local * len(self.hosts) + host.index if distribution == "cyclic" else block_rank
                block_rank += 1
                slurm = {
                    "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_PROCID": str(rank),
                    "SLURM_NTASKS": str(self.world_size), "SLURM_LOCALID": str(local),
                    "SLURM_NODEID": str(host.index), "SLURM_NNODES": str(len(self.hosts)),
                    "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
                    "SLURM_TASKS_PER_NODE": tasks_per_node, "SLURMD_NODENAME": host.hostname,
                }
                procs.append(self.popen(host.index, [sys.executable, *script_argv], env=self._env(env, slurm),
                                        **popen_kwargs))
        return procs

    def launch_mpiexec(self, script_argv: Sequence[str], env: dict | None = None,
                       **popen_kwargs) -> list[subprocess.Popen]:
        """MPICH's ``mpiexec -hosts node0:L,node1:L,... python script``, run
        on host 0; Hydra starts its proxy on each other host through a
        launcher script that enters that host's namespaces (as ssh would log
        in). Returns [the mpiexec process]."""
        script = os.path.join(self._tmp, "enter-host.sh")
        with open(script, "w") as f:
            # Hydra calls it as ssh: [-x] HOST "COMMAND"
            f.write('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nhost=$1; shift\ncase $host in\n')
            for host in self.hosts:
                f.write(f"  {host.hostname}) pid={host.agent_pid};;\n")
            f.write('  *) echo "enter-host.sh: no host $host" >&2; exit 1;;\nesac\n')
            f.write('exec nsenter -t "$pid" -m -u -n -- sh -c "$*"\n')
        os.chmod(script, 0o755)
        hosts = ",".join(f"{h.hostname}:{self.ranks_per_host[h.index]}" for h in self.hosts)
        argv = ["mpiexec", "-launcher", "ssh", "-launcher-exec", script, "-hosts", hosts, "-n", str(self.world_size),
                sys.executable, *script_argv]
        return [self.popen(0, argv, env=self._env(env), **popen_kwargs)]

    def _env(self, extra: dict | None = None, more: dict | None = None) -> dict:
        return _env(extra, {CONTROL_ENV: self._control, **(more or {})})

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float) -> list[int]:
        """Every process's exit status; kills the rest and raises TimeoutError
        naming them if they are not done within ``timeout`` seconds. Meanwhile
        it carries out what launched processes ask through ``request_rate``."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                late = [j for j, p in enumerate(procs) if p.poll() is None]
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                raise TimeoutError(f"EmulatedCluster.wait: processes {late} still running after {timeout} s")
            self._serve_rate_request()
            time.sleep(0.02)
        return [p.returncode for p in procs]

    def _serve_rate_request(self) -> None:
        try:
            with open(os.path.join(self._control, "request")) as f:
                request = f.read().strip()
        except FileNotFoundError:
            return
        if not request or request == self._served:
            return
        serial, _, rate = request.partition(" ")
        try:
            self.set_rate(rate if rate != "none" else None)
            answer = serial
        except (ValueError, ClusterUnavailable) as exc:
            answer = f"{serial} {exc}"
        done = os.path.join(self._control, "done")
        with open(done + ".tmp", "w") as f:
            f.write(answer)
        os.replace(done + ".tmp", done)
        self._served = request

    # --- faults -----------------------------------------------------------------

    def kill_host(self, host: int) -> None:
        """SIGKILL every process in host ``host`` but its agent (the host stays up, its ranks die)."""
        for pid in self._pids_in(self.hosts[host].netns):
            if pid != self.hosts[host].agent_pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def cut_link(self, host: int) -> None:
        """Takes host ``host``'s interface down: its packets go nowhere."""
        self._ip("-n", self.hosts[host].netns, "link", "set", "eth0", "down")

    def stall_host(self, host: int, resume: bool = False) -> None:
        """SIGSTOPs (or with resume, SIGCONTs) every process in host ``host``."""
        for pid in self._pids_in(self.hosts[host].netns):
            if pid != self.hosts[host].agent_pid:
                try:
                    os.kill(pid, signal.SIGCONT if resume else signal.SIGSTOP)
                except ProcessLookupError:
                    pass


_requests = 0  # request_rate's serial numbers in this process


def request_rate(rate: str | None, timeout: float = 60.0) -> None:
    """From a process launched on an emulated cluster (one process at a
    time, e.g. rank 0, then a barrier): asks the driver to shape every host's
    link to ``rate`` ("300mbit"; None: unshaped) and returns once it has.
    The driver does it while in ``EmulatedCluster.wait``. Raises
    RuntimeError outside a cluster, naming the driver's refusal, or after
    ``timeout`` seconds."""
    global _requests
    control = os.environ.get(CONTROL_ENV)
    if not control:
        raise RuntimeError(f"request_rate: {CONTROL_ENV} is not set; only a process an EmulatedCluster launched "
                           "can ask it for a rate")
    _requests += 1
    serial = f"{os.getpid()}.{_requests}"
    request = os.path.join(control, "request")
    with open(request + ".tmp", "w") as f:
        f.write(f"{serial} {rate if rate is not None else 'none'}")
    os.replace(request + ".tmp", request)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(os.path.join(control, "done")) as f:
                answer = f.read().strip()
        except FileNotFoundError:
            answer = ""
        if answer == serial:
            return
        if answer.startswith(serial + " "):
            raise RuntimeError(f"request_rate({rate!r}): the driver refused: {answer[len(serial) + 1:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"request_rate({rate!r}): the driver did not answer within {timeout:g} s "
                               "(is it in EmulatedCluster.wait?)")
        time.sleep(0.02)


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    text = rate.strip().lower()
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    raise ValueError(f"EmulatedCluster: rate {rate!r} is not a tc rate such as '1gbit' or '500mbit'")


def _env(extra: dict | None = None, more: dict | None = None) -> dict:
    env = dict(os.environ)
    for name in [n for n in env if n.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL"))]:
        del env[name]  # the cluster's launcher sets its own
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(extra or {})
    env.update(more or {})
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pydist.cluster_emulator",
        description="Run a training script on an emulated cluster (namespaces on this machine; needs root).")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--rate", default=None, help="shape every host's link with tc tbf, e.g. 1gbit")
    parser.add_argument("--launcher", choices=("torchrun", "slurm", "slurm-cyclic", "mpiexec"), default="torchrun",
                        help="slurm-cyclic: srun -m cyclic's placement (rank t on host t %% H)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("name the script to run after --")
    with EmulatedCluster(args.hosts, args.ranks_per_host, rate=args.rate) as cluster:
        for host in cluster.hosts:
            print(f"[cluster] {host.hostname} {host.address} ({args.ranks_per_host} ranks)"
                  + (f", link {args.rate}" if args.rate else ""), flush=True)
        if args.launcher == "torchrun":
            procs = cluster.launch_torchrun(script)
        elif args.launcher == "mpiexec":
            procs = cluster.launch_mpiexec(script)
        else:
            procs = cluster.launch_slurm(script, distribution="cyclic" if args.launcher == "slurm-cyclic" else "block")
        codes = cluster.wait(procs, args.timeout)
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
