"""Three example workloads: LightningModules and data modules on data every machine has.

Shared by the example scripts (``vit_digits.py``, ``char_gpt.py``, ``ddpm_digits.py``), the tests
and ``benchmarks/quality.py``. Every module is an ordinary user module: ``configure_optimizers``
returns a plain ``torch.optim.AdamW`` with two param groups (decay / no decay) and a per-step
``LambdaLR``, which is what the ``BAOC`` callback expects to find and replace.

| name          | model                                     | data (embedded, no download)              | quality metric          |
|---------------|-------------------------------------------|-------------------------------------------|-------------------------|
| `vit_digits`  | ViT, patch 2, 3 blocks of width 64 (~150k) | scikit-learn's 8x8 digits, 1400 / 397     | accuracy (`val_acc`)    |
| `char_gpt`    | character GPT, 4 blocks of width 128 (~0.8M) | the standard library's own ``.py`` sources | perplexity (`val_ppl`) |
| `ddpm_digits` | DDPM, a tiny conv UNet (~0.25M)            | scikit-learn's 8x8 digits                  | held-out denoising loss (`val_denoise`) |

Two recipes per workload (:data:`RECIPES`): ``"realistic"`` (AdamW, linear warm-up, cosine decay
to a tenth of the peak) and ``"stress"`` (a constant, higher learning rate, no warm-up), where
cheaper optimizer states show their cost first.

Each data module takes ``data_dir`` for a real data set on disk instead of the embedded one (never
downloaded): an image folder ``data_dir/<class>/*.png`` for the digits workloads (grayscale,
resized to ``image_size``), a directory of ``.txt`` / ``.py`` / ``.md`` files for the GPT.

Example:
    >>> module, data = build("vit_digits", recipe="realistic", max_steps=300, seed=0)
    >>> trainer = L.Trainer(max_steps=300, accelerator="cpu", logger=False)   # doctest: +SKIP
    >>> trainer.fit(module, data)                                              # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity
from workload_parts import (
    VOCAB,
    Block,
    TinyUNet,
    _gpt_init,
    _load_image_folder,
    _read_corpus,
    _SplitDataModule,
    _Windows,
    encode,
    stdlib_text,
)

__all__ = [
    "RECIPES",
    "WORKLOADS",
    "Recipe",
    "Workload",
    "ViTDigits",
    "CharGPT",
    "DDPMDigits",
    "DigitsDataModule",
    "CharDataModule",
    "build",
    "stdlib_text",
]

SPLIT_SEED = 0  # the train / validation split is the same for every run seed


# --------------------------------------------------------------------------------------- recipes


@dataclass(frozen=True)
class Recipe:
    """An AdamW recipe: peak learning rate, schedule and hyperparameters.

    Attributes:
        lr: Peak learning rate.
        schedule: ``"cosine"`` (decay to ``min_lr_ratio * lr`` at ``max_steps``) or ``"constant"``.
        warmup_fraction: Fraction of ``max_steps`` of linear warm-up from ~0 (0: none).
        min_lr_ratio: Final learning rate of the cosine schedule, as a fraction of ``lr``.
        weight_decay: Decoupled weight decay of the decay group (the other group gets 0).
        betas: AdamW's ``(beta1, beta2)``.
        eps: AdamW's epsilon.
    """

    lr: float
    schedule: str = "cosine"
    warmup_fraction: float = 0.1
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"Invalid schedule: {self.schedule!r}; expected 'cosine' or 'constant'")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"Invalid lr: {self.lr!r}; expected a finite number > 0")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"Invalid warmup_fraction: {self.warmup_fraction!r}; expected 0 <= x < 1")

    def lr_factor(self, step: int, max_steps: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based) of ``max_steps``."""
        warmup = int(self.warmup_fraction * max_steps)
        if step < warmup:
            return (step + 1) / warmup
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


