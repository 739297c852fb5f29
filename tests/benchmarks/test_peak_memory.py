"""The memory budget is a cap on the whole run, with no spike above the steady state, and a peak as planned
(``benchmarks/peak_memory.py``).

By default, on a small run (3 x Linear(1024, 1024), 3.1M parameters, 16 steps, in this process) whose tensors'
bytes are counted at every allocation and free (``TensorBytes``, from torch's profiler): a counter, not a
sampler, so the figures do not depend on how the threads are scheduled. Also the counter itself on known
allocations, and every comparison shown to fail on a wrong plan or a missed allocation.

Under ``slow`` (on CUDA by default, where the runs take seconds): the 42M- and 105M-parameter runs, each in its
own process (peak RSS from the kernel, or the tensors counted), and the small runs with the other cores busy.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
from peak_memory import (
    MARK_BYTES,
    TensorBytes,
    Workload,
    bound_bytes,
    excess,
    excess_misses,
    excess_table,
    excess_workload,
    fast_workload,
    plan_misses,
    planned_rows,
    planned_table,
    run_all,
    table,
)
from support import BusyCores

BUDGETS = [0.25, 0.5]
MIB = 2**20

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB and glibc's malloc: Linux")
#: The 42M runs: slow on the CPU (bf16 matrix products there take seconds a step), seconds on a GPU.
ACCELERATORS = [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


def one_miss(misses: list[str], words: str) -> bool:
    """Exactly one check failed, the one whose sentence holds ``words``."""
    return len(misses) == 1 and words in misses[0]


def test_the_counter_sees_every_allocation_and_free_of_its_thread() -> None:
    # Known blocks between marks: 3 MiB and 5 MiB held together (the first interval's peak, 8 MiB), then 5 MiB
    # and 1 MiB (held at the second mark); after them an 8 MiB block and its 8 MiB sum, held together for a
    # moment (the second interval's peak, 16 MiB). A 64 MiB block made and freed by another
    # Python thread in the first interval is not counted (the counter follows its own thread): 8 MiB there.
    def elsewhere() -> None:
        torch.empty(64 * MIB, dtype=torch.uint8)

    counter = TensorBytes()
    counter.start()
    try:
        counter.mark()
        a = torch.empty(3 * MIB, dtype=torch.uint8)
        b = torch.empty(5 * MIB, dtype=torch.uint8)
        del a
        c = torch.empty(MIB, dtype=torch.uint8)
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        counter.mark()
        del b, c
        x = torch.ones(2 * MIB)  # float32: 8 MiB
        y = x + x  # 8 MiB more: 16 MiB, for a moment
        del x
        total = y.sum()
        del y
        counter.mark()
    finally:
        counter.stop()
    counts = counter.counts()
    start = counts["held"][0]
    assert [h - start for h in counts["held"]] == [0, 6 * MIB, 4]  # at the end, the sum's 4 bytes
    assert [p - start for p in counts["peaks"]] == [8 * MIB, 16 * MIB]
    assert counts["peak"] - start == 16 * MIB
    assert total.item() == 4 * MIB  # 2 x 2 Mi ones


def test_the_counter_needs_two_marks() -> None:
    counter = TensorBytes()
    counter.start()
    counter.mark()
    counter.stop()
    with pytest.raises(RuntimeError, match=rf"recorded 1 marks of {MARK_BYTES} bytes; counts\(\) needs 2"):
        counter.counts()


def test_a_small_run_holds_the_planned_gradients_state_and_instruments_and_peaks_within_the_plan() -> None:
    """3.1M parameters, fp32 and bf16-true, BAOC at 0.25 with its defaults, the allocation at step 12 of 16:
    the most held at a step's end over fit start is the plan's gradients + state + instruments within 2%, and
    the peak is within the plan (its working memory bounds the scratch on top). Measured (torch 2.13, the
    same on every run: the bytes are counted): held +0.34% (fp32, 18.62 MiB) and +0.45% (bf16-true, 8.68 MiB);
    peak 22.7 and 12.0 MiB against 26.6 and 16.6 planned, of which 8 MiB is the working memory's bound."""
    rows = planned_rows(fast_workload(), 0.25, here=True)
    print("\n" + planned_table(rows))
    for r in rows:
        assert r["check"] == r["planned"], r  # check plans what the run plans
        assert [list(a) for a in r["allocations"]] == [[12, "warmup"]], r["allocations"]
        assert plan_misses(r) == [], plan_misses(r)
        # the counter sees the allocation's scratch (the risk scoring, a conversion's slices): at least a
        # quarter of the working memory's bound above what is held (measured: 4.1 and 3.4 MiB)
        assert r["measured"] - r["held"] >= r["terms"]["working"] // 4, r
        assert "planned peak" in r["line"], r["line"]
        # The comparison fails a wrong plan and a missed allocation: without its working memory the plan is
        # under the peak; with the gradients twice it is off what is held; a count that missed the
        # instruments' buffers is too.
        t = r["terms"]
        assert one_miss(plan_misses({**r, "planned": r["planned"] - t["working"]}), "is above the planned")
        assert one_miss(plan_misses({**r, "terms": {**t, "gradients": 2 * t["gradients"]}}), "held at a step's end")
        assert one_miss(plan_misses({**r, "held": r["held"] - t["instruments"]}), "held at a step's end")


