"""The allocation frontier: quality against optimizer-state bytes per parameter, BAOC at six memory budgets
beside every uniform AdamW state format, on the three example workloads.

For each workload of ``examples/workloads.py`` (``char_gpt``, ``ddpm_digits``, ``vit_digits``), its realistic
recipe (warm-up + cosine) and quality.py's 1000 steps, seeds 0, 1 and 2 train

- ``fp32``: the module's own ``torch.optim.AdamW``, the reference (8 bytes per parameter);
- every AdamW state format of ``BlockwiseAdamW`` (``lightning_baoc.formats.FORMATS``) on every tensor:
  ``blockwise_fp32``, ``bf16_momentum``, ``bf16``, ``nomomentum``, ``int8``, ``int8_factored``,
  ``nomomentum_int8``, ``factored``. ``offload`` has no row: its state is fp32 in host memory, the arithmetic
  of ``fp32``, so its quality is fp32's;
- the ``BAOC`` callback at memory budgets 0.5, 0.35, 0.25, 0.15, 0.1 and 0.05 of fp32 AdamW's state.

A run is quality.py's run (:func:`quality.run_cached`: the same training, the same cache
``benchmarks/runs/quality/<workload>/realistic/<row>-seed<s>-steps<n>.json``), so quality.py's runs of the rows
both measure are read, not trained again, and only the missing runs train; a cached run counts only where its
config is the one quality.py would write now. The rows quality.py has no row of are
``_quality_rows.FRONTIER_ROWS`` (not in quality.py's tables).

Per workload it writes

- a table: each row's state bytes per parameter (measured on the optimizer's tensors at the end of training,
  from the cached run), its final quality (mean ± standard error over the seeds), and differences paired on
  the seeds, each ± its standard error: against fp32 AdamW, for BAOC against the next larger budget and against
  the best uniform format that fits the budget (the best final quality among the uniform rows whose bytes per
  parameter are at most ``budget x 8``);
- the verdicts: (a) BAOC's quality does not get worse as the budget grows, beyond one standard error of each
  paired difference of adjacent budgets; (b) at each budget BAOC is no worse than the best fitting uniform
  format beyond one standard error; (c) BAOC at 0.15 is no more than 0.5% worse than fp32 AdamW's mean;
- the formats each seed's allocation gave the blocks (blocks per format), and the blocks whose format
  differs between seeds;
- a plot of quality against bytes per parameter (log axis): BAOC's curve beside the uniform formats, error
  bars of one standard error.

Quality is the workload's metric, as in quality.py: the held-out perplexity of the GPT, the held-out
denoising loss of the DDPM and the ViT's validation accuracy (its cached runs record no validation loss);
"worse" is signed by the metric's direction.

Run from the repository root:

    python benchmarks/frontier.py --docs                        # every missing run (~1.5 h on 2 CPUs), then the page
    python benchmarks/frontier.py --docs --max-seconds 3000     # as many runs as fit 50 minutes, then the page
    python benchmarks/frontier.py --report-only --docs          # tables and plots from the cached runs only
    python benchmarks/frontier.py --small                       # the small version: ViT, 2 seeds, 30 steps, a temp dir
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import torch
from _report import DOCS, command, examples_on_path, machine, markdown_table, write_docs_section

examples_on_path()

from _quality_rows import BAOC_BUDGETS, FRONTIER_BAOC_BUDGETS, FRONTIER_ROWS, ROWS, Row  # noqa: E402
from quality import (  # noqa: E402
    DEFAULT_STEPS, load_cached, machine_of, parse_steps, result_path, run_cached, run_config,
)
from workloads import WORKLOADS  # noqa: E402

from lightning_baoc.formats import FORMATS  # noqa: E402

HERE = Path(__file__).resolve().parent
PAGE = "benchmarks/frontier.md"  # the docs page (under docs/) the tables go to
SECTION = "frontier"
RECIPE = "realistic"
TASKS = ("char_gpt", "ddpm_digits", "vit_digits")
#: fp32 AdamW's state: two fp32 moments per parameter; a budget B allows B x this many bytes per parameter.
FP32_BYTES = 8.0
#: Uniform rows: one format on every tensor. ``offload`` has none (fp32 state on the host: fp32's arithmetic).
UNIFORM = ("fp32", "blockwise_fp32", "bf16_momentum", "bf16", "nomomentum", "int8", "int8_factored",
           "nomomentum_int8", "factored")
#: Which registered format each uniform row of BlockwiseAdamW holds (checked against FORMATS by the tests).
UNIFORM_FORMATS = {"blockwise_fp32": "fp32", "bf16_momentum": "bf16_momentum", "bf16": "bf16",
                   "nomomentum": "nomomentum", "int8": "int8", "int8_factored": "int8_factored",
                   "nomomentum_int8": "nomomentum_int8", "factored": "factored"}
SKIPPED_FORMATS = {"offload": "fp32 state in host memory: the arithmetic of fp32, so fp32's quality"}
#: BAOC rows, largest budget first.
BUDGETS: dict[str, float] = dict(sorted({**BAOC_BUDGETS, **FRONTIER_BAOC_BUDGETS}.items(), key=lambda kv: -kv[1]))
FRONTIER: dict[str, Row] = {name: {**ROWS, **FRONTIER_ROWS}[name] for name in (*UNIFORM, *BUDGETS)}
#: Done-when (c): BAOC at this budget no more than this fraction worse than fp32 AdamW's mean.
PARITY_ROW, PARITY = "baoc_0.15", 0.005
#: ``--small``: one workload, two seeds, 30 steps (BAOC allocates at step 20), rows enough for every verdict.
SMALL = dict(workloads=["vit_digits"], seeds=[0, 1], steps=["30"],
             rows=["fp32", "int8", "nomomentum_int8", "factored", "baoc_0.35", "baoc_0.15"])


# ------------------------------------------------------------------------------------ statistics


class Estimate(NamedTuple):
    """A mean over seeds with its standard error (``None`` with one value) and the number of values."""

    mean: float
    se: float | None
    n: int


def mean_se(values: Sequence[float]) -> Estimate | None:
    """Mean and standard error (sample std / sqrt(n)) of ``values``; None if empty.

    Example:
        >>> mean_se([1.0, 2.0, 3.0])
        Estimate(mean=2.0, se=0.5773502691896258, n=3)
    """
    if not values:
        return None
    n = len(values)
    return Estimate(statistics.fmean(values), statistics.stdev(values) / math.sqrt(n) if n > 1 else None, n)


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> Estimate | None:
    """``a - b`` paired on the seeds both have (seed -> value): the mean of the per-seed differences and its
    standard error; None without a common seed.

    Example:
        >>> paired_difference({0: 1.0, 1: 2.0, 2: 9.0}, {0: 0.5, 1: 1.5})
        Estimate(mean=0.5, se=0.0, n=2)
    """
    return mean_se([a[s] - b[s] for s in sorted(a.keys() & b.keys())])


def worse_by(d: Estimate, higher_is_better: bool) -> float:
    """How much worse the first side of the difference ``d`` is (negative: better), in the metric's units."""
    return -d.mean if higher_is_better else d.mean


