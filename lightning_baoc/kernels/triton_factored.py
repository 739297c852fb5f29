"""The factored formats' second moment on the GPU for all tensors of a step at once: two launches, not a kernel and
a dozen operations per tensor.

Adafactor's factored moment (``factored``, ``int8_factored``: :mod:`lightning_baoc.formats.factored_math`) needs,
before the update, each tensor's row and column sums of ``(g k)**2``, the row and column vectors' EMA from them,
the row vector's mean and the row and column factors of the estimate's root. Per tensor that was one sums
kernel and about a dozen torch operations; on a GPU their launches cost more than their work. Here:

- :func:`_sums` — one launch per kind of tensor (weight and gradient dtypes, correction width, L2 decay) over
  all of them, one program per ``ROWS`` rows of a tensor (found by a binary search over the tensors' first
  programs, as the update's launch finds its super-block): the row sums, and each program's column sums as one
  row of a partial buffer;
- :func:`_finish` — one launch, one program per tensor: the column sums added over the partial rows in order,
  the vectors' EMA (``_update_row``'s arithmetic: ``(v * beta2 + sums * alpha) + (1 - beta2) * eps**2``,
  saturated at fp32's largest value), the row mean (``sum(row / rows)``), and the factors
  ``sqrt_rn(row / mean / bias_correction2)`` and ``sqrt_rn(col)`` (inf where a moment saturated) into flat
  buffers the update's table points into. Where the device decided the step is skipped (the tensor's skip flag),
  the program returns: the vectors stay, and the update, which reads the same flag, does not read the factors.

Every addition is in a fixed order, so the result does not depend on the launch's size or on how many tensors
step together: the planned step, the CUDA graph step and the unplanned step give the same bits
(``tests/kernels/test_triton_factored.py``; against the eager step within fp32 ulps, the means summed in
another order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_baoc.formats.factored_math import EPS_SQUARE
from lightning_baoc.formats.kinds import M_NONE, V_FACTORED
from lightning_baoc.kernels import triton_common as tc
from lightning_baoc.kernels.triton_common import tl, triton

#: Rows of one program of the sums (their partial column sums: 4 bytes per ROWS elements), and its column tile.
ROWS, TILE = 64, 128
#: Elements a finishing program reads at a time.
BLOCK = 1024

#: The sums' table: a tensor's row (then each tensor's first program).
SUM_COLUMNS = ("grad", "param", "correction", "rows", "cols", "k", "partial", "row_sum")
#: The finish's table: a tensor's row.
FINISH_COLUMNS = ("row", "col", "rows", "cols", "partial", "programs", "row_sum", "row_factor", "col_factor",
                  "skip_flag", "bias_correction2", "alpha_row", "alpha_col")

if triton is not None:
    _SUM_COUNT = tl.constexpr(len(SUM_COLUMNS))
    _FINISH_COUNT = tl.constexpr(len(FINISH_COLUMNS))
    _FP32_MAX = tl.constexpr(3.4028234663852886e38)

    @triton.jit(do_not_specialize=["count"])
    def _sums(
        table, count, partial, row_sum, gsign, l2,
        L2: tl.constexpr, W: tl.constexpr, G: tl.constexpr, CB: tl.constexpr, SEARCH: tl.constexpr,
        BR: tl.constexpr, BC: tl.constexpr,
    ):
        """Row sums of ``(g k)**2`` of BR rows of one tensor, and their column sums (one row of ``partial``)."""
        pid = tl.program_id(0).to(tl.int64)
        first = table + count * _SUM_COUNT
        lo = tc._find(first, count, pid, SEARCH)
        row = table + lo * _SUM_COUNT
        WT: tl.constexpr = tl.float32 if W == 0 else tl.int16
        GT: tl.constexpr = tl.float32 if G == 0 else tl.int16
        CT: tl.constexpr = tl.int8 if CB == 8 else tl.int16
        g_ptr = tc._ptr(row, 0, GT)
        p_ptr = tc._ptr(row, 1, WT)
        c_ptr = tc._ptr(row, 2, CT)
        rows = tl.load(row + 3)
        cols = tl.load(row + 4)
        k = tc._int32_at(row, 5).to(tl.float32, bitcast=True)
        local = pid - tl.load(first + lo)
        out = partial + tl.load(row + 6) + local * cols
        r = local * BR + tl.arange(0, BR)
        rmask = r < rows
        acc = tl.zeros((BR,), tl.float32)
        for c0 in range(0, cols, BC):
            c = c0 + tl.arange(0, BC)
            cmask = c < cols
            idx = r[:, None] * cols + c[None, :]
            mask = rmask[:, None] & cmask[None, :]
            if G == 0:
                g = tl.load(g_ptr + idx, mask=mask, other=0.0) * gsign
            else:
                g = tc._load16(tl.load(g_ptr + idx, mask=mask, other=0), G) * gsign
            if L2:
                if W == 0:
                    p = tl.load(p_ptr + idx, mask=mask, other=0.0)
                else:
                    p = tc._load_master(p_ptr, c_ptr, idx, mask, W, CB)
                g = tl.fma(p, l2, g)
            x = g * k
            sq = x * x
            acc += tl.sum(sq, axis=1)
            tl.store(out + c, tl.sum(sq, axis=0), mask=cmask)
        tl.store(row_sum + tl.load(row + 7) + r, acc, mask=rmask)

    @triton.jit
    def _finish(table, partial, row_sum, factors, beta2, floor, SKIP: tl.constexpr, B: tl.constexpr):
        """One tensor's vectors and factors from its sums (module docstring)."""
        row = table + tl.program_id(0).to(tl.int64) * _FINISH_COUNT
        if SKIP:
            if tl.load(tc._ptr(row, 9, tl.float32)) != 0.0:
                return
        r_ptr = tc._ptr(row, 0, tl.float32)
        c_ptr = tc._ptr(row, 1, tl.float32)
        rows = tl.load(row + 2)
        cols = tl.load(row + 3)
        part = partial + tl.load(row + 4)
        programs = tl.load(row + 5)
        sums = row_sum + tl.load(row + 6)
        rf = factors + tl.load(row + 7)
        cf = factors + tl.load(row + 8)
        bc2 = tc._int32_at(row, 10).to(tl.float32, bitcast=True)
        alpha_r = tc._int32_at(row, 11).to(tl.float32, bitcast=True)
        alpha_c = tc._int32_at(row, 12).to(tl.float32, bitcast=True)
        n_rows = rows.to(tl.float32)
        acc = tl.zeros((B,), tl.float32)
        for i0 in range(0, rows, B):
            i = i0 + tl.arange(0, B)
            m = i < rows
            v = tl.load(r_ptr + i, mask=m, other=0.0)
            new = (v * beta2 + tl.load(sums + i, mask=m, other=0.0) * alpha_r) + floor
            new = tl.where(new > _FP32_MAX, _FP32_MAX, new)  # saturated (NaN kept, as clamp_ keeps it)
            tl.store(r_ptr + i, new, mask=m)
            acc += tl.where(m, tl.div_rn(new, n_rows), 0.0)
        mean = tl.sum(acc, axis=0)
        for j0 in range(0, cols, B):
            j = j0 + tl.arange(0, B)
            m = j < cols
            s = tl.zeros((B,), tl.float32)
            for p in range(0, programs):
                s += tl.load(part + p * cols + j, mask=m, other=0.0)
            v = tl.load(c_ptr + j, mask=m, other=0.0)
            new = (v * beta2 + s * alpha_c) + floor
            new = tl.where(new > _FP32_MAX, _FP32_MAX, new)
            tl.store(c_ptr + j, new, mask=m)
            tl.store(cf + j, tl.where(new >= _FP32_MAX, float("inf"), tl.sqrt_rn(new)), mask=m)
        for i0 in range(0, rows, B):
            i = i0 + tl.arange(0, B)
            m = i < rows
            v = tl.load(r_ptr + i, mask=m, other=0.0)
            ratio = tl.where(mean > 0.0, tl.div_rn(v, mean), 0.0)
            factor = tl.sqrt_rn(tl.div_rn(ratio, bc2))
            tl.store(rf + i, tl.where(v >= _FP32_MAX, float("inf"), factor), mask=m)


