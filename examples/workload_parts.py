"""The parts the example workloads (``workloads.py``) are built from: the transformer blocks (nanoGPT's names),
the DDPM's tiny UNet, the data modules' common base and loaders, and the character corpus of the standard
library's own sources."""

from __future__ import annotations

import importlib.util
import math
import string
from pathlib import Path
from typing import ClassVar

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

# ------------------------------------------------------------------------- transformer building


class Attention(nn.Module):
    """Multi-head self-attention with one fused ``qkv`` Linear and an output ``proj``."""

    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"Invalid heads: dim={dim} must be divisible by heads={heads}")
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """``fc`` -> GELU -> ``proj``, ``ratio`` x wide."""

    def __init__(self, dim: int, ratio: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, ratio * dim)
        self.proj = nn.Linear(ratio * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block (nanoGPT's names: ``ln_1``, ``attn``, ``ln_2``, ``mlp``)."""

    def __init__(self, dim: int, heads: int, causal: bool, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_ratio)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _gpt_init(module: nn.Module) -> None:
    # GPT-2's initialization: N(0, 0.02) weights, zero biases.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _load_image_folder(data_dir: str | Path, image_size: int) -> tuple[Tensor, Tensor]:
    """Images ``data_dir/<class>/*`` as grayscale ``image_size`` squares in [0, 1], and labels."""
    from PIL import Image  # a dependency of matplotlib

    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"Invalid data_dir: {str(data_dir)!r} is not a directory; expected <dir>/<class>/*.png")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    xs, ys = [], []
    for label, cls in enumerate(classes):
        for path in sorted((root / cls).iterdir()):
            if path.suffix.lower() not in (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".pgm"):
                continue
            with Image.open(path) as img:
                img = img.convert("L").resize((image_size, image_size), Image.BILINEAR)
                xs.append(torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).float().view(image_size, image_size) / 255.0)
            ys.append(label)
    if not xs:
        raise FileNotFoundError(f"Invalid data_dir: no images under {str(data_dir)!r}; expected <dir>/<class>/*.png")
    return torch.stack(xs)[:, None], torch.tensor(ys)


class _SplitDataModule(L.LightningDataModule):
    """Base of the example data modules: a training set and a validation set, built once in ``setup``.

    Subclasses implement :meth:`build_sets` and set :attr:`val_batch_size`; the training loader
    shuffles from a generator seeded with ``seed`` and drops the last partial batch.

    Args:
        batch_size: Training batch size.
        seed: Seed of the training shuffle.
        data_dir: A real data set on disk instead of the embedded one, or None.
    """

    #: Batch size of the (unshuffled) validation loader.
    val_batch_size: ClassVar[int]

    def __init__(self, batch_size: int, seed: int, data_dir: str | None) -> None:
        super().__init__()
        self.batch_size, self.seed, self.data_dir = batch_size, seed, data_dir
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def build_sets(self) -> tuple[Dataset, Dataset]:
        """``(train_set, val_set)``; called once, by the first :meth:`setup`."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self.build_sets()

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=g, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size)


class _ResBlock(nn.Module):
    """GroupNorm -> SiLU -> conv, plus the time embedding, twice; 1x1 skip when widths differ."""

    def __init__(self, c_in: int, c_out: int, t_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(8, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.time = nn.Linear(t_dim, c_out)
        self.norm2 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: Tensor, t_emb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.time(t_emb)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class TinyUNet(nn.Module):
    """A two-level UNet for small images (side divisible by 2): eps prediction from ``(x_t, t)``."""

    def __init__(self, channels: int = 32, t_dim: int = 64) -> None:
        super().__init__()
        c = channels
        self.t_dim = t_dim
        self.time_mlp = nn.Sequential(nn.Linear(t_dim, 2 * t_dim), nn.SiLU(), nn.Linear(2 * t_dim, t_dim))
        self.inc = nn.Conv2d(1, c, 3, padding=1)
        self.down1 = _ResBlock(c, c, t_dim)
        self.downsample = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.down2 = _ResBlock(2 * c, 2 * c, t_dim)
        self.mid = _ResBlock(2 * c, 2 * c, t_dim)
        self.upsample = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.up1 = _ResBlock(2 * c, c, t_dim)
        self.out_norm = nn.GroupNorm(8, c)
        self.out = nn.Conv2d(c, 1, 3, padding=1)

    def time_embedding(self, t: Tensor) -> Tensor:
        """Sinusoidal embedding of integer timesteps, ``(B, t_dim)``."""
        half = self.t_dim // 2
        freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        return torch.cat([args.sin(), args.cos()], dim=1)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        emb = self.time_mlp(self.time_embedding(t).to(x.dtype))  # bf16 weights (bf16-true): bf16 embedding
        h1 = self.down1(self.inc(x), emb)
        h = self.mid(self.down2(self.downsample(h1), emb), emb)
        h = self.up1(torch.cat([self.upsample(h), h1], dim=1), emb)
        return self.out(F.silu(self.out_norm(h)))


#: Standard-library modules whose source is the embedded corpus, in order (the tail is held out).
STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "json.decoder", "json.encoder", "textwrap", "string", "csv", "difflib", "configparser",
    "inspect", "dataclasses", "enum", "functools", "typing", "pathlib", "logging", "subprocess",
    "tarfile", "zipfile", "pydoc", "http.client", "urllib.parse", "email.message", "calendar",
    "datetime", "fractions", "decimal", "statistics", "ast", "shutil", "tempfile",
)
VOCAB = string.printable  # 100 characters; anything else is mapped to '?'


def stdlib_text(max_chars: int = 1_000_000) -> str:
    """The source of :data:`STDLIB_MODULES` (whatever this Python ships), up to ``max_chars``.

    Read from the installed files, so every Python installation has it; the text (and so the
    numbers) differs a little between Python versions.
    """
    parts, total = [], 0
    for name in STDLIB_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        text = Path(spec.origin).read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def _read_corpus(data_dir: str | Path) -> str:
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"Invalid data_dir: {str(data_dir)!r} is not a directory of .txt/.py/.md files")
    files = sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".py", ".md") and p.is_file())
    if not files:
        raise FileNotFoundError(f"Invalid data_dir: no .txt/.py/.md files under {str(data_dir)!r}")
    return "".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def encode(text: str) -> Tensor:
    """Characters -> int64 indices into :data:`VOCAB` (unknown characters become '?')."""
    lookup = {c: i for i, c in enumerate(VOCAB)}
    unknown = lookup["?"]
    return torch.tensor([lookup.get(c, unknown) for c in text], dtype=torch.int64)


class _Windows(Dataset):
    """Windows ``(x, y)`` of ``block_size`` characters starting every ``stride`` characters."""

    def __init__(self, data: Tensor, block_size: int, stride: int, limit: int | None = None) -> None:
        self.data, self.block_size = data, block_size
        starts = torch.arange(0, len(data) - block_size - 1, stride)
        if limit is not None and len(starts) > limit:
            starts = starts[torch.linspace(0, len(starts) - 1, limit).long()]
        self.starts = starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        s = int(self.starts[i])
        chunk = self.data[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]
