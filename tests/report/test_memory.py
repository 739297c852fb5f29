"""The memory line of a fit: the planned peak beyond the weights beside what was measured from fit start."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_baoc import BAOC
from lightning_baoc.costs.peak import PlannedPeak, planned_peak, working_bytes
from lightning_baoc.report.memory import MemoryMeter

from support_lightning import DigitsModule, loaders, make_trainer


def test_the_planned_peak_counts_gradients_state_instruments_and_working_memory() -> None:
    shapes = {"a": [(64, 64), (64,)], "b": [(10, 64)]}
    dtypes = {"a": [torch.bfloat16, torch.bfloat16], "b": [torch.float32]}
    peak = planned_peak(shapes, dtypes, state_bytes=1000, instrument_bytes=500, chunk_size=4096)
    assert peak.gradients == 2 * (64 * 64 + 64) + 4 * 640
    assert peak.working == working_bytes(4096) == 16 * 4096 + 96 * 65536
    assert peak.total == peak.gradients + 1000 + 500 + peak.working
    assert "activations not counted" in peak.line() and peak.to_dict()["total"] == peak.total


@pytest.mark.slow  # a fit; the memory line's figures are held by default in this file
def test_a_fit_prints_the_planned_peak_beside_the_measured_one(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import lightning_baoc.integrations.callback as callback

    said: list[str] = []
    monkeypatch.setattr(callback, "rank_zero_info", lambda message, *a, **k: said.append(str(message)))
    torch.manual_seed(0)
    model = DigitsModule(widths=(64, 256, 256, 10))
    baoc = BAOC(memory_budget=0.3, warmup_steps=8, sample_every=2, report="json", calibration="prior")
    train, _ = loaders(320)
    make_trainer(tmp_path, max_steps=12, callbacks=[baoc]).fit(model, train)
    planned = baoc.controller.planned_peak()
    assert isinstance(planned, PlannedPeak)
    assert planned.gradients == sum(p.numel() * p.element_size() for p in model.parameters())
    assert planned.state >= baoc.controller.peak_state_bytes() * 0.9
    printed = [m for m in said if m.startswith("BAOC memory:")]
    assert len(printed) == 1 and "planned peak" in printed[0] and "measured: peak resident" in printed[0], printed
    line = baoc.memory_line()
    assert line.startswith("BAOC memory: planned peak") and "measured:" in line
    measured = baoc.measured_memory()
    assert measured is not None and measured.kind == "resident"
    if sys.platform.startswith("linux"):
        assert measured.peak is not None and measured.start is not None and measured.peak >= measured.start


def test_the_meter_reads_nothing_before_fit_start() -> None:
    meter = MemoryMeter()
    assert meter.measured() is None
    assert meter.line(None) == "BAOC memory: no planned peak"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_measured_peak_is_max_allocated_over_fit_start() -> None:
    meter = MemoryMeter()
    device = torch.device("cuda")
    meter.start(device)
    x = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    del x
    m = meter.measured()
    assert m is not None and m.kind == "allocated"
    assert m.growth is None or m.growth >= 64 << 20
