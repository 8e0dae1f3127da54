"""Priority on the link under overlap_optimizer: the chunks the next forward
needs first go over the link first ([Note: transfer priority] in
csrc/transport/transport.h, [Note: the link's queue] in
csrc/transport/sim_net_transport.cpp).

Each spawned rank trains stock torch DDP + an optimizer and pydist's DDP
with ``overlap_optimizer`` over a simulated link slow enough that most
buckets are still queued when backward ends (so the order on the link is a
choice the link makes), and checks:

- results bitwise torch's (losses, parameters, optimizer state): the link
  reorders only when each collective is modelled to complete, never the
  collectives themselves;
- overtaking: a chunk launched later (a front layer's) completed before a
  chunk launched earlier (a back layer's) that was still queued, per the
  reducer's own stamps, and the link counted the overtakes;
- the front layers' update first: their bucket, launched last, was updated
  before the all-reduces of the back layers' buckets queued with it had
  completed (the update records against the reducer's stamps);
- plain DDP on the same link (no overlap_optimizer, no priorities): the
  same link is first in, first out, with no overtake;
- the link's queue itself, on pieces launched from Python with
  ``priority=``: an urgent piece launched last overtakes the waiting ones
  but not the one on the link, and a cap on bytes in flight that commits
  every piece at launch leaves nothing to overtake.

The updates-after-their-all-reduce invariant is checked by
test_overlap_optimizer.py's test_updates_follow_allreduce_and_precede_forward,
whose parity runs also go over a prioritizing link now.
"""

from __future__ import annotations

import time

import pytest

from pydist.spawn import run_ranks

# 125 KB/s: a ~1.2 KB bucket takes ~10 ms on the link, the step's six
# buckets ~50 ms, well past backward (~1 ms, but a rank of this loaded
# machine is now and then descheduled for several ms): they queue.
QUEUED_LINK = "0.001Gbps,100us"
OVERTAKE_MARGIN_MS = 2.0


def _priority_ranks(rank, world_size):
    import test_overlap_optimizer as base

    base.SLOW_LINK = QUEUED_LINK  # this spawned process only
    run = base.Run(optimizer="adamw", steps=6)

    def record(ddp):
        ddp.set_record_timing(True, keep=64)

    reference = base._train("torch", run, rank)
    overlapped = base._train("overlap", run, rank, record=record)
    ddp = overlapped.pop("ddp")
    out = {"parity": None, "overtakes": [], "front_update": [], "stats": ddp.reducer.transport.stats()}
    try:
        base._assert_same(reference, overlapped, exact=True, what="overlap_optimizer on a prioritizing link vs torch")
    except AssertionError as error:
        out["parity"] = str(error)

    num_buckets = len(ddp.bucket_indices())
    reduced = {r.iteration: r for r in ddp.iteration_records()}
    for upd in ddp.update_records():
        it = reduced.get(upd.step)
        if it is None or len(it.buckets) != num_buckets:
            continue  # before the one-time bucket rebuild
        # Chunks in launch order, with their completion stamps (ms since the iteration was armed).
        chunks = [(c.launch_ms, c.complete_ms, b.index) for b in it.buckets for c in b.chunks]
        # A chunk launched later that completed well before an earlier-launched one (by more
        # than a late wake of the link's timer thread): an overtake.
        overtaken = [(early[2], late[2]) for i, early in enumerate(chunks) for late in chunks[i + 1:]
                     if late[0] > early[0] and late[1] < early[1] - OVERTAKE_MARGIN_MS]
        out["overtakes"].append(overtaken)
        # Buckets whose all-reduce had not completed when backward ended: queued on the link
        # together. When the front layers' bucket (the last launched) was updated, and when
        # each of the others' all-reduce completed, on one clock (ns).
        queued = [b for b in it.buckets if b.complete_ms > it.backward_end_ms]
        front = max(b.index for b in it.buckets)
        updated = {b.index: upd.start_ns + b.updated_ms * 1e6 for b in upd.buckets}
        out["front_update"].append((front, updated[front],
                                    {b.index: it.start_ns + b.complete_ms * 1e6 for b in queued if b.index != front}))
    return out


