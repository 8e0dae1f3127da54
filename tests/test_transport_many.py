"""Transport.all_gather_many: one all-gather of several inputs, scattered
into several outputs per rank (csrc/transport/transport.h, [Note:
transports]; the shared-memory version: [Note: an all-gather in pieces] in
csrc/transport/shm_transport.cpp).

The oracle is the plain all_gather of the concatenated inputs, through the
same transport and through gloo's own all_gather_into_tensor, on
integer-valued floats (exact in every dtype: rtol=0, atol=0). The outputs
are views into larger buffers, as the sharded wrapper's unsharded buffers'
rank views are, and the bytes around them must stay untouched. Sizes are
uneven, include empty inputs, and add up to more than one staging step of
the shared-memory segment, so pieces straddle step boundaries.
"""

import pytest
import torch
import torch.distributed as dist

from pydist.spawn import run_ranks

SIZE_CASES = [
    [1, 15, 1000, 3],
    [0, 5, 0, 17, 0],
    [0],
    [0, 0, 0],
    [200_003, 7, 150_001, 0, 90_000],  # more than one shared-memory step in every dtype, at 2 and 4 ranks
]
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]
GUARD = 99  # the value around every destination view
PAD_BEFORE, PAD_AFTER = 5, 3


def _ints(n, rank, dtype, salt=0):
    """Small integers: exact in every dtype."""
    return ((torch.arange(n) * 7 + rank * 3 + salt) % 23 - 11).to(dtype)


def _make(kind):
    from pydist import transport

    if kind == "process_group":
        return transport.ProcessGroupTransport(dist.group.WORLD)
    shm = transport.open_shm(dist.group.WORLD)
    if kind == "shm":
        return shm
    if kind == "counting(shm)":
        return transport.wrap("counting", shm)
    if kind == "sim_net(shm)":
        return transport.wrap("sim_net", shm, bandwidth=1e12, latency=1e-6)
    raise ValueError(kind)


def _destinations(sizes, world_size, dtype):
    """Per input, a buffer of world_size parts with guard bytes either side,
    and its rank views: outputs[q][i] is rank q's part of buffer i."""
    buffers = [torch.full((PAD_BEFORE + world_size * s + PAD_AFTER,), GUARD, dtype=dtype) for s in sizes]
    outputs = [[b[PAD_BEFORE + q * s : PAD_BEFORE + (q + 1) * s] for b, s in zip(buffers, sizes)]
               for q in range(world_size)]
    return buffers, outputs


def _exact_like_all_gather(rank, world_size, kind):
    t = _make(kind)
    checked = 0
    for dtype in DTYPES:
        for salt, sizes in enumerate(SIZE_CASES):
            inputs = [_ints(s, rank, dtype, salt=salt + i) for i, s in enumerate(sizes)]
            buffers, outputs = _destinations(sizes, world_size, dtype)
            versions = [b._version for b in buffers]
            t.all_gather_many(inputs, outputs).wait()

            # the oracles: this transport's plain all_gather, gloo's, and the exact answer
            joined = torch.cat(inputs)
            plain = torch.full((joined.numel() * world_size,), GUARD, dtype=dtype)
            t.all_gather(joined, plain).wait()
            reference = torch.empty_like(plain)
            dist.all_gather_into_tensor(reference, joined)
            exact = torch.cat([_ints(s, q, dtype, salt=salt + i) for q in range(world_size) for i, s in enumerate(sizes)])
            torch.testing.assert_close(plain, reference, rtol=0, atol=0)
            torch.testing.assert_close(plain, exact, rtol=0, atol=0)
            rows = plain.view(world_size, -1)
            for q in range(world_size):
                torch.testing.assert_close(torch.cat(outputs[q]), rows[q], rtol=0, atol=0, msg=f"{dtype} {sizes} rank {q}")
            for b, s in zip(buffers, sizes):
                assert torch.all(b[:PAD_BEFORE] == GUARD) and torch.all(b[PAD_BEFORE + world_size * s :] == GUARD)
            for i, s in enumerate(sizes):
                assert torch.equal(inputs[i], _ints(s, rank, dtype, salt=salt + i)), "all_gather_many wrote an input"
            if "shm" in kind:  # the worker writes through data pointers: autograd sees no write
                assert [b._version for b in buffers] == versions
            checked += 1
    stats = t.stats()
    if kind == "counting(shm)":
        # each call counts as one all-gather of its output's bytes (world_size x its inputs)
        calls = 2 * len(DTYPES) * len(SIZE_CASES)
        expected = 2 * world_size * sum(sum(sizes) * torch.empty(0, dtype=d).element_size()
                                        for d in DTYPES for sizes in SIZE_CASES)
        assert stats["all_gather_calls"] == calls and stats["all_gather_bytes"] == expected, stats
    if kind == "sim_net(shm)":
        assert stats["sim_net_calls"] == 2 * len(DTYPES) * len(SIZE_CASES), stats
    return checked


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["shm", "process_group"])
def test_all_gather_many_exact_like_all_gather(kind, world_size):
    counts = run_ranks(_exact_like_all_gather, world_size, args=(kind,), timeout=360)
    assert counts == [len(DTYPES) * len(SIZE_CASES)] * world_size


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["counting(shm)", "sim_net(shm)"])
def test_wrappers_forward_all_gather_many(kind):
    counts = run_ranks(_exact_like_all_gather, 2, args=(kind,), timeout=240)
    assert counts == [len(DTYPES) * len(SIZE_CASES)] * 2


