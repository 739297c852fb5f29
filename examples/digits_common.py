"""What the digits examples share: scikit-learn's embedded 8x8 digits and an MLP LightningModule.

``examples/digits_baoc.py`` (the BAOC callback over a plain AdamW) and
``examples/digits_blockwise.py`` (``BlockwiseAdamW`` with formats chosen by hand) differ only in
their optimizer, their depth and how they evaluate; the data, the network and the training step
live here once. Each example subclasses :class:`DigitsMLP` with its own ``configure_optimizers``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


def digits_loaders(batch_size: int = 64, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """scikit-learn's digits, split 1400 / 397, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    train = TensorDataset(x[:1400], y[:1400])
    test = TensorDataset(x[1400:], y[1400:])
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(test, batch_size=512)


def mlp(hidden_layers: int, width: int = 256, inputs: int = 64, classes: int = 10) -> nn.Sequential:
    """``hidden_layers`` x (Linear, LayerNorm, GELU), then a Linear head.

    Modules are numbered as in one flat ``nn.Sequential``: the Linear layers are ``0, 3, 6, ...``,
    the block names the examples' formats refer to (``net.0``, ``net.3``, ...).
    """
    layers: list[nn.Module] = []
    features = inputs
    for _ in range(hidden_layers):
        layers += [nn.Linear(features, width), nn.LayerNorm(width), nn.GELU()]
        features = width
    layers.append(nn.Linear(features, classes))
    return nn.Sequential(*layers)


class DigitsMLP(L.LightningModule):
    """An MLP classifier on digits; subclasses choose the optimizer (``configure_optimizers``).

    Args:
        hidden_layers: (Linear, LayerNorm, GELU) layers of width 256 before the head.
        lr: the learning rate (default: 2e-3).
        max_steps: the cosine schedule's length in optimizer steps (default: 500).
    """

    def __init__(self, hidden_layers: int, lr: float = 2e-3, max_steps: int = 500) -> None:
        super().__init__()
        self.net = mlp(hidden_layers)
        self.lr, self.max_steps = lr, max_steps

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def evaluate(self, batch: tuple[Tensor, Tensor], stage: str, prog_bar: bool = False) -> None:
        """Log ``{stage}_loss`` and ``{stage}_acc`` of one batch (for validation or test steps)."""
        x, y = batch
        logits = self.net(x)
        self.log(f"{stage}_loss", nn.functional.cross_entropy(logits, y), prog_bar=prog_bar)
        self.log(f"{stage}_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=prog_bar)

    def with_cosine_schedule(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``configure_optimizers``'s return value: ``optimizer`` with a per-step cosine schedule."""
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
