"""Library code that expects torch's DDP gets what it expects from pydist's,
checked beside stock torch DDP on the same seeds and data (2 spawned gloo
ranks: bitwise, see [Note: when the suite asserts bitwise equality]).

- ``copy.deepcopy(model)`` and ``torch.save(model)`` / ``torch.load``: the
  copy trains on, with torch DDP's losses and parameters.
- ``isinstance(model, torch.nn.parallel.DistributedDataParallel)``, and
  ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` gives
  torch DDP's keys.
- torch DDP's surface: ``_set_static_graph()`` before the first forward (and
  its refusal after), parameters and buffers ignored through
  ``_set_params_and_buffers_to_ignore_for_model``, ``will_sync_module_buffers()``,
  ``_get_ddp_logging_data()`` / ``logger``, ``_register_fused_optim``,
  ``_register_builtin_comm_hook``; the inherited methods pydist does not
  implement raise ``NotImplementedError`` naming themselves.
- ``device_mesh=`` (1-D) as torch's, with torch's errors; torch's
  ``ZeroRedundancyOptimizer`` and post-local-SGD hook on the wrapper.
"""

import copy
import io

import pytest
import torch
import torch.distributed as dist

from ddp_harness import ddp_class, outcome, pack, unpack
from ddp_models import IN_FEATURES, MLP, build_model
from pydist.spawn import run_ranks

IMPLS = ("torch", "pydist")


def _batch(rank, step):
    g = torch.Generator().manual_seed(rank * 10_007 + step * 101)
    return torch.randn(8, IN_FEATURES, generator=g)


