"""``bf16``: both moments in bf16 with stochastic rounding (4 bytes per parameter element).

Stochastic rounding keeps the second moment decaying: with beta2 = 0.999, ``v * 0.999`` rounds
back to ``v`` under round-to-nearest bf16 (8 mantissa bits), so a nearest-rounded v would stop
tracking a shrinking gradient (tested in ``tests/formats/test_quantization.py``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from lightning_baoc.formats.base import Shape, StepHyper, TensorSpec, numel_of
from lightning_baoc.formats.elementwise import ElementwiseFormat
from lightning_baoc.formats.kinds import M_BF16, V_BF16
from lightning_baoc.formats.quant import bf16_stochastic, rounding_hash


class BF16(ElementwiseFormat):
    """Momentum and second moment in bf16, stochastically rounded. Bytes: ``4 * numel``."""

    name = "bf16"
    has_momentum = True
    summary = "m bf16, v bf16 (stochastic rounding)"
    kernel_kinds = (M_BF16, V_BF16)

    #: The rounding used to store (``(x, out, key, start, which, hashed)``); tests swap in round-to-nearest to show
    #: the stagnation it causes.
    rounding: Callable[..., None] = staticmethod(bf16_stochastic)

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        n = numel_of(shape)
        return (TensorSpec("exp_avg", torch.bfloat16, n), TensorSpec("exp_avg_sq", torch.bfloat16, n))

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return views["exp_avg"][start:stop].to(torch.float32)

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        self.rounding(m, views["exp_avg"][start:stop], hyper.noise_key, start, 0)

    def load_v(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return views["exp_avg_sq"][start:stop].to(torch.float32)

    def store_v(self, v: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        self.rounding(v, views["exp_avg_sq"][start:stop], hyper.noise_key, start, 1)

    def store(
        self, m: Tensor | None, v: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper
    ) -> None:
        """Both moments of a slice from one rounding hash: the momentum's noise is its top 16 bits, the second
        moment's its bottom 16 (:func:`~lightning_baoc.formats.quant.rounding_hash`), computed here once for
        this call instead of once per store."""
        hashed = rounding_hash(start, start + v.numel(), hyper.noise_key, v.device)
        if m is not None:
            self.rounding(m, views["exp_avg"][start:stop], hyper.noise_key, start, 0,
                          hashed if m.device == v.device and m.numel() == v.numel() else None)
        self.rounding(v, views["exp_avg_sq"][start:stop], hyper.noise_key, start, 1, hashed)