def _pairs_with_plain_all_gather(rank, world_size, kind):
    """A rank's all_gather_many meets a peer's plain all_gather of the same
    total: the same collective, so both get the same rows."""
    t = _make(kind)
    sizes = SIZE_CASES[-1]
    total = sum(sizes)
    for many_rank in range(world_size):
        joined = _ints(total, rank, torch.float32, salt=many_rank)
        exact = torch.cat([_ints(total, q, torch.float32, salt=many_rank) for q in range(world_size)])
        if rank == many_rank:
            _, outputs = _destinations(sizes, world_size, torch.float32)
            t.all_gather_many(list(joined.split(sizes)), outputs).wait()
            got = torch.cat([torch.cat(outputs[q]) for q in range(world_size)])
        else:
            got = torch.empty(total * world_size)
            t.all_gather(joined, got).wait()
        torch.testing.assert_close(got, exact, rtol=0, atol=0)
    return True


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["shm", "process_group"])
def test_all_gather_many_pairs_with_a_peers_plain_all_gather(kind):
    assert run_ranks(_pairs_with_plain_all_gather, 2, args=(kind,), timeout=150) == [True, True]


def _different_totals(rank, world_size):
    """Rank 0 gathers 10 elements per rank, rank 1 gathers 12: both fail at
    once, each naming both collectives."""
    import time

    t = _make("shm")
    sizes = [4, 6] if rank == 0 else [4, 8]
    _, outputs = _destinations(sizes, world_size, torch.float32)
    start = time.monotonic()
    try:
        t.all_gather_many([torch.ones(s) for s in sizes], outputs).wait()
    except RuntimeError as exc:
        message = str(exc).splitlines()[0]
    else:
        message = "no error"
    return message, time.monotonic() - start


@pytest.mark.timeout(120)
def test_different_totals_fail_every_rank_naming_both():
    results = run_ranks(_different_totals, 2, timeout=100)
    for rank, (message, seconds) in enumerate(results):
        assert "the ranks issued different collectives" in message, (rank, message)
        assert "all-gather #1 of 10 Float elements per rank" in message, (rank, message)
        assert "all-gather #1 of 12 Float elements per rank" in message, (rank, message)
        assert seconds < 30, f"rank {rank} took {seconds:.1f} s to fail (the group's timeout is 100 s)"


def _argument_errors(rank, world_size, kind):
    t = _make(kind)
    ok = [torch.zeros(2), torch.zeros(3)]
    outs = [[torch.zeros(2), torch.zeros(3)] for _ in range(world_size)]
    messages = []
    for inputs, outputs in (
        ([], [[] for _ in range(world_size)]),
        (ok, outs[:1]),
        (ok, [outs[0], [torch.zeros(2)]]),
        (ok, [outs[0], [torch.zeros(2), torch.zeros(4)]]),
        (ok, [outs[0], [torch.zeros(2), torch.zeros(3, dtype=torch.float64)]]),
        ([torch.zeros(2), torch.zeros(6)[::2]], outs),
    ):
        try:
            t.all_gather_many(inputs, outputs)
        except RuntimeError as exc:
            messages.append(str(exc).splitlines()[0])
    dist.barrier()  # no rank leaves while another is still connecting
    return messages


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["shm", "process_group"])
def test_argument_errors_name_the_tensor(kind):
    messages = run_ranks(_argument_errors, 2, args=(kind,), timeout=100)[0]
    assert len(messages) == 6, messages
    assert "needs at least one input" in messages[0]
    assert "outputs has 1 lists, one per rank (world_size 2) expected" in messages[1]
    assert "outputs[1] has 1 tensors, one per input (2) expected" in messages[2]
    assert "outputs[1][1] has 4 elements, inputs[1] 3" in messages[3]
    assert "outputs[1][1] is Double on cpu, inputs[0] Float on cpu" in messages[4]
    assert "inputs[1] is not contiguous" in messages[5]


def test_one_rank_copies_each_input_into_its_output():
    from pydist import transport

    shm = transport.ShmTransport("/pydist-test-many-one-rank", 0, 1, create=True, timeout_s=5)
    inputs = [_ints(s, 0, torch.float32, salt=s) for s in (3, 0, 40_000)]
    buffers, outputs = _destinations([3, 0, 40_000], 1, torch.float32)
    shm.all_gather_many(inputs, outputs).wait()
    for got, want in zip(outputs[0], inputs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
