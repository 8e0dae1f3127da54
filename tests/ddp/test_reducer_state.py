"""The reducer's state machine and who decides its policies ([Note: reducer
state] in csrc/reducer/reducer.h): an entry point called in the wrong state
raises naming the state; the transport can be replaced (a wrapper put in
front) before the first backward, or later between iterations by one that
keeps the buckets' layout; the bucket rebuild happens once, and
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

    # After it, a comm hook cannot come; a wrapper can still go in front
    # between iterations (the buckets' layout stays), not during one.
    with pytest.raises(RuntimeError, match="register_comm_hook must be called before the first backward"):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    for m in (ddp, reference):
        m.zero_grad()
    loss = ddp(x).square().sum()  # armed: an iteration is under way
    with pytest.raises(RuntimeError, match="between iterations .the reducer is Armed"):
        ddp.reducer.set_transport(transport.wrap("counting", counting))
    loss.backward()
    reference(x).square().sum().backward()
    outer = transport.wrap("counting", counting)
    ddp.reducer.set_transport(outer)
    assert ddp.reducer.transport.name == "counting(counting(gloo))"
    for m in (ddp, reference):
        m.zero_grad()
        m(x).square().sum().backward()
    for (name, p), q in zip(ddp.module.named_parameters(), reference.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    seen["outer_calls"] = outer.stats()["all_reduce_calls"]

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
        assert seen["outer_calls"] > 1, f"rank {rank}: the later wrapper saw {seen['outer_calls']} all-reduces"
        assert seen["unused_rebuilt"] == (False, None)
