"""``init_process_group``: one call that joins the job under any launcher.

    import pydist
    result = pydist.init_process_group()   # InitResult(rank=1, world_size=4, ...)

The steps, in order: ``detect()`` the launcher -> ``resolve_backend`` ->
``open_store`` (rank 0 hosts a TCPStore; under MPI it picks a free port and
broadcasts it) -> ``wait_for_ranks`` (every rank checks in, or a timeout names
the missing ones) -> ``torch.distributed.init_process_group`` on that store ->
the CUDA device from the local rank.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import socket
import sys
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from .launchers import EXPORTED_FROM_ENV, LaunchInfo, LauncherConflict, detect
from .mpi_runtime import load_mpi

__all__ = ["init_process_group", "InitResult", "RendezvousTimeout", "RendezvousError", "PortInUse", "resolve_backend",
           "export_torchrun_env", "TORCHRUN_VARIABLES"]


class RendezvousTimeout(TimeoutError):
    """Some ranks did not check in within the timeout; the message names them."""


class PortInUse(RuntimeError):
    """Rank 0 could not listen on the rendezvous port."""


class RendezvousError(RuntimeError):
    """The processes of the job do not form one job (two claim the same rank)."""


class InitResult(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    backend: str  # the torch.distributed backend in use ("gloo", "nccl", "cpu:gloo,cuda:nccl", "mpi4py", "mpi")
    launcher: str  # LaunchInfo.launcher, or "init_method" when only a URL was given
    local_world_size: int  # ranks on this host (torchrun's LOCAL_WORLD_SIZE)


_ARRIVAL_POLL_S = 0.02
_attempts = itertools.count()  # [Note: one key space per attempt]


def resolve_backend(backend: str | None) -> str:
    """None -> gloo for CPU tensors, and NCCL for CUDA tensors where CUDA is
    available ("cpu:gloo,cuda:nccl", torch's own default), so CPU training
    and pydist's CPU collectives work on a machine with GPUs too. "mpi" ->
    torch's own MPI backend when torch was built with one, else pydist's
    mpi4py backend (registered here)."""
    if backend is None:
        return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    name = backend.lower()
    if name == "mpi" and dist.is_mpi_available():
        return "mpi"
    if name in ("mpi", "mpi4py"):
        from pydist.backends.mpi4py_backend import register

        return register()
    return name


def _timeout(timeout) -> datetime.timedelta:
    if timeout is None:
        return datetime.timedelta(minutes=30)  # torch's default for gloo
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _listen_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "address already in use" in text or "eaddrinuse" in text or "errno 98" in text


def _bound_socket(bind: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def _host_store(addr: str, port: int, world_size: int, timeout: datetime.timedelta, where: str,
                bind: str | None = None) -> dist.TCPStore:
    """Rank 0's store on ``port`` (0: a free one). ``bind``: listen on that
    address only (see [Note: where the store listens]); None: every address."""
    try:
        if bind is None:
            return dist.TCPStore(addr, port, world_size, True, timeout=timeout, wait_for_workers=False)
        sock = _bound_socket(bind, port)
        return dist.TCPStore(addr, sock.getsockname()[1], world_size, True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=sock.detach())  # the store owns the socket from here
    except (RuntimeError, OSError) as exc:
        if _listen_error(exc):
            raise PortInUse(
                f"{where}: rank 0 cannot listen on port {port} for the rendezvous store: the port is already "
                f"in use on {socket.gethostname()} ({describe_port(bind or '127.0.0.1', port)}); pick another "
                "MASTER_PORT (or unset it under MPI to get a free one). If two processes were both given RANK=0, "
                "give each process its own RANK"
            ) from exc
        raise


# [Note: where the store listens]
# torch's TCPStore listens on every interface. Under MPI pydist knows where
# the ranks are: when every rank runs on rank 0's host, the store listens on
# 127.0.0.1 only, so nothing outside the machine can reach it; otherwise it
# listens where torch would.


def _listener_of(port: int) -> str | None:
    """The local process listening on TCP ``port``, from /proc (Linux), or None."""
    try:
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if not os.path.exists(table):
                continue
            with open(table) as f:
                for line in list(f)[1:]:
                    fields = line.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                        inodes.add(fields[9])
        if not inodes:
            return None
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    return f"process {pid} ({cmd[:120]}) listens on it"
        return "a process this user cannot inspect listens on it"
    except (OSError, ValueError, IndexError):
        return None


def describe_port(addr: str, port: int, wait_s: float = 0.5) -> str:
    """Say what answers on ``addr:port``: the local listener if /proc shows
    it, and what the service sends first."""
    parts = []
    try:
        local = addr in ("127.0.0.1", "localhost", "::1") or socket.gethostbyname(addr) in _local_addresses()
    except OSError:
        local = False
    if local:
        who = _listener_of(port)
        if who:
            parts.append(who)
    try:
        with socket.create_connection((addr, port), timeout=wait_s) as probe:
            probe.settimeout(wait_s)
            try:
                first = probe.recv(64)
                parts.append(f"it sent {first!r} on connect" if first else "it closed the connection at once")
            except socket.timeout:
                parts.append(f"it accepts connections and sends nothing for {wait_s:g} s")
    except OSError as exc:
        parts.append(f"connecting failed: {exc}")
    return "; ".join(parts)


def _local_addresses() -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)} | {"127.0.0.1"}
    except OSError:
        return {"127.0.0.1"}


def _join_store(addr: str, port: int, world_size: int, rank: int, timeout: datetime.timedelta, where: str):
    """[Note: a bounded store handshake]
    torch's TCPStore client bounds its connect by ``timeout`` but not the
    handshake after it: a foreign service on the port that accepts and never
    answers blocks the constructor forever. The constructor runs on a helper
    thread (it releases the GIL) and this rank gives up after ``timeout``,
    saying what is on the port; the helper stays blocked in its recv, a daemon
    thread that ends with the process."""
    outcome: dict = {}

    def connect():
        try:
            outcome["store"] = dist.TCPStore(addr, port, world_size, False, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            outcome["error"] = exc

    helper = threading.Thread(target=connect, name="pydist-store-connect", daemon=True)
    helper.start()
    helper.join(timeout.total_seconds() + _HANDSHAKE_SLACK_S)
    if "store" in outcome:
        return outcome["store"]
    if "error" in outcome or not _accepts(addr, port):  # nothing listens: torch's own error is on its way
        raise RendezvousTimeout(
            f"{where}: rank {rank} of {world_size} could not reach the rendezvous store at {addr}:{port} within "
            f"{timeout.total_seconds():.0f} s; missing ranks: [0] (rank 0 hosts the store and never answered)"
        ) from outcome.get("error")
    raise RendezvousTimeout(
        f"{where}: rank {rank} of {world_size}: something at {addr}:{port} accepted the connection but did not "
        f"answer as a torch TCPStore within {timeout.total_seconds():.0f} s ({describe_port(addr, port)}). "
        "Another service holds MASTER_PORT: pick a free MASTER_PORT for the job"
    )


_HANDSHAKE_SLACK_S = 2.0  # beyond the timeout, for torch's own connect error when nothing listens


def _accepts(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


class _MPIStore(NamedTuple):
    store: dist.TCPStore
    rank: int
    world_size: int
    local_world_size: int
    master_addr: str  # what rank 0 announced (ranks on its host connect to 127.0.0.1)
    master_port: int


def _open_mpi_store(info: LaunchInfo, timeout: datetime.timedelta) -> _MPIStore:
    """[Note: rendezvous under MPI]
    mpirun starts every rank at once but tells none of them a master address.
    Rank 0 opens the TCPStore on port 0 (the kernel picks a free port, so no
    race between choosing and binding) and broadcasts ``(host, ip, port)`` -- or
    its error, so the other ranks fail with it instead of waiting in the
    broadcast. Ranks on rank 0's host connect to 127.0.0.1; when that is every
    rank, the store listens there only (see [Note: where the store listens])."""
    where = f"init_process_group under {info.launcher}"
    comm = load_mpi(where).COMM_WORLD
    if info.world_size is not None and comm.Get_size() != info.world_size:
        raise LauncherConflict(
            f"{where}: the launcher says world size {info.world_size} but MPI_COMM_WORLD has {comm.Get_size()} ranks"
        )
    if comm.Get_rank() != info.rank:
        raise LauncherConflict(f"{where}: the launcher says rank {info.rank} but MPI_COMM_WORLD says {comm.Get_rank()}")
    rank, size = comm.Get_rank(), comm.Get_size()
    host = socket.gethostname()
    hosts = comm.allgather(host)
    store, message = None, None
    if rank == 0:
        try:
            addr = os.environ.get("MASTER_ADDR") or socket.gethostbyname(host)
            port = int(os.environ.get("MASTER_PORT", 0))
            all_local = hosts.count(host) == size
            bind = None if not all_local else (addr if "MASTER_ADDR" in os.environ else "127.0.0.1")
            store = _host_store(addr if not all_local else bind, port, size, timeout, where, bind=bind)
            message = {"host": host, "addr": addr, "port": store.port}
        except BaseException as exc:  # noqa: BLE001 - sent to the others, then re-raised
            comm.bcast({"error": f"{type(exc).__name__}: {exc}"}, root=0)
            raise
    message = comm.bcast(message, root=0)
    if "error" in message:
        raise RuntimeError(f"{where}: rank {rank}: rank 0 failed to open the rendezvous store: {message['error']}")
    if rank != 0:
        addr = message["addr"]
        if message["host"] == host and "MASTER_ADDR" not in os.environ:
            addr = "127.0.0.1"
        store = _join_store(addr, message["port"], size, rank, timeout, where)
    return _MPIStore(store, rank, size, hosts.count(host), message["addr"], message["port"])


def open_store(info: LaunchInfo, timeout: datetime.timedelta, backend: str | None = None) -> _MPIStore:
    """Return the store and where it is. Rank 0 hosts the store, except under
    torchrun, whose agent already hosts one at MASTER_PORT. Under an MPI
    launcher MPI agrees on the port, unless the launcher's environment already
    names one and ``backend`` needs no MPI (``LaunchInfo.master_addr``)."""
    if info.uses_mpi and (info.master_addr is None or backend in ("mpi", "mpi4py")):
        return _open_mpi_store(info, timeout)
    where = f"init_process_group under {info.launcher}"
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if info.rank == 0 and not agent_hosts_it:
        # An MPI launcher's ranks all on this host: see [Note: where the store listens].
        bind = "127.0.0.1" if info.uses_mpi and info.master_addr == "127.0.0.1" else None
        store = _host_store(info.master_addr, info.master_port, info.world_size, timeout, where, bind=bind)
    else:
        store = _join_store(info.master_addr, info.master_port, info.world_size, info.rank, timeout, where)
    return _MPIStore(store, info.rank, info.world_size, info.local_world_size, info.master_addr, info.master_port)


def wait_for_ranks(store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Check in, then wait until all ``world_size`` ranks have. Two processes
    claiming one rank fail every rank at once, naming it and both processes;
    on timeout, ``RendezvousTimeout`` names the ranks that never checked in.

    [Note: distinct ranks, not arrivals]
    Each rank increments its own key ``claims/<rank>``; only the first claim
    counts towards ``arrived``, so a duplicated rank can never make up for a
    missing one. A second claim writes ``duplicate``, which every waiting rank
    polls."""
    me = f"{socket.gethostname()} pid {os.getpid()}"
    claim = store.add(f"claims/{rank}", 1)
    store.set(f"claimed/{rank}/{claim}", me)
    if claim > 1:
        first = store.get(f"claimed/{rank}/1").decode()
        text = (f"rank {rank} was claimed by more than one process ({first}, and {me}); two processes were given "
                f"the same RANK: give each process of the job its own rank in [0, {world_size})")
        store.set("duplicate", text)
        raise RendezvousError(text)
    store.add("arrived", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add("arrived", 0) < world_size:
        if store.check(["duplicate"]):
            raise RendezvousError(f"rank {rank}: {store.get('duplicate').decode()}")
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"claims/{r}"])]
            raise RendezvousTimeout(
                f"rank {rank}: ranks {missing} of {world_size} did not arrive within "
                f"{timeout.total_seconds():.0f} s (were they started, with the same WORLD_SIZE and MASTER_ADDR?)"
            )
        time.sleep(_ARRIVAL_POLL_S)
    if store.check(["duplicate"]):  # a duplicate that came after the count was complete
        raise RendezvousError(f"rank {rank}: {store.get('duplicate').decode()}")


