"""``benchmarks/frontier.py``: the paired statistics and the verdicts on synthetic numbers, the rows against the
format registry and quality.py's tables, and (slow) the small version end to end."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import frontier as F
import quality as Q
from _quality_rows import FRONTIER_ROWS, _Probe

from lightning_baoc.formats import FORMATS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _row(name: str, finals: dict[int, float], bpp: float, failed: dict[int, str] | None = None) -> F.RowRuns:
    return F.RowRuns(name, finals=dict(finals), failed=dict(failed or {}), bytes_per_param=bpp, params=100)


def _rows(shift: float = 0.0) -> dict[str, F.RowRuns]:
    """A loss (lower is better) on seeds 0-2: a seed effect shared by every row (so pairing removes it) plus
    each row's own offset."""
    seed = {0: 1.00, 1: 1.10, 2: 0.90}

    def row(name: str, offset: float, bpp: float, jitter: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> F.RowRuns:
        return _row(name, {s: seed[s] + offset + j for s, j in zip(seed, jitter)}, bpp)

    return {
        "fp32": row("fp32", 0.0, 8.0),
        "int8": row("int8", 0.001, 2.3),  # fits 0.35 (2.8 B), not 0.25 (2.0 B)
        "nomomentum_int8": row("nomomentum_int8", 0.02, 1.1),  # fits 0.25 and 0.15 (1.2 B)
        "factored": row("factored", 0.05, 0.1),
        "baoc_0.35": row("baoc_0.35", 0.002, 2.8, (0.002, -0.002, 0.0)),  # int8 + 0.0010 ± 0.0012: within one se
        "baoc_0.25": row("baoc_0.25", 0.010, 2.0, (0.002, -0.002, 0.0)),  # 0.35 - 0.25 < 0: no worse
        "baoc_0.15": row("baoc_0.15", 0.004 + shift, 1.2, (0.0002, -0.0002, 0.0)),  # 0.25 worse by 0.0060 ± 0.0010
    }


def _verdicts(rows: dict[str, F.RowRuns], higher_is_better: bool = False) -> dict[str, F.Verdict]:
    return {v.check: v for v in F.judge(rows, higher_is_better)}


def test_paired_statistics_best_fitting_uniform_and_verdicts() -> None:
    # paired on seeds: the shared seed effect (std 0.1) cancels; a seed only one side has is left out
    d = F.paired_difference({0: 1.0, 1: 2.0, 2: 3.0, 7: 9.0}, {0: 0.9, 1: 1.9, 2: 2.9})
    assert d.n == 3 and d.mean == pytest.approx(0.1) and d.se == pytest.approx(0.0, abs=1e-12)
    d = F.paired_difference({0: 1.0, 1: 2.0}, {0: 0.0, 1: 0.0})
    assert d.mean == 1.5 and d.se == pytest.approx(0.5)  # stdev([1, 2]) / sqrt(2)
    assert F.mean_se([2.0]) == F.Estimate(2.0, None, 1) and F.paired_difference({0: 1.0}, {1: 1.0}) is None

    # fitting: bytes / param at most budget x 8 (exactly at the cap fits); the best by the metric's direction
    cand = {"int8": (2.3, 1.001), "nomomentum_int8": (1.1, 1.02), "factored": (0.1, 1.05), "bf16": (4.0, 0.99)}
    assert F.best_fitting_uniform(cand, 0.5, False) == "bf16"  # 4.0 <= 0.5 x 8
    assert F.best_fitting_uniform(cand, 0.35, False) == "int8"
    assert F.best_fitting_uniform(cand, 0.25, False) == "nomomentum_int8"  # int8's 2.3 > 2.0
    assert F.best_fitting_uniform(cand, 0.25, True) == "factored"  # higher is better: the largest value
    assert F.best_fitting_uniform(cand, 0.01, False) is None

    v = _verdicts(_rows())
    a35, a25 = v["(a) BAOC 0.35 no worse than BAOC 0.25"], v["(a) BAOC 0.25 no worse than BAOC 0.15"]
    assert a35.passed is True and "no worse" in a35.measured
    assert a25.passed is False and "+0.0060" in a25.measured and "beyond one se" in a25.measured
    b35, b25 = (v[f"(b) BAOC {b} no worse than the best uniform that fits"] for b in ("0.35", "0.25"))
    assert b35.passed is True and "- int8 " in b35.measured and "within one se" in b35.measured
    assert b25.passed is True and "- nomomentum_int8 " in b25.measured  # int8 does not fit 0.25
    b15 = v["(b) BAOC 0.15 no worse than the best uniform that fits"]
    assert b15.passed is True and "- nomomentum_int8 " in b15.measured
    c = v["(c) BAOC 0.15 within 0.5% of fp32 AdamW"]
    assert c.passed is True and "0.40% worse" in c.measured  # 0.004 on fp32's mean 1.0

    # (c) fails past 0.5%, alone: BAOC 0.15 (0.0062) is still better than nomomentum_int8 (0.02)
    v = _verdicts(_rows(shift=0.0022))
    assert v["(c) BAOC 0.15 within 0.5% of fp32 AdamW"].passed is False
    assert "0.62% worse" in v["(c) BAOC 0.15 within 0.5% of fp32 AdamW"].measured
    assert v["(b) BAOC 0.15 no worse than the best uniform that fits"].passed is True
    # BAOC 0.15 at 0.024: worse than nomomentum_int8 by 0.004 ± 0.0001 (fails (b)), and than 0.25 (passes (a))
    v = _verdicts(_rows(shift=0.02))
    assert v["(b) BAOC 0.15 no worse than the best uniform that fits"].passed is False
    assert v["(a) BAOC 0.25 no worse than BAOC 0.15"].passed is True

    # accuracy (higher is better): the same numbers negated give the same verdicts
    neg = {k: _row(k, {s: -x for s, x in r.finals.items()}, r.bytes_per_param) for k, r in _rows().items()}
    assert {k: x.passed for k, x in _verdicts(neg, higher_is_better=True).items()} == {
        k: x.passed for k, x in _verdicts(_rows()).items()}

    # a failed seed: the larger budget fails (a); a row with a diverged seed is no fitting uniform
    rows = _rows()
    rows["baoc_0.35"] = _row("baoc_0.35", {0: 1.0, 1: 1.1}, 2.8, {2: "diverged"})
    rows["int8"].failed = {2: "diverged"}
    v = _verdicts(rows)
    assert v["(a) BAOC 0.35 no worse than BAOC 0.25"].passed is False
    assert v["(b) BAOC 0.35 no worse than the best uniform that fits"].passed is False
    assert "int8" not in F.uniform_candidates(rows)
    # one seed has no standard error: not judged
    one = {k: _row(k, {0: r.finals[0]}, r.bytes_per_param) for k, r in _rows().items()}
    assert all(x.passed is None for k, x in _verdicts(one).items() if not k.startswith("(c)"))


def test_allocations_estimates_and_rows() -> None:
    assert F.flipped_blocks({0: {"a": "int8", "b": "fp32"}, 1: {"a": "int8", "b": "bf16"}, 2: {"a": "int8"}}) == ["b"]
    per_step = {"fp32": [0.02, 0.03, 0.025], "baoc_0.5": [0.04, 0.05]}
    assert F.estimate_seconds(per_step, "fp32", 1000) == pytest.approx(25.0)
    assert F.estimate_seconds(per_step, "baoc_0.05", 100) == pytest.approx(4.5)  # BAOC rows timed by BAOC rows
    assert F.estimate_seconds(per_step, "int8_factored", 1000) == pytest.approx(25.0)
    assert F.estimate_seconds({}, "fp32", 1000) is None

    # every registered AdamW format has a uniform row but offload, and each row holds its format
    assert set(F.UNIFORM_FORMATS.values()) | set(F.SKIPPED_FORMATS) == set(FORMATS)
    for name, fmt in F.UNIFORM_FORMATS.items():
        assert F.FRONTIER[name].make(_Probe()).formats()["net.weight"] == fmt, name
    assert list(F.BUDGETS.values()) == [0.5, 0.35, 0.25, 0.15, 0.1, 0.05]
    # additive to quality.py: the new rows are none of its rows, and its BAOC cache version covers them
    assert not set(FRONTIER_ROWS) & set(Q.ROWS) and Q.parse_args([]).rows == list(Q.ROWS)
    assert Q.run_config("char_gpt", "realistic", "baoc_0.05", 0, 1000)["baoc_version"] == Q.BAOC_CACHE_VERSION
    assert "baoc_version" not in Q.run_config("char_gpt", "realistic", "int8_factored", 0, 1000)


NUMBER = re.compile(r"[+-]?\d+\.\d+")


@pytest.mark.slow
def test_the_risk_models_order_of_uniform_formats_beside_their_realized_order() -> None:
    fp32 = _row("fp32", {0: 1.00, 1: 1.10}, 8.0)
    int8 = _row("int8", {0: 1.01, 1: 1.12}, 2.1)  # 0.015 worse on average
    fact = _row("factored", {0: 1.20, 1: 1.28}, 0.1)  # 0.19 worse
    nomo = _row("nomomentum_int8", {0: 1.05, 1: 1.14}, 1.1)  # 0.045 worse
    baoc = _row("baoc_0.25", {0: 1.0, 1: 1.1}, 2.0)
    # two risk tables, one block each: the model ranks factored below no-momentum (wrong)
    baoc.risk_tables = {0: {"a": {"int8": 0.01, "factored": 0.02, "nomomentum_int8": 0.05}},
                        1: {"a": {"int8": 0.03, "factored": 0.04, "nomomentum_int8": 0.07}}}
    rows = {"fp32": fp32, "int8": int8, "factored": fact, "nomomentum_int8": nomo, "baoc_0.25": baoc}
    order = {name: (pred, d.mean) for name, pred, d in F.risk_order(rows, higher_is_better=False)}
    assert order == {"int8": (pytest.approx(0.02), pytest.approx(0.015)), "factored": (pytest.approx(0.03), pytest.approx(0.19)),
                     "nomomentum_int8": (pytest.approx(0.06), pytest.approx(0.045))}
    assert F.rank_correlation([0.02, 0.03, 0.06], [0.015, 0.19, 0.045]) == pytest.approx(0.5)
    assert F.rank_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0) and F.rank_correlation([1, 2], [1, 2]) is None
    table = F.risk_order_table(rows, higher_is_better=False, scale=1.0)
    assert "+0.50 over 3 formats" in table and table.index("| int8 |") < table.index("| factored |") < table.index("| nomomentum_int8 |")
    # accuracy (higher is better): a lower accuracy is worse, so the sign turns
    acc = {k: _row(k, {s: 1 - v for s, v in r.finals.items()}, r.bytes_per_param) for k, r in rows.items()}
    acc["baoc_0.25"].risk_tables = baoc.risk_tables
    assert {n: d.mean for n, _, d in F.risk_order(acc, higher_is_better=True)}["factored"] == pytest.approx(0.19)


