"""A LightningModule written for one device, trained pipelined by PyTorch Lightning.

The module below knows nothing of the pipeline: its network is an ``nn.Sequential``, its loss
a method over (outputs, targets), its batches pairs (inputs, targets), and its steps call
the network and log what they compute. ``Trainer(strategy=PipelineStrategy(chunks=4),
devices=2)`` cuts the network in two, one stage per process (Lightning starts the second
process by running this script again), and every step runs as a pipeline over 4
micro-batches. The logged losses and accuracy are the same on both processes.

It classifies the points of three interleaved spirals (made here, nothing to download),
then trains the same module on one device on the same batches, and prints both runs'
validation loss and accuracy and how far apart their training losses were.

    pip install '.[lightning]'
    python examples/lightning_module.py
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset

from gpipe.integrations.lightning import PipelineStrategy


class SpiralClassifier(L.LightningModule):
    """An ordinary LightningModule: nothing here is about pipelines."""

    def __init__(self, width: int = 64, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(2, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, labels)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        logits = self(x)
        self.log("val_loss", self.loss_fn(logits, y))
        self.log("val_accuracy", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def spirals(n_per_arm: int, seed: int) -> TensorDataset:
    """Three spiral arms of ``n_per_arm`` noisy points each, labelled by arm."""
    g = torch.Generator().manual_seed(seed)
    radius = torch.linspace(0.1, 1.0, n_per_arm)
    points, labels = [], []
    for arm in range(3):
        angle = radius * 4.0 + arm * 2 * math.pi / 3 + 0.2 * torch.randn(n_per_arm, generator=g)
        points.append(torch.stack([radius * angle.cos(), radius * angle.sin()], 1))
        labels.append(torch.full((n_per_arm,), arm))
    return TensorDataset(torch.cat(points), torch.cat(labels))


class LossPerStep(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(strategy: object, devices: int, args: argparse.Namespace) -> tuple[L.Trainer, list[float]]:
    """Train from the same weights on the same batches, whatever the strategy."""
    torch.manual_seed(args.seed)
    module = SpiralClassifier()
    train = DataLoader(
        spirals(400, args.seed),
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    val = DataLoader(spirals(200, args.seed + 1), batch_size=200)
    record = LossPerStep()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=args.steps,
        check_val_every_n_epoch=None,
        val_check_interval=args.steps,
        num_sanity_val_steps=0,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train, val)
    return trainer, record.losses


def report(name: str, trainer: L.Trainer, losses: list[float]) -> None:
    metrics = trainer.callback_metrics
    print(
        f"{name}: trained {len(losses)} steps, training loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
        f"validation loss {float(metrics['val_loss']):.4f}, "
        f"accuracy {100 * float(metrics['val_accuracy']):.1f}%",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    trainer, piped = fit(PipelineStrategy(chunks=args.chunks), 2, args)
    if trainer.global_rank != 0:  # the second process: its part is done
        return
    report(f"pipelined (2 processes, chunks={args.chunks})", trainer, piped)
    plain_trainer, plain = fit("auto", 1, args)
    report("without the pipeline (one device)", plain_trainer, plain)
    worst = max(abs(a - b) / abs(b) for a, b in zip(piped, plain, strict=True))
    print(f"largest relative difference in the training loss of a step: {worst:.2e}")


if __name__ == "__main__":
    main()
