"""Cells of the fault matrix (fault_matrix.py) under pytest: a rank of a
sharded job that dies or raises inside a forward, while the other waits in
a gather of that forward's plan, ends the whole job within seconds (well
inside the group's 10 s timeout: the death is noticed, not timed out), and
the surviving rank's error names the collective and the rank it waited for."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fault_matrix  # noqa: E402


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scenario,wrapper", [
    ("kill9", "pydist-fsdp-shm"),
    ("exception", "pydist-fsdp-shm"),
    ("kill9", "pydist-fsdp-gloo"),
])
def test_sharded_job_ends_when_a_rank_fails_in_forward(tmp_path, scenario, wrapper):
    row = fault_matrix.run_cell("manual", scenario, wrapper, str(tmp_path), where="forward")
    assert not row["hang"], row
    assert row["seconds"] is not None and row["seconds"] < fault_matrix.TIMEOUT_S, row
    assert row["rc"][1] != 0 and row["rc"][0] != 0, row  # the survivor raised too, it did not train on
    assert row["leftovers"] == 0, row
    if wrapper.endswith("shm"):
        assert "shared-memory all-gather" in row["message"] and "rank 0 waited for rank 1" in row["message"], row
