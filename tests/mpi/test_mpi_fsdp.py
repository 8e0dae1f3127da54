"""``pydist.fully_shard`` and ``pydist.FullyShardedDataParallel`` on the
mpi4py backend give bitwise torch FSDP2's / FSDP1's numerics on gloo.

Each rank (started by ``mpiexec -n 2``) trains the same scenarios as
tests/fsdp (fsdp_harness.py, same seeds and per-rank data) twice: torch's
wrapper on a gloo group over the same ranks, then pydist's on the default
group, the mpi4py one. pydist's unit collectives take one of two paths (see
[Note: which transport carries a sharded unit] in
pydist/fsdp/_fsdp_collectives.py): the shared-memory transport, mapped over
the mpi4py group since the launcher's ranks share this host (``shm=True``),
or the group itself (``shm=False``): ``MPI_Reduce_scatter_block`` and
``MPI_Allgather`` on the group's thread, whose calls are counted here. At
two ranks every averaged gradient is ``g_0/2 + g_1/2``: bitwise either way.
"""

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fsdp"))
from fsdp_harness import Scenario, assert_parity, run_scenarios  # noqa: E402

from pydist.backends.mpi4py_backend import MPI4PyProcessGroup  # noqa: E402

SCENARIOS = [
    Scenario(model="mlp", optimizer="sgd"),
    Scenario(model="nested", optimizer="adam"),
    Scenario(model="nested", optimizer="sgd", reshard_after_forward=False, micro_steps=2),
    Scenario(model="frozen", optimizer="sgd", mixed=True),
    Scenario(model="badpad", optimizer="adam"),
    Scenario(model="nested", optimizer="sgd", clip=0.05, steps=3),
    Scenario(api="fsdp1", model="nested", optimizer="adam", strategy="SHARD_GRAD_OP"),
    Scenario(api="fsdp1", model="mlp", optimizer="sgd", mixed=True),
    Scenario(api="fsdp1", model="nested", optimizer="sgd", clip=0.05, steps=3),  # the norm summed on the mpi4py group
]


def _with_shm(shm: bool):
    import dataclasses

    return [dataclasses.replace(sc, shm=shm) for sc in SCENARIOS]


def _run(world, gloo, scenarios):
    assert isinstance(dist.group.WORLD, MPI4PyProcessGroup), "the default group is not pydist's mpi4py group"
    results = run_scenarios(world.rank, world.world_size, scenarios, torch_group=gloo)
    assert_parity([results], exact=True, scenarios=scenarios, first_rank=world.rank)
    return results


@pytest.mark.timeout(240)
def test_fsdp_on_the_mpi4py_group_is_bitwise_torch_fsdp_on_gloo(world, gloo):
    mpi_group = dist.group.WORLD
    before = {op: mpi_group.issued_[op] for op in ("reduce_scatter_single", "all_gather_single")}
    scenarios = _with_shm(False)
    results = _run(world, gloo, scenarios)
    for sc, per_impl in zip(scenarios, results):
        assert per_impl["pydist"].transport != "shm", f"{sc}: pydist took shared memory, not the mpi4py group"
    # the units' collectives really went through the mpi4py group's MPI calls
    for op, n in before.items():
        assert mpi_group.issued_[op] - n >= len(scenarios), f"{op}: {mpi_group.issued_[op] - n} calls on the mpi4py group"


@pytest.mark.timeout(240)
def test_fsdp_through_shared_memory_under_mpiexec_is_bitwise_torch_fsdp(world, gloo):
    mpi_group = dist.group.WORLD
    before = mpi_group.issued_["reduce_scatter_single"]
    scenarios = _with_shm(True)
    results = _run(world, gloo, scenarios)
    for sc, per_impl in zip(scenarios, results):
        assert per_impl["pydist"].transport == "shm", f"{sc}: pydist ran on {per_impl['pydist'].transport}"
    # (all-gathers still reach the group: opening the segment agrees on it there)
    assert mpi_group.issued_["reduce_scatter_single"] == before, "gradients went through the mpi4py group"


@pytest.mark.timeout(60)
def test_mpi4py_collectives_leave_storage_resizable(world):
    # The engine frees an unsharded buffer with untyped_storage().resize_(0)
    # after the group gathered into it; the group must not pin its storage.
    import torch

    out = torch.empty(4 * world.world_size)
    dist.all_gather_into_tensor(out, torch.full((4,), float(world.rank)))
    grads = torch.arange(4.0 * world.world_size)
    shard = torch.empty(4)
    dist.reduce_scatter_tensor(shard, grads)
    assert shard.tolist() == [world.world_size * (4 * world.rank + i) for i in range(4)]
    assert out.tolist() == [float(r) for r in range(world.world_size) for _ in range(4)]
    for t in (out, grads, shard):
        t.untyped_storage().resize_(0)  # raises where the storage was pinned
