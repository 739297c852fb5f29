"""``nomomentum``: no first moment, fp32 second moment (4 bytes per parameter element).

The update is ``g / (sqrt(v_hat) + eps)``: RMSprop with Adam's bias-corrected second moment.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .adam_math import foreach_dense_fp32
from .base import Canonical, Shape, StateFormat, StepHyper, StepItem, TensorSpec, numel_of


class NoMomentum(StateFormat):
    """Second moment in fp32, no momentum. Bytes: ``4 * numel``."""

    name = "nomomentum"
    has_momentum = False
    summary = "no m, v fp32"

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        return (TensorSpec("exp_avg_sq", torch.float32, numel_of(shape)),)

    def encode(self, state: Canonical, views: dict[str, Tensor], hyper: StepHyper) -> None:
        views["exp_avg_sq"].copy_(state.dense_v().reshape(-1))

    def decode(self, views: dict[str, Tensor], shape: Shape) -> Canonical:
        return Canonical(
            tuple(shape), exp_avg_sq=views["exp_avg_sq"].clone().view(tuple(shape))
        )

    def update(self, items: list[StepItem], hyper: StepHyper) -> None:
        foreach_dense_fp32(items, hyper, None, "exp_avg_sq")
