"""The class fully_shard gives a module, where scripts meet it beyond
isinstance: slicing a sharded container (``model[:-1]``) builds the wrapped
class, as torch's ``FSDPModule.__new__`` does, and ``copy.deepcopy`` of a
sharded module raises as torch's does (an AssertionError), naming the cure."""

import copy

import pytest
import torch.nn as nn

from pydist.spawn import run_ranks


def _rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from pydist import fully_shard

    out = {}
    for impl, shard in (("torch", lambda m: torch_fully_shard(m, mesh=init_device_mesh("cpu", (2,)))),
                        ("pydist", fully_shard)):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        shard(model[0])
        shard(model)
        head = model[:-1]
        out[impl, "slice"] = (type(head).__name__, [type(m).__name__ for m in head], head[0] is model[0])
        try:
            copy.deepcopy(model)
            out[impl, "deepcopy"] = "copied"
        except AssertionError as exc:
            out[impl, "deepcopy"] = str(exc)
    return out


@pytest.mark.timeout(90)
def test_slicing_and_deepcopy_as_torchs_fully_shard():
    for out in run_ranks(_rank, 2, timeout=70):
        assert out["pydist", "slice"] == out["torch", "slice"] == ("Sequential", ["FSDPLinear", "Linear"], True)
        assert "deepcopy" in out["torch", "deepcopy"]
        assert "cannot be deep-copied" in out["pydist", "deepcopy"] and "before fully_shard" in out["pydist", "deepcopy"]
