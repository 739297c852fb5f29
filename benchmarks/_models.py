"""A small character-level GPT shared by the benchmarks (nanoGPT's layout, sized by arguments).

Token + position embedding, ``n_layer`` pre-norm transformer blocks (causal self-attention with
one ``qkv`` Linear and one ``proj`` Linear, an MLP of two Linears), a final LayerNorm and an untied
``lm_head``. The blocks live in the ``ModuleList`` ``h``, so ``partition(model, "layer")`` gives one
block per transformer block.

Example:
    >>> model = CharGPT(vocab_size=65, block_size=64, n_layer=6, n_head=4, n_embd=128)
    >>> model.num_parameters() > 1_000_000
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one ``qkv`` projection, one output ``proj``."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Two Linears with a GELU between, 4x wide."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharGPT(nn.Module):
    """A character GPT; ``forward(idx, targets)`` returns ``(logits, loss)`` (loss ``None`` without targets)."""

    def __init__(
        self, vocab_size: int = 65, block_size: int = 64, n_layer: int = 6, n_head: int = 4, n_embd: int = 128
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # GPT-2's initialization: N(0, 0.02) weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Number of parameters."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def char_corpus(min_chars: int = 200_000) -> tuple[Tensor, int]:
    """A deterministic character corpus from the Python standard library's own source code.

    No download: the text is the source of a few stdlib modules, repeated to ``min_chars``.
    Returns the encoded text (int64) and the vocabulary size.
    """
    import argparse
    import inspect
    import json
    import textwrap

    text = "".join(inspect.getsource(m) for m in (argparse, json.decoder, textwrap))
    while len(text) < min_chars:
        text += text
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    return torch.tensor([lookup[c] for c in text], dtype=torch.int64), len(chars)


def batches(data: Tensor, batch_size: int, block_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """One random batch ``(x, y)`` of ``batch_size`` windows of ``block_size`` characters."""
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + block_size] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts])
    return x, y
