"""The hot path's gathers: a segment's sampled elements and row norms into a staging buffer.

The gradient of a sharded parameter (a ``DTensor``, FSDP2) holds some rows of the whole on this
rank, a DeepSpeed fragment's (a ``sharding.Piece``) some run of its elements: :func:`_gather` writes
the sampled elements and rows that fall in them and zeros elsewhere, so that a sum over the ranks
(the sampler's one all-reduce per sample) assembles the sample the whole gradient gives.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_baoc.optim.sharding import is_sharded, local, shard_offset, whole_shape
from lightning_baoc.sampling.layout import _Segment

_FP32_MAX = torch.finfo(torch.float32).max


def _gather(seg: _Segment, grad: Tensor | None, buf: Tensor, device: torch.device, with_rows: bool) -> None:
    """Write ``seg``'s sampled elements (and row norms) of ``grad`` into ``buf``; zeros if no grad."""
    elems = buf[seg.elem_offset : seg.elem_offset + seg.elem_count]
    rows = buf[seg.row_offset : seg.row_offset + seg.row_count] if with_rows else buf[:0]
    if grad is None:
        elems.zero_()
        rows.zero_()
        return
    if is_sharded(grad) or seg.piece is not None:
        _gather_shard(seg, grad, elems, rows, device, with_rows)
        return
    if seg.elem_count:
        index = seg.indices_on(device)
        flat = grad.reshape(-1)
        if index is None:
            elems.copy_(flat)
        elif flat.dtype == torch.float32:
            torch.index_select(flat, 0, index, out=elems)
        else:
            elems.copy_(flat.index_select(0, index))
    if with_rows and seg.row_count:
        mat = grad.reshape(grad.shape[0], -1)[seg.row_start :: seg.row_step]
        # accumulated in float64: in float32 the squares of finite gradients of 1e19 sum past its
        # maximum and the sample would be dropped as non-finite. At most max_rows rows per tensor,
        # every sample_every steps. A norm beyond float32 itself saturates (it stays finite).
        if mat.device.type == "mps":  # no float64 there: scale each row by its largest value
            amax = mat.abs().amax(dim=1, keepdim=True).float().clamp_(min=torch.finfo(torch.float32).tiny)
            norms = torch.linalg.vector_norm(mat / amax, dim=1, dtype=torch.float32).mul_(amax.squeeze(1))
            rows.copy_(norms.clamp_(max=_FP32_MAX))
        else:
            rows.copy_(_row_norms(mat))


def _row_norms(mat: Tensor) -> Tensor:
    """Row norms accumulated in float64 (see :func:`_gather`), saturated at float32's maximum."""
    return torch.linalg.vector_norm(mat, dim=1, dtype=torch.float64).clamp_(max=_FP32_MAX)


def _gather_shard(seg: _Segment, grad: Tensor, elems: Tensor, rows: Tensor, device: torch.device, with_rows: bool) -> None:
    """:func:`_gather` of this rank's part of a sharded gradient (a ``DTensor``'s rows, a piece's elements):
    its part, zeros elsewhere."""
    if seg.shard_offset is None:  # the parameter's layout is fixed: found once
        seg.shard_offset = seg.piece.offset if seg.piece is not None else shard_offset(grad)
    mine, offset = local(grad), seg.shard_offset
    n = mine.numel()
    elems.zero_()
    if seg.elem_count and n:
        flat = mine.reshape(-1)
        index = seg.indices_on(device)
        if index is None:  # every element, in order
            elems[offset : offset + n].copy_(flat)
        else:
            key = (device, offset, n)
            cached = seg._shard_positions.get(key)
            if cached is None:  # once per layout: the sampled indices in this shard (sorted)
                host = seg.elem_index if seg.elem_index is not None else index.cpu()
                lo, hi = (int(torch.searchsorted(host, v)) for v in (offset, offset + n))
                cached = seg._shard_positions[key] = (lo, hi, (host[lo:hi] - offset).to(device))
            lo, hi, positions = cached
            if hi > lo:
                elems[lo:hi].copy_(flat.index_select(0, positions))
    if with_rows and seg.row_count:
        rows.zero_()
        width = math.prod(whole_shape(seg.param)[1:])
        if seg.piece is not None and seg.piece.cuts_rows:
            _cut_rows(seg, mine.reshape(-1), offset, width, rows)
            return
        first, count = offset // width, mine.numel() // width
        k_lo, k_hi = _sampled_rows(seg, first, first + count)
        if k_hi > k_lo:
            start = seg.row_start + k_lo * seg.row_step - first
            mat = mine.reshape(count, -1)[start :: seg.row_step][: k_hi - k_lo]
            rows[k_lo:k_hi].copy_(_row_norms(mat))


def _sampled_rows(seg: _Segment, first: int, stop: int) -> tuple[int, int]:
    """The sampled rows ``row_start + k * row_step`` among rows ``[first, stop)``: ``k`` in ``[k_lo, k_hi)``."""
    k_lo = max(0, -(-(first - seg.row_start) // seg.row_step))
    k_hi = min(seg.row_count, -(-(stop - seg.row_start) // seg.row_step))
    return k_lo, k_hi


def _cut_rows(seg: _Segment, flat: Tensor, offset: int, width: int, rows: Tensor) -> None:
    """The squares of the norms of the sampled rows' parts in ``flat``, a piece of a parameter whose ranks cut
    some of its rows: a sum over the ranks adds a cut row's parts and the sampler takes the root after it."""
    end = offset + flat.numel()
    if end == offset:
        return
    a, b = -(-offset // width), end // width  # rows [a, b) lie whole in the piece: one reduction
    k_lo, k_hi = _sampled_rows(seg, a, b)
    if k_hi > k_lo:
        start = (seg.row_start + k_lo * seg.row_step) * width - offset
        mat = flat[start : b * width - offset].view(-1, width)[:: seg.row_step][: k_hi - k_lo]
        rows[k_lo:k_hi].copy_(_row_norms(mat).square_().clamp_(max=_FP32_MAX))
    for r in {offset // width, (end - 1) // width} - set(range(a, b)):  # the (at most two) cut at the edges
        k, off_step = divmod(r - seg.row_start, seg.row_step)
        if not off_step and 0 <= k < seg.row_count:
            part = flat[max(r * width, offset) - offset : min((r + 1) * width, end) - offset]
            rows[k].copy_(_row_norms(part.view(1, -1)).square_().clamp_(max=_FP32_MAX)[0])


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge touching ``[a, b)`` ranges (one copy when the blocks are laid out contiguously)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
