"""``offload``: fp32 momentum and second moment in host memory (Deep Optimizer States, arXiv 2410.21316).

On an accelerator, the states live in (pinned) host memory and cost the device nothing; the update
of an offloaded parameter runs on the CPU: its gradient is copied to the host, the fp32 AdamW
math runs there, and the new parameter values are copied back.

When training runs on the CPU, host memory *is* the device's memory: the states are then counted
in full by ``BlockwiseAdamW.state_bytes()`` (8 bytes per element), so ``offload`` can never make a
budget look met there (``tests/optim/test_accounting.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .adam_math import foreach_dense_fp32
from .base import Canonical, Shape, StateFormat, StepHyper, StepItem, TensorSpec, numel_of

HOST = torch.device("cpu")


class Offload(StateFormat):
    """fp32 states in host memory, updated on the CPU. Device bytes: 0 on an accelerator."""

    name = "offload"
    has_momentum = True
    offloaded = True
    summary = "m fp32, v fp32, in host memory (updated on the CPU)"

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        n = numel_of(shape)
        return (TensorSpec("exp_avg", torch.float32, n), TensorSpec("exp_avg_sq", torch.float32, n))

    def encode(self, state: Canonical, views: dict[str, Tensor], hyper: StepHyper) -> None:
        if state.exp_avg is None:
            raise ValueError("this format needs a momentum; the optimizer re-creates it before encode")
        views["exp_avg"].copy_(state.exp_avg.reshape(-1))
        views["exp_avg_sq"].copy_(state.dense_v().reshape(-1))

    def decode(self, views: dict[str, Tensor], shape: Shape) -> Canonical:
        shape = tuple(shape)
        return Canonical(
            shape,
            exp_avg=views["exp_avg"].clone().view(shape),
            exp_avg_sq=views["exp_avg_sq"].clone().view(shape),
        )

    def update(self, items: list[StepItem], hyper: StepHyper) -> None:
        local = [it for it in items if it.param.device == it.views["exp_avg"].device]
        foreach_dense_fp32(local, hyper, "exp_avg", "exp_avg_sq")
        for it in items:
            if it.param.device == it.views["exp_avg"].device:
                continue
            host_param = it.param.detach().to(HOST, torch.float32)
            host_grad = it.grad.detach().to(HOST, torch.float32)
            host_item = StepItem(host_param, host_grad, it.views, it.bias_correction1, it.bias_correction2)
            foreach_dense_fp32([host_item], hyper, "exp_avg", "exp_avg_sq")
            it.param.copy_(host_param, non_blocking=True)
