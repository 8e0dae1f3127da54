"""The rank-side training harness of the DDP parity suite, and the comparisons.

    results = run_ranks(run_scenarios, 2, args=([Scenario(model="mlp")],))
    for rank_result in results:
        assert_runs_match(rank_result[0]["torch"], rank_result[0]["pydist"], exact=True)

``run_scenarios`` runs in every spawned rank. For each ``Scenario`` it trains
stock ``torch.nn.parallel.DistributedDataParallel`` and then
``pydist.DistributedDataParallel`` one after the other, in the same process
group, each from a fresh seed, a fresh model and the same per-rank data, and
records what a user could observe: the loss of every backward, every
parameter's ``.grad`` after every backward (``None`` stays ``None``), the
final parameters and buffers, the ``state_dict`` keys, and, when asked, the
buckets a comm hook saw. Both wrappers run in the same ranks because a spawn
costs seconds here.

[Note: when the suite asserts bitwise equality]
Without a comm hook, DDP averages a gradient as ``sum_r g_r / world_size``
(torch multiplies each bucket by ``1/world_size`` before the all-reduce).
With two ranks the sum is ``g_0 + g_1``, which IEEE addition computes the
same whichever rank's term comes first, and scaling by a power of two is
exact; so any correct implementation gives bitwise torch's gradients with
two ranks, whatever its bucket layout, and bitwise-equal gradients keep
parameters, losses and optimizer states bitwise equal step after step. With
four ranks the summation order depends on how gloo chunks each bucket,
hence on the bucket layout, and the suite compares with ``rtol=1e-6``.
Comm hooks that only cast and divide element-wise (fp16, bf16) keep the
two-rank argument; PowerSGD depends on the bucket layout itself (its random
projections and error feedback are kept per bucket index), so its parity
needs the same layout as torch, which the bucket probe checks directly.

The results cross the process boundary as ``torch.save`` bytes, so that no
shared-memory handle outlives the rank that made it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_models import IN_FEATURES, OUT_FEATURES, build_model

IMPLS = ("torch", "pydist")


def outcome(fn) -> tuple[str, str]:
    """("ok", "") or (exception type name, message): what ``fn()`` did, to
    compare with what the same call does under torch."""
    try:
        fn()
        return ("ok", "")
    except Exception as e:  # noqa: BLE001 - the outcome is what is compared
        return (type(e).__name__, str(e))


def ddp_class(impl: str):
    """The wrapper class under the name ``impl``: the reference or the one under test."""
    if impl == "torch":
        return torch.nn.parallel.DistributedDataParallel
    if impl == "pydist":
        from pydist import DistributedDataParallel

        return DistributedDataParallel
    raise ValueError(f"unknown DDP implementation {impl!r}; expected one of {IMPLS}")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One training run, done once per implementation with identical inputs."""

    model: str = "mlp"  # a name in ddp_models.MODELS
    optimizer: str = "sgd"  # see make_optimizer
    steps: int = 4  # optimizer steps (per rank; `join` adds `rank` more)
    batch: int = 8  # samples per rank per micro-batch
    seed: int = 0
    ddp_kwargs: dict = dataclasses.field(default_factory=dict)  # given to both wrappers
    pydist_kwargs: dict = dataclasses.field(default_factory=dict)  # given to pydist only
    init_seed_per_rank: bool = False  # ranks build different weights: construction must broadcast rank 0's
    perturb_buffers: bool = False  # add `rank` to every float buffer before wrapping
    micro_steps: int = 1  # micro-batches per step; all but the last run under no_sync()
    hook: str | None = None  # None, "fp16", "bf16", "powersgd" or "probe"
    autocast_bf16: bool = False  # forward under torch.autocast(<device type>, dtype=torch.bfloat16)
    branch_schedule: bool = False  # `branch` model: skip the branch on some ranks/steps (see use_branch)
    join: str | None = None  # None, "context", "context_nodiv" or "method"; ranks get uneven batches
    integer_data: bool = False  # integer-valued inputs and a linear loss: exact integer gradients
    grads_to_none: bool = True  # optimizer.zero_grad(set_to_none=...) after every step
    device: str = "cpu"  # "cuda": model and data on cuda:0, which every rank shares (tests/ddp/test_ddp_cuda.py)


class BucketRecord(NamedTuple):
    """What a comm hook saw of one GradBucket."""

    index: int
    is_last: bool
    numel: int  # bucket.buffer().numel()
    dtype: str
    params: tuple  # names of bucket.parameters(), in order
    grad_shapes: tuple  # shapes of bucket.gradients()
    grads_view_buffer: bool  # every bucket.gradients() tensor shares bucket.buffer()'s storage


