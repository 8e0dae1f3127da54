"""Stock torch DDP, and pydist's DDP, on the mpi4py backend give the same
numerics as torch DDP on gloo.

The same model, seeds and per-rank data are trained for a few steps once with
DDP over the default (mpi4py) group and once over a gloo group; losses,
gradients and parameters must be bit-identical. Gradients are also checked
against the single-process oracle: the full batch on one model. pydist's DDP
runs both ways: its buckets all-reduced on the mpi4py group, and through
shared memory (its default where the ranks share a host, as here).
"""

import copy
import functools

import torch
import torch.distributed as dist

from pydist.backends.mpi4py_backend import MPI4PyProcessGroup

STEPS = 4


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train(model, group, rank, world_size, wrapper=torch.nn.parallel.DistributedDataParallel):
    ddp = wrapper(model, process_group=group, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    trace = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        trace.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
    return trace


def assert_same_training(trace_a, trace_b, model_a, model_b):
    """Losses, grads of every step and final parameters are bit-identical."""
    for (loss_a, grads_a), (loss_b, grads_b) in zip(trace_a, trace_b):
        torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
        for ga, gb in zip(grads_a, grads_b):
            torch.testing.assert_close(ga, gb, rtol=0, atol=0)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_stock_ddp_same_numerics_on_mpi4py_and_gloo(world, gloo):
    mpi_group = dist.group.WORLD
    assert isinstance(mpi_group, MPI4PyProcessGroup)
    issued_before = mpi_group.issued_["allreduce"]

    model_mpi, model_gloo = make_model(), make_model()
    oracle = copy.deepcopy(model_mpi)
    trace_mpi = train(model_mpi, mpi_group, world.rank, world.world_size)
    trace_gloo = train(model_gloo, gloo, world.rank, world.world_size)

    # DDP's C++ reducer really called into the Python group (at least one bucket a step).
    assert mpi_group.issued_["allreduce"] - issued_before >= STEPS
    assert_same_training(trace_mpi, trace_gloo, model_mpi, model_gloo)

    # The oracle: the first step's averaged gradient is the full-batch gradient.
    xs, ys = zip(*(batch(0, r) for r in range(world.world_size)))
    torch.nn.functional.mse_loss(oracle(torch.cat(xs)), torch.cat(ys)).backward()
    for p, g in zip(oracle.parameters(), trace_mpi[0][1]):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_pydist_ddp_on_mpi4py_matches_torch_ddp_on_gloo(world, gloo):
    import pydist

    mpi_group = dist.group.WORLD
    issued_before = mpi_group.issued_["allreduce"]
    model_pydist, model_torch = make_model(), make_model()
    wrapper = functools.partial(pydist.DistributedDataParallel, shm_allreduce=False)
    trace_pydist = train(model_pydist, mpi_group, world.rank, world.world_size, wrapper)
    trace_torch = train(model_torch, gloo, world.rank, world.world_size)

    # pydist's C++ reducer called into the Python group, one all-reduce per bucket.
    assert mpi_group.issued_["allreduce"] - issued_before >= STEPS
    assert_same_training(trace_pydist, trace_torch, model_pydist, model_torch)


def test_pydist_ddp_through_shared_memory_under_mpirun(world, gloo):
    # Ranks started by the MPI launcher share this host: the default transport
    # maps one segment; the mpi4py group only sets it up.
    import pydist

    mpi_group = dist.group.WORLD
    model_pydist, model_torch = make_model(), make_model()
    issued_before = mpi_group.issued_["allreduce"]
    trace_pydist = train(model_pydist, mpi_group, world.rank, world.world_size, pydist.DistributedDataParallel)
    trace_torch = train(model_torch, gloo, world.rank, world.world_size)
    assert mpi_group.issued_["allreduce"] == issued_before, "gradients went through the mpi4py group"
    assert_same_training(trace_pydist, trace_torch, model_pydist, model_torch)


def test_pydist_records_on_mpi4py(world):
    # The reducer stamps completion from the future of the Python group's work.
    import pydist

    ddp = pydist.DistributedDataParallel(make_model(), bucket_cap_mb=0.001, record_timing=True, shm_allreduce=False)
    for step in range(2):
        x, y = batch(step, world.rank)
        ddp.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    record = ddp.last_iteration_record()
    assert record.buckets
    for b in record.buckets:
        assert 0 <= b.launch_ms <= b.complete_ms <= b.done_ms <= record.finalize_end_ms, b
