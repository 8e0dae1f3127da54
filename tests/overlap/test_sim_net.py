"""The simulated network (csrc/transport/sim_net_transport.cpp, [Note:
simulated network]) in front of both transports DDP's gradients use.

Bounds, against the Python oracle pydist.overlap.model_seconds:
  lower: a collective never completes before launch + the model's time
         (exact: no tolerance), and pieces launched together queue on the
         link (the k-th completes no earlier than launch + k model times);
  upper: it completes within UPPER_SLACK_S of launch + the model's time.
         Generous on purpose: the machine is shared and loaded, a timer
         thread may wake late, and the inner transport's own time counts.
The launch does not block the caller, and results are bitwise those of the
transport behind it (integer-valued floats: exact sums).
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from pydist.spawn import run_ranks

LINK = "0.5Gbps,100us"
UPPER_SLACK_S = 0.060  # 60 ms past the model's completion: see the module comment
NUMEL = (2 << 20) // 4  # 2 MiB of float32: 33.6 ms for a 2-rank all-reduce on LINK


def _ints(n, rank, salt=0):
    return ((torch.arange(n) * 7 + rank * 3 + salt) % 23 - 11).float()


def test_parse_and_model():
    from pydist.overlap import Link, model_seconds, parse_link

    assert parse_link("10Gbps,20us") == Link(10e9, 20e-6)
    assert parse_link("1 Gb/s, 5ms") == Link(1e9, 5e-3)
    assert parse_link("100Mbps") == Link(100e6, 0.0)
    with pytest.raises(ValueError, match="cannot read the bandwidth '10 parsecs'"):
        parse_link("10 parsecs,20us")
    # ring all-reduce: 2(n-1) latencies + 2(n-1)/n of the bytes; RS/AG: half that
    assert model_seconds("all_reduce", 10**9, 4, "8Gbps,1ms") == pytest.approx(6e-3 + 1.5)
    assert model_seconds("reduce_scatter", 10**9, 4, "8Gbps,1ms") == pytest.approx(3e-3 + 0.75)
    assert model_seconds("all_gather", 10**9, 1, "8Gbps,1ms") == 0.0


def test_options_are_checked():
    from pydist import transport

    shm = transport.ShmTransport("/pydist-test-simnet-options", 0, 1, create=True, timeout_s=5)
    try:
        with pytest.raises(RuntimeError, match="option 'latency' is required"):
            transport.wrap("sim_net", shm, bandwidth=1e9)
        with pytest.raises(RuntimeError, match="unknown option 'jitter'"):
            transport.wrap("sim_net", shm, bandwidth=1e9, latency=0, jitter=1)
        with pytest.raises(RuntimeError, match="bandwidth must be > 0"):
            transport.wrap("sim_net", shm, bandwidth=0, latency=0)
        t = transport.wrap("sim_net", shm, bandwidth=1e9, latency=1e-3)
        assert t.name == "sim_net(shm)"
        x = torch.arange(5.0)
        t.all_reduce(x).wait()  # one rank: the model's time is 0
        assert torch.equal(x, torch.arange(5.0))
    finally:
        shm.unlink()


def _timed(fn):
    dist.barrier()
    start = time.monotonic_ns()
    future = fn()
    returned = time.monotonic_ns()
    early = future.done()
    completed = future.wait()
    waited = time.monotonic_ns()
    return start, returned, early, completed, waited


def _bounds_on(rank, world_size, kind):
    from pydist import overlap, transport

    inner = transport.open_shm(dist.group.WORLD) if kind == "shm" else transport.ProcessGroupTransport(dist.group.WORLD)
    t = overlap.sim_net(inner, LINK)
    assert t.name == f"sim_net({inner.name})"
    out = {}

    def check(name, collective, nbytes, launch):
        model_ns = overlap.model_seconds(collective, nbytes, world_size, LINK) * 1e9
        start, returned, early, completed, waited = _timed(launch)
        assert returned - start < model_ns / 2, f"{name}: the launch blocked for {(returned - start) / 1e6:.1f} ms"
        assert not early, f"{name}: done right after launch, the model needs {model_ns / 1e6:.1f} ms"
        assert completed >= start + model_ns, f"{name}: completed {(completed - start) / 1e6:.2f} ms after launch < model {model_ns / 1e6:.2f} ms"
        assert waited >= start + model_ns
        late = (completed - start - model_ns) / 1e9
        assert late <= UPPER_SLACK_S, f"{name}: completed {late * 1e3:.1f} ms after the model's time"
        out[name] = late

    x = _ints(NUMEL, rank)
    check("all_reduce", "all_reduce", x.nbytes, lambda: t.all_reduce(x, 0.5))
    exact = sum(_ints(NUMEL, r) for r in range(world_size)) * 0.5
    assert torch.equal(x, exact)
    plain = _ints(NUMEL, rank)
    inner.all_reduce(plain, 0.5).wait()
    assert torch.equal(x, plain), "sim_net changed the all-reduce's result"

    flat = _ints(NUMEL * world_size, rank, salt=1)
    mine = torch.empty(NUMEL)
    check("reduce_scatter", "reduce_scatter", flat.nbytes, lambda: t.reduce_scatter(flat, mine))
    expected = torch.empty(NUMEL)
    inner.reduce_scatter(flat, expected).wait()
    assert torch.equal(mine, expected)

    shard = _ints(NUMEL, rank, salt=2)
    gathered = torch.empty(NUMEL * world_size)
    check("all_gather", "all_gather", gathered.nbytes, lambda: t.all_gather(shard, gathered))
    assert torch.equal(gathered, torch.cat([_ints(NUMEL, r, salt=2) for r in range(world_size)]))

    # Pieces launched together share the link: the k-th (from 1) completes
    # no earlier than launch + k model times.
    pieces = [_ints(NUMEL // 4, rank, salt=3 + i) for i in range(4)]
    one = overlap.model_seconds("all_reduce", pieces[0].nbytes, world_size, LINK) * 1e9
    dist.barrier()
    start = time.monotonic_ns()
    futures = [t.all_reduce(p) for p in pieces]
    times = [f.wait() for f in futures]
    for k, done in enumerate(times, 1):
        assert done >= start + k * one, f"piece {k}: {(done - start) / 1e6:.2f} ms < {k} x {one / 1e6:.2f} ms"
    assert (times[-1] - start - 4 * one) / 1e9 <= UPPER_SLACK_S
    for i, p in enumerate(pieces):
        assert torch.equal(p, sum(_ints(NUMEL // 4, r, salt=3 + i) for r in range(world_size)))
    stats = t.stats()
    assert stats["sim_net_calls"] == 7
    dist.barrier()
    return out


def _both_transports(rank, world_size):
    return {kind: _bounds_on(rank, world_size, kind) for kind in ("shm", "process_group")}


@pytest.mark.timeout(120)
def test_bounds_and_bitwise_results_on_both_transports():
    lateness = run_ranks(_both_transports, 2, timeout=100)
    for rank, per_kind in enumerate(lateness):
        assert set(per_kind) == {"shm", "process_group"}


def _ddp_under_sim_net(rank, world_size):
    """DDP with sim_net= and with PYDIST_SIM_NET, on shm and on the group:
    gradients bitwise those of a plain DDP; the step's communication spans
    at least the model's time for every chunk, one after the other."""
    from pydist import DistributedDataParallel as DDP
    from pydist import overlap, transport

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(rank))
    names = {}
    for kind in ("shm", "process_group"):
        reference = DDP(_copy(model), shm_allreduce=(kind == "shm"))
        for how in ("keyword", "env"):
            if how == "env":
                os.environ["PYDIST_SIM_NET"] = "1Gbps,50us"
                ddp = DDP(_copy(model), shm_allreduce=(kind == "shm"), allreduce_chunk_mb=0.25, record_timing=True)
                del os.environ["PYDIST_SIM_NET"]
            else:
                ddp = DDP(_copy(model), shm_allreduce=(kind == "shm"), allreduce_chunk_mb=0.25, record_timing=True,
                          sim_net="1Gbps,50us")
            names[(kind, how)] = transport.transport_of(ddp).name
            for _ in range(3):  # the buckets are rebuilt after the first
                for m in (ddp, reference):
                    m.zero_grad()
                    m(x).square().sum().backward()
                for (n, p), q in zip(ddp.module.named_parameters(), reference.module.parameters()):
                    assert torch.equal(p.grad, q.grad), f"{kind}/{how}: {n}.grad differs from plain DDP's"
            stats = transport.transport_of(ddp).stats()
            rec = ddp.last_iteration_record()
            span_ms = max(b.complete_ms for b in rec.buckets) - min(b.launch_ms for b in rec.buckets)
            chunks = stats["sim_net_calls"] // 3
            grad_bytes = sum(p.numel() * 4 for p in model.parameters())
            model_ms = 1e3 * (overlap.model_seconds("all_reduce", grad_bytes, world_size, "1Gbps,0us")
                              + chunks * 2 * (world_size - 1) * 50e-6)
            assert span_ms >= model_ms * 0.999, f"{kind}/{how}: step communication {span_ms:.2f} ms < model {model_ms:.2f} ms"
    dist.barrier()
    return names


