"""The unshard pool (see [Note: the unsharded buffer's memory] in
pydist/fsdp/_fsdp_param_group.py): during training the units' unsharded
storages point into at most POOL_SLOTS slots, no two live buffers share a
byte, and the slots stop growing after the first step; no two reduce
batches hold one input's bytes, and later batches reuse earlier inputs; a long run that
changes reshard_after_forward, explicit unshard, prefetch targets and
reshard_after_backward between steps (one of them inside a unit's forward,
after it borrowed a slot) stays bitwise torch FSDP2's at two ranks; and the pool's guards raise on a slot handed out twice, on units
placed over one another and on a storage re-pointed behind pydist's back."""

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks

D = 16


class Chain(nn.Module):
    """Eight flat units, then a unit with a nested unit inside it (the parent
    stays unsharded while its child computes), around root parameters.
    ``probe`` (pydist's run only) is called between the blocks in forward
    and backward, and inside each block in both."""

    def __init__(self, n: int = 8):
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(n)])
        self.outer = nn.Sequential(nn.Linear(D, D), nn.Sequential(nn.Linear(D, D), nn.Tanh()))
        self.out = nn.Linear(D, 2)
        self.probe = None

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
            if self.probe is not None:
                x = _Probe.apply(x, self.probe)
        return self.out(self.outer(x))

    def units(self):
        return [*self.blocks, self.outer[1], self.outer]


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probe):
        ctx.probe = probe
        probe()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.probe()
        return grad, None


class PoolProbe:
    """Looks at every unit's unsharded storage: which slot (or its own
    memory) each live one is in, that no two overlap, how many slots are live."""

    def __init__(self, model):
        from pydist.fsdp._utils import _units

        self.units = _units(model)
        self.samples = 0
        self.pooled = 0  # live buffers of units other than the root seen in a slot
        self.owning = 0  # ... seen in memory of their own (the root always owns its: not counted)
        self.max_live_slots = 0
        self.problems: list[str] = []
        self.step = 0  # set by the training loop
        self.owning_by_step: dict[int, int] = {}
        self.root_state = model._pydist_fsdp_state
        self.inputs_passed_on = 0  # the most reduce batches seen (in one backward) to have passed their input on

    def __call__(self):
        pool = self.units[0].pool
        live = []
        for pg in self.units:
            storage = pg.unsharded.untyped_storage()
            if storage.nbytes():
                live.append((storage.data_ptr(), storage.nbytes(), pg))
        live.sort(key=lambda t: t[0])
        for (a, n, pa), (b, _, pb) in zip(live, live[1:]):
            if a + n > b:
                self.problems.append(f"{pa.label!r} [{a:#x}, +{n}) overlaps {pb.label!r} at {b:#x}")
        slots = set()
        for ptr, n, pg in live:
            holder = [s for s in pool.slots
                      if s.memory is not None and s.memory.data_ptr() <= ptr and ptr + n <= s.memory.data_ptr() + s.nbytes]
            if pg._slot is None:
                self.owning += not pg.is_root
                self.owning_by_step[self.step] = self.owning_by_step.get(self.step, 0) + (not pg.is_root)
                if holder:
                    self.problems.append(f"{pg.label!r} owns its memory but points into slot {holder[0].index}")
            else:
                self.pooled += 1
                slots.add(pg._slot.index)
                if holder != [pg._slot]:
                    self.problems.append(f"{pg.label!r} is placed in slot {pg._slot.index} but points at {ptr:#x}")
        self.samples += 1
        self.max_live_slots = max(self.max_live_slots, len(slots))
        self._check_grad_batch_inputs()

    def _check_grad_batch_inputs(self):
        """The reduce batches of this backward: no two hold one input's bytes
        (a batch takes an earlier one's input only once its collective is
        done, and the earlier one lets go of it); counts the inputs passed on."""
        batches = self.root_state.schedule.grad_batches
        held = sorted((b.input.data_ptr(), b.input.numel() * b.input.element_size(), i)
                      for i, b in enumerate(batches) if b.input is not None)
        for (a, n, i), (b, _, j) in zip(held, held[1:]):
            if a + n > b:
                self.problems.append(f"grad batches {i} and {j} hold overlapping inputs at {a:#x}, {b:#x}")
        passed_on = sum(b.launched and b.input is None and b.future is not None for b in batches)
        self.inputs_passed_on = max(self.inputs_passed_on, passed_on)

    def hook_blocks(self, model):
        """Samples inside each unit's forward, and in its backward."""

        def inside(module, args, output):
            self()
            if output.requires_grad:
                output.register_hook(lambda grad: self())

        for block in model.units():
            block[0].register_forward_hook(inside)


