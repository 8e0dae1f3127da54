"""Resident gradients against torch DDP: what a user can see of a .grad.

pydist moves a ``.grad`` that lives across iterations into its bucket slot,
so autograd accumulates straight into the bucket and nothing is copied in or
out ([Note: resident gradients] in csrc/reducer/reducer.h). These tests hold
it to torch's semantics for ``gradient_as_bucket_view=False``: the same
values bitwise (two ranks), grads that are not views and keep their own
storage, the same tensor objects updated in place, a view of ``.grad`` that
a user keeps still seeing every update, and an old ``.grad`` the user kept
after ``zero_grad(set_to_none=True)`` never written again. They also check
that the move really happens (the grads tile their buckets), so a change
that silently turns it off fails here.
"""

import pytest
import torch
import torch.distributed as dist

from ddp_harness import Scenario, assert_parity, run_parity
from pydist.spawn import run_ranks

WORLD_SIZES = [2, pytest.param(4, id="4ranks")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parity_when_grads_live_across_steps(world_size):
    # zero_grad(set_to_none=False): the grads become resident after the bucket
    # rebuild and stay so; with no_sync micro-batches they accumulate there
    scenarios = [
        Scenario(optimizer="sgd", steps=5, grads_to_none=False),
        Scenario(optimizer="adam", steps=4, grads_to_none=False, micro_steps=3, seed=1),
        Scenario(model="many_tiny", steps=4, grads_to_none=False, ddp_kwargs={"bucket_cap_mb": 0.01}, seed=2),
        # grads dropped every step: the 128 KB one moves in at each finalize
        Scenario(model="wide", optimizer="adam", steps=4, seed=3),
        Scenario(model="wide", steps=4, grads_to_none=False, micro_steps=2, seed=4),
    ]
    results = run_parity(scenarios, world_size)
    assert_parity(results, exact=(world_size == 2), scenarios=scenarios)


def _grads_tile_buckets(ddp) -> bool:
    """Every bucket's .grads lie back to back in one piece of memory."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    assert any(len(bucket) > 1 for bucket in ddp.bucket_indices()), "no bucket holds two grads: nothing to check"
    for bucket in ddp.bucket_indices():
        spans = sorted((params[i].grad.data_ptr(), params[i].grad.nbytes) for i in bucket)
        if any(start + size != nxt for (start, size), (nxt, _) in zip(spans, spans[1:])):
            return False
    return True


def _semantics_main(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from ddp_models import build_model
    from pydist import DistributedDataParallel

    models = {}
    for name, cls in (("torch", TorchDDP), ("pydist", DistributedDataParallel)):
        torch.manual_seed(0)
        models[name] = cls(build_model("mlp"), bucket_cap_mb=0.002)  # several buckets
    step_no = [0]

    def step(set_to_none: bool):
        # one backward on both wrappers; returns whether their grads agree bitwise
        step_no[0] += 1
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * step_no[0] + rank))
        for ddp in models.values():
            ddp.zero_grad(set_to_none=set_to_none)
            ddp(x).pow(2).sum().backward()
        pairs = zip(models["torch"].module.parameters(), models["pydist"].module.parameters())
        return all(torch.equal(a.grad, b.grad) for a, b in pairs)

    ddp = models["pydist"]
    params = list(ddp.module.parameters())
    facts = {"equal": [step(False) for _ in range(3)]}
    facts["tiled after 3 steps"] = _grads_tile_buckets(ddp)
    facts["not views"] = all(not p.grad._is_view() and p.grad._base is None for p in params)

    # the same tensor objects, updated in place, as torch does it
    objects = [p.grad for p in params]
    facts["equal"].append(step(False))
    facts["same objects"] = all(p.grad is g for p, g in zip(params, objects))

    # a view of .grad the user keeps goes on seeing every update; that grad
    # stays out of its bucket (it is shared), the others stay in
    kept_view = params[0].grad.view(-1)
    facts["equal"] += [step(False), step(False)]
    facts["kept view sees updates"] = torch.equal(kept_view, params[0].grad.view(-1))
    del kept_view

    # set_to_none with the old grads kept: they are never written again
    held = [p.grad for p in params]
    held_values = [g.clone() for g in held]
    facts["equal"] += [step(True), step(False), step(False)]
    facts["held untouched"] = all(torch.equal(h, v) for h, v in zip(held, held_values))
    facts["held are not the new grads"] = all(h is not p.grad for h, p in zip(held, params))
    del held

    # a grad the user assigns is the one that gets the average
    mine = [torch.zeros_like(p) for p in params]
    for p, g, ref in zip(params, mine, models["torch"].module.parameters()):
        p.grad = g
        ref.grad = torch.zeros_like(ref)
    facts["equal"] += [step(False), step(False)]
    facts["assigned grads kept"] = all(p.grad is g for p, g in zip(params, mine))
    facts["tiled again"] = _grads_tile_buckets(ddp)
    # storage of exactly its own bytes, as a fresh tensor has
    facts["own storage"] = all(p.grad.untyped_storage().nbytes() == p.grad.nbytes for p in params)
    dist.barrier()
    return facts


@pytest.mark.timeout(120)
def test_grads_keep_torch_semantics():
    for rank, facts in enumerate(run_ranks(_semantics_main, 2, timeout=100)):
        assert all(facts.pop("equal")), f"rank {rank}: grads differ from torch DDP's at some step"
        failed = [what for what, ok in facts.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


class _WithEmptyParam(torch.nn.Module):
    """An MLP with a zero-size parameter in its bucket (it gets a grad of zeros)
    and a weight large enough to move in even when its grad is new."""

    def __init__(self):
        super().__init__()
        from ddp_models import build_model

        self.mlp = build_model("wide")
        self.empty = torch.nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.mlp(x) + self.empty.sum()


def _zero_grad_after_forward_main(rank, world_size):
    # The order of many tutorials: forward, optimizer.zero_grad(), backward,
    # here while the user keeps every step's grads. Torch never writes a kept
    # grad again; pydist must not either, though the grads it drops at
    # zero_grad were resident in the bucket when forward ended.
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pydist import DistributedDataParallel

    models = {}
    for name, cls in (("torch", TorchDDP), ("pydist", DistributedDataParallel)):
        torch.manual_seed(0)
        models[name] = cls(_WithEmptyParam(), bucket_cap_mb=0.002)
    kept = {name: [] for name in models}
    equal = []
    for step in range(6):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for name, ddp in models.items():
            out = ddp(x)
            ddp.zero_grad(set_to_none=step % 2 == 1)  # both ways, after forward
            out.pow(2).sum().backward()
            kept[name].append([(p.grad, p.grad.clone()) for p in ddp.module.parameters()])
        pairs = zip(models["torch"].module.parameters(), models["pydist"].module.parameters())
        equal.append(all(torch.equal(a.grad, b.grad) for a, b in pairs))
    # which kept grads were written again later: torch's pattern (a kept grad
    # that stayed .grad through zero_grad(set_to_none=False) is) and pydist's
    written = {name: [[not torch.equal(g, v) for g, v in per_step] for per_step in kept[name]] for name in kept}
    # after the last step (set_to_none=True): the new 128 KB grad moved into
    # its bucket (a storage carved from the bucket cannot be resized), the
    # small ones were copied back into the tensors autograd made
    wide = models["pydist"].module.mlp
    moved = {name: not p.grad.untyped_storage().resizable() for name, p in wide.named_parameters()}
    dist.barrier()
    return {"equal": equal, "written": written, "moved": moved}


@pytest.mark.timeout(120)
def test_zero_grad_between_forward_and_backward():
    for rank, facts in enumerate(run_ranks(_zero_grad_after_forward_main, 2, timeout=100)):
        assert all(facts["equal"]), f"rank {rank}: grads differ from torch DDP's: {facts['equal']}"
        assert any(map(any, facts["written"]["torch"])) and not all(map(all, facts["written"]["torch"]))
        assert facts["moved"] == {name: name == "fc2.weight" for name in facts["moved"]}, facts["moved"]
        assert facts["written"]["pydist"] == facts["written"]["torch"], (
            f"rank {rank}: kept grads written again by pydist {facts['written']['pydist']}, "
            f"by torch {facts['written']['torch']}"
        )

