"""Pipeline parallelism with torch.distributed.pipelining's names: a script
swaps the import.

    from pydist.pipelining import PipelineStage, Schedule1F1B   # was: from torch.distributed.pipelining import ...

    stage = PipelineStage(my_part_of_the_model, stage_index=rank, num_stages=world, device=device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    if rank == 0:
        schedule.step(x)                          # the first stage takes the batch
    elif rank == world - 1:
        out = schedule.step(target=y, losses=losses)
    else:
        schedule.step()

Activations go forward and gradients back over pydist's channels (shared
memory between ranks of one host, the process group otherwise, delayed by
PYDIST_SIM_NET), each end on a thread of its own; losses, gradients and
parameters are bitwise those of torch's schedules with the same micro-batches
(see [Note: the same bits as torch's pipelining] in stage.py). Every wait is
bounded and a failing stage ends every rank ([Note: nothing hangs] in
schedules.py). docs/pipelining.md is the guide.
"""

from pydist.pipelining._p2p import P2PError
from pydist.pipelining.schedules import (
    PipelineError,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    StageRecord,
)
from pydist.pipelining.stage import PipelineStage

__all__ = [
    "PipelineStage",
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "PipelineScheduleSingle",
    "PipelineScheduleMulti",
    "PipelineError",
    "P2PError",
    "StageRecord",
]

# torch.distributed.pipelining names pydist does not implement: a script that
# uses one gets an error naming it rather than an AttributeError.
_NOT_IMPLEMENTED = {
    "pipeline": "tracing a model into stages (split the model by hand into one module per stage)",
    "Pipe": "tracing a model into stages",
    "pipe_split": "tracing a model into stages",
    "SplitPoint": "tracing a model into stages",
    "build_stage": "stages from a traced pipeline",
    "ScheduleLoopedBFS": "the looped breadth-first schedule",
    "ScheduleInterleavedZeroBubble": "zero-bubble schedules (split input/weight backward)",
    "ScheduleZBVZeroBubble": "zero-bubble schedules (split input/weight backward)",
    "ScheduleDualPipeV": "the DualPipeV schedule",
}


def __getattr__(name):
    if name in _NOT_IMPLEMENTED:
        raise NotImplementedError(f"pydist.pipelining.{name}: {_NOT_IMPLEMENTED[name]} is not implemented; "
                                  f"GPipe, 1F1B and interleaved 1F1B are")
    raise AttributeError(f"module 'pydist.pipelining' has no attribute {name!r}")
