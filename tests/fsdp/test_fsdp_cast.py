"""Casting a fully_shard'ed model (``Module._apply``: ``.to(dtype)``,
``.double()``), bitwise against torch's FSDP2 doing the same, at 2 ranks:

- accelerate's FSDP2 preparation: a model loaded in bf16 is fully_shard'ed
  with a bf16 ``MixedPrecisionPolicy`` and then upcast with
  ``model.to(torch.float32)``; AdamW with ``clip_grad_norm_`` trains it;
- a model trained in float32 for two steps, then cast to float64 with
  ``model.double()`` and trained on with a new optimizer. Its units share
  collective batches, so the gathers planned in float32 must not outlive the
  cast (a stale batch would gather into the old buffers). Torch's FSDP2
  fails this cast after its lazy init, so its side loads the trained values
  into a fresh float64 model instead.

A cast while a unit holds gradients it has not reduced yet (gradient sync
off) is refused, naming the cure."""

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)))


def _model(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(16) for _ in range(4)], nn.Linear(16, 3)).to(dtype)


def _shard(model: nn.Module, impl: str, **kwargs) -> None:
    if impl == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        kwargs["mesh"] = init_device_mesh("cpu", (2,))
    else:
        from pydist import fully_shard
    for block in model[:-1]:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _steps(model, opt, rank: int, first: int, count: int, dtype: torch.dtype, clip: bool = False) -> list:
    out = []
    for step in range(first, first + count):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank)).to(dtype)
        loss = model(x).square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).full_tensor().item() if clip else None
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), norm))
    return out


def _params(model) -> dict:
    return {n: (p.full_tensor().detach().clone(), type(p).__name__, p.placements) for n, p in model.named_parameters()}


def _rank(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    for impl in ("torch", "pydist"):
        # accelerate: loaded in bf16, sharded with bf16 compute, upcast after.
        model = _model(torch.bfloat16)
        _shard(model, impl, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        model = model.to(torch.float32)
        dtypes = {p.dtype for p in model.parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out["upcast", impl] = (dtypes, _steps(model, opt, rank, 0, 3, torch.float32, clip=True), _params(model))

        # Trained, then cast between iterations.
        model = _model(torch.float32)
        _shard(model, impl)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        before = _steps(model, opt, rank, 0, 2, torch.float32)
        if impl == "torch":  # torch 2.13's FSDP2 keeps float32 unsharded parameters across a cast after its
            # lazy init (split_with_sizes_copy then refuses the float64 all-gather): its reference is a fresh
            # float64 model given the trained values, which is what the cast must amount to.
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            trained = {n: p.full_tensor().double() for n, p in model.named_parameters()}
            model = _model(torch.float64)
            _shard(model, impl)
            set_model_state_dict(model, trained, options=StateDictOptions(full_state_dict=True))
        else:
            model.double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        after = _steps(model, opt, rank, 2, 3, torch.float64)
        out["recast", impl] = ({p.dtype for p in model.parameters()}, before + after, _params(model))

    model = _model(torch.float32)
    _shard(model, "pydist")
    model.set_requires_gradient_sync(False)
    model(torch.randn(8, 16)).sum().backward()  # gradients kept unreduced, in float32, for the next backward
    out["pending"] = _refusal(model.double)
    return out


def _refusal(call) -> str:
    """The message of the NotImplementedError ``call()`` raises."""
    try:
        call()
    except NotImplementedError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(150)
def test_cast_after_fully_shard_trains_bitwise_as_torchs_fsdp2():
    for rank, out in enumerate(run_ranks(_rank, 2, timeout=130)):
        for flow, dtype in (("upcast", torch.float32), ("recast", torch.float64)):
            (ref_dtypes, ref_steps, ref_params), (dtypes, steps, params) = out[flow, "torch"], out[flow, "pydist"]
            assert ref_dtypes == dtypes == {dtype}, (rank, flow, ref_dtypes, dtypes)
            assert steps == ref_steps, (rank, flow, steps, ref_steps)
            assert params.keys() == ref_params.keys()
            for name, (ref, kind, placements) in ref_params.items():
                got, got_kind, got_placements = params[name]
                assert (got_kind, got_placements) == (kind, placements), (rank, flow, name)
                assert got.dtype == ref.dtype == dtype and torch.equal(got, ref), (rank, flow, name)
        assert "not reduced yet" in out["pending"] and "between iterations" in out["pending"], out["pending"]


def _submodule_rank(rank, world_size):
    """A cast on a submodule inside a unit, which the unit's own _apply never
    sees: all of a unit's submodules cast alike, the root's pre-forward takes
    the dtype up (bitwise the whole unit cast); one submodule alone is refused
    there, naming the parameter, on every rank, before any collective."""
    out = {}
    for how in ("whole", "submodules"):
        model = _model(torch.float32)
        _shard(model, "pydist")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = _steps(model, opt, rank, 0, 2, torch.float32)
        if how == "whole":
            model.double()
        else:
            for block in model[:-1]:
                block.lin.double()
                block.norm.double()
            model[-1].double()  # the root's own parameters: its module is the root, cast here as a plain Linear
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        after = _steps(model, opt, rank, 2, 2, torch.float64)
        out[how] = (before + after, _params(model))
    model = _model(torch.float32)
    _shard(model, "pydist")
    model(torch.randn(8, 16)).sum().backward()
    model[1].norm.double()  # half of the second unit
    out["half"] = _refusal(lambda: model(torch.randn(8, 16)))
    return out


@pytest.mark.timeout(150)
def test_cast_of_submodules_inside_units_is_taken_up_or_refused():
    for rank, out in enumerate(run_ranks(_submodule_rank, 2, timeout=130)):
        (ref_steps, ref_params), (steps, params) = out["whole"], out["submodules"]
        assert steps == ref_steps, (rank, steps, ref_steps)
        for name, (ref, kind, placements) in ref_params.items():
            got, got_kind, got_placements = params[name]
            assert got.dtype == ref.dtype == torch.float64 and torch.equal(got, ref), (rank, name)
        assert "fully_shard(1)" in out["half"] and "norm.weight torch.float64" in out["half"], out["half"]