def _fifo_ranks(rank, world_size):
    import test_overlap_optimizer as base

    base.SLOW_LINK = QUEUED_LINK
    run = base.Run(optimizer="adamw", steps=4)

    def record(ddp):
        ddp.set_record_timing(True, keep=64)

    plain = base._train("pydist", run, rank, record=record)
    ddp = plain.pop("ddp")
    orders = []
    for it in ddp.iteration_records():
        chunks = sorted((c.launch_ms, c.complete_ms) for b in it.buckets for c in b.chunks)
        orders.append([c[1] for c in chunks])
    return {"completions_in_launch_order": orders, "stats": ddp.reducer.transport.stats()}


def _front_updated_first(front, updated_ns, queued_complete_ns) -> bool:
    """Whether the front layers' bucket was updated before the all-reduce of
    every other bucket queued with it completed, but for one: the transfer
    the link had already committed when the front chunk arrived. On a
    first-in-first-out link the front bucket lands after all of them."""
    later = [b for b, done in queued_complete_ns.items() if done > updated_ns]
    return len(queued_complete_ns) >= 2 and len(later) >= len(queued_complete_ns) - 1


# [Note: what the priority tests assert of each step]
# Each rank's link decides from its own launches (counted exactly:
# sim_net_overtakes), but a collective completes at max(that rank's modelled
# end, the inner collective's completion), and the inner one completes only
# once the other rank launched it too. On this shared 2-core machine a rank
# is now and then descheduled for longer than a bucket's time on the link,
# and then that step's completions follow the other rank's launches, in
# launch order. So the records are required to show the priority order in
# at least one step, which a first-in-first-out link never does (its
# completions are in launch order: the plain DDP test), not in every step.
@pytest.mark.timeout(90)
def test_front_chunks_overtake_and_update_first():
    for result in run_ranks(_priority_ranks, 2, timeout=75):
        assert result["parity"] is None, result["parity"]
        steps = len(result["overtakes"])
        assert steps >= 4, result
        # every step has several chunks waiting at once: the link commits the latest launched first
        assert result["stats"]["sim_net_overtakes"] >= steps, result["stats"]
        assert any(result["overtakes"]), \
            f"no step shows a chunk launched later completing before a queued earlier one: {result['overtakes']}"
        assert any(_front_updated_first(*step) for step in result["front_update"]), \
            f"no step shows the front layers' update landing before the queued back layers' all-reduces: " \
            f"{result['front_update']}"


@pytest.mark.timeout(60)
def test_plain_ddp_link_stays_first_in_first_out():
    for result in run_ranks(_fifo_ranks, 2, timeout=45):
        assert result["stats"]["sim_net_overtakes"] == 0, result["stats"]
        for completions in result["completions_in_launch_order"]:
            # in launch order, up to a late wake of the link's timer thread on a loaded machine
            assert all(b >= a - 2.0 for a, b in zip(completions, completions[1:])), completions


def _link_queue_ranks(rank, world_size):
    """Four pieces launched back to back on a sim_net link, the last one
    urgent: the order they complete in, under a cap of one transfer and
    under a cap that commits them all at launch."""
    import torch
    import torch.distributed as dist

    from pydist import transport

    inner = transport.ProcessGroupTransport(dist.group.WORLD)
    numel = 25_000  # 100 KB: at 40 Mb/s its all-reduce over 2 ranks takes 20 ms
    bandwidth = 40e6
    out = {"errors": {}}
    for name, options in (("inflight_bytes", {"inflight_bytes": -1.0}), ("whole", {"inflight_bytes": 0.5})):
        try:
            transport.wrap("sim_net", inner, bandwidth=bandwidth, latency=0.0, **options)
            out["errors"][name] = None
        except RuntimeError as error:
            out["errors"][name] = str(error)
    for cap in (0, 10 * numel * 4):
        link = transport.wrap("sim_net", inner, bandwidth=bandwidth, latency=0.0, inflight_bytes=cap)
        pieces = [torch.full((numel,), float(rank + 10 * i)) for i in range(4)]
        dist.barrier()
        futures = [link.all_reduce(p, priority=9 if i == 3 else 0) for i, p in enumerate(pieces)]
        done = [f.wait() for f in futures]
        out[cap] = {"order": sorted(range(4), key=lambda i: done[i]), "overtakes": link.stats()["sim_net_overtakes"],
                    "sums": all(torch.equal(p, torch.full((numel,), float(1 + 20 * i))) for i, p in enumerate(pieces))}
    return out


