"""The momentum formats of :class:`~lightning_baoc.optim.BlockwiseSGD` and
:class:`~lightning_baoc.optim.BlockwiseLion`: one state, the momentum buffer, per parameter.

SGD with momentum and Lion keep a single moment. Its format is chosen per parameter, as AdamW's
are, from :data:`MOMENTUM_FORMATS`:

=========  ==========================================================  ===============
name       momentum buffer                                             bytes / element
=========  ==========================================================  ===============
``fp32``   fp32 (the reference: torch's SGD, Lion's paper)              4
``bf16``   bf16, stochastically rounded (keyed like AdamW's ``bf16``)   2
``int8``   companded int8, fp16 scale per 32, exponent per 1024        ~1.127
``none``   no buffer: plain SGD / sign descent                          0
=========  ==========================================================  ===============

The storage is AdamW's: the int8 buffer is the int8 format's momentum (the same codes, scales and
rounding, :mod:`.quant`), the bf16 buffer the bf16 format's. ``int8`` falls back to ``fp32`` under
the 8-bit threshold (``min_8bit_numel``), as AdamW's int8 does.

The update rule is the optimizer's (``StepHyper.rule``):

- ``"sgd"``: torch's SGD. ``d = g (+ weight_decay * p)``; the buffer starts as ``d`` on its first
  step, then ``b = momentum * b + (1 - dampening) * d``; the step is ``-lr * (d + momentum * b)``
  with Nesterov, ``-lr * b`` without; in ``none``, ``-lr * d``.
- ``"lion"``: Lion (Chen et al., 2023). ``p *= 1 - lr * weight_decay``;
  ``p -= lr * sign(beta1 * m + (1 - beta1) * g)``; ``m = beta2 * m + (1 - beta2) * g``; in ``none``
  the buffer is zero at every step: ``p -= lr * sign(g)``.

The eager step below is the reference (and the step on other devices than the CPU): one chunk of
``hyper.chunk`` elements at a time, in fp32, written back through the format, with the same
operations in the same order as the references (so ``fp32`` equals them to the bit on the same
device). On the CPU the compiled kernel (``momentum_step`` in ``kernels/cpu_step.cpp``) runs the same
operations in one pass per 1024-element super-block, bit-equal to this step
(``tests/kernels/test_momentum_kernels.py``).
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Mapping

import torch
from torch import Tensor

from lightning_baoc.formats.adam_math import chunk_ranges, grad_flat, param_flat
from lightning_baoc.formats.base import Canonical, Shape, StateFormat, StepHyper, StepItem, TensorSpec, numel_of
from lightning_baoc.formats.frames import finish_stores, frame_lead, quant_args, quant_specs, store_quantized
from lightning_baoc.formats.kinds import M_BF16, M_FP32, M_INT8, M_NONE
from lightning_baoc.formats.quant import bf16_stochastic, dequantize_momentum, quantize_momentum

#: The update rules the momentum formats run.
RULES = ("sgd", "lion")


class MomentumFormat(StateFormat):
    """A format holding one momentum buffer (or none) per parameter: the SGD and Lion family."""

    has_second_moment = False
    #: The compiled kernel's momentum kind (:mod:`lightning_baoc.formats.kinds`; the kernels' ``momentum_step``).
    momentum_kind: int

    def encode(self, state: Canonical, views: dict[str, Tensor], hyper: StepHyper) -> None:
        if not self.has_momentum:
            return
        if state.exp_avg is None:
            raise ValueError("this format needs a momentum; the optimizer re-creates it before encode")
        m = state.exp_avg.reshape(-1)
        for start, stop in chunk_ranges(m.numel(), hyper.chunk, frame_lead(views)):
            self.store_m(m[start:stop].to(torch.float32).clone(), views, start, stop, hyper)
        finish_stores(views)

    def decode(self, views: dict[str, Tensor], shape: Shape) -> Canonical:
        shape = tuple(shape)
        if not self.has_momentum:
            return Canonical(shape)
        return Canonical(shape, exp_avg=self.load_m(views, 0, numel_of(shape)).view(shape))

    def load_v(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        raise NotImplementedError(f"momentum format {self.name!r} holds no second moment")

    def store_v(self, v: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        raise NotImplementedError(f"momentum format {self.name!r} holds no second moment")

    def update(self, items: list[StepItem], hyper: StepHyper) -> None:
        """One SGD or Lion step (``hyper.rule``) of every parameter in ``items``, chunk by chunk."""
        if hyper.rule not in RULES:
            raise ValueError(f"momentum format {self.name!r} runs the rules {RULES}, not {hyper.rule!r}")
        for item in items:
            step_hyper = replace(hyper, noise_key=item.noise_key)
            p, write_back = param_flat(item.param)
            g = grad_flat(item.grad)
            first = item.momentum_step <= 1  # the buffer's first step (SGD starts it as d)
            for start, stop in chunk_ranges(p.numel(), hyper.chunk, frame_lead(item.views)):
                m = self.load_m(item.views, start, stop) if self.has_momentum else None
                if hyper.rule == "sgd":
                    m = chunk_sgd(p[start:stop], g[start:stop], m, hyper, first)
                else:
                    chunk_lion(p[start:stop], g[start:stop], m, hyper)
                if m is not None:
                    self.store_m(m, item.views, start, stop, step_hyper)
            finish_stores(item.views)
            write_back()


def chunk_sgd(p: Tensor, g: Tensor, buf: Tensor | None, hyper: StepHyper, first: bool) -> Tensor | None:
    """torch's SGD step on a flat fp32 chunk, in place on ``p``; returns the new buffer.

    ``hyper.beta1`` is the momentum, ``hyper.dampening`` and ``hyper.nesterov`` torch's; ``buf`` is
    ``None`` without a buffer (format ``none``, or momentum 0), and ignored on the buffer's ``first``
    step, where it starts as the gradient (torch's ``clone(d_p)``).
    """
    d = g.to(torch.float32)
    if hyper.maximize:
        d = -d
    if hyper.weight_decay != 0:
        d = d.add(p, alpha=hyper.weight_decay)
    if buf is not None and hyper.beta1 != 0:
        if first:
            buf = d.clone()
        else:
            buf.mul_(hyper.beta1).add_(d, alpha=1.0 - hyper.dampening)
        d = d.add(buf, alpha=hyper.beta1) if hyper.nesterov else buf
    p.add_(d, alpha=-hyper.lr)
    return buf


def chunk_lion(p: Tensor, g: Tensor, m: Tensor | None, hyper: StepHyper) -> None:
    """One Lion step on a flat fp32 chunk, in place on ``p`` and ``m`` (``None``: a zero buffer)."""
    g = g.to(torch.float32)
    if hyper.maximize:
        g = -g
    if hyper.weight_decay != 0:
        p.mul_(1.0 - hyper.lr * hyper.weight_decay)
    if m is None:
        p.add_(torch.sign(g), alpha=-hyper.lr)
        return
    update = m.mul(hyper.beta1).add_(g, alpha=1.0 - hyper.beta1).sign_()
    p.add_(update, alpha=-hyper.lr)
    m.mul_(hyper.beta2).add_(g, alpha=1.0 - hyper.beta2)


class MomentumFP32(MomentumFormat):
    """The momentum buffer in fp32 (the reference). Bytes: ``4 * numel``."""

    name = "fp32"
    has_momentum = True
    summary = "momentum fp32"
    momentum_kind = M_FP32

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        return (TensorSpec("exp_avg", torch.float32, numel_of(shape)),)

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return views["exp_avg"][start:stop].clone()

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        target = views["exp_avg"][start:stop]
        if m.data_ptr() != target.data_ptr():
            target.copy_(m)


class MomentumBF16(MomentumFormat):
    """The momentum buffer in bf16, stochastically rounded. Bytes: ``2 * numel``."""

    name = "bf16"
    has_momentum = True
    summary = "momentum bf16 (stochastic rounding)"
    momentum_kind = M_BF16

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        return (TensorSpec("exp_avg", torch.bfloat16, numel_of(shape)),)

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return views["exp_avg"][start:stop].to(torch.float32)

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        bf16_stochastic(m, views["exp_avg"][start:stop], hyper.noise_key, start, 0)


class MomentumInt8(MomentumFormat):
    """The momentum buffer companded to int8 (AdamW ``int8``'s momentum). Bytes: ``~1.127 * numel``."""

    name = "int8"
    has_momentum = True
    quantized = True
    fallback = "fp32"
    summary = "momentum int8 companded, groups of 32"
    momentum_kind = M_INT8

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        return quant_specs("exp_avg", torch.int8, numel_of(shape))

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return dequantize_momentum(*quant_args(views, "exp_avg", start, stop))

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        store_quantized(quantize_momentum, m, views, "exp_avg", start, stop)


class MomentumNone(MomentumFormat):
    """No buffer: SGD without momentum, Lion's sign of the gradient. Bytes: 0."""

    name = "none"
    has_momentum = False
    summary = "no momentum buffer"
    momentum_kind = M_NONE

    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        return ()

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        raise NotImplementedError("format 'none' holds no momentum")

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        raise NotImplementedError("format 'none' holds no momentum")


#: Registry of the momentum formats: name -> format object (read-only), cheapest last.
MOMENTUM_FORMATS: Mapping[str, StateFormat] = MappingProxyType(
    {cls.name: cls() for cls in (MomentumFP32, MomentumBF16, MomentumInt8, MomentumNone)}
)
