"""``quality.py``'s summaries of cached runs: each row's quality over the seeds, the steps to reach fp32's
quality, the targets judged on a workload's runs, and the plot of state bytes against quality."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _report import examples_on_path, markdown_table

examples_on_path()

from _quality_rows import BAOC_BUDGETS, ROWS  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

# -------------------------------------------------------------------------------- summarizing


@dataclass
class Summary:
    """The seeds of one (workload, recipe, row) reduced to table cells."""

    runs: int = 0
    finals: list[float] | None = None
    diverged: int = 0
    errors: list[str] | None = None
    state_bytes: list[int] | None = None
    params: int | None = None
    curve: list[tuple[int, float]] | None = None
    seconds: list[float] | None = None


def summarize(results: list[dict[str, Any]]) -> Summary:
    """Final qualities, divergences, state bytes and the seed-mean curve of a row's runs."""
    s = Summary(runs=len(results), finals=[], errors=[], state_bytes=[], seconds=[])
    curves = []
    for r in results:
        if r["status"] == "error":
            s.errors.append(r["error"])
            continue
        s.params = r["params"]
        s.state_bytes.append(r["state_bytes"])
        s.seconds.append(r["seconds"])
        if r["status"] == "diverged":
            s.diverged += 1
        else:
            s.finals.append(r["final"])
            curves.append({step: value for step, value in r["curve"]})
    if curves:
        common = sorted(set.intersection(*(set(c) for c in curves)))
        s.curve = [(step, statistics.fmean(c[step] for c in curves)) for step in common]
    return s


def steps_to_reach(curve: list[tuple[int, float]] | None, target: float, higher_is_better: bool) -> int | None:
    """First step of ``curve`` at least as good as ``target``; None if never."""
    for step, value in curve or []:
        if (value >= target) if higher_is_better else (value <= target):
            return step
    return None


def _num(value: float, digits: int) -> str:
    return f"{value:.3g}" if abs(value) >= 1e4 else f"{value:.{digits}f}"


def _fmt_quality(s: Summary, label: str) -> str:
    if s.runs == 0:
        return "not run"
    if s.errors and len(s.errors) == s.runs:
        return f"error: {s.errors[0]}"
    parts = []
    if s.finals:
        digits = 2 if label == "accuracy" else (3 if label == "perplexity" else 4)
        scale = 100.0 if label == "accuracy" else 1.0
        unit = "%" if label == "accuracy" else ""
        values = [v * scale for v in s.finals]
        std = f" ± {_num(statistics.stdev(values), digits)}{unit}" if len(values) > 1 else ""
        parts.append(f"{_num(statistics.fmean(values), digits)}{unit}{std} (n={len(values)})")
    if s.diverged:
        parts.append(f"diverged in {s.diverged}/{s.runs - len(s.errors or [])}")
    if s.errors:
        parts.append(f"error in {len(s.errors)}")
    return "; ".join(parts)


def _fmt_bytes(values: list[int] | None, params: int | None) -> tuple[str, str]:
    if not values or not params:
        return "-", "-"
    lo, hi = min(values), max(values)
    fp32 = 8 * params
    if lo == hi:
        return f"{lo:,}", f"{lo / fp32:.3f}"
    mean = statistics.fmean(values)
    return f"{mean:,.0f} ({lo:,}-{hi:,})", f"{mean / fp32:.3f}"


#: A row "fits" a BAOC budget when its measured state is at most this much over the budget.
FIT_TOLERANCE = 0.01
#: Rows that are one format for every tensor (what "uniform formats that fit" means).
_UNIFORM = ("bf16", "fp16_nomomentum", "int8", "nomomentum", "factored")
#: Where int8 has not been measured: the budget below which uniform int8 does not fit.
INT8_RATIO = 0.27


def _mean_sd(s: Summary) -> tuple[float, float, int] | None:
    """Mean, sample std and count of a row's finite finals; None without finals (or with a diverged seed)."""
    if not s.finals or s.diverged:
        return None
    return statistics.fmean(s.finals), statistics.stdev(s.finals) if len(s.finals) > 1 else 0.0, len(s.finals)


def _noise(a: tuple[float, float, int], b: tuple[float, float, int]) -> float:
    """Two standard errors of the difference of two seed means."""
    return 2.0 * math.sqrt(a[1] ** 2 / a[2] + b[1] ** 2 / b[2])


