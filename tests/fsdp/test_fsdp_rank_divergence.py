"""Ranks whose forwards run different units: every rank raises at once,
naming the unit, on shared memory and on gloo (where a collective of another
size aborts the process from gloo's thread, as it does under torch's FSDP2
on the same script), and after the error the loop trains on as torch FSDP2
does without that iteration, bitwise. See [Note: ranks that run different
units] in pydist/fsdp/_fsdp_state.py."""

import time

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks


class Experts(nn.Module):
    """Four units of three sizes; ``skip`` names the ones a rank leaves out."""

    def __init__(self):
        super().__init__()
        self.a, self.e1, self.e2, self.c = nn.Linear(8, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 8), nn.Linear(8, 4)
        self.skip: tuple = ()

    def forward(self, x):
        x = self.a(x)
        if "e1" not in self.skip:
            x = self.e1(x)
        if "e2" not in self.skip:
            x = x + self.e2(x)
        return self.c(x)


def _build(impl, world_size, shm, batch_bytes):
    import pydist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    model = Experts()
    shard = torch_fully_shard if impl == "torch" else pydist.fully_shard
    kwargs = {"mesh": init_device_mesh("cpu", (world_size,))} if impl == "torch" else {"shm": shm}
    for unit in (model.a, model.e1, model.e2, model.c):
        shard(unit, **kwargs)
    shard(model, **kwargs)
    if impl == "pydist" and batch_bytes is not None:
        model.set_collective_batch_bytes(batch_bytes)
    return model


# Per step, the units each rank skips: (rank 0's, rank 1's). The step where
# they differ raises; the others train.
CASES = {
    # after a step where every rank agreed (each unit in the plan)
    "one_skipped_after_agreement": [((), ()), ((), ("e2",)), ((), ())],
    # two units in a row: without the plan catching up, rank 1 would gather c where rank 0 gathers e2
    "two_skipped_after_agreement": [((), ()), ((), ("e1", "e2")), ((), ())],
    # the first forward: no plan, every unit checks before it gathers
    "skipped_in_first_step": [((), ("e2",)), ((), ()), ((), ())],
    # a unit every rank skipped last step (not in the plan) runs on one rank
    "run_on_one_rank_outside_the_plan": [(("e2",), ("e2",)), ((), ("e2",)), ((), ())],
}


def _train(rank, world_size, impl, case, shm, batch_bytes):
    """SGD with momentum over CASES[case]; the reference (torch) draws the
    batch of the diverging step and skips it."""
    model = _build(impl, world_size, shm, batch_bytes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    errors = []
    for skips in CASES[case]:
        x = torch.randn(4, 8, generator=gen)
        diverging = skips[0] != skips[1]
        if diverging and impl == "torch":
            continue
        model.skip = skips[rank]
        start = time.monotonic()
        try:
            model(x).pow(2).sum().backward()
            opt.step()
        except RuntimeError as exc:
            errors.append((str(exc), time.monotonic() - start))
        opt.zero_grad()
    if impl == "torch":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}, errors
    import pydist

    return pydist.fsdp.full_state_dict(model), errors


def _both(rank, world_size, case, shm, batch_bytes):
    return {impl: _train(rank, world_size, impl, case, shm, batch_bytes) for impl in ("torch", "pydist")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shm,batch_bytes", [(True, None), (False, None), (False, 0)])
def test_a_unit_run_on_some_ranks_only_fails_every_rank_naming_it(case, shm, batch_bytes):
    for rank, out in enumerate(run_ranks(_both, 2, args=(case, shm, batch_bytes), timeout=110)):
        (ref, _), (got, errors) = out["torch"], out["pydist"]
        assert len(errors) == 1, f"rank {rank}: {errors}"
        message, seconds = errors[0]
        assert "the ranks ran different fully_shard'ed units" in message, f"rank {rank}: {message}"
        skipped = "'e1' ran on rank 0 and not on rank 1; 'e2'" if "two" in case else "'e2'"
        assert f"{skipped} ran on rank 0 and not on rank 1" in message, f"rank {rank}: {message}"
        assert seconds < 20, f"rank {rank} failed only after {seconds:.0f} s"
        for k in ref:  # and the loop trains on as if the diverging step had not run
            assert torch.equal(got[k], ref[k]), f"rank {rank}: {k} differs by {(got[k] - ref[k]).abs().max().item()}"
