"""The optimizer step on ``fully_shard``'s DTensor parameters runs on their
local shards, bitwise torch FSDP2's step through DTensor dispatch.

Each rank trains torch's ``fully_shard`` model first, for every optimizer
configuration, while pydist's local-shard step is not installed yet (it is
installed by the first ``pydist.fully_shard``; the test checks it did not
run), so torch's reference steps go through DTensor dispatch. Then pydist's
model, same seeds and data, whose steps must go through the local shards
(``LOCAL_SHARD_STEPS``). Each run: ``clip_grad_norm_`` before every step, a
StepLR scheduler changing lr each step, an ``opt.state_dict()`` /
``load_state_dict`` round trip into a new optimizer, and a
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` one into
another. Compared bitwise: losses, norms, parameters, the optimizer state
(values and that they stay DTensors of the parameter's placements). Also:
groups mixing pydist's parameters with a plain one or with torch FSDP2's
step through the DTensors, and a step that raises on the local shards leaves
the optimizer's parameters and state the same objects. See
[Note: the optimizer step on local shards] in pydist/fsdp/_optim_step.py.
"""

import pytest
import torch
import torch.nn as nn

from fsdp_harness import bitwise_mismatches

from pydist.spawn import run_ranks

# (name, optimizer class, its arguments); foreach off, on and left to torch, fused where the CPU has it.
CONFIGS = [
    ("sgd-momentum", "SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False)),
    ("sgd-momentum-default", "SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("sgd-nesterov-default", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("sgd-nesterov-foreach", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True, foreach=True)),
    ("adam", "Adam", dict(lr=0.01, foreach=False)),
    ("adam-amsgrad-default", "Adam", dict(lr=0.01, amsgrad=True)),
    ("adam-foreach-amsgrad", "Adam", dict(lr=0.01, foreach=True, amsgrad=True)),
    ("adam-fused", "Adam", dict(lr=0.01, fused=True)),
    ("adamw", "AdamW", dict(lr=0.01, weight_decay=0.1)),
    ("adamw-foreach", "AdamW", dict(lr=0.01, weight_decay=0.1, foreach=True)),
]
# The configurations whose local-shard steps take torch's multi-tensor path
# in place of its per-parameter loop (see [Note: torch's foreach ops in
# place of its per-parameter loop]): those left to torch's default, but
# SGD's Nesterov without weight decay, whose multi-tensor update adds into
# the gradients (the check pydist runs once finds them changed).
FOREACH_IN_PLACE_OF_LOOP = {"sgd-momentum-default", "adam-amsgrad-default", "adamw"}
STEPS = 2  # per phase: fresh, after load_state_dict, after set_optimizer_state_dict


def _model():
    # Dim 0 of 5, 3 and 1: uneven chunks at 2 ranks, one rank's chunk empty.
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))


def _units(model):
    return (model[0], model[2], model[4])