@dataclass
class Buffers:
    """The working memory of one factored launch: the partial column sums, the row sums and the factors."""

    partial: Tensor
    row_sum: Tensor
    factors: Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.partial, self.row_sum, self.factors))


class FactoredWork:
    """The factored tensors of one step on one device, laid out once: which kind each one's sums launch is, where
    its partial sums, row sums and factors lie in the flat buffers. :meth:`launch` runs the two launches of a step;
    :meth:`factors` gives each tensor's row and column factors (views of the buffers, for the update's table).

    ``params``, ``grad_dtypes``, ``views`` (each one's ``exp_avg_sq_row`` and ``exp_avg_sq_col``), ``corrections``:
    the tensors, in order. The hyperparameters are read at each step (:meth:`tables`, :meth:`launch`)."""

    def __init__(self, params: list[Tensor], grad_dtypes: list[torch.dtype], views: list[dict[str, Tensor]],
                 corrections: list[Tensor | None]) -> None:
        self.device = params[0].device
        self.count = len(params)
        dims = [(v["exp_avg_sq_row"].numel(), v["exp_avg_sq_col"].numel()) for v in views]
        self.rows = np.array([r for r, _ in dims], dtype=np.int64)
        self.cols = np.array([c for _, c in dims], dtype=np.int64)
        self.programs = (self.rows + ROWS - 1) // ROWS
        partial_sizes = self.programs * self.cols
        self.partial_at = np.concatenate([[0], np.cumsum(partial_sizes)[:-1]]).astype(np.int64)
        self.row_at = np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int64)
        self.rf_at = self.row_at.copy()
        self.cf_at = int(self.rows.sum()) + np.concatenate([[0], np.cumsum(self.cols)[:-1]]).astype(np.int64)
        self.sizes = (int(partial_sizes.sum()), int(self.rows.sum()), int(self.rows.sum() + self.cols.sum()))
        self.longest = np.maximum(self.rows, self.cols).astype(np.float64)
        # the sums' tables, by kind (the gradient's column filled at each launch)
        self.kinds: dict[tuple[int, int, int], np.ndarray] = {}
        kinds = [(tc._KINDS[p.dtype], tc._KINDS[g], 0 if c is None else tc._CORRECTION_BITS[c.dtype])
                 for p, g, c in zip(params, grad_dtypes, corrections)]
        for kind in dict.fromkeys(kinds):
            self.kinds[kind] = np.array([i for i, k in enumerate(kinds) if k == kind], dtype=np.int64)
        rows = []
        for i, (p, c) in enumerate(zip(params, corrections)):
            rows.append([0, p.data_ptr(), p.data_ptr() if c is None else c.data_ptr(), int(self.rows[i]),
                         int(self.cols[i]), 0, int(self.partial_at[i]), int(self.row_at[i])])
        self.sum_rows = np.array(rows, dtype=np.int64).reshape(-1, len(SUM_COLUMNS))
        fin = []
        for i, v in enumerate(views):
            r, c = int(self.rows[i]), int(self.cols[i])
            longest = max(r, c)
            fin.append([v["exp_avg_sq_row"].data_ptr(), v["exp_avg_sq_col"].data_ptr(), r, c, int(self.partial_at[i]),
                        int(self.programs[i]), int(self.row_at[i]), int(self.rf_at[i]), int(self.cf_at[i]), 0, 0,
                        tc._float_bits(longest / c), tc._float_bits(longest / r)])
        self.finish_rows = np.array(fin, dtype=np.int64).reshape(-1, len(FINISH_COLUMNS))

    def buffers(self) -> Buffers:
        """Fresh working memory for a step (a captured step keeps its own)."""
        partial, row_sum, factors = self.sizes
        return Buffers(torch.empty(partial, dtype=torch.float32, device=self.device),
                       torch.empty(row_sum, dtype=torch.float32, device=self.device),
                       torch.empty(factors, dtype=torch.float32, device=self.device))

    def factors(self, buffers: Buffers) -> list[tuple[int, int]]:
        """Each tensor's (row factor, column factor) addresses in ``buffers``."""
        base = buffers.factors.data_ptr()
        return [(base + 4 * int(r), base + 4 * int(c)) for r, c in zip(self.rf_at, self.cf_at)]

    def tables(self, grads: list[int], skips: Any, bias_corrections2: Any, hyper: Any) -> tuple[dict[tuple, Tensor], Tensor]:
        """The launches' tables on the device (the sums' per kind, then the finish's): ``grads``, the gradients'
        addresses; ``skips``, the skip flags' addresses; ``bias_corrections2``, each tensor's, fp32 bits; ``hyper``:
        the step's hyperparameters (each tensor's scale of the squares, ``sqrt((1 - beta2) / max(rows, cols))``)."""
        sums = {}
        scale = np.sqrt((1.0 - hyper.beta2) / self.longest).astype(np.float32).view(np.int32).astype(np.int64)
        for kind, members in self.kinds.items():
            part = self.sum_rows[members].copy()
            part[:, 0] = np.asarray(grads, dtype=np.int64)[members]
            part[:, 5] = scale[members]
            firsts = np.cumsum(self.programs[members])
            flat = torch.from_numpy(np.concatenate([part.reshape(-1), [0], firsts[:-1]]).astype(np.int64))
            sums[kind] = tc.on_device(flat, self.device)
        fin = self.finish_rows.copy()
        fin[:, 9] = skips
        fin[:, 10] = bias_corrections2
        return sums, tc.on_device(torch.from_numpy(fin.reshape(-1)), self.device)

    def launch(self, sums: dict[tuple, Tensor], finish: Tensor, buffers: Buffers, hyper: Any) -> None:
        """The step's two launches (the sums' one per kind) into ``buffers``, by :meth:`tables`' tables."""
        common = tc._common((M_NONE, V_FACTORED), hyper, 0.0, 0.0)
        beta2, floor = tc._f32(hyper.beta2), tc._f32((1.0 - hyper.beta2) * EPS_SQUARE)
        for kind, table in sums.items():
            members = self.kinds[kind]
            count = len(members)
            _sums[(int(self.programs[members].sum()),)](
                table, count, buffers.partial, buffers.row_sum, common["gsign"], common["l2"], L2=common["L2"], W=kind[0], G=kind[1],
                CB=kind[2], SEARCH=max(count - 1, 1).bit_length(), BR=ROWS, BC=TILE, enable_fp_fusion=False)
        _finish[(self.count,)](finish, buffers.partial, buffers.row_sum, buffers.factors, beta2, floor,
                               SKIP=True, B=BLOCK, enable_fp_fusion=False)


__all__ = ["BLOCK", "Buffers", "FINISH_COLUMNS", "FactoredWork", "ROWS", "SUM_COLUMNS", "TILE"]