#: Recipes per workload. The GPT's realistic recipe is nanoGPT's character recipe (beta2 0.99);
#: the stress recipes are constant learning rates 3-5x the realistic peaks, without warm-up,
#: still stable for fp32 AdamW on these models (checked by ``benchmarks/quality.py``'s fp32 row).
RECIPES: dict[str, dict[str, Recipe]] = {
    "vit_digits": {
        "realistic": Recipe(lr=2e-3, weight_decay=0.05),
        "stress": Recipe(lr=6e-3, schedule="constant", warmup_fraction=0.0, weight_decay=0.05),
    },
    "char_gpt": {
        "realistic": Recipe(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99)),
        "stress": Recipe(lr=3e-3, schedule="constant", warmup_fraction=0.0, weight_decay=0.1, betas=(0.9, 0.99)),
    },
    "ddpm_digits": {
        "realistic": Recipe(lr=2e-3, weight_decay=0.01),
        "stress": Recipe(lr=6e-3, schedule="constant", warmup_fraction=0.0, weight_decay=0.01),
    },
}


# ---------------------------------------------------------------------------------- base module


class Workload(L.LightningModule):
    """Base of the example modules: the recipe, the two param groups and ``configure_optimizers``.

    Subclasses set the class attributes and implement ``training_step`` / ``validation_step``.

    Args:
        recipe: ``"realistic"`` or ``"stress"`` (see :data:`RECIPES`) (default: ``"realistic"``).
        max_steps: Optimizer steps of the run; the schedule's length (default: 1000).
        lr: Overrides the recipe's peak learning rate (default: None, the recipe's).
    """

    name: ClassVar[str]
    #: Key of the quality metric in ``trainer.callback_metrics``.
    quality_metric: ClassVar[str]
    #: Human name of the quality metric.
    quality_label: ClassVar[str]
    higher_is_better: ClassVar[bool]
    #: Parameter names (substrings) that never get weight decay besides 1-D tensors.
    no_decay_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, recipe: str = "realistic", max_steps: int = 1000, lr: float | None = None) -> None:
        super().__init__()
        if recipe not in RECIPES[self.name]:
            raise ValueError(f"Invalid recipe: {recipe!r}; expected one of {sorted(RECIPES[self.name])}")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"Invalid max_steps: {max_steps!r}; expected an int >= 1")
        self.recipe_name = recipe
        self.recipe = RECIPES[self.name][recipe] if lr is None else replace(RECIPES[self.name][recipe], lr=lr)
        self.max_steps = max_steps

    def num_parameters(self) -> int:
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def param_groups(self) -> list[dict[str, Any]]:
        """Two AdamW param groups: matrices with ``weight_decay``; vectors, norms, tokens without."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if p.ndim < 2 or any(s in name for s in self.no_decay_names):
                no_decay.append(p)
            else:
                decay.append(p)
        return [
            {"params": decay, "weight_decay": self.recipe.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def lr_lambda(self, step: int) -> float:
        """The schedule for ``LambdaLR``: a multiplier of the peak learning rate."""
        return self.recipe.lr_factor(step, self.max_steps)

    def configure_optimizers(self) -> dict[str, Any]:
        """A plain ``torch.optim.AdamW`` (decay / no-decay groups) and the recipe's per-step schedule."""
        r = self.recipe
        opt = torch.optim.AdamW(self.param_groups(), lr=r.lr, betas=r.betas, eps=r.eps, weight_decay=r.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# --------------------------------------------------------------------------------------- digits


class DigitsDataModule(_SplitDataModule):
    """scikit-learn's 8x8 digits (1797 images, shipped with the package): 1400 train / 397 validation.

    Images are ``(1, image_size, image_size)`` in [0, 1] (upsampled bilinearly when ``image_size``
    is not 8). With ``denoise_pairs > 0`` the validation set is, for the DDPM, every validation
    image with ``denoise_pairs`` fixed ``(t, noise)`` draws (from a generator seeded with
    ``SPLIT_SEED``), so every run is scored on the same noise.

    Args:
        batch_size: Training batch size (default: 64).
        seed: Seed of the training shuffle (default: 0).
        image_size: Side of the images (default: 8).
        data_dir: An image folder ``<dir>/<class>/*.png`` instead of the digits (default: None).
        denoise_pairs: Fixed ``(t, noise)`` draws per validation image, for the DDPM (default: 0).
        timesteps: Diffusion timesteps the draws of ``t`` come from (default: 1000).
    """

    val_batch_size = 512

    def __init__(
        self,
        batch_size: int = 64,
        seed: int = 0,
        image_size: int = 8,
        data_dir: str | None = None,
        denoise_pairs: int = 0,
        timesteps: int = 1000,
    ) -> None:
        super().__init__(batch_size, seed, data_dir)
        self.image_size, self.denoise_pairs, self.timesteps = image_size, denoise_pairs, timesteps

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(x_train, y_train, x_val, y_val)``, images ``(N, 1, S, S)`` in [0, 1]."""
        if self.data_dir is not None:
            x, y = _load_image_folder(self.data_dir, self.image_size)
            n_train = int(0.8 * len(x))
        else:
            from sklearn.datasets import load_digits

            data = load_digits()
            x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
            y = torch.tensor(data.target, dtype=torch.long)
            if self.image_size != 8:
                x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
            n_train = 1400
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
        x, y = x[order], y[order]
        return x[:n_train], y[:n_train], x[n_train:], y[n_train:]

    def build_sets(self) -> tuple[Dataset, Dataset]:
        """Training ``(x, y)``; validation ``(x, y)``, or ``(x0, t, noise)`` with ``denoise_pairs``."""
        x_train, y_train, x_val, y_val = self.tensors()
        train_set = TensorDataset(x_train, y_train)
        if not self.denoise_pairs:
            return train_set, TensorDataset(x_val, y_val)
        g = torch.Generator().manual_seed(SPLIT_SEED)
        x0 = x_val.repeat_interleave(self.denoise_pairs, dim=0)
        t = torch.randint(self.timesteps, (len(x0),), generator=g)
        noise = torch.randn(x0.shape, generator=g)
        return train_set, TensorDataset(x0, t, noise)


class ViTDigits(Workload):
    """A small Vision Transformer classifying digits: patches -> ``Linear`` -> [cls] + positions -> blocks.

    Args:
        recipe: See :class:`Workload`.
        max_steps: See :class:`Workload`.
        lr: See :class:`Workload`.
        image_size: Side of the input images (default: 8).
        patch_size: Side of a patch; must divide ``image_size`` (default: 2, so 16 patches).
        dim: Width (default: 64).
        depth: Transformer blocks (default: 3).
        heads: Attention heads (default: 4).
        num_classes: Classes (default: 10).
    """

    name = "vit_digits"
    quality_metric = "val_acc"
    quality_label = "accuracy"
    higher_is_better = True
    no_decay_names = ("cls_token", "pos_embed")

    def __init__(
        self,
        recipe: str = "realistic",
        max_steps: int = 1000,
        lr: float | None = None,
        image_size: int = 8,
        patch_size: int = 2,
        dim: int = 64,
        depth: int = 3,
        heads: int = 4,
        num_classes: int = 10,
    ) -> None:
        super().__init__(recipe, max_steps, lr)
        if image_size % patch_size:
            raise ValueError(f"Invalid patch_size: {patch_size} must divide image_size={image_size}")
        self.save_hyperparameters()
        self.patch_size = patch_size
        n_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Linear(patch_size * patch_size, dim)
        # 2-D (tokens x dim), as an embedding table: optimizers that treat embeddings row-wise
        # (Adam-mini) expect that shape.
        self.cls_token = nn.Parameter(torch.zeros(1, dim))
        self.pos_embed = nn.Parameter(torch.randn(n_patches + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, causal=False) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_loss = MeanMetric()

    def forward(self, images: Tensor) -> Tensor:
        """Logits ``(B, num_classes)`` of images ``(B, 1, S, S)``."""
        b, c, h, w = images.shape
        p = self.patch_size
        # (B, C, H, W) -> (B, N, C*p*p) by reshapes (F.unfold's im2col is very slow on some CPU builds).
        patches = images.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        x = self.patch_embed(patches)
        x = torch.cat([self.cls_token.expand(len(x), 1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_loss.update(F.cross_entropy(logits, y), weight=len(y))
        self.val_acc.update(logits, y)
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)


# ------------------------------------------------------------------------------------------ DDPM


class DDPMDigits(Workload):
    """A small DDPM (Ho et al. 2020) on digits: linear beta schedule, eps prediction, MSE loss.

    Images are scaled to [-1, 1]. The quality metric ``val_denoise`` is the eps-prediction MSE on
    the validation images at fixed ``(t, noise)`` draws (:class:`DigitsDataModule` with
    ``denoise_pairs``), so it is comparable across runs and seeds.

    Args:
        recipe: See :class:`Workload`.
        max_steps: See :class:`Workload`.
        lr: See :class:`Workload`.
        channels: Width of the UNet's first level (default: 32).
        timesteps: Diffusion steps T (default: 1000).
        beta_start: First beta of the linear schedule (default: 1e-4).
        beta_end: Last beta of the linear schedule (default: 0.02).
    """

    name = "ddpm_digits"
    quality_metric = "val_denoise"
    quality_label = "denoising loss"
    higher_is_better = False

    def __init__(
        self,
        recipe: str = "realistic",
        max_steps: int = 1000,
        lr: float | None = None,
        channels: int = 32,
        timesteps: int = 1000,
        beta_start: float = 1e-4,
        beta_end: float = 0.02,
    ) -> None:
        super().__init__(recipe, max_steps, lr)
        self.save_hyperparameters()
        self.net = TinyUNet(channels)
        self.timesteps = timesteps
        betas = torch.linspace(beta_start, beta_end, timesteps, dtype=torch.float64)
        alphas_bar = torch.cumprod(1.0 - betas, dim=0)
        self.register_buffer("betas", betas.float(), persistent=False)
        self.register_buffer("alphas_bar", alphas_bar.float(), persistent=False)
        self.val_denoise = MeanMetric()

    def noisy(self, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """``x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise``."""
        abar = self.alphas_bar[t][:, None, None, None]
        return abar.sqrt() * x0 + (1.0 - abar).sqrt() * noise

    def denoising_loss(self, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """Mean squared error of the predicted noise (``x0`` in [0, 1])."""
        x0 = 2.0 * x0 - 1.0
        return F.mse_loss(self.net(self.noisy(x0, t, noise), t), noise)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x0 = batch[0]
        t = torch.randint(self.timesteps, (len(x0),), device=x0.device)
        loss = self.denoising_loss(x0, t, torch.randn_like(x0))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        x0, t, noise = batch
        self.val_denoise.update(self.denoising_loss(x0, t, noise), weight=len(x0))
        self.log("val_denoise", self.val_denoise, prog_bar=True)

    @torch.no_grad()
    def sample(self, n: int, image_size: int = 8, generator: torch.Generator | None = None) -> Tensor:
        """``n`` images in [0, 1] by ancestral sampling over all timesteps."""
        x = torch.randn(n, 1, image_size, image_size, generator=generator)
        alphas = 1.0 - self.betas
        for i in reversed(range(self.timesteps)):
            t = torch.full((n,), i, dtype=torch.long)
            eps = self.net(x, t)
            x = (x - self.betas[i] / (1.0 - self.alphas_bar[i]).sqrt() * eps) / alphas[i].sqrt()
            if i > 0:
                x = x + self.betas[i].sqrt() * torch.randn(x.shape, generator=generator)
        return ((x.clamp(-1, 1) + 1) / 2).cpu()


# ----------------------------------------------------------------------------------- character


class CharDataModule(_SplitDataModule):
    """Characters of the standard library's source (or ``data_dir``): first 90% train, last 10% validation.

    Args:
        block_size: Context length (default: 64).
        batch_size: Training batch size (default: 16).
        seed: Seed of the training shuffle (default: 0).
        data_dir: A directory of ``.txt`` / ``.py`` / ``.md`` files instead (default: None).
        max_chars: Characters of the embedded corpus (default: 1,000,000).
        val_windows: Evenly spaced validation windows (default: 128).
    """

    val_batch_size = 64

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 16,
        seed: int = 0,
        data_dir: str | None = None,
        max_chars: int = 1_000_000,
        val_windows: int = 128,
    ) -> None:
        super().__init__(batch_size, seed, data_dir)
        self.block_size, self.max_chars, self.val_windows = block_size, max_chars, val_windows

    def build_sets(self) -> tuple[Dataset, Dataset]:
        """Non-overlapping windows of the first 90%; ``val_windows`` evenly spaced ones of the rest."""
        text = stdlib_text(self.max_chars) if self.data_dir is None else _read_corpus(self.data_dir)
        data = encode(text)
        split = int(0.9 * len(data))
        if len(data) - split < self.block_size + 2:
            raise ValueError(f"Corpus too small: {len(data)} characters for block_size={self.block_size}")
        train_set = _Windows(data[:split], self.block_size, self.block_size)
        return train_set, _Windows(data[split:], self.block_size, self.block_size, limit=self.val_windows)


class CharGPT(Workload):
    """A character-level GPT (nanoGPT's layout; names match ``benchmarks/_models.py``).

    Args:
        recipe: See :class:`Workload`.
        max_steps: See :class:`Workload`.
        lr: See :class:`Workload`.
        vocab_size: Vocabulary (default: 100, ``string.printable``).
        block_size: Context length (default: 64).
        n_layer: Transformer blocks (default: 4).
        n_head: Attention heads (default: 4).
        n_embd: Width (default: 128; about 0.8M parameters in all).
    """

    name = "char_gpt"
    quality_metric = "val_ppl"
    quality_label = "perplexity"
    higher_is_better = False

    def __init__(
        self,
        recipe: str = "realistic",
        max_steps: int = 1000,
        lr: float | None = None,
        vocab_size: int = len(VOCAB),
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
    ) -> None:
        super().__init__(recipe, max_steps, lr)
        self.save_hyperparameters()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, causal=True) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(_gpt_init)
        self.val_ppl = Perplexity()
        self.val_loss = MeanMetric()

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(B, T, vocab_size)`` of indices ``(B, T)``."""
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"Invalid input: sequence length {t} exceeds block_size={self.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_loss.update(F.cross_entropy(logits.flatten(0, 1), y.flatten()), weight=y.numel())
        self.val_ppl.update(logits, y)
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)


# ---------------------------------------------------------------------------------------- build

WORKLOADS: dict[str, type[Workload]] = {"vit_digits": ViTDigits, "char_gpt": CharGPT, "ddpm_digits": DDPMDigits}


def build(
    name: str,
    recipe: str = "realistic",
    max_steps: int = 1000,
    seed: int = 0,
    data_dir: str | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
) -> tuple[Workload, L.LightningDataModule]:
    """The module (initialized from ``seed``) and data module of workload ``name``.

    Args:
        name: ``"vit_digits"``, ``"char_gpt"`` or ``"ddpm_digits"``.
        recipe: ``"realistic"`` or ``"stress"`` (default: ``"realistic"``).
        max_steps: Optimizer steps of the run (the schedule's length) (default: 1000).
        seed: Seeds the initialization, the shuffle and the training noise (default: 0).
        data_dir: A real data set on disk instead of the embedded one (default: None).
        lr: Overrides the recipe's peak learning rate (default: None).
        batch_size: Overrides the training batch size (default: None: 64 images, 16 windows).

    Returns:
        ``(module, datamodule)``.
    """
    if name not in WORKLOADS:
        raise ValueError(f"Invalid workload: {name!r}; expected one of {sorted(WORKLOADS)}")
    L.seed_everything(seed, verbose=False)
    if name == "vit_digits":
        data: L.LightningDataModule = DigitsDataModule(batch_size or 64, seed, data_dir=data_dir)
        module: Workload = ViTDigits(recipe, max_steps, lr)
    elif name == "char_gpt":
        data = CharDataModule(batch_size=batch_size or 16, seed=seed, data_dir=data_dir)
        module = CharGPT(recipe, max_steps, lr)
    else:
        module = DDPMDigits(recipe, max_steps, lr)
        data = DigitsDataModule(batch_size or 64, seed, data_dir=data_dir, denoise_pairs=4, timesteps=module.timesteps)
    return module, data