@pytest.mark.slow  # long; the counted peak within the plan is held by default in this file
def test_a_small_run_peaks_over_its_steady_state_within_adamws_own_plus_a_third_of_a_byte() -> None:
    """3.1M parameters, fp32 and bf16-true, plain AdamW and BAOC at 0.25 with its defaults, the allocation at
    step 12 of 16, the tensors' bytes counted: BAOC's peak over its steady state is within AdamW's own excess
    + 0.3 bytes per parameter, and the peak saves at least half the state saved. Measured (torch 2.13):
    BAOC's excess 1.36 (fp32) and 1.12 (bf16-true) bytes per parameter against 2.97 and 1.63 allowed (AdamW's
    own: 2.67 and 1.33, its step's temporaries). The whole-tensor decode this guards against adds 8 bytes per
    element of the largest tensor (2.7 bytes per parameter here): it fails."""
    rows = excess(fast_workload(), 0.25, here=True)
    print("\n" + excess_table(rows))
    for r in rows:
        assert excess_misses(r, warmup=12) == [], excess_misses(r, warmup=12)
        # the count sees the steps' transients, without which every excess would be 0 and pass: AdamW's foreach
        # step's temporaries and BAOC's scratch at its allocation (measured 2.67 and 1.36 in fp32, 1.33 and 1.12)
        assert r["excess"]["adamw"] >= 1.0 and r["excess"]["baoc"] >= 0.5, r
        decoded = 8 * 1024 * 1024 / fast_workload().params  # one 1024 x 1024 state decoded whole, per parameter
        spiked = {**r, "excess": {**r["excess"], "baoc": r["excess"]["baoc"] + decoded}}
        assert one_miss(excess_misses(spiked, warmup=12), "over its steady state"), spiked


