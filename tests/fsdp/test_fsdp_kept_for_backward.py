"""The forward's last batch stays unsharded for the backward, which needs it
first (see [Note: gather and reduce plans] in pydist/fsdp/_fsdp_schedule.py):
it is gathered once per iteration, not twice, and the next batch goes out
as the backward begins. A forward with grad that no backward follows must
not leave stale parameters behind: the units kept for it are resharded at
the next forward, so an edit of the parameters in between is seen, as under
torch's FSDP2 (bitwise at 2 ranks)."""

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks

D = 8
UNIT_BYTES = (D * D + D) * 4


class Chain(nn.Module):
    def __init__(self, n: int = 6):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(n)])
        self.out = nn.Linear(D, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _build(impl: str, world_size: int):
    import pydist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    model = Chain()
    shard = torch_fully_shard if impl == "torch" else pydist.fully_shard
    kwargs = {"mesh": init_device_mesh("cpu", (world_size,))} if impl == "torch" else {}
    for block in model.blocks:
        shard(block, **kwargs)
    model = shard(model, **kwargs)
    if impl == "pydist":
        model.set_collective_batch_bytes(2 * UNIT_BYTES + 64)  # two blocks per collective
    return model


def _full(impl: str, model) -> dict:
    import pydist

    if impl == "torch":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {k: v.clone() for k, v in pydist.fsdp.full_state_dict(model).items()}


def _run(rank, world_size, impl):
    import pydist

    model = _build(impl, world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    out = {"params": [], "losses": []}

    def step():
        loss = model(torch.randn(4, D, generator=gen)).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach())
        out["params"].append(_full(impl, model))

    step()
    step()  # the second iteration plans from the first's order
    if impl == "pydist":
        record = pydist.fsdp.last_iteration_record(model)
        out["gathers"] = [(r.unit, r.phase) for r in record.collectives if r.kind == "all_gather"]
        out["kept_now"] = [s.param_group.label for s in model._pydist_fsdp_state.all_states
                           if s.param_group is not None and s.param_group.sharded_state.name == "KEPT"]
    # A forward with grad that no backward follows, then the blocks' weights
    # edited through model.parameters(): the next iteration must see the edit.
    model(torch.randn(4, D, generator=gen)).sum()
    with torch.no_grad():
        for block in model.blocks:
            for p in block.parameters():
                p.mul_(0.5)
    step()
    step()
    return out


def _both(rank, world_size):
    return {impl: _run(rank, world_size, impl) for impl in ("torch", "pydist")}


@pytest.mark.timeout(120)
def test_last_batch_kept_for_backward_and_resharded_when_no_backward_comes():
    for rank, out in enumerate(run_ranks(_both, 2, timeout=110)):
        ref, got = out["torch"], out["pydist"]
        for i, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
            assert torch.equal(a, b), f"rank {rank}, step {i}: loss {b} vs torch FSDP2's {a}"
        for i, (a, b) in enumerate(zip(ref["params"], got["params"])):
            for k in a:
                assert torch.equal(a[k], b[k]), f"rank {rank}, step {i}: {k} differs from torch FSDP2"
        gathers = got["gathers"]
        forward = {u for u, phase in gathers if phase.startswith("forward")}
        backward = {u for u, phase in gathers if phase.startswith("backward")}
        assert {f"blocks.{i}" for i in range(6)} <= forward, gathers
        # The last two blocks (the forward's last batch) are not gathered again in backward; the rest are.
        assert {"blocks.4", "blocks.5"}.isdisjoint(backward), gathers
        assert {f"blocks.{i}" for i in range(4)} <= backward, gathers
        assert ("blocks.3", "backward_prefetch") in gathers, "the first batch gathered in backward went ahead"
        assert got["kept_now"] == [], f"rank {rank}: still kept after the backward: {got['kept_now']}"
