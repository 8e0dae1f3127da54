"""torch.compile over a fully_shard'ed model compiled before its first
eager forward, beside torch's FSDP2 and pydist's own eager steps, on
spawned gloo ranks (Dynamo's eager backend: the tracing is what is tested)."""

import pytest
import torch

from fsdp_harness import MODELS, Scenario, make_optimizer, train_steps, wrap
from pydist.spawn import run_ranks


def _compiled_rank(rank, world_size):
    import torch._dynamo

    sc = Scenario(model="nested")
    losses = {}
    for impl, compiled in (("torch", True), ("pydist", False), ("pydist", True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = wrap(impl, sc, MODELS["nested"](), world_size)
        opt = make_optimizer("adam", model.parameters())
        # The root's first forward (its lazy init: the transport, the checks)
        # runs under Dynamo here; it is excluded from tracing and runs eagerly.
        run = torch.compile(model, backend="eager") if compiled else model
        losses[impl, compiled] = train_steps(run, opt, rank, 3, 0)
    return losses


@pytest.mark.timeout(180)
def test_compiled_before_any_eager_forward_trains_as_eager_and_as_torch():
    for rank, losses in enumerate(run_ranks(_compiled_rank, 2, timeout=160)):
        ref = losses["pydist", False]
        assert losses["pydist", True] == ref, f"rank {rank}: compiled {losses['pydist', True]}, eager {ref}"
        assert losses["torch", True] == ref, f"rank {rank}: torch FSDP2 compiled {losses['torch', True]}, pydist {ref}"
