"""Adafactor's factored second moment, driven in row blocks (shared by ``factored`` and ``int8_factored``).

For a parameter viewed as ``(R, C)`` (:func:`~lightning_baoc.formats.base.factor_dims`) the state is
``row[i] = EMA(mean_j g[i, j]**2)`` and ``col[j] = EMA(mean_i g[i, j]**2)`` with Adam's beta2,
and the second moment used in the update is the rank-1 estimate ``row[i] * col[j] / mean(row)``
(Shazeer & Stern, 2018), bias-corrected like Adam's. Memory: ``4 * (R + C)`` bytes.
"""

from __future__ import annotations

import math
from math import gcd
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from lightning_baoc.formats.adam_math import effective_grad, param_flat
from lightning_baoc.formats.base import StepHyper, StepItem, factor_dims, factor_view, factored_ratio
from lightning_baoc.formats.frames import finish_stores, frame_lead
from lightning_baoc.formats.quant import SUPER, sqrt_rn

#: Added to squared gradients so that a row of exact zeros keeps a positive estimate (Adafactor's eps1).
EPS_SQUARE = 1e-30
FP32_MAX = torch.finfo(torch.float32).max

LoadM = Callable[[dict[str, Tensor], int, int], Tensor]
StoreM = Callable[[Tensor, dict[str, Tensor], int, int, StepHyper], None]


