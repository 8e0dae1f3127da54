"""The rank-side harness of the FSDP parity suite, and its comparisons.

    results = run_parity([Scenario(model="mlp")], world_size=2)
    assert_parity(results, exact=True)

``run_scenarios`` runs in every spawned rank. For each ``Scenario`` it
trains torch's sharded wrapper (FSDP2 ``fully_shard``, or FSDP1's class)
and then pydist's, one after the other in the same process group, each from
the same seed, the same model and the same per-rank data, and records the
loss of every backward, the global gradient norm where the scenario clips,
and the full parameters after the last step (gathered: torch's through
``DTensor.full_tensor()`` / FSDP1's full state dict, pydist's through
``pydist.fsdp.full_state_dict``).

Bitwise at two ranks: each averaged gradient element is ``(g_0 + g_1) / 2``
in any implementation (see [Note: when the suite asserts bitwise equality]
in tests/ddp/ddp_harness.py), and SGD and Adam work element by element, so
the different shard layouts (torch: dim 0 per parameter; pydist: the
unit's flat layout) do not change a bit. Four ranks sum in another order:
``rtol=1e-6``. Clipping: FSDP1's norm is bitwise torch FSDP1's at two ranks
(pydist takes torch's parameters in torch's order, in its arithmetic); an
FSDP2 run's is summed over other pieces of each parameter (torch: dim-0
chunks; pydist: the flat layout), so FSDP2 clipping is compared with
``rtol=1e-6``. See [Note: the global norm of sharded gradients].
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

IN, OUT = 8, 4


# --------------------------------------------------------------------------
# Models, and which submodules become units
# --------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 16), nn.Linear(16, OUT)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    def units(self):
        return [self.fc1, self.fc2, self.fc3]


class Block(nn.Module):
    """Linear -> LayerNorm -> inner Linear, residual; ``inner`` is its own unit (nested)."""

    def __init__(self, dim: int, frozen: bool = False):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.inner = nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        if frozen:
            self.proj.weight.requires_grad_(False)  # frozen and trainable in one unit

    def forward(self, x):
        return x + self.inner(self.norm(self.proj(x)))


class Nested(nn.Module):
    """Root parameters before and after the blocks, blocks with nested units."""

    def __init__(self, frozen: bool = False, dim: int = 24):
        super().__init__()
        self.embed = nn.Linear(IN, dim)
        self.blocks = nn.ModuleList([Block(dim, frozen=frozen and i == 1) for i in range(3)])
        self.head = nn.Linear(dim, OUT)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def units(self):
        return [m for b in self.blocks for m in (b.inner, b)]  # bottom-up


class BadPadding(nn.Module):
    """``Linear(n, 1)`` + ``Linear(1, n)``: rows a per-parameter dim-0 shard pads badly."""

    def __init__(self, n: int = 257):
        super().__init__()
        self.down = nn.Linear(IN * 32, 1)
        self.up = nn.Linear(1, n)
        self.out = nn.Linear(n, OUT)

    def forward(self, x):
        return self.out(torch.tanh(self.up(self.down(x.repeat(1, 32)))))

    def units(self):
        return [self.down, self.up]


class Buffered(MLP):
    """The MLP with a floating buffer in its forward (FSDP1's ``buffer_dtype``
    casts it) and an integer one (no dtype touches it)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 32))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)) * self.scale)))


MODELS = {"mlp": MLP, "nested": Nested, "frozen": lambda: Nested(frozen=True), "badpad": BadPadding,
          "buffered": Buffered}


