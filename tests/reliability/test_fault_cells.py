"""Cells of the fault matrix (fault_matrix.py) under pytest: a rank of a
sharded job that dies, raises or exits inside a forward, while the other waits in
a gather of that forward's plan, ends the whole job within seconds (well
inside the group's 10 s timeout: the death is noticed, not timed out), and
the surviving rank's error names the collective and the rank it waited for."""

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fault_matrix  # noqa: E402


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher,scenario,wrapper", [
    ("manual", "kill9", "pydist-fsdp-shm"),
    ("manual", "exception", "pydist-fsdp-shm"),
    ("manual", "kill9", "pydist-fsdp-gloo"),
    # Under mpiexec the rank that exits waits in MPI_Finalize for the others,
    # its end still attached unless closed at exit: the survivor then waited
    # out the whole timeout (see [Note: leaving the segment at exit] in
    # pydist/transport/shm_segment.py).
    ("mpiexec", "early_exit", "pydist-fsdp-shm"),
])
def test_sharded_job_ends_when_a_rank_fails_in_forward(tmp_path, launcher, scenario, wrapper):
    if launcher == "mpiexec" and shutil.which("mpiexec") is None:
        pytest.skip("needs mpiexec (pip install mpich)")
    # The cell kills its ranks itself as hung after 90 s, before pytest's timeout.
    row = fault_matrix.run_cell(launcher, scenario, wrapper, str(tmp_path), where="forward", cap_s=30)
    assert not row["hang"], row
    assert row["seconds"] is not None and row["seconds"] < fault_matrix.TIMEOUT_S / 2, row
    assert all(rc != 0 for rc in row["rc"]), row  # the survivor raised too, it did not train on
    assert row["leftovers"] == 0, row
    if wrapper.endswith("shm"):
        assert "shared-memory all-gather" in row["message"] and "rank 0 waited for rank 1" in row["message"], row


@pytest.mark.timeout(150)
@pytest.mark.parametrize("wrapper", ["pydist-fsdp-shm", "pydist-fsdp-gloo"])
def test_sharded_job_ends_when_one_rank_catches_an_exception_in_forward(tmp_path, wrapper):
    """Rank 1's forward raises and its loop catches it and trains on, as a
    loop that skips a bad batch does; rank 0 never raised. The ranks' gathers
    are then out of step, with the same sizes: neither trains on parameters
    paired with another unit's, both stop at the end of rank 0's forward,
    naming the forwards they are in."""
    row = fault_matrix.run_cell("manual", "caught", wrapper, str(tmp_path), where="forward", cap_s=30)
    assert not row["hang"], row
    assert row["seconds"] is not None and row["seconds"] < fault_matrix.TIMEOUT_S / 2, row
    assert all(rc != 0 for rc in row["rc"]), row
    assert row["leftovers"] == 0, row
    assert "ran different fully_shard'ed units" in row["message"], row
    assert "different forwards of the root (rank 0: #6, rank 1: #7)" in row["message"], row


@pytest.mark.timeout(150)
def test_sharded_job_ends_when_one_rank_catches_an_exception_in_backward(tmp_path):
    """The same in backward, on shared memory: rank 1 abandons its backward
    with reduce-scatters still to issue and begins its next forward, whose
    first collective meets rank 0's next reduce-scatter. The transport
    compares every call's kind and size across the ranks, so both stop there,
    naming the two calls. (On gloo, pydist's and torch's, the ranks wait out
    the group's timeout instead.)"""
    row = fault_matrix.run_cell("manual", "caught", "pydist-fsdp-shm", str(tmp_path), where="backward", cap_s=30)
    assert not row["hang"], row
    assert row["seconds"] is not None and row["seconds"] < fault_matrix.TIMEOUT_S / 2, row
    assert all(rc != 0 for rc in row["rc"]), row
    assert row["leftovers"] == 0, row
    assert "the ranks issued different collectives: rank 0 runs reduce-scatter" in row["message"], row