class RunResult(NamedTuple):
    """Everything one rank observed in one training run."""

    losses: list  # the local loss of every backward, in order
    grads: list  # after every backward: {name: grad clone or None}
    params: dict  # final {name: tensor}
    buffers: dict  # final {name: tensor}
    state_dict_keys: list  # ddp.state_dict().keys(), in order
    buckets: list  # per backward: [BucketRecord] in call order ("probe" hook only)
    grad_storage_groups: list  # after the last backward: sorted groups of names whose grads share storage
    allreduce_transport: str  # pydist's: "shm" or "process_group"; torch's: "process_group"


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def make_batch(sc: Scenario, rank: int, step: int, micro: int):
    """Per-rank data: a function of (seed, rank, step, micro) only."""
    g = torch.Generator().manual_seed(sc.seed * 1_000_003 + rank * 10_007 + step * 101 + micro)
    if sc.integer_data:
        x = torch.randint(-3, 4, (sc.batch, IN_FEATURES), generator=g).float()
        y = torch.randint(-3, 4, (sc.batch, OUT_FEATURES), generator=g).float()
    else:
        x = torch.randn(sc.batch, IN_FEATURES, generator=g)
        y = torch.randn(sc.batch, OUT_FEATURES, generator=g)
    return x, y


def loss_fn(sc: Scenario, out, y):
    if sc.integer_data:
        return (out.float() * y).sum()  # gradient of weight = y^T x: integers
    return F.mse_loss(out.float(), y)


def use_branch(step: int, rank: int, world_size: int) -> bool:
    """The `branch` schedule: step % 4 == 0 every rank uses the branch; 1: all
    but rank 0 (locally unused on rank 0); 2: no rank (globally unused: grads
    stay None); 3: only the last rank."""
    phase = step % 4
    if phase == 0:
        return True
    if phase == 1:
        return rank != 0
    if phase == 2:
        return False
    return rank == world_size - 1


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if name == "sgd_exact":  # no momentum, lr a power of two: exact with integer gradients
        return torch.optim.SGD(params, lr=0.25)
    raise ValueError(f"unknown optimizer {name!r}")


# --------------------------------------------------------------------------
# Comm hooks
# --------------------------------------------------------------------------


class BucketProbe:
    """Comm-hook state that records every GradBucket, then averages as DDP does."""

    def __init__(self, names_by_id: dict):
        self.names_by_id = names_by_id
        self.per_backward: list = []

    def start_backward(self):
        self.per_backward.append([])