def _build(impl, world_size, mixed):
    import pydist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    model = Chain()
    shard = torch_fully_shard if impl == "torch" else pydist.fully_shard
    kwargs = {"mesh": init_device_mesh("cpu", (world_size,))} if impl == "torch" else {}
    if mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in model.units():
        shard(unit, **kwargs)
    return shard(model, **kwargs)


def _full(impl, model) -> dict:
    import pydist

    if impl == "torch":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {k: v.clone() for k, v in pydist.fsdp.full_state_dict(model).items()}


# What changes before each step, applied the same way to both implementations.
def _change(model, step: int) -> list:
    """Returns the micro-batches of the step as (sync, reshard_after_backward)."""
    blocks = model.blocks
    if step == 2:
        blocks[2].set_reshard_after_forward(False, recurse=False)  # stays unsharded into backward
    if step == 3:
        blocks[0].set_modules_to_forward_prefetch([blocks[1], blocks[3]])
        blocks[6].set_modules_to_backward_prefetch([blocks[5]])
    if step == 5:
        blocks[2].set_reshard_after_forward(True, recurse=False)
        model.outer.set_reshard_after_forward(False, recurse=False)  # the parent keeps its parameters
        blocks[0].set_modules_to_forward_prefetch([])
    if step == 7:
        model.outer.set_reshard_after_forward(True, recurse=False)
        # Told inside its forward, once unsharded (into a slot, for pydist),
        # not to reshard after it: pydist moves it out of the slot.
        def keep(module, args):
            blocks[3].set_reshard_after_forward(False, recurse=False)
            handle.remove()

        handle = blocks[3][0].register_forward_pre_hook(keep)
    if step == 8:
        blocks[3].set_reshard_after_forward(True, recurse=False)
    if step in (4, 6):  # gradient accumulation that keeps the units unsharded between micro-batches
        return [(False, False), (False, False), (True, True)]
    return [(True, True)]


def _train(rank, world_size, impl, mixed, steps):
    model = _build(impl, world_size, mixed)
    probe = None
    if impl == "pydist":
        model.set_collective_batch_bytes(2 * (D * D + D) * 4 + 64)  # two blocks per collective (fp32)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    log, slot_ptrs = [], []
    moved = [0]  # times blocks[3] left a pool slot while unsharded
    if impl == "pydist":
        pg = model.blocks[3]._pydist_fsdp_state.param_group
        leave_pool = pg._leave_pool

        def counting_leave_pool():
            moved[0] += pg._slot is not None
            leave_pool()

        pg._leave_pool = counting_leave_pool
    for step in range(steps):
        micro_batches = _change(model, step)
        if step == 1 and impl == "pydist":  # the first forward opened the pool: watch it from now on
            probe = PoolProbe(model)
            model.probe = probe
            probe.hook_blocks(model)
        if probe is not None:
            probe.step = step
        if step in (3, 6):
            model.blocks[4].unshard()  # explicit: forward finds it unsharded
        for sync, reshard_after_backward in micro_batches:
            model.set_requires_gradient_sync(sync)
            model.set_reshard_after_backward(reshard_after_backward)
            model(torch.randn(4, 8, generator=gen)).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        log.append(_full(impl, model))
        if impl == "pydist":
            slot_ptrs.append([s.memory.data_ptr() if s.memory is not None else 0
                              for s in model.blocks[0]._pydist_fsdp_state.param_group.pool.slots])
    out = {"params": log}
    if probe is not None:
        out.update(samples=probe.samples, pooled=probe.pooled, owning=probe.owning,
                   max_live_slots=probe.max_live_slots, problems=probe.problems, slot_ptrs=slot_ptrs,
                   owning_by_step=probe.owning_by_step, moved=moved[0], inputs_passed_on=probe.inputs_passed_on)
    return out


