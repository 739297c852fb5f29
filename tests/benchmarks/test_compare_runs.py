"""``benchmarks/compare_runs.py``: two caches of the risk-validation runs compared allocation by allocation,
each harm paired with the fp32 continuation of its own data order and file."""

from __future__ import annotations

import json
import math
import statistics

import compare_runs as C
import pytest
from _report import file_text

FP32 = "[]"


def _cache(losses: dict[str, dict[int, float]]) -> dict[str, list[float]]:
    """A cache as risk_validation.py writes it: [allocation, order] -> [end, path]."""
    return {json.dumps([json.loads(a), o]): [loss, loss + 1.0] for a, by_order in losses.items() for o, loss in by_order.items()}


X = json.dumps([["h.0.mlp.fc", "int8"]])
Y = json.dumps([["h.0.mlp.fc", "factored"], ["h.1.mlp.fc", "nomomentum"]])


def test_each_harm_is_taken_against_the_fp32_run_of_its_own_order_and_file() -> None:
    old = _cache({FP32: {0: 1.0, 1: 2.0, 2: 3.0}, X: {0: 1.1, 1: 2.2, 2: 3.3}})
    new = _cache({FP32: {0: 5.0, 1: 5.0, 2: 5.0}, X: {0: 5.1, 1: 5.2, 2: 5.3}})  # another level, the same harms
    (c,) = C.compare(old, new)
    assert c.allocation == X
    assert c.old.mean == pytest.approx(0.2) and c.new.mean == pytest.approx(0.2)
    assert c.old.se == pytest.approx(statistics.stdev([0.1, 0.2, 0.3]) / math.sqrt(3))
    assert c.old.orders == 3 and c.z == pytest.approx(0.0, abs=1e-9)
    # the path metric reads the second loss of each run (here the end loss + 1: the same harms)
    assert C.compare(old, new, metric=1)[0].new.mean == pytest.approx(0.2)


def test_a_rerun_beyond_its_noise_is_counted_and_listed_first() -> None:
    old = _cache({FP32: {0: 1.0, 1: 1.0, 2: 1.0}, X: {0: 1.10, 1: 1.11, 2: 1.12}, Y: {0: 1.5, 1: 1.6, 2: 1.7}})
    new = _cache({FP32: {0: 1.0, 1: 1.0, 2: 1.0}, X: {0: 1.20, 1: 1.21, 2: 1.22}, Y: {0: 1.5, 1: 1.7, 2: 1.6}})
    comparisons = C.compare(old, new)
    by = {c.allocation: c for c in comparisons}
    assert by[X].z == pytest.approx(0.1 / math.hypot(0.01 / math.sqrt(3), 0.01 / math.sqrt(3)))
    assert by[Y].z == pytest.approx(0.0, abs=1e-9)
    text = C.report("cfg", comparisons, shown=1)
    assert "2 allocations compared, 1 within 2 combined standard errors (50%)" in text
    assert "h.0.mlp.fc int8" in text and "nomomentum" not in text  # the largest z only


def test_only_the_orders_both_files_hold_are_paired() -> None:
    old = _cache({FP32: {0: 1.0, 1: 1.0, 2: 1.0}, X: {0: 1.1, 1: 1.3, 2: 9.0}, Y: {0: 1.2, 1: 1.2}})
    new = _cache({FP32: {0: 1.0, 1: 1.0, 3: 1.0}, X: {0: 1.1, 1: 1.3, 3: 1.0}, Y: {0: 1.2}})
    (c,) = C.compare(old, new)  # Y shares a single order: not compared
    assert c.allocation == X and c.old.orders == 2  # orders 0 and 1: order 2 (old only) is left out
    assert c.old.mean == pytest.approx(0.2) and c.new.mean == pytest.approx(0.2)
    assert C.compare(_cache({X: {0: 1.0, 1: 1.0}}), new) == []  # no fp32 continuation to take harms against


def test_a_file_is_read_from_disk_or_at_a_git_revision(tmp_path) -> None:
    path = tmp_path / "runs.json"
    path.write_text("{}")
    assert file_text(str(path)) == "{}"
    assert "[project]" in file_text("HEAD:pyproject.toml")
    with pytest.raises(FileNotFoundError, match="REV:PATH"):
        file_text(str(tmp_path / "missing.json"))


def _results(harms: dict[str, list[float]]) -> dict:
    """An allocation-level results file as momentum_risk_validation.py and correction_risk_validation.py write it."""
    return {"task": "digits", "allocations": {label: {"harm_end": h, "harm_path": [x + 1.0 for x in h]}
                                              for label, h in harms.items()}}


def test_allocation_level_results_files_are_compared_label_by_label() -> None:
    old = _results({"risk-min": [0.1, 0.2, 0.3], "risk-max": [0.5, 0.6, 0.7], "random 0": [0.4, 0.4]})
    new = _results({"risk-min": [0.1, 0.2, 0.3], "risk-max": [0.9, 1.0, 1.1, 1.2], "random 1": [0.0, 0.1]})
    by = {c.allocation: c for c in C.compare_allocations(old, new)}
    assert set(by) == {"risk-min", "risk-max"}  # the labels both files hold
    assert by["risk-min"].identical and by["risk-min"].z == 0.0
    big = by["risk-max"]  # the orders both hold: the fourth (new only) is left out
    assert not big.identical and big.new.orders == 3 and big.new.mean == pytest.approx(1.0)
    assert big.z == pytest.approx(0.4 / math.hypot(big.old.se, big.new.se))
    assert C.compare_allocations(old, new, "path")[0].old.mean == pytest.approx(1.6)  # harm_path read
    text = C.report("cfg", list(by.values()), shown=5)
    assert "2 allocations compared, 1 within 2 combined standard errors (50%), 1 identical order by order" in text
    assert "| risk-max |" in text


def test_identical_runs_are_counted_in_a_cache_too() -> None:
    runs = {FP32: {0: 1.0, 1: 2.0}, X: {0: 1.5, 1: 2.5}, Y: {0: 1.2, 1: 2.1}}
    moved = {**runs, Y: {0: 1.2, 1: 2.1 + 1e-12}}
    by = {c.allocation: c for c in C.compare(_cache(runs), _cache(moved))}
    assert by[X].identical and not by[Y].identical  # one ulp-sized difference is not identical
    assert "2 within 2 combined standard errors (100%), 1 identical order by order" in C.report("cfg", list(by.values()), 5)
