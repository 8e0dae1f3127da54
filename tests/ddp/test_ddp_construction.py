"""Modules pydist cannot reduce correctly are refused at construction (or at
the next forward, for a parameter replaced after wrapping), beside what
stock torch DDP does with the same module, on spawned gloo ranks.

- A module on the meta device (deferred init): refused, saying how to
  materialize it (torch refuses too). Materialized first, then wrapped, it
  trains to torch DDP's parameters bitwise.
- A parameter replaced after wrapping (materializing from meta makes new
  Parameters, as does assigning ``module.w = nn.Parameter(...)``; or a
  ``.double()``):
  the reducer's hooks watch the old tensors, so gradients would silently stop
  being averaged; pydist refuses at the next forward, naming the parameter.
  The test shows what is at stake: the same sequence with the check taken
  away leaves the ranks' parameters different.
- Sparse gradients (``nn.Embedding(sparse=True)``), complex parameters,
  lazy (uninitialized) parameters and ``SyncBatchNorm`` on CPU: refused,
  naming the parameter or layer; torch's outcome beside each.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_harness import ddp_class, outcome, pack, unpack
from ddp_models import IN_FEATURES, OUT_FEATURES, MLP
from pydist.spawn import run_ranks



def _meta_mlp():
    with torch.device("meta"):
        return MLP()


def _materialized_mlp(seed):
    module = _meta_mlp()
    module.to_empty(device="cpu")
    torch.manual_seed(seed)
    for m in module.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return module


def _replace_params(module):
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            setattr(m, key, nn.Parameter(p.detach().clone()))


def _train(ddp, rank, steps=3):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(steps):
        g = torch.Generator().manual_seed(rank * 101 + step)
        ddp(torch.randn(4, IN_FEATURES, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _deferred_init(rank, world_size):
    out = {}
    for impl in ("torch", "pydist"):
        dist.barrier()
        out[f"{impl}:meta"] = outcome(lambda: ddp_class(impl)(_meta_mlp()))
        dist.barrier()
        # the way that works: materialize, initialize (seeds differ per rank:
        # construction broadcasts rank 0's), then wrap
        out[f"{impl}:materialized"] = _train(ddp_class(impl)(_materialized_mlp(seed=rank)), rank)
    # parameters replaced after wrapping (meta -> cpu materialization makes
    # new Parameters; so does loading weights by assignment): tensors the
    # reducer never hooked
    torch.manual_seed(0)
    ddp = ddp_class("pydist")(MLP())
    _replace_params(ddp.module)
    out["pydist:replaced_after_wrap"] = outcome(lambda: _train(ddp, rank))
    # the same, with the check disabled: what a user would have got
    torch.manual_seed(0)
    ddp = ddp_class("pydist")(MLP())
    _replace_params(ddp.module)
    ddp._check_params_unchanged = lambda: None
    out["pydist:unchecked"] = _train(ddp, rank)
    # a dtype changed after wrapping
    torch.manual_seed(0)
    ddp = ddp_class("pydist")(MLP())
    ddp.module.double()
    out["pydist:double_after_wrap"] = outcome(
        lambda: ddp(torch.randn(4, IN_FEATURES, dtype=torch.float64)).sum().backward()
    )
    return pack(out)


@pytest.mark.timeout(120)
def test_meta_module_refused_and_materialized_module_trains_like_torch():
    results = [unpack(b) for b in run_ranks(_deferred_init, 2, timeout=90)]
    for rank, r in enumerate(results):
        kind, msg = r["pydist:meta"]
        assert kind == "RuntimeError", f"rank {rank}: a meta module gave {kind}: {msg}"
        assert "meta" in msg and "to_empty" in msg and "fc1.weight" in msg, msg
        assert r["torch:meta"][0] != "ok", "torch DDP accepted a meta module: the reference changed"
        for name, t in r["torch:materialized"].items():
            assert torch.equal(t, r["pydist:materialized"][name]), f"rank {rank}: {name} differs from torch DDP's"
            assert torch.equal(t, results[0]["torch:materialized"][name])
        kind, msg = r["pydist:replaced_after_wrap"]
        assert kind == "RuntimeError" and "fc1.weight" in msg and "replaced" in msg, (kind, msg)
        kind, msg = r["pydist:double_after_wrap"]
        assert kind == "RuntimeError" and "fc1.weight" in msg and "torch.float64" in msg, (kind, msg)
    # without the check, training "succeeds" and the replicas drift apart
    drift = max((results[0]["pydist:unchecked"][n] - results[1]["pydist:unchecked"][n]).abs().max().item()
                for n in results[0]["pydist:unchecked"])
    assert drift > 0, "the unchecked run stayed in sync: the test no longer shows what the check prevents"


class _SparseEmbeddingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, IN_FEATURES, sparse=True)
        self.fc = nn.Linear(IN_FEATURES, OUT_FEATURES)


class _ComplexNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN_FEATURES, OUT_FEATURES)
        self.phase = nn.Parameter(torch.ones(OUT_FEATURES, dtype=torch.complex64))


class _SyncBNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN_FEATURES, 16)
        self.norm = nn.SyncBatchNorm(16)


class _LazyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.LazyLinear(OUT_FEATURES)


MODULES = {"sparse": _SparseEmbeddingNet, "complex": _ComplexNet, "syncbn": _SyncBNNet, "lazy": _LazyNet}


def _unsupported(rank, world_size):
    out = {}
    for kind, cls in MODULES.items():
        for impl in ("torch", "pydist"):
            dist.barrier()
            torch.manual_seed(0)
            out[f"{impl}:{kind}"] = outcome(lambda: ddp_class(impl)(cls()))
    return out


@pytest.mark.timeout(90)
def test_unsupported_modules_refused_naming_the_parameter():
    r = run_ranks(_unsupported, 2, timeout=60)[0]
    kind, msg = r["pydist:sparse"]
    assert kind == "NotImplementedError" and "'emb'" in msg and "sparse=False" in msg, (kind, msg)
    assert r["torch:sparse"][0] == "ok", r["torch:sparse"]  # torch reduces sparse gradients
    kind, msg = r["pydist:complex"]
    assert kind == "NotImplementedError" and "'phase'" in msg and "complex64" in msg and "view_as_real" in msg, (kind, msg)
    # SyncBatchNorm on CPU: torch's error type and words, and pydist names the layer
    assert r["torch:syncbn"][0] == "ValueError" and "only work with GPU modules" in r["torch:syncbn"][1], r["torch:syncbn"]
    kind, msg = r["pydist:syncbn"]
    assert kind == "ValueError" and "SyncBatchNorm layers only work with GPU modules" in msg and "'norm'" in msg, (kind, msg)
    assert r["torch:lazy"][0] == "RuntimeError" and "uninitialized" in r["torch:lazy"][1], r["torch:lazy"]
    kind, msg = r["pydist:lazy"]
    assert kind == "RuntimeError" and "uninitialized" in msg and "fc.weight" in msg, (kind, msg)