@pytest.mark.timeout(60)
def test_link_queue_priority_and_cap():
    for result in run_ranks(_link_queue_ranks, 2, timeout=45):
        assert "inflight_bytes must be" in result["errors"]["inflight_bytes"], result["errors"]
        assert "inflight_bytes must be" in result["errors"]["whole"], result["errors"]
        one_at_a_time, all_committed = result[0], result[10 * 25_000 * 4]
        # the first is on the link at once; the urgent last one overtakes the two waiting
        assert one_at_a_time["order"] == [0, 3, 1, 2], one_at_a_time
        assert one_at_a_time["overtakes"] == 1, one_at_a_time
        # a cap that commits every piece at launch leaves nothing to overtake: launch order
        assert all_committed["order"] == [0, 1, 2, 3], all_committed
        assert all_committed["overtakes"] == 0, all_committed
        assert one_at_a_time["sums"] and all_committed["sums"]  # the results are the inner collective's


def _update_threads_ranks(rank, world_size):
    """updates="worker" and updates="forward" ([Note: which thread updates]),
    each bitwise torch DDP + the optimizer, with no_sync and BatchNorm
    buffers, each update applied by the thread asked for (the forward may
    take over from the worker the buckets it needs first)."""
    import test_overlap_optimizer as base
    import torch

    from pydist import DistributedDataParallel
    from pydist.ddp.overlap_optimizer import choose_update_thread

    out = {"auto": [choose_update_thread(cores, ranks) for cores, ranks in ((2, 2), (3, 2), (4, 2), (16, 1))]}
    model = DistributedDataParallel(base.Net())
    try:
        model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), updates="threads")
        out["refused"] = None
    except ValueError as error:
        out["refused"] = str(error)
    base.SLOW_LINK = QUEUED_LINK
    reference = base._train("torch", base.Run(optimizer="adam_foreach", steps=5, micro=2, bn=True), rank)
    for updates in ("worker", "forward"):
        run = base.Run(optimizer="adam_foreach", steps=5, micro=2, bn=True, updates=updates)
        overlapped = base._train("overlap", run, rank, record=lambda ddp: ddp.set_record_timing(True, keep=64))
        ddp = overlapped.pop("ddp")
        try:
            base._assert_same(reference, overlapped, exact=True, what=f"updates={updates!r} vs torch")
            out[f"{updates}_parity"] = None
        except AssertionError as error:
            out[f"{updates}_parity"] = str(error)
        out[f"{updates}_threads"] = sorted({b.thread for r in ddp.update_records() for b in r.buckets})
    return out


# Backward sleeps this long between the back layers' gradients and the
# front layers' ones: on QUEUED_LINK (~10 ms a bucket) some back buckets
# land meanwhile, and the front bucket, launched last, is still behind a
# transfer the link committed when the next forward starts.
SLOW_BACKWARD_S = 0.04


