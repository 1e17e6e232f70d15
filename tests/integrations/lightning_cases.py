"""A LightningModule written for one device, and its training, for
tests/integrations/test_lightning.py: on one device in the test's process, and pipelined on
each of two processes (importable by name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.nn.functional import mse_loss
from torch.utils.data import DataLoader, TensorDataset

from gpipe.integrations.lightning import PipelineStrategy

from ..small_models import N_IN, N_OUT, mlp

ROWS, BATCH = 96, 16


class Regression(L.LightningModule):
    """Nothing here knows of the pipeline: the network is an nn.Sequential, the loss a
    method over (outputs, targets), a batch a pair (inputs, targets)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return mse_loss(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss_fn(self(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def loaders() -> tuple[DataLoader, DataLoader]:
    """Training rows shuffled by a seeded generator, and validation rows in order."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, N_IN, dtype=torch.float64, generator=g)
    y = torch.tanh(x @ torch.randn(N_IN, N_OUT, dtype=torch.float64, generator=g))
    order = torch.Generator().manual_seed(4)
    train = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=order)
    return train, DataLoader(TensorDataset(x[:48], y[:48]), batch_size=BATCH)


class Record(L.Callback):
    """Per batch: the loss Lightning got back and the logged train_loss; per validation,
    the logged val_loss."""

    def __init__(self) -> None:
        self.returned: list[float] = []
        self.logged: list[float] = []
        self.validated: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.returned.append(float(outputs["loss"]))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self.validated.append(float(trainer.callback_metrics["val_loss"]))


def train(strategy: Any, devices: int, checkpoint: Path, resume: bool = False) -> dict[str, Any]:
    """Two epochs (12 batches; gradients accumulated over 2, clipped by norm, an SGD step
    and a halved learning rate per epoch), validated after each; then validate() again and
    save a checkpoint. With ``resume``, a third epoch from that checkpoint instead."""
    torch.manual_seed(0)
    module = Regression()
    record = Record()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        precision="64-true",
        max_epochs=3 if resume else 2,
        accumulate_grad_batches=2,
        gradient_clip_val=2.2,  # below the gradient's norm in one step of six
        num_sanity_val_steps=1,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    train_loader, val_loader = loaders()
    trainer.fit(module, train_loader, val_loader, ckpt_path=checkpoint if resume else None)
    if resume:
        return {"returned": record.returned, "validated": record.validated}
    (validated,) = trainer.validate(module, val_loader, verbose=False)
    trainer.save_checkpoint(checkpoint)
    return {
        "returned": record.returned,
        "logged": record.logged,
        "validated": record.validated,
        "validate": validated["val_loss"],
    }


def pipelined(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What each of two processes runs: the same training, a stage each, and its resumption."""
    trained = train(PipelineStrategy(chunks=4, balance=[5, 3]), 2, checkpoint)
    return trained, train(PipelineStrategy(chunks=4, balance=[5, 3]), 2, checkpoint, resume=True)


class BuiltInConfigureModel(Regression):
    """Builds its network in ``configure_model``, as a model too large for one device would
    be: under PipelineStrategy on the meta device, so that each rank allocates its stage."""

    def __init__(self) -> None:
        super().__init__()
        del self.net

    def configure_model(self) -> None:
        if not hasattr(self, "net"):  # called again by every fit and validate
            self.net = mlp()
            self.built_on = next(self.net.parameters()).device.type


def on_the_meta_device(devices: int, checkpoint: Path, resume: bool = False) -> dict[str, Any]:
    """Train a ``BuiltInConfigureModel`` for an epoch on ``devices`` processes and save a
    checkpoint (with ``resume``, a second epoch from it instead); returns the losses and
    how many parameters this rank held."""
    module = BuiltInConfigureModel()
    record = Record()
    trainer = L.Trainer(
        strategy=PipelineStrategy(chunks=4, balance=[5, 3] if devices == 2 else None),
        accelerator="cpu",
        devices=devices,
        precision="64-true",
        max_epochs=2 if resume else 1,
        num_sanity_val_steps=0,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, *loaders(), ckpt_path=checkpoint if resume else None)
    if not resume:
        trainer.save_checkpoint(checkpoint)
    held = sum(p.numel() for p in module.parameters())
    return {
        "returned": record.returned,
        "validated": record.validated,
        "held": held,
        "built_on": module.built_on,
    }


def pipelined_on_the_meta_device(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    return on_the_meta_device(2, checkpoint), on_the_meta_device(2, checkpoint, resume=True)


class TwoNetworks(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Sequential(torch.nn.Identity())


class ParameterOutside(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))


class NoLoss(Regression):
    loss_fn = None  # type: ignore[assignment]


class Manual(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class DictBatches(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch["pair"], batch_idx)


class NetworkUncalled(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return sum(p.sum() for p in self.parameters())


def fit_on_one_process(module: L.LightningModule, *, batches: Any = None, **trainer: Any) -> None:
    """Fit ``module`` for a step with PipelineStrategy in this process (a pipeline of one
    stage)."""
    ckpt_path = trainer.pop("ckpt_path", None)
    L.Trainer(
        strategy=PipelineStrategy(chunks=2),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer,
    ).fit(module, batches if batches is not None else loaders()[0], ckpt_path=ckpt_path)
