"""One parameter's optimizer state converted between formats in bounded slices.

A conversion never decodes a whole parameter to fp32: it walks the flat elements in slices of
``hyper.chunk`` (aligned to the 8-bit formats' super-blocks), loads each slice's ``m`` and ``v`` from
the old format in fp32, and stores it through the new one. The scratch is a few fp32 slices (about
``16 * chunk`` bytes: 2 MiB at the default chunk), whatever the size of the parameter. Factored second
moments are read by expanding their rows and columns slice by slice (Adafactor's rank-1 estimate,
the same products as :func:`~lightning_baoc.formats.base.expand_factored`) and written by summing
row and column means over the slices.

Semantics are those of decode -> encode: state is inherited (quantize / dequantize, factor / expand),
a momentum dropped is gone, and a momentum created is one EMA step of the current gradient
(``m = (1 - beta1) g``, bias-corrected on its own: ``m_step = 1``), or zero when the gradient is
missing or not finite (always zero for SGD and Lion, whose buffers start empty). Formats without a
second moment (SGD's and Lion's, :mod:`lightning_baoc.formats.momentum`) convert their momentum alone.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from lightning_baoc.formats import StepHyper
from lightning_baoc.formats.adam_math import chunk_ranges
from lightning_baoc.formats.base import FactoredMeans, StateFormat, factor_view, factored_ratio, numel_of, row_mean
from lightning_baoc.formats.frames import finish_stores, frame_lead

_FP32_MAX = torch.finfo(torch.float32).max
_ROW, _COL = "exp_avg_sq_row", "exp_avg_sq_col"

Slice = Callable[[int, int], Tensor]


def convert_state(
    src: StateFormat,
    src_views: dict[str, Tensor],
    dst: StateFormat,
    dst_views: dict[str, Tensor],
    shape: tuple[int, ...],
    hyper: StepHyper,
    grad: Tensor | None,
    m_step: int,
    shards: Any = None,
    agree: Callable[[bool], bool] | None = None,
) -> int:
    """Fill ``dst_views`` (zeroed, format ``dst``) from ``src_views`` (format ``src``), slice by slice.

    ``shards``: the state is a shard's rows of a parameter split by rows (``optim.sharding.RowShards``):
    a factored second moment read or written is the whole parameter's (its row mean and its column
    means summed over the shards: a collective, so every rank converts the parameter at once).
    ``agree``: turns this rank's finding that the gradient is finite (a momentum re-created from it)
    into every shard's (a shard's gradient: a collective), so that no shard re-creates a momentum
    from its gradient while another starts from zero, with another bias-correction count.

    Returns the momentum's bias-correction count after the conversion (``m_step`` kept when both
    formats hold a momentum, 1 for a momentum created from a finite gradient, else 0).
    """
    n = numel_of(shape)
    device = next((t.device for t in dst_views.values()), None)
    # a shard laid out in the whole parameter's 8-bit super-blocks: slices start on them
    lead = frame_lead(dst_views) if frame_lead(src_views) is None else frame_lead(src_views)
    load_v = _v_reader(src, src_views, shape, shards) if dst.has_second_moment else None
    load_m: Slice | None = (lambda a, b: src.load_m(src_views, a, b)) if src.has_momentum else None
    if dst.has_momentum and load_m is None:
        load_m, m_step = _momentum_from_gradient(grad, n, hyper, agree)
    elif not dst.has_momentum:
        m_step = 0
    if dst.factored:
        sums = FactoredMeans(shape, device, shards)
        for a, b in chunk_ranges(n, hyper.chunk, lead):
            sums.add(a, load_v(a, b).to(device))
            if dst.has_momentum:
                dst.store_m(load_m(a, b).to(device), dst_views, a, b, hyper)
        finish_stores(dst_views)
        row, col = sums.reduced()
        dst_views[_ROW].copy_(row)
        dst_views[_COL].copy_(col)
        return m_step
    for a, b in chunk_ranges(n, hyper.chunk, lead):
        if dst.has_momentum:
            dst.store_m(load_m(a, b).to(device), dst_views, a, b, hyper)
        if load_v is not None:
            dst.store_v(load_v(a, b).to(device), dst_views, a, b, hyper)
    finish_stores(dst_views)
    return m_step


class StateSlices:
    """One parameter's state read in bounded fp32 slices, never decoded whole: what the risk model
    scores (elements at sampled indices, the factored formats' row and column means of ``v``).

    ``shards``: a shard's rows of a parameter split by rows (``optim.sharding.RowShards``), read over
    the whole parameter's row mean (a collective at construction when the state is factored, another in
    :meth:`factored_means`); ``None`` reads this rank's rows alone. The scratch is a few slices of
    ``chunk`` elements and the outputs' size.
    """

    def __init__(self, fmt: StateFormat, views: dict[str, Tensor], shape: tuple[int, ...], chunk: int,
                 shards: Any = None) -> None:
        self.fmt, self.views, self.shape, self.shards = fmt, views, shape, shards
        self.numel = numel_of(shape)
        self.device = next((t.device for t in views.values()), torch.device("cpu"))
        self._ranges = list(chunk_ranges(self.numel, chunk, frame_lead(views)))
        # read only: an element-wise v's slice is read in place (a conversion's reader copies it for its store)
        self._load_v = _v_reader(fmt, views, shape, shards) if fmt.factored else (lambda a, b: fmt.load_v(views, a, b))

    @property
    def has_momentum(self) -> bool:
        return self.fmt.has_momentum

    def gather(self, index: Tensor | None) -> tuple[Tensor | None, Tensor]:
        """fp32 ``m`` (``None`` without a momentum) and ``v`` at the flat ``index`` (``None``: every
        element), read slice by slice; only the slices holding an index are loaded."""
        if index is None:
            index = torch.arange(self.numel, device=self.device)
        index = index.to(self.device)
        ordered, order = index.sort()
        m = torch.empty(index.numel(), dtype=torch.float32, device=self.device) if self.has_momentum else None
        v = torch.empty(index.numel(), dtype=torch.float32, device=self.device)
        bounds = torch.searchsorted(ordered, torch.tensor([b for _, b in self._ranges], device=self.device)).tolist()
        lo = 0
        for (a, b), hi in zip(self._ranges, bounds):
            if hi > lo:
                local_index, slots = ordered[lo:hi] - a, order[lo:hi]
                v[slots] = self._load_v(a, b)[local_index]
                if m is not None:
                    m[slots] = self.fmt.load_m(self.views, a, b)[local_index]
            lo = hi
        return m, v

    def factored_means(self) -> tuple[Tensor, Tensor]:
        """Row and column means of ``v`` (a shard's columns summed over the shards: a collective)."""
        means = FactoredMeans(self.shape, self.device, self.shards)
        for a, b in self._ranges:
            means.add(a, self._load_v(a, b))
        return means.reduced()


def _v_reader(fmt: StateFormat, views: dict[str, Tensor], shape: tuple[int, ...], shards: Any = None) -> Slice:
    """fp32 ``v`` of the flat elements ``[a, b)``, a new tensor (the store may overwrite it)."""
    if not fmt.factored:
        return lambda a, b: fmt.load_v(views, a, b).clone()
    rows, cols = factor_view(shape)  # type: ignore[misc]
    row, col = views[_ROW], views[_COL]
    # the products expand_factored computes (a shard's rows: over the whole parameter's row mean)
    ratio = factored_ratio(row, row_mean(row, shards))

    def load(a: int, b: int) -> Tensor:
        index = torch.arange(a, b, device=row.device)
        return (ratio[index // cols] * col[index % cols]).clamp_(max=_FP32_MAX)

    return load


def _momentum_from_gradient(
    grad: Tensor | None, n: int, hyper: StepHyper, agree: Callable[[bool], bool] | None = None
) -> tuple[Slice, int]:
    """A reader of the re-created momentum ``(1 - beta1) g`` and its bias-correction count.

    SGD's and Lion's buffers (``hyper.rule`` other than ``"adamw"``) start empty instead, as they
    do at a fresh start: SGD's takes the gradient on its next step, Lion's starts from zero.
    """
    flat = grad.detach().reshape(-1) if grad is not None else None
    finite = hyper.rule == "adamw" and flat is not None and all(bool(torch.isfinite(flat[a:b]).all()) for a, b in chunk_ranges(n, hyper.chunk))
    if agree is not None and hyper.rule == "adamw":
        finite = agree(finite)
    if not finite:
        return (lambda a, b: torch.zeros(b - a, dtype=torch.float32)), 0
    return (lambda a, b: flat[a:b].to(torch.float32).mul(1.0 - hyper.beta1)), 1
