"""The pieces of pydist's FSDP on their own: the unit's flat layout (in one
process), the collectives on both transports with integer-valued floats
(exact answers), the keywords not implemented (and CPUOffloadPolicy where
it asks for nothing), and the module methods."""

import pytest
import torch
import torch.nn as nn

from pydist import _C
from pydist.fsdp import FSDPParamGroup, fully_shard
from pydist.fsdp import _fsdp_collectives as collectives
from pydist.fsdp._fsdp_param import ParamModuleInfo
from pydist.spawn import run_ranks


def _named(module):
    return [(n, p, [ParamModuleInfo(*_owner(module, n))]) for n, p in module.named_parameters()]


def _owner(module, fqn):
    *path, name = fqn.split(".")
    for part in path:
        module = getattr(module, part)
    return module, name


def torch_fsdp2_padded_numel(params, world_size):
    """What FSDP2's per-parameter dim-0 sharding holds in total (padding included)."""
    total = 0
    for p in params:
        rows = -(-p.shape[0] // world_size) * world_size
        total += rows * (p.numel() // p.shape[0])
    return total


@pytest.mark.parametrize("world_size", [2, 4, 3])
def test_layout_pads_only_at_the_unit_end(world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(255, 1), nn.Linear(1, 255))  # 1 and 255 rows: bad for dim-0 sharding
    full = [p.detach().clone() for p in model.parameters()]
    total = sum(p.numel() for p in full)
    flat = torch.cat([p.reshape(-1) for p in full])
    shards = []
    for rank in range(world_size):
        m = nn.Sequential(nn.Linear(255, 1), nn.Linear(1, 255))
        m.load_state_dict(dict(zip(["0.weight", "0.bias", "1.weight", "1.bias"], full)))
        pg = FSDPParamGroup(_named(m), rank, world_size, sharded=True, reshard_after_forward=True, label="m")
        assert pg.padded_numel - total < world_size  # at most N - 1 padding elements, all at the end
        assert pg.shard_numel == -(-total // world_size)
        shards.append(pg.shard.clone())
        # each parameter the module now holds is this rank's slice of its flattened self
        for fp in pg.fsdp_params:
            assert m.get_parameter(fp.fqn) is fp.sharded_param and fp.sharded_param.dim() == 1
            want = flat[fp.local_start:fp.local_end]
            assert torch.equal(fp.sharded_param.detach(), want), fp
            assert fp.sharded_param.untyped_storage().data_ptr() == pg.shard.untyped_storage().data_ptr()
        assert pg.persistent_bytes() == pg.shard_numel * 4
    gathered = torch.cat(shards)
    assert torch.equal(gathered[:total], flat) and not gathered[total:].any()
    # torch FSDP2 pads every parameter's dim 0: about 2x here at 4 ranks
    if world_size == 4:
        assert torch_fsdp2_padded_numel(full, world_size) >= 1.49 * total > pg.padded_numel


def test_unimplemented_keywords_name_themselves():
    from torch.distributed.fsdp import CPUOffloadPolicy

    m = nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="mixed precision with NO_SHARD"):
        FSDPParamGroup(_named(m), 0, 2, sharded=False, reshard_after_forward=False, label="m", param_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="pin_memory"):
        fully_shard(m, offload_policy=CPUOffloadPolicy())  # (pin_memory=True: torch pins the CPU shards)
    with pytest.raises(NotImplementedError, match="shard_placement_fn"):
        fully_shard(m, shard_placement_fn=lambda p: None)
    with pytest.raises(NotImplementedError, match="reshard_after_forward"):
        fully_shard(m, reshard_after_forward=2)


def _marked_rank(rank, world_size):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    marked = {}
    for impl, shard in (("torch", torch_fully_shard), ("pydist", fully_shard)):
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
        shard(model[1])
        shard(model)
        marked[impl] = {name: (getattr(m, "_is_fsdp_managed_module", False), getattr(m, "_fsdp_use_orig_params", False))
                        for name, m in model.named_modules()}
    return marked


@pytest.mark.timeout(60)
def test_modules_are_marked_fsdp_managed_as_torchs():
    """Libraries ask torch's way (Hugging Face's generate() turns on
    synced_gpus for such a model; without it a rank that finished first left
    the others waiting in an all-gather)."""
    for marked in run_ranks(_marked_rank, 2, timeout=50):
        assert marked["pydist"] == marked["torch"], marked
        assert all(v == (True, True) for v in marked["torch"].values())


def _offload_rank(rank, world_size):
    """torch's CPUOffloadPolicy(pin_memory=False) on a unit on the CPU, where
    torch's FSDP2 runs as without it: the parameters after 3 Adam steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    for impl, shard in (("torch", torch_fully_shard), ("pydist", fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        kwargs = {"mesh": init_device_mesh("cpu", (world_size,))} if impl == "torch" else {}
        shard(model[0], offload_policy=CPUOffloadPolicy(pin_memory=False), **kwargs)
        shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False), **kwargs)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(rank * 10 + step)
            model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        out[impl] = [p.full_tensor() for p in model.parameters()]
    return out


@pytest.mark.timeout(60)
def test_cpu_offload_policy_on_the_cpu_as_torchs():
    for out in run_ranks(_offload_rank, 2, timeout=50):
        for mine, theirs in zip(out["pydist"], out["torch"]):
            assert torch.equal(mine, theirs)


def _collectives_rank(rank, world_size, shm):
    import torch.distributed as dist

    t = collectives.open_transport(dist.group.WORLD, [torch.empty(0)], shm=shm)
    out = {"name": t.name}
    # all-gather: rank r's shard holds 100*r + i
    shard = torch.arange(5, dtype=torch.float32) + 100 * rank
    full = torch.empty(5 * world_size)
    collectives.all_gather_unit(t, shard, full).wait()
    out["gathered"] = full
    # reduce-scatter of a unit laid out as [g0 (6), gap (3), g1 (4)] + padding
    g0 = torch.full((2, 3), float(rank + 1))
    g1 = torch.arange(4, dtype=torch.float32) * (rank + 1)
    grads, numels = [g0, None, g1], [6, 3, 4]
    shard_numel = -(-13 // world_size)
    def pack(grads, out, world_size, column, scale):
        _C.pack_rank_major(grads, numels, out, world_size, column, shard_numel, scale)

    rs = collectives.reduce_scatter_grads(t, pack, grads, shard_numel, torch.float32)
    rs.future.wait()
    out["rs"] = rs.output
    ar = collectives.all_reduce_grads(t, grads, numels, 13, torch.float32)
    ar.future.wait()
    out["ar"] = ar.output
    out["sum"] = collectives.all_reduce_sum(t, torch.tensor([float(rank + 1)]))
    out["small"] = collectives.all_gather_small(t, torch.tensor([float(rank)]))
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_collectives_exact(shm):
    world_size = 2
    results = run_ranks(_collectives_rank, world_size, args=(shm,), timeout=60)
    n = world_size
    mean = sum(range(1, n + 1)) / n  # ranks scale by rank + 1: the average multiplier
    want_full = torch.cat([torch.arange(5, dtype=torch.float32) + 100 * r for r in range(n)])
    layout = torch.cat([torch.full((6,), mean), torch.zeros(3), torch.arange(4, dtype=torch.float32) * mean])
    padded = torch.cat([layout, torch.zeros(-(-13 // n) * n - 13)])
    for rank, out in enumerate(results):
        assert out["name"] == ("shm" if shm else "gloo")
        assert torch.equal(out["gathered"], want_full)
        s = -(-13 // n)
        assert torch.equal(out["rs"], padded[rank * s:(rank + 1) * s]), (rank, out["rs"])
        assert torch.equal(out["ar"], layout)
        assert out["sum"].item() == sum(range(1, n + 1))
        assert torch.equal(out["small"].reshape(-1), torch.arange(n, dtype=torch.float32))


class SometimesUsed(nn.Module):
    """One unit whose ``extra`` layer only odd ranks use."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.extra = nn.Linear(6, 6)

    def forward(self, x, use_extra: bool):
        x = self.body(x)
        return self.extra(x) if use_extra else x


def _unused_and_memory_rank(rank, world_size, _unused):
    import torch.distributed as dist

    from pydist.fsdp import full_state_dict, persistent_bytes

    # --- a parameter used on some ranks only: its gradient is the average
    # over the ranks with zeros where it was not used (never a hang). The
    # oracle: each rank's plain gradients, averaged by hand.
    torch.manual_seed(0)
    plain = SometimesUsed()
    model = SometimesUsed()
    model.load_state_dict(plain.state_dict())
    fully_shard(model)
    use_extra = rank % 2 == 1
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(-2, 3, (4, 6), generator=g).float()
    plain(x, use_extra).sum().backward()
    local = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in plain.named_parameters()}
    every = [None] * world_size
    dist.all_gather_object(every, local)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(x, use_extra).sum().backward()
    opt.step()
    expected = {n: p.detach() - sum(e[n] / world_size for e in every) for n, p in plain.named_parameters()}
    got = full_state_dict(model)
    unused = {n: torch.equal(expected[n], got[n]) for n in expected}

    # --- persistent bytes: the shards, their gradients and Adam's state, and
    # no more; the unsharded buffers hold nothing between iterations.
    torch.manual_seed(0)
    big = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    psi = sum(p.numel() for p in big.parameters())
    for layer in big:
        fully_shard(layer)
    fully_shard(big)
    opt = torch.optim.Adam(big.parameters(), lr=1e-3)
    pool_peak = []  # what the pool held when the root released it, each step
    for _ in range(2):
        big(torch.randn(3, 64)).sum().backward()
        opt.step()
        if not pool_peak:  # the first forward opened the pool
            pool = big._pydist_fsdp_state.schedule.pool
            release = pool.release
            pool.release = lambda: (pool_peak.append(pool.nbytes), release())
    measured = persistent_bytes(big, opt)
    units = [layer._pydist_fsdp_state.param_group for layer in big]
    unsharded_bytes = sum(u.unsharded.untyped_storage().nbytes() for u in units)
    shard_bytes = sum(u.shard_numel * 4 for u in units)
    local_numel = sum(p.to_local().numel() for p in big.parameters())  # DTensors: this rank's chunks
    adam_bytes = 2 * 4 * local_numel + 4 * sum(1 for _ in big.parameters())  # exp_avg, exp_avg_sq, step
    pool_bytes = sum(slot.memory.untyped_storage().nbytes() for slot in pool.slots if slot.memory is not None)
    largest_batch = sum(-(-u.padded_numel * 4 // 64) * 64 for u in units)  # this small model gathers in one batch
    # --- per-unit records of an iteration of a nested model on shared memory
    import torch.nn.functional as F

    from fsdp_harness import Nested
    from pydist.fsdp import last_iteration_record

    records = {}
    for batch_bytes in (0, 6000, None):  # each unit alone, pairs (a Block 648 floats, its inner 600), the default
        torch.manual_seed(0)
        nested = Nested()
        for m in nested.units():
            fully_shard(m, shm=True)
        fully_shard(nested, shm=True)
        if batch_bytes is not None:
            nested.set_collective_batch_bytes(batch_bytes)
        for _ in range(2):
            F.mse_loss(nested(torch.randn(4, 8)), torch.randn(4, 4)).backward()
        records[batch_bytes] = last_iteration_record(nested)
    # A unit already unsharded when the root first cuts the forward's batches
    # (the second forward) stays out of them that time; the next forward,
    # every unit SHARDED again, gathers the whole model in one batch again
    # (that layout is not the one the next plans reuse).
    torch.manual_seed(0)
    nested = Nested()
    for m in nested.units():
        fully_shard(m, shm=True)
    fully_shard(nested, shm=True)
    for i in range(3):
        if i == 1:
            nested.blocks[1].unshard()
        F.mse_loss(nested(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    regathered = last_iteration_record(nested)
    # FSDP2's module methods: an explicit unshard shows full parameters, reshard the shards
    block = nested.blocks[1]
    handle = block.unshard(async_op=True)
    handle.wait()
    shapes = [tuple(block.proj.weight.shape)]
    block.reshard()
    shapes.append(tuple(block.proj.weight.to_local().shape))
    return {
        "shapes": shapes,
        "records": records,
        "regathered": regathered,
        "unused_match": unused,
        "persistent": tuple(measured),
        "expected": (shard_bytes, shard_bytes, adam_bytes, pool_bytes),
        "pool_bound": 2 * largest_batch,
        "pool_peak": max(pool_peak),
        "unsharded_bytes": unsharded_bytes,
        "psi": psi,
    }


@pytest.mark.timeout(90)
def test_unused_on_some_ranks_and_persistent_bytes():
    world_size = 2
    for rank, out in enumerate(run_ranks(_unused_and_memory_rank, world_size, args=(None,), timeout=60)):
        assert all(out["unused_match"].values()), f"rank {rank}: {out['unused_match']}"
        assert out["persistent"] == out["expected"], f"rank {rank}: (params, grads, optimizer, pools) {out['persistent']}"
        assert out["unsharded_bytes"] == 0
        assert out["persistent"][3] == 0, f"rank {rank}: the pool holds {out['persistent'][3]} bytes after a step"
        assert 0 < out["pool_peak"] <= out["pool_bound"], f"rank {rank}: the pool held {out['pool_peak']} bytes"
        # The shards, gradients and Adam's state: 16 Psi / N, the pool freed between iterations.
        assert sum(out["persistent"]) <= 1.01 * 16 * out["psi"] / world_size
        for batch_bytes, record in out["records"].items():
            _check_records(record, batch_bytes)
        _check_records(out["regathered"], None)
        assert out["shapes"] == [(24, 24), (12, 24)], out["shapes"]  # resharded: this rank's dim-0 chunk of a DTensor


def _check_records(record, batch_bytes):
    """The shape of an iteration (see [Note: the order of an iteration] and
    [Note: gather and reduce plans]), units alone (batch_bytes 0), in small
    batches, or all in one (None: the default, for this small model)."""
    units = {"", "blocks.0", "blocks.0.inner", "blocks.1", "blocks.1.inner", "blocks.2", "blocks.2.inner"}
    by_kind: dict = {}
    for r in record.collectives:
        by_kind.setdefault((r.kind, r.phase), []).append(r)
        assert 0 < r.issued_ns <= r.completed_ns, r
    forward = by_kind[("all_gather", "forward")] + by_kind.get(("all_gather", "forward_prefetch"), [])
    assert sorted(r.unit for r in forward) == sorted(units), batch_bytes  # each unit once
    batch_issues = {r.issued_ns for r in forward}
    if batch_bytes is None:
        assert len(batch_issues) == 1, f"the default batch should gather this small model at once: {forward}"
    else:  # the second iteration gathers ahead, by the first iteration's order
        assert len(batch_issues) >= 3, forward
        assert by_kind.get(("all_gather", "forward_prefetch")), f"batch_bytes={batch_bytes}: no forward prefetch"
    prefetched = by_kind.get(("all_gather", "backward_prefetch"), []) + by_kind.get(("all_gather", "forward_prefetch"), [])
    assert all(r.issued_ns < r.needed_ns for r in prefetched)
    if batch_bytes is not None:
        assert by_kind.get(("all_gather", "backward_prefetch")), f"batch_bytes={batch_bytes}: backward prefetched nothing"
    scatters = by_kind[("reduce_scatter", "backward")]
    assert sorted(r.unit for r in scatters) == sorted(units)
    if batch_bytes == 0:
        assert len({r.issued_ns for r in scatters}) == len(units), scatters
    elif batch_bytes is not None:
        assert 1 < len({r.issued_ns for r in scatters}) < len(units), scatters
    end = record.backward_end_ns
    for r in scatters:
        assert r.needed_ns >= end, f"{r.unit}: its reduce-scatter was waited before backward ended"
        if r.unit == "":  # the root's inputs need no grad: the final callback launches it
            assert r.issued_ns >= end
        else:  # launched from inside backward, so it ran while autograd went on
            assert r.issued_ns < end, f"{r.unit} (batch_bytes={batch_bytes}): reduce-scatter launched only after backward"


def step_on_averaged_grads(plain: nn.Module, opt, world_size: int) -> None:
    """The oracle of a sharded step: every rank's plain gradients (zeros where
    a parameter got none), averaged by hand, then ``opt`` steps."""
    import torch.distributed as dist

    every = [None] * world_size
    dist.all_gather_object(every, {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                                   for n, p in plain.named_parameters()})
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.grad = sum(e[n] / world_size for e in every)
    opt.step()
    opt.zero_grad()


class Skipping(nn.Module):
    """Four units in a row; ``skip`` leaves one out (the same on every rank)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x, skip: int | None = None):
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = torch.tanh(layer(x))
        return x


def _skipped_unit_rank(rank, world_size, batch_bytes):
    """A unit the plan gathers ahead (last iteration's order) whose forward
    does not come this time: resharded at the root's post-forward, skipped
    by backward's reduce batches, and training matches a plain model."""
    from pydist.fsdp import full_state_dict
    from pydist.fsdp._fsdp_param_group import ShardedState

    torch.manual_seed(0)
    plain = Skipping()
    model = Skipping()
    model.load_state_dict(plain.state_dict())
    for layer in model.layers:
        fully_shard(layer, shm=True)
    fully_shard(model, shm=True)
    model.set_collective_batch_bytes(batch_bytes)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(rank)
    after_forward = []
    for skip in (None, 2, None, 1):
        x = torch.randint(-2, 3, (4, 8), generator=g).float()
        out = model(x, skip)
        unit = model.layers[skip]._pydist_fsdp_state.param_group if skip is not None else None
        if unit is not None:
            after_forward.append((unit.sharded_state == ShardedState.SHARDED,
                                  unit.unsharded.untyped_storage().nbytes(),
                                  type(model.layers[skip].weight).__name__))
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        plain(x, skip).sum().backward()
        step_on_averaged_grads(plain, plain_opt, world_size)
    got = full_state_dict(model)
    return {"after_forward": after_forward,
            "match": {n: torch.equal(p.detach(), got[n]) for n, p in plain.named_parameters()}}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("batch_bytes", [0, 1 << 20], ids=["alone", "batched"])
def test_unit_gathered_ahead_and_skipped(batch_bytes):
    for rank, out in enumerate(run_ranks(_skipped_unit_rank, 2, args=(batch_bytes,), timeout=60)):
        assert out["after_forward"] == [(True, 0, "DTensor")] * 2, f"rank {rank}: {out['after_forward']}"  # the shard
        assert all(out["match"].values()), f"rank {rank}: {out['match']}"


def _fast_path_rank(rank, world_size):
    """Units with an output cast or forward-prefetch targets, and the root,
    take the hooks' general path; the others the fast path (see [Note: the
    hooks' fast path]); training matches a plain model either way, with a
    no_grad forward and a skipped unit between."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from pydist.fsdp import full_state_dict

    torch.manual_seed(0)
    plain = Skipping()
    model = Skipping()
    model.load_state_dict(plain.state_dict())
    for i, layer in enumerate(model.layers):
        fully_shard(layer, shm=True, mp_policy=MixedPrecisionPolicy(output_dtype=torch.float32) if i == 1 else None)
    fully_shard(model, shm=True)
    model.layers[2].set_modules_to_forward_prefetch([model.layers[3]])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(rank)
    for skip in (None, 0, None):
        x = torch.randint(-2, 3, (4, 8), generator=g).float()
        with torch.no_grad():
            model(x)
        model(x, skip).sum().backward()
        opt.step()
        opt.zero_grad()
        plain(x, skip).sum().backward()
        step_on_averaged_grads(plain, plain_opt, world_size)
    got = full_state_dict(model)
    return {"plain": [layer._pydist_fsdp_state.plain for layer in model.layers] + [model._pydist_fsdp_state.plain],
            "match": {n: torch.equal(p.detach(), got[n]) for n, p in plain.named_parameters()}}


@pytest.mark.timeout(90)
def test_hooks_fast_path_only_for_plain_units():
    for rank, out in enumerate(run_ranks(_fast_path_rank, 2, timeout=60)):
        assert out["plain"] == [True, False, False, True, False], f"rank {rank}: {out['plain']}"
        assert all(out["match"].values()), f"rank {rank}: {out['match']}"


def test_exposed_time_counts_a_batched_wait_once():
    """The members of one batched collective each record its one wait: the
    iteration's exposed time is the union of the waits, not their sum."""
    from pydist.fsdp._fsdp_param_group import CollectiveRecord
    from pydist.fsdp._utils import IterationRecord

    batch = [CollectiveRecord(f"blocks.{i}", "reduce_scatter", "backward", 0, 100, 160) for i in range(3)]
    alone = CollectiveRecord("out", "all_gather", "forward", 0, 10, 30)
    overlapping = CollectiveRecord("inp", "all_gather", "forward", 0, 150, 190)  # ends 30 ns after the batch
    unstamped = CollectiveRecord("root", "all_gather", "forward", 0, 500, -1)
    record = IterationRecord(batch + [alone, overlapping, unstamped], backward_end_ns=200)
    assert [r.exposed_ns for r in batch] == [60, 60, 60]
    assert record.exposed_ns() == 20 + 60 + 30


UNIT_ROWS, UNITS = 128, 30  # Linear(128, 128): 66,048 unsharded bytes a unit


def _forward_batches_rank(rank, world_size):
    """How many all-gathers the root's second forward issues for UNITS
    equal units under the default batch size, and that default."""
    from pydist.fsdp import last_iteration_record
    from pydist.fsdp._fsdp_schedule import default_batch_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(UNIT_ROWS, UNIT_ROWS) for _ in range(UNITS)])
    for layer in model:
        fully_shard(layer, shm=True)
    fully_shard(model, shm=True)
    for _ in range(2):  # the first forward learns the order; the second gathers by the plan
        model(torch.randn(2, UNIT_ROWS)).sum().backward()
    gathers = [r for r in last_iteration_record(model).collectives
               if r.kind == "all_gather" and r.phase in ("forward", "forward_prefetch")]
    return len({r.issued_ns for r in gathers}), default_batch_bytes(world_size)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_default_batch_grows_with_the_sharding_ranks(world_size):
    """256 KiB of each rank's shard per collective, up to 2 MiB: 7 units a
    batch at 2 ranks, 15 at 4 (a fixed 2 MiB would gather all 30 in one), so
    a backward's transient memory (two pool slots, two reduce inputs) stays
    small where the collectives are cheap. See BATCH_BYTES_PER_RANK."""
    unit_bytes = (UNIT_ROWS * UNIT_ROWS + UNIT_ROWS) * 4
    for batches, default in run_ranks(_forward_batches_rank, world_size, timeout=100):
        assert default == min(256 * 1024 * world_size, 2 << 20)
        per_batch = default // unit_bytes
        assert batches == -(-UNITS // per_batch) == {2: 5, 4: 2}[world_size], (batches, default)
