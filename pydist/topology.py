"""Which ranks of a group share a host, and the groups that follow from it.

    from pydist import topology
    topo = topology.of(group)            # collective the first time per group, then cached
    print(topo.describe())               # "2 hosts x 2 ranks: node0 (ranks 0, 1), node1 (ranks 2, 3)"
    topo.hosts                           # ((0, 1), (2, 3)): group ranks per host, host order
    topo.local_group, topo.cross_group   # this rank's host, and its stream (its local index on every host)

[Note: a host is the ranks that map one segment]
Host names do not say which ranks share memory: containers on one machine
may share a name or not, and two machines may both call themselves
"localhost". So every rank writes a probe file into its /dev/shm named with
a random token, the ranks exchange the tokens, and each rank looks which of
them its own /dev/shm holds (with the right contents): ranks that see each
other's probes can map one shared segment, and that is a host here. Names
(the hostname) are only for the messages. The probes are removed before
``of`` returns, on every path (their names follow the segments' scheme, so
a set-up killed half way is swept like a segment: see shm_segment).

Hosts are ordered by their lowest rank, a host's ranks by rank. The groups
built for a topology that spans hosts with at least two ranks on one
(``spans_hosts and shares_host``):
  local groups   the ranks of each host (for the shared-memory set-up),
  cross groups   "streams": local rank l of every host, in host order (only
                 when every host has the same number of ranks);
made once per process group, in the same order on every rank.
"""

from __future__ import annotations

import os
import secrets
import socket
import weakref
from typing import NamedTuple

import torch.distributed as dist

__all__ = ["Topology", "of", "discover", "describe_world", "timeout_of", "VERBOSE_ENV"]

VERBOSE_ENV = "PYDIST_VERBOSE"  # "1": init_process_group prints the topology it found (rank 0, one line)
SHM_DIR = "/dev/shm"


class Topology(NamedTuple):
    """What ``of(group)`` found. Ranks are the group's."""

    hosts: tuple  # tuple of tuples: the group ranks on each host, hosts ordered by lowest rank
    host_names: tuple  # each host's hostname (as its lowest rank reports it)
    rank: int  # this rank in the group
    host: int  # this rank's host (index into hosts)
    local_rank: int  # this rank's index among its host's ranks
    local_group: object = None  # torch ProcessGroup of this host's ranks (None: not built)
    cross_group: object = None  # torch ProcessGroup of this rank's stream (None: not built)

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def spans_hosts(self) -> bool:
        return len(self.hosts) > 1

    @property
    def shares_host(self) -> bool:
        """At least two ranks share a host."""
        return any(len(h) > 1 for h in self.hosts)

    @property
    def uniform(self) -> bool:
        """Every host has the same number of ranks."""
        return len({len(h) for h in self.hosts}) == 1

    @property
    def local_size(self) -> int:
        return len(self.hosts[self.host])

    def host_label(self, h: int) -> str:
        ranks = self.hosts[h]
        return f"{self.host_names[h]} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"

    def describe(self) -> str:
        sizes = sorted({len(h) for h in self.hosts})
        shape = f"{len(self.hosts)} host{'s' if len(self.hosts) > 1 else ''} x {sizes[0]} rank{'s' if sizes[0] > 1 else ''}" \
            if len(sizes) == 1 else f"{len(self.hosts)} hosts of {'/'.join(str(len(h)) for h in self.hosts)} ranks"
        return f"{shape}: " + ", ".join(self.host_label(h) for h in range(len(self.hosts)))

    def uneven_hosts(self) -> str:
        """What differs when hosts have different numbers of ranks (for errors)."""
        return ", ".join(f"{self.host_names[h]} has {len(r)} ({', '.join(map(str, r))})" for h, r in enumerate(self.hosts))


_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def of(group=None, build_groups: bool = True) -> Topology:
    """The topology of ``group`` (default: the world): collective over the
    group the first time it is asked for that group, cached after. With
    ``build_groups`` the local and cross groups are made too (see the module
    docstring) where the group spans hosts and shares one."""
    group = group if group is not None else dist.group.WORLD
    found = _cache.get(group)
    if found is None or (build_groups and found.local_group is None and _wants_groups(found)):
        found = discover(group) if found is None else found
        if build_groups and _wants_groups(found):
            found = _build_groups(group, found)
        _cache[group] = found
    return found


