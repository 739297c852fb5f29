"""The worker thread's reductions of a staging buffer over all blocks.

The worker's loop (``_worker_loop`` in :mod:`lightning_baoc.sampling.sampler`, beside the sampler whose
thread runs it) hands each staging buffer to
:meth:`GradientSampler._reduce <lightning_baoc.sampling.sampler.GradientSampler._reduce>`, which
uses the segmented reductions here: which blocks' samples are finite (:func:`_valid_blocks`), the
cosine of each block's sample with the previous step's (:func:`_cosines`), and the coefficient of
variation of each block's row norms (:func:`_anisotropy`). :class:`_ReductionMaps` holds the index
maps that let them reduce all blocks with a handful of tensor ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from lightning_baoc.optim.sharding import whole_numel
from lightning_baoc.sampling.layout import _Block


@dataclass
class _ReductionMaps:
    """Index maps that let the worker reduce all blocks' elements and row norms at once."""

    row_lengths: Tensor  # row norms of each row segment (int64)
    elem_lengths: Tensor  # sampled elements of each block (int64)
    block_of_seg: Tensor  # the block of each row segment
    seg_weight: Tensor  # the numel of each row segment's tensor (float64)
    seg_rows: Tensor  # row norms of each row segment (float64)
    elem_bounds: Tensor  # end of each block's elements in the staging buffer
    row_bounds: Tensor  # end of each block's row norms in the staging buffer

    @staticmethod
    def build(blocks: list[_Block]) -> _ReductionMaps:
        block_of_seg: list[int] = []
        weight: list[float] = []
        count: list[float] = []
        for bi, block in enumerate(blocks):
            for seg in block.segments:
                if seg.row_count:
                    block_of_seg.append(bi)
                    # A tensor's CV counts in proportion to its size in the block's anisotropy.
                    weight.append(float(whole_numel(seg.param)))
                    count.append(float(seg.row_count))
        return _ReductionMaps(
            row_lengths=torch.tensor(count, dtype=torch.int64),
            elem_lengths=torch.tensor([b.elements for b in blocks], dtype=torch.int64),
            block_of_seg=torch.tensor(block_of_seg, dtype=torch.int64),
            seg_weight=torch.tensor(weight, dtype=torch.float64),
            seg_rows=torch.tensor(count, dtype=torch.float64),
            elem_bounds=torch.tensor([b.elem_stop for b in blocks], dtype=torch.int64),
            row_bounds=torch.tensor([b.row_stop for b in blocks], dtype=torch.int64),
        )

    def tensors(self) -> list[Tensor]:
        return [getattr(self, f.name) for f in fields(self)]


def _valid_blocks(
    host: Tensor, missing: list[int], maps: _ReductionMaps, blocks: int, elements: int
) -> tuple[Tensor, list[int]]:
    """Blocks with a finite, present sample, and the blocks with a non-finite value.

    ``host``: the staging buffer (its first ``elements`` values are the sampled elements, the rest
    row norms); ``missing``: the blocks without a gradient.
    """
    valid = torch.ones(blocks, dtype=torch.bool)
    if missing:
        valid[missing] = False
    # One sum says whether any value is inf/nan (a finite sum of ~1e5 gradient values cannot
    # overflow fp32 unless they are ~1e33): the per-value search runs only then.
    if math.isfinite(float(host.sum())):
        return valid, []
    bad = torch.nonzero(~torch.isfinite(host)).flatten()
    in_rows = bad >= elements
    hit = torch.cat(
        [
            torch.searchsorted(maps.elem_bounds, bad[~in_rows], right=True),
            torch.searchsorted(maps.row_bounds, bad[in_rows], right=True),
        ]
    ).unique()
    hit_list = sorted(set(hit.tolist()) - set(missing))
    valid[hit] = False
    return valid, hit_list


#: Sampled elements reduced at once by :func:`_cosines` (whole blocks; a larger block alone): its
#: float64 working copies then take ~1.3 MiB whatever the number of blocks, not 64 bytes per
#: sampled element of the model.
COSINE_SLICE = 1 << 15


def _block_slices(elem_lengths: list[int], limit: int) -> list[tuple[int, int, int, int]]:
    """Consecutive runs of blocks of at most ``limit`` sampled elements together (a larger block
    alone): ``(first block, stop block, first element, stop element)`` of each run."""
    out: list[tuple[int, int, int, int]] = []
    b0 = e0 = e = 0
    for bi, n in enumerate(elem_lengths):
        if e + n - e0 > limit and bi > b0:
            out.append((b0, bi, e0, e))
            b0, e0 = bi, e
        e += n
    if elem_lengths:
        out.append((b0, len(elem_lengths), e0, e))
    return out


def _cosines(
    x: Tensor, y: Tensor, valid: Tensor, elem_lengths: Tensor, slices: list[tuple[int, int, int, int]] | None = None
) -> Tensor:
    """Per block: cosine of the samples ``x`` and ``y`` (all blocks side by side; nan where a block
    is not ``valid`` or a sample is zero). ``slices``: :func:`_block_slices` of the lengths, if the
    caller keeps them (they depend on the layout only)."""
    # One segmented reduction per run of blocks (a Python loop over blocks costs ~10x more), in
    # slices of COSINE_SLICE elements so the working copies stay small (the same sums: each block
    # is reduced whole, in the same order).
    # float64 products: the square of a finite gradient of 1e20 is past float32's maximum
    if slices is None:
        slices = _block_slices(elem_lengths.tolist(), COSINE_SLICE)
    parts = []
    for b0, b1, e0, e1 in slices:
        xs, ys = x[e0:e1].to(torch.float64), y[e0:e1].to(torch.float64)
        parts.append(torch.segment_reduce(torch.stack([xs * ys, xs * xs, ys * ys], dim=1), "sum",
                                          lengths=elem_lengths[b0:b1]))
    sums = torch.cat(parts) if parts else torch.zeros(0, 3, dtype=torch.float64)
    denom = (sums[:, 1] * sums[:, 2]).sqrt()
    ok = valid & (denom > 0)
    return torch.where(ok, sums[:, 0] / denom, torch.full_like(denom, math.nan))


def _anisotropy(rows: Tensor, maps: _ReductionMaps, blocks: int) -> Tensor:
    """Per block: numel-weighted mean over its row tensors of CV(row norms) (nan if none)."""
    if rows.numel() == 0:
        return torch.full((blocks,), math.nan, dtype=torch.float64)
    r = rows.to(torch.float64)
    sums = torch.segment_reduce(torch.stack([r, r * r], dim=1), "sum", lengths=maps.row_lengths)
    mean = sums[:, 0] / maps.seg_rows
    var = (sums[:, 1] / maps.seg_rows - mean * mean).clamp_(min=0.0)
    cv = var.sqrt() / mean  # population std / mean, as statistics.coefficient_of_variation
    ok = torch.isfinite(cv)
    w = torch.where(ok, maps.seg_weight, torch.zeros_like(cv))
    num = torch.zeros(blocks, dtype=torch.float64).index_add_(0, maps.block_of_seg, torch.where(ok, cv, 0.0) * w)
    den = torch.zeros(blocks, dtype=torch.float64).index_add_(0, maps.block_of_seg, w)
    return torch.where(den > 0, num / den, torch.full_like(num, math.nan))
