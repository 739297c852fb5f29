"""Built-in models for planning, built on the ``meta`` device (shapes only): a LLaMA-7B-shaped
decoder, a ViT-B/16 and a tiny decoder for tests (:data:`PRESETS`), or any
``package.module:factory`` (:func:`build_model`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DecoderConfig:
    """A LLaMA-style decoder: RMSNorm, bias-free projections, SwiGLU MLP, untied head."""

    vocab: int = 32000
    dim: int = 4096
    layers: int = 32
    heads: int = 32
    mlp: int = 11008


class DecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP (module names as in LLaMA checkpoints)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.input_layernorm = nn.RMSNorm(cfg.dim)
        self.self_attn = nn.ModuleDict(
            {name: nn.Linear(cfg.dim, cfg.dim, bias=False) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        )
        self.post_attention_layernorm = nn.RMSNorm(cfg.dim)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(cfg.dim, cfg.mlp, bias=False),
                "up_proj": nn.Linear(cfg.dim, cfg.mlp, bias=False),
                "down_proj": nn.Linear(cfg.mlp, cfg.dim, bias=False),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.input_layernorm(x)
        q, k, v = (self.self_attn[n](h).view(b, t, self.heads, -1).transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.self_attn["o_proj"](a)
        h = self.post_attention_layernorm(x)
        return x + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](h)) * self.mlp["up_proj"](h))


class Decoder(nn.Module):
    """A LLaMA-shaped causal language model (no rotary embedding: the planner needs shapes)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class ViTBlock(nn.Module):
    """Pre-norm transformer encoder block (timm's names: norm1, attn.qkv, attn.proj, mlp.fc1/fc2)."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(dim, 3 * dim), "proj": nn.Linear(dim, dim)})
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(dim, hidden), "fc2": nn.Linear(hidden, dim)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn["qkv"](self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn["proj"](a)
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.norm2(x))))


class ViT(nn.Module):
    """ViT-B/16 shapes by default: 224x224 images, 16x16 patches, 12 x 768, 1000 classes (86.6M)."""

    def __init__(self, image: int = 224, patch: int = 16, dim: int = 768, depth: int = 12, heads: int = 12,
                 hidden: int = 3072, classes: int = 1000) -> None:
        super().__init__()
        tokens = (image // patch) ** 2 + 1
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, dim))
        self.blocks = nn.ModuleList(ViTBlock(dim, heads, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


#: name -> (factory, one-line description). Factories build on the current default device.
PRESETS: Mapping[str, tuple[Callable[[], nn.Module], str]] = {
    "llama-7b": (lambda: Decoder(DecoderConfig()), "LLaMA-7B-shaped decoder: 32 x 4096, MLP 11008, vocab 32000 (6.74B)"),
    "vit-b16": (lambda: ViT(), "ViT-B/16: 224px, 12 x 768, MLP 3072, 1000 classes (86.6M)"),
    "tiny": (
        lambda: Decoder(DecoderConfig(vocab=512, dim=64, layers=2, heads=4, mlp=176)),
        "tiny decoder for tests: 2 x 64, MLP 176, vocab 512",
    ),
}


def build_model(spec: str, device: str | torch.device = "meta") -> nn.Module:
    """Build a preset or ``package.module:factory`` (called with no arguments) on ``device``.

    Example:
        >>> sum(p.numel() for p in build_model("llama-7b").parameters())
        6738415616
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model must be a preset {sorted(PRESETS)} or 'package.module:factory', got {spec!r}")
    if spec in PRESETS:
        factory = PRESETS[spec][0]
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(
                f"cannot import {module_name!r} from model={spec!r}: {err}; put its directory on PYTHONPATH "
                f"(PYTHONPATH=examples for the examples' models)"
            ) from None
        factory = module
        for part in attr.split("."):
            if not hasattr(factory, part):
                raise ValueError(f"{module_name!r} has no attribute {attr!r} (model={spec!r})")
            factory = getattr(factory, part)
        if not callable(factory):
            raise ValueError(f"model={spec!r} names {type(factory).__name__}, not a callable factory")
    else:
        raise ValueError(
            f"Unknown model {spec!r}; allowed: a preset {sorted(PRESETS)} or 'package.module:factory'"
        )
    with torch.device(device):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={spec!r} built {type(model).__name__}, expected a torch.nn.Module")
    return model


__all__ = ["PRESETS", "Decoder", "DecoderConfig", "DecoderLayer", "ViT", "ViTBlock", "build_model"]
