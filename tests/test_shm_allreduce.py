"""The shared-memory transport's all-reduce (csrc/transport/shm_transport.h), on its own.

Sums are checked exactly: integer-valued inputs, and scales that are powers
of two, so every dtype holds the exact answer; random floats are checked
bitwise against gloo's all-reduce of the pre-scaled tensors (the arithmetic
torch's DDP does). Sizes cross the transport's piece and slice boundaries.

The failure tests run several ranks' ends in one process (each end has its
own worker thread) or in a child process, so that one rank's error message
can be read: a peer that shut its end down, a peer process that died, a peer
that never arrives (timeout), and a failure spreading to the other ranks.
"""

import multiprocessing as mp
import os
import secrets
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pydist import _C
from pydist.spawn import run_ranks

PIECE_ELEMS_F32 = (1 << 20) // 4  # kShmPieceBytes of float32
SIZES = [1, 15, 64, 1000, PIECE_ELEMS_F32, PIECE_ELEMS_F32 + 1, 3 * PIECE_ELEMS_F32 + 17]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _name() -> str:
    return f"/pydist-test-{os.getpid()}-{secrets.token_hex(4)}"


def _ints(n: int, rank: int, dtype) -> torch.Tensor:
    """Small integers (exact in every dtype, and so are their sums)."""
    return ((torch.arange(n) * 7 + rank * 3) % 23 - 11).to(dtype)


def _exact_sums(rank, world_size):
    from pydist.transport import open_shm

    shm = open_shm(dist.group.WORLD)
    checked = 0
    for dtype in DTYPES:
        for n in SIZES:
            for scale in (1.0, 0.5):
                x = _ints(n, rank, dtype)
                expected = sum(_ints(n, r, torch.float64) * scale for r in range(world_size)).to(dtype)
                shm.allreduce_(x, scale)
                assert torch.equal(x, expected), f"{dtype} n={n} scale={scale}: max error {(x.double() - expected.double()).abs().max()}"
                checked += 1
    return checked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_exact_sums_every_dtype_and_size(world_size):
    counts = run_ranks(_exact_sums, world_size, timeout=100)
    assert counts == [len(DTYPES) * len(SIZES) * 2] * world_size


def _bitwise_like_gloo(rank, world_size):
    from pydist.transport import open_shm

    shm = open_shm(dist.group.WORLD)
    gen = torch.Generator().manual_seed(rank)
    for dtype in DTYPES:
        for n in (1000, 3 * PIECE_ELEMS_F32 + 17):
            grad = torch.randn(n, generator=gen).to(dtype)
            # torch's DDP: multiply by 1/world_size into the bucket, then gloo sums
            reference = grad * (1.0 / world_size)
            dist.all_reduce(reference)
            mine = grad.clone()
            shm.allreduce_(mine, 1.0 / world_size)
            assert torch.equal(mine, reference), f"{dtype} n={n}: differs from gloo's sum"
    return True


@pytest.mark.timeout(60)
def test_two_ranks_bitwise_equal_to_gloo():
    assert run_ranks(_bitwise_like_gloo, 2, timeout=50) == [True, True]


def test_rejects_what_it_cannot_carry():
    name = _name()
    shm = _C.ShmTransport(name, 0, 1, create=True, timeout_s=5)
    shm.unlink()
    with pytest.raises(RuntimeError, match="contiguous CPU tensor of float32"):
        shm.allreduce_(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="not contiguous"):
        shm.allreduce_(torch.zeros(4, 4).t())
    x = torch.arange(5.0)
    shm.allreduce_(x, 0.5)  # a group of one: its own tensor, scaled
    assert torch.equal(x, torch.arange(5.0) * 0.5)
    assert not _C.ShmTransport.supports(torch.int32)


def test_open_errors_name_the_object():
    with pytest.raises(RuntimeError, match=r"rank 1 could not open the shared-memory object /pydist-test-.*No such file"):
        _C.ShmTransport(_name(), 1, 2, create=False, timeout_s=1)
    name = _name()
    first = _C.ShmTransport(name, 0, 2, create=True, timeout_s=1)
    try:
        with pytest.raises(RuntimeError, match="expected .* bytes for 3 ranks"):
            _C.ShmTransport(name, 1, 3, create=False, timeout_s=1)
        with pytest.raises(RuntimeError, match="could not create"):
            _C.ShmTransport(name, 0, 2, create=True, timeout_s=1)
    finally:
        first.unlink()


