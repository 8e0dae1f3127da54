"""Gradient clipping on pydist's shards by the global norm, through torch's
own ``clip_grad_norm_`` / ``get_total_norm`` (a script whose only change is
the import) and through ``pydist.clip_grad_norm_``, against the obviously
correct norm: every rank's shard gradients gathered and concatenated. See
[Note: the global norm of sharded gradients] in pydist/fsdp/_clip_grad.py.
Spawned gloo ranks; the shared-memory and the gloo transport."""

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

# Bound before pydist is imported, as a script's own imports may be: it must
# clip by the global norm all the same.
from torch.nn.utils import clip_grad_norm_ as clip_imported_early

import pydist  # noqa: E402,F401  before the next line: importing pydist installs the global norm
from pydist.spawn import run_ranks  # noqa: E402
from torch.nn.utils import get_total_norm as norm_imported_after_pydist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fsdp_harness import IN, Nested  # noqa: E402

NORMS = (2.0, 1.0, 3.0, math.inf)


def _grads_after_backward(model: nn.Module, rank: int, dtype: torch.dtype = torch.float32) -> list:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(100 + rank)  # each rank its own data: the shards' gradients differ by rank
    model(torch.randn(4, IN, dtype=dtype)).float().pow(2).sum().backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


def _oracle(local: list, norm_type: float, replicated: list = ()) -> float:
    """The norm of every rank's ``local`` tensors and ``replicated`` once, concatenated."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [t.detach().reshape(-1).clone() for t in local])
    flat = torch.cat([t for per_rank in everyone for t in per_rank] + [t.reshape(-1) for t in replicated])
    return float(torch.linalg.vector_norm(flat.double(), norm_type))


def _sharded_model(shm: bool, dtype: torch.dtype = torch.float32) -> nn.Module:
    """FSDP1's door: its gradients are plain 1-D pieces, which pydist's norm
    counts over the ranks (fully_shard's are DTensors: torch's own norm)."""
    from pydist import FullyShardedDataParallel

    torch.manual_seed(0)
    model = Nested().to(dtype)
    units = set(model.units())
    policy = lambda module, recurse, nonwrapped_numel: recurse or module in units  # noqa: E731
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, shm=shm)


def _clip_rank(rank: int, world_size: int) -> dict:
    import pydist

    out = {}
    for shm in (True, False):
        model = _sharded_model(shm)
        grads = _grads_after_backward(model, rank)
        extra = torch.full((5,), 0.5)  # a tensor of no unit: counted once
        for norm_type in NORMS:
            want = _oracle(grads, norm_type)
            out[(shm, "get_total_norm", norm_type)] = (float(torch.nn.utils.get_total_norm(grads, norm_type)), want)
            out[(shm, "get_total_norm imported by name", norm_type)] = (
                float(norm_imported_after_pydist(grads, norm_type)), want)
            out[(shm, "with a replicated tensor", norm_type)] = (
                float(torch.nn.utils.get_total_norm(grads + [extra], norm_type)),
                _oracle(grads, norm_type, [extra]))
            if not math.isinf(norm_type):  # (the rank holding the largest element has the inf-norm alone)
                local = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]).double(), norm_type))
                out[(shm, "this rank's alone", norm_type)] = (local, want)  # what torch's own gave before
        # Clipping: torch's clip_grad_norm_ (however imported) and pydist's
        # return the global norm, and scale every rank's shards alike.
        for name, clip in (("torch.nn.utils.clip_grad_norm_", torch.nn.utils.clip_grad_norm_),
                           ("imported before pydist", clip_imported_early),
                           ("pydist.clip_grad_norm_", pydist.clip_grad_norm_)):
            grads = _grads_after_backward(model, rank)
            before = _oracle(grads, 2.0)
            max_norm = before / 4
            got = float(clip(model.parameters(), max_norm))
            out[(shm, name, "norm")] = (got, before)
            out[(shm, name, "norm after clipping")] = (_oracle(grads, 2.0), max_norm)
        with pytest.raises(NotImplementedError, match="0.0-norm of sharded gradients"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=0)
        # bf16 parameters: their norm is bf16, reduced over the transport in bf16.
        model = _sharded_model(shm, torch.bfloat16)
        grads = _grads_after_backward(model, rank, torch.bfloat16)
        norm = torch.nn.utils.get_total_norm(grads)
        assert norm.dtype == torch.bfloat16
        out[(shm, "bf16", 2.0)] = (float(norm), _oracle(grads, 2.0), 1e-2)
    # A tensor pydist did not reduce goes to torch's own, unchanged.
    plain = [torch.arange(6.0) - 2.5, torch.ones(3)]
    from pydist.fsdp._clip_grad import _torch_total_norm

    out["plain tensors"] = (float(torch.nn.utils.get_total_norm(plain, 3.0)), float(_torch_total_norm(plain, 3.0)))
    return out


@pytest.mark.timeout(120)
def test_torchs_clip_grad_norm_clips_pydist_shards_by_the_global_norm():
    results = run_ranks(_clip_rank, 2, timeout=100)
    for rank, out in enumerate(results):
        for key, (got, want, *rtol) in out.items():
            if key[1:2] == ("this rank's alone",):
                # the old behaviour is a different number: the test can tell them apart
                assert got < want * (1 - 1e-3), (rank, key, got, want)
            else:
                assert got == pytest.approx(want, rel=rtol[0] if rtol else 1e-5), (rank, key, got, want)
    for key, (got, *_) in results[0].items():
        if key[1:2] != ("this rank's alone",):
            assert results[1][key][0] == got, ("the ranks' norms differ", key)


def _no_shard_rank(rank: int, world_size: int) -> tuple:
    from torch.distributed.fsdp import ShardingStrategy

    import pydist

    torch.manual_seed(0)
    model = pydist.FullyShardedDataParallel(Nested(), sharding_strategy=ShardingStrategy.NO_SHARD,
                                            device_id=torch.device("cpu"))
    grads = _grads_after_backward(model, rank)
    local = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]), 2.0))
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)), local


@pytest.mark.timeout(90)
def test_no_shard_gradients_are_counted_once():
    """NO_SHARD units' gradients are the whole averaged gradient on every
    rank: the norm is this rank's, as torch's FSDP1 gives."""
    for got, local in run_ranks(_no_shard_rank, 2, timeout=70):
        assert got == pytest.approx(local, rel=1e-6)