def best_fitting_uniform(
    candidates: Mapping[str, tuple[float, float]], budget: float, higher_is_better: bool
) -> str | None:
    """The uniform row of best mean quality among those whose bytes per parameter fit ``budget`` (at most
    ``budget x 8``): ``candidates`` is row -> (bytes per parameter, mean quality); None if none fits.

    Example:
        >>> rows = {"int8": (2.2, 1.0), "factored": (0.1, 1.2), "nomomentum_int8": (1.1, 1.1)}
        >>> best_fitting_uniform(rows, 0.25, higher_is_better=False)  # int8's 2.2 bytes do not fit 0.25 x 8
        'nomomentum_int8'
    """
    fits = [(name, mean) for name, (bpp, mean) in candidates.items() if bpp <= budget * FP32_BYTES * (1 + 1e-12)]
    if not fits:
        return None
    return min(fits, key=lambda nm: -nm[1] if higher_is_better else nm[1])[0]


@dataclass
class RowRuns:
    """One row's cached runs on one workload.

    Attributes:
        name: Row name.
        finals: seed -> final quality, the runs that finished.
        failed: seed -> why a run has no final quality (``"diverged"``, ``"error: ..."``).
        bytes_per_param: state bytes per parameter, the mean over the runs (None: no run).
        seconds: wall seconds of each run.
        blocks: seed -> block -> format of the allocation BAOC ended with (the runs that recorded it).
        tensors: seed -> format -> parameter tensors (quality.py's ``formats``, every BlockwiseAdamW run).
        params: the model's parameters.
        risk_tables: seed -> the risk table (block -> format -> risk) BAOC's first allocation solved.
    """

    name: str
    finals: dict[int, float] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    bytes_per_param: float | None = None
    seconds: list[float] = field(default_factory=list)
    blocks: dict[int, dict[str, str]] = field(default_factory=dict)
    tensors: dict[int, dict[str, int]] = field(default_factory=dict)
    params: int | None = None
    risk_tables: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)

    @property
    def estimate(self) -> Estimate | None:
        """Mean quality ± standard error over the finished seeds (None while a seed failed: no mean to trust)."""
        return None if self.failed else mean_se([self.finals[s] for s in sorted(self.finals)])


def collect(results: Mapping[int, dict[str, Any]], name: str) -> RowRuns:
    """A row's :class:`RowRuns` from its cached results (seed -> the run's JSON)."""
    out = RowRuns(name)
    per_param = []
    for seed, r in sorted(results.items()):
        if r.get("status") == "error":
            out.failed[seed] = f"error: {r.get('error', '')}"
            continue
        out.params = r["params"]
        per_param.append(r["state_bytes"] / r["params"])
        out.seconds.append(r["seconds"])
        if r["status"] == "diverged" or r.get("final") is None:
            out.failed[seed] = "diverged"
        else:
            out.finals[seed] = float(r["final"])
        if r.get("baoc_summary"):
            out.blocks[seed] = dict(r["baoc_summary"]["formats"])
        if r.get("formats"):
            out.tensors[seed] = dict(r["formats"])
        if r.get("allocations"):
            out.risk_tables[seed] = r["allocations"][0]["risk"]
    out.bytes_per_param = statistics.fmean(per_param) if per_param else None
    return out


