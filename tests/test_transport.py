"""pydist.transport: the one seam every collective goes through
(csrc/transport/transport.h, [Note: transports]).

Every transport's reduce-scatter and all-gather is checked exactly against
gloo's own collectives on the same data (integer-valued floats, so the
answer is exact in every dtype: rtol=0, atol=0), at 2 and 3 ranks, with
sizes that cross the shared-memory transport's step boundaries, mixed with
all-reduces so the protocol's step counters interleave. A wrapper registered
by name sits in front of a transport, inside DDP's reducer too.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from pydist.spawn import run_ranks

STEP_F32 = (1 << 20) // 4  # one shared-memory piece of float32
SHARD_SIZES = [1, 15, 1000, STEP_F32 // 2 + 3, STEP_F32 + 17]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _ints(n, rank, dtype, salt=0):
    """Small integers: exact in every dtype, and so are their sums."""
    return ((torch.arange(n) * 7 + rank * 3 + salt) % 23 - 11).to(dtype)


def _make(kind):
    from pydist import transport

    if kind == "shm":
        return transport.open_shm(dist.group.WORLD)
    return transport.ProcessGroupTransport(dist.group.WORLD)


def _exact_like_gloo(rank, world_size, kind):
    t = _make(kind)
    checked = 0
    for dtype in DTYPES:
        for shard in SHARD_SIZES:
            for scale in (1.0, 0.5):
                flat = _ints(shard * world_size, rank, dtype)
                mine = torch.full((shard,), 99, dtype=dtype)
                t.reduce_scatter(flat, mine, scale).wait()
                # gloo's own reduce-scatter of the pre-scaled input, and the exact answer
                reference = torch.empty(shard, dtype=dtype)
                dist.reduce_scatter_tensor(reference, flat * scale)
                exact = sum(_ints(shard * world_size, r, torch.float64) * scale for r in range(world_size))
                exact = exact[rank * shard : (rank + 1) * shard].to(dtype)
                torch.testing.assert_close(mine, reference, rtol=0, atol=0)
                torch.testing.assert_close(mine, exact, rtol=0, atol=0)
                assert torch.equal(flat, _ints(shard * world_size, rank, dtype)), "reduce_scatter wrote its input"

                piece = _ints(shard, rank, dtype, salt=5)
                gathered = torch.full((shard * world_size,), 99, dtype=dtype)
                t.all_gather(piece, gathered).wait()
                reference = torch.empty(shard * world_size, dtype=dtype)
                dist.all_gather_into_tensor(reference, piece)
                exact = torch.cat([_ints(shard, r, dtype, salt=5) for r in range(world_size)])
                torch.testing.assert_close(gathered, reference, rtol=0, atol=0)
                torch.testing.assert_close(gathered, exact, rtol=0, atol=0)

                x = _ints(shard, rank, dtype, salt=1)  # an all-reduce between them
                t.all_reduce(x, scale).wait()
                exact = sum(_ints(shard, r, torch.float64, salt=1) * scale for r in range(world_size)).to(dtype)
                torch.testing.assert_close(x, exact, rtol=0, atol=0)
                checked += 1
    return checked


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["shm", "process_group"])
def test_reduce_scatter_and_all_gather_exact_like_gloo(kind, world_size):
    counts = run_ranks(_exact_like_gloo, world_size, args=(kind,), timeout=240)
    assert counts == [len(DTYPES) * len(SHARD_SIZES) * 2] * world_size


def _futures_in_flight(rank, world_size):
    """Several collectives queued before any is waited on, completing in
    order, each with a completion time on time.monotonic_ns's clock."""
    import time

    t = _make("shm")
    before = time.monotonic_ns()
    xs = [_ints(STEP_F32 + 5, rank, torch.float32, salt=i) for i in range(4)]
    futures = [t.all_reduce(x) for x in xs]
    times = [f.wait() for f in futures]
    after = time.monotonic_ns()
    for i, x in enumerate(xs):
        exact = sum(_ints(STEP_F32 + 5, r, torch.float64, salt=i) for r in range(world_size)).float()
        torch.testing.assert_close(x, exact, rtol=0, atol=0)
    assert before <= times[0] <= times[1] <= times[2] <= times[3] <= after, (before, times, after)
    t.set_stamp_completion(False)
    assert t.all_reduce(torch.ones(3)).wait() == -1  # no clock read
    return True


@pytest.mark.timeout(120)
def test_futures_complete_in_order_with_their_times():
    assert run_ranks(_futures_in_flight, 2, timeout=100) == [True, True]