class _Bf16Block(nn.Module):
    """bf16 parameters, float in and out."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.lin2 = nn.Linear(63, 128), nn.LayerNorm(128), nn.Linear(128, 254)
        self.lin3 = nn.Linear(254, 64)
        self.to(torch.bfloat16)

    def forward(self, x):
        return self.lin3(self.lin2(self.norm(self.lin(x.bfloat16())))).float()


def _run_model():
    """Units whose local shards (2 ranks) form runs stepped as one tensor
    (see [Note: adjacent shards stepped as one tensor]), in shard bytes:
    unit 0 768, 128, 128, 128 (one run); unit 1 8192, 128 on rank 0 (a
    run), 7936, 124 on rank 1 (none: FSDP2's padding of the weight's chunk
    to 32 rows lies between them); unit 2 in bf16 8064, 128, 128,
    128, 32512, 254 (a run), then 16256, 64 (another): the shard of 127
    bf16 elements ends in a tail that ATen's loops compute element by
    element, which a run going on past it would vectorize (some elements
    round differently, under SGD's ``add(alpha=)``: the test fails with
    ``_RUN_BYTES`` at 2); the root 256, 4 (rank 0: a run), 0, 0 (rank 1:
    nothing to step). And on both ranks a unit of 4096, 64, 64, 64, 4096,
    128, 128, 128: one run where float32 tails step alike (checked once per
    configuration, ``_tails_alike``), else two (the 64-byte shards end
    theirs)."""
    return nn.Sequential(nn.Sequential(nn.Linear(6, 64), nn.LayerNorm(64)),
                         nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 64), nn.LayerNorm(64)),
                         nn.Sequential(nn.Linear(64, 63), nn.Tanh()), _Bf16Block(), nn.Linear(64, 1))


def _run_units(model):
    return (model[0], model[1], model[2], model[3])


def _train(fully_shard, rank: int, config, build=_model, units=_units) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    name, cls, kwargs = config
    torch.manual_seed(0)
    model = build()
    for layer in units(model):
        fully_shard(layer)
    fully_shard(model)
    g = torch.Generator().manual_seed(7 + rank)
    out = {"losses": [], "norms": []}

    def make_opt():
        opt = getattr(torch.optim, cls)(model.parameters(), **kwargs)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)

    def steps(opt, sched):
        for _ in range(STEPS):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).full_tensor())
            opt.step()
            # The gradients as the step left them (torch's single-tensor path does not change them).
            out["grads_after_step"] = [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]
            sched.step()
            opt.zero_grad()
            out["losses"].append(loss.detach())

    opt, sched = make_opt()
    steps(opt, sched)
    saved, saved_sched = opt.state_dict(), sched.state_dict()
    opt, sched = make_opt()
    opt.load_state_dict(saved)
    sched.load_state_dict(saved_sched)
    steps(opt, sched)
    osd, saved_sched = get_optimizer_state_dict(model, opt), sched.state_dict()
    opt, sched = make_opt()
    set_optimizer_state_dict(model, opt, osd)
    sched.load_state_dict(saved_sched)
    steps(opt, sched)
    out["params"] = {k: p.full_tensor() for k, p in model.named_parameters()}
    state = {}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, DTensor):
                state[f"{i}.{k}.placements"] = v.placements == opt.param_groups[0]["params"][i].placements
                v = v.full_tensor()
            state[f"{i}.{k}"] = v
    out["state"] = state
    return out


def _rank(rank, world_size):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import pydist
    from pydist.fsdp._optim_step import LOCAL_SHARD_FOREACH, LOCAL_SHARD_STEPS

    ref = {c[0]: _train(torch_fully_shard, rank, c) for c in CONFIGS}
    through_dtensors = sum(LOCAL_SHARD_STEPS.values())  # 0: not installed before pydist's first fully_shard
    mismatches = []
    local_steps, foreach = {}, {}
    for config in CONFIGS:
        before, before_foreach = sum(LOCAL_SHARD_STEPS.values()), sum(LOCAL_SHARD_FOREACH.values())
        got = _train(pydist.fully_shard, rank, config)
        local_steps[config[0]] = sum(LOCAL_SHARD_STEPS.values()) - before
        foreach[config[0]] = sum(LOCAL_SHARD_FOREACH.values()) - before_foreach
        bitwise_mismatches(ref[config[0]], got, config[0], mismatches)
        placements = [k for k, v in got["state"].items() if k.endswith(".placements")]
        if not placements or not all(got["state"][k] for k in placements):
            mismatches.append(f"{config[0]}: state not DTensors of the parameters' placements")
    return {"through_dtensors": through_dtensors, "local_steps": local_steps, "foreach": foreach,
            "mismatches": mismatches,
            "mixed_local_steps": _mixed_groups(torch_fully_shard, pydist.fully_shard),
            "after_error": _failing_step(pydist.fully_shard)}


def _runs_rank(rank, world_size):
    """Each configuration on ``_run_model``, torch's FSDP2 and pydist's:
    the mismatches, and the runs pydist stepped as one tensor."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import pydist
    from pydist.fsdp._optim_step import LOCAL_SHARD_RUNS

    mismatches, runs = [], {}
    for config in CONFIGS:
        ref = _train(torch_fully_shard, rank, config, _run_model, _run_units)
        before = LOCAL_SHARD_RUNS.copy()
        got = _train(pydist.fully_shard, rank, config, _run_model, _run_units)
        runs[config[0]] = dict(LOCAL_SHARD_RUNS - before)
        bitwise_mismatches(ref, got, config[0], mismatches)
    return {"mismatches": mismatches, "runs": runs, "repointed": _repointed_shard_steps(pydist.fully_shard)}


