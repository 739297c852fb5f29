"""``fp32``: AdamW's reference format, both moments in fp32 (8 bytes per parameter element)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_baoc.formats.base import (
    FP32_ULPS, FUSED_TENSOR_LR, Canonical, Parity, Shape, StateFormat, StepHyper, StepItem, TensorSpec, numel_of,
)
from lightning_baoc.formats.fused_adam import fused_dense_fp32
from lightning_baoc.formats.kinds import M_FP32, V_FP32


class FP32(StateFormat):
    """Momentum and second moment in fp32. The eager step runs torch's fused AdamW kernel like
    ``torch.optim.AdamW(fused=True)`` (the foreach step where the kernel cannot serve a parameter:
    :mod:`lightning_baoc.formats.fused_adam`); the compiled CPU step runs its own loop in
    :func:`~lightning_baoc.formats.adam_math.chunk_adamw`'s order, within an ulp of it per step.

    Bytes: ``8 * numel``.
    """

    name = "fp32"
    has_momentum = True
    summary = "m fp32, v fp32"
    kernel_kinds = (M_FP32, V_FP32)  # the compiled step's own AdamW (chunk_adamw's order)
    parity = Parity(compiled=FP32_ULPS, triton=FUSED_TENSOR_LR)

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        n = numel_of(shape)
        return (TensorSpec("exp_avg", torch.float32, n), TensorSpec("exp_avg_sq", torch.float32, n))

    def encode(self, state: Canonical, views: dict[str, Tensor], hyper: StepHyper) -> None:
        views["exp_avg"].copy_(_required_m(state).reshape(-1))
        views["exp_avg_sq"].copy_(state.dense_v().reshape(-1))

    def decode(self, views: dict[str, Tensor], shape: Shape) -> Canonical:
        return Canonical(
            tuple(shape),
            exp_avg=views["exp_avg"].to(torch.float32).clone().view(tuple(shape)),
            exp_avg_sq=views["exp_avg_sq"].to(torch.float32).clone().view(tuple(shape)),
        )

    def update(self, items: list[StepItem], hyper: StepHyper) -> None:
        fused_dense_fp32(items, hyper, "exp_avg", "exp_avg_sq")


def _required_m(state: Canonical) -> Tensor:
    if state.exp_avg is None:
        raise ValueError("this format needs a momentum; the optimizer re-creates it before encode")
    return state.exp_avg
