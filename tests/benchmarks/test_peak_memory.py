"""The memory budget is a cap on the whole run: peak resident memory of a 42M-parameter model trained
through Lightning (``benchmarks/peak_memory.py``: each run in its own process, peak RSS from the
kernel), BAOC at budgets 0.25 and 0.5 against plain SGD (the baseline) and fp32 AdamW (the
reference), over a warm-up, the allocation's conversion and re-evaluations."""

from __future__ import annotations

import sys

import pytest

from peak_memory import Workload, bound_bytes, run_all, table

BUDGETS = [0.25, 0.5]


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="measured (docs/benchmarks/peak-memory.md): 0.407 of AdamW's peak above the baseline at budget 0.25 and "
    "0.652 at 0.5, 8.9 MiB and 7.2 MiB over the bound: BAOC's own memory beyond the state (sampler buffers 22.6 MiB, "
    "shadow 5.3 MiB, about 10 MiB outside torch's allocator) is still to be brought down to a few percent",
)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB and glibc's malloc: Linux")
def test_peak_rss_above_the_baseline_is_the_budget_of_adamws() -> None:
    workload = Workload()
    assert workload.params >= 40_000_000
    results = run_all(workload, BUDGETS)
    print("\n" + table(workload, results, BUDGETS))
    base = results["sgd"]["peak_rss"]
    adamw = results["adamw"]["peak_rss"] - base
    assert adamw >= 8 * workload.params * 0.9  # the reference holds fp32 AdamW's state
    for b in BUDGETS:
        r = results[f"baoc:{b}"]
        assert [reason for _, reason in r["allocations"]][:2] == ["warmup", "epoch"]  # conversion, re-evaluation
        assert r["peak_state_bytes"] <= r["budget_bytes"] + 8 * workload.width**2
        assert r["peak_rss"] - base <= b * adamw + bound_bytes(workload, r)
