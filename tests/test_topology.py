"""pydist.topology on one host (no root needed): every rank of a local job
sees every other's probe, so the job is one host, and no probe is left in
/dev/shm. The multi-host cases run on the emulated cluster (tests/cluster)."""

import os

import pytest

from pydist.spawn import run_ranks


def _topology(rank, world_size):
    import socket

    import torch.distributed as dist

    from pydist import topology

    before = sorted(os.listdir("/dev/shm"))
    topo = topology.of()
    again = topology.of()
    dist.barrier()
    probes = [n for n in os.listdir("/dev/shm") if "probe" in n and str(os.getpid()) in n]
    return {"describe": topo.describe(), "cached": again is topo, "hosts": topo.hosts, "local_rank": topo.local_rank,
            "groups": (topo.local_group, topo.cross_group), "probes": probes, "host": socket.gethostname()}


@pytest.mark.timeout(60)
def test_one_host_is_one_host():
    results = run_ranks(_topology, 2, timeout=50)
    for rank, r in enumerate(results):
        assert r["hosts"] == ((0, 1),)
        assert r["describe"] == f"1 host x 2 ranks: {r['host']} (ranks 0, 1)"
        assert r["cached"] and r["local_rank"] == rank
        assert r["groups"] == (None, None)  # one host: no subgroups are made
        assert r["probes"] == []
