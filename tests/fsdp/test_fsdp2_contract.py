"""FSDP2's contract: a training script written against torch's FSDP2 API runs
with only the import of ``fully_shard`` changed, bitwise torch's.

The script (``_script``) is what an FSDP2 user writes: transformer blocks
built on the meta device, ``fully_shard`` per block, on the final norm and
the output layer as one group (a list, as torchtitan groups them) and on the
root with a ``MixedPrecisionPolicy``, ``to_empty`` and initialization through DTensors,
explicit forward and backward prefetch, AdamW with ``clip_grad_norm_``
every step, a DTensor-API checkpoint (``full_tensor``) and a DCP one, and a
resume into a fresh meta model with ``set_model_state_dict(...,
broadcast_from_rank0=True)`` and ``set_optimizer_state_dict``, and one through
the DTensor API as torch's FSDP2 example resumes (the meta model's state
dict, ``distribute_tensor``, ``load_state_dict(assign=True)``). Each rank runs
it twice, once per ``fully_shard`` (torch's, pydist's), on the same seeds
and data; losses, norms, parameters, optimizer state and checkpoints must be
equal bit for bit (two ranks: every sum of two terms is exact in either
order), at 2 ranks and on a 2 x 2 HSDP mesh at 4 (two sums of two). See [Note: DTensor parameters] in pydist/fsdp/_fsdp_param.py and
[Note: a unit's layout] in _fsdp_param_group.py.
"""

import copy
import os
import tempfile

import pytest
import torch
import torch.nn as nn

from fsdp_harness import bitwise_mismatches

from pydist.spawn import run_ranks

DIM, HEADS, VOCAB, SEQ = 16, 2, 24, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 3 * DIM), nn.GELU(), nn.Linear(3 * DIM, DIM))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class LM(nn.Module):
    def __init__(self, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(layers)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def init_weights(self):
        """Through DTensor ops on the sharded parameters, as FSDP2 scripts do."""
        for name, p in self.named_parameters():
            if name.endswith("bias") or ".norm." in name:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
            else:
                nn.init.trunc_normal_(p, std=0.02)


def _build(fully_shard, mp, mesh):
    with torch.device("meta"):
        model = LM()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, mesh=mesh)
    # the final norm and the output layer as one group, as torchtitan groups them
    fully_shard([model.norm, model.head], mp_policy=mp, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mp_policy=mp, mesh=mesh)
    # explicit prefetch, as torchtitan sets it
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return model


def _script(fully_shard, rank: int, ckpt_dir: str, mp, mesh) -> dict:
    """An FSDP2 training script; ``fully_shard`` is the only thing swapped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    torch.manual_seed(0)
    model = _build(fully_shard, mp, mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    out = {"isinstance": all(isinstance(m, FSDPModule) for m in (model, *model.blocks, model.norm, model.head)),
           "placements": all(isinstance(p, DTensor) and p.placements == placements for p in model.parameters())}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses, norms = [], []

    def step():
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.roll(1, 1).flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5).full_tensor().item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    for _ in range(3):
        step()
    # DTensor-API checkpoint: full tensors gathered per parameter
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    # DCP checkpoint of model and optimizer
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(ckpt_dir, "dcp"))
    full_osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out["full"] = full
    out["full_osd"] = full_osd["state"]
    for _ in range(2):
        step()
    out["after"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    # resume: a fresh meta model, rank 0's full state broadcast into it
    torch.manual_seed(1)
    resumed = _build(fully_shard, mp, mesh)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # (torch's loaders put their own values into the dicts they are given: each gets a copy)
    set_model_state_dict(resumed, copy.deepcopy(full) if rank == 0 else {}, options=options)
    ropt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    set_optimizer_state_dict(resumed, ropt, copy.deepcopy(full_osd) if rank == 0 else {}, options=options)
    model, opt = resumed, ropt
    resumed_losses = len(losses)
    for _ in range(2):
        step()
    out["resumed"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    out["resumed_losses"] = losses[resumed_losses:]
    # and the DCP checkpoint loads into the resumed model, giving back step 3's values
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, "dcp"))
    set_model_state_dict(model, sd["model"])
    out["dcp_loaded"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    out["losses"], out["norms"] = losses, norms
    # resume through the DTensor API, as torch's FSDP2 example does: the meta model's state dict gives each
    # parameter's mesh and placements, the full values are distributed and assigned, no to_empty
    resumed = _build(fully_shard, mp, mesh)
    meta_sd = resumed.state_dict()
    out["meta_sd"] = {k: (str(v.device), tuple(v.shape), getattr(v, "placements", None)) for k, v in meta_sd.items()}
    resumed.load_state_dict({k: nn.Parameter(distribute_tensor(full[k], v.device_mesh, v.placements))
                             for k, v in meta_sd.items()}, strict=False, assign=True)
    out["dtensor_resumed"] = {k: v.full_tensor() for k, v in resumed.state_dict().items()}
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    out["dtensor_resumed_loss"] = resumed(tokens).float().sum().item()
    return out


def _rank(rank, world_size, ckpt_dir, bf16, hsdp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import pydist

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    mesh = (init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (world_size,)))
    results = {}
    for name, fn in (("torch", torch_fully_shard), ("pydist", pydist.fully_shard)):
        d = os.path.join(ckpt_dir, name)
        os.makedirs(d, exist_ok=True)
        results[name] = _script(fn, rank, d, mp, mesh)
    ref, got = results["torch"], results["pydist"]
    mismatches = []
    for key in ("losses", "norms", "full", "full_osd", "after", "resumed", "resumed_losses", "dcp_loaded", "meta_sd",
                "dtensor_resumed", "dtensor_resumed_loss"):
        bitwise_mismatches(ref[key], got[key], key, mismatches)
    return {"isinstance": got["isinstance"], "placements": got["placements"], "mismatches": mismatches,
            "list_refusals": _list_refusals(pydist.fully_shard, mesh)}


def _list_refusals(fully_shard, mesh) -> list:
    """What pydist refuses of a list (see [Note: a list of modules]), each
    before anything is sharded: the messages, and whether the modules were
    left as they were."""
    tied = nn.ModuleList([nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)])
    tied[1].weight = tied[0].weight
    outer = nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM))
    found = []
    for modules in ([tied[0], tied[1]], [outer, outer[1]]):
        try:
            fully_shard(modules, mesh=mesh)
            found.append("accepted")
        except NotImplementedError as e:
            untouched = not any(hasattr(p, "_pydist_fsdp_taken_by") for m in modules for p in m.parameters())
            found.append(str(e) if untouched else "changed the modules")
    return found


@pytest.mark.timeout(240)
@pytest.mark.parametrize("bf16,hsdp", [(False, False), (True, False), (False, True)],
                         ids=["fp32", "bf16", "hsdp-2x2-fp32"])
def test_fsdp2_script_with_only_the_import_changed(bf16, hsdp):
    """At 2 ranks; HSDP on a 2 x 2 ("replicate", "shard") mesh at 4."""
    with tempfile.TemporaryDirectory() as d:
        results = run_ranks(_rank, 4 if hsdp else 2, args=(d, bf16, hsdp), timeout=200)
    for rank, r in enumerate(results):
        assert r["isinstance"] and r["placements"], f"rank {rank}"
        assert not r["mismatches"], f"rank {rank}: " + "; ".join(r["mismatches"][:8])
        tied, nested = r["list_refusals"]
        assert "weight tied between modules of a list" in tied and "parameter weight of module 1" in tied, tied
        assert "is inside module 0" in nested, nested