def init_process_group(backend: str | None = None, timeout=None, init_method: str | None = None) -> InitResult:
    """Join the default process group, whatever launched this process.

    ``backend``: None (gloo, plus NCCL for CUDA tensors where CUDA is
    available: see ``resolve_backend``), any torch backend name, or
    "mpi" (torch's MPI backend if built in, else pydist's mpi4py backend).
    ``timeout``: seconds or a timedelta, for the rendezvous and the group.
    ``init_method``: a torch URL (``tcp://``, ``file://``) used instead of the
    launcher's address; rank and world size still come from the launcher if
    one is found, else from the URL's query.
    """
    info = detect(required=init_method is None)
    backend = resolve_backend(backend)
    timeout = _timeout(timeout)
    local_rank = info.local_rank if info else 0
    if torch.cuda.is_available():  # before the group exists, so NCCL binds to this device
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    local_size, addr, port = (info.local_world_size, info.master_addr, info.master_port) if info else (None,) * 3
    if init_method is not None:
        rank = info.rank if info else -1
        size = info.world_size if info and info.world_size is not None else -1
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
        addr = port = None  # the URL's, not the launcher's
    elif backend == "mpi":  # torch's own MPI backend reads MPI_COMM_WORLD itself
        dist.init_process_group(backend, timeout=timeout)
    else:
        opened = open_store(info, timeout, backend)
        # See [Note: one key space per attempt]
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"pydist/{restart}/{next(_attempts)}", opened.store)
        wait_for_ranks(store, opened.rank, opened.world_size, timeout)
        if opened.local_world_size is None:
            local_size = _count_local_ranks(store, opened.world_size)
        else:
            local_size = opened.local_world_size
        addr, port = opened.master_addr, opened.master_port
        check_hosts(store, opened.rank, opened.world_size, backend, addr, timeout)
        dist.init_process_group(backend, store=store, rank=opened.rank, world_size=opened.world_size, timeout=timeout)
    _destroy_at_exit()
    if os.environ.get("PYDIST_VERBOSE", "") not in ("", "0"):  # one line: the hosts pydist found
        from pydist import topology

        line = topology.describe_world()
        if dist.get_rank() == 0:
            print(line, flush=True)
    result = InitResult(dist.get_rank(), dist.get_world_size(), local_rank, backend,
                        info.launcher if info else "init_method",
                        local_size if local_size is not None else 1)
    export_torchrun_env({"RANK": result.rank, "LOCAL_RANK": result.local_rank, "WORLD_SIZE": result.world_size,
                         "LOCAL_WORLD_SIZE": local_size, "MASTER_ADDR": addr, "MASTER_PORT": port},
                        f"init_process_group under {result.launcher}", result.launcher)
    return result