@dataclass(frozen=True)
class Verdict:
    """One line of the verdict table: the check, pass (True) / fail (False) / not judged (None), the numbers."""

    check: str
    passed: bool | None
    measured: str


def _decimals(se: float | None, value: float) -> int:
    """Decimals that show ``se`` to two significant digits (``value`` to four where there is no se)."""
    ref = se if se else abs(value)
    return max(0, 1 - math.floor(math.log10(ref))) + (0 if se else 2) if ref else 4


def _pm(mean: float, se: float | None, sign: str = "") -> str:
    """``mean ± se`` with the se's two significant digits (``sign="+"``: signed)."""
    d = _decimals(se, mean)
    return f"{mean:{sign}.{d}f}" + (f" ± {se:.{d}f}" if se is not None else "")


def _fmt_diff(d: Estimate, scale: float) -> str:
    se = None if d.se is None else d.se * scale
    return _pm(d.mean * scale, se, "+") + (f" (n={d.n})" if se is not None else " (1 seed: no se)")


def uniform_candidates(rows: Mapping[str, RowRuns]) -> dict[str, tuple[float, float]]:
    """Uniform rows with a mean over finished seeds, no failed seed and measured bytes: row -> (bytes/param, mean)."""
    return {name: (r.bytes_per_param, est.mean) for name, r in rows.items()
            if name in UNIFORM and r.bytes_per_param is not None and (est := r.estimate) is not None}


def judge(rows: Mapping[str, RowRuns], higher_is_better: bool, scale: float = 1.0) -> list[Verdict]:
    """The issue's three checks on one workload's rows (row name -> :class:`RowRuns`).

    (a) for adjacent budgets (the BAOC rows present), the larger budget is not worse than the smaller by more
    than one standard error of their paired difference; (b) at each budget, BAOC is not worse than the best
    uniform row that fits (:func:`best_fitting_uniform`) by more than one standard error of their paired
    difference; (c) BAOC at 0.15 is at most 0.5% worse than fp32 AdamW's mean (paired on the seeds). A
    difference of one seed has no standard error: that check is not judged. ``scale``: the numbers' display
    (100 for accuracy in %).
    """
    out: list[Verdict] = []
    baoc = [name for name in BUDGETS if name in rows and (rows[name].finals or rows[name].failed)]
    for large, small in zip(baoc, baoc[1:]):
        check = f"(a) BAOC {BUDGETS[large]:g} no worse than BAOC {BUDGETS[small]:g}"
        if rows[large].failed:
            out.append(Verdict(check, False, f"BAOC {BUDGETS[large]:g}: {_failures(rows[large])}"))
            continue
        if rows[small].failed:
            out.append(Verdict(check, True, f"BAOC {BUDGETS[small]:g}: {_failures(rows[small])}"))
            continue
        d = paired_difference(rows[large].finals, rows[small].finals)
        out.append(_within_se(check, d, higher_is_better, scale, f"BAOC {BUDGETS[large]:g} - BAOC {BUDGETS[small]:g}"))
    candidates = uniform_candidates(rows)
    for name in baoc:
        budget = BUDGETS[name]
        best = best_fitting_uniform(candidates, budget, higher_is_better)
        check = f"(b) BAOC {budget:g} no worse than the best uniform that fits"
        if rows[name].failed:
            out.append(Verdict(check, False, f"BAOC {budget:g}: {_failures(rows[name])}"))
        elif best is None:
            out.append(Verdict(check, None, f"no uniform row fits {budget * FP32_BYTES:g} bytes / param"))
        else:
            d = paired_difference(rows[name].finals, rows[best].finals)
            out.append(_within_se(check, d, higher_is_better, scale,
                                  f"BAOC {budget:g} - {best} ({candidates[best][0]:.3g} B/param)"))
    if PARITY_ROW in rows and "fp32" in rows and (rows[PARITY_ROW].finals or rows[PARITY_ROW].failed):
        check = f"(c) BAOC {BUDGETS[PARITY_ROW]:g} within {PARITY:.1%} of fp32 AdamW"
        ref = rows["fp32"].estimate
        if rows[PARITY_ROW].failed:
            out.append(Verdict(check, False, f"BAOC {BUDGETS[PARITY_ROW]:g}: {_failures(rows[PARITY_ROW])}"))
        elif ref is None or (d := paired_difference(rows[PARITY_ROW].finals, rows["fp32"].finals)) is None:
            out.append(Verdict(check, None, "fp32 AdamW: no finished seed in common"))
        else:
            rel = worse_by(d, higher_is_better) / abs(ref.mean)
            out.append(Verdict(check, rel <= PARITY, f"BAOC {BUDGETS[PARITY_ROW]:g} - fp32: {_fmt_diff(d, scale)}; "
                               f"{abs(rel):.2%} {'worse' if rel > 0 else 'better'} than fp32's "
                               f"{_pm(ref.mean * scale, None)} (limit: {PARITY:.1%} worse)"))
    return out


