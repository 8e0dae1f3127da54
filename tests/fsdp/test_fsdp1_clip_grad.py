"""Clipping through ``pydist.FullyShardedDataParallel``, bitwise torch FSDP1's
``clip_grad_norm_`` at two ranks: the returned norms, every step clipped,
and the parameters after (issue #36: they were one ulp off, and the runs
drifted apart). Both ways scripts clip under FSDP1: the method
``model.clip_grad_norm_`` (accelerate's) and ``torch.nn.utils.clip_grad_norm_
(model.parameters())``, whose reference is torch's method too (on torch's
FSDP1 that call takes each rank's own norm; pydist gives the global one);
fp32 and bf16 ``MixedPrecision`` with fp32 reduction, FULL_SHARD,
SHARD_GRAD_OP and NO_SHARD, p = 2, 1, 3 and inf (the last two, a maximum
and torch's own clip_grad_norm_, were bitwise before too; the others were
not). torch's ``use_orig_params=False`` norms other tensors (one flat shard
per handle) and pydist's door refuses it. See [Note: the global norm of
sharded gradients] in pydist/fsdp/_clip_grad.py. Spawned gloo ranks."""

import functools

import pytest

from fsdp_harness import Nested, Scenario, assert_parity, run_parity

CLIP = 0.05  # below every step's norm: every step clips
# Wide enough that each step's norm sums enough terms to round differently
# in another order (the dim-24 ones often agree by luck).
MODELS = {"wide": functools.partial(Nested, dim=128), "wide frozen": functools.partial(Nested, dim=128, frozen=True)}


def clipped(**kwargs) -> Scenario:
    return Scenario(api="fsdp1", clip=CLIP, steps=5, **kwargs)


SCENARIOS = [
    clipped(model="wide", optimizer="sgd", shm=False),
    clipped(model="wide", optimizer="sgd", clip_with="torch", shm=True),
    clipped(model="wide", optimizer="adam", mixed=True, shm=True),
    clipped(model="wide", optimizer="adam", mixed=True, clip_with="torch", strategy="SHARD_GRAD_OP", shm=False),
    clipped(model="wide", optimizer="sgd", mixed=True, strategy="SHARD_GRAD_OP", shm=True),
    # the parameters given in another order than torch's (a script's own list): the same norm
    clipped(model="wide", optimizer="adam", clip_with="torch reversed", shm=True),
    clipped(model="wide frozen", optimizer="sgd", norm_type=float("inf"), shm=True),
    clipped(model="wide", optimizer="sgd", norm_type=1.0, clip_with="torch", shm=True),
    clipped(model="wide", optimizer="adam", norm_type=3.0, shm=False),
    clipped(model="wide frozen", optimizer="sgd", strategy="NO_SHARD", shm=True),
]


@pytest.mark.timeout(120)
def test_fsdp1_clipping_bitwise_at_two_ranks():
    results = run_parity(SCENARIOS, 2, timeout=100, models=MODELS)
    assert_parity(results, exact=True, scenarios=SCENARIOS)  # norms and parameters, bit for bit
    for i, sc in enumerate(SCENARIOS):
        norms = results[0][i]["torch"].norms
        assert len(norms) == sc.steps and all(n > CLIP for n in norms), f"scenario {i} ({sc}) did not clip: {norms}"
