"""Runs of units (see [Note: runs of units] in pydist/fsdp/_fsdp_schedule.py):
consecutive units of one gather batch, each taking the one output of the
one before it, whose backward is handled as one; the hooks on the inner
units' outputs close (csrc/fsdp/output_gate.h) and pack in C++. Bitwise
beside torch's ``fully_shard`` at two ranks for chains with the shapes a
run must survive: an inner output also used past the run, the run's last
output unused while an inner one is, a member with a unit nested inside it;
and, on a plain chain, that the runs form as described and the backward
calls Python hooks only where runs end."""

from functools import partial

import pytest
import torch
import torch.nn as nn

from pydist.spawn import run_ranks

DIM = 16


class Block(nn.Module):
    def __init__(self, inner: bool = False):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.inner = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) if inner else None

    def forward(self, x):
        h = self.norm(self.lin(x))
        return h + self.inner(h) if self.inner is not None else h


class Chain(nn.Module):
    """Six units in a chain between root layers; ``skip``: block 2's output
    also reaches the loss past the run; ``dead_end``: the last two blocks'
    outputs reach no loss, block 3's does; ``nested``: block 3 holds a unit."""

    def __init__(self, skip: bool = False, dead_end: bool = False, nested: bool = False):
        super().__init__()
        from fsdp_harness import IN, OUT

        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList([Block(inner=nested and i == 3) for i in range(6)])
        self.head = nn.Linear(DIM, OUT)
        self.skip, self.dead_end = skip, dead_end

    def forward(self, x):
        h = self.inp(x)
        outs = []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        if self.dead_end:
            return self.head(outs[3]) + 0 * outs[5].detach().sum()
        return self.head(h + outs[2]) if self.skip else self.head(h)

    def units(self):
        return [m for b in self.blocks for m in ([b.inner] if b.inner is not None else []) + [b]]


@pytest.mark.timeout(150)
def test_runs_bitwise_with_torch_fully_shard():
    from fsdp_harness import Scenario, assert_parity, run_parity

    scenarios = [
        Scenario(model="chain", optimizer="adam", shm=True),
        Scenario(model="chain", optimizer="sgd", shm=False),
        Scenario(model="chain", optimizer="sgd", micro_steps=3, shm=True),
        Scenario(model="chain", optimizer="adam", mixed=True, shm=True),
        Scenario(model="chain_skip", optimizer="adam", shm=True),
        Scenario(model="chain_dead_end", optimizer="sgd", shm=True),
        Scenario(model="chain_nested", optimizer="adam", shm=False),
    ]
    models = {"chain": Chain, "chain_skip": partial(Chain, skip=True), "chain_dead_end": partial(Chain, dead_end=True),
              "chain_nested": partial(Chain, nested=True)}
    results = run_parity(scenarios, 2, timeout=140, models=models)
    assert_parity(results, exact=True, scenarios=scenarios)


def _formation_rank(rank, world_size):
    import pydist
    from pydist.fsdp import _fsdp_state

    torch.manual_seed(0)
    model = Chain()
    for block in model.blocks:
        pydist.fully_shard(block)
    pydist.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    original = _fsdp_state._OutputHook.__call__

    def counting(hook):
        calls.append(hook.state.param_group.label if hook.state.param_group is not None else None)
        return original(hook)

    _fsdp_state._OutputHook.__call__ = counting
    out = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
        loss = model(x).sum()
        runs = [b.param_group.run for b in map(_fsdp_state.state_of, model.blocks)]
        calls.clear()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(dict(
            run_sizes=[len(r.members) if r is not None else 0 for r in runs],
            same_run=len({id(r) for r in runs if r is not None}),
            python_hook_calls=list(calls),
            runs_left=[b.param_group.run is not None for b in map(_fsdp_state.state_of, model.blocks)],
        ))
    _fsdp_state._OutputHook.__call__ = original
    return out


@pytest.mark.timeout(120)
def test_a_chain_forms_one_run_and_backward_calls_python_only_at_its_end():
    for rank, steps in enumerate(run_ranks(_formation_rank, 2, timeout=100)):
        # The first forward has no gather plan yet: no runs, a Python hook per
        # unit (the root's first: its output is the loss's input).
        assert steps[0]["run_sizes"] == [0] * 6, steps[0]
        assert steps[0]["python_hook_calls"] == [""] + [f"blocks.{i}" for i in range(5, -1, -1)], steps[0]
        for step in steps[1:]:
            # blocks.0 takes the root's output (its Function is its post-backward
            # point) and starts the run; all six are one run.
            assert step["run_sizes"] == [6] * 6 and step["same_run"] == 1, (rank, step)
            # Python runs the root's hook and the run's last (blocks.5's
            # output) only; the gates of blocks.0-4's outputs closed, and pack in C++.
            assert step["python_hook_calls"] == ["", "blocks.5"], (rank, step)
            assert not any(step["runs_left"]), (rank, step)
