"""Training parity: pydist DDP against stock torch DDP, on spawned gloo ranks.

Every test trains torch DDP and pydist DDP in the same spawned ranks from the
same seeds on different data per rank (see ddp_harness) and requires the
same losses, the same ``.grad`` after every backward (``None`` where torch
leaves ``None``), the same final parameters and buffers and the same
``state_dict`` keys: bitwise with two ranks, ``rtol=1e-6`` with four. See
[Note: when the suite asserts bitwise equality] in ddp_harness. Tests that
take ``transport`` run twice: pydist's buckets all-reduced through shared
memory (its default here) and on the gloo group.

Covered: plain training (SGD with momentum, Adam), parameter broadcast at
construction, ``no_sync`` accumulation, ``gradient_as_bucket_view``,
``find_unused_parameters`` with a branch skipped on some ranks and steps,
``static_graph`` with reentrant checkpointing, BatchNorm buffers with and
without ``broadcast_buffers``, bf16 autocast, tied and frozen parameters, a
model with 1,058 tiny parameters under several small bucket caps, pydist's
``first_bucket_cap_mb``, an exact integer-data check against a naive
all-reduce oracle, and ``state_dict`` checkpoints moved between the two.
"""

import pytest
import torch
import torch.distributed as dist

from ddp_harness import (
    TRANSPORTS,
    Scenario,
    assert_parity,
    assert_ranks_agree,
    assert_transport,
    build_local_model,
    ddp_class,
    make_batch,
    make_optimizer,
    loss_fn,
    pack,
    run_parity,
    unpack,
    with_transport,
)
from pydist.spawn import run_ranks

WORLD_SIZES = [2, pytest.param(4, id="4ranks")]


def _check(scenarios, world_size, transport=None, **tol):
    if transport is not None:
        scenarios = with_transport(scenarios, transport)
    results = run_parity(scenarios, world_size)
    assert_parity(results, exact=(world_size == 2), scenarios=scenarios, **tol)
    if transport is not None:
        assert_transport(results, transport)
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_plain_training_sgd_and_adam(world_size, transport):
    scenarios = [Scenario(optimizer="sgd"), Scenario(optimizer="adam", seed=1)]
    results = _check(scenarios, world_size, transport)
    for i in range(len(scenarios)):
        assert_ranks_agree(results, "pydist", i)
        # the data differ per rank: if the ranks agree, gradients were averaged
        losses = [results[r][i]["pydist"].losses[0] for r in range(world_size)]
        assert len(set(losses)) == world_size


