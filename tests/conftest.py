"""Shared test fixtures: small models and scikit-learn's embedded digits data set."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def digits_tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits (1797 images, shipped with the package): train/test split, scaled."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def mlp(widths: tuple[int, ...] = (64, 256, 256, 10), seed: int = 0) -> nn.Sequential:
    """A plain MLP with LayerNorm, seeded."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers += [nn.LayerNorm(b), nn.GELU()]
    return nn.Sequential(*layers)


@pytest.fixture(scope="session")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return digits_tensors()
