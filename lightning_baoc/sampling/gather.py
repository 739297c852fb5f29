"""The hot path's gathers: a segment's sampled elements and row norms into a staging buffer."""

from __future__ import annotations

import torch
from torch import Tensor

from .layout import _Segment

_FP32_MAX = torch.finfo(torch.float32).max


def _gather(seg: _Segment, grad: Tensor | None, buf: Tensor, device: torch.device, with_rows: bool) -> None:
    """Write ``seg``'s sampled elements (and row norms) of ``grad`` into ``buf``; zeros if no grad."""
    elems = buf[seg.elem_offset : seg.elem_offset + seg.elem_count]
    rows = buf[seg.row_offset : seg.row_offset + seg.row_count] if with_rows else buf[:0]
    if grad is None:
        elems.zero_()
        rows.zero_()
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
        else:
            norms = torch.linalg.vector_norm(mat, dim=1, dtype=torch.float64)
        rows.copy_(norms.clamp_(max=_FP32_MAX))


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge touching ``[a, b)`` ranges (one copy when the blocks are laid out contiguously)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