# [Note: the torchrun variables after init]
# Scripts written for torchrun read RANK, LOCAL_RANK, WORLD_SIZE,
# LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment, so after
# the rendezvous pydist sets them to what it found, whatever the launcher
# (child processes inherit them). A variable already set to another value is
# never overwritten: that is a stale or wrong variable, and the error names
# both values -- unless pydist set it itself, earlier in this process (a group
# destroyed and created again gets a new MASTER_PORT under MPI). Unknown values
# (MASTER_* under torch's own MPI backend) are left alone. The launcher they
# came from is recorded in PYDIST_TORCHRUN_ENV_FROM, so ``detect()`` keeps
# reading the real launcher rather than taking them for a torchrun launch.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_exported: dict[str, str] = {}  # what this process last set, by export_torchrun_env


def export_torchrun_env(values: dict, where: str, launcher: str | None = None) -> None:
    """Set the torchrun variables; see [Note: the torchrun variables after init]."""
    values = {k: str(v) for k, v in values.items() if v is not None}
    conflicts = [f"{k}={os.environ[k]!r} is set but pydist found {k}={v!r}" for k, v in values.items()
                 if k in os.environ and os.environ[k] != v and _exported.get(k) != os.environ[k]]
    if conflicts:
        raise LauncherConflict(
            f"{where}: {'; '.join(conflicts)}. pydist does not overwrite a variable that contradicts the launcher: "
            "unset it (it is probably left over from another launch)"
        )
    os.environ.update(values)
    _exported.update(values)
    if launcher not in (None, "torchrun", "init_method"):
        os.environ[EXPORTED_FROM_ENV] = launcher


