"""Shared driver for formats whose states are stored element by element (bf16, 8-bit, fp32).

A subclass says how to load a chunk of each moment into fp32 and how to store it back; this
driver walks every parameter in cache-sized chunks (boundaries on 32-element groups), runs the
fp32 AdamW math of :func:`~lightning_baoc.formats.adam_math.chunk_adamw` and writes back. Encode
and decode use the same two methods over the whole tensor, so a conversion and a step quantize
identically.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace

import torch
from torch import Tensor

from lightning_baoc.formats.adam_math import chunk_adamw, chunk_ranges, grad_flat, param_flat
from lightning_baoc.formats.base import Canonical, Shape, StateFormat, StepHyper, StepItem, numel_of
from lightning_baoc.formats.frames import finish_stores, frame_lead


class ElementwiseFormat(StateFormat):
    """A format whose momentum (optional) and second moment are stored per element."""

    @abstractmethod
    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        """A new flat fp32 tensor of the momentum elements ``[start, stop)``."""

    @abstractmethod
    def store_m(
        self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper
    ) -> None:
        """Store flat fp32 ``m`` (may be overwritten) as the momentum elements ``[start, stop)``."""

    @abstractmethod
    def load_v(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        """A flat fp32 tensor of the second-moment elements ``[start, stop)``.

        It may be the stored view itself (fp32 storage), which the step then updates in place;
        ``store_v`` must accept that.
        """

    @abstractmethod
    def store_v(
        self, v: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper
    ) -> None:
        """Store flat fp32 ``v`` (may be overwritten) as the second-moment elements ``[start, stop)``."""

    def store(
        self, m: Tensor | None, v: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper
    ) -> None:
        """Store a slice's moments: ``m`` (``None``: the format holds none) then ``v`` (see :meth:`store_m`,
        :meth:`store_v`); a format whose two stores share work overrides it (``BF16``: one rounding hash)."""
        if m is not None:
            self.store_m(m, views, start, stop, hyper)
        self.store_v(v, views, start, stop, hyper)

    def encode(self, state: Canonical, views: dict[str, Tensor], hyper: StepHyper) -> None:
        n = numel_of(state.shape)
        v = state.dense_v().reshape(-1)
        m = state.exp_avg.reshape(-1) if (self.has_momentum and state.exp_avg is not None) else None
        if self.has_momentum and m is None:
            raise ValueError("this format needs a momentum; the optimizer re-creates it before encode")
        for start, stop in chunk_ranges(n, hyper.chunk, frame_lead(views)):
            m_slice = m[start:stop].to(torch.float32).clone() if m is not None else None
            self.store(m_slice, v[start:stop].to(torch.float32).clone(), views, start, stop, hyper)
        finish_stores(views)

    def decode(self, views: dict[str, Tensor], shape: Shape) -> Canonical:
        n = numel_of(shape)
        shape = tuple(shape)
        m = self.load_m(views, 0, n).view(shape) if self.has_momentum else None
        return Canonical(shape, exp_avg=m, exp_avg_sq=self.load_v(views, 0, n).clone().view(shape))

    def update(self, items: list[StepItem], hyper: StepHyper) -> None:
        """The eager step (the compiled one's reference, :mod:`.compiled`): chunks of
        ``hyper.chunk`` elements, loaded to fp32, updated, stored back."""
        for item in items:
            step_hyper = replace(hyper, noise_key=item.noise_key)
            p, write_back = param_flat(item.param)
            g = grad_flat(item.grad)
            for start, stop in chunk_ranges(p.numel(), hyper.chunk, frame_lead(item.views)):
                m = self.load_m(item.views, start, stop) if self.has_momentum else None
                v = self.load_v(item.views, start, stop)
                chunk_adamw(
                    p[start:stop],
                    g[start:stop],
                    m,
                    v,
                    hyper,
                    item.bias_correction1,
                    item.bias_correction2,
                )
                self.store(m, v, item.views, start, stop, step_hyper)
            finish_stores(item.views)
            write_back()


class Fp32SecondMoment:
    """``load_v``/``store_v`` of a second moment stored as a plain fp32 ``exp_avg_sq``: the step
    updates the stored slice in place (``nomomentum``, ``bf16_momentum``)."""

    def load_v(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        return views["exp_avg_sq"][start:stop]  # fp32 already: updated in place

    def store_v(self, v: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        target = views["exp_avg_sq"][start:stop]
        if v.data_ptr() != target.data_ptr():
            target.copy_(v)
