"""``nomomentum``: no first moment, fp32 second moment (4 bytes per parameter element).

The update is ``g / (sqrt(v_hat) + eps)``: RMSprop with Adam's bias-corrected second moment.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_baoc.formats.base import Shape, StepHyper, TensorSpec, numel_of
from lightning_baoc.formats.elementwise import ElementwiseFormat, Fp32SecondMoment
from lightning_baoc.formats.kinds import M_NONE, V_FP32


class NoMomentum(Fp32SecondMoment, ElementwiseFormat):
    """Second moment in fp32, no momentum. Bytes: ``4 * numel``."""

    name = "nomomentum"
    has_momentum = False
    summary = "no m, v fp32"
    kernel_kinds = (M_NONE, V_FP32)

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        return (TensorSpec("exp_avg_sq", torch.float32, numel_of(shape)),)

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        raise NotImplementedError("nomomentum holds no momentum")

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        raise NotImplementedError("nomomentum holds no momentum")
