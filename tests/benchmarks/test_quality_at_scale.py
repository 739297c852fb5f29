"""``benchmarks/quality_at_scale.py`` at its tiny size on the CPU, so that the GPU script cannot rot: runs
written one by one, resumed, a slice stopped in time, peers that are not installed reported as rows."""

from __future__ import annotations

import math

import pytest

import quality_at_scale as qs


@pytest.mark.slow
def test_the_tiny_size_trains_resumes_and_reports(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(qs, "RESULTS", tmp_path)
    runs = [("tiny", row, 0) for row in ("fp32", "baoc_0.25", "int8", "bnb_8bit")]
    written = qs.run_slice(runs, "cpu", None, corpus_mb=1.0)
    assert [p.name for p in written] == ["fp32_s0.json", "baoc_0.25_s0.json", "int8_s0.json", "bnb_8bit_s0.json"]
    results = qs.load("tiny")
    for row in ("fp32", "baoc_0.25", "int8"):
        r = results[(row, 0)]
        assert r["status"] == "ok" and r["steps"] == qs.SIZES["tiny"]["steps"], r
        assert r["val_loss"] < math.log(256) - 1.0, r  # it learned the bytes' statistics
        assert r["tokens_per_second"] > 0 and r["peak_memory"] > 0
    n = results[("fp32", 0)]["params"]
    assert results[("fp32", 0)]["state_bytes"] == 8 * n  # torch AdamW's two fp32 moments
    assert results[("int8", 0)]["state_bytes"] < 2.5 * n
    assert results[("baoc_0.25", 0)]["state_bytes"] <= 0.25 * 8 * n * 1.05
    assert results[("bnb_8bit", 0)]["status"] in ("ok",) or results[("bnb_8bit", 0)]["status"].startswith("not available")
    assert qs.run_slice(runs, "cpu", None, corpus_mb=1.0) == []  # resumed: nothing left to run
    more = runs + [("tiny", "baoc_0.15", 0)]
    assert qs.run_slice(more, "cpu", 0.0, corpus_mb=1.0) == []  # no time left: stops before the run
    table = qs.report("tiny")
    assert "| baoc_0.25 |" in table and "vs fp32 (paired)" in table and "| bnb_8bit |" in table
