"""``offload``: fp32 momentum and second moment in host memory (Deep Optimizer States, arXiv 2410.21316).

On an accelerator, the states live in (pinned) host memory and cost the device nothing. Their update is
scheduled by subgroups, each on the host or on the device as the performance model finds fastest
(:mod:`lightning_baoc.optim.offload_schedule`, ``BlockwiseAdamW(offload_schedule=...)``); what that part does not
serve (a master-weight correction, a sharded parameter, gradient release, ``atomic_step``) takes this format's own
:meth:`Offload.update`: its gradient is copied to the host, the fp32 AdamW math runs there, and the new parameter
values are copied back.

When training runs on the CPU, host memory *is* the device's memory: the states are then counted
in full by ``BlockwiseAdamW.state_bytes()`` (8 bytes per element), so ``offload`` can never make a
budget look met there (``tests/optim/test_accounting.py``).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from lightning_baoc.formats.adam_math import element_batches
from lightning_baoc.formats.base import (
    FP32_ULPS, FUSED_TENSOR_LR, Canonical, Parity, Shape, StateFormat, StepHyper, StepItem, TensorSpec, numel_of,
)
from lightning_baoc.formats.fused_adam import fused_dense_fp32
from lightning_baoc.formats.kinds import M_FP32, V_FP32

HOST = torch.device("cpu")
#: Default size of the subgroups the offloaded states are updated in: bytes of fp32 parameters (64 MiB: 16,777,216
#: elements; the paper's subgroups are of this order), :mod:`lightning_baoc.optim.offload_schedule`.
DEFAULT_SUBGROUP_BYTES = 64 << 20
#: Bytes per element of ``offload``'s host-held state: fp32 ``exp_avg`` and ``exp_avg_sq`` (what the device path
#: moves each way; the weight on the device is its own master).
STATE_BYTES = 8


class Offload(StateFormat):
    """fp32 states in host memory, updated on the CPU. Device bytes: 0 on an accelerator."""

    name = "offload"
    has_momentum = True
    offloaded = True
    summary = "m fp32, v fp32, in host memory (updated on the CPU)"
    kernel_kinds = (M_FP32, V_FP32)  # the compiled step's own AdamW (chunk_adamw's order)
    parity = Parity(compiled=FP32_ULPS, triton=FUSED_TENSOR_LR)

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
        """States on the parameter's device (training on the CPU) update in place; the others on
        host copies of their parameters and gradients, batched (:data:`HOST_BATCH_ELEMENTS`, :func:`host_copies`),
        one fused launch per batch (:func:`~lightning_baoc.formats.fused_adam.fused_dense_fp32`)."""
        local = [it for it in items if it.param.device == it.views["exp_avg"].device]
        fused_dense_fp32(local, hyper, "exp_avg", "exp_avg_sq")
        remote = [it for it in items if it.param.device != it.views["exp_avg"].device]
        for host in host_copies(remote):
            fused_dense_fp32(host, hyper, "exp_avg", "exp_avg_sq")


#: Elements of parameters copied to the host for one fused launch at most (a parameter larger than
#: this is a batch of its own): bounds the host copies of parameters and gradients to 128 MiB.
HOST_BATCH_ELEMENTS = 1 << 24


def host_batches(items: list[StepItem], limit: int = HOST_BATCH_ELEMENTS) -> Iterator[list[StepItem]]:
    """``items`` in consecutive batches of at most ``limit`` parameter elements (at least one item)."""
    return element_batches(items, limit)


def host_copies(items: list[StepItem], limit: int = HOST_BATCH_ELEMENTS) -> Iterator[list[StepItem]]:
    """``items`` whose states are in host memory, in batches (:func:`host_batches`), each as items over host
    fp32 copies of their parameters and gradients; once the loop asks for the next batch (the math ran on
    these copies), the new values are copied back to the parameters."""
    for batch in host_batches(items, limit):
        host = _on_host(batch)
        yield host
        _write_back(batch, host)


def host_update(items: list[StepItem], hyper: StepHyper) -> None:
    """One step of ``items`` whose states are in host memory: the fp32 math runs on host copies of
    the parameters and gradients, and the new values are copied back to the parameters."""
    host = _on_host(items)
    fused_dense_fp32(host, hyper, "exp_avg", "exp_avg_sq")
    _write_back(items, host)


def _on_host(items: list[StepItem]) -> list[StepItem]:
    """``items`` over host fp32 copies of their parameters and gradients (the states are there already)."""
    return [
        StepItem(
            it.param.detach().to(HOST, torch.float32),
            it.grad.detach().to(HOST, torch.float32),
            it.views,
            it.bias_correction1,
            it.bias_correction2,
            it.step_count,
        )
        for it in items
    ]


def _write_back(items: list[StepItem], host: list[StepItem]) -> None:
    for it, copy in zip(items, host):
        if copy.param.data_ptr() != it.param.data_ptr():  # not the parameter itself (fp32 on the host)
            it.param.copy_(copy.param, non_blocking=True)