def _both(rank, world_size, mixed, steps):
    return {impl: _train(rank, world_size, impl, mixed, steps) for impl in ("torch", "pydist")}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mixed", [False, True])
def test_pool_bounded_and_mixed_settings_bitwise_torch_fsdp2(mixed):
    from pydist.fsdp._fsdp_schedule import POOL_SLOTS

    steps = 9
    for rank, out in enumerate(run_ranks(_both, 2, args=(mixed, steps), timeout=170)):
        ref, got = out["torch"], out["pydist"]
        for step, (r, g) in enumerate(zip(ref["params"], got["params"])):
            for k in r:
                assert torch.equal(g[k], r[k]), f"rank {rank}, step {step}: {k} differs from torch FSDP2"
        assert not got["problems"], f"rank {rank}: {got['problems'][:5]}"
        assert got["samples"] > 100
        assert 0 < got["max_live_slots"] <= POOL_SLOTS
        # Under the default settings (step 1) every unit but the root borrows
        # a slot; later steps keep units unsharded, unshard explicitly and set
        # prefetch targets, which own their memory.
        assert got["owning_by_step"].get(1, 0) == 0, got["owning_by_step"]
        assert got["pooled"] > 0 and got["owning"] > 0, (got["pooled"], got["owning"])
        # Reduce batches reuse the input of an earlier one whose collective is done.
        assert got["inputs_passed_on"] > 0, f"rank {rank}: no reduce batch took an earlier batch's input"
        assert got["moved"] == 1, f"rank {rank}: blocks.3 left the pool {got['moved']} times (step 7: once)"
        # Between iterations the pool holds nothing (released at the end of backward).
        assert all(ptrs == [0] * POOL_SLOTS for ptrs in got["slot_ptrs"]), got["slot_ptrs"]


# --- the guards, directly ---------------------------------------------------------


def _unit(n: int = 10):
    from pydist.fsdp._fsdp_param import ParamModuleInfo
    from pydist.fsdp._fsdp_param_group import FSDPParamGroup

    lin = nn.Linear(n, 1)
    named = [(name, p, [ParamModuleInfo(lin, name)]) for name, p in lin.named_parameters()]
    return FSDPParamGroup(named, rank=0, world_size=2, sharded=True, reshard_after_forward=True, label=f"lin{n}")


def test_pool_guards():
    from pydist import _C
    from pydist.fsdp._fsdp_schedule import UnshardPool

    pool = UnshardPool()
    a, b = _unit(10), _unit(6)
    slot = pool.take(a.unsharded_nbytes + 64 + b.unsharded_nbytes)
    slot.place(a, 0)
    assert a.unsharded.untyped_storage().data_ptr() == slot.memory.data_ptr()
    with pytest.raises(RuntimeError, match=r"before the end of the last unit placed \(48\)"):
        slot.place(b, 8)  # would share bytes with a
    slot.place(b, 64)
    # A slot with units in it is never handed out again: the pool skips it, and taking it directly raises.
    other = pool.take(16)
    assert other is not None and other is not slot and pool.take(16) is None
    with pytest.raises(RuntimeError, match=r"handed out again while units \['lin10', 'lin6'\]"):
        slot.take(16)
    # A storage that already points somewhere is never pointed again.
    with pytest.raises(RuntimeError, match="only while it holds no memory"):
        _C.point_storage_into(a.unsharded, other.memory, 0)
    # The slot is free only once its last unit gave its part back.
    slot.give_back(a)
    assert slot.taken and a.unsharded.untyped_storage().nbytes() == 0
    slot.give_back(b)
    assert not slot.taken and b._slot is None
    # A storage resized behind pydist's back while in a slot (it now owns
    # other memory) is reported when it gives the slot back.
    slot.take(16)
    slot.place(a, 0)
    a.unsharded.untyped_storage().resize_(a.unsharded_nbytes)
    with pytest.raises(RuntimeError, match="re-pointed"):
        slot.give_back(a)
    assert not slot.taken and a.unsharded.untyped_storage().nbytes() == 0