def _within_se(check: str, d: Estimate | None, higher_is_better: bool, scale: float, what: str) -> Verdict:
    if d is None:
        return Verdict(check, None, f"{what}: no finished seed in common")
    if d.se is None:
        return Verdict(check, None, f"{what}: {_fmt_diff(d, scale)}")
    worse = worse_by(d, higher_is_better)
    if worse <= 0:
        return Verdict(check, True, f"{what}: {_fmt_diff(d, scale)}; no worse")
    return Verdict(check, worse <= d.se, f"{what}: {_fmt_diff(d, scale)}; worse, "
                   f"{'within' if worse <= d.se else 'beyond'} one se")


def _failures(r: RowRuns) -> str:
    return ", ".join(f"seed {s} {why}" for s, why in sorted(r.failed.items()))


# ---------------------------------------------------------------------------------------- tables


def _scale(w: str) -> tuple[float, str]:
    return (100.0, "%") if WORKLOADS[w].quality_label == "accuracy" else (1.0, "")


def _fmt_quality(r: RowRuns, w: str, seeds: Sequence[int]) -> str:
    scale, unit = _scale(w)
    if not r.finals and not r.failed:
        return "not run"
    parts = []
    if (est := mean_se([r.finals[s] for s in sorted(r.finals)])) is not None:
        parts.append(f"{_pm(est.mean * scale, None if est.se is None else est.se * scale)}{unit} (n={est.n})")
    if r.failed:
        parts.append(_failures(r))
    missing = [s for s in seeds if s not in r.finals and s not in r.failed]
    if missing:
        parts.append(f"seeds {', '.join(map(str, missing))} not run")
    return "; ".join(parts)


def task_table(w: str, rows: Mapping[str, RowRuns], seeds: Sequence[int]) -> str:
    """One workload's table: bytes per parameter, quality, and the paired differences (each ± se)."""
    cls = WORKLOADS[w]
    scale, unit = _scale(w)
    candidates = uniform_candidates(rows)
    present = [name for name in BUDGETS if name in rows]
    lines = []
    for name, r in rows.items():
        fp32 = rows.get("fp32")
        vs_fp32 = paired_difference(r.finals, fp32.finals) if fp32 is not None and name != "fp32" else None
        vs_larger = vs_best = None
        best = None
        if name in BUDGETS:
            i = present.index(name)
            if i > 0:
                vs_larger = paired_difference(r.finals, rows[present[i - 1]].finals)
            best = best_fitting_uniform(candidates, BUDGETS[name], cls.higher_is_better)
            if best is not None:
                vs_best = paired_difference(r.finals, rows[best].finals)
        lines.append([
            FRONTIER[name].label,
            f"{r.bytes_per_param:.3f}" if r.bytes_per_param is not None else "-",
            _fmt_quality(r, w, seeds),
            _fmt_diff(vs_fp32, scale) if vs_fp32 else "-",
            (f"{_fmt_diff(vs_larger, scale)} (vs {BUDGETS[present[present.index(name) - 1]]:g})" if vs_larger else "-"),
            (f"{_fmt_diff(vs_best, scale)} (vs {best})" if vs_best else ("none fits" if name in BUDGETS else "-")),
            f"{statistics.median(r.seconds):.0f}" if r.seconds else "-",
        ])
    metric = f"{cls.quality_label}{' (%)' if unit else ''}"
    headers = ["row", "bytes / param", f"{metric}: mean ± se", "- fp32 AdamW (paired)", "- next larger budget",
               "- best uniform that fits", "s / run"]
    return markdown_table(headers, lines)


def verdict_table(verdicts: Sequence[Verdict]) -> str:
    """The verdicts as a table: check, measured, pass / fail / not judged."""
    word = {True: "pass", False: "**fail**", None: "not judged"}
    return markdown_table(["check", "measured", "verdict"], [[v.check, v.measured, word[v.passed]] for v in verdicts])


def _counts(counts: Mapping[str, int]) -> str:
    """``"fp32 15, bf16 16"``: format -> count in the registry's order of formats (others, e.g. "mixed", last)."""
    order = {name: i for i, name in enumerate(FORMATS)}
    return ", ".join(f"{fmt} {n}" for fmt, n in sorted(counts.items(), key=lambda kv: (order.get(kv[0], 99), kv[0])))


def flipped_blocks(blocks: Mapping[int, Mapping[str, str]]) -> list[str]:
    """Blocks whose format differs between the seeds' allocations (seed -> block -> format).

    Example:
        >>> flipped_blocks({0: {"a": "int8", "b": "fp32"}, 1: {"a": "int8", "b": "bf16"}})
        ['b']
    """
    names = sorted(set().union(*(set(b) for b in blocks.values()))) if blocks else []
    return [n for n in names if len({b.get(n) for b in blocks.values()}) > 1]