def _copy(model):
    import copy

    return copy.deepcopy(model)


@pytest.mark.timeout(120)
def test_ddp_gradients_bitwise_under_sim_net_on_both_transports():
    names = run_ranks(_ddp_under_sim_net, 2, timeout=100)[0]
    assert names == {
        ("shm", "keyword"): "sim_net(shm)", ("shm", "env"): "sim_net(shm)",
        ("process_group", "keyword"): "sim_net(gloo)", ("process_group", "env"): "sim_net(gloo)",
    }


_FORK_SCRIPT = r"""
import os, sys, threading
import torch
from pydist import _C, transport

name = sys.argv[1]
ends = [_C.ShmTransport(name, 0, 2, create=True, timeout_s=30),
        _C.ShmTransport(name, 1, 2, create=False, timeout_s=30)]
links = [transport.wrap("sim_net", e, bandwidth=1e9, latency=0.02) for e in ends]  # 40 ms per all-reduce
xs = [torch.ones(4), torch.ones(4)]
threads = [threading.Thread(target=lambda l=l, x=x: l.all_reduce(x).wait()) for l, x in zip(links, xs)]
[t.start() for t in threads]
[t.join(20) for t in threads]
assert xs[0].tolist() == [2.0] * 4, xs  # held by the timer thread, which is now running
pid = os.fork()
if pid == 0:
    try:
        links[0].all_reduce(torch.ones(4))
        print("CHILD USED THE PARENT'S LINK")
    except RuntimeError as exc:
        print("child refused:", exc)
    sys.stdout.flush()
    sys.exit(0)  # interpreter teardown destroys the inherited links and their timer
_, status = os.waitpid(pid, 0)
print("child status", status)
"""


@pytest.mark.timeout(60)
def test_forked_child_is_refused_and_exits_cleanly():
    import subprocess
    import sys

    name = f"/pydist-test-simnet-fork-{os.getpid()}"
    out = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, name], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "child refused: sim_net: this simulated link belongs to process" in out.stdout, out.stdout + out.stderr
    assert "was forked from it" in out.stdout
    assert "child status 0" in out.stdout, out.stdout + out.stderr  # not killed by std::terminate at teardown
