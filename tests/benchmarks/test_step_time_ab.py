"""``benchmarks/step_time_ab.py``: step_time.py's ratios read from its output, and two versions' rounds
judged within noise or not."""

from __future__ import annotations

import step_time_ab as AB

OUTPUT = """lightning_baoc from /somewhere
1 thread, torch AdamW fused: 1.1 ms, 1.00x torch AdamW fused
1 thread, int8: 2.2 ms, 2.00x torch AdamW fused
2 threads, int8: 1.4 ms, 1.46x torch AdamW fused
1 thread, fp32, skip_nonfinite=False: 0.9 ms, 0.83x torch AdamW fused
| int8 | 2.138 | 2.2 | 2.00x |
"""


def test_the_ratios_are_read_per_optimizer_and_thread_count() -> None:
    assert AB.ratios(OUTPUT) == {"torch AdamW fused (1 thr)": 1.0, "int8 (1 thr)": 2.0, "int8 (2 thr)": 1.46,
                                 "fp32, skip_nonfinite=False (1 thr)": 0.83}


def test_a_median_inside_the_other_versions_range_is_within_noise_and_one_outside_is_not() -> None:
    before = [{"int8 (1 thr)": r, "fp32 (1 thr)": 1.10} for r in (1.9, 2.0, 2.1)]
    after = [{"int8 (1 thr)": r, "fp32 (1 thr)": 1.40} for r in (2.05, 1.95, 2.0)]
    rows, outside = AB.summary(before, after)
    assert outside == 1
    assert rows[0][0] == "int8 (1 thr)" and rows[0][-1] == "within noise" and rows[0][3] == "+0.0%"
    assert rows[1][0] == "fp32 (1 thr)" and rows[1][-1] == "outside" and rows[1][3] == "+27.3%"