def _pair(timeout_s=5.0):
    name = _name()
    ends = [_C.ShmTransport(name, 0, 2, create=True, timeout_s=timeout_s)]
    ends.append(_C.ShmTransport(name, 1, 2, create=False, timeout_s=timeout_s))
    ends[0].unlink()
    return ends


def _in_threads(calls):
    """Runs each call in its own thread; returns each one's exception or None."""
    errors = [None] * len(calls)

    def run(i):
        try:
            calls[i]()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "an all-reduce did not return"
    return errors


@pytest.mark.timeout(30)
def test_two_ends_in_one_process():
    ends = _pair()
    xs = [_ints(PIECE_ELEMS_F32 * 2 + 5, r, torch.float32) for r in range(2)]
    expected = xs[0] + xs[1]
    assert _in_threads([lambda e=e, x=x: e.allreduce_(x) for e, x in zip(ends, xs)]) == [None, None]
    assert torch.equal(xs[0], expected) and torch.equal(xs[1], expected)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("leaves", ["destroyed", "closed"])
def test_peer_that_shut_down_fails_the_wait_at_once(leaves):
    ends = _pair(timeout_s=60)
    if leaves == "destroyed":
        gone = ends.pop()  # rank 1's wrapper is gone
    else:
        # close() is what the exit does while something still holds the end
        # (see [Note: leaving the segment at exit] in pydist/transport/shm_segment.py).
        gone = ends[1]
        gone.close()
        gone.close()  # idempotent
    del gone
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="waited for rank 1 to stage piece 1, but rank 1 has shut its end down"):
        ends[0].allreduce_(torch.ones(10))
    assert time.monotonic() - start < 5
    if leaves == "closed":
        with pytest.raises(RuntimeError, match="the transport is shutting down"):
            ends[1].allreduce_(torch.ones(10))


@pytest.mark.timeout(30)
def test_peer_that_failed_elsewhere_and_left_is_named_with_its_cause():
    """A rank whose failure came from outside this transport (the
    hierarchical transport's cross-host leg) aborts it before it leaves: a
    peer waiting on it gets that cause, not only "shut its end down", also
    when it looks after the rank has left. The first cause is kept."""
    ends = _pair(timeout_s=60)
    ends[1].abort("HierarchicalTransport: an all-reduce failed on the cross-host leg; unreachable host: node1")
    ends[1].abort("a later failure")
    ends[1].close()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="waited for rank 1 to stage piece 1, but rank 1 failed and aborted the "
                                           "transport: HierarchicalTransport: an all-reduce failed on the cross-host "
                                           "leg; unreachable host: node1$"):
        ends[0].allreduce_(torch.ones(10))
    assert time.monotonic() - start < 5


@pytest.mark.timeout(30)
def test_peer_that_never_arrives_times_out_and_aborts_the_others():
    ends = _pair(timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 did not arrive within the timeout of 500 ms"):
        ends[0].allreduce_(torch.ones(10))
    assert time.monotonic() - start < 5
    # rank 0 aborted the transport: rank 1, arriving late, fails at once too
    with pytest.raises(RuntimeError, match="rank 0 failed an all-reduce and aborted the transport"):
        ends[1].allreduce_(torch.ones(10))
    # and a broken end stays broken, saying why
    with pytest.raises(RuntimeError, match="did not arrive within the timeout"):
        ends[0].allreduce_(torch.ones(10))



@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["numel", "kind", "dtype", "empty"])
def test_ranks_issuing_different_collectives_fail_naming_both(case):
    """Pieces pair up by count alone, so without a check these would pair
    unrelated pieces and finish with wrong data (an all-gather of 1000
    elements against one of 600 left zeros in rank 0's output)."""
    ends = _pair(timeout_s=10)
    one = torch.ones(16)
    calls = {
        "numel": [lambda: ends[0].all_gather(torch.ones(1000), torch.zeros(2000)).wait(),
                  lambda: ends[1].all_gather(torch.ones(600), torch.zeros(1200)).wait()],
        "kind": [lambda: ends[0].all_gather(one, torch.zeros(32)).wait(),
                 lambda: ends[1].reduce_scatter(torch.ones(32), torch.zeros(16), 1.0).wait()],
        "dtype": [lambda: ends[0].all_reduce(torch.ones(16), 1.0).wait(),
                  lambda: ends[1].all_reduce(torch.ones(16, dtype=torch.float64), 1.0).wait()],
        "empty": [lambda: ends[0].all_gather(torch.ones(0), torch.zeros(0)).wait(),
                  lambda: ends[1].all_gather(one, torch.zeros(32)).wait()],
    }[case]
    start = time.monotonic()
    errors = _in_threads(calls)
    assert time.monotonic() - start < 5, "the mismatch was found only at the timeout"
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} finished a collective its peer did not issue"
        assert "the ranks issued different collectives" in str(error), str(error)
        assert f"rank {rank} runs" in str(error) and f"rank {1 - rank} runs" in str(error)