def row_blocks(rows: int, cols: int, chunk: int, lead: int | None = None) -> Iterator[tuple[int, int]]:
    """Row ranges of about ``chunk`` elements whose element offsets fall on 8-bit super-blocks (of the
    whole parameter, for a shard whose first element sits ``lead`` elements into its super-block:
    ``frames.frame_lead``; the rows before the first such offset are a range of their own)."""
    step = max(1, chunk // max(cols, 1))
    align = SUPER // gcd(cols, SUPER)
    step = max(align, (step // align) * align)
    first = 0
    if lead:  # the first row on a super-block: lead is a multiple of gcd(cols, SUPER), as a shard starts on a row
        first = next((r for r in range(min(align, rows)) if (r * cols + lead) % SUPER == 0), rows)
        if first:
            yield 0, first
    for r0 in range(first, rows, step):
        yield r0, min(r0 + step, rows)


def factored_update(
    items: list[StepItem],
    hyper: StepHyper,
    load_m: LoadM | None = None,
    store_m: StoreM | None = None,
) -> None:
    """AdamW with a factored second moment; momentum through ``load_m``/``store_m`` when given."""
    for item in items:
        dims = factor_dims(item.param.shape) if item.shards is None else factor_view(item.param.shape)
        if dims is None:  # the optimizer resolves such shapes to the fallback format
            raise ValueError(f"shape {tuple(item.param.shape)} has no factored form")
        rows, cols = dims
        p_flat, write_back = param_flat(item.param)
        p2d = p_flat.view(rows, cols)
        g2d = item.grad.reshape(rows, cols)
        row, col = item.views["exp_avg_sq_row"], item.views["exp_avg_sq_col"]
        blocks = list(row_blocks(rows, cols, hyper.chunk, frame_lead(item.views)))
        mean = _update_moments(row, col, g2d, p2d, blocks, hyper, item.shards)
        row_factor, col_factor = sqrt_factors(row, col, item.bias_correction2, mean)

        for r0, r1 in blocks:
            p = p2d[r0:r1]
            g = effective_grad(g2d[r0:r1], p, hyper)
            denom = overflowed(g, torch.outer(row_factor[r0:r1], col_factor).add_(hyper.eps), hyper)
            if hyper.weight_decay != 0 and hyper.decoupled_weight_decay:
                p.mul_(1.0 - hyper.lr * hyper.weight_decay)
            if load_m is not None and store_m is not None:
                start, stop = r0 * cols, r1 * cols
                m = load_m(item.views, start, stop).view(r1 - r0, cols)
                m.lerp_(g, 1.0 - hyper.beta1)
                p.addcdiv_(m, denom, value=-hyper.lr / item.bias_correction1)
                store_m(m.view(-1), item.views, start, stop, hyper)
            else:
                p.addcdiv_(g, denom, value=-hyper.lr)
        if store_m is not None:
            finish_stores(item.views)
        write_back()


def overflowed(g: Tensor, denom: Tensor, hyper: StepHyper) -> Tensor:
    """``denom`` with inf where AdamW's own second moment of ``g``, ``(1 - beta2) g g``, overflows fp32, in place.

    There torch's AdamW's ``v`` is inf and its update 0; the factored estimate would instead take a finite,
    saturated moment and move the weight by ``lr g / 2**64``, 66.5 at ``g = 1e25`` (issue 51). With this the
    factored formats move 0 where AdamW does, at any finite gradient up to fp32's largest."""
    return denom.masked_fill_(torch.isinf(g.mul(1.0 - hyper.beta2).mul_(g)), math.inf)


def _update_moments(
    row: Tensor, col: Tensor, g2d: Tensor, p2d: Tensor, blocks: list[tuple[int, int]], hyper: StepHyper,
    shards: Any = None,
) -> Tensor | None:
    """``row = beta2 row + (1 - beta2)(mean_j g**2 + EPS_SQUARE)``, ``col`` likewise, in place.

    The means are sums of ``(g k)**2`` with ``k**2 = (1 - beta2) / max(rows, cols)``, rescaled
    once: no partial sum exceeds ``(1 - beta2) * max(g**2)``, so the moments stay finite wherever
    AdamW's own ``(1 - beta2) * g * g`` does. A plain mean of ``g**2`` overflows first: at
    ``g = 1e19`` every square is 1e38 and a row of 40 of them sums past fp32's maximum (issue 14).

    ``shards`` (a shard's rows, :attr:`StepItem.shards`): ``rows`` counts every rank's rows, and
    the column sums and the new row mean are summed over the shards in one all-reduce of
    ``cols + 1`` floats; returns that mean (``None`` without shards: the caller takes ``row``'s).
    """
    rows, cols = g2d.shape
    total = rows if shards is None else shards.rows
    k = math.sqrt((1.0 - hyper.beta2) / max(total, cols))
    row_sum = torch.empty(rows, dtype=torch.float32, device=row.device)
    col_sum = torch.zeros(cols + (shards is not None), dtype=torch.float32, device=col.device)
    for r0, r1 in blocks:
        # mul, not mul_: the effective gradient may be the gradient itself
        sq = effective_grad(g2d[r0:r1], p2d[r0:r1], hyper).mul(k).square_()
        row_sum[r0:r1] = sq.sum(dim=1)
        col_sum[:cols].add_(sq.sum(dim=0))
    if shards is None:
        moments_from_sums(row, col, row_sum, col_sum, hyper)
        return None
    _update_row(row, row_sum, max(total, cols) / cols, hyper)
    col_sum[cols] = row.div(total).sum()  # this shard's part of the new row mean
    shards.sum_(col_sum)
    _update_row(col, col_sum[:cols], max(total, cols) / total, hyper)
    return col_sum[cols:]


def _update_row(moment: Tensor, sums: Tensor, alpha: float, hyper: StepHyper) -> None:
    moment.mul_(hyper.beta2).add_(sums, alpha=alpha).add_((1.0 - hyper.beta2) * EPS_SQUARE)
    # gradients beyond AdamW's own range (where its v is inf) saturate instead of making the
    # row/mean ratio below inf / inf = NaN; vectors of rows + cols elements, so this is cheap
    moment.clamp_(max=FP32_MAX)


def moments_from_sums(row: Tensor, col: Tensor, row_sum: Tensor, col_sum: Tensor, hyper: StepHyper) -> None:
    """The factored moments' update from the row and column sums of ``(g k)**2``, in place
    (:func:`_update_moments`; the CUDA step computes the same in its own kernel, ``kernels/triton_factored.py``)."""
    rows, cols = row.numel(), col.numel()
    _update_row(row, row_sum, max(rows, cols) / cols, hyper)
    _update_row(col, col_sum, max(rows, cols) / rows, hyper)


def sqrt_factors(row: Tensor, col: Tensor, bias_correction2: float, mean: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Vectors whose outer product is the square root of the bias-corrected rank-1 estimate.

    ``sqrt(row[i] * col[j] / (mean(row) * bias_correction2))`` is computed as
    ``sqrt(row[i] / (mean(row) * bias_correction2)) * sqrt(col[j])``: the ratio is at most
    ``rows / bias_correction2`` and ``sqrt(col)`` at most 2**64, so no intermediate overflows (the
    product ``row[i] * col[j]`` of two moments near 1e38 would), and nothing is divided by a row
    mean of 0: an all-zero row factor gives a zero estimate. No host sync.
    """
    ratio = factored_ratio(row, mean)  # in [0, rows] (a shard's rows: over the whole parameter's mean)
    # a moment saturated at fp32's maximum (_update_row) stands for one beyond it, where AdamW's v is inf: its
    # factor is inf, and the updates of its row or column 0
    row_factor = sqrt_rn(ratio.div_(bias_correction2)).masked_fill_(row >= FP32_MAX, math.inf)
    return row_factor, sqrt_rn(col).masked_fill_(col >= FP32_MAX, math.inf)
