"""Small deterministic models for the DDP parity suite.

Each model is built by name through ``build_model(name)`` right after the
harness seeds torch, so torch DDP and pydist DDP get bit-identical modules.
Every model takes ``forward(x, **options)`` with ``x`` of shape
``(batch, IN_FEATURES)`` and returns ``(batch, OUT_FEATURES)``; the options
a model understands are listed on it (only ``branch`` has one).

The models are chosen for what they make a DDP do:

- ``mlp``: plain training; several tensors of different sizes, so small
  bucket caps give several buckets.
- ``wide``: an MLP with a 128 KB weight, above the size from which pydist
  moves a gradient created during backward into its bucket.
- ``branch``: a sub-module the caller can skip (``use_branch=False``), for
  ``find_unused_parameters`` with locally and globally unused parameters.
- ``batchnorm``: running statistics buffers, for ``broadcast_buffers``.
- ``tied``: one parameter used twice in the graph (two modules share it).
- ``frozen``: a layer with ``requires_grad=False``; DDP must leave it out of
  the buckets but still broadcast it at construction.
- ``many_tiny``: 1,058 tiny parameters, so buckets hold many tensors and a
  small cap gives many buckets.
- ``checkpointed``: a block run twice under reentrant activation
  checkpointing plus a parameter never used: the case ``static_graph=True``
  exists for (hooks fire twice per backward, unused parameter without
  ``find_unused_parameters``).
- ``linear_int``: one bias-free linear layer; with integer-valued weights
  and data its gradients are integers, so the averaged gradient is known
  exactly.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IN_FEATURES = 8
OUT_FEATURES = 4


class MLP(nn.Module):
    def __init__(self, hidden1: int = 32, hidden2: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, hidden1)
        self.fc2 = nn.Linear(hidden1, hidden2)
        self.fc3 = nn.Linear(hidden2, OUT_FEATURES)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class BranchNet(nn.Module):
    """``trunk -> [branch] -> head``; ``use_branch=False`` skips ``branch``."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(IN_FEATURES, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, OUT_FEATURES)

    def forward(self, x, use_branch=True):
        h = F.relu(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, OUT_FEATURES)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class TiedNet(nn.Module):
    """``dec.weight`` is ``enc.weight``: one parameter, two uses per forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, 16)
        self.enc = nn.Linear(16, 16)
        self.dec = nn.Linear(16, 16)
        self.dec.weight = self.enc.weight
        self.out = nn.Linear(16, OUT_FEATURES)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.enc(h))
        h = torch.tanh(self.dec(h))
        return self.out(h)


class FrozenNet(nn.Module):
    """``frozen`` never trains (``requires_grad=False``); the rest does."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(IN_FEATURES, 16)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, OUT_FEATURES)

    def forward(self, x):
        return self.head(F.relu(self.fc(F.relu(self.frozen(x)))))


class ManyTinyNet(nn.Module):
    """1,024 scalar gates, 32 small vectors and a head: 1,058 tiny parameters.

    The gates and vectors are stacked in the forward (one op each), so the
    model costs little to run while DDP still sees 1,058 separate tensors."""

    N_GATES = 1024
    N_VECS = 32

    def __init__(self):
        super().__init__()
        self.gates = nn.ParameterList(
            [nn.Parameter(0.2 * torch.randn(())) for _ in range(self.N_GATES)]
        )
        self.vecs = nn.ParameterList(
            [nn.Parameter(0.3 * torch.randn(IN_FEATURES)) for _ in range(self.N_VECS)]
        )
        self.head = nn.Linear(self.N_VECS, OUT_FEATURES)

    def forward(self, x):
        v = torch.stack(list(self.vecs))  # (32, IN_FEATURES)
        g = torch.stack(list(self.gates)).view(self.N_VECS, self.N_VECS)
        h = torch.tanh(x @ v.t())
        h = torch.tanh(h @ g)
        return self.head(h)


class CheckpointedNet(nn.Module):
    """``block`` runs twice under reentrant checkpointing; ``unused`` never runs."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.unused = nn.Linear(16, 16)
        self.head = nn.Linear(16, OUT_FEATURES)

    def forward(self, x):
        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=True)
        h = checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


class LinearInt(nn.Module):
    """Integer-valued weights: with integer data the gradients are integers."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN_FEATURES, OUT_FEATURES, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randint(-3, 4, self.fc.weight.shape).float())

    def forward(self, x):
        return self.fc(x)


MODELS = {
    "mlp": MLP,
    "wide": functools.partial(MLP, 256, 128),
    "branch": BranchNet,
    "batchnorm": BatchNormNet,
    "tied": TiedNet,
    "frozen": FrozenNet,
    "many_tiny": ManyTinyNet,
    "checkpointed": CheckpointedNet,
    "linear_int": LinearInt,
}


def build_model(name: str) -> nn.Module:
    """A fresh model by name, initialised from torch's current RNG state."""
    return MODELS[name]()
