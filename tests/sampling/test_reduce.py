"""The worker's reductions: cosines reduced in slices of whole blocks give the sums of one pass,
and their working memory does not grow with the number of blocks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_baoc.sampling import reduce
from lightning_baoc.sampling.reduce import COSINE_SLICE, _block_slices, _cosines


def reference_cosines(x: torch.Tensor, y: torch.Tensor, lengths: list[int]) -> list[float]:
    out, start = [], 0
    for n in lengths:
        a, b = x[start : start + n].double(), y[start : start + n].double()
        denom = math.sqrt(float(a.square().sum()) * float(b.square().sum()))
        out.append(float((a * b).sum()) / denom if denom > 0 else math.nan)
        start += n
    return out


def test_slices_cover_every_block_once_in_order_within_the_limit() -> None:
    lengths = [3, 4, 10, 1, 1, 1, 7]
    slices = _block_slices(lengths, limit=8)
    assert [(b0, b1) for b0, b1, _, _ in slices] == [(0, 2), (2, 3), (3, 6), (6, 7)]
    assert [(e0, e1) for _, _, e0, e1 in slices] == [(0, 7), (7, 17), (17, 20), (20, 27)]
    for b0, b1, e0, e1 in slices:  # a run over the limit is a single block
        assert e1 - e0 <= 8 or b1 - b0 == 1
    assert _block_slices([], limit=8) == []


@pytest.mark.parametrize("limit", [1, 4096, 9000, COSINE_SLICE])
def test_sliced_cosines_equal_one_pass_bit_for_bit_and_the_reference(limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [5000, 4096, 1, 20000, 4096, 4096, 3000, 0]
    x = torch.randn(sum(lengths), generator=g)
    y = 0.5 * x + torch.randn(sum(lengths), generator=g)
    x[5000 + 4096 : 5000 + 4096 + 1] = 0.0  # a zero sample: nan
    valid = torch.ones(len(lengths), dtype=torch.bool)
    valid[4] = False
    monkeypatch.setattr(reduce, "COSINE_SLICE", 1 << 40)
    one_pass = _cosines(x, y, valid, torch.tensor(lengths))
    monkeypatch.setattr(reduce, "COSINE_SLICE", limit)
    got = _cosines(x, y, valid, torch.tensor(lengths))
    assert torch.equal(got.isnan(), one_pass.isnan())
    assert torch.equal(got.nan_to_num(), one_pass.nan_to_num())
    want = reference_cosines(x, y, lengths)
    for i, (a, b) in enumerate(zip(got.tolist(), want)):
        if i == 4 or math.isnan(b):
            assert math.isnan(a), i
        else:
            assert abs(a - b) <= 1e-12, (i, a, b)
    assert sum(not math.isnan(v) for v in got.tolist()) == 5


def test_cosine_working_memory_does_not_grow_with_the_blocks() -> None:
    """200 blocks of 4096 sampled elements (819,200): the float64 copies of one pass would take
    ~25 MiB at once; in slices the peak of live allocations stays within 3 MiB."""
    lengths = [4096] * 200
    x, y = torch.randn(sum(lengths)), torch.randn(sum(lengths))
    valid = torch.ones(len(lengths), dtype=torch.bool)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _cosines(x, y, valid, torch.tensor(lengths))
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    assert 0 < peak <= 3 * 2**20, peak
    assert peak >= 8 * 3 * COSINE_SLICE  # the products of one slice were live: the measure sees them
