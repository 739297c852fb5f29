"""Shared pieces of the Lightning tests (no tests here): a plain LightningModule on digits.

``DigitsModule`` is what a user writes, unchanged by BAOC: AdamW with two param groups (weight
decay on matrices only) and a cosine schedule as a per-step ``LambdaLR``. It records the loss of
every training batch and the learning rate of every step, so tests can compare runs.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from support import digits_tensors, mlp, one_thread  # noqa: F401  (re-exported)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_baoc import BlockwiseLion

# Lightning's informational noise in tests
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*litlogger.*")


class DigitsModule(L.LightningModule):
    """An MLP classifier on scikit-learn's digits: AdamW, two param groups, cosine LambdaLR.

    Args:
        widths: MLP layer widths.
        lr: peak learning rate.
        schedule: ``"cosine"`` (a per-step cosine ``LambdaLR``) or ``"none"``.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` (torch's, momentum 0.9), ``"lion"``
            (:class:`~lightning_baoc.BlockwiseLion`) or ``"adagrad"`` (unsupported by BAOC, for the
            error test).
        manual: manual optimization (one optimizer step per batch).
    """

    def __init__(
        self,
        widths: tuple[int, ...] = (64, 128, 128, 10),
        lr: float = 3e-3,
        schedule: str = "cosine",
        optimizer: str = "adamw",
        manual: bool = False,
    ) -> None:
        super().__init__()
        self.net = mlp(tuple(widths), seed=0)
        self.lr = lr
        self.schedule = schedule
        self.optimizer_name = optimizer
        self.automatic_optimization = not manual
        self.losses: dict[tuple[int, int], float] = {}
        self.lrs: dict[int, list[float]] = {}
        self.optimizer_checks: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses[(self.current_epoch, batch_idx)] = loss.item()
        self.log("train_loss", loss)
        opt = self.optimizers()
        # self.optimizers() must hand out the optimizer Lightning steps (BAOC's after the swap).
        self.optimizer_checks.append(opt.optimizer is self.trainer.strategy.optimizers[0])
        self.lrs.setdefault(self.global_step, [g["lr"] for g in opt.param_groups])
        if self.automatic_optimization:
            return loss
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), prog_bar=False)

    def configure_optimizers(self) -> Any:
        matrices = [p for p in self.parameters() if p.dim() > 1]
        vectors = [p for p in self.parameters() if p.dim() <= 1]
        groups = [{"params": matrices, "weight_decay": 0.05}, {"params": vectors, "weight_decay": 0.0}]
        if self.optimizer_name == "adagrad":
            return torch.optim.Adagrad(groups, lr=self.lr)
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        elif self.optimizer_name == "lion":
            opt = BlockwiseLion(groups, lr=self.lr)
        else:
            opt = (torch.optim.Adam if self.optimizer_name == "adam" else torch.optim.AdamW)(groups, lr=self.lr)
        if self.schedule == "none" or self._trainer is None:
            return opt
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        cosine = lambda step: 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))  # noqa: E731
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [cosine, cosine])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Crash(Callback):
    """Raises at the start of epoch ``at`` (after the checkpoint of the epoch before was saved)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.at:
            raise RuntimeError(f"simulated crash at epoch {self.at}")


def fit_crash_resume(
    root: Path, model: L.LightningModule, baoc: Callback, epochs: int, crash_at: int | None = None, ckpt_path: str | None = None,
    accelerator: str = "cpu",
) -> L.Trainer:
    """Fit ``model`` on 320 digits (accumulation 2, clipping 1.0), checkpointing every epoch under
    ``root / "ckpt"`` (``last.ckpt`` too); with ``crash_at`` the fit raises at the start of that epoch
    (the test expects it), with ``ckpt_path`` it resumes from there; on ``accelerator``."""
    import pytest
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_top_k=-1, every_n_epochs=1,
                                 save_on_train_epoch_end=True)
    callbacks: list[Callback] = [baoc, checkpoint] + ([Crash(crash_at)] if crash_at is not None else [])
    trainer = make_trainer(root, max_epochs=epochs, accumulate_grad_batches=2, gradient_clip_val=1.0,
                           callbacks=callbacks, enable_checkpointing=True, limit_val_batches=0, accelerator=accelerator)
    train, _ = loaders(n_train=320)
    if crash_at is not None:
        with pytest.raises(RuntimeError, match="simulated crash"):
            trainer.fit(model, train)
    else:
        trainer.fit(model, train, ckpt_path=ckpt_path)
    return trainer


def loaders(n_train: int = 640, batch_size: int = 32) -> tuple[DataLoader, DataLoader]:
    """Digits train (first ``n_train`` samples, in order) and test loaders."""
    xtr, ytr, xte, yte = digits_tensors()
    train = DataLoader(TensorDataset(xtr[:n_train], ytr[:n_train]), batch_size=batch_size, shuffle=False)
    val = DataLoader(TensorDataset(xte, yte), batch_size=400)
    return train, val


def make_trainer(root: Path | str, **kwargs: Any) -> L.Trainer:
    """A quiet, deterministic CPU Trainer writing under ``root``."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        default_root_dir=str(root),
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def val_loss(model: L.LightningModule) -> float:
    """Cross-entropy of ``model`` on the digits test split."""
    _, _, xte, yte = digits_tensors()
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(xte), yte))
