"""What examples/train.py trains: two models and the data each learns from.

    model = build_model(ModelConfig("mlp", width=256, depth=4))
    dataset = make_dataset("mlp", samples=8192, seed=0)

- ``mlp``: an MLP classifying synthetic points. The labels come from a fixed,
  randomly drawn "teacher" network, so the task is learnable and the loss
  falls within a few epochs.
- ``transformer``: a small causal transformer language model over characters
  of a generated corpus (sentences of a toy grammar drawn with a seeded
  generator), predicting each next character.

Both datasets are generated from ``seed`` alone, so every run of the job with
the same seed trains on the same bytes. Only rank 0 calls ``make_dataset``;
train.py sends the tensors to the other ranks (``share_dataset``). With a real
dataset, replace ``make_dataset`` with your loading code: local rank 0 of each
node downloads or unpacks, the others wait at a barrier, then every rank opens
the files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

__all__ = ["ModelConfig", "build_model", "make_dataset", "loss_fn", "MLP", "TinyLM"]

MLP_FEATURES = 64  # input features of the synthetic points
MLP_CLASSES = 10
LM_CONTEXT = 32  # characters per training sequence
DROPOUT = 0.1  # both models use dropout, so resuming must restore every rank's RNG


@dataclass(frozen=True)
class ModelConfig:
    """Everything that decides the model's parameter shapes. A snapshot
    records it; resuming with another one is refused."""

    name: str  # "mlp" or "transformer"
    width: int  # MLP hidden width; transformer d_model
    depth: int  # MLP hidden layers; transformer blocks
    vocab: int = 0  # transformer only: characters in the corpus (set by the data)

    def as_dict(self) -> dict:
        return asdict(self)


class MLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, classes: int, dropout: float = DROPOUT):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(in_features if i == 0 else width, width), nn.ReLU(), nn.Dropout(dropout)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class TinyLM(nn.Module):
    """A decoder-only transformer: token and position embeddings, pre-norm
    blocks with a causal mask, a linear head over the vocabulary."""

    def __init__(self, vocab: int, width: int, depth: int, context: int = LM_CONTEXT, heads: int = 4,
                 dropout: float = DROPOUT):
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.token(tokens) + self.position(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def build_model(config: ModelConfig) -> nn.Module:
    """The bare model (unwrapped); its parameters come from torch's global
    RNG, which train.py seeds identically on every rank first."""
    if config.name == "mlp":
        return MLP(MLP_FEATURES, config.width, config.depth, MLP_CLASSES)
    if config.name == "transformer":
        return TinyLM(config.vocab, config.width, config.depth)
    raise ValueError(f"build_model: unknown model {config.name!r} (expected 'mlp' or 'transformer')")


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for both: the MLP's [batch, classes] logits against
    [batch] labels, the LM's [batch, time, vocab] against [batch, time]."""
    return nn.functional.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


def make_dataset(name: str, samples: int, seed: int) -> TensorDataset:
    """``samples`` training examples for model ``name``, from ``seed`` alone."""
    generator = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return _teacher_points(samples, generator)
    if name == "transformer":
        return _corpus_windows(samples, generator)
    raise ValueError(f"make_dataset: unknown model {name!r} (expected 'mlp' or 'transformer')")


def _teacher_points(samples: int, generator: torch.Generator) -> TensorDataset:
    x = torch.randn(samples, MLP_FEATURES, generator=generator)
    hidden = torch.randn(MLP_FEATURES, 32, generator=generator) / MLP_FEATURES**0.5
    readout = torch.randn(32, MLP_CLASSES, generator=generator)
    labels = (torch.tanh(x @ hidden) @ readout).argmax(dim=1)
    return TensorDataset(x, labels)


# A toy grammar: sentence = subject verb object [adverb] "." -- enough
# structure for a small LM's loss to fall well below uniform in a few epochs.
_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "our neighbour"]
_VERBS = ["sees", "likes", "chases", "finds", "draws", "remembers", "follows"]
_OBJECTS = ["the ball", "a red kite", "the river", "an apple", "the moon", "a quiet street", "the garden"]
_ADVERBS = ["", " today", " again", " slowly", " at night"]


def generate_corpus(characters: int, generator: torch.Generator) -> str:
    def pick(words: list[str]) -> str:
        return words[int(torch.randint(len(words), (1,), generator=generator))]

    parts: list[str] = []
    total = 0
    while total < characters:
        sentence = f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)}{pick(_ADVERBS)}. "
        parts.append(sentence)
        total += len(sentence)
    return "".join(parts)[:characters]


def corpus_vocabulary() -> list[str]:
    """Every character the grammar can produce, sorted: the LM's vocabulary
    (fixed by the grammar, so every rank knows it without the data)."""
    return sorted(set("".join(_SUBJECTS + _VERBS + _OBJECTS + _ADVERBS) + ". "))


def _corpus_windows(samples: int, generator: torch.Generator) -> TensorDataset:
    """``samples`` windows of LM_CONTEXT characters, each paired with the same
    window shifted by one (the next-character targets)."""
    text = generate_corpus(samples * LM_CONTEXT + 1, generator)
    index = {ch: i for i, ch in enumerate(corpus_vocabulary())}
    ids = torch.tensor([index[ch] for ch in text], dtype=torch.long)
    inputs = ids[:-1].view(samples, LM_CONTEXT)
    targets = ids[1:].view(samples, LM_CONTEXT)
    return TensorDataset(inputs.clone(), targets.clone())