def probe_hook(probe: BucketProbe, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    grads = bucket.gradients()
    probe.per_backward[-1].append(
        BucketRecord(
            index=bucket.index(),
            is_last=bucket.is_last(),
            numel=buf.numel(),
            dtype=str(buf.dtype),
            params=tuple(probe.names_by_id.get(id(p), "?") for p in bucket.parameters()),
            grad_shapes=tuple(tuple(g.shape) for g in grads),
            grads_view_buffer=all(
                g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for g in grads
            ),
        )
    )
    return default_hooks.allreduce_hook(None, bucket)


def bf16_compress_hook_for_torch(process_group, bucket):
    """torch's bf16_compress_hook under another name, for torch DDP only.

    Torch DDP refuses a hook *named* ``bf16_compress_hook`` unless CUDA+NCCL
    or XPU+XCCL is there (``_check_comm_hook`` raises TypeError "BF16 all
    reduce communication hook required CUDA 11+ and NCCL 2.10+ ..."), though
    gloo all-reduces bf16 on CPU fine. The reference run calls the very same
    hook through this wrapper; pydist gets the hook itself, unchanged."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


def register_hook(ddp, sc: Scenario, module, impl: str):
    """Registers the scenario's comm hook; returns the probe for "probe", else None."""
    if sc.hook is None:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if sc.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif sc.hook == "bf16":
        hook = bf16_compress_hook_for_torch if impl == "torch" else default_hooks.bf16_compress_hook
        ddp.register_comm_hook(None, hook)
    elif sc.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=1,
            start_powerSGD_iter=2,
            random_seed=sc.seed,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif sc.hook == "probe":
        probe = BucketProbe({id(p): n for n, p in module.named_parameters()})
        ddp.register_comm_hook(probe, probe_hook)
        return probe
    else:
        raise ValueError(f"unknown hook {sc.hook!r}")
    return None


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def build_local_model(sc: Scenario, rank: int):
    torch.manual_seed(sc.seed + (1000 * rank if sc.init_seed_per_rank else 0))
    module = build_model(sc.model)
    if sc.perturb_buffers:
        with torch.no_grad():
            for b in module.buffers():
                if b.is_floating_point():
                    b.add_(rank)
    return module.to(sc.device)


def wrap(impl: str, module, sc: Scenario):
    kwargs = dict(sc.ddp_kwargs)
    if impl == "pydist":
        kwargs.update(sc.pydist_kwargs)
    return ddp_class(impl)(module, **kwargs)


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the CPU, so that results leave the rank as plain bytes."""
    return t.detach().to("cpu", copy=True)


def _snapshot_grads(module) -> dict:
    return {n: (None if p.grad is None else _on_cpu(p.grad)) for n, p in module.named_parameters()}


def _grad_storage_groups(module) -> list:
    groups: dict = {}
    for n, p in module.named_parameters():
        if p.grad is not None:
            groups.setdefault(p.grad.untyped_storage().data_ptr(), []).append(n)
    return sorted(tuple(sorted(g)) for g in groups.values())


def _join_context(ddp, sc: Scenario):
    from torch.distributed.algorithms.join import Join

    if sc.join is None:
        return contextlib.nullcontext()
    if sc.join == "context":
        return Join([ddp])
    if sc.join == "context_nodiv":
        return Join([ddp], divide_by_initial_world_size=False)
    if sc.join == "method":
        return ddp.join()
    raise ValueError(f"unknown join mode {sc.join!r}")


def train(rank: int, world_size: int, sc: Scenario, impl: str) -> RunResult:
    """One training run of `impl` on this rank; see the module docstring."""
    module = build_local_model(sc, rank)
    ddp = wrap(impl, module, sc)
    probe = register_hook(ddp, sc, module, impl)
    opt = make_optimizer(sc.optimizer, [p for p in ddp.parameters() if p.requires_grad])
    n_steps = sc.steps + (rank if sc.join else 0)
    losses, grads, storage_groups = [], [], []
    with _join_context(ddp, sc):
        for step in range(n_steps):
            for micro in range(sc.micro_steps):
                x, y = (t.to(sc.device) for t in make_batch(sc, rank, step, micro))
                sync = micro == sc.micro_steps - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    with torch.autocast(torch.device(sc.device).type, dtype=torch.bfloat16, enabled=sc.autocast_bf16):
                        if sc.branch_schedule:
                            out = ddp(x, use_branch=use_branch(step, rank, world_size))
                        else:
                            out = ddp(x)
                    loss = loss_fn(sc, out, y)
                    if probe is not None:
                        probe.start_backward()
                    loss.backward()
                losses.append(loss.item())
                grads.append(_snapshot_grads(module))
                if step == n_steps - 1 and micro == sc.micro_steps - 1:
                    # Only after the last backward: a Python storage object
                    # of a .grad keeps pydist from moving it into its bucket
                    # (a conservative test for "shared"; see [Note: resident
                    # gradients] in csrc/reducer/reducer.h).
                    storage_groups = _grad_storage_groups(module)
            opt.step()
            opt.zero_grad(set_to_none=sc.grads_to_none)
    result = RunResult(
        losses=losses,
        grads=grads,
        params={n: _on_cpu(p) for n, p in module.named_parameters()},
        buffers={n: _on_cpu(b) for n, b in module.named_buffers()},
        state_dict_keys=list(ddp.state_dict().keys()),
        buckets=probe.per_backward if probe is not None else [],
        grad_storage_groups=storage_groups,
        allreduce_transport=getattr(ddp, "allreduce_transport", "process_group"),
    )
    return result


def run_scenarios(rank: int, world_size: int, scenarios, impls=IMPLS) -> bytes:
    """Rank entry point: every scenario, every implementation, in order.

    Returns ``torch.save`` bytes of ``[{impl: RunResult}]``; see ``unpack``."""
    out = []
    for sc in scenarios:
        per_impl = {}
        for impl in impls:
            dist.barrier()
            per_impl[impl] = train(rank, world_size, sc, impl)
        out.append(per_impl)
    return pack(out)


def pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# pydist's gradient transports (see [Note: which transport] in
# csrc/reducer/reducer.h): the suite runs each where it matters.
TRANSPORTS = ("shm", "process_group")


def with_transport(scenarios, transport: str) -> list:
    """The scenarios with pydist's bucket all-reduces required on ``transport``."""
    want = {"shm": True, "process_group": False}[transport]
    return [dataclasses.replace(sc, pydist_kwargs={**sc.pydist_kwargs, "shm_allreduce": want}) for sc in scenarios]


def assert_transport(results, transport: str) -> None:
    for rank, per_rank in enumerate(results):
        for i, per_impl in enumerate(per_rank):
            got = per_impl["pydist"].allreduce_transport
            assert got == transport, f"rank {rank} scenario {i}: pydist all-reduced on {got}, not {transport}"


def run_parity(scenarios, world_size: int, timeout: float = 120.0, backend: str = "gloo"):
    """Spawns the ranks; returns ``results[rank][scenario_index][impl]``."""
    from pydist.spawn import run_ranks

    ranks = run_ranks(run_scenarios, world_size, args=(list(scenarios),), backend=backend, timeout=timeout)
    return [unpack(b) for b in ranks]


# --------------------------------------------------------------------------
# Comparisons (parent side)
# --------------------------------------------------------------------------


def assert_tensors_match(ref, got, exact: bool, what: str, rtol=1e-6, atol=1e-6):
    assert got.dtype == ref.dtype and got.shape == ref.shape, (
        f"{what}: pydist has {got.dtype}{tuple(got.shape)}, torch has {ref.dtype}{tuple(ref.shape)}"
    )
    if exact or not ref.is_floating_point():
        if not torch.equal(ref, got):
            diff = (ref.double() - got.double()).abs().max().item()
            raise AssertionError(f"{what}: not bitwise equal to torch DDP's (max abs diff {diff:.3e})")
    else:
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_runs_match(ref: RunResult, got: RunResult, exact: bool, where: str = "", rtol=1e-6, atol=1e-6):
    """pydist's run ``got`` matches torch's run ``ref``: losses, every grad
    (None where torch's is None), final params and buffers, state_dict keys."""
    kw = dict(exact=exact, rtol=rtol, atol=atol)
    assert len(got.losses) == len(ref.losses), f"{where}: {len(got.losses)} backwards, torch ran {len(ref.losses)}"
    for i, (rg, gg) in enumerate(zip(ref.grads, got.grads)):
        assert gg.keys() == rg.keys(), f"{where}: parameter names differ: {list(gg)} vs torch {list(rg)}"
        for name in rg:
            what = f"{where} backward {i} grad of {name}"
            if rg[name] is None or gg[name] is None:
                assert rg[name] is None and gg[name] is None, (
                    f"{what}: torch's is {'None' if rg[name] is None else 'a tensor'}, "
                    f"pydist's is {'None' if gg[name] is None else 'a tensor'}"
                )
                continue
            assert_tensors_match(rg[name], gg[name], what=what, **kw)
    for i, (rl, gl) in enumerate(zip(ref.losses, got.losses)):
        if exact:
            assert rl == gl, f"{where} backward {i}: loss {gl!r} != torch's {rl!r}"
        else:
            assert abs(rl - gl) <= atol + rtol * abs(rl), f"{where} backward {i}: loss {gl!r} vs torch's {rl!r}"
    assert got.params.keys() == ref.params.keys(), f"{where}: parameter names differ"
    for name in ref.params:
        assert_tensors_match(ref.params[name], got.params[name], what=f"{where} final param {name}", **kw)
    assert got.buffers.keys() == ref.buffers.keys(), f"{where}: buffer names differ"
    for name in ref.buffers:
        assert_tensors_match(ref.buffers[name], got.buffers[name], what=f"{where} final buffer {name}", **kw)
    assert got.state_dict_keys == ref.state_dict_keys, (
        f"{where}: state_dict keys {got.state_dict_keys} != torch DDP's {ref.state_dict_keys}"
    )


def assert_parity(results, exact: bool, rtol=1e-6, atol=1e-6, scenarios=None):
    """Every rank, every scenario: pydist's run matches torch's."""
    for rank, per_rank in enumerate(results):
        for i, per_impl in enumerate(per_rank):
            label = f"rank {rank} scenario {i}" + (f" {scenarios[i]}" if scenarios else "")
            assert_runs_match(per_impl["torch"], per_impl["pydist"], exact, label, rtol=rtol, atol=atol)


def assert_ranks_agree(results, impl: str, scenario_index: int = 0):
    """DDP keeps replicas equal: every rank ends with rank 0's parameters."""
    ref = results[0][scenario_index][impl].params
    for rank in range(1, len(results)):
        for name, t in results[rank][scenario_index][impl].params.items():
            assert torch.equal(t, ref[name]), f"{impl}: rank {rank}'s {name} differs from rank 0's"
