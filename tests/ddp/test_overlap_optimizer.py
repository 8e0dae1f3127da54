"""DistributedDataParallel.overlap_optimizer against stock torch DDP + the same optimizer.

Each spawned rank trains stock ``torch.nn.parallel.DistributedDataParallel``
with an optimizer stepped after backward, and pydist's wrapper with
``overlap_optimizer(opt)``, from the same seeds on the same per-rank data,
and compares every loss (computed by forwards that overlap the previous
step's updates, so a forward that read a parameter before its update shows
here), the final parameters and buffers and the optimizer's state_dict:
bitwise at 2 ranks (see [Note: when the suite asserts bitwise equality] in
ddp_harness; per-bucket updates of an element-wise optimizer are the same
arithmetic as one step: [Note: why element-wise only]), and at 3 ranks
bitwise against plain pydist DDP + the optimizer (same transport, same
summation order) and to rtol 1e-5 against torch (gloo sums 3 ranks in its
own order, and Adam divides rounding-level gradient differences by
sqrt(v), so parameters drift by more than the gradients' 1e-7).

pydist's gradients go over a slow simulated link, so buckets land well after
backward and the update worker lags the next forward: the ordering is
exercised, not only the arithmetic. The records test checks the two
invariants directly: no bucket is updated before its all-reduce completed
(the reducer's completion stamp), and no module's forward starts before the
update of every bucket holding its parameters.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pydist.spawn import run_ranks

SLOW_LINK = "0.05Gbps,200us"  # ~6 MB/s: a 1 KB bucket lands ~0.4 ms after launch, the step's 30 KB ~5 ms


class Net(nn.Module):
    """Linear+LayerNorm blocks (one ~1 KB bucket each at the test's cap), an
    optional BatchNorm (buffers) and an optional branch some steps skip."""

    def __init__(self, width: int = 16, depth: int = 5, bn: bool = False, branch: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(depth))
        self.bn = nn.BatchNorm1d(width) if bn else None
        self.branch = nn.Linear(width, width) if branch else None
        self.out = nn.Linear(width, 4)

    def forward(self, x, use_branch: bool = True):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        if self.bn is not None:
            h = self.bn(h)
        if self.branch is not None and use_branch:
            h = h + self.branch(h)
        return self.out(h)


@dataclasses.dataclass(frozen=True)
class Run:
    optimizer: str = "sgd"      # "sgd" (momentum, weight decay), "adam_foreach", "adamw_fused", "adamw"
    steps: int = 8
    micro: int = 1              # micro-batches per step; all but the last under no_sync
    bn: bool = False
    branch: bool = False        # find_unused_parameters, branch skipped on some ranks and steps
    scheduler: bool = False     # StepLR halving lr every 2 steps
    set_to_none: bool = True
    checkpoint_at: int = -1     # pydist: checkpoint after this many steps, resume in a fresh model
    clip: bool = False          # torch's clip_grad_norm_ between backward and opt.step() (no wait_grads)
    scaler: bool = False        # torch.amp.GradScaler's scale / step / update (no wait_grads)
    updates: str = "auto"       # overlap_optimizer's updates=: which thread applies them


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if name == "adam_foreach":
        return torch.optim.Adam(params, lr=1e-2, foreach=True)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True)
    raise ValueError(name)


def _batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _build(impl: str, run: Run, state=None):
    from pydist import DistributedDataParallel

    torch.manual_seed(0)
    module = Net(bn=run.bn, branch=run.branch)
    if state is not None:
        module.load_state_dict(state)
    kwargs = dict(bucket_cap_mb=0.001, find_unused_parameters=run.branch)
    if impl == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(module, **kwargs)
    else:
        ddp = DistributedDataParallel(module, first_bucket_cap_mb=0.001, sim_net=SLOW_LINK, **kwargs)
    opt = _optimizer(run.optimizer, ddp.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if run.scheduler else None
    if impl == "overlap":
        ddp.overlap_optimizer(opt, updates=run.updates)
    return ddp, opt, sched


def _train(impl: str, run: Run, rank: int, record=None):
    """Losses of every backward, then the final module state and optimizer state."""
    ddp, opt, sched = _build(impl, run)
    if record is not None:
        record(ddp)
    losses = []
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if run.scaler else None
    for step in range(run.steps):
        if step == run.checkpoint_at:
            state = copy.deepcopy(ddp.module.state_dict())  # waits for the updates in flight
            opt_state = copy.deepcopy(opt.state_dict())
            sched_state = sched.state_dict() if sched else None
            del ddp, opt, sched
            ddp, opt, sched = _build(impl, run, state)
            opt.load_state_dict(opt_state)
            if sched:
                sched.load_state_dict(sched_state)
        opt.zero_grad(set_to_none=run.set_to_none)
        for micro in range(run.micro):
            x, y = _batch(rank, step, micro)
            sync = contextlib.nullcontext() if micro == run.micro - 1 else ddp.no_sync()
            with sync:
                loss = F.mse_loss(ddp(x, use_branch=(step + rank) % 3 != 0), y)
                (scaler.scale(loss) if scaler else loss).backward()
            losses.append(loss.detach().clone())
        if run.clip:  # reads every averaged gradient: see [Note: clipping and loss scaling wait for the gradients]
            losses.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05))
        if scaler:
            scaler.step(opt)
            scaler.update()
            losses.append(torch.tensor(scaler.get_scale()))
        else:
            opt.step()
        if sched:
            sched.step()
    module_state = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    return {"losses": losses, "module": module_state, "opt": copy.deepcopy(opt.state_dict()), "ddp": ddp}


def _assert_same(a, b, exact: bool, what: str):
    def check(x, y, where):
        if torch.is_tensor(x):
            if exact:
                assert torch.equal(x, y), f"{what}: {where} differs: max |diff| {(x - y).abs().max().item()}"
            else:
                assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), \
                    f"{what}: {where} differs: max |diff| {(x - y).abs().max().item()}"
        elif isinstance(x, dict):
            assert x.keys() == y.keys(), f"{what}: {where} keys {sorted(x)} vs {sorted(y)}"
            for k in x:
                check(x[k], y[k], f"{where}.{k}")
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), f"{what}: {where} length"
            for i, (u, v) in enumerate(zip(x, y)):
                check(u, v, f"{where}[{i}]")
        else:
            assert x == y, f"{what}: {where}: {x!r} vs {y!r}"

    for key in ("losses", "module", "opt"):
        check(a[key], b[key], key)


RUNS_2 = [
    Run(optimizer="sgd", steps=8, scaler=True),
    Run(optimizer="adam_foreach", steps=6, micro=2, bn=True, scheduler=True, clip=True),
    Run(optimizer="adamw_fused", steps=6, branch=True, set_to_none=False),
    Run(optimizer="adamw", steps=6, scheduler=True, checkpoint_at=3),
    Run(optimizer="sgd", steps=6, micro=2, branch=True, bn=True, checkpoint_at=2),
]


def _parity_ranks(rank, world_size, runs):
    failures = []
    for run in runs:
        reference = _train("torch", run, rank)
        overlapped = _train("overlap", run, rank)
        try:
            if world_size == 2:
                _assert_same(reference, overlapped, exact=True, what=f"{run} vs torch")
            else:
                _assert_same(_train("pydist", run, rank), overlapped, exact=True, what=f"{run} vs pydist")
                _assert_same(reference, overlapped, exact=False, what=f"{run} vs torch")
        except AssertionError as error:
            failures.append(str(error))
    return failures


@pytest.mark.timeout(120)
def test_bitwise_parity_with_torch_two_ranks():
    for failures in run_ranks(_parity_ranks, 2, args=(RUNS_2,)):
        assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
def test_parity_three_ranks():
    runs = [Run(optimizer="sgd", steps=5, micro=2), Run(optimizer="adamw_fused", steps=5, branch=True, bn=True)]
    for failures in run_ranks(_parity_ranks, 3, args=(runs,)):
        assert not failures, "\n".join(failures)


def _ordering_ranks(rank, world_size, updates):
    """Per step: the reducer's completion stamp of each bucket, when its
    update began, and when each module's forward began (a pre-hook added
    after overlap_optimizer's, so it runs after that module's wait)."""
    forward_starts: list[dict[str, int]] = []

    def record(ddp):
        ddp.set_record_timing(True, keep=64)
        for name, module in ddp.module.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(
                    lambda m, args, name=name: forward_starts[-1].__setitem__(name, time.monotonic_ns()))
        original = ddp.forward

        def forward(*a, **k):
            forward_starts.append({})
            return original(*a, **k)

        ddp.forward = forward

    run = Run(optimizer="adamw", steps=8, updates=updates)
    result = _train("overlap", run, rank, record=record)
    ddp = result.pop("ddp")
    params = ddp._params
    names = {id(p): n.rpartition(".")[0] for n, p in ddp.module.named_parameters()}
    reduced = {r.iteration: r for r in ddp.iteration_records()}
    problems, checked = [], 0
    for upd in ddp.update_records():
        it = reduced[upd.step]
        complete = {b.index: it.start_ns + b.complete_ms * 1e6 for b in it.buckets}
        for b in upd.buckets:
            began = upd.start_ns + b.update_start_ms * 1e6
            if began < complete[b.index]:
                problems.append(f"step {upd.step}: bucket {b.index} updated before its all-reduce completed")
            checked += 1
        # the forward after this step: every module started after its buckets' updates
        # (records of the steps before the one-time bucket rebuild have another layout)
        if upd.step + 1 < len(forward_starts) and len(upd.buckets) == len(ddp.bucket_indices()):
            starts = forward_starts[upd.step + 1]
            updated = {b.index: upd.start_ns + b.updated_ms * 1e6 for b in upd.buckets}
            for bucket, indices in enumerate(ddp.bucket_indices()):
                for i in indices:
                    module = names[id(params[i])]
                    if module in starts and starts[module] < updated[bucket]:
                        problems.append(f"step {upd.step}: module {module!r} ran before bucket {bucket} was updated")
    waited = sum(b.forward_wait_ms for r in ddp.update_records() for b in r.buckets)
    return {"problems": problems, "checked": checked, "waited_ms": waited,
            "report": ddp.update_records()[-1].report()}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("updates", ["worker", "forward"])
def test_updates_follow_allreduce_and_precede_forward(updates):
    for result in run_ranks(_ordering_ranks, 2, args=(updates,)):
        assert result["checked"] >= 5 * 6, result  # most steps' buckets were checked
        assert not result["problems"], "\n".join(result["problems"]) + "\n" + result["report"]


def _refusals(rank, world_size):
    from pydist import DistributedDataParallel

    out = {}
    ddp = DistributedDataParallel(Net())

    def refused(key, fn):
        try:
            fn()
            out[key] = None
        except (ValueError, RuntimeError, TypeError) as error:
            out[key] = str(error)

    refused("lbfgs", lambda: ddp.overlap_optimizer(torch.optim.LBFGS(ddp.parameters())))
    refused("rprop", lambda: ddp.overlap_optimizer(torch.optim.Rprop(ddp.parameters())))
    hooked = torch.optim.SGD(ddp.parameters(), lr=0.1)
    hooked.register_step_post_hook(lambda *a: None)
    refused("hooks", lambda: ddp.overlap_optimizer(hooked))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp.overlap_optimizer(opt)
    refused("second", lambda: ddp.overlap_optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1)))
    ddp(torch.randn(4, 8)).sum().backward()
    refused("closure", lambda: opt.step(lambda: 0.0))
    # wait_grads: averaged gradients in .grad before opt.step(), e.g. for clipping
    ddp.wait_grads()
    grads = [p.grad.clone() for p in ddp.parameters()]
    summed = [g.clone() for g in grads]
    for g in summed:
        dist.all_reduce(g)
    out["grads_averaged"] = all(torch.equal(g, s / world_size) for g, s in zip(grads, summed))
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    opt.step()
    ddp.wait_updates()
    ddp.overlap_optimizer(None)  # detach: plain DDP again
    ddp(torch.randn(4, 8)).sum().backward()
    out["detached_state"] = ddp.reducer.state
    return out


@pytest.mark.timeout(60)
def test_refusals_and_wait_grads():
    for out in run_ranks(_refusals, 2):
        assert "LBFGS is not element-wise" in out["lbfgs"]
        assert "Rprop is not one of the optimizers" in out["rprop"]
        assert "step hook" in out["hooks"]
        assert "another optimizer is already attached" in out["second"]
        assert "closure" in out["closure"]
        assert out["grads_averaged"]
        assert out["detached_state"] == "Idle"


def _copies(rank, world_size):
    """A wrapper with overlap_optimizer pickles and deep-copies (waiting for
    its updates first); the copy trains as plain DDP, the original goes on."""
    import io

    from pydist import DistributedDataParallel

    ddp = DistributedDataParallel(Net(), sim_net=SLOW_LINK, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ddp.overlap_optimizer(opt)
    ddp(torch.randn(4, 8)).sum().backward()
    opt.step()  # updates in flight
    buffer = io.BytesIO()
    torch.save(ddp, buffer)  # pickling waits for them
    clone = copy.deepcopy(ddp)
    same = all(torch.equal(a, b) for a, b in zip(ddp.parameters(), clone.parameters()))
    clone(torch.randn(4, 8)).sum().backward()
    ddp(torch.randn(4, 8)).sum().backward()
    opt.step()
    ddp.wait_updates()
    return {"same": same, "clone_overlap": clone._overlap, "clone_state": clone.reducer.state}


@pytest.mark.timeout(60)
def test_pickle_and_deepcopy():
    for out in run_ranks(_copies, 2):
        assert out == {"same": True, "clone_overlap": None, "clone_state": "Idle"}
