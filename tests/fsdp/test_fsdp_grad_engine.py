"""The gradient path of pydist's FSDP: each unit's gradients packed by one
C++ call into its column of its batch's rank-major reduce-scatter input
(``pydist._C.pack_rank_major`` against its pure-torch oracle, bitwise), the
reduced shards handed out as ``.grad`` in C++ (``hand_out_grads``),
and, on spawned gloo ranks against stock torch ``fully_shard`` (bitwise at
two ranks), the cases that path has to get right: a batch mixing frozen,
partly frozen and trainable units, a unit whose post-backward comes from
the previous unit's output hook (with a residual around it, so that hook
fires late) beside units that take the autograd Function (two inputs, the
first unit), a unit whose input does not carry its backward (``.detach()``),
gradient accumulation and bf16. A parameter used on some ranks
only, inside a batch, is checked against every rank's plain gradients
averaged by hand (torch's FSDP2 drops a parameter without a gradient from
its reduce-scatter, so ranks that disagree on it do not meet there)."""

import pytest
import torch
import torch.nn as nn

from pydist import _C
from pydist.fsdp import _fsdp_collectives as collectives
from pydist.spawn import run_ranks

# --------------------------------------------------------------------------
# pack_rank_major and hand_out_grads, in one process
# --------------------------------------------------------------------------