@pytest.mark.timeout(60)
def test_construction_broadcasts_rank0_params():
    # each rank builds different weights; DDP must start every rank from rank 0's
    scenarios = [Scenario(init_seed_per_rank=True, steps=2), Scenario(init_seed_per_rank=True, model="frozen", steps=2)]
    results = _check(scenarios, 2)
    for i in range(len(scenarios)):
        assert_ranks_agree(results, "pydist", i)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_sync_accumulation(transport):
    # three micro-batches per step, the first two under no_sync(): their grads
    # stay local (checked after each backward) and the third syncs the sum
    scenarios = [Scenario(micro_steps=3, steps=3), Scenario(micro_steps=2, steps=3, optimizer="adam")]
    results = _check(scenarios, 2, transport)
    # a no_sync backward must not have averaged: ranks' grads differ there
    g0 = results[0][0]["pydist"].grads[0]["fc1.weight"]
    g1 = results[1][0]["pydist"].grads[0]["fc1.weight"]
    assert not torch.equal(g0, g1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gradient_as_bucket_view(transport):
    kw = {"gradient_as_bucket_view": True}
    scenarios = [Scenario(ddp_kwargs=kw), Scenario(ddp_kwargs=kw, optimizer="adam", micro_steps=2)]
    results = _check(scenarios, 2, transport)
    for rank in range(2):
        ref = results[rank][0]["torch"].grad_storage_groups
        got = results[rank][0]["pydist"].grad_storage_groups
        # torch's grads are views into its buckets; pydist's must share storage the same way
        assert got == ref, f"rank {rank}: grads share storage as {got}, torch DDP's as {ref}"
        assert any(len(g) > 1 for g in got), "with gradient_as_bucket_view the grads must be bucket views"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_find_unused_parameters_branch_skipped(world_size, transport):
    # use_branch(): step 1 locally unused on rank 0, step 2 unused by all ranks
    # (torch leaves those grads untouched: None after zero_grad(set_to_none=True),
    # and SGD-momentum then skips them; the zeros of zero_grad(set_to_none=False)
    # otherwise), step 3 used on the last rank only
    kw = {"find_unused_parameters": True}
    scenarios = [
        Scenario(model="branch", branch_schedule=True, steps=5, ddp_kwargs=kw),
        Scenario(model="branch", branch_schedule=True, steps=4, ddp_kwargs=kw, optimizer="adam", seed=3),
        Scenario(model="branch", branch_schedule=True, steps=4, ddp_kwargs=kw, grads_to_none=False, seed=4),
    ]
    results = _check(scenarios, world_size, transport)
    # the schedule did what it says: globally unused at step 2 -> untouched everywhere
    for rank in range(world_size):
        assert results[rank][0]["torch"].grads[2]["branch.weight"] is None
        assert results[rank][0]["torch"].grads[1]["branch.weight"] is not None
        assert not results[rank][2]["torch"].grads[2]["branch.weight"].any()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_static_graph(transport):
    # checkpointed: a block run twice under reentrant checkpointing and an
    # always-unused layer, without find_unused_parameters: static_graph's case
    kw = {"static_graph": True}
    scenarios = [
        Scenario(model="checkpointed", ddp_kwargs=kw, steps=4),
        Scenario(model="mlp", ddp_kwargs=kw, optimizer="adam", steps=3),
    ]
    results = _check(scenarios, 2, transport)
    assert results[0][0]["torch"].grads[-1]["unused.weight"] is None


@pytest.mark.timeout(60)
def test_batchnorm_buffers():
    # ranks start with different running stats and see different data:
    # broadcast_buffers=True makes rank 0's the truth at every forward (and at
    # construction); False leaves every rank its own
    scenarios = [
        Scenario(model="batchnorm", perturb_buffers=True, steps=3),
        Scenario(model="batchnorm", perturb_buffers=True, steps=3, ddp_kwargs={"broadcast_buffers": False}),
    ]
    results = _check(scenarios, 2)
    rm0 = [results[r][0]["pydist"].buffers["bn.running_mean"] for r in range(2)]
    rm1 = [results[r][1]["pydist"].buffers["bn.running_mean"] for r in range(2)]
    # broadcast: the ranks' buffers differ only by their last local update, not by the +rank offset
    assert (rm0[0] - rm0[1]).abs().max() < 0.5
    assert (rm1[0] - rm1[1]).abs().max() > 0.5


@pytest.mark.timeout(60)
def test_bf16_autocast_cpu():
    scenarios = [Scenario(autocast_bf16=True), Scenario(autocast_bf16=True, optimizer="adam", model="batchnorm")]
    _check(scenarios, 2)


@pytest.mark.timeout(60)
def test_tied_parameters():
    scenarios = [Scenario(model="tied"), Scenario(model="tied", optimizer="adam")]
    results = _check(scenarios, 2)
    assert "dec.weight" not in results[0][0]["pydist"].params  # one parameter, two uses


@pytest.mark.timeout(60)
def test_frozen_parameters():
    scenarios = [Scenario(model="frozen"), Scenario(model="frozen", optimizer="adam")]
    results = _check(scenarios, 2)
    assert results[0][0]["pydist"].grads[-1]["frozen.weight"] is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_tiny_params_small_bucket_caps(transport):
    # 1,058 parameters, 1,024 of them 0-dim; ~26 floats per bucket, then the
    # default caps (more caps: test_ddp_hooks's fp16 and probe tests)
    scenarios = [
        Scenario(model="many_tiny", steps=3, optimizer="adam", ddp_kwargs={"bucket_cap_mb": 0.0001}),
        Scenario(model="many_tiny", steps=2),
    ]
    _check(scenarios, 2, transport)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_mlp_several_small_bucket_caps(world_size, transport):
    caps = [0.0005, 0.002, 0.01]
    scenarios = [Scenario(ddp_kwargs={"bucket_cap_mb": cap}, steps=3, seed=5) for cap in caps]
    scenarios.append(Scenario(ddp_kwargs={"bucket_cap_mb": 0.001}, optimizer="adam", steps=3))
    _check(scenarios, world_size, transport)


@pytest.mark.timeout(60)
def test_first_bucket_cap_mb_is_accepted_and_correct():
    # pydist's own keyword: another first bucket changes the layout, which with
    # two ranks cannot change the averaged gradients
    scenarios = [
        Scenario(pydist_kwargs={"first_bucket_cap_mb": 0.0005}),
        Scenario(model="many_tiny", steps=2, pydist_kwargs={"first_bucket_cap_mb": 0.001}),
    ]
    _check(scenarios, 2)


# --------------------------------------------------------------------------
# The naive oracle: integer data, exact answers
# --------------------------------------------------------------------------


def _exact_against_naive_oracle(rank, world_size, transport):
    """pydist's averaged grads equal a naive all-reduce of local grads, exactly."""
    sc = Scenario(model="linear_int", integer_data=True, optimizer="sgd_exact", steps=3)
    local = build_local_model(sc, rank)
    ddp = ddp_class("pydist")(build_local_model(sc, rank), shm_allreduce=(transport == "shm"))
    assert ddp.allreduce_transport == transport
    local_opt = make_optimizer(sc.optimizer, local.parameters())
    opt = make_optimizer(sc.optimizer, ddp.parameters())
    for step in range(sc.steps):
        x, y = make_batch(sc, rank, step, 0)
        loss_fn(sc, local(x), y).backward()
        for p in local.parameters():  # the oracle: DataParallelNaive
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
        loss_fn(sc, ddp(x), y).backward()
        for (name, p), q in zip(ddp.module.named_parameters(), local.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step} {name}: {p.grad} != naive {q.grad}"
        local_opt.step()
        opt.step()
        local_opt.zero_grad()
        opt.zero_grad()
    return pack({n: p.detach() for n, p in ddp.module.named_parameters()})


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_exact_mean_against_naive_oracle(world_size, transport):
    results = [unpack(b) for b in run_ranks(_exact_against_naive_oracle, world_size, args=(transport,), timeout=60)]
    for rank in range(1, world_size):
        for name, t in results[rank].items():
            assert torch.equal(t, results[0][name])


# --------------------------------------------------------------------------
# state_dict
# --------------------------------------------------------------------------


def _state_dict_round_trip(rank, world_size):
    sc = Scenario(model="batchnorm", steps=2)
    out = {}
    for src, dst in (("torch", "pydist"), ("pydist", "torch")):
        torch.manual_seed(0)
        trained = ddp_class(src)(build_local_model(sc, rank))
        opt = make_optimizer("sgd", trained.parameters())
        for step in range(sc.steps):
            x, y = make_batch(sc, rank, step, 0)
            loss_fn(sc, trained(x), y).backward()
            opt.step()
            opt.zero_grad()
        saved = trained.state_dict()
        blob = pack(saved)  # through bytes, as a checkpoint file would be
        fresh = ddp_class(dst)(build_local_model(Scenario(model="batchnorm", seed=7), rank))
        fresh.load_state_dict(unpack(blob))
        out[f"{src}->{dst}"] = (
            list(saved.keys()),
            {k: v.clone() for k, v in saved.items()},
            {k: v.clone() for k, v in fresh.state_dict().items()},
        )
    return pack(out)


@pytest.mark.timeout(60)
def test_state_dict_keys_and_checkpoint_exchange():
    for rank, data in enumerate(run_ranks(_state_dict_round_trip, 2, timeout=60)):
        out = unpack(data)
        torch_keys = out["torch->pydist"][0]
        pydist_keys = out["pydist->torch"][0]
        assert pydist_keys == torch_keys, f"rank {rank}: pydist state_dict keys {pydist_keys} != torch's {torch_keys}"
        assert all(k.startswith("module.") for k in torch_keys)
        # same seeds and data, two ranks: the trained values are bitwise torch's
        for k in torch_keys:
            assert torch.equal(out["pydist->torch"][1][k], out["torch->pydist"][1][k]), f"rank {rank}: trained {k} differs"
        for direction, (keys, saved, loaded) in out.items():
            assert list(loaded.keys()) == keys, f"rank {rank} {direction}: keys after load differ"
            for k in keys:
                assert torch.equal(saved[k], loaded[k]), f"rank {rank} {direction}: {k} not restored"
