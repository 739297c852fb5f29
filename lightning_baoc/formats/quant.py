"""Quantization helpers shared by the formats: companded 8-bit groups, bf16 stochastic rounding.

Companding follows FlashOptim (arXiv 2602.23349, "Optimizer state quantization"), groups of 32
elements with one 16-bit absmax scale per group:

- momentum: ``x / absmax -> softsign y = 2x / (1 + |x|) -> int8 round(127 y)``; inverse
  ``y = q / 127, x = y / (2 - |y|)``. Softsign spends more codes near zero, where most momentum
  values sit.
- second moment: ``sqrt(v) / absmax -> uint8 round(255 .)``; inverse squares. The square root
  halves the dynamic range the 8 bits must cover.

Scales are stored as bfloat16 (2 bytes, as fp16 would be): fp16's smallest normal number is
6.1e-5 and ``sqrt(v)`` of a gradient of 1e-7 is 1e-7, so fp16 scales would flush whole groups of a
quiet layer to zero. The scale is rounded *up* so that every normalized value lies in [-1, 1], and
quantization normalizes by the stored scale, so encode and decode agree exactly on it.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32
SCALE_DTYPE = torch.bfloat16
# A bf16 scale rounded to nearest is within 2**-8 (relative) of the exact value; bumping by 2**-7
# first guarantees the stored scale is >= the absmax.
_SCALE_BUMP = 1.0 + 2.0**-7


def num_groups(numel: int) -> int:
    """Number of quantization groups (scales) for ``numel`` elements."""
    return -(-numel // GROUP)


def _per_group(x: Tensor, scales: Tensor) -> Tensor:
    """Multiply flat ``x`` in place by its group's scale; the tail group may be short."""
    n = x.numel()
    full = (n // GROUP) * GROUP
    if full:
        body = x[:full].view(-1, GROUP)
        s = scales[: full // GROUP].to(torch.float32).unsqueeze(1)
        body.mul_(s)
    if full < n:
        x[full:].mul_(scales[-1].to(torch.float32))
    return x


def group_absmax(x: Tensor) -> Tensor:
    """Absolute maximum of every group of 32 (the last group may be shorter)."""
    n = x.numel()
    full = (n // GROUP) * GROUP
    parts = []
    if full:
        parts.append(x[:full].view(-1, GROUP).abs().amax(dim=1))
    if full < n:
        parts.append(x[full:].abs().amax().reshape(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _store_scales(absmax: Tensor, scales_out: Tensor) -> Tensor:
    """Round the absmax up to bf16, store it, and return the fp32 reciprocal (0 for empty groups)."""
    scales_out.copy_(absmax * _SCALE_BUMP)
    stored = scales_out.to(torch.float32)
    return torch.where(stored > 0, stored.reciprocal(), torch.zeros_like(stored))


def quantize_momentum(x: Tensor, codes_out: Tensor, scales_out: Tensor) -> None:
    """Companded int8 quantization of a flat fp32 momentum chunk (``x`` is overwritten)."""
    inv = _store_scales(group_absmax(x), scales_out)
    _per_group(x, inv).clamp_(-1.0, 1.0)
    # softsign: y = 2x / (1 + |x|)
    y = x.abs().add_(1.0)
    torch.div(x, y, out=y).mul_(2.0 * 127.0).round_()
    codes_out.copy_(y)


def dequantize_momentum(codes: Tensor, scales: Tensor) -> Tensor:
    """Inverse of :func:`quantize_momentum`: a new flat fp32 tensor."""
    y = codes.to(torch.float32).div_(127.0)
    x = y.abs().neg_().add_(2.0)
    torch.div(y, x, out=x)
    return _per_group(x, scales)


def quantize_sqrt(v: Tensor, codes_out: Tensor, scales_out: Tensor) -> None:
    """sqrt-companded uint8 quantization of a flat fp32 second-moment chunk (``v`` is overwritten)."""
    s = v.clamp_(min=0.0).sqrt_()
    inv = _store_scales(group_absmax(s), scales_out)
    _per_group(s, inv).clamp_(0.0, 1.0).mul_(255.0).round_()
    codes_out.copy_(s)


def dequantize_sqrt(codes: Tensor, scales: Tensor) -> Tensor:
    """Inverse of :func:`quantize_sqrt`: a new flat fp32 tensor."""
    s = codes.to(torch.float32).div_(255.0)
    _per_group(s, scales)
    return s.mul_(s)


def bf16_stochastic(x: Tensor, out: Tensor, generator: torch.Generator | None) -> None:
    """Write fp32 ``x`` into bf16 ``out`` with stochastic rounding.

    Adding 16 random bits below the bf16 mantissa and truncating rounds up with probability equal
    to the discarded fraction, so the rounding is unbiased: ``E[round(x)] = x``. Round-to-nearest
    would freeze ``v * 0.999`` at ``v`` (DESIGN.md, "Why stochastic rounding").
    """
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    noise.add_(bits).bitwise_and_(-65536)
    out.copy_(noise.view(torch.float32))


def bf16_round_nearest(x: Tensor, out: Tensor, generator: torch.Generator | None = None) -> None:
    """Round-to-nearest bf16 store (the naive choice; kept to demonstrate stagnation in tests)."""
    out.copy_(x)
