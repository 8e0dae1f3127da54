"""The pieces that need no second rank: messages between stages come back
bitwise (any dtype, None entries, odd byte counts), the action lists and
their CSV form, and errors that name what is wrong."""

import pytest
import torch

from pydist.pipelining import _p2p
from pydist.pipelining.schedules import _Action, gpipe_order, interleaved_order, one_f_one_b_order


def test_messages_round_trip_bitwise():
    g = torch.Generator().manual_seed(0)
    tensors = (torch.randn(3, 5, generator=g).requires_grad_(True), None,
               torch.randn(7, generator=g).to(torch.float16),  # 14 bytes: the next tensor starts unaligned
               torch.tensor([float("nan"), -0.0, float("inf")]), torch.randint(-9, 9, (2, 2), generator=g),
               torch.tensor([True, False]), torch.randn(2, generator=g).to(torch.bfloat16), torch.empty(0, 4))
    header, payload = _p2p.encode(tensors)
    assert _p2p.payload_bytes(header) == payload.numel()
    back = _p2p.decode(header, payload)
    assert back[1] is None and back[0].requires_grad and back[0].is_leaf and not back[2].requires_grad
    for a, b in zip(tensors, back):
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.detach().reshape(-1).view(torch.uint8) if a.numel() else a.detach(),
                               b.detach().reshape(-1).view(torch.uint8) if b.numel() else b.detach())
    # through the shared-memory link's float64 words and back
    words = _p2p._as_f64(payload)
    assert torch.equal(words.view(torch.uint8)[: payload.numel()], payload)


def test_a_message_that_does_not_fit_the_header_is_refused():
    with pytest.raises(ValueError, match="header"):
        _p2p.encode(tuple(torch.zeros(1, 1, 1, 1, 1) for _ in range(12)))
    with pytest.raises(TypeError, match="only tensors"):
        _p2p.encode((3,))


def test_action_lists():
    assert [str(a) for a in gpipe_order(1, 3)] == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]
    # torch's Schedule1F1B runs num_stages - stage_index warm-up forwards
    assert [str(a) for a in one_f_one_b_order(0, 2, 4)] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    assert [str(a) for a in one_f_one_b_order(1, 2, 4)] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]
    for rank in range(2):  # every stage of the rank runs each micro-batch's F and B once, in order
        acts = [a for a in interleaved_order(rank, 2, 2, 4) if a is not None]
        for stage in (rank, rank + 2):
            for kind in "FB":
                assert [a.microbatch_index for a in acts if a.stage_index == stage
                        and a.computation_type.value == kind] == [0, 1, 2, 3]
    assert _Action.from_str("12REDUCE_GRAD") == _Action(12, _Action.from_str("0REDUCE_GRAD").computation_type)
    assert _Action.from_str("") is None
    with pytest.raises(ValueError, match="cannot read the action '0W1'"):
        _Action.from_str("0W1")


def test_stage_arguments_are_checked(tmp_path):
    import torch.distributed as dist

    import pydist.pipelining as pp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="stage_index 2 is out of range of num_stages 2"):
            pp.PipelineStage(torch.nn.Linear(2, 2), 2, 2, torch.device("cpu"))
        with pytest.raises(ValueError, match="p2p='tcp'"):
            pp.PipelineStage(torch.nn.Linear(2, 2), 0, 2, torch.device("cpu"), p2p="tcp")
        stage = pp.PipelineStage(torch.nn.Linear(2, 2), 0, 1, torch.device("cpu"), timeout=5)
        with pytest.raises(ValueError, match="holds the last stage, whose loss_fn needs target="):
            pp.ScheduleGPipe(stage, 2, loss_fn=torch.nn.functional.mse_loss).step(torch.zeros(4, 2))
        with pytest.raises(NotImplementedError, match="ScheduleZBVZeroBubble"):
            pp.ScheduleZBVZeroBubble
        # one rank, one stage (first and last): the micro-batch loop, bitwise
        import pp_harness as h

        ref = h.reference(4, 4, 1)
        model = torch.nn.Sequential(*h.make_layers(4))
        (x, y), = h.batches(1)
        losses = []
        out = pp.ScheduleGPipe(pp.PipelineStage(model, 0, 1, torch.device("cpu")), 4, loss_fn=h.loss_fn).step(
            x, target=y, losses=losses)
        assert out.shape == (8, 4) and all(torch.equal(a, b) for a, b in zip(losses, ref["losses"][0]))
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref["grads"]))
    finally:
        dist.destroy_process_group()
