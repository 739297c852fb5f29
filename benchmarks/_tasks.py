"""The tasks the risk-validation benchmarks train on (``risk_validation.py``, ``int8_mechanism.py``,
``momentum_risk_validation.py``, ``correction_risk_validation.py``): a model, a training loss of one batch
drawn from a generator, a held-out loss and the stress recipe's constant learning rate. The data ships with
the packages or is generated: scikit-learn's digits and the Python standard library's source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from _models import CharGPT
from torch import nn


@dataclass
class Task:
    name: str
    make_model: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, torch.Generator], torch.Tensor]  # training loss of one batch
    heldout: Callable[[nn.Module], float]
    lr: float


def digits_task() -> Task:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    xtr, ytr, xte, yte = x[order[:1400]], y[order[:1400]], x[order[1400:]], y[order[1400:]]

    def make() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(64, 128), nn.GELU()]
        for _ in range(6):
            layers += [nn.Linear(128, 128), nn.GELU()]
        layers.append(nn.Linear(128, 10))
        return nn.Sequential(*layers)

    def loss(model: nn.Module, step: int, gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, len(xtr), (32,), generator=gen)
        return nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])

    def heldout(model: nn.Module) -> float:
        with torch.no_grad():
            return nn.functional.cross_entropy(model(xte), yte).item()

    return Task("digits", make, loss, heldout, lr=3e-3)


def chargpt_task(n_layer: int = 4, n_embd: int = 128, eval_seqs: int = 64) -> Task:
    import argparse as a
    import configparser as cp
    import csv as c
    import difflib as d
    import inspect
    import json.decoder as j
    import string as s
    import textwrap as t

    text = "".join(inspect.getsource(m) for m in (a, j, t, s, c, d, cp))
    chars = sorted(set(text))
    lookup = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([lookup[ch] for ch in text], dtype=torch.int64)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    block = 64
    vgen = torch.Generator().manual_seed(1234)
    vstarts = torch.randint(len(val) - block - 1, (eval_seqs,), generator=vgen)
    vx = torch.stack([val[i : i + block] for i in vstarts])
    vy = torch.stack([val[i + 1 : i + 1 + block] for i in vstarts])

    def make() -> nn.Module:
        torch.manual_seed(0)
        return CharGPT(vocab_size=len(chars), block_size=block, n_layer=n_layer, n_head=4, n_embd=n_embd)

    def loss(model: nn.Module, step: int, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(len(train) - block - 1, (32,), generator=gen)
        x = torch.stack([train[i : i + block] for i in starts])
        y = torch.stack([train[i + 1 : i + 1 + block] for i in starts])
        return model(x, y)[1]

    def heldout(model: nn.Module) -> float:
        with torch.no_grad():
            return model(vx, vy)[1].item()

    return Task("chargpt", make, loss, heldout, lr=2e-3)


def ddpm_task(channels: int = 32, eval_pairs: int = 8, lr: float = 6e-3) -> Task:
    """A small DDPM on scikit-learn's digits: ``examples/workloads.py``'s ``TinyUNet`` (eps prediction,
    linear beta schedule over 1000 steps), batches of 64 with fresh ``(t, noise)`` draws. Held-out:
    the denoising MSE on the 397 validation images, each at ``eval_pairs`` fixed ``(t, noise)``
    draws, so evaluation noise is small next to the effects measured."""
    from _report import examples_on_path
    from sklearn.datasets import load_digits

    examples_on_path()
    from workloads import TinyUNet

    images = torch.tensor(load_digits().images, dtype=torch.float32)[:, None] / 16.0 * 2.0 - 1.0
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    xtr, xte = images[order[:1400]], images[order[1400:]]
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    abar = torch.cumprod(1.0 - betas, dim=0).float()
    vgen = torch.Generator().manual_seed(1234)
    vx = xte.repeat(eval_pairs, 1, 1, 1)
    vt = torch.randint(1000, (len(vx),), generator=vgen)
    vn = torch.randn(vx.shape, generator=vgen)

    def denoising(model: nn.Module, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        a = abar[t][:, None, None, None]
        return nn.functional.mse_loss(model(a.sqrt() * x0 + (1.0 - a).sqrt() * noise, t), noise)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return TinyUNet(channels)

    def loss(model: nn.Module, step: int, gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(len(xtr), (64,), generator=gen)
        t = torch.randint(1000, (64,), generator=gen)
        return denoising(model, xtr[idx], t, torch.randn((64, 1, 8, 8), generator=gen))

    def heldout(model: nn.Module) -> float:
        with torch.no_grad():
            return denoising(model, vx, vt, vn).item()

    return Task("ddpm", make, loss, heldout, lr=lr)
