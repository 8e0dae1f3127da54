"""``pydist.fully_shard`` at 2 and 4 ranks against the oracle: ONE process,
the plain model (no wrapper), training on the global batch.

[Note: the global-batch oracle]
Rank r's loss is the mean over its own ``sc.batch`` samples; the sharded
wrapper averages the ranks' gradients, so with equal per-rank batches the
step is the gradient of the mean over all ``world_size * sc.batch`` samples:
the loss of one process fed the ranks' batches concatenated in rank order.
The mean of the ranks' losses is that process's loss. Gradient accumulation
sums the micro-batches' gradients in both (each micro-batch's loss is a
mean over its own global micro-batch), and the clipped norm is the norm of
the global-batch gradient. The sums run in another order (one matmul over
the global batch against per-rank matmuls then a cross-rank sum), so
``rtol=1e-5``: the issue's tolerance for this oracle.
"""

import pytest
import torch
import torch.nn.functional as F

from fsdp_harness import MODELS, RunResult, Scenario, assert_close, make_batch, make_optimizer, run_parity

RTOL, ATOL = 1e-5, 1e-6


def train_global_batch(sc: Scenario, world_size: int) -> RunResult:
    """See [Note: the global-batch oracle]."""
    torch.manual_seed(sc.seed)
    model = MODELS[sc.model]()
    opt = make_optimizer(sc.optimizer, [p for p in model.parameters() if p.requires_grad])
    losses, norms = [], []
    for step in range(sc.steps):
        for micro in range(sc.micro_steps):
            xs, ys = zip(*(make_batch(sc, rank, step, micro) for rank in range(world_size)))
            loss = F.mse_loss(model(torch.cat(xs)), torch.cat(ys))
            loss.backward()
            losses.append(loss.item())
        if sc.clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), sc.clip)))
        opt.step()
        opt.zero_grad()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return RunResult(losses, norms, params, "one process")


SCENARIOS = [
    Scenario(model="mlp", optimizer="sgd", shm=True),
    Scenario(model="mlp", optimizer="adam", shm=False),
    Scenario(model="nested", optimizer="adam", shm=True),
    Scenario(model="nested", optimizer="sgd", reshard_after_forward=False, micro_steps=2, shm=True),
    Scenario(model="frozen", optimizer="adam", shm=False),
    Scenario(model="badpad", optimizer="sgd", shm=True),
    Scenario(model="nested", optimizer="sgd", clip=0.05, steps=3, shm=True),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fully_shard_matches_one_process_on_the_global_batch(world_size):
    results = run_parity(SCENARIOS, world_size, timeout=140, impls=("pydist",))
    for i, sc in enumerate(SCENARIOS):
        ref = train_global_batch(sc, world_size)
        where = f"scenario {i} ({sc}) at {world_size} ranks"
        rank_losses = torch.tensor([results[rank][i]["pydist"].losses for rank in range(world_size)])
        # the mean of the ranks' local means is the global mean: see the Note
        assert_close(torch.tensor(ref.losses), rank_losses.mean(0), False, f"{where}: mean of the ranks' losses",
                     rtol=RTOL, atol=ATOL)
        if sc.clip is not None:
            assert ref.norms and all(n > sc.clip for n in ref.norms), f"{where}: the oracle never clipped {ref.norms}"
        for rank in range(world_size):
            got = results[rank][i]["pydist"]
            assert_close(ref.norms, got.norms, False, f"{where} rank {rank} clip norms", rtol=RTOL, atol=ATOL)
            assert sorted(got.params) == sorted(ref.params), f"{where} rank {rank}: keys {sorted(got.params)}"
            for k, v in ref.params.items():
                assert_close(v, got.params[k], False, f"{where} rank {rank} param {k}", rtol=RTOL, atol=ATOL)
        # the oracle is not trivially met: one rank's data alone trains elsewhere
        assert rank_losses[0].tolist() != ref.losses, f"{where}: rank 0's losses are the global batch's"
