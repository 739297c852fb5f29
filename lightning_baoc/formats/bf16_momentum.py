"""``bf16_momentum``: bf16 momentum with stochastic rounding, fp32 second moment (6 bytes/element)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_baoc.formats.base import Parity, Shape, StepHyper, TensorSpec, numel_of
from lightning_baoc.formats.elementwise import ElementwiseFormat, Fp32SecondMoment
from lightning_baoc.formats.kinds import M_BF16, V_FP32
from lightning_baoc.formats.quant import bf16_stochastic


class BF16Momentum(Fp32SecondMoment, ElementwiseFormat):
    """Momentum in bf16 (stochastically rounded), second moment in fp32. Bytes: ``6 * numel``."""

    name = "bf16_momentum"
    has_momentum = True
    summary = "m bf16 (stochastic rounding), v fp32"
    kernel_kinds = (M_BF16, V_FP32)
    # the reference: one momentum element on a bf16 rounding boundary after 50 steps rounds the other
    # way (measured 5.5e-5)
    parity = Parity(reference=6e-4)

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        n = numel_of(shape)
        # fp32 first: the pool packs tensors by descending item size, so no padding is needed.
        return (TensorSpec("exp_avg_sq", torch.float32, n), TensorSpec("exp_avg", torch.bfloat16, n))

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return views["exp_avg"][start:stop].to(torch.float32)

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        bf16_stochastic(m, views["exp_avg"][start:stop], hyper.noise_key, start, 0)
