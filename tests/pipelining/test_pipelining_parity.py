"""pydist.pipelining beside torch.distributed.pipelining on the same model,
seeds and micro-batches: losses, step outputs, first-step gradients and
parameters after several steps bitwise equal, for GPipe, 1F1B and
interleaved 1F1B (2 stages per rank), over the process group (gloo) and
shared memory, at 2 and 4 ranks, and to the one-process reference that runs
the micro-batches in order (see [Note: the same bits as torch's pipelining]
in pydist/pipelining/stage.py)."""

import pytest
import torch

import pp_harness as h
from pydist.spawn import run_ranks

N_LAYERS, M, STEPS = 8, 4, 5


def _by_stage(per_rank: list[dict], key: str) -> list[torch.Tensor]:
    stages = {}
    for r in per_rank:
        stages.update(r[key])
    return [t for s in sorted(stages) for t in stages[s]]


def _last(per_rank: list[dict], key: str):
    return next(r[key] for r in per_rank if r["losses"])


def _assert_same(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}[{i}] differs by {float((x - y).abs().max())}"


def _check(results, cases, world, ref, torch_runs):
    for i, case in enumerate(cases):
        per_rank = [results[r][i] for r in range(world)]
        name = "/".join(map(str, case))
        _assert_same(_by_stage(per_rank, "grads"), ref["grads"], f"{name} grads vs reference")
        _assert_same(_by_stage(per_rank, "params"), ref["params"], f"{name} params vs reference")
        losses = _last(per_rank, "losses")
        assert len(losses) == STEPS
        for got, want in zip(losses, ref["losses"]):
            _assert_same(got, want, f"{name} losses vs reference")
        lib, schedule = case[0], case[1]
        if lib == "pydist":
            expected = {"process_group": "process_group", "shm": "shm", None: "shm"}[case[3]]
            assert per_rank[0]["carrier"] == expected
            twin = torch_runs.get(schedule)
            if twin is not None:  # the same schedule under torch
                theirs = [results[r][twin] for r in range(world)]
                assert torch.equal(_last(per_rank, "output"), _last(theirs, "output")), f"{name} step output"
                assert per_rank[0]["order"] == theirs[0]["order"], f"{name}: pipeline_order differs from torch's"


@pytest.mark.timeout(120)
def test_two_ranks_bitwise_with_torch_and_reference():
    cases = [("torch", "gpipe", 1, None), ("torch", "1f1b", 1, None), ("torch", "interleaved", 2, None)]
    cases += [("pydist", s, 2 if s == "interleaved" else 1, p2p)
              for s in ("gpipe", "1f1b", "interleaved") for p2p in ("process_group", "shm")]
    results = run_ranks(h.compare_job, 2, args=(cases, N_LAYERS, M, STEPS), timeout=100)
    torch_runs = {c[1]: i for i, c in enumerate(cases) if c[0] == "torch"}
    _check(results, cases, 2, h.reference(N_LAYERS, M, STEPS), torch_runs)


@pytest.mark.timeout(150)
def test_four_ranks_bitwise_with_torch_and_reference_then_a_raising_stage_ends_all_four():
    # 8 stages for the interleaved schedule: one layer each.
    cases = [("torch", "1f1b", 1, None), ("pydist", "1f1b", 1, "shm"), ("pydist", "gpipe", 1, "process_group"),
             ("pydist", "interleaved", 2, "shm")]
    results = run_ranks(h.compare_job, 4, args=(cases, N_LAYERS, M, STEPS, 2), timeout=130)
    torch_runs = {c[1]: i for i, c in enumerate(cases) if c[0] == "torch"}
    _check(results, cases, 4, h.reference(N_LAYERS, M, STEPS), torch_runs)
    # then stage 2 of 4 raises (see tests/pipelining/test_pipelining_failures.py): every rank ends naming it,
    # the first and last through two abort hops each
    for rank in range(4):
        message = results[rank][-1]
        assert message != "finished" and "stage 2" in message, (rank, message)
    assert "raised in its forward of micro-batch 1" in results[2][-1]
