"""The overlap lab: how a DDP step's communication overlaps its backward.

    from pydist import overlap
    overlap.record(ddp)                  # records on (overlap.record() for every wrapper)
    ...train...
    for s in overlap.steps(ddp):         # per step: exposed communication, per bucket too
        print(s.iteration, s.exposed_ms, "waited last on bucket", s.waited_last)
    overlap.reset(ddp)

From the environment, any unchanged script (torchrun, mpiexec, spawn):

    PYDIST_TRACE=DIR        one Chrome trace per rank, DIR/rank{R}.json (trace.py)
    PYDIST_SIM_NET=10Gbps,20us   gradients over a simulated link (network.py)
    PYDIST_RECORD_PLAN=FILE / PYDIST_REPLAY=FILE   bucket plans (plans.py)

and ``python -m pydist.overlap merge|report|predict`` over the traces (__main__.py;
predict.py: the step at another link or bucket cap, from one recorded run).
"""

from pydist.overlap.analysis import BucketOverlap, StepOverlap, analyze_step
from pydist.overlap.recording import record, records, reset, steps, stop, wrappers
from pydist.overlap.plans import Plan, load_plan, replay, save_plan
from pydist.overlap.network import Link, model_seconds, parse_link, sim_net

__all__ = [
    "BucketOverlap", "StepOverlap", "analyze_step",
    "record", "records", "reset", "steps", "stop", "wrappers",
    "Plan", "load_plan", "replay", "save_plan",
    "Link", "model_seconds", "parse_link", "sim_net",
]