def _wants_groups(topo: Topology) -> bool:
    return topo.spans_hosts and topo.shares_host


def discover(group=None) -> Topology:
    """Collective over ``group``: which of its ranks share a host; see
    [Note: a host is the ranks that map one segment]. Builds no group."""
    from pydist.transport.shm_segment import _pid_namespace

    group = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    token = secrets.token_hex(8)
    name = f"pydist-{_pid_namespace()}-{os.getpid()}-probe{token}"
    path = os.path.join(SHM_DIR, name)
    wrote = False
    try:
        try:
            with open(path, "w") as f:
                f.write(token)
            wrote = True
        except OSError:
            pass  # no /dev/shm here: this rank shares a host with nobody
        probes: list = [None] * size
        dist.all_gather_object(probes, (name if wrote else None, token, socket.gethostname()), group=group)
        seen = [r for r, (n, t, _) in enumerate(probes) if n is not None and _holds(os.path.join(SHM_DIR, n), t)]
        if rank not in seen:
            seen.append(rank)
        views: list = [None] * size
        dist.all_gather_object(views, sorted(seen), group=group)  # also: every rank has looked
    finally:
        if wrote:
            try:
                os.unlink(path)
            except OSError:
                pass
    # A host: ranks that see one another. Each rank's view is its host's
    # ranks; the views agree unless /dev/shm is shared one way only (a bind
    # mount), where the lowest rank's view wins and the others are alone.
    host_of: dict[int, int] = {}
    hosts: list[tuple] = []
    for r in range(size):
        if r in host_of:
            continue
        members = tuple(q for q in views[r] if q not in host_of and r in views[q])
        for q in members:
            host_of[q] = len(hosts)
        hosts.append(members)
    names = tuple(probes[h[0]][2] for h in hosts)
    mine = host_of[rank]
    return Topology(tuple(hosts), names, rank, mine, hosts[mine].index(rank))


def _holds(path: str, token: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == token
    except OSError:
        return False


def _build_groups(group, topo: Topology) -> Topology:
    """The local groups, and (every host the same size) the cross groups,
    made by every rank of ``group`` in the same order. Subgroups of the world
    are made with torch's collective ``new_group``; of another group, with
    local synchronization (only that group's ranks call it)."""
    global_ranks = dist.get_process_group_ranks(group)
    world = dist.get_world_size(group) == dist.get_world_size()
    backend, timeout = dist.get_backend(group), timeout_of(group)

    def make(ranks: tuple):
        members = [global_ranks[r] for r in ranks]
        if world:
            return dist.new_group(members, backend=backend, timeout=timeout)
        if topo.rank not in ranks:
            return None
        return dist.new_group(members, backend=backend, timeout=timeout, use_local_synchronization=True)

    local_group = cross_group = None
    for h, ranks in enumerate(topo.hosts):
        made = make(ranks)
        if h == topo.host:
            local_group = made
    if topo.uniform:
        for l in range(topo.local_size):
            made = make(tuple(host[l] for host in topo.hosts))
            if l == topo.local_rank:
                cross_group = made
    return topo._replace(local_group=local_group, cross_group=cross_group)


def new_cross_group(group, topo: Topology):
    """Collective over ``group``: a fresh group of this rank's stream (a
    subgroup of the world gets one of its own each call; of another group,
    where torch names subgroups by their ranks alone, the topology's)."""
    if dist.get_world_size(group) != dist.get_world_size():
        return topo.cross_group
    global_ranks = dist.get_process_group_ranks(group)
    backend, timeout = dist.get_backend(group), timeout_of(group)
    mine = None
    for l in range(topo.local_size):
        made = dist.new_group([global_ranks[host[l]] for host in topo.hosts], backend=backend, timeout=timeout)
        if l == topo.local_rank:
            mine = made
    return mine


def timeout_of(group):
    """The parent's timeout, which subgroups keep (torch's new_group would take its 30-minute default)."""
    from pydist.transport.shm_segment import group_timeout

    return group_timeout(group)


def describe_world() -> str:
    """One line: the world's topology (a collective on first use)."""
    return f"pydist: {of(build_groups=False).describe()}"