@pytest.mark.slow
def test_the_small_runs_hold_with_the_other_cores_busy() -> None:
    """The two small runs' comparisons with every core but one kept busy (``support.BusyCores``), where a
    sampled peak was missed (issue 61: -5.2% and -6.9% against a 5% tolerance): they hold, and every byte
    counted is the same as without the spinners, which are shown to have run."""
    quiet = planned_rows(fast_workload(), 0.25, here=True), excess(fast_workload(), 0.25, here=True)
    with BusyCores(max(1, (os.cpu_count() or 2) - 1)) as busy:
        planned = planned_rows(fast_workload(), 0.25, here=True)
        spikes = excess(fast_workload(), 0.25, here=True)
    print("\n" + planned_table(planned) + "\n\n" + excess_table(spikes))
    print(f"spinners' CPU time {busy.cpu_seconds} s in {busy.wall_seconds:.1f} s")
    # the spinners ran: each had its share of a core (on 2 cores shared with other work, measured 15% of the
    # wall time at a load average of 9, 25% at 5), not just a start
    assert min(busy.cpu_seconds) >= 0.05 * busy.wall_seconds, (busy.cpu_seconds, busy.wall_seconds)
    for r in planned:
        assert plan_misses(r) == [] and r["measured"] - r["held"] >= r["terms"]["working"] // 4, r
    for r in spikes:
        assert excess_misses(r, warmup=12) == [], r
    assert [(r["measured"], r["held"]) for r in planned] == [(r["measured"], r["held"]) for r in quiet[0]]
    assert [(r["steady"], r["peak"]) for r in spikes] == [(r["steady"], r["peak"]) for r in quiet[1]]


@pytest.mark.slow
@linux
@pytest.mark.parametrize("layers,bound_share", [(40, 0.10), (100, 0.055)])
def test_peak_rss_above_the_baseline_is_the_budget_of_adamws(layers: int, bound_share: float) -> None:
    """Within ``B x`` AdamW's peak above the baseline plus the documented bound, which is under 10%
    of AdamW's at 42M parameters (the instruments' 16 MiB floor) and under 5.5% at 105M."""
    workload = Workload(layers=layers)
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
        assert r["sampler_bytes"] + r["shadow_bytes"] <= r["instrument_allowance"]
        bound = bound_bytes(workload, r)
        assert bound <= bound_share * adamw
        assert r["peak_rss"] - base <= b * adamw + bound


@linux
@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_the_peak_over_the_steady_state_is_within_adamws_own_plus_a_third_of_a_byte(accelerator: str) -> None:
    """42M parameters (10 x Linear(2048, 2048)) built under ``init_module``, fp32 and bf16-true, BAOC at 0.25
    with its defaults, the allocation at step 20 of 40: the whole run's peak exceeds its own steady state
    by at most plain AdamW's excess + 0.3 bytes per parameter, and the peak saves at least half the state
    saved; resident bytes (the kernel's peak, ``ru_maxrss``). On CUDA the same with allocated bytes
    (``max_memory_allocated``). Measured (2-core CPU, torch 2.13): excess 0.19 (fp32) and 0.09 (bf16) B/param
    against 1.10 and 0.70 allowed; the risk model decoded each tensor's whole state before (1.23 and 0.82)."""
    workload = excess_workload(accelerator=accelerator)
    assert workload.params >= 40_000_000
    rows = excess(workload, 0.25)
    print("\n" + excess_table(rows))
    for r in rows:
        assert excess_misses(r, warmup=20) == [], r


@linux
@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_the_planned_peak_is_the_measured_allocated_peak_within_5_percent(accelerator: str) -> None:
    """The same 42M run, fp32 and bf16-true: the peak beyond the weights that ``lightning-baoc check`` plans
    on the meta model, and the callback at fit end, against the tensors' bytes counted from fit start
    (``TensorBytes``; on CUDA ``max_memory_allocated``). Measured (2-core CPU, torch 2.13): +0.2% (fp32) and
    +2.7% (bf16-true): 251.3 and 127.9 MiB counted against 251.9 and 131.3 planned (sampled every 0.2 ms
    instead, -5.2% and -6.9% on a loaded machine: issue 61)."""
    rows = planned_rows(excess_workload(accelerator=accelerator), 0.25)
    print("\n" + planned_table(rows))
    for r in rows:
        assert r["check"] == r["planned"], r  # check plans what the run plans
        assert abs(r["planned"] - r["measured"]) <= 0.05 * r["measured"], r
        assert "planned peak" in r["line"] and "measured: " in r["line"], r["line"]