def _steps(ddp, rank, first, count, opt=None):
    """``count`` SGD steps on batches ``first...``; returns the losses."""
    opt = opt or torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(first, first + count):
        loss = ddp(_batch(rank, step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_same(results, what):
    for rank, r in enumerate(results):
        ref, got = r["torch"], r["pydist"]
        for key in ref[what] if isinstance(ref[what], dict) else [None]:
            a = ref[what] if key is None else ref[what][key]
            b = got[what] if key is None else got[what][key]
            ok = torch.equal(a, b) if torch.is_tensor(a) else a == b
            assert ok, f"rank {rank} {what} {key or ''}: pydist {b} != torch DDP's {a}"


# --------------------------------------------------------------------------
# deepcopy and pickle
# --------------------------------------------------------------------------


def _copies(rank, world_size):
    out = {}
    for impl in IMPLS:
        dist.barrier()
        torch.manual_seed(0)
        ddp = ddp_class(impl)(build_model("batchnorm"))
        r = {"before": _steps(ddp, rank, 0, 2)}
        copied = copy.deepcopy(ddp)
        r["deepcopy_type"] = type(copied).__name__
        r["deepcopy"] = _steps(copied, rank, 2, 3)
        r["deepcopy_state"] = _state(copied.module)
        buf = io.BytesIO()
        torch.save(ddp, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        r["pickle"] = _steps(loaded, rank, 2, 3)
        r["pickle_state"] = _state(loaded.module)
        r["original"] = _steps(ddp, rank, 2, 3)  # the original is untouched by the copies and trains on
        r["original_state"] = _state(ddp.module)
        out[impl] = r
    return pack(out)


@pytest.mark.timeout(120)
def test_deepcopy_and_pickle_train_on_like_torch():
    results = [unpack(b) for b in run_ranks(_copies, 2, timeout=90)]
    for what in ("before", "deepcopy", "deepcopy_state", "pickle", "pickle_state", "original", "original_state"):
        _assert_same(results, what)
    assert results[0]["pydist"]["deepcopy_type"] == "DistributedDataParallel"
    # the copies' gradients were averaged: every rank ends with the same
    # parameters (buffers carry the last forward's local update)
    for what in ("deepcopy_state", "pickle_state"):
        for key, t in results[0]["pydist"][what].items():
            if key.startswith("bn.running") or key.endswith("num_batches_tracked"):
                continue
            assert torch.equal(t, results[1]["pydist"][what][key]), f"{what} {key} differs across ranks"


# --------------------------------------------------------------------------
# the type, and torch.distributed.checkpoint's state dict
# --------------------------------------------------------------------------


def _type_and_checkpoint(rank, world_size):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    out = {}
    for impl in IMPLS:
        dist.barrier()
        torch.manual_seed(0)
        ddp = ddp_class(impl)(build_model("batchnorm"))
        _steps(ddp, rank, 0, 1)
        sd = get_model_state_dict(ddp)
        out[impl] = {
            "isinstance": isinstance(ddp, torch.nn.parallel.DistributedDataParallel),
            "keys": list(sd),
            "values": {k: v.clone() for k, v in sd.items()},
        }
    # a checkpoint written through torch's API from one loads into the other
    torch.manual_seed(1)
    target = ddp_class("pydist")(build_model("batchnorm"))
    set_model_state_dict(target, dict(out["torch"]["values"]))  # it renames keys in place
    out["loaded"] = _state(target.module)
    return pack(out)


@pytest.mark.timeout(90)
def test_isinstance_torch_ddp_and_checkpoint_state_dict_keys():
    results = [unpack(b) for b in run_ranks(_type_and_checkpoint, 2, timeout=60)]
    for r in results:
        assert r["pydist"]["isinstance"] and r["torch"]["isinstance"]
        assert r["pydist"]["keys"] == r["torch"]["keys"], (r["pydist"]["keys"], r["torch"]["keys"])
        assert not any(k.startswith("module.") for k in r["pydist"]["keys"])
        for k, v in r["torch"]["values"].items():
            assert torch.equal(r["pydist"]["values"][k], v), k
            assert torch.equal(r["loaded"][k], v), f"{k} not loaded from torch DDP's checkpoint"


# --------------------------------------------------------------------------
# torch DDP's surface
# --------------------------------------------------------------------------

IGNORED = ["fc1.bias", "bn.running_mean"]


class _ReassignsBuffer(torch.nn.Module):
    """Its forward replaces its buffer with a new tensor (self.total = ...)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(IN_FEATURES, 4)
        self.register_buffer("total", torch.zeros(()))

    def forward(self, x):
        self.total = self.total + x.detach().sum()
        return self.fc(x)


def _surface(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: F401

    out = {}
    for impl in IMPLS:
        cls = ddp_class(impl)
        r = {}
        # _set_static_graph() after construction, before the first forward
        dist.barrier()
        torch.manual_seed(0)
        ddp = cls(build_model("mlp"))
        ddp._set_static_graph()
        r["static_graph"] = _steps(ddp, rank, 0, 3)
        r["static_graph_state"] = _state(ddp.module)
        # ... and after it
        torch.manual_seed(0)
        ddp = cls(build_model("mlp"))
        _steps(ddp, rank, 0, 1)
        try:
            ddp._set_static_graph()
            r["static_graph_late"] = "accepted"
        except RuntimeError:
            r["static_graph_late"] = "RuntimeError"
        # ignored parameters and buffers: each rank keeps its own
        dist.barrier()
        torch.manual_seed(rank)  # ranks build different weights
        module = build_model("batchnorm")
        with torch.no_grad():
            module.bn.running_mean.add_(rank)
        cls._set_params_and_buffers_to_ignore_for_model(module, IGNORED)
        ddp = cls(module)
        r["parameters_to_ignore"] = sorted(ddp.parameters_to_ignore)
        r["will_sync_before"] = ddp.will_sync_module_buffers()
        r["ignored"] = _steps(ddp, rank, 0, 3)
        r["ignored_state"] = _state(ddp.module)
        with torch.no_grad():
            ddp(_batch(rank, 9))
        r["will_sync_after_no_grad"] = ddp.will_sync_module_buffers()
        # a buffer the forward reassigns: the new one is broadcast
        dist.barrier()
        torch.manual_seed(0)
        ddp = cls(_ReassignsBuffer())
        r["reassigned_buffer"] = _steps(ddp, rank, 0, 3)
        r["reassigned_buffer_state"] = _state(ddp.module)
        # the logging data
        dist.barrier()
        torch.manual_seed(0)
        ddp = cls(build_model("batchnorm"))
        r["log_init"] = ddp._get_ddp_logging_data()
        _steps(ddp, rank, 0, 3)
        r["log_after"] = ddp._get_ddp_logging_data()
        r["logger_type_has_data"] = hasattr(ddp.logger, "_get_ddp_logging_data")
        # an optimizer fused into the gradient reduction
        dist.barrier()
        torch.manual_seed(0)
        ddp = cls(build_model("mlp"))
        ddp._register_fused_optim(torch.optim.SGD, 0.1)
        losses = []
        for step in range(3):
            loss = ddp(_batch(rank, step)).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        r["fused_optim"] = losses
        r["fused_optim_state"] = _state(ddp.module)
        # torch's built-in fp16 hook
        dist.barrier()
        torch.manual_seed(0)
        ddp = cls(build_model("mlp"))
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        r["builtin_hook"] = _steps(ddp, rank, 0, 3)
        r["builtin_hook_state"] = _state(ddp.module)
        out[impl] = r
    # what pydist refuses, and how
    ddp = ddp_class("pydist")(build_model("mlp"))
    refused = {}
    for name, args in [("_remove_autograd_hooks", ()), ("_check_reducer_finalized", ()),
                       ("_update_process_group", (None,)), ("_set_sparse_metadata", ({},)),
                       ("_register_buffer_comm_hook", (None, None)), ("_set_ddp_runtime_logging_sample_rate", (2,))]:
        try:
            getattr(ddp, name)(*args)
            refused[name] = "accepted"
        except NotImplementedError as e:
            refused[name] = str(e)
    out["refused"] = refused
    return pack(out)


# entries of torch's logging data whose meaning pydist shares and whose value
# must then be torch's
SHARED_LOG_KEYS = [
    "backend_name", "bucket_sizes", "device_ids", "dtypes", "module_name", "broadcast_buffers", "bucket_cap_bytes",
    "find_unused_parameters", "gradient_as_bucket_view", "has_sync_bn", "is_multi_device_module", "iteration",
    "num_parameter_tensors", "output_device", "rank", "total_parameter_size_bytes", "world_size",
]


@pytest.mark.timeout(120)
def test_torch_ddp_surface_methods_match_torch():
    results = [unpack(b) for b in run_ranks(_surface, 2, timeout=90)]
    for what in ("static_graph", "static_graph_state", "static_graph_late", "parameters_to_ignore",
                 "will_sync_before", "ignored", "ignored_state", "will_sync_after_no_grad",
                 "fused_optim", "fused_optim_state", "builtin_hook", "builtin_hook_state",
                 "reassigned_buffer", "reassigned_buffer_state"):
        _assert_same(results, what)
    assert results[0]["pydist"]["static_graph_late"] == "RuntimeError"
    # an ignored parameter stays rank-local (ranks built different weights),
    # the others agree (buffers carry the last forward's local update)
    a, b = results[0]["pydist"]["ignored_state"], results[1]["pydist"]["ignored_state"]
    for key in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        assert torch.equal(a[key], b[key]) != (key in IGNORED), f"{key}: ignored={key in IGNORED} but ranks agree={torch.equal(a[key], b[key])}"
    for rank, r in enumerate(results):
        for when in ("log_init", "log_after"):
            for key in SHARED_LOG_KEYS:
                assert r["pydist"][when].get(key) == r["torch"][when].get(key), (
                    f"rank {rank} {when} {key}: pydist {r['pydist'][when].get(key)!r}, torch {r['torch'][when].get(key)!r}"
                )
        assert r["pydist"]["log_after"]["has_rebuilt_buckets"] == r["torch"]["log_after"]["has_rebuilt_buckets"] == 1
        assert r["pydist"]["log_after"]["rebuilt_bucket_sizes"] == r["torch"]["log_after"]["rebuilt_bucket_sizes"]
        assert r["pydist"]["logger_type_has_data"]
    for name, msg in results[0]["refused"].items():
        assert msg != "accepted" and name in msg, f"{name}: {msg}"


# torch DDP methods pydist inherits unchanged, each reviewed: it only reads
# attributes pydist sets, or reaches pydist's state through methods pydist
# overrides. See [Note: the torch DDP surface].
INHERITED_REVIEWED = {
    "_active_ddp_module", "_get_active_ddp_module", "_inside_ddp_forward", "_run_ddp_forward",
    "_build_debug_param_to_name_mapping", "_check_comm_hook", "_check_sync_bufs_post_fwd",
    "_check_sync_bufs_pre_fwd", "_default_broadcast_coalesced", "_distributed_broadcast_coalesced",
    "_sync_module_buffers", "_distributed_rank", "_get_data_parallel_params", "_get_parameters",
    "_passing_sync_batchnorm_handle", "_register_fused_optim", "_set_ddp_sink_clone",
    "_set_params_and_buffers_to_ignore_for_model", "broadcast_buffers", "gather", "scatter", "to_kwargs", "train",
}


def test_every_torch_ddp_method_is_overridden_or_reviewed():
    """A method torch's DDP gains in a later release must be looked at:
    inherited blindly it could reach for a torch reducer pydist lacks."""
    ours = ddp_class("pydist")
    unreviewed = [
        name for name, value in vars(torch.nn.parallel.DistributedDataParallel).items()
        if not (name.startswith("__") and name.endswith("__")) and not name.startswith("_abc")
        and name not in vars(ours) and name not in INHERITED_REVIEWED
    ]
    assert not unreviewed, f"torch DDP members pydist neither overrides nor has reviewed: {unreviewed}"


def _timing_log(rank, world_size):
    torch.manual_seed(0)
    ddp = ddp_class("pydist")(build_model("mlp"), record_timing=True)
    _steps(ddp, rank, 0, 3)
    return ddp._get_ddp_logging_data()


@pytest.mark.timeout(60)
def test_logging_data_averages_from_recorded_iterations():
    log = run_ranks(_timing_log, 2, timeout=45)[0]
    for key in ("avg_backward_compute_time", "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time"):
        assert key in log and log[key] >= 0, (key, log)
    assert log["avg_backward_compute_time"] > 0


# --------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------


def _compiled(rank, world_size):
    """Per implementation: eager, then torch.compile with a backend that
    counts the graphs it is given. Recompiling after the warm-up steps
    raises (error_on_recompile)."""
    import warnings

    import torch._dynamo
    from torch._dynamo.utils import counters

    out = {}
    for impl in IMPLS:
        for mode in ("eager", "compiled"):
            dist.barrier()
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(0)
            # a 2 MB model in 1 MB buckets: Dynamo's DDPOptimizer splits the
            # graph at buckets (its first bucket is 1 MB, whatever the cap)
            ddp = ddp_class(impl)(MLP(1024, 512), bucket_cap_mb=1)
            graphs = []

            def count_graphs(gm, example_inputs):
                graphs.append(len(gm.graph.nodes))
                return gm.forward

            model = torch.compile(ddp, backend=count_graphs) if mode == "compiled" else ddp
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses = _steps(model, rank, 0, 2, opt)
                warm = len(graphs)
                with torch._dynamo.config.patch(error_on_recompile=True):
                    losses += _steps(model, rank, 2, 4, opt)
            out[(impl, mode)] = {
                "losses": losses,
                "state": _state(ddp.module),
                "graphs_warm": warm,
                "graphs_end": len(graphs),
                "graph_breaks": sum(counters["graph_break"].values()),
                "warnings": [str(w.message) for w in caught if "pybind11" in str(w.message) or "Dynamo" in str(w.message)],
            }
    return pack(out)


@pytest.mark.timeout(240)
def test_torch_compile_matches_eager_without_recompiles():
    results = [unpack(b) for b in run_ranks(_compiled, 2, timeout=200)]
    for rank, r in enumerate(results):
        ref = r[("torch", "eager")]
        for key in (("pydist", "eager"), ("torch", "compiled"), ("pydist", "compiled")):
            assert r[key]["losses"] == ref["losses"], f"rank {rank} {key}: losses {r[key]['losses']} vs torch eager {ref['losses']}"
            for name, t in ref["state"].items():
                assert torch.equal(r[key]["state"][name], t), f"rank {rank} {key}: {name} differs from torch eager"
        ours, theirs = r[("pydist", "compiled")], r[("torch", "compiled")]
        assert ours["warnings"] == [], f"rank {rank}: Dynamo warned: {ours['warnings']}"
        # no recompilation once warm (error_on_recompile would have raised),
        # and not a graph more than torch DDP: the bookkeeping stays eager
        assert ours["graphs_end"] == ours["graphs_warm"]
        # DDPOptimizer split the graph at pydist's buckets as at torch's
        assert ours["graphs_warm"] == theirs["graphs_warm"] > 1, (ours["graphs_warm"], theirs["graphs_warm"])
        assert ours["graph_breaks"] <= theirs["graph_breaks"], (ours["graph_breaks"], theirs["graph_breaks"])



def _device_mesh(rank, world_size):
    """torch DDP's ``device_mesh=``: a 1-D mesh's group, against torch DDP
    given the same mesh; the errors torch raises for a mesh beside a group
    and for a 2-D mesh, and pydist's refusal of a mesh sliced from a larger
    one (DDP beside tensor parallelism, where torch rewrites the module)."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    mesh = init_device_mesh("cpu", (world_size,))
    for impl in ("torch", "pydist"):
        torch.manual_seed(0)
        ddp = ddp_class(impl)(MLP(), device_mesh=mesh)
        _steps(ddp, rank, 0, 3)
        out[impl] = (_state(ddp.module), ddp.device_mesh is mesh, ddp.process_group is mesh.get_group())
    torch.manual_seed(0)
    out["both"] = outcome(lambda: ddp_class("pydist")(MLP(), process_group=dist.group.WORLD, device_mesh=mesh))
    mesh_2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("tp", "dp"))
    for impl in ("torch", "pydist"):
        torch.manual_seed(0)
        out[f"{impl}:2d"] = outcome(lambda: ddp_class(impl)(MLP(), device_mesh=mesh_2d))
    out["sliced"] = outcome(lambda: ddp_class("pydist")(MLP(), device_mesh=mesh_2d["dp"]))
    return out


@pytest.mark.timeout(90)
def test_device_mesh_as_torchs():
    for rank, r in enumerate(run_ranks(_device_mesh, 2, timeout=60)):
        (theirs, *_), (mine, mesh_kept, group) = r["torch"], r["pydist"]
        assert mesh_kept and group, rank
        for name, value in theirs.items():
            assert torch.equal(mine[name], value), f"rank {rank}: {name}"
        assert r["both"] == ("RuntimeError", "Cannot specify both process_group and device_mesh arguments."), r["both"]
        assert r["pydist:2d"] == r["torch:2d"] and "Only 1D device mesh" in r["torch:2d"][1], r["pydist:2d"]
        kind, msg = r["sliced"]
        assert kind == "NotImplementedError" and "sliced" in msg, (kind, msg)


def _zero_and_local_sgd(rank, world_size):
    """torch's ZeroRedundancyOptimizer, and the post-local-SGD comm hook with
    its PeriodicModelAverager, on each wrapper: the parameters after 6 steps."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import ZeroRedundancyOptimizer

    subgroup, _ = dist.new_subgroups(group_size=1)  # (its default needs CUDA)
    out = {}
    for impl in ("torch", "pydist"):
        for how in ("zero", "local_sgd"):
            torch.manual_seed(0)
            ddp = ddp_class(impl)(MLP())
            averager = None
            if how == "zero":
                opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
            else:
                ddp.register_comm_hook(PostLocalSGDState(None, subgroup, start_localSGD_iter=2), post_localSGD_hook)
                averager = PeriodicModelAverager(period=2, warmup_steps=2)
                opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            for step in range(6):
                ddp(_batch(rank, step)).pow(2).mean().backward()
                opt.step()
                if averager is not None:  # (it averages the parameters that have a .grad)
                    averager.average_parameters(ddp.parameters())
                opt.zero_grad()
            out[f"{impl}:{how}"] = [p.detach().clone() for p in ddp.parameters()]
    return out


@pytest.mark.timeout(90)
def test_zero_redundancy_optimizer_and_post_local_sgd_as_beside_torch():
    for rank, r in enumerate(run_ranks(_zero_and_local_sgd, 2, timeout=60)):
        for how in ("zero", "local_sgd"):
            for mine, theirs in zip(r[f"pydist:{how}"], r[f"torch:{how}"]):
                assert torch.equal(mine, theirs), f"rank {rank}: {how}"