# --------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    model: str = "mlp"
    optimizer: str = "sgd"  # "sgd" (momentum) or "adam"
    steps: int = 4
    batch: int = 8
    seed: int = 0
    reshard_after_forward: bool = True
    micro_steps: int = 1  # all but the last backward of a step skip gradient sync
    clip: float | None = None  # clip the global gradient norm to this before each step
    norm_type: float = 2.0  # the clipping norm's p
    api: str = "fsdp2"  # "fsdp2": fully_shard; "fsdp1": FullyShardedDataParallel
    strategy: str = "FULL_SHARD"  # FSDP1's sharding_strategy
    shm: bool | None = None  # pydist's transport: True shared memory, False the group
    policy: str = "module"  # FSDP1's auto_wrap_policy: "module" (ModuleWrapPolicy) or "size" (size_based, 500)
    mixed: bool = False  # bf16 parameters, fp32 reduction: fsdp2 MixedPrecisionPolicy on every unit, fsdp1 MixedPrecision
    reduce_dtype: str | None = "float32"  # under ``mixed``: None leaves each API's default (see [Note: FSDP1's mixed precision])
    buffer_dtype: str | None = None  # fsdp1 under ``mixed``: MixedPrecision's buffer_dtype
    prefetch: bool = False  # explicit set_modules_to_forward/backward_prefetch (fsdp2, both impls)
    forward_prefetch: bool = False  # fsdp1's forward_prefetch
    device: str = "cpu"  # where the model trains: fsdp2 moves it there before fully_shard, fsdp1 passes device_id
    mesh: tuple | None = None  # HSDP: (replicate, shard) sizes of a 2-D mesh (fsdp1: with a HYBRID strategy)
    # fsdp2, how micro-batches before the last skip communication: "sync"
    # (set_requires_gradient_sync(False): no reduction at all), "all_reduce"
    # (HSDP: set_requires_all_reduce(False): reduce-scatter, no all-reduce)
    accumulate: str = "sync"
    # How pydist's fsdp1 clips: "method" (model.clip_grad_norm_), "torch"
    # (torch.nn.utils.clip_grad_norm_(model.parameters())), "torch reversed"
    # (the parameters in reverse). torch's fsdp1 always calls its method.
    clip_with: str = "method"


class RunResult(NamedTuple):
    losses: list
    norms: list  # the clipped runs' total norms
    params: dict  # full parameters after the last step, by unwrapped key
    transport: str


def make_batch(sc: Scenario, rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(sc.seed * 1_000_003 + rank * 10_007 + step * 101 + micro)
    return torch.randn(sc.batch, IN, generator=g), torch.randn(sc.batch, OUT, generator=g)


def train_steps(model, opt, rank: int, steps: int, offset: int) -> list:
    """``steps`` plain steps on the default scenario's batches from step
    ``offset`` on; the losses. For the state-dict tests, which train, save,
    load and train on."""
    losses = []
    for step in range(steps):
        x, y = make_batch(Scenario(), rank, offset + step, 0)
        loss = F.mse_loss(model(x).float(), y)  # torch 2.11's mse_loss backward refuses a bf16 input with fp32 targets
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(f"unknown optimizer {name!r}")


def wrap(impl: str, sc: Scenario, model: nn.Module, world_size: int, torch_group=None):
    """The wrapped ``model``: torch's on ``torch_group`` (None: the default
    group), pydist's on the default group."""
    if sc.api == "fsdp2":
        if impl == "torch":
            from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if sc.mesh is not None:
                mesh = _hsdp_mesh(sc)
            elif torch_group is None:
                mesh = init_device_mesh(sc.device, (world_size,))
            else:
                mesh = DeviceMesh.from_group(torch_group, sc.device)
            kwargs = dict(mesh=mesh)
        else:
            from pydist import fully_shard

            kwargs = dict(shm=sc.shm)
            if sc.mesh is not None:
                kwargs["mesh"] = _hsdp_mesh(sc)
        if sc.mixed:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=_dtype(sc.reduce_dtype))
        model.to(sc.device)
        for m in model.units():
            fully_shard(m, reshard_after_forward=sc.reshard_after_forward, **kwargs)
        fully_shard(model, reshard_after_forward=sc.reshard_after_forward, **kwargs)
        if sc.prefetch:
            units = [m for m in model.units() if any(True for _ in m.parameters(recurse=False))] or model.units()
            for a, b in zip(units, units[1:]):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
        return model
    # FSDP1
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if sc.policy == "size":
        import functools

        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=500)
    elif sc.model == "mlp":
        policy = ModuleWrapPolicy({nn.Linear})
    else:
        policy = ModuleWrapPolicy({type(m) for m in model.units()})
    kwargs = dict(auto_wrap_policy=policy, device_id=torch.device(sc.device), use_orig_params=True,
                  forward_prefetch=sc.forward_prefetch)
    if sc.mesh is not None:
        kwargs["device_mesh"] = _hsdp_mesh(sc)
    if sc.mixed:
        from torch.distributed.fsdp import MixedPrecision

        kwargs["mixed_precision"] = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=_dtype(sc.reduce_dtype), buffer_dtype=_dtype(sc.buffer_dtype))
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

        return FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy[sc.strategy],
                                        process_group=torch_group, **kwargs)
    import pydist

    return pydist.FullyShardedDataParallel(model, sharding_strategy=pydist.ShardingStrategy[sc.strategy], shm=sc.shm,
                                           **kwargs)