@pytest.mark.timeout(30)
def test_empty_collectives_still_pair_up():
    ends = _pair()
    outs = [torch.zeros(0), torch.zeros(0)]
    calls = [lambda e=e, o=o: e.all_gather(torch.ones(0), o).wait() for e, o in zip(ends, outs)]
    assert _in_threads(calls) == [None, None]
    xs = [_ints(40, r, torch.float32) for r in range(2)]  # and the next one pairs as before
    expected = xs[0] + xs[1]
    assert _in_threads([lambda e=e, x=x: e.allreduce_(x) for e, x in zip(ends, xs)]) == [None, None]
    assert torch.equal(xs[0], expected) and torch.equal(xs[1], expected)


def _map_then_die(name, ready):
    end = _C.ShmTransport(name, 1, 2, create=False, timeout_s=60)  # noqa: F841 - held until the process dies
    ready.set()
    os._exit(3)  # no destructor: as if killed


def _rank_zero_and_a_peer_that_dies():
    """Rank 0's end, and a child process that maps rank 1's end and exits
    without a destructor (not yet reaped: the caller joins it)."""
    name = _name()
    end = _C.ShmTransport(name, 0, 2, create=True, timeout_s=60)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_map_then_die, args=(name, ready))
    child.start()
    assert ready.wait(30)
    return end, child


@pytest.mark.timeout(60)
def test_peer_process_that_died_fails_the_wait_at_once():
    end, child = _rank_zero_and_a_peer_that_dies()
    child.join(30)
    end.unlink()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 .*its process \(pid {child.pid}\) has exited"):
        end.allreduce_(torch.ones(10))
    assert time.monotonic() - start < 5


def _wanted_but_impossible(rank, world_size):
    from pydist import DistributedDataParallel as DDP

    try:
        DDP(torch.nn.Linear(4, 4), shm_allreduce=True)
    except RuntimeError as exc:
        return str(exc)
    return "constructed"


@pytest.mark.timeout(60)
def test_required_shm_in_a_group_of_one_says_why():
    (message,) = run_ranks(_wanted_but_impossible, 1, timeout=50)
    assert "shm_allreduce=True" in message and "rank 0: a group of one rank has nothing to all-reduce" in message


def _mismatched_wanted(rank, world_size):
    from pydist import DistributedDataParallel as DDP

    try:
        DDP(torch.nn.Linear(4, 4), shm_allreduce=(rank == 0))
    except ValueError as exc:
        return str(exc)
    return "constructed"


@pytest.mark.timeout(60)
def test_shm_allreduce_differing_across_ranks_raises_on_every_rank():
    messages = run_ranks(_mismatched_wanted, 2, timeout=50)
    for message in messages:
        assert "shm_allreduce differs across ranks (rank 0: True, rank 1: False)" in message


# --- issue 17: zombies, forked children, leaked segments ----------------------


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


@pytest.mark.timeout(60)
def test_zombie_peer_fails_the_wait_at_once():
    # A launcher that reaps its children one by one leaves a dead rank a
    # zombie; kill(pid, 0) succeeds on a zombie, so the state is read too.
    end, child = _rank_zero_and_a_peer_that_dies()
    try:
        deadline = time.monotonic() + 30
        while _process_state(child.pid) != "Z":  # exited, not reaped (no join, no is_alive)
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"waited for rank 1 .*its process \(pid {child.pid}\) has exited"):
            end.allreduce_(torch.ones(10))
        assert time.monotonic() - start < 5  # generous: the machine is shared
    finally:
        child.join(30)


