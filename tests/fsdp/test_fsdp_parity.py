"""Training parity: ``pydist.fully_shard`` against torch's ``fully_shard``
(FSDP2) on spawned gloo ranks, same seeds, same per-rank data.

Each test spawns its ranks once and runs several scenarios in them (a spawn
costs seconds here). Bitwise at two ranks, ``rtol=1e-6`` at four: see the
docstring of fsdp_harness. Covered: an MLP and a nested model (units inside
units, root parameters before and after them), SGD with momentum and Adam,
``reshard_after_forward`` True and False, gradient accumulation through
``set_requires_gradient_sync(False)``, frozen and trainable parameters in one
unit, a shape that pads badly per parameter, explicit forward/backward
prefetch, the global gradient norm of torch's ``clip_grad_norm_`` on the shards, bf16
parameters with fp32 reduction (``MixedPrecisionPolicy``, with and without
accumulation), and both transports (shared memory and the gloo group).
The small models here go as one batched collective per pass by default
(see [Note: batched collectives]); ``test_fully_shard_bitwise_batch_sizes``
runs them with every unit alone and in batches of a few units.
"""

import pytest

from fsdp_harness import Scenario, assert_parity, run_parity, run_scenarios


@pytest.mark.timeout(150)
def test_fully_shard_bitwise_at_two_ranks():
    scenarios = [
        Scenario(model="mlp", optimizer="sgd", shm=True),
        Scenario(model="mlp", optimizer="adam", shm=False),
        Scenario(model="nested", optimizer="adam", shm=True),
        Scenario(model="nested", optimizer="sgd", reshard_after_forward=False, shm=False),
        Scenario(model="frozen", optimizer="sgd", micro_steps=3, shm=True),
        Scenario(model="nested", optimizer="adam", micro_steps=2, reshard_after_forward=False, shm=True),
        Scenario(model="badpad", optimizer="adam", shm=True),
        Scenario(model="nested", optimizer="sgd", prefetch=True, shm=True),
        Scenario(model="nested", optimizer="sgd", clip=0.05, steps=3, shm=True),
        Scenario(model="nested", optimizer="adam", mixed=True, shm=True),
        Scenario(model="frozen", optimizer="sgd", mixed=True, micro_steps=3, shm=False),
    ]
    results = run_parity(scenarios, 2, timeout=140)
    assert_parity(results, exact=True, scenarios=scenarios)
    for per_rank in results:
        for sc, per_impl in zip(scenarios, per_rank):
            assert per_impl["pydist"].transport == ("shm" if sc.shm else "gloo"), sc
    clipped = next(results[0][i]["pydist"].norms for i, sc in enumerate(scenarios) if sc.clip is not None)
    assert clipped and all(n > 0.05 for n in clipped), f"the clip scenario never clipped: norms {clipped}"
    # the ranks saw different data: if their parameters agree, gradients were averaged
    for i in range(len(scenarios)):
        ref = results[0][i]["pydist"]
        assert ref.losses != results[1][i]["pydist"].losses
        for k, v in ref.params.items():
            assert (results[1][i]["pydist"].params[k] == v).all(), f"scenario {i}: ranks disagree on {k}"


@pytest.mark.timeout(150)
def test_fully_shard_close_at_four_ranks():
    scenarios = [
        Scenario(model="nested", optimizer="adam", shm=True),
        Scenario(model="badpad", optimizer="sgd", micro_steps=2, shm=False),
    ]
    results = run_parity(scenarios, 4, timeout=140)
    assert_parity(results, exact=False, scenarios=scenarios)


def _scenarios_with_batch_bytes(rank, world_size, scenarios, batch_bytes):
    """run_scenarios with every root's collective batch at ``batch_bytes``."""
    from pydist.fsdp import _fsdp_schedule

    _fsdp_schedule.BATCH_BYTES_PER_RANK = batch_bytes // world_size
    return run_scenarios(rank, world_size, scenarios)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("batch_bytes", [0, 6000])
def test_fully_shard_bitwise_batch_sizes(batch_bytes):
    """Units alone (0) and in pairs (6000 bytes: a nested Block and its inner
    unit) give torch FSDP2's bits too: batching only moves copies."""
    from pydist.spawn import run_ranks

    scenarios = [
        Scenario(model="nested", optimizer="adam", shm=True),
        Scenario(model="nested", optimizer="sgd", reshard_after_forward=False, shm=False),
        Scenario(model="frozen", optimizer="sgd", micro_steps=3, shm=True),
        Scenario(model="nested", optimizer="sgd", prefetch=True, shm=True),
        Scenario(model="nested", optimizer="adam", mixed=True, shm=True),
    ]
    results = run_ranks(_scenarios_with_batch_bytes, 2, args=(scenarios, batch_bytes), timeout=180)
    assert_parity(results, exact=True, scenarios=scenarios)
