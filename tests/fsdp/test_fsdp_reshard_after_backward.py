"""``set_reshard_after_backward(False)`` against torch's FSDP2 at 2 ranks:
gradient accumulation whose no-sync micro-batches keep the units unsharded
after backward (so the next forward gathers nothing for them), then a synced
micro-batch with resharding, then the optimizer step. Compared per
micro-batch: which units are unsharded after backward, and how many units
the next forward all-gathers (torch: its ``foreach_all_gather`` calls,
pydist: its records); and the parameters bitwise after every step. See
[Note: resharding after backward] in pydist/fsdp/_fsdp_param_group.py."""

import pytest
import torch

from pydist.spawn import run_ranks
from test_fsdp_training_changes import _build, _full


def _torch_units(model) -> dict:
    """Unit name -> whether its parameters are unsharded now (torch)."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "_get_fsdp_state"):
            pg = m._get_fsdp_state()._fsdp_param_group
            if pg is not None:
                out[name] = pg.is_unsharded
    return out


def _pydist_units(model) -> dict:
    from pydist.fsdp._fsdp_param_group import ShardedState

    out = {}
    for name, m in model.named_modules():
        state = m.__dict__.get("_pydist_fsdp_state")
        if state is not None and state.param_group is not None:
            out[name] = state.param_group.sharded_state == ShardedState.UNSHARDED
    return out


def _run(rank, world_size, impl, which, mixed):
    import pydist
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as torch_pg

    model = _build(impl, world_size, mixed)
    keep = [model] if which == "all" else [model.blocks[1]]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    gathers = [0]
    if impl == "torch":
        real = torch_pg.foreach_all_gather

        def counting(*args, **kwargs):
            gathers[0] += 1
            return real(*args, **kwargs)

        torch_pg.foreach_all_gather = counting
    units = _torch_units if impl == "torch" else _pydist_units
    log = []
    try:
        for _ in range(3):
            for sync in (False, False, True):
                model.set_requires_gradient_sync(sync)
                for m in keep:
                    m.set_reshard_after_backward(sync, recurse=(which == "all"))
                gathers[0] = 0
                loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).sum()
                if impl == "pydist":
                    record = pydist.fsdp.last_iteration_record(model)
                    gathers[0] = sum(1 for r in record.collectives if r.kind == "all_gather")
                forward_gathers = gathers[0]
                loss.backward()
                log.append((forward_gathers, units(model)))
            opt.step()
            opt.zero_grad()
            log.append(_full(impl, model))
    finally:
        if impl == "torch":
            torch_pg.foreach_all_gather = real
    return log


def _both(rank, world_size, which, mixed):
    return {impl: _run(rank, world_size, impl, which, mixed) for impl in ("torch", "pydist")}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("which,mixed", [("all", False), ("one", False), ("all", True)])
def test_reshard_after_backward_false_as_torch_fsdp2(which, mixed):
    for rank, out in enumerate(run_ranks(_both, 2, args=(which, mixed), timeout=140)):
        ref, got = out["torch"], out["pydist"]
        assert len(ref) == len(got)
        kept_any = False
        for i, (r, g) in enumerate(zip(ref, got)):
            if isinstance(r, dict) and all(isinstance(v, torch.Tensor) for v in r.values()):
                for k in r:
                    assert torch.equal(g[k], r[k]), f"rank {rank}, entry {i}: {k} differs from torch"
                continue
            assert g == r, f"rank {rank}, micro-batch {i}: (units gathered in forward, unsharded after backward)"
            kept_any |= any(r[1].values())
        assert kept_any, "no unit stayed unsharded after backward: the test did not exercise the setting"