_FORK_SCRIPT = r"""
import os, sys, threading, time
import torch
from pydist import _C

name = sys.argv[1]
ends = [_C.ShmTransport(name, 0, 2, create=True, timeout_s=30),
        _C.ShmTransport(name, 1, 2, create=False, timeout_s=30)]
pid = os.fork()
if pid == 0:
    try:
        ends[0].allreduce_(torch.ones(3))
        print("CHILD USED THE PARENT'S END")
    except RuntimeError as exc:
        print("child refused:", exc)
    sys.stdout.flush()
    sys.exit(0)  # interpreter teardown destroys the inherited ends
start = time.monotonic()
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    if time.monotonic() - start > 20:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("CHILD HUNG AT EXIT")
        sys.exit(1)
    time.sleep(0.02)
print(f"child exited after {time.monotonic() - start:.2f} s")
# The child left the parent's ends attached and working.
xs = [torch.arange(5.0), torch.arange(5.0) * 10]
threads = [threading.Thread(target=e.allreduce_, args=(x,)) for e, x in zip(ends, xs)]
[t.start() for t in threads]
[t.join(20) for t in threads]
assert torch.equal(xs[0], torch.arange(5.0) * 11) and torch.equal(xs[1], xs[0]), xs
print("parent ends still work")
"""


@pytest.mark.timeout(90)
def test_forked_child_exits_without_joining_the_parents_worker():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, _name()], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "child refused: ShmTransport.all-reduce: this end of /pydist-test-" in out.stdout
    assert "was forked from it and cannot use it" in out.stdout
    assert "parent ends still work" in out.stdout
    exit_s = float(out.stdout.split("child exited after ")[1].split(" s")[0])
    assert exit_s < 10, out.stdout  # generous: the machine is shared


def _segments() -> set:
    return {e for e in os.listdir("/dev/shm") if e.startswith("pydist-")}


def _create_and_die(name, names):
    from pydist.transport import shm_segment

    name = name or shm_segment._new_segment_name()  # named as a rank 0 names it
    end = _C.ShmTransport(name, 0, 2, create=True, timeout_s=60)  # noqa: F841 - held until the process dies
    names.put(name)
    names.close()
    names.join_thread()  # flushed before the abrupt exit
    os._exit(9)  # no destructor, no finally: as if killed


def _killed_creator(name=None) -> str:
    """The name of a segment whose creator was killed before anyone mapped it."""
    ctx = mp.get_context("spawn")
    names = ctx.Queue()
    child = ctx.Process(target=_create_and_die, args=(name, names))
    child.start()
    name = names.get(timeout=30)
    child.join(30)
    assert child.exitcode == 9
    return name


@pytest.mark.timeout(60)
def test_creator_killed_before_peers_map_leaves_no_segment():
    name = _name()
    _killed_creator(name)
    assert name[1:] in _segments()  # rank 0 died between creating and the others mapping
    end = _C.ShmTransport(name, 1, 2, create=False, timeout_s=1)  # the last rank to map removes the name
    assert name[1:] not in _segments()
    del end


@pytest.mark.timeout(60)
def test_segment_whose_creator_died_unmapped_is_swept():
    from pydist.transport import shm_segment

    name = _killed_creator()
    mine = shm_segment._new_segment_name()  # a creator that is alive: this process
    live = _C.ShmTransport(mine, 0, 2, create=True, timeout_s=1)
    assert {name[1:], mine[1:]} <= _segments()
    removed = shm_segment.sweep_stale_segments()  # other dead jobs' leftovers may go too
    assert name[1:] in removed and mine[1:] not in removed
    assert name[1:] not in _segments() and mine[1:] in _segments()
    del live  # rank 0's end unlinks a name nobody else mapped
    assert mine[1:] not in _segments()


def _rank_killed_while_attaching(rank, world_size, store_path, results):
    import datetime

    from pydist import transport
    from pydist.transport import shm_segment

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        def killed(*args):
            os._exit(9)  # killed after rank 0 created the segment, before mapping it
        shm_segment._attach = killed
    start = time.monotonic()
    try:
        transport.open_shm(dist.group.WORLD, wanted=None)
        results.put(("returned", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((f"{type(exc).__name__}: {exc}", time.monotonic() - start))
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.timeout(90)
def test_rank_killed_while_attaching_leaves_no_segment(tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_killed_while_attaching, args=(r, 2, str(tmp_path / "store"), results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        message, elapsed = results.get(timeout=60)  # rank 0's: rank 1 died before answering
        print(f"rank 0, {elapsed:.2f} s after rank 1 was killed: {message}")
        for p in procs:
            p.join(30)
        assert procs[1].exitcode == 9
        assert elapsed < 25, message  # the peer's death is seen before the 30 s group timeout
        # Other jobs on this machine make segments too: look for rank 0's.
        assert not [s for s in _segments() if f"-{procs[0].pid}-" in s], message
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
