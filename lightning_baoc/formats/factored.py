"""``factored``: no momentum, factored second moment (row and column fp32 vectors).

Bytes for a tensor viewed as ``(R, C)``: ``4 * (R + C)``, close to zero per element for large
matrices. 1-D tensors (and matrices with a side of 1) have no factored form and fall back to
``nomomentum`` (a dense fp32 v, as Adafactor keeps for vectors); the accounting reports the
fallback format.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_baoc.formats.base import (
    FACTORED_SUMS, Canonical, Parity, Shape, StateFormat, StepHyper, StepItem, TensorSpec, factor_view,
)
from lightning_baoc.formats.factored_math import factored_update
from lightning_baoc.formats.kinds import M_NONE, V_FACTORED


class Factored(StateFormat):
    """Adafactor-style factored v without momentum. Bytes: ``4 * (rows + cols)``."""

    name = "factored"
    has_momentum = False
    factored = True
    fallback = "nomomentum"
    summary = "no m, v factored into row + column (fp32)"
    kernel_kinds = (M_NONE, V_FACTORED)
    parity = Parity(compiled=FACTORED_SUMS, triton=FACTORED_SUMS)

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        dims = factor_view(shape)  # a shard's rows keep the whole parameter's format (formats.base.factor_view)
        if dims is None:
            raise ValueError(f"shape {tuple(shape)} has no factored form; use the fallback {self.fallback!r}")
        rows, cols = dims
        return (
            TensorSpec("exp_avg_sq_row", torch.float32, rows),
            TensorSpec("exp_avg_sq_col", torch.float32, cols),
        )

    def encode(self, state: Canonical, views: dict[str, Tensor], hyper: StepHyper) -> None:
        row, col = state.factored_v()
        views["exp_avg_sq_row"].copy_(row)
        views["exp_avg_sq_col"].copy_(col)

    def decode(self, views: dict[str, Tensor], shape: Shape) -> Canonical:
        return Canonical(
            tuple(shape), row=views["exp_avg_sq_row"].clone(), col=views["exp_avg_sq_col"].clone()
        )

    def update(self, items: list[StepItem], hyper: StepHyper) -> None:
        factored_update(items, hyper)