def _work_while_waiting_ranks(rank, world_size):
    """updates="forward" updates the buckets that landed while the one the
    next forward needs first is still in flight: [Note: the forward updates
    what has landed]."""
    import test_overlap_optimizer as base
    import torch
    import torch.nn.functional as F

    from pydist import DistributedDataParallel

    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(SLOW_BACKWARD_S)
            return grad

    class SlowFront(base.Net):  # the sleep sits after the first block: its backward runs late
        def forward(self, x):
            h = torch.tanh(self.inp(x))
            for i, block in enumerate(self.blocks):
                h = torch.tanh(block(h))
                if i == 0:
                    h = SlowBackward.apply(h)
            return self.out(h)

    torch.manual_seed(0)
    ddp = DistributedDataParallel(SlowFront(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.001, sim_net=QUEUED_LINK)
    ddp.set_record_timing(True, keep=64)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    ddp.overlap_optimizer(opt, updates="forward")
    for step in range(5):
        opt.zero_grad()
        x, y = base._batch(rank, step, 0)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    ddp.wait_updates()
    return {"steps": _updated_before_front_landed(ddp), "report": ddp.update_records()[-2].report()}


@pytest.mark.timeout(60)
def test_forward_updates_landed_buckets_while_front_in_flight():
    for result in run_ranks(_work_while_waiting_ranks, 2, timeout=45):
        assert len(result["steps"]) >= 2, result
        assert any(result["steps"]), \
            "no step shows the forward updating a landed bucket before the front bucket landed:\n" + result["report"]


def _updated_before_front_landed(ddp) -> list[bool]:
    """Per step after the bucket rebuild: whether some bucket's update began
    before the front layers' bucket (the one the next forward needs first)
    had landed, on the clock of the reducer's records. updates="forward"
    does so whenever a bucket landed before the front one: [Note: the
    forward updates what has landed]; a forward that waited for the front
    bucket first never does."""
    reduced = {r.iteration: r for r in ddp.iteration_records()}
    steps = []
    for upd in ddp.update_records():
        it = reduced.get(upd.step)
        if it is None or len(it.buckets) != len(upd.buckets) or len(upd.buckets) < 2:
            continue
        front = max(b.index for b in it.buckets)
        front_landed = it.start_ns + next(b.complete_ms for b in it.buckets if b.index == front) * 1e6
        steps.append(any(upd.start_ns + b.update_start_ms * 1e6 < front_landed
                         for b in upd.buckets if b.index != front))
    return steps


@pytest.mark.timeout(60)
def test_each_update_thread_bitwise():
    for result in run_ranks(_update_threads_ranks, 2, timeout=45):
        assert "updates='threads'" in result["refused"] and "'worker', 'forward'" in result["refused"], result
        assert result["auto"] == ["forward", "forward", "worker", "worker"], result["auto"]
        assert result["worker_parity"] is None, result["worker_parity"]
        assert result["forward_parity"] is None, result["forward_parity"]
        assert "worker" in result["worker_threads"], result["worker_threads"]
        assert result["forward_threads"] == ["forward"], result["forward_threads"]



# --- priority on a real link: the "ordered" wrapper ([Note: ordering a real link]) ---


def _ordered_queue_ranks(rank, world_size):
    """Five pieces launched back to back through the "ordered" wrapper in
    front of a slow first-in-first-out link (sim_net committing every
    transfer at launch, so it never reorders: a stand-in for gloo on a slow
    wire), with priorities 0, 1, 5, 3, 5: the order they complete in, the
    sums, and the leader's counters; under a cap of one collective and under
    one that commits them all at launch."""
    import torch
    import torch.distributed as dist

    from pydist import transport

    numel = 12_500  # 50 KB: at 40 Mb/s its all-reduce takes 10-13 ms
    fifo = transport.wrap("sim_net", transport.ProcessGroupTransport(dist.group.WORLD), bandwidth=40e6, latency=0.0,
                          inflight_bytes=1e9)
    out = {"errors": {}}
    for name, make in (("option", lambda: transport.wrap("ordered", fifo, bandwidth=1.0)),
                       ("cap", lambda: transport.wrap("ordered", fifo, inflight_bytes=-1.0)),
                       ("reduce_scatter", lambda: transport.wrap("ordered", fifo).reduce_scatter(
                           torch.zeros(2 * world_size), torch.zeros(2)))):
        try:
            make()
            out["errors"][name] = None
        except RuntimeError as error:
            out["errors"][name] = str(error)
    priorities = [0, 1, 5, 3, 5]
    for cap in (0, 10 * numel * 4):
        ordered = transport.wrap("ordered", fifo, inflight_bytes=cap)
        pieces = [torch.full((numel,), float(rank + 10 * i)) for i in range(len(priorities))]
        dist.barrier()
        futures = [ordered.all_reduce(p, priority=q) for p, q in zip(pieces, priorities)]
        done = [f.wait() for f in futures]
        base = sum(range(world_size))
        out[cap] = {"order": sorted(range(len(pieces)), key=lambda i: done[i]), "stats": ordered.stats(),
                    "name": ordered.name, "orders": ordered.orders_by_priority,
                    "sums": all(torch.equal(p, torch.full((numel,), float(base + 10 * i * world_size)))
                                for i, p in enumerate(pieces))}
        del ordered  # the leader commits nothing more: every launch was decided
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.timeout(60)
def test_ordered_transport_commits_the_most_urgent_first(world_size):
    for rank, result in enumerate(run_ranks(_ordered_queue_ranks, world_size, timeout=45)):
        assert "takes only inflight_bytes" in result["errors"]["option"], result["errors"]
        assert "inflight_bytes must be" in result["errors"]["cap"], result["errors"]
        assert "orders all-reduces only" in result["errors"]["reduce_scatter"], result["errors"]
        one_at_a_time, all_committed = result[0], result[10 * 12_500 * 4]
        assert one_at_a_time["name"] == "ordered(sim_net(gloo))" and one_at_a_time["orders"], one_at_a_time
        assert one_at_a_time["sums"] and all_committed["sums"], f"rank {rank}: a sum is not the exact one"
        # the first goes at once; of the four waiting, 5 (launched 2nd of them), 5, 3, 1, on every rank
        assert one_at_a_time["order"] == [0, 2, 4, 3, 1], (rank, one_at_a_time)
        # a cap that commits each at launch leaves nothing to overtake: launch order
        assert all_committed["order"] == [0, 1, 2, 3, 4], (rank, all_committed)
        if rank == 0:  # the leader's counters
            assert one_at_a_time["stats"]["ordered_commits"] == 5, one_at_a_time["stats"]
            assert one_at_a_time["stats"]["ordered_overtakes"] == 3, one_at_a_time["stats"]
            assert all_committed["stats"]["ordered_overtakes"] == 0, all_committed["stats"]


def _ordered_ddp_ranks(rank, world_size):
    """overlap_optimizer with no simulated link, on one host: the policy
    leaves the shared-memory transport as it is ([Note: priority on every
    link]: the wrapper goes in front only where gradients cross hosts,
    tests/cluster). With the "ordered" wrapper put in front by hand (two
    chunks of credit, as across hosts), results bitwise torch DDP + AdamW,
    with BatchNorm buffers and unused parameters, every chunk decided by
    rank 0."""
    import test_overlap_optimizer as base

    from pydist import transport

    base.SLOW_LINK = None  # this spawned process only
    out = {}
    run = base.Run(optimizer="adamw", steps=6, branch=True, bn=True)
    reference = base._train("torch", run, rank)

    def ordered(ddp):
        out["policy"] = ddp.reducer.transport.name
        ddp.reducer.set_transport(transport.wrap("ordered", ddp.reducer.transport, inflight_bytes=2 * 1024))

    overlapped = base._train("overlap", run, rank, record=ordered)
    ddp = overlapped.pop("ddp")
    try:
        base._assert_same(reference, overlapped, exact=True, what="overlap_optimizer through 'ordered' vs torch")
        out["parity"] = None
    except AssertionError as error:
        out["parity"] = str(error)
    out["attached"] = ddp.reducer.transport.name
    out["stats"] = ddp.reducer.transport.stats()
    return out


@pytest.mark.timeout(90)
def test_ordered_transport_under_overlap_optimizer_is_bitwise_torch():
    for rank, result in enumerate(run_ranks(_ordered_ddp_ranks, 2, timeout=75)):
        assert result["parity"] is None, result["parity"]
        assert result["policy"] == "shm", result  # one host: left first in, first out
        assert result["attached"] == "ordered(shm)", result
        if rank == 0:  # the leader decided every chunk: several per step
            assert result["stats"]["ordered_commits"] >= 6 * 2, result["stats"]


def _ordered_peer_gone_ranks(rank, world_size, leaving):
    """Rank ``leaving`` leaves without launching anything; the other
    launches an all-reduce through the "ordered" wrapper over gloo and must
    get inner's error (the leader's data or decision, or a follower's
    request for a decision), not wait forever."""
    import torch
    import torch.distributed as dist

    from pydist import transport

    if rank == leaving:
        return None
    ordered = transport.wrap("ordered", transport.ProcessGroupTransport(dist.group.WORLD))
    start = time.monotonic()
    try:
        ordered.all_reduce(torch.ones(4), priority=1).wait()
        error = None
    except RuntimeError as failure:
        error = str(failure)
    return {"error": error, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("leaving", [0, 1], ids=["leader_leaves", "follower_leaves"])
@pytest.mark.timeout(60)
def test_ordered_transport_fails_when_a_peer_is_gone(leaving):
    results = run_ranks(_ordered_peer_gone_ranks, 2, args=(leaving,), timeout=20)
    result = results[1 - leaving]
    assert result["error"] is not None, result
    assert result["seconds"] < 20, result
