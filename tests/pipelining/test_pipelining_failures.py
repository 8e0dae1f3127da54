"""Nothing hangs (see [Note: nothing hangs] in pydist/pipelining/schedules.py):
a stage that raises, dies or stalls ends every rank within the timeout,
and every rank's error names the failing stage; over the process group
(gloo) and shared memory, side by side in one job (two independent
pipelines on ranks {0, 1} and {2, 3}); a raise in the middle of 4 stages
is checked at the end of the 4-rank parity job
(test_pipelining_parity.py). Then many short pipelines of each schedule,
new each time, and no hang."""

import pytest

import pp_failures as f
from pydist.pipelining.schedules import kStallExitCode

TIMEOUT = 3.0  # each stage's timeout; every rank must be done well within the launcher's 45 s
SIDE_BY_SIDE = [([0, 1], "process_group"), ([2, 3], "shm")]


def _names_stage_1(message: str) -> bool:
    return "stage 1" in message


@pytest.mark.timeout(90)
def test_a_stage_that_raises_ends_every_rank_naming_it():
    out = f.launch(f.faulty_job, 4, args=(SIDE_BY_SIDE, "1f1b", 1, "raise", TIMEOUT), timeout_s=45)
    for rank in range(4):
        status, message, seconds = out[rank]
        assert status == "raised", (rank, out[rank])
        assert "stage 1" in message and "injected fault" in message, (rank, message)
    # the stage that raised names its action and micro-batch
    assert "raised in its forward of micro-batch 1" in out[1][1] and "raised in its forward" in out[3][1]
    # its peers heard of it through the abort message, long before their timeout
    assert "stage 1 failed" in out[0][1] and "stage 1 failed" in out[2][1]


@pytest.mark.timeout(90)
def test_a_stage_that_dies_ends_its_peers_naming_it():
    out = f.launch(f.faulty_job, 4, args=(SIDE_BY_SIDE, "1f1b", 1, "die", TIMEOUT), timeout_s=45)
    assert out[1][0] == "exit 3" and out[3][0] == "exit 3", out
    for rank in (0, 2):
        status, message, _ = out[rank]
        assert status == "raised" and "stage 1 (rank 1)" in message, (rank, out[rank])


@pytest.mark.timeout(90)
def test_a_stage_that_stalls_is_ended_by_its_watchdog_and_its_peers_time_out():
    out = f.launch(f.faulty_job, 4, args=(SIDE_BY_SIDE, "1f1b", 1, "stall", TIMEOUT), timeout_s=45)
    assert out[1][0] == f"exit {kStallExitCode}" and out[3][0] == f"exit {kStallExitCode}", out
    for rank in (0, 2):
        status, message, _ = out[rank]
        # the channel gives up after the timeout, naming the stage it waited for
        assert status == "raised" and ("stage 1 on rank 1 did not send it" in message
                                       or "of stage 1 (rank 1) -> stage 0" in message), (rank, out[rank])


@pytest.mark.timeout(120)
def test_fifty_runs_of_each_schedule_on_gloo_and_shm_do_not_hang():
    out = f.launch(f.repeated_job, 2, args=(50,), timeout_s=100)
    assert out[0] == out[1] or (out[0][:2] == out[1][:2]), out
    assert out[0][:2] == ("ok", 300) and out[1][:2] == ("ok", 300), out
