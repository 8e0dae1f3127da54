"""Uneven inputs: ``join()`` and ``torch.distributed.algorithms.join.Join``.

Rank ``r`` trains ``steps + r`` batches. Ranks that run out early shadow the
others' all-reduces with zeros; by default the sum is still divided by the
initial world size (``divide_by_initial_world_size=True``), with ``False``
by the number of ranks still training. At the end the last rank to join
broadcasts its parameters, so every rank ends equal. pydist must match torch
DDP doing the same: through ``with Join([model])``, with ``Join([model],
divide_by_initial_world_size=False)`` and through ``with model.join()``.
A joined rank's zero all-reduces must go where the active ranks' go, so each
test runs with both of pydist's transports.
"""

import pytest
import torch

from ddp_harness import (
    TRANSPORTS,
    Scenario,
    assert_parity,
    assert_ranks_agree,
    assert_transport,
    run_parity,
    with_transport,
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_join_uneven_inputs(transport):
    scenarios = with_transport(
        [
            Scenario(join="context", steps=3),
            Scenario(join="method", steps=3, optimizer="adam"),
            Scenario(join="context_nodiv", steps=3),
            Scenario(join="context", steps=2, model="batchnorm"),
        ],
        transport,
    )
    results = run_parity(scenarios, 2)
    assert_parity(results, exact=True, scenarios=scenarios)
    assert_transport(results, transport)
    for i in range(len(scenarios)):
        assert_ranks_agree(results, "pydist", i)
    # the divisor is visible: rank 1's last step runs alone
    by_initial = results[1][0]["torch"].grads[-1]["fc1.weight"]
    by_active = results[1][2]["torch"].grads[-1]["fc1.weight"]
    torch.testing.assert_close(by_active, 2 * by_initial, rtol=1e-6, atol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_join_uneven_inputs_4_ranks(transport):
    scenarios = with_transport([Scenario(join="context", steps=2), Scenario(join="context_nodiv", steps=2)], transport)
    results = run_parity(scenarios, 4)
    assert_parity(results, exact=False, scenarios=scenarios)
    assert_transport(results, transport)
    for i in range(len(scenarios)):
        assert_ranks_agree(results, "pydist", i)
