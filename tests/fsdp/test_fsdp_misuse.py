"""What pydist's FSDP refuses instead of training wrong, on spawned gloo
ranks: a unit run twice before one backward, a weight tied across two
units, set_collective_batch_bytes on a unit that is not a root (before and
after the first forward); and reading records is local (no collective), so
one rank may."""

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks


def _blocks(n: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


class Reuse(nn.Module):
    """Applies ``b`` twice (weights shared across two layers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.b(self.a(x)))


def _shard_blocks_then_root(model: nn.Module) -> nn.Module:
    from pydist import fully_shard

    for block in model.children():
        fully_shard(block)
    return fully_shard(model)


def _message(fn) -> str:
    try:
        fn()
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _misuse_rank(rank, world_size):
    from pydist import fully_shard
    from pydist.fsdp import last_iteration_record

    out = {}
    x = torch.randn(3, 4)

    # Reading records before the first forward, on rank 0 only: no collective
    # (a collective here would leave rank 1 ahead and rank 0 hanging).
    model = _shard_blocks_then_root(_blocks())
    if rank == 0:
        record = last_iteration_record(model)
        out["early_record"] = (record.collectives, record.backward_end_ns)
    model(x).sum().backward()  # both ranks meet here either way
    out["record_after_step"] = len(last_iteration_record(model).collectives) > 0

    # A block used twice in one forward of its root.
    model = _shard_blocks_then_root(Reuse())
    out["reused"] = _message(lambda: model(x).sum().backward())

    # Two root forwards summed into one loss: the second backward of each unit.
    model = _shard_blocks_then_root(_blocks())
    out["two_forwards"] = _message(lambda: (model(x).sum() + model(2 * x).sum()).backward())

    # A weight tied across two units.
    model = _blocks()
    model[1].weight = model[0].weight
    fully_shard(model[0])
    out["tied"] = _message(lambda: fully_shard(model))

    # The batch size set on a unit the root plans for: refused at the root's
    # first forward, and on the unit after it.
    model = _shard_blocks_then_root(_blocks())
    model[0].set_collective_batch_bytes(0)
    out["batch_bytes_before"] = _message(lambda: model(x))
    # Refused before any state changed: put back, set on the root, the model trains.
    model[0].set_collective_batch_bytes(None)
    model.set_collective_batch_bytes(0)
    model(x).sum().backward()
    out["batch_bytes_fixed"] = [pg.had_grad is None and pg.transport is not None for pg in model._param_groups(True)]
    model = _shard_blocks_then_root(_blocks())
    model(x)
    out["batch_bytes_after"] = _message(lambda: model[1].set_collective_batch_bytes(0))
    return out


@pytest.mark.timeout(120)
def test_misuse_is_refused_and_records_are_local():
    for rank, out in enumerate(run_ranks(_misuse_rank, 2, timeout=90)):
        if rank == 0:
            assert out["early_record"] == ([], -1)
        assert out["record_after_step"]
        assert out["reused"].startswith("RuntimeError") and "ran forward a second time" in out["reused"], out["reused"]
        assert "unit 'b'" in out["reused"], out["reused"]
        assert out["two_forwards"].startswith("RuntimeError"), out["two_forwards"]
        assert "backward reached it again" in out["two_forwards"], out["two_forwards"]
        assert out["tied"].startswith("NotImplementedError"), out["tied"]
        assert "parameter 1.weight" in out["tied"] and "Linear (as weight)" in out["tied"], out["tied"]
        for when in ("before", "after"):
            message = out[f"batch_bytes_{when}"]
            unit = "'0' (FSDPLinear)" if when == "before" else "'1' (FSDPLinear)"
            assert message.startswith("ValueError") and f"{unit}, which is not a root" in message, message
        assert out["batch_bytes_fixed"] and all(out["batch_bytes_fixed"]), out["batch_bytes_fixed"]


def test_fsdp2_policies_are_torchs_own_objects():
    """``from pydist import MixedPrecisionPolicy`` (as an FSDP2 script imports
    it beside fully_shard) gives torch's class itself, so isinstance checks
    and pickled policies cannot tell them apart."""
    import torch.distributed.fsdp as torch_fsdp

    import pydist
    from pydist import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    assert MixedPrecisionPolicy is torch_fsdp.MixedPrecisionPolicy
    assert OffloadPolicy is torch_fsdp.OffloadPolicy and CPUOffloadPolicy is torch_fsdp.CPUOffloadPolicy
    assert {"MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"} <= set(pydist.__all__)
