"""``nomomentum_int8``: no momentum, sqrt-companded uint8 second moment (``1 + 2/32 + 1/1024`` bytes/element).

Hazard (measured on a character GPT): a uint8 v rounds entries below ~1/510 of their
group's maximum square root to zero, and without momentum the raw gradient is then divided by
``eps``. The risk model must see this; the format does not hide it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_baoc.formats.base import Shape, StepHyper, TensorSpec, numel_of
from lightning_baoc.formats.elementwise import ElementwiseFormat
from lightning_baoc.formats.frames import quant_args, quant_specs, store_quantized
from lightning_baoc.formats.kinds import M_NONE, V_UINT8
from lightning_baoc.formats.quant import dequantize_sqrt, quantize_sqrt


class NoMomentumInt8(ElementwiseFormat):
    """No momentum; second moment as uint8 sqrt-companded codes with fp16 scales per 32."""

    name = "nomomentum_int8"
    has_momentum = False
    quantized = True
    fallback = "nomomentum"
    summary = "no m, v uint8 sqrt-companded, groups of 32"
    kernel_kinds = (M_NONE, V_UINT8)

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        n = numel_of(shape)
        return quant_specs("exp_avg_sq", torch.uint8, n)

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        raise NotImplementedError("nomomentum_int8 holds no momentum")

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        raise NotImplementedError("nomomentum_int8 holds no momentum")

    def load_v(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return dequantize_sqrt(*quant_args(views, "exp_avg_sq", start, stop))

    def store_v(self, v: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        store_quantized(quantize_sqrt, v, views, "exp_avg_sq", start, stop)