def _hsdp_mesh(sc: Scenario):
    """A 2-D ("replicate", "shard") mesh of ``sc.mesh``'s sizes (every call a new one)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(sc.device, sc.mesh, mesh_dim_names=("replicate", "shard"))


def _dtype(name: str | None):
    return getattr(torch, name) if name is not None else None


def _sync_context(impl: str, sc: Scenario, model, sync: bool):
    if sc.api == "fsdp1":
        return contextlib.nullcontext() if sync else model.no_sync()
    if sc.accumulate == "all_reduce":
        model.set_requires_all_reduce(sync)
    else:
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def _clip(impl: str, sc: Scenario, model, max_norm: float) -> float:
    if sc.api == "fsdp1" and (impl == "torch" or sc.clip_with == "method"):
        # torch's reference is always its method: torch.nn.utils.clip_grad_norm_
        # on torch's FSDP1 takes this rank's norm alone.
        return float(model.clip_grad_norm_(max_norm, sc.norm_type))
    # torch's own on pydist too: a script whose only change is the import
    # clips by the global norm (see [Note: the global norm of sharded gradients]).
    params = list(model.parameters())
    if sc.clip_with == "torch reversed":
        params.reverse()
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm, sc.norm_type))


def _full_params(impl: str, sc: Scenario, model) -> dict:
    if impl == "pydist":
        from pydist.fsdp import full_state_dict

        sd = full_state_dict(model) if sc.api == "fsdp2" else model.state_dict()
    elif sc.api == "fsdp2":
        sd = {k: _full_tensor(v) if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def _full_tensor(dtensor) -> torch.Tensor:
    """A torch FSDP2 parameter (``Shard(0)``, HSDP's ``(Replicate(),
    Shard(0))``) in full. Off the CPU its local chunks are gathered on the
    CPU over the mesh dimension that shards it: ``full_tensor()`` of a CUDA
    DTensor over gloo dies in torch 2.11's functional all-gather (SIGSEGV,
    seen on an H200 with two ranks sharing the GPU)."""
    if dtensor.device.type == "cpu":
        return dtensor.full_tensor()
    mesh = dtensor.device_mesh
    dim = next(i for i, p in enumerate(dtensor.placements) if p.is_shard())
    chunks = [None] * mesh.size(dim)
    dist.all_gather_object(chunks, dtensor.to_local().detach().cpu(), group=mesh.get_group(dim))
    return torch.cat(chunks)


def train(rank: int, world_size: int, sc: Scenario, impl: str, torch_group=None) -> RunResult:
    torch.manual_seed(sc.seed)
    model = wrap(impl, sc, MODELS[sc.model](), world_size, torch_group)
    opt = make_optimizer(sc.optimizer, [p for p in model.parameters() if p.requires_grad])
    losses, norms = [], []
    for step in range(sc.steps):
        for micro in range(sc.micro_steps):
            x, y = (t.to(sc.device) for t in make_batch(sc, rank, step, micro))
            with _sync_context(impl, sc, model, micro == sc.micro_steps - 1):
                loss = F.mse_loss(model(x).float(), y)
                loss.backward()
            losses.append(loss.item())
        if sc.clip is not None:
            norms.append(_clip(impl, sc, model, sc.clip))
        opt.step()
        opt.zero_grad()
    transport = "process_group"
    if impl == "pydist":
        from pydist.fsdp._fsdp_state import state_of

        inner = getattr(model, "module", model)
        transport = state_of(inner).transport.name
    return RunResult(losses, norms, _full_params(impl, sc, model), transport)


def run_scenarios(rank: int, world_size: int, scenarios, impls=("torch", "pydist"), torch_group=None,
                  models=None) -> list:
    """Rank entry point: ``[{impl: RunResult}]`` per scenario (pydist.spawn
    pickles it by value: no tensor shares memory with the rank). torch's
    wrapper runs on ``torch_group`` (tests/mpi: gloo beside pydist's mpi4py
    default group). ``models`` adds a test module's own models to MODELS by
    name (picklable: classes, functools.partial)."""
    MODELS.update(models or {})
    out = []
    for sc in scenarios:
        per_impl = {}
        for impl in impls:
            dist.barrier()
            per_impl[impl] = train(rank, world_size, sc, impl, torch_group)
        out.append(per_impl)
    return out


def run_parity(scenarios, world_size: int, timeout: float = 100.0, impls=("torch", "pydist"), models=None,
               backend: str = "gloo"):
    """Spawns the ranks; returns ``results[rank][scenario_index][impl]``."""
    from pydist.spawn import run_ranks

    return run_ranks(run_scenarios, world_size, args=(list(scenarios), tuple(impls), None, models), timeout=timeout,
                     backend=backend)


# --------------------------------------------------------------------------
# Comparisons (parent side)
# --------------------------------------------------------------------------


def bitwise_mismatches(a, b, what: str, mismatches: list) -> None:
    """Appends to ``mismatches`` where ``b`` is not bitwise ``a``: nested
    dicts and lists, tensors (dtype, shape and values; DTensors as their full
    tensors, a collective), anything else by ``==``."""
    from torch.distributed.tensor import DTensor

    a, b = (x.full_tensor() if isinstance(x, DTensor) else x for x in (a, b))
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            mismatches.append(f"{what}: keys {sorted(map(str, a))} != "
                              f"{sorted(map(str, b)) if isinstance(b, dict) else type(b).__name__}")
            return
        for k in a:
            bitwise_mismatches(a[k], b[k], f"{what}[{k}]", mismatches)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            bitwise_mismatches(x, y, f"{what}[{i}]", mismatches)
    elif isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):
            diff = (a.float() - b.float()).abs().max().item() if isinstance(b, torch.Tensor) and a.shape == b.shape \
                else f"{type(b).__name__} {getattr(b, 'dtype', '')} {getattr(b, 'shape', '')}"
            mismatches.append(f"{what}: max |diff| {diff}")
    elif a != b:
        mismatches.append(f"{what}: {a} != {b}")


def assert_close(ref, got, exact: bool, what: str, rtol: float = 1e-6, atol: float = 1e-6):
    ref, got = torch.as_tensor(ref), torch.as_tensor(got)
    assert got.dtype == ref.dtype and got.shape == ref.shape, (
        f"{what}: pydist has {got.dtype}{tuple(got.shape)}, torch has {ref.dtype}{tuple(ref.shape)}"
    )
    if exact:
        if not torch.equal(ref, got):
            diff = (ref.double() - got.double()).abs().max().item()
            raise AssertionError(f"{what}: not bitwise equal to torch's (max abs diff {diff:.3e})")
    else:
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_parity(results, exact: bool, scenarios, transport: str | None = None, first_rank: int = 0):
    """``results[i]`` is rank ``first_rank + i``'s (tests/mpi: each rank checks its own)."""
    for rank, per_rank in enumerate(results, first_rank):
        for i, (sc, per_impl) in enumerate(zip(scenarios, per_rank)):
            ref, got = per_impl["torch"], per_impl["pydist"]
            where = f"rank {rank} scenario {i} ({sc})"
            # a clipped FSDP2 step scales by a norm summed over other pieces (see the module's docstring)
            exact_here = exact and (sc.clip is None or sc.api == "fsdp1")
            assert_close(ref.losses, got.losses, exact_here, f"{where} losses")
            assert_close(ref.norms, got.norms, exact_here, f"{where} clip norms")
            assert sorted(ref.params) == sorted(got.params), f"{where}: keys {sorted(got.params)} != torch's {sorted(ref.params)}"
            for k in ref.params:
                assert_close(ref.params[k], got.params[k], exact_here, f"{where} param {k}")
            if transport is not None:
                assert got.transport == transport, f"{where}: pydist ran on {got.transport}, not {transport}"
