"""Record a run's bucket assignment and launch order; replay it in another.

    PYDIST_RECORD_PLAN=plan.json python train.py    # rank 0 writes the plan once buckets are rebuilt
    PYDIST_REPLAY=plan.json python train.py         # every wrapper reduces with that plan
    overlap.save_plan(ddp, "plan.json"); overlap.replay(ddp, "plan.json")   # the same from code

A plan is the buckets as lists of parameter indices in launch order (the
reducer launches buckets in list order, and each bucket's chunks in order:
see [Note: chunked launches] in csrc/reducer/reducer.h), with the
parameters' names, shapes and dtypes to check it against, and the chunk
size it was reduced with. Replayed, the reducer takes the plan before the
first backward and never rebuilds it from the gradient order, so two runs
that differ in anything else (bucket caps, the simulated network, the
transport) sum every gradient in the same grouping: with the same data and
seeds their parameters are bitwise equal.
"""

from __future__ import annotations

import atexit
import json
import os
import warnings
import weakref
from typing import NamedTuple

__all__ = ["ENV", "RECORD_ENV", "Plan", "plan_of", "save_plan", "load_plan", "apply_plan", "replay"]

ENV = "PYDIST_REPLAY"
RECORD_ENV = "PYDIST_RECORD_PLAN"
FORMAT = "pydist.overlap.plan/1"


class Plan(NamedTuple):
    buckets: list[list[int]]  # parameter indices, in launch order
    params: list[tuple[str, list[int], str]]  # name, shape, dtype of each parameter the reducer owns
    chunk_bytes: int
    world_size: int
    source: str = ""  # the file it was read from (load_plan), for errors; not saved


def plan_of(ddp) -> Plan:
    return Plan(
        buckets=[list(b) for b in ddp.reducer.bucket_indices()],
        params=[(n, list(p.shape), str(p.dtype)) for n, p in zip(ddp._param_names, ddp._params)],
        chunk_bytes=ddp._chunk_bytes,
        world_size=ddp.reducer.transport.world_size,  # readable after the group is destroyed too
    )


def save_plan(ddp, path: str) -> Plan:
    """Writes ``ddp``'s current plan (call it after the first iteration, once
    the buckets were rebuilt from the gradient order)."""
    plan = plan_of(ddp)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, **{k: v for k, v in plan._asdict().items() if k != "source"}}, f, indent=1)
    os.replace(tmp, path)
    return plan


def load_plan(path: str) -> Plan:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"pydist.overlap replay: cannot read the plan {path!r} ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise RuntimeError(f"pydist.overlap replay: {path!r} is not a pydist plan (format {found!r})")
    try:
        return Plan(buckets=[[_index(i) for i in bucket] for bucket in data["buckets"]],
                    params=[(str(name), [_index(n) for n in shape], str(dtype)) for name, shape, dtype in data["params"]],
                    chunk_bytes=_index(data["chunk_bytes"]), world_size=_index(data["world_size"]), source=path)
    except KeyError as exc:
        problem = f"no {exc.args[0]!r} entry"
    except (TypeError, ValueError) as exc:
        problem = str(exc)
    raise RuntimeError(f"pydist.overlap replay: the plan {path!r} is damaged ({problem}); record it again "
                       f"({RECORD_ENV}=FILE or overlap.save_plan)")


def _index(value) -> int:
    """A non-negative integer of a plan file (bools and fractions are not)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} where a non-negative integer belongs")
    return value


def apply_plan(ddp, plan: Plan, reducer=None) -> None:
    """The reducer (``ddp.reducer`` unless given) takes ``plan`` as its final
    assignment. Raises naming the first parameter that differs from the
    plan's; must run before the first backward."""
    reducer = reducer if reducer is not None else ddp.reducer
    mine = [(n, list(p.shape), str(p.dtype)) for n, p in zip(ddp._param_names, ddp._params)]
    theirs = [(n, list(s), d) for n, s, d in plan.params]
    read = f" (read from {plan.source!r})" if plan.source else ""
    if len(mine) != len(theirs):
        raise RuntimeError(
            f"pydist.overlap replay: the plan has {len(theirs)} parameters, this model {len(mine)}{read}; "
            "replay a plan recorded from the same model (nothing was applied)"
        )
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            raise RuntimeError(
                f"pydist.overlap replay: parameter {i} is {a[0]} {a[1]} {a[2]} here but {b[0]} {b[1]} {b[2]} "
                f"in the plan{read}; replay a plan recorded from the same model (nothing was applied)"
            )
    if plan.chunk_bytes != ddp._chunk_bytes:
        warnings.warn(
            f"pydist.overlap replay: the plan was reduced in chunks of {plan.chunk_bytes} bytes, this wrapper "
            f"uses {ddp._chunk_bytes}; beyond 2 ranks sums may differ at rounding level "
            f"(pass allreduce_chunk_mb={plan.chunk_bytes / 2**20:g} to hold them fixed)",
            stacklevel=3,
        )
    reducer.rebuild_buckets(plan.buckets)  # the layout is Rebuilt for good: no rebuild from the gradient order
    ddp._pydist_replayed_plan = plan


def replay(ddp, plan: "str | Plan") -> None:
    """The API form of PYDIST_REPLAY: call after wrapping, before the first forward."""
    apply_plan(ddp, load_plan(plan) if isinstance(plan, str) else plan)


def record_plan_at_exit(ddp, path: str) -> None:
    """PYDIST_RECORD_PLAN: rank 0 writes ``ddp``'s plan at the first forward
    after its buckets were rebuilt, and again at exit."""
    import torch.distributed as dist

    if dist.get_rank(ddp.process_group) != 0:
        return
    hook = _SavePlanOnceRebuilt(path)
    hook.handle = ddp.register_forward_pre_hook(hook)
    ref = weakref.ref(ddp)

    def save_at_exit():
        alive = ref()
        if alive is not None and getattr(alive, "reducer", None) is not None and hook.handle.id in alive._forward_pre_hooks:
            save_plan(alive, path)  # the run ended before a forward after the rebuild

    atexit.register(save_at_exit)


class _SavePlanOnceRebuilt:
    """Forward pre-hook: saves the plan at the first forward after the
    rebuild, then removes itself. Pickled, it becomes inert."""

    def __init__(self, path: str):
        self.path = path
        self.handle = None

    def __call__(self, module, args) -> None:
        if module._has_rebuilt_buckets:
            save_plan(module, self.path)
            self.handle.remove()

    def __reduce__(self):
        from pydist.overlap.recording import InertHook

        return (InertHook, ())
