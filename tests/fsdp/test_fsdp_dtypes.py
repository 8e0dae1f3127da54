"""Units in dtypes the shared-memory transport does not carry (complex),
at 2 ranks, bitwise against torch's FSDP2 (SGD and Adam: the same DTensor
parameters under the same optimizer) and, for SGD, against one process
training on the global batch (Adam on complex DTensor parameters drifts
from that reference by ~4e-2 in 3 steps here, under torch's FSDP2 and so
under pydist's, so it is no oracle for Adam). The
root opens its transport knowing every dtype its units communicate in, so
``shm=None`` falls back to the process group (which carries a complex
tensor as its real and imaginary parts, as torch's collectives do) and
``shm=True`` refuses on every rank naming the dtype."""

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks


def _model(complex_unit: bool):
    torch.manual_seed(0)
    dtype = torch.cfloat if complex_unit else torch.float64
    return nn.Sequential(nn.Linear(6, 8, dtype=dtype), nn.Linear(8, 8, dtype=dtype), nn.Linear(8, 3, dtype=dtype))


def _batches(rank: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, 6, generator=gen, dtype=dtype) for _ in range(3)]


def _loss(model, x):
    return model(x).abs().pow(2).sum()


def _optimizer(name: str, params):
    return torch.optim.Adam(params, lr=0.01) if name == "adam" else torch.optim.SGD(params, lr=0.05)


def _train(rank: int, impl: str, opt_name: str, complex_unit: bool):
    import pydist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = _model(complex_unit)
    if impl == "torch":
        shard, kwargs = torch_fully_shard, {"mesh": init_device_mesh("cpu", (2,))}
    else:
        shard, kwargs = pydist.fully_shard, {"shm": None}
    for layer in model:
        shard(layer, **kwargs)
    shard(model, **kwargs)
    opt = _optimizer(opt_name, model.parameters())
    for x in _batches(rank, next(model.parameters()).dtype):
        _loss(model, x).backward()
        opt.step()
        opt.zero_grad()
    if impl == "torch":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}, "gloo"
    from pydist.fsdp._fsdp_state import state_of

    return {k: v.clone() for k, v in pydist.fsdp.full_state_dict(model).items()}, state_of(model).transport.name


def _global_batch(opt_name: str) -> dict:
    """One process, both ranks' batches per step, each loss halved (the
    gradient FSDP averages)."""
    model = _model(complex_unit=True)
    opt = _optimizer(opt_name, model.parameters())
    for xs in zip(_batches(0, torch.cfloat), _batches(1, torch.cfloat)):
        for x in xs:
            (_loss(model, x) / 2).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.named_parameters()}


def _rank(rank, world_size, complex_unit, runs):
    return {run: _train(rank, *run.split("-"), complex_unit) for run in runs}


def _assert_equal(ours: dict, ref: dict, what: str) -> None:
    for k, v in ref.items():
        assert torch.equal(ours[k], v), f"{what}: {k} differs"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("complex_unit,transport", [(True, "gloo"), (False, "shm")])
def test_unit_dtype_picks_the_transport_and_trains_bitwise(complex_unit, transport):
    runs = ("torch-sgd", "torch-adam", "pydist-sgd", "pydist-adam") if complex_unit else ("torch-adam", "pydist-adam")
    for rank, out in enumerate(run_ranks(_rank, 2, args=(complex_unit, runs), timeout=100)):
        for run in runs:
            if run.startswith("pydist"):
                assert out[run][1] == transport, f"rank {rank}: {run}'s units went over {out[run][1]}"
                _assert_equal(out[run][0], out[run.replace("pydist", "torch")][0], f"rank {rank} {run} against torch")
        if complex_unit:
            _assert_equal(out["pydist-sgd"][0], _global_batch("sgd"), f"rank {rank} against the global batch")


def _require_shm(rank, world_size):
    import pydist

    model = _model(complex_unit=True)
    pydist.fully_shard(model, shm=True)
    try:
        model(torch.randn(2, 6, dtype=torch.cfloat))
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_shm_required_refuses_a_complex_unit_on_every_rank():
    for rank, message in enumerate(run_ranks(_require_shm, 2, timeout=100)):
        assert message is not None and "complex64" in message and "shm" in message, f"rank {rank}: {message}"
        # it names the collectives a sharded unit runs, not DDP's
        assert "cannot all-gather and reduce-scatter through shared memory" in message, f"rank {rank}: {message}"
        assert "all-reduce" not in message, f"rank {rank}: {message}"