# [Note: checks across hosts before gloo connects]
# Gloo listens on the address the hostname resolves to unless
# GLOO_SOCKET_IFNAME names an interface. Where /etc/hosts maps the hostname
# to 127.0.x.1 (many images do), every rank listens on loopback and the
# ranks on other hosts get "Connection refused" with no hint. And a job
# whose hosts hold different numbers of ranks is usually a launch mistake
# (a node given the wrong nproc_per_node). So before the group connects,
# every rank publishes what it sees (its host, and whether gloo would bind
# loopback, with the interface that reaches MASTER_ADDR), and every rank
# reads all of them: all raise at once, naming the hosts, instead of some
# waiting for the timeout.
def check_hosts(store, rank: int, world_size: int, backend: str, master_addr: str | None,
                timeout: datetime.timedelta) -> None:
    """See [Note: checks across hosts before gloo connects]; raises RendezvousError."""
    host = socket.gethostname()
    loopback = ""
    if "gloo" in backend and not os.environ.get("GLOO_SOCKET_IFNAME"):
        try:
            resolved = socket.gethostbyname(host)
        except OSError:
            resolved = ""
        if resolved.startswith("127."):
            iface, source = _interface_towards(master_addr)
            loopback = f"{resolved}|{iface}|{source}"
    store.set(f"host/{rank}", f"{host}|{loopback}")
    keys = [f"host/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    seen = [store.get(k).decode().split("|", 1) for k in keys]
    hosts: dict[str, list[int]] = {}
    for r, (name, _) in enumerate(seen):
        hosts.setdefault(name, []).append(r)
    if len(hosts) < 2:
        return  # one host: loopback is where the peers are
    bad = [(r, name, how.split("|")) for r, (name, how) in enumerate(seen) if how]
    if bad:
        per_host = {name: (resolved, iface, source) for _, name, (resolved, iface, source) in bad}
        names = sorted({iface for _, iface, _ in per_host.values()})
        use = (f"GLOO_SOCKET_IFNAME={names[0]}" if len(names) == 1 and names[0]
               else "GLOO_SOCKET_IFNAME=<each host's interface on the job's network>")
        found = ", ".join(f"{name}: {resolved} -> use {iface or '?'}{f' ({source})' if source else ''}"
                          for name, (resolved, iface, source) in sorted(per_host.items()))
        raise RendezvousError(
            f"rank {rank}: hostnames resolve to loopback ({found}), so gloo would listen on loopback and the ranks "
            f"on the other hosts could not connect ('Connection refused'). Set {use} in every rank's environment "
            "(the interface that reaches the other hosts; `ip -br addr` lists them), or make each hostname resolve "
            "to its host's address on the job's network (/etc/hosts)"
        )
    if len({len(ranks) for ranks in hosts.values()}) > 1:
        listing = ", ".join(f"{name} has {len(ranks)} ({', '.join(map(str, ranks))})" for name, ranks in hosts.items())
        raise RendezvousError(
            f"rank {rank}: the hosts run different numbers of ranks: {listing}. Start the same number on every "
            "host (torchrun --nproc_per_node, srun --ntasks-per-node, mpirun -ppn)"
        )


def _interface_towards(addr: str | None) -> tuple[str, str]:
    """(interface name, its address) this host would use to reach ``addr``; ("", "") if unknown."""
    import fcntl
    import struct

    try:
        addresses = {}  # interface -> its IPv4 address
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue
                addresses[name] = socket.inet_ntoa(packed[20:24])
        source = ""
        if addr:
            target = socket.gethostbyname(addr)
            if not target.startswith("127."):  # MASTER_ADDR names this host by loopback on the master itself
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                    probe.connect((target, 9))  # UDP: no packet is sent, the kernel only picks the route
                    source = probe.getsockname()[0]
        for name, address in addresses.items():
            if (address == source) if source else not address.startswith("127."):
                return name, address
        return "", source
    except OSError:
        return "", ""


def _count_local_ranks(store, world_size: int) -> int:
    """Ranks on this host, from the hosts the ranks recorded when they checked in."""
    keys = [f"claimed/{r}/1" for r in range(world_size)]
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    host = socket.gethostname()
    return sum(1 for v in values if v.decode().rsplit(" pid ", 1)[0] == host)


# [Note: one key space per attempt]
# The store can outlive this call: torchrun's agent keeps its store across
# worker restarts, and a script may destroy and re-create its group. Keys are
# prefixed by the restart count and a per-process attempt number, so arrivals
# of an earlier attempt are never counted for this one.

# [Note: exit cleanly under mpiexec]
# A script that never calls destroy_process_group leaves its groups to be torn
# down during interpreter shutdown. Seen under mpiexec (backtrace in gdb): a
# gloo worker thread ("pt_gloo_runloop") frees its last finished work object
# *after* the caller saw it complete; freeing it drops Python tensors, which
# needs the GIL; if the interpreter is finalizing by then, CPython ends the
# thread with a forced unwind through a noexcept destructor, and
# std::terminate aborts the process ("terminate called without an active
# exception"), so mpiexec reports a failed job although the script succeeded.
# destroy_process_group alone does not help while the script still holds a
# group: gloo stops its threads only when the group object dies. So at exit,
# while Python is still fully alive: destroy every group (this also stops the
# mpi4py backend's MPI threads before mpi4py finalizes MPI, which runs after
# all atexit handlers), then release the GIL for EXIT_GRACE_S so the worker
# threads can drop what they hold.
EXIT_GRACE_S = 0.1
_registered = False


def _destroy_at_exit() -> None:
    global _registered
    if not _registered:
        atexit.register(_destroy_all)
        _registered = True


def _destroy_all() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    backend_module = sys.modules.get("pydist.backends.mpi4py_backend")
    if backend_module is not None:  # stop MPI threads of groups never destroyed; abort if one is stuck
        backend_module.finish_at_exit()
    time.sleep(EXIT_GRACE_S)  # See [Note: exit cleanly under mpiexec]
