"""Ranks that fail on purpose, and a launcher that watches every rank end
on its own: unlike pydist.spawn.run_ranks, it kills nobody early, so a test
sees whether each rank ends by itself, and how, within the timeout."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import pp_harness as h




def _rank_main(fn, rank, world, args, store, timeout_s, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    start = time.monotonic()
    try:
        value = fn(rank, world, *args)
        results.put((rank, "ok", value, time.monotonic() - start))
    except BaseException as exc:  # the test reads what each rank raised
        results.put((rank, "raised", f"{type(exc).__name__}: {exc}", time.monotonic() - start))
    results.close()
    results.join_thread()  # the result is out before the process is
    os._exit(0)  # no teardown: a peer may be gone


def launch(fn, world: int, args=(), timeout_s: float = 30.0, group_timeout_s: float = 10.0) -> dict:
    """Runs fn on ``world`` ranks; waits up to ``timeout_s`` for every
    process to exit. Returns {rank: (status, value or message, seconds)}
    with status "ok", "raised" or "exit <code>" (died or ended itself)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pydist-pp-") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world, args, os.path.join(tmp, "store"),
                                                      group_timeout_s, results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        out = {}
        while True:
            try:
                rank, status, value, seconds = results.get(timeout=0.5)
            except queue.Empty:
                break
            out[rank] = (status, value, seconds)
        for r, p in enumerate(procs):
            if r not in out:
                out[r] = ("hung" if r in hung else f"exit {p.exitcode}", None, None)
        return out


class Faulty(nn.Module):
    """Identity that misbehaves in the forward of one micro-batch (its n-th call)."""

    def __init__(self, inner: nn.Module, how: str, at_call: int):
        super().__init__()
        self.inner, self.how, self.at_call, self.calls = inner, how, at_call, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at_call:
            if self.how == "raise":
                raise ValueError("injected fault")
            if self.how == "die":
                os._exit(3)
            if self.how == "stall":
                time.sleep(600)
        return self.inner(x)


def faulty_job(rank: int, world: int, pipelines: list, schedule: str, bad_stage: int, how: str,
               stage_timeout: float):
    """Independent pipelines side by side, ``pipelines`` a list of (ranks,
    p2p): in each, one step of ``schedule`` in which stage ``bad_stage``
    misbehaves (``how``) in its second forward. Raises what the step raised."""
    from pydist import pipelining as pp

    groups = [dist.new_group(ranks) for ranks, _ in pipelines]  # collective: every rank makes every group
    (ranks, p2p), group = next(((r, p), g) for (r, p), g in zip(pipelines, groups) if rank in r)
    n = len(ranks)
    me = ranks.index(rank)
    parts = h.split(h.make_layers(n * 2), n)
    module = Faulty(parts[me], how, at_call=2) if me == bad_stage else parts[me]
    stage = pp.PipelineStage(module, me, n, torch.device("cpu"), group=group, p2p=p2p, timeout=stage_timeout)
    cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=4, loss_fn=h.loss_fn)
    x, y = h.batches(1)[0]
    if me == 0:
        sched.step(x)
    elif me == n - 1:
        sched.step(target=y)
    else:
        sched.step()
    return "finished"


def repeated_job(rank: int, world: int, runs: int):
    """``runs`` pipelines of each schedule and carrier, one step each, each
    with new stages and channels; returns how many ran."""
    from pydist import pipelining as pp

    done = 0
    for p2p in ("process_group", "shm"):
        for schedule in ("gpipe", "1f1b", "interleaved"):
            for _ in range(runs):
                spr = 2 if schedule == "interleaved" else 1
                parts = h.split(h.make_layers(2 * world * spr), world * spr)
                mine = [s for s in range(world * spr) if s % world == rank]
                stages = [pp.PipelineStage(parts[s], s, world * spr, torch.device("cpu"), p2p=p2p, timeout=20)
                          for s in mine]
                cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
                       "interleaved": pp.ScheduleInterleaved1F1B}[schedule]
                sched = cls(stages if spr == 2 else stages[0], n_microbatches=4, loss_fn=h.loss_fn)
                x, y = h.batches(1)[0]
                kwargs = {"target": y} if world * spr - 1 in mine else {}
                sched.step(*((x,) if 0 in mine else ()), **kwargs)
                sched.close()
                done += 1
    return done
