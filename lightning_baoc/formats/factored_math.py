"""Adafactor's factored second moment, driven in row blocks (shared by ``factored`` and ``int8_factored``).

For a parameter viewed as ``(R, C)`` (:func:`~lightning_baoc.formats.base.factor_dims`) the state is
``row[i] = EMA(mean_j g[i, j]**2)`` and ``col[j] = EMA(mean_i g[i, j]**2)`` with Adam's beta2,
and the second moment used in the update is the rank-1 estimate ``row[i] * col[j] / mean(row)``
(Shazeer & Stern, 2018), bias-corrected like Adam's. Memory: ``4 * (R + C)`` bytes.
"""

from __future__ import annotations

from math import gcd
from typing import Callable, Iterator

import torch
from torch import Tensor

from .adam_math import effective_grad, param_flat
from .base import StepHyper, StepItem, factor_dims
from .quant import SUPER

#: Added to squared gradients so that a row of exact zeros keeps a positive estimate (Adafactor's eps1).
EPS_SQUARE = 1e-30

LoadM = Callable[[dict[str, Tensor], int, int], Tensor]
StoreM = Callable[[Tensor, dict[str, Tensor], int, int, StepHyper], None]


def row_blocks(rows: int, cols: int, chunk: int) -> Iterator[tuple[int, int]]:
    """Row ranges of about ``chunk`` elements whose element offsets fall on 8-bit super-blocks."""
    step = max(1, chunk // max(cols, 1))
    align = SUPER // gcd(cols, SUPER)
    step = max(align, (step // align) * align)
    for r0 in range(0, rows, step):
        yield r0, min(r0 + step, rows)


def factored_update(
    items: list[StepItem],
    hyper: StepHyper,
    load_m: LoadM | None = None,
    store_m: StoreM | None = None,
) -> None:
    """AdamW with a factored second moment; momentum through ``load_m``/``store_m`` when given."""
    for item in items:
        dims = factor_dims(item.param.shape)
        if dims is None:  # the optimizer resolves such shapes to the fallback format
            raise ValueError(f"shape {tuple(item.param.shape)} has no factored form")
        rows, cols = dims
        p_flat, write_back = param_flat(item.param)
        p2d = p_flat.view(rows, cols)
        g2d = item.grad.reshape(rows, cols)
        row, col = item.views["exp_avg_sq_row"], item.views["exp_avg_sq_col"]
        blocks = list(row_blocks(rows, cols, hyper.chunk))

        row_mean_sq = torch.empty(rows, dtype=torch.float32, device=row.device)
        col_sum_sq = torch.zeros(cols, dtype=torch.float32, device=col.device)
        for r0, r1 in blocks:
            g = effective_grad(g2d[r0:r1], p2d[r0:r1], hyper)
            sq = g.square().add_(EPS_SQUARE)  # never in place: g may be the gradient itself
            row_mean_sq[r0:r1] = sq.mean(dim=1)
            col_sum_sq.add_(sq.sum(dim=0))
        row.mul_(hyper.beta2).add_(row_mean_sq, alpha=1.0 - hyper.beta2)
        col.mul_(hyper.beta2).add_(col_sum_sq.div_(rows), alpha=1.0 - hyper.beta2)
        row_mean = float(row.mean())
        scale = 1.0 / (row_mean * item.bias_correction2) if row_mean > 0 else 0.0

        for r0, r1 in blocks:
            p = p2d[r0:r1]
            g = effective_grad(g2d[r0:r1], p, hyper)
            denom = torch.outer(row[r0:r1], col).mul_(scale).sqrt_().add_(hyper.eps)
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
        write_back()