def _shape_errors(rank, world_size, kind):
    t = _make(kind)
    messages = []
    for call in (
        lambda: t.reduce_scatter(torch.zeros(5), torch.zeros(2)),
        lambda: t.all_gather(torch.zeros(2), torch.zeros(5)),
    ):
        try:
            call()
        except RuntimeError as exc:
            messages.append(str(exc).splitlines()[0])
    dist.barrier()  # no rank leaves while another is still connecting
    return messages


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["shm", "process_group"])
def test_shape_mismatch_names_the_sizes(kind):
    messages = run_ranks(_shape_errors, 2, args=(kind,), timeout=100)[0]
    assert len(messages) == 2, messages
    assert "input has 5 elements, world_size (2) x output_shard (2) expected" in messages[0]
    assert "output has 5 elements, world_size (2) x shard (2) expected" in messages[1]


# --- wrappers -------------------------------------------------------------------


def test_unknown_wrapper_names_the_registered_ones():
    from pydist import transport

    assert "counting" in transport.registered_wrappers()
    shm = transport.ShmTransport("/pydist-test-wrap-unknown", 0, 1, create=True, timeout_s=5)
    with pytest.raises(RuntimeError, match="no transport wrapper named 'slow'; registered:.*'counting'"):
        transport.wrap("slow", shm)


def _counting_wrapper_in_ddp(rank, world_size, kind):
    """A counting wrapper in front of DDP's transport sees every chunk, and
    the gradients stay bitwise those of the plain transport."""
    from pydist import DistributedDataParallel as DDP
    from pydist import _C, transport

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(200, 200) for _ in range(6)])
    reference = DDP(copy.deepcopy(model), shm_allreduce=(kind == "shm"))
    ddp = DDP(model, shm_allreduce=(kind == "shm"), allreduce_chunk_mb=0.25)
    inner = transport.transport_of(ddp)
    assert inner.name == ("shm" if kind == "shm" else "gloo")
    counting = transport.wrap("counting", inner)
    assert counting.name == f"counting({inner.name})"
    # A reducer over the same parameters, its chunks going through the wrapper.
    buckets = ddp.reducer.bucket_indices()
    chunk_bytes = int(0.25 * 2**20)
    reducer = _C.Reducer(
        ddp._params, ddp._param_names, buckets, dist.group.WORLD, chunk_bytes=chunk_bytes, transport=counting
    )
    del ddp.reducer  # its hooks go; the wrapped reducer's stay
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 200, generator=gen)
    reducer.prepare_for_backward([])
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    stats = counting.stats()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stats["all_reduce_bytes"] == grad_bytes, stats
    # [Note: chunked launches]: a chunk ends at the parameter that brings it
    # to chunk_bytes, or at its bucket's end.
    chunks = 0
    for bucket in buckets:
        size = 0
        for slot, i in enumerate(bucket):
            size += ddp._params[i].numel() * 4
            if size >= chunk_bytes or slot == len(bucket) - 1:
                chunks, size = chunks + 1, 0
    assert stats["all_reduce_calls"] == chunks >= 3, (stats, buckets)
    assert stats["reduce_scatter_calls"] == stats["all_gather_calls"] == 0
    return stats["all_reduce_calls"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["shm", "process_group"])
def test_counting_wrapper_sees_every_chunk_of_a_backward(kind):
    calls = run_ranks(_counting_wrapper_in_ddp, 2, args=(kind,), timeout=100)
    assert calls[0] == calls[1]


# --- the stubs -------------------------------------------------------------------


def test_type_stubs_name_exactly_what_the_extension_exports():
    import ast
    import pathlib

    import pydist
    from pydist import _C

    stub = ast.parse((pathlib.Path(pydist.__file__).parent / "_C.pyi").read_text())
    stubbed = {node.name: node for node in stub.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    stubbed |= {node.target.id: node for node in stub.body if isinstance(node, ast.AnnAssign)}  # constants
    exported = {name for name in vars(_C) if not name.startswith("_")}
    assert set(stubbed) == exported, f"stubs only: {set(stubbed) - exported}; extension only: {exported - set(stubbed)}"
    for name, node in stubbed.items():
        if not isinstance(node, ast.ClassDef):
            continue
        members = {n.name for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
        actual = {m for m in vars(getattr(_C, name)) if not m.startswith("_")}
        assert members == actual, f"{name}: stubs only {members - actual}; extension only {actual - members}"
