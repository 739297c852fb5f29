"""``int8``: companded 8-bit momentum and second moment, groups of 32 (FlashOptim).

Bytes for ``n`` elements: ``n`` (int8 momentum codes) + ``n`` (uint8 sqrt-v codes) +
``2 * 2 * ceil(n / 32)`` (one fp16 scale per group for each) + ``2 * ceil(n / 1024)`` (one int8
exponent per super-block for each), i.e. ``2 + 4/32 + 2/1024`` (~2.127) per element.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_baoc.formats.base import Shape, StepHyper, TensorSpec, numel_of
from lightning_baoc.formats.elementwise import ElementwiseFormat
from lightning_baoc.formats.frames import quant_args, quant_specs, store_quantized
from lightning_baoc.formats.kinds import M_INT8, V_UINT8
from lightning_baoc.formats.quant import dequantize_momentum, dequantize_sqrt, quantize_momentum, quantize_sqrt


class Int8(ElementwiseFormat):
    """Companded int8 momentum + sqrt-companded uint8 second moment (fp16 scales per 32)."""

    name = "int8"
    has_momentum = True
    quantized = True
    fallback = "fp32"
    summary = "m int8 companded, v uint8 sqrt-companded, groups of 32"
    kernel_kinds = (M_INT8, V_UINT8)

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        n = numel_of(shape)
        return quant_specs("exp_avg", torch.int8, n) + quant_specs("exp_avg_sq", torch.uint8, n)

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return dequantize_momentum(*quant_args(views, "exp_avg", start, stop))

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        store_quantized(quantize_momentum, m, views, "exp_avg", start, stop)

    def load_v(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return dequantize_sqrt(*quant_args(views, "exp_avg_sq", start, stop))

    def store_v(self, v: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        store_quantized(quantize_sqrt, v, views, "exp_avg_sq", start, stop)
