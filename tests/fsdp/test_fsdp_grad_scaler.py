"""``torch.amp.GradScaler`` on pydist's shards beside torch FSDP2: an overflow
that only one rank's shard holds makes every rank skip the step and halve
its scale, as FSDP2's DTensor gradients make it. See [Note: one found_inf
for every rank] in pydist/fsdp/_grad_scaler.py. Spawned gloo ranks; pydist
on the shared-memory and on the gloo transport."""

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks

STEPS = 3  # the first overflows, the next two are finite


class ScaledHead(nn.Module):
    """``(x * p).sum()`` (root unit, 8 elements: 4 per rank) plus a head on
    ``x`` clamped finite (its own unit): an inf in input column 7 reaches
    ``p.grad[7]`` alone, in rank 1's shard, whichever rank's input has it."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return (x * self.p).sum() + self.head(x.clamp(-1e3, 1e3)).pow(2).sum()


def _full(model, impl: str) -> dict:
    if impl == "torch":
        return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    from pydist.fsdp import full_state_dict

    return full_state_dict(model)


def _scaler_rank(rank: int, world_size: int) -> dict:
    import pydist

    out = {}
    for impl, shm in (("torch", None), ("pydist", True), ("pydist", False)):
        torch.manual_seed(0)
        model = ScaledHead()
        if impl == "torch":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world_size,))  # FSDP2 takes the GPU where one is visible
            fully_shard(model.head, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            pydist.fully_shard(model.head, shm=shm)
            pydist.fully_shard(model, shm=shm)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        initial = _full(model, impl)
        scales, unchanged_after_overflow = [], None
        for step in range(STEPS):
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(4, 8, generator=g)
            if step == 0 and rank == 0:
                x[1, 7] = float("inf")  # rank 0's input; the inf lands in rank 1's shard of p
            scaler.scale(model(x)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            if step == 0:
                after = _full(model, impl)
                unchanged_after_overflow = all(torch.equal(after[k], initial[k]) for k in initial)
        out[impl, shm] = dict(scales=scales, unchanged=unchanged_after_overflow, params=_full(model, impl))
    return out


@pytest.mark.timeout(120)
def test_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank_as_fsdp2():
    results = run_ranks(_scaler_rank, 2, timeout=100)
    for rank, out in enumerate(results):
        ref = out["torch", None]
        assert ref["scales"] == [512.0, 512.0, 512.0] and ref["unchanged"], (rank, "torch FSDP2", ref["scales"])
        for shm in (True, False):
            got = out["pydist", shm]
            where = f"rank {rank}, pydist shm={shm}"
            assert got["scales"] == ref["scales"], f"{where}: scales {got['scales']}, FSDP2's {ref['scales']}"
            assert got["unchanged"], f"{where}: the overflowing step changed parameters"
            for k, v in ref["params"].items():
                assert torch.equal(got["params"][k], v), f"{where}: {k} differs from FSDP2's after {STEPS} steps"