def targets_table(w: str, sums: dict[tuple[str, str], Summary], rows: list[str], recipes: list[str]) -> str:
    """The quality targets, judged on the cached runs of one workload.

    * parity: BAOC at 0.35 worse than fp32 AdamW by at most one fp32 std and 0.5% (relative);
    * at each budget: BAOC no worse than the best uniform format or peer that fits the budget
      (measured state <= budget x (1 + FIT_TOLERANCE)) beyond noise (two standard errors of the
      difference of the seed means);
    * below uniform int8's measured state (budget 0.25): better than each fitting uniform format
      that is worse than fp32 beyond noise.

    "Worse" is signed by the workload's direction (lower accuracy, higher loss or perplexity).
    """
    cls = WORKLOADS[w]
    scale = 100.0 if cls.quality_label == "accuracy" else 1.0
    unit = " pt" if scale != 1.0 else ""

    def worse(a: float, b: float) -> float:  # how much worse a is than b
        return (b - a) if cls.higher_is_better else (a - b)

    def ratio(row: str) -> float | None:
        byts = [b for r in recipes for b in (sums[r, row].state_bytes or [])]
        params = next((sums[r, row].params for r in recipes if sums[r, row].params), None)
        return statistics.fmean(byts) / (8 * params) if byts and params else None

    ratios = {r: x for r in rows if ROWS[r].budget is None and r != "fp32" and (x := ratio(r)) is not None}
    int8_ratio = ratios.get("int8", INT8_RATIO)
    lines = []
    for recipe in recipes:
        ref = _mean_sd(sums[recipe, "fp32"]) if "fp32" in rows else None
        if ref is None:
            continue
        if "baoc_0.35" in rows and (b := _mean_sd(sums[recipe, "baoc_0.35"])) is not None:
            d = worse(b[0], ref[0])
            ok = d <= ref[1] and d <= 0.005 * abs(ref[0])
            tail = ""
            a_curve, r_curve = sums[recipe, "baoc_0.35"].curve or [], sums[recipe, "fp32"].curve or []
            if len(a_curve) >= 3 and len(r_curve) >= 3:  # the same, on the mean of the last 3 validations
                d3 = worse(statistics.fmean(v for _, v in a_curve[-3:]), statistics.fmean(v for _, v in r_curve[-3:]))
                tail = f"; over the last 3 validations {d3 * scale:+.4g}{unit}"
            lines.append([recipe, "BAOC 0.35 no worse than fp32 AdamW by 1 std or 0.5%",
                          f"{d * scale:+.4g}{unit} ({d / abs(ref[0]):+.2%}); fp32 std {ref[1] * scale:.3g}{unit}{tail}",
                          "met" if ok else "missed"])
        for name, budget in BAOC_BUDGETS.items():
            if name not in rows or (b := _mean_sd(sums[recipe, name])) is None:
                continue
            fits = [r for r, x in ratios.items() if x <= budget * (1 + FIT_TOLERANCE)]
            fitting = [(r, m) for r in fits if (m := _mean_sd(sums[recipe, r])) is not None]
            dead = [r for r in fits if sums[recipe, r].diverged]
            if fitting:
                best_row, best = min(fitting, key=lambda rm: worse(rm[1][0], 0.0))
                d, n = worse(b[0], best[0]), _noise(b, best)
                lines.append([recipe, f"BAOC {budget} vs best that fits ({ROWS[best_row].label})",
                              f"{d * scale:+.4g}{unit} (noise {n * scale:.3g}{unit})",
                              "met" if d <= n else "missed"])
            if budget < int8_ratio:  # below int8: only formats without an 8-bit momentum fit uniformly
                degraded = [(r, m) for r, m in fitting if r in _UNIFORM
                            and worse(m[0], ref[0]) > _noise(m, ref)]
                for r, m in degraded:
                    d, n = worse(m[0], b[0]), _noise(b, m)
                    lines.append([recipe, f"BAOC {budget} clearly better than {ROWS[r].label} (degraded)",
                                  f"{d * scale:+.4g}{unit} better (noise {n * scale:.3g}{unit})",
                                  "met" if d > n else "missed"])
                for r in dead:
                    lines.append([recipe, f"BAOC {budget} clearly better than {ROWS[r].label}",
                                  "that row diverged", "met"])
    if not lines:
        return ""
    return (f"Targets on {w} (from the runs above; noise = two standard errors of the difference of the seed "
            "means):\n\n" + markdown_table(["recipe", "target", "measured", "verdict"], lines))



def _seed_text(seeds: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``"0-3"``; otherwise a comma list."""
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds)) or "none"


def save_plot(plot: dict[Any, Any], workloads: list[str], recipes: list[str], path: Path) -> None:
    """State bytes (x fp32 AdamW) against quality, one panel per workload and recipe.

    One colour per row across panels, error bars of one std. A row whose quality is far off fp32's
    (accuracy under half of it, loss or perplexity over 1.5 times it) is drawn at the panel's edge
    with a triangle, so it does not squash the others.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for points in plot.values() for label, *_ in points))
    colors = {label: plt.get_cmap("tab20")(i % 20) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(len(recipes), len(workloads), figsize=(4.5 * len(workloads) + 3.4, 3.6 * len(recipes)),
                             squeeze=False)
    for j, w in enumerate(workloads):
        higher = WORKLOADS[w].higher_is_better
        scale = 100.0 if WORKLOADS[w].quality_label == "accuracy" else 1.0
        for i, recipe in enumerate(recipes):
            ax = axes[i][j]
            points = plot.get((w, recipe), [])
            ref = next((y for label, _, y, _ in points if label == ROWS["fp32"].label), None)
            def far(y: float) -> bool:
                return ref is not None and ((y < 0.5 * ref) if higher else (y > 1.5 * ref))

            near = [(y, err) for _, _, y, err in points if not far(y)]
            if near:
                lo, hi = min(y - e for y, e in near) * scale, max(y + e for y, e in near) * scale
                pad = 0.15 * (hi - lo) + 1e-3 * abs(hi)
                ax.set_ylim(lo - pad, hi + pad)
            for label, x, y, err in points:
                if far(y):
                    edge = ax.get_ylim()[0] if higher else ax.get_ylim()[1]
                    ax.plot(x, edge, "v" if higher else "^", color=colors[label], markersize=9, clip_on=False)
                    ax.annotate(f"{y * scale:.3g}", (x, edge), fontsize=7, xytext=(5, 4 if higher else -10),
                                textcoords="offset points")
                else:
                    ax.errorbar(x, y * scale, yerr=err * scale, fmt="o", color=colors[label], capsize=3)
            ax.set_title(f"{w}, {recipe}", fontsize=10)
            ax.set_xlabel("optimizer-state bytes / fp32 AdamW")
            ax.set_ylabel(WORKLOADS[w].quality_label + (" (%)" if scale != 1.0 else ""))
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colors[label]) for label in labels]
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 3.2 / fig.get_figwidth(), 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
