"""PYDIST_REPLAY with a plan recorded for another model, or a damaged plan
file: every rank's DDP construction refuses it, naming the parameter that
differs (or what is wrong in the file) and the file; nothing is applied,
and the same file still replays into the model it was recorded for
(pydist/overlap/plans.py). Two spawned gloo ranks; no training needed: a
plan is the reducer's bucket assignment, which exists once DDP is built."""

import collections
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from pydist.spawn import run_ranks


def _model(widths):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def _with_plan(path, widths, names=None):
    """DDP of ``_model(widths)`` (its Linears renamed to ``names``) built under PYDIST_REPLAY=path."""
    from pydist import DistributedDataParallel as DDP

    model = _model(widths)
    if names is not None:
        model = nn.Sequential(collections.OrderedDict(zip(names, model)))
    os.environ["PYDIST_REPLAY"] = path
    try:
        return DDP(model)  # one bucket of its own: the plan's are smaller
    finally:
        os.environ.pop("PYDIST_REPLAY")


def _ranks(rank, world_size, root):
    from pydist import DistributedDataParallel as DDP
    from pydist import overlap

    plan_path = os.path.join(root, "plan.json")
    recorded = DDP(_model([16, 24, 8]))
    if rank == 0:
        overlap.save_plan(recorded, plan_path)
        with open(plan_path) as f:
            plan = json.load(f)
        plan["buckets"] = [[3, 2], [1, 0]]  # two buckets, launched last parameter first: what the check replays
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        del plan["buckets"]
        with open(os.path.join(root, "no_buckets.json"), "w") as f:
            json.dump(plan, f)
        plan["buckets"] = [[0, 1.5]]
        with open(os.path.join(root, "fraction.json"), "w") as f:
            json.dump(plan, f)
    dist.barrier()
    out = {}
    for case, path, widths, names in (("transposed", plan_path, [16, 8, 24], None),  # same count, other shapes
                                      ("renamed", plan_path, [16, 24, 8], ["a", "b"]),
                                      ("deeper", plan_path, [16, 24, 8, 8], None),
                                      ("no_buckets", os.path.join(root, "no_buckets.json"), [16, 24, 8], None),
                                      ("fraction", os.path.join(root, "fraction.json"), [16, 24, 8], None)):
        try:
            _with_plan(path, widths, names)
            out[case] = "applied"
        except RuntimeError as exc:
            out[case] = str(exc)
    replayed = _with_plan(plan_path, [16, 24, 8])
    out["replayed"] = replayed.bucket_indices()
    return out, plan_path


@pytest.mark.timeout(100)
def test_a_plan_for_another_model_or_damaged_is_refused(tmp_path):
    for rank, (out, plan_path) in enumerate(run_ranks(_ranks, 2, args=(str(tmp_path),), timeout=90)):
        read = f"(read from {plan_path!r})"
        assert (f"parameter 0 is 0.weight [8, 16] torch.float32 here but 0.weight [24, 16] torch.float32 in the plan "
                f"{read}; replay a plan recorded from the same model (nothing was applied)") in out["transposed"], (
            rank, out["transposed"])
        assert "parameter 0 is a.weight [24, 16] torch.float32 here but 0.weight" in out["renamed"], out["renamed"]
        assert f"the plan has 4 parameters, this model 6 {read}" in out["deeper"], out["deeper"]
        no_buckets = os.path.join(str(tmp_path), "no_buckets.json")
        assert f"the plan {no_buckets!r} is damaged (no 'buckets' entry)" in out["no_buckets"], out["no_buckets"]
        assert "is damaged (1.5 where a non-negative integer belongs)" in out["fraction"], out["fraction"]
        assert out["replayed"] == [[3, 2], [1, 0]], f"rank {rank}: the plan did not replay into its model"
