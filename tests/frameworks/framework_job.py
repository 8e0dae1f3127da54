"""One job under torchrun (2 CPU ranks): a tiny regression trained by
accelerate's multi-CPU path, by Lightning's DDP strategy and by the HF
Trainer (where transformers is installed), first on pydist's
DDP through ``pydist.patch_torch()`` called before the frameworks are imported
(as docs/frameworks.md shows), then, after ``undo()``, on torch's DDP from the
same seed. Rank 0 saves what tests/frameworks/test_frameworks.py compares:
each framework's final parameters and the wrapper class it built, per run,
and the patch's report.

Lightning's strategy bound the class at its import, under the patch; for the
torch run the test puts torch's class back under that name, as if Lightning
had been imported without the patch (one process instead of two jobs).
"""

import argparse
import os

import torch
# Bound before the patch on purpose: patch_torch() must report it, and it keeps torch's class.
from torch.nn.parallel import DistributedDataParallel as BoundBeforeThePatch  # noqa: F401

import pydist  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

TORCH_DDP = torch.nn.parallel.DistributedDataParallel
report = pydist.patch_torch(warn=False)

import pytorch_lightning as pl  # noqa: E402  (after the patch: its strategy binds the class at import)
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

try:
    import transformers  # noqa: E402
except ImportError:  # the test of the HF Trainer skips
    transformers = None

STEPS, BATCH = 4, 8  # per rank


def make_data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2 * STEPS * BATCH, 16, generator=generator)
    return TensorDataset(x, x @ torch.randn(16, 4, generator=generator))


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train_with_accelerate():
    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type.value == "MULTI_CPU", accelerator.distributed_type
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(make_data(), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    wrapper = f"{type(model).__module__}.{type(model).__qualname__}"
    return wrapper, {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self):
        wrapper = type(self.trainer.strategy.model)  # the wrapper the strategy built, while it trains
        self.wrapper = f"{wrapper.__module__}.{wrapper.__qualname__}"

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def train_with_lightning():
    module = Regression()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, gradient_clip_val=0.5,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(make_data(), batch_size=BATCH))
    return module.wrapper, {k: v.clone() for k, v in module.net.state_dict().items()}


class RegressionForTrainer(torch.nn.Module):
    """make_model's network as the HF Trainer takes a model: keyword
    inputs, a dict with the loss."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


class TrainerData(torch.utils.data.Dataset):
    def __init__(self):
        self.data = make_data()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return {"x": x, "labels": y}


def train_with_hf_trainer(run: str):
    """The HF Trainer (it prepares through accelerate): AdamW, linear decay,
    clipping, gradient accumulation over 2 micro-batches (no_sync)."""
    if transformers is None:
        return None
    module = RegressionForTrainer()
    arguments = transformers.TrainingArguments(
        output_dir=os.path.join(args.out, f"trainer_{run}"), use_cpu=True, per_device_train_batch_size=BATCH // 2,
        gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=0.01, max_grad_norm=0.5, seed=0,
        report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=module, args=arguments, train_dataset=TrainerData())
    trainer.train()
    wrapper = type(trainer.model_wrapped)
    return f"{wrapper.__module__}.{wrapper.__qualname__}", {k: v.clone() for k, v in module.state_dict().items()}


results = {"pydist": {"accelerate": train_with_accelerate(), "lightning": train_with_lightning(),
                      "hf_trainer": train_with_hf_trainer("pydist")},
           "patched": report.patched, "unreached": report.unreached}
report.undo()
import pytorch_lightning.strategies.ddp  # noqa: E402

pytorch_lightning.strategies.ddp.DistributedDataParallel = TORCH_DDP  # see the docstring
results["torch"] = {"accelerate": train_with_accelerate(), "lightning": train_with_lightning(),
                    "hf_trainer": train_with_hf_trainer("torch")}
if int(os.environ["RANK"]) == 0:
    torch.save(results, os.path.join(args.out, "results.pt"))
# Groups destroyed before exit, as torch asks: gloo's threads left to the
# interpreter's exit can abort the process ("terminate called without an
# active exception", pytorch/pytorch#190489; seen once here, on a rank whose
# training had ended).
torch.distributed.destroy_process_group()