def _repointed_shard_steps(fully_shard) -> bool:
    """A shard in a run re-pointed with ``set_`` (the same tensor object, its
    data elsewhere) after a step: the next step updates it where it is now."""
    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(6, 64), nn.LayerNorm(64)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        if _ == 0:
            local = model[0].weight._local_tensor
            moved = local.clone()
            with torch.no_grad():
                local.set_(moved.untyped_storage(), 0, local.shape, local.stride())
            before = moved.clone()
    return not torch.equal(model[0].weight._local_tensor, before)


def _failing_step(fully_shard) -> str:
    """A step that raises inside torch's update on the local shards (an
    ``exp_avg`` of another dtype) leaves the optimizer's parameters and
    state the same objects, DTensors; "" or what differs."""
    from torch.distributed.tensor import DTensor

    from pydist.fsdp._optim_step import LOCAL_SHARD_STEPS

    torch.manual_seed(0)
    model = fully_shard(_model())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(2, 6)).sum().backward()
        if not opt.state:
            opt.step()
    params = list(opt.param_groups[0]["params"])
    p = params[0]
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].double()
    state = {q: dict(opt.state[q]) for q in params}
    before = LOCAL_SHARD_STEPS["adam"]
    try:
        opt.step()
        return "the step did not raise"
    except RuntimeError:
        pass
    if LOCAL_SHARD_STEPS["adam"] != before + 1:
        return "the step that raised did not run on local shards"
    if any(a is not b or type(a) is not DTensor for a, b in zip(opt.param_groups[0]["params"], params, strict=True)):
        return "parameters"
    if any(opt.state[q].keys() != state[q].keys() or any(opt.state[q][k] is not v for k, v in state[q].items())
           for q in params) or not all(type(opt.state[q]["exp_avg"]) is DTensor for q in params):
        return "state"
    return ""