def _pack_case(dtype, world_size):
    """A unit's gradients (None: a frozen parameter, or no gradient), their
    numels, its shard's numel and a batch row with the unit between two
    others (its column is not the first)."""
    g = torch.Generator().manual_seed(world_size)
    shapes = [(5, 3), (7,), (1,), (4, 4), (2,)]
    present = [True, False, True, True, False]
    grads = [torch.randn(s, generator=g).to(dtype) if p else None for s, p in zip(shapes, present)]
    numels = [torch.Size(s).numel() for s in shapes]
    shard_numel = -(-sum(numels) // world_size)
    return grads, numels, shard_numel, 3 + shard_numel + 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_pack_rank_major_matches_the_oracle(dtype, world_size, scale):
    grads, numels, shard_numel, row = _pack_case(dtype, world_size)
    got = torch.full((world_size * row,), -7.0, dtype=dtype)
    want = got.clone()
    _C.pack_rank_major(grads, numels, got, world_size, 3, shard_numel, scale)
    collectives.reference_pack_unit_grads(grads, numels, want, world_size, 3, shard_numel, scale)
    assert torch.equal(got, want)
    # the neighbours' columns are untouched
    rows = got.view(world_size, row)
    assert (rows[:, :3] == -7).all() and (rows[:, 3 + shard_numel:] == -7).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_pack_rank_major_on_cuda_is_the_cpu_pack(dtype, world_size, scale):
    """A CUDA unit's pack (one ATen op per cut) writes the CPU pack's bits."""
    grads, numels, shard_numel, row = _pack_case(dtype, world_size)
    want = torch.full((world_size * row,), -7.0, dtype=dtype)
    got = want.cuda()
    _C.pack_rank_major(grads, numels, want, world_size, 3, shard_numel, scale)
    _C.pack_rank_major([t.cuda() if t is not None else None for t in grads], numels, got, world_size, 3, shard_numel,
                       scale)
    assert torch.equal(got.cpu(), want)
    with pytest.raises(RuntimeError, match="on cuda:0 expected"):
        _C.pack_rank_major([torch.zeros(3, dtype=dtype)], [3], got, world_size, 0, shard_numel, scale)


def test_pack_rank_major_refuses_what_it_cannot_pack():
    out = torch.empty(8)
    with pytest.raises(RuntimeError, match=r"grads\[0\] is Double"):
        _C.pack_rank_major([torch.zeros(3, dtype=torch.float64)], [3], out, 2, 0, 4)
    with pytest.raises(RuntimeError, match="not contiguous"):
        _C.pack_rank_major([torch.zeros(3, 2).t()], [6], out, 2, 0, 4)
    with pytest.raises(RuntimeError, match="do not fit"):
        _C.pack_rank_major([torch.zeros(9)], [9], out, 2, 0, 4)
    with pytest.raises(RuntimeError, match="does not fit a row"):
        _C.pack_rank_major([torch.zeros(3)], [3], out, 2, 1, 4)
    with pytest.raises(RuntimeError, match="not world_size"):
        _C.pack_rank_major([torch.zeros(3)], [3], torch.empty(7), 2, 0, 3)
    # complex (packed as real and imaginary parts): a gradient without its
    # numel, or a numel without its gradient, is refused there too
    cout = torch.empty(8, dtype=torch.cfloat)
    with pytest.raises(RuntimeError, match="2 grads but 1 numels"):
        _C.pack_rank_major([torch.zeros(3, dtype=torch.cfloat), torch.zeros(1, dtype=torch.cfloat)], [3], cout, 2, 0, 4)
    with pytest.raises(RuntimeError, match="1 grads but 2 numels"):
        _C.pack_rank_major([torch.zeros(3, dtype=torch.cfloat)], [3, 1], cout, 2, 0, 4)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_grad_pack_packs_each_column_as_pack_param_grads(world_size):
    """A GradPack over FSDP2's layout (a column per parameter, here one
    column of two) packs what pack_param_grads of each column packs, clears
    the .grads and says which parameters had one."""
    g = torch.Generator().manual_seed(world_size)
    shapes = [(5, 3), (7,), (2, 2), (4,)]
    columns = [(0, 1), (1, 3), (3, 4)]  # (first, end) of the parameters in each
    widths = [-(-sum(torch.Size(shapes[i]).numel() for i in range(a, b)) // world_size) for a, b in columns]
    offsets = [sum(widths[:c]) for c in range(len(widths))]
    row = 2 + sum(widths) + 3  # the unit between two others in its batch's rows

    def params_with_grads():
        params = [nn.Parameter(torch.zeros(s)) for s in shapes]
        for i, p in enumerate(params):
            if i != 2:  # one without a gradient: zeros in the pack
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        return params

    numels = [torch.Size(s).numel() for s in shapes]
    params = params_with_grads()
    got = torch.full((world_size * row,), -7.0)
    pack = _C.GradPack(params, numels, [(a, b, o, w) for (a, b), o, w in zip(columns, offsets, widths)])
    pack.aim(got, world_size, 2, 0.5)
    pack.pack()
    assert pack.packed and pack.take_had() == [True, True, False, True]
    assert all(p.grad is None for p in params)
    reference = params_with_grads()
    want = torch.full((world_size * row,), -7.0)
    had = []
    for (a, b), o, w in zip(columns, offsets, widths):
        had += _C.pack_param_grads(reference[a:b], numels[a:b], want, world_size, 2 + o, w, 0.5)
    assert had == [True, True, False, True] and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="does not follow the columns before it"):
        _C.GradPack(params, numels, [(0, 1, 0, 8), (2, 4, 8, 4)])


def test_hand_out_grads_sets_views_then_adds():
    p = nn.Parameter(torch.zeros(2, 3))
    q = nn.Parameter(torch.zeros(4))
    empty = nn.Parameter(torch.zeros(0))  # a parameter with no part on this rank
    reduced = torch.arange(12, dtype=torch.float32)
    output = reduced[1:]  # a view with an offset, as a unit's part of a batch's output is
    _C.hand_out_grads(output, [p, q, empty], [0, 7, 11])
    assert p.grad.shape == (2, 3) and p.grad.data_ptr() == output.data_ptr()  # a view, no copy
    assert torch.equal(p.grad, torch.arange(1.0, 7).view(2, 3))
    assert torch.equal(q.grad, torch.tensor([8.0, 9, 10, 11])) and q.grad.data_ptr() == reduced[8:].data_ptr()
    assert empty.grad.shape == (0,)
    kept = q.grad
    _C.hand_out_grads(torch.ones(5), [q], [1])
    assert q.grad is kept and torch.equal(kept, torch.tensor([9.0, 10, 11, 12]))
    with pytest.raises(RuntimeError, match=r"tensor 0 .* at offset 2 does not fit the output"):
        _C.hand_out_grads(torch.ones(5), [q], [2])
    with pytest.raises(RuntimeError, match="does not fit"):
        _C.hand_out_grads(torch.ones(5, dtype=torch.float64), [q], [0])
    with pytest.raises(RuntimeError, match="2 tensors but 1 offsets"):
        _C.hand_out_grads(torch.ones(5), [p, q], [0])


def test_reduce_inputs_wait_for_all_but_the_last_two_then_let_go():
    """[Note: reduce inputs on a device]: each launch waits for the
    reductions launched before the previous one, then lets go of their
    inputs (waited first: the wait orders the stream before the memory is
    reused); the last two stay held until the end of backward."""
    from pydist.fsdp._fsdp_schedule import ReduceInputs

    events = []

    class Future:
        def __init__(self, i):
            self.i = i

        def wait(self):
            events.append(("wait", self.i))

    held = ReduceInputs()
    for i in range(5):
        held.launched(Future(i), lambda i=i: events.append(("let go", i)))
    assert events == [("wait", 0), ("let go", 0), ("wait", 1), ("let go", 1), ("wait", 2), ("let go", 2)]
    held.clear()
    held.launched(Future(5), lambda: events.append(("let go", 5)))
    assert len(events) == 6, "a new backward waits for nothing of the last one"


def test_pieces_like_views_in_each_shape():
    reduced = torch.arange(12, dtype=torch.float32)
    output = reduced[1:]
    a, b, c = _C.pieces_like(output, [torch.empty(2, 3), torch.empty(4), torch.empty(0, 5)], [0, 7, 11])
    assert a.shape == (2, 3) and a.stride() == (3, 1) and a.data_ptr() == output.data_ptr()
    assert torch.equal(a, torch.arange(1.0, 7).view(2, 3)) and torch.equal(b, torch.tensor([8.0, 9, 10, 11]))
    assert c.shape == (0, 5)
    with pytest.raises(RuntimeError, match=r"tensor 1 .* at offset 8 does not fit the output"):
        _C.pieces_like(output, [torch.empty(1), torch.empty(4)], [0, 8])


# --------------------------------------------------------------------------
# Against torch's fully_shard, on spawned ranks
# --------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.lin(x))


class TwoInputs(nn.Module):
    """A unit that takes two tensors: its post-backward comes from the Function."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, a, b):
        return torch.tanh(self.lin(a)) * b


class MixedBatch(nn.Module):
    """Six small units that the default reduce plan batches together, with
    a frozen unit (blocks.1) and a partly frozen one (blocks.3: its norm's
    weight) among them, a residual around blocks.2, and a unit of two inputs."""

    def __init__(self, dim: int = 8, out: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(5)])
        self.blocks[1].requires_grad_(False)
        self.blocks[3].norm.weight.requires_grad_(False)
        self.two = TwoInputs(dim)
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        h = self.blocks[0](x)  # the first unit: its input needs no grad (the final callback's)
        h = self.blocks[1](h)  # frozen, chained
        h = h + self.blocks[2](h)  # its input's hook fires after the residual's backward too
        h = self.blocks[3](h)
        h = self.blocks[4](h)
        return self.head(self.two(h, h))

    def units(self):
        return list(self.blocks) + [self.two]


class DetachedInput(nn.Module):
    """A unit that uses its input only through ``.detach()``: its input's
    hook fires without its backward having to run first."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.lin(x.detach()))


class DetachChain(nn.Module):
    def __init__(self, dim: int = 8, out: int = 4):
        super().__init__()
        self.first, self.detached, self.last = Block(dim), DetachedInput(dim), Block(dim)
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        h = self.first(x)
        return self.head(self.last(self.detached(h)) + h)

    def units(self):
        return [self.first, self.detached, self.last]


@pytest.mark.timeout(150)
def test_mixed_batches_bitwise_with_torch_fully_shard():
    from fsdp_harness import Scenario, assert_parity, run_parity

    scenarios = [
        Scenario(model="mixed_batch", optimizer="adam", shm=True),
        Scenario(model="mixed_batch", optimizer="sgd", shm=False),
        Scenario(model="mixed_batch", optimizer="sgd", micro_steps=3, shm=True),
        Scenario(model="mixed_batch", optimizer="adam", reshard_after_forward=False, shm=True),
        Scenario(model="mixed_batch", optimizer="adam", mixed=True, micro_steps=2, shm=True),
        Scenario(model="detach_chain", optimizer="adam", shm=True),
        Scenario(model="detach_chain", optimizer="sgd", reshard_after_forward=False, shm=False),
    ]
    results = run_parity(scenarios, 2, timeout=140, models={"mixed_batch": MixedBatch, "detach_chain": DetachChain})
    assert_parity(results, exact=True, scenarios=scenarios)


class Gated(nn.Module):
    """A unit whose ``extra`` layer runs only where ``use_extra`` is set."""

    def __init__(self, dim: int):
        super().__init__()
        self.body = nn.Linear(dim, dim)
        self.extra = nn.Linear(dim, dim)
        self.use_extra = True

    def forward(self, x):
        x = torch.tanh(self.body(x))
        return self.extra(x) if self.use_extra else x


def _some_ranks_rank(rank, world_size, batch_bytes):
    from test_fsdp_units import step_on_averaged_grads

    from pydist import fully_shard
    from pydist.fsdp import full_state_dict, last_iteration_record

    torch.manual_seed(0)
    plain = nn.Sequential(*[Gated(6) for _ in range(4)])
    model = nn.Sequential(*[Gated(6) for _ in range(4)])
    model.load_state_dict(plain.state_dict())
    # blocks 1 and 2 use `extra` on odd ranks only: inside one batch, and
    # their post-backward comes from the next unit's output hook
    for m in (plain, model):
        for i in (1, 2):
            m[i].use_extra = rank % 2 == 1
    for block in model:
        fully_shard(block, shm=True)
    fully_shard(model, shm=True)
    model.set_collective_batch_bytes(batch_bytes)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randint(-2, 3, (4, 6), generator=g).float().requires_grad_()  # the first unit takes the Function
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        plain(x.detach().requires_grad_()).sum().backward()
        step_on_averaged_grads(plain, plain_opt, world_size)
    got = full_state_dict(model)
    scatters = [r for r in last_iteration_record(model).collectives if r.kind == "reduce_scatter"]
    return {"match": {n: torch.equal(p.detach(), got[n]) for n, p in plain.named_parameters()},
            "launches": len({r.issued_ns for r in scatters}), "units": sorted(r.unit for r in scatters)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("batch_bytes", [0, 1 << 20], ids=["alone", "batched"])
def test_parameter_used_on_some_ranks_inside_a_batch(batch_bytes):
    for rank, out in enumerate(run_ranks(_some_ranks_rank, 2, args=(batch_bytes,), timeout=60)):
        assert all(out["match"].values()), f"rank {rank}: {out['match']}"
        assert out["units"] == ["0", "1", "2", "3"], out["units"]  # the root manages no parameter
        # batched: the four blocks as one reduce-scatter (block 0's input needs
        # grad, so its post-backward comes from inside backward too)
        assert out["launches"] == (1 if batch_bytes else 4), out