def allocation_table(rows: Mapping[str, RowRuns], seeds: Sequence[int]) -> str:
    """Per budget and seed, the formats BAOC's allocation gave: blocks per format (parameter tensors per
    format, marked, for the runs that predate the per-block record), and the blocks whose format differs
    between the seeds."""
    lines = []
    for name in BUDGETS:
        r = rows.get(name)
        if r is None or not (r.blocks or r.tensors):
            continue
        cells = []
        for s in seeds:
            if s in r.blocks:
                cells.append(f"{_counts(Counter(r.blocks[s].values()))} ({len(r.blocks[s])} blocks)")
            elif s in r.tensors:
                cells.append(f"{_counts(r.tensors[s])} (parameter tensors)")
            else:
                cells.append("-")
        if len(r.blocks) > 1 and all(s in r.blocks for s in r.tensors):
            flips = flipped_blocks(r.blocks)
            total = len(set().union(*(set(b) for b in r.blocks.values())))
            named = f": {', '.join(flips[:6])}{', ...' if len(flips) > 6 else ''}" if flips else ""
            flip = f"{len(flips)} of {total}{named}"
        else:
            flip = "- (per-block allocation not recorded)" if len(r.tensors) > 1 else "-"
        lines.append([f"{BUDGETS[name]:g}", *cells, flip])
    if not lines:
        return ""
    return markdown_table(["budget", *(f"seed {s}" for s in seeds), "blocks whose format differs between seeds"], lines)


# ---------------------------------------------------------------------------- predicted vs realized