def _mixed_groups(torch_fully_shard, pydist_fully_shard) -> list:
    """Local-shard calls of one Adam step over pydist's parameters plus a
    plain one, and plus torch FSDP2's: none (such groups step through the
    DTensors, as without pydist)."""
    from pydist.fsdp._optim_step import LOCAL_SHARD_STEPS

    calls = []
    models = []
    for fully_shard in (pydist_fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        models.append(fully_shard(_model()))
        models[-1](torch.randn(2, 6)).sum().backward()
    plain = nn.Parameter(torch.zeros(3))
    plain.grad = torch.ones(3)
    for extra in ([plain], list(models[1].parameters())):
        before = sum(LOCAL_SHARD_STEPS.values())
        torch.optim.Adam([*models[0].parameters(), *extra]).step()
        calls.append(sum(LOCAL_SHARD_STEPS.values()) - before)
    return calls


@pytest.mark.timeout(150)
def test_optimizer_step_on_local_shards_is_torch_fsdp2s_bitwise():
    results = run_ranks(_rank, 2, timeout=120)
    for rank, r in enumerate(results):
        assert not r["mismatches"], f"rank {rank}: " + "; ".join(r["mismatches"][:8])
        assert r["through_dtensors"] == 0, f"rank {rank}: torch's reference steps did not go through DTensors"
        # Every step of every phase on local shards, and the step with zero
        # gradients set_optimizer_state_dict takes to create the state (torch's
        # _init_optim_state); SGD's first and that one, whose momentum buffers
        # are still to be created, through the DTensors.
        expected = {name: 3 * STEPS - 1 if cls == "SGD" else 3 * STEPS + 1 for name, cls, _ in CONFIGS}
        assert r["local_steps"] == expected, f"rank {rank}"
        expected = {name: expected[name] if name in FOREACH_IN_PLACE_OF_LOOP else 0 for name in expected}
        assert r["foreach"] == expected, f"rank {rank}: local-shard steps on torch's multi-tensor path"
        assert r["mixed_local_steps"] == [0, 0], f"rank {rank}"
        assert r["after_error"] == "", f"rank {rank}: {r['after_error']} changed by a step that raised"


@pytest.mark.timeout(150)
def test_adjacent_shards_stepped_as_one_tensor_are_torch_fsdp2s_bitwise():
    """See [Note: adjacent shards stepped as one tensor]: on the
    single-tensor path each step of the three phases (fresh, after
    ``load_state_dict``, after ``set_optimizer_state_dict``) steps every
    unit's runs (5 on rank 0, 3 on rank 1) as one tensor, with torch FSDP2's
    result bitwise; the foreach and fused paths take no runs."""
    for rank, r in enumerate(run_ranks(_runs_rank, 2, timeout=120)):
        assert not r["mismatches"], f"rank {rank}: " + "; ".join(r["mismatches"][:8])
        assert r["repointed"], f"rank {rank}: a shard re-pointed with set_ was not stepped where it is"
        for name, cls, kwargs in CONFIGS:
            # The steps on local shards but set_optimizer_state_dict's, whose
            # zero gradients torch makes one by one (not adjacent).
            steps = 3 * STEPS - 1 if cls == "SGD" else 3 * STEPS
            functional = "sgd" if cls == "SGD" else "adam"
            tails = f"{functional} over float32 tails" in r["runs"][name]  # what pydist's check found
            per_step = (5 if rank == 0 else 3) + (1 if tails else 2)
            expected = {} if kwargs.get("foreach") or kwargs.get("fused") else {
                f"{functional} over float32 tails" if tails else functional: steps * per_step}
            assert r["runs"][name] == expected, f"rank {rank}: {name} stepped {r['runs'][name]} runs"


def _fake_sgd(perturb):
    """An SGD functional (the arguments torch's takes) whose update is
    ``perturb``ed where ``perturb(param, foreach)`` says: what the checks
    must catch."""
    def sgd(params, d_p_list, momentum_buffer_list, has_sparse_grad=False, foreach=None, fused=None,
            grad_scale=None, found_inf=None, *, weight_decay, momentum, lr, dampening, nesterov, maximize):
        for p, g in zip(params, d_p_list):
            p.add_(g, alpha=-lr)
            if perturb(p, foreach):
                p.nextafter_(torch.full_like(p, float("inf")))  # one ulp
    return sgd


def test_checks_refuse_paths_that_round_otherwise(monkeypatch):
    """``_tails_alike`` and ``_foreach_alike`` (see [Note: torch's foreach
    ops in place of its per-parameter loop]) find a functional whose
    tensors shorter than a block, or whose multi-tensor path, step one ulp
    off, and agree where nothing differs."""
    from pydist.fsdp import _optim_step as o

    f = next(x for x in o._FUNCTIONALS if x.name == "sgd")
    shard = torch.zeros(3)
    args = dict(params=[shard], d_p_list=[shard.clone()], momentum_buffer_list=[shard.clone()], lr=0.1,
                weight_decay=0.0, momentum=0.0, dampening=0.0, nesterov=False, maximize=False)
    config = o._config(f, args)
    faithful, short, multi = (_fake_sgd(lambda p, foreach: False), _fake_sgd(lambda p, foreach: p.numel() < 32),
                              _fake_sgd(lambda p, foreach: foreach))
    for functional, tails, foreach in ((faithful, {torch.float32}, True), (short, set(), True),
                                       (multi, {torch.float32}, False)):
        monkeypatch.setattr(o, "_TAILS_ALIKE", {})
        monkeypatch.setattr(o, "_FOREACH_ALIKE", {})
        assert o._tails_alike(functional, f, args, config, frozenset({torch.float32})) == tails
        assert o._foreach_alike(functional, f, args, config, frozenset({torch.float32})) == foreach
    args["lr"] = torch.tensor(0.1)  # a Tensor lr: no configuration, neither path swapped
    assert o._config(f, args) is None
