"""``int8``: companded 8-bit momentum and second moment, groups of 32 (FlashOptim).

Bytes for ``n`` elements: ``n`` (int8 momentum codes) + ``n`` (uint8 sqrt-v codes) +
``2 * 2 * ceil(n / 32)`` (one 16-bit scale per group for each), i.e. ``2 + 4/32`` per element.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Shape, StepHyper, TensorSpec, numel_of
from .elementwise import ElementwiseFormat
from .quant import (
    GROUP,
    SCALE_DTYPE,
    dequantize_momentum,
    dequantize_sqrt,
    num_groups,
    quantize_momentum,
    quantize_sqrt,
)


def group_slice(start: int, stop: int) -> slice:
    """The scales covering elements ``[start, stop)`` (``start`` on a group boundary)."""
    return slice(start // GROUP, -(-stop // GROUP))


class Int8(ElementwiseFormat):
    """Companded int8 momentum + sqrt-companded uint8 second moment (bf16 scales per 32)."""

    name = "int8"
    has_momentum = True
    quantized = True
    fallback = "fp32"
    summary = "m int8 companded, v uint8 sqrt-companded, groups of 32"

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        n = numel_of(shape)
        g = num_groups(n)
        return (
            TensorSpec("exp_avg_scale", SCALE_DTYPE, g),
            TensorSpec("exp_avg_sq_scale", SCALE_DTYPE, g),
            TensorSpec("exp_avg", torch.int8, n),
            TensorSpec("exp_avg_sq", torch.uint8, n),
        )

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return dequantize_momentum(
            views["exp_avg"][start:stop], views["exp_avg_scale"][group_slice(start, stop)]
        )

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        quantize_momentum(
            m, views["exp_avg"][start:stop], views["exp_avg_scale"][group_slice(start, stop)]
        )

    def load_v(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return dequantize_sqrt(
            views["exp_avg_sq"][start:stop], views["exp_avg_sq_scale"][group_slice(start, stop)]
        )

    def store_v(self, v: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        quantize_sqrt(
            v, views["exp_avg_sq"][start:stop], views["exp_avg_sq_scale"][group_slice(start, stop)]
        )