def uniform_risk(risk: Mapping[str, Mapping[str, float]], fmt: str) -> float | None:
    """The total risk a risk table (block -> format -> risk) gives ``fmt`` on every block; None where a block
    does not offer it.

    Example:
        >>> uniform_risk({"a": {"fp32": 0.0, "int8": 0.1}, "b": {"fp32": 0.0, "int8": 0.25}}, "int8")
        0.35
    """
    values = [row.get(fmt) for row in risk.values()]
    return None if not values or any(v is None for v in values) else math.fsum(values)


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation of ``x`` and ``y`` (ties share their mean rank); None under 3 pairs or
    where one side is constant.

    Example:
        >>> rank_correlation([1, 2, 3, 4], [10, 30, 20, 40])
        0.8
    """
    if len(x) < 3:
        return None

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    if len(set(rx)) == 1 or len(set(ry)) == 1:
        return None
    return statistics.correlation(rx, ry)


def risk_order(rows: Mapping[str, RowRuns], higher_is_better: bool) -> list[tuple[str, float, Estimate]]:
    """Per uniform format with runs and a prediction: (row, the risk the model predicts for it on every
    block, the mean over every BAOC run's first risk table; how much worse than fp32 AdamW it trained, paired
    on the seeds, in the metric's units, positive = worse)."""
    tables = [t for name in BUDGETS if name in rows for t in rows[name].risk_tables.values()]
    out = []
    for name, fmt in UNIFORM_FORMATS.items():
        r = rows.get(name)
        if r is None or not r.finals or "fp32" not in rows or not tables:
            continue
        predicted = [u for t in tables if (u := uniform_risk(t, fmt)) is not None]
        d = paired_difference(r.finals, rows["fp32"].finals)
        if predicted and d is not None:
            sign = -1.0 if higher_is_better else 1.0
            out.append((name, statistics.fmean(predicted), Estimate(sign * d.mean, d.se, d.n)))
    return out


def risk_order_table(rows: Mapping[str, RowRuns], higher_is_better: bool, scale: float) -> str:
    """The uniform formats ordered by the risk the model predicts beside how much worse each trained: does the
    model rank the feasible uniform allocations as their quality does? With Spearman's rank correlation."""
    order = risk_order(rows, higher_is_better)
    if not order:
        return ""
    order.sort(key=lambda t: t[1])
    lines = [[name, f"{pred:.3g}", _pm(d.mean * scale, None if d.se is None else d.se * scale)]
             for name, pred, d in order]
    rho = rank_correlation([p for _, p, _ in order], [d.mean for _, _, d in order])
    n_tables = sum(len(rows[name].risk_tables) for name in BUDGETS if name in rows)
    return (markdown_table(["uniform row", "predicted risk (model)", "worse than fp32 AdamW (paired)"], lines)
            + f"\n\nPredicted: the total risk of the format on every block, the mean over {n_tables} risk tables "
            f"(each BAOC run's first allocation). Spearman's rank correlation of predicted and realized: "
            f"{'n/a' if rho is None else f'{rho:+.2f}'} over {len(order)} formats.")


# ------------------------------------------------------------------------------------------ plot


def save_frontier_plot(w: str, rows: Mapping[str, RowRuns], path: Path) -> None:
    """Quality against state bytes per parameter (log x) on one workload: BAOC's curve over its budgets beside
    the uniform rows, error bars of one standard error. A point far off fp32's (accuracy under half of it, a
    loss over 1.5 times it) is drawn at the panel's edge with a triangle and its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    cls = WORKLOADS[w]
    scale, unit = _scale(w)
    higher = cls.higher_is_better
    ref = rows["fp32"].estimate.mean if "fp32" in rows and rows["fp32"].estimate else None

    def far(y: float) -> bool:
        return ref is not None and ((y < 0.5 * ref) if higher else (y > 1.5 * ref))

    points = {name: (r.bytes_per_param, est) for name, r in rows.items() if r.bytes_per_param is not None
              and (est := mean_se([r.finals[s] for s in sorted(r.finals)])) is not None}
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    near = [(est.mean, est.se or 0.0) for _, est in points.values() if not far(est.mean)]
    if near:
        lo, hi = min(y - e for y, e in near) * scale, max(y + e for y, e in near) * scale
        pad = 0.12 * (hi - lo) + 1e-3 * abs(hi)
        ax.set_ylim(lo - pad, hi + pad)
    edge = ax.get_ylim()[0] if higher else ax.get_ylim()[1]
    palette = [plt.get_cmap("tab10")(i) for i in (0, 1, 2, 4, 5, 6, 8, 9)]  # tab10 without red (BAOC's) and grey
    uniform = [n for n in UNIFORM if n in points]
    for name in BUDGETS:  # each budget's cap: the uniform rows left of its line fit it
        if name in rows:
            ax.axvline(BUDGETS[name] * FP32_BYTES, color="crimson", alpha=0.15, linestyle=":", linewidth=1)
    for i, name in enumerate(uniform):
        x, est = points[name]
        color = "black" if name == "fp32" else palette[i % len(palette)]
        if far(est.mean):
            ax.plot(x, edge, "v" if higher else "^", color=color, markersize=9, clip_on=False)
            ax.annotate(f"{name} {est.mean * scale:.3g}", (x, edge), fontsize=7, xytext=(4, 4 if higher else -10),
                        textcoords="offset points")
            continue
        ax.errorbar(x, est.mean * scale, yerr=(est.se or 0.0) * scale, fmt="s", color=color, capsize=3,
                    label=FRONTIER[name].label)
    curve = sorted((points[n][0], points[n][1], BUDGETS[n]) for n in BUDGETS
                   if n in points and not far(points[n][1].mean))
    if curve:
        ax.errorbar([x for x, _, _ in curve], [e.mean * scale for _, e, _ in curve],
                    yerr=[(e.se or 0.0) * scale for _, e, _ in curve], fmt="o-", color="crimson", capsize=3,
                    linewidth=1.8, label="BAOC (budgets)")
        for x, e, b in curve:
            ax.annotate(f"{b:g}", (x, e.mean * scale), fontsize=7, xytext=(4, -10 if higher else 5),
                        textcoords="offset points", color="crimson")
    ax.set_xscale("log")
    ticks = [t for t in (0.05, 0.1, 0.2, 0.5, 1, 2, 4, 8) if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("optimizer-state bytes per parameter (fp32 AdamW: 8)")
    ax.set_ylabel(f"{cls.quality_label}{' (%)' if unit else ''}, {'higher' if higher else 'lower'} is better")
    ax.set_title(f"{w}: quality against optimizer-state bytes (mean ± se over seeds)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- runs


def load_rows(results_dir: Path, w: str, rows: Sequence[str], seeds: Sequence[int], steps: int) -> dict[str, RowRuns]:
    """Every row's cached runs of one workload (those whose config is the one quality.py writes now)."""
    out = {}
    for name in rows:
        found = {s: r for s in seeds if (r := load_cached(results_dir, w, RECIPE, name, s, steps)) is not None}
        out[name] = collect(found, name)
    return out


def predates_block_record(result: dict[str, Any]) -> bool:
    """A BAOC run cached before runs recorded their allocation per block and the risk tables it solved
    (``baoc_summary``, ``allocations``): trained by a BAOC of before 2026-12, whose instruments were not yet sized from the state they watch (docs/benchmarks/quality.md)."""
    return result["config"]["row"] in BUDGETS and result.get("status") != "error" and "allocations" not in result


def missing_runs(results_dir: Path, workloads: Sequence[str], rows: Sequence[str], seeds: Sequence[int],
                 steps: Mapping[str, int], refresh_baoc: bool = False) -> list[tuple[str, str, int, str]]:
    """The runs to train, in the order they train (seed, workload, row): (workload, row, seed, why), why
    ``"absent"`` (no file), ``"stale"`` (a file whose config is not the one quality.py writes now) or, with
    ``refresh_baoc``, ``"refresh"`` (a BAOC run cached before runs recorded their allocation per block)."""
    out = []
    for seed in seeds:
        for w in workloads:
            for name in rows:
                found = load_cached(results_dir, w, RECIPE, name, seed, steps[w])
                if found is None:
                    path = result_path(results_dir, run_config(w, RECIPE, name, seed, steps[w]))
                    out.append((w, name, seed, "stale" if path.exists() else "absent"))
                elif refresh_baoc and predates_block_record(found):
                    out.append((w, name, seed, "refresh"))
    return out


def seconds_per_step(results_dir: Path, w: str) -> dict[str, list[float]]:
    """Row -> wall seconds per step of each cached run of ``w`` (any seed, any length) that recorded its time."""
    out: dict[str, list[float]] = {}
    for path in sorted((results_dir / w / RECIPE).glob("*.json")):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        steps = r.get("steps_done") or r.get("config", {}).get("steps")
        if r.get("seconds") and steps:
            out.setdefault(r["config"]["row"], []).append(r["seconds"] / steps)
    return out


def estimate_seconds(per_step: Mapping[str, Sequence[float]], row: str, steps: int) -> float | None:
    """A run's expected wall seconds: the median seconds per step of the row's cached runs, else of the runs of
    its kind (BAOC or not), else of any run, times ``steps``; None where nothing was timed.

    Example:
        >>> estimate_seconds({"fp32": [0.02, 0.03, 0.025], "baoc_0.5": [0.04]}, "baoc_0.1", 1000)
        40.0
    """
    is_baoc = row in BUDGETS
    for pool in ([row], [r for r in per_step if r.startswith("baoc_") == is_baoc], list(per_step)):
        times = [t for r in pool for t in per_step.get(r, [])]
        if times:
            return statistics.median(times) * steps
    return None


def train_missing(args: argparse.Namespace, steps: Mapping[str, int], start: float) -> tuple[int, list[str]]:
    """Train the missing runs (seed by seed, so a cut run leaves whole seeds), stopping before a run that would
    end after ``--max-seconds``; returns the runs trained and what was left."""
    todo = missing_runs(args.results_dir, args.workloads, args.rows, args.seeds, steps, args.refresh_baoc)
    per_step = {w: seconds_per_step(args.results_dir, w) for w in args.workloads}
    total = sum(estimate_seconds(per_step[w], row, steps[w]) or 0.0 for w, row, _, _ in todo)
    unknown = sum(1 for w, row, _, _ in todo if estimate_seconds(per_step[w], row, steps[w]) is None)
    print(f"{len(todo)} runs to train, about {total / 60:.0f} min by the cached runs' times"
          + (f" ({unknown} with no cached run to time them by)" if unknown else ""), flush=True)
    trained, left = 0, []
    for i, (w, name, seed, why) in enumerate(todo):
        est = estimate_seconds(per_step[w], name, steps[w])
        elapsed = time.perf_counter() - start
        if args.max_seconds is not None and est is not None and elapsed + est > args.max_seconds:
            left = [f"{w} {n} seed {s}" for w, n, s, _ in todo[i:]]
            print(f"--max-seconds {args.max_seconds:g}: {elapsed:.0f} s spent, {w} {name} seed {seed} would take about "
                  f"{est:.0f} s; stopping with {len(left)} runs left", flush=True)
            break
        result = run_cached(args.results_dir, w, RECIPE, FRONTIER[name], seed, steps[w], rerun=why == "refresh")
        trained += 1
        if "seconds" in result and result.get("steps_done"):
            per_step[w].setdefault(name, []).append(result["seconds"] / result["steps_done"])
        final = result.get("final")
        print(f"{w} {name} seed {seed} ({why}): {result['status']}"
              + (f", {WORKLOADS[w].quality_metric} {final:.4f}" if final is not None else "")
              + (f", {result['state_bytes'] / result['params']:.3f} B/param, {result['seconds']:.0f} s"
                 if "seconds" in result else ""), flush=True)
    return trained, left


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=TASKS, default=list(TASKS), help="(default: all three)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="(default: 0 1 2)")
    parser.add_argument("--rows", nargs="+", choices=list(FRONTIER), default=list(FRONTIER),
                        help="(default: all; fp32 AdamW, the reference, is always added)")
    parser.add_argument("--steps", nargs="+", default=None,
                        help=f"N for all workloads or WORKLOAD=N (default: quality.py's {DEFAULT_STEPS})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1, as quality.py)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop before starting a run that would end after this many seconds of this command, "
                        "estimated from the cached runs' times (default: no limit)")
    parser.add_argument("--results-dir", type=Path, default=HERE / "runs" / "quality",
                        help="quality.py's cache of runs (default: benchmarks/runs/quality)")
    parser.add_argument("--refresh-baoc", action=argparse.BooleanOptionalAction, default=True,
                        help="train again the BAOC runs cached before runs recorded their allocation per block (a "
                        "BAOC of before 2026-12: docs/benchmarks/quality.md says they are to be trained again), so "
                        "every budget is today's BAOC; overwrites those files of quality.py's cache; resumable "
                        "(default: on)")
    parser.add_argument("--report-only", action="store_true", help="no training: tables from the cached runs")
    parser.add_argument("--docs", action="store_true", help=f"write the tables into docs/{PAGE}, the plots beside it")
    parser.add_argument("--small", action="store_true",
                        help="the small version: vit_digits, seeds 0 1, 30 steps, 6 rows, a temporary results dir "
                        "unless --results-dir; writes no docs page")
    args = parser.parse_args(argv)
    if args.small:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        for key, value in SMALL.items():
            if f"--{key}" not in given:
                setattr(args, key, value)
        if "--results-dir" not in given:
            args.results_dir = Path(tempfile.mkdtemp(prefix="frontier-small-"))
        args.docs = False
    if "fp32" not in args.rows:
        args.rows = ["fp32", *args.rows]
    args.rows = [name for name in FRONTIER if name in args.rows]  # uniform rows, then budgets, largest first
    return args


def _shown(path: Path) -> str:
    """``path`` relative to the repository root where it is inside it."""
    rel = os.path.relpath(path.resolve(), HERE.parent)
    return str(path) if rel.startswith("..") else rel


def report(args: argparse.Namespace, steps: Mapping[str, int], left: Sequence[str]) -> str:
    """The page section: per workload the table, the verdicts, the allocations and the plot."""
    parts, results = [], []
    for w in args.workloads:
        rows = load_rows(args.results_dir, w, args.rows, args.seeds, steps[w])
        results += [r for name in args.rows for s in args.seeds
                    if (r := load_cached(args.results_dir, w, RECIPE, name, s, steps[w])) is not None]
        cls = WORKLOADS[w]
        scale, _ = _scale(w)
        params = next((r.params for r in rows.values() if r.params), None)
        plot = (DOCS / PAGE).parent / f"frontier-{w}.png" if args.docs else args.results_dir / f"frontier-{w}.png"
        if any(r.finals for r in rows.values()):
            save_frontier_plot(w, rows, plot)
        verdicts = verdict_table(judge(rows, cls.higher_is_better, scale))
        allocations = allocation_table(rows, args.seeds)
        ordering = risk_order_table(rows, cls.higher_is_better, scale)
        image = (f"![{w}: quality against bytes per parameter]({os.path.relpath(plot, (DOCS / PAGE).parent)})"
                 if args.docs else f"Plot: `{plot}`")
        parts.append(
            f"### {w}\n\n{params or 0:,} parameters; {steps[w]} steps, {RECIPE} recipe; quality: "
            f"{cls.quality_label} (`{cls.quality_metric}`, {'higher' if cls.higher_is_better else 'lower'} is better"
            f"{', in %' if scale != 1 else ''}).\n\n{task_table(w, rows, args.seeds)}\n\n"
            f"Verdicts on {w}:\n\n{verdicts}\n\n"
            + (f"Allocations (blocks per format at the end of training):\n\n{allocations}\n\n" if allocations else "")
            + (f"The risk model's order of the uniform formats against their realized order:\n\n{ordering}\n\n"
               if ordering else "")
            + image
        )
    missing = missing_runs(args.results_dir, args.workloads, args.rows, args.seeds, steps)
    stale = sum(1 for *_, why in missing if why == "stale")
    tail = (f"Missing: {len(missing)} runs ({stale} of them cached with another config), "
            f"trained by the same command without `--report-only`." if missing else "Every run is cached.")
    if left:
        tail += f" Stopped by --max-seconds before {len(left)} of them."
    old = [r for r in results if predates_block_record(r)]
    if old:
        n_baoc = sum(1 for r in results if r["config"]["row"] in BUDGETS)
        tail += (f" {len(old)} of the {n_baoc} BAOC runs were cached before runs recorded their allocation per block "
                 "(their allocations above count parameter tensors): trained by the BAOC of their date, before its "
                 "instruments were sized from the state they watch ([Quality](quality.md)); the command without "
                 "`--no-refresh-baoc` trains them again.")
    skipped = "; ".join(f"`{k}`: {v}" for k, v in SKIPPED_FORMATS.items())
    trained_on, here = machine_of(results), machine()
    machines = (f"Machine: {here}." if trained_on == here
                else f"Runs trained on: {trained_on}. Report written on: {here}.")
    return (
        "## The frontier on three workloads\n\n"
        f"{machines} Command: `{command()}`\n\n"
        "Each run is quality.py's (the workload's unchanged module and recipe, the row's optimizer; BAOC rows add "
        "`BAOC(memory_budget=B, warmup_steps=max(20, steps // 5), seed=seed)`), read from its cache "
        f"`{_shown(args.results_dir)}/<workload>/{RECIPE}/`. Bytes / param: the optimizer state measured on its "
        "tensors at the end of training over the parameters (fp32 AdamW: 8). Mean ± se: over the seeds' final "
        "validations, se = sample std / sqrt(n). Differences are paired on the seeds (row minus the named row, in "
        "the metric's units: for accuracy a positive difference is better, for a loss or perplexity a negative "
        "one), ± the standard error of the per-seed differences. The best uniform that fits: the best mean among "
        "the uniform rows whose bytes / param are at most budget x 8. Verdicts: (a) the larger of two adjacent "
        "budgets is not worse by more than one se of their paired difference; (b) BAOC is not worse than the best "
        f"uniform that fits by more than one se; (c) BAOC {BUDGETS[PARITY_ROW]:g} is at most {PARITY:.1%} worse "
        f"than fp32 AdamW's mean. Formats without a row: {skipped}.\n\n"
        + "\n\n".join(parts) + f"\n\n{tail}"
    )


def main(argv: list[str] | None = None) -> str:
    """Train the missing runs (unless ``--report-only``) and return the report (markdown)."""
    start = time.perf_counter()
    args = parse_args(argv)
    steps = parse_steps(args.steps, args.workloads)
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    left: list[str] = []
    if not args.report_only:
        _, left = train_missing(args, steps, start)
    text = report(args, steps, left)
    print(text)
    if args.docs:
        write_docs_section(PAGE, SECTION, text)
    return text


if __name__ == "__main__":
    main()
