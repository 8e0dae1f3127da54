"""No warning of ours: the state-dict paths the example jobs do not take
(torch's get_model_state_dict / get_optimizer_state_dict on a sharded model,
which call pydist's gathers), on 2 spawned ranks under the hook the example
jobs run under (warnings_are_errors/sitecustomize.py: a warning that this
repository's code makes torch raise is an error). Before the fix, torch 2.13's
FutureWarning for all_gather_into_tensor came from pydist's full-state-dict
gather once per rank.
"""

import runpy
from pathlib import Path

import pytest
import torch

from pydist.spawn import run_ranks

HOOK = Path(__file__).with_name("warnings_are_errors") / "sitecustomize.py"


def _full_state_dicts(rank, world_size):
    runpy.run_path(str(HOOK))  # installs the hook in this rank
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    import pydist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    for layer in (model[0], model[2]):
        pydist.fully_shard(layer)
    pydist.fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.full((4, 8), float(rank + 1))).sum().backward()
    optimizer.step()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {name: tensor.shape for name, tensor in full.items()}, sorted(optim["state"])


@pytest.mark.timeout(120)
def test_full_state_dicts_of_a_sharded_model_raise_no_warning_of_ours():
    shapes, optim_keys = run_ranks(_full_state_dicts, world_size=2, timeout=100)[0]
    assert shapes == {"0.weight": (16, 8), "0.bias": (16,), "2.weight": (3, 16), "2.bias": (3,)}
    assert optim_keys == ["0.bias", "0.weight", "2.bias", "2.weight"]