def test_small_run_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = ROOT / "docs" / "benchmarks" / "frontier.md"
    before = page.read_text()
    report = F.main(["--small", "--results-dir", str(tmp_path)])
    assert page.read_text() == before  # --small never writes the docs page
    files = sorted(tmp_path.rglob("*.json"))
    assert len(files) == len(F.SMALL["rows"]) * len(F.SMALL["seeds"])
    runs = {f.name: json.loads(f.read_text()) for f in files}
    assert all(r["status"] == "ok" and r["steps_done"] == 30 for r in runs.values())
    baoc = runs["baoc_0.15-seed0-steps30.json"]
    blocks = baoc["baoc_summary"]["formats"]
    assert baoc["baoc_summary"]["phase"] == "allocated" and set(blocks.values()) <= set(FORMATS) | {"mixed"}
    assert baoc["state_bytes"] <= 0.15 * 8 * baoc["params"] * 1.001

    # the rows' table: its third cell is the quality over both seeds
    table = [line for line in report.splitlines() if line.startswith("| ") and line.split(" | ")[2].endswith("(n=2)")]
    assert {line.split(" | ")[0][2:] for line in table} == {F.FRONTIER[r].label for r in F.SMALL["rows"]}
    verdicts = [line for line in report.splitlines() if re.match(r"\| \([abc]\) ", line)]
    assert [v[3] for v in verdicts] == ["a", "b", "b", "c"]
    for line in verdicts:
        assert NUMBER.search(line) and re.search(r"\| (pass|\*\*fail\*\*) \|$", line), line
    allocation = next(line for line in report.splitlines() if line.startswith("| 0.15 |"))
    assert f"({len(blocks)} blocks)" in allocation and "of 22" in allocation
    assert (tmp_path / "frontier-vit_digits.png").stat().st_size > 10_000

    # cached and resumable: a report trains nothing; a deleted run is the only one trained again
    stamps = {f: f.stat().st_mtime_ns for f in files}
    assert F.main(["--small", "--results-dir", str(tmp_path), "--report-only"]).count("| (") == 4
    files[0].unlink()
    capsys.readouterr()
    F.main(["--small", "--results-dir", str(tmp_path)])
    assert "1 runs to train" in capsys.readouterr().out
    assert all(f.stat().st_mtime_ns == stamps[f] for f in files[1:]) and files[0].exists()
    assert math.isfinite(json.loads(files[0].read_text())["final"])
