"""The reducer's state machine and who decides its policies ([Note: reducer
state] in csrc/reducer/reducer.h): an entry point called in the wrong state
raises naming the state; the transport can be replaced (a wrapper put in
front) before the first backward only; the bucket rebuild happens once, and
only where pydist/ddp/buckets.py's rebuilds_buckets says so."""

import pytest
import torch
from torch import nn

from pydist.spawn import run_ranks


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _state_main(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from pydist import DistributedDataParallel, transport

    torch.manual_seed(0)
    reference = DistributedDataParallel(_model(), shm_allreduce=False)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_model(), shm_allreduce=False, bucket_cap_mb=0.001, allreduce_chunk_mb=0.0005)
    seen = {}

    # Idle: the static-graph callback is refused, naming the state.
    with pytest.raises(RuntimeError, match="expected state Armed, but it is Idle"):
        ddp.reducer.delay_all_reduce()

    # Before the first backward a wrapper can go in front of the transport.
    counting = transport.wrap("counting", ddp.reducer.transport)
    ddp.reducer.set_transport(counting)
    assert ddp.reducer.transport.name == "counting(gloo)"
    seen["rebuilt_before"] = ddp._has_rebuilt_buckets
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):  # the second forward rebuilds the buckets
        for m in (ddp, reference):
            m.zero_grad()
            m(x).square().sum().backward()
    for (name, p), q in zip(ddp.module.named_parameters(), reference.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    seen["calls"] = counting.stats()["all_reduce_calls"]
    seen["rebuilt_after"] = ddp._has_rebuilt_buckets
    seen["pending"] = ddp.reducer.pending_rebuild_order()

    # After it, neither a transport nor a comm hook can change.
    with pytest.raises(RuntimeError, match="Reducer.set_transport must be called before the first backward"):
        ddp.reducer.set_transport(counting)
    with pytest.raises(RuntimeError, match="register_comm_hook must be called before the first backward"):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)

    # find_unused_parameters: buckets stay as assigned (no order recorded).
    unused = DistributedDataParallel(_model(), shm_allreduce=False, find_unused_parameters=True)
    for _ in range(3):
        unused(x).sum().backward()
    seen["unused_rebuilt"] = (unused._has_rebuilt_buckets, unused.reducer.pending_rebuild_order())

    # A second comm hook is refused.
    hooked = DistributedDataParallel(_model(), shm_allreduce=False)
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="may only be called once"):
        hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    return seen


@pytest.mark.timeout(120)
def test_reducer_states_transport_replacement_and_rebuild_policy():
    for rank, seen in enumerate(run_ranks(_state_main, 2)):
        assert seen["rebuilt_before"] is False
        assert seen["rebuilt_after"] is True and seen["pending"] is None, f"rank {rank}"
        assert seen["calls"] > 3, f"rank {rank}: the wrapper saw {seen['calls']} all-reduces in 3 backwards"
        assert seen["unused_rebuilt"] == (False, None)
