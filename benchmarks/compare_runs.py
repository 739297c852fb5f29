"""Two measurements of the same risk-validation runs, paired: is the rerun within its noise?

``benchmarks/risk_validation.py`` caches every training run it makes (``benchmarks/runs/risk_validation_<task>.json``:
per configuration, per allocation and data order, the held-out loss at the end and over the path). After a
change to the optimizer's numerics (a new kernel) the tables are regenerated; this script compares the
regenerated runs with the runs they replace. For every configuration both files hold and every allocation
both measured, each file gives the allocation's harm on each data order (its held-out loss minus the fp32
continuation's on the same order, over the orders both files hold); the two mean harms are compared against
their combined standard error, as the tables' own noise floors: the rerun is within its noise where
``|new - old| <= 2 * sqrt(se_old^2 + se_new^2)``. Partial reruns compare what they hold. Run from the
repository root:

    python benchmarks/compare_runs.py HEAD~1:benchmarks/runs/risk_validation_chargpt.json \\
        benchmarks/runs/risk_validation_chargpt.json

The allocation-level results files of ``momentum_risk_validation.py`` and ``correction_risk_validation.py``
(``benchmarks/runs/<name>.json``, regenerated with ``--json OTHER``) hold each allocation's harms by data
order; they are compared the same way, allocation by allocation:

    python benchmarks/compare_runs.py benchmarks/runs/momentum_risk_validation_digits_sgd.json OTHER

Either file may be ``REV:PATH``, the file at a git revision. Prints one table per configuration (one per
allocation-level file), with the number of allocations whose harms are identical order by order (a rerun on
bit-equal numerics), and the command; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, file_text, markdown_table  # noqa: E402
from risk_validation import mean_sem  # noqa: E402

FP32 = "[]"  # the allocation of the fp32 continuation: no block changed


class Harm(NamedTuple):
    mean: float
    se: float
    orders: int


class Comparison(NamedTuple):
    allocation: str
    old: Harm
    new: Harm
    identical: bool = False  # every paired run the same number in both files

    @property
    def z(self) -> float:
        noise = math.hypot(self.old.se, self.new.se)
        diff = abs(self.new.mean - self.old.mean)
        return diff / noise if noise > 0 else (0.0 if diff == 0 else math.inf)


def _runs(cache: dict[str, list[float]], metric: int) -> dict[str, dict[int, float]]:
    """Held-out loss per allocation (its JSON text) and data order."""
    out: dict[str, dict[int, float]] = {}
    for key, losses in cache.items():
        allocation, order = json.loads(key)
        out.setdefault(json.dumps(allocation), {})[order] = losses[metric]
    return out


def _harm(runs: dict[int, float], fp32: dict[int, float], orders: list[int]) -> Harm:
    harms = [runs[o] - fp32[o] for o in orders]
    return Harm(*mean_sem(harms), len(harms))  # the tables' own mean and standard error


def compare(old: dict[str, list[float]], new: dict[str, list[float]], metric: int = 0) -> list[Comparison]:
    """Each allocation both caches measured on at least two common data orders (with the fp32 continuation
    on the same orders), its mean harm in each."""
    a, b = _runs(old, metric), _runs(new, metric)
    if FP32 not in a or FP32 not in b:
        return []
    out = []
    for allocation in sorted(a.keys() & b.keys() - {FP32}):
        orders = sorted(a[allocation].keys() & b[allocation].keys() & a[FP32].keys() & b[FP32].keys())
        if len(orders) >= 2:
            same = all(a[k][o] == b[k][o] for k in (allocation, FP32) for o in orders)
            out.append(Comparison(allocation, _harm(a[allocation], a[FP32], orders), _harm(b[allocation], b[FP32], orders),
                                  same))
    return out


def compare_allocations(old: dict, new: dict, metric: str = "end") -> list[Comparison]:
    """Two allocation-level results files: each allocation both hold, its harms (already taken against the
    reference continuation of each data order) over the orders both hold."""
    a, b = old["allocations"], new["allocations"]
    out = []
    for label in sorted(a.keys() & b.keys()):
        x, y = a[label][f"harm_{metric}"], b[label][f"harm_{metric}"]
        n = min(len(x), len(y))
        if n >= 2:
            out.append(Comparison(label, Harm(*mean_sem(x[:n]), n), Harm(*mean_sem(y[:n]), n), x[:n] == y[:n]))
    return out


def _name(allocation: str, width: int = 70) -> str:
    if not allocation.startswith("["):  # a label of an allocation-level results file
        return allocation
    text = ", ".join(f"{block} {fmt}" for block, fmt in json.loads(allocation))
    return text if len(text) <= width else text[: width - 3] + "..."


def report(config: str, comparisons: list[Comparison], shown: int) -> str:
    within = sum(c.z <= 2 for c in comparisons)
    lines = [f"Configuration {config}: {len(comparisons)} allocations compared, {within} within 2 combined standard "
             f"errors ({within / len(comparisons):.0%}), {sum(c.identical for c in comparisons)} identical order by order."
             if comparisons else f"Configuration {config}: nothing to compare."]
    worst = sorted(comparisons, key=lambda c: -c.z)[:shown]
    if worst:
        rows = [[_name(c.allocation), c.old.orders, f"{c.old.mean:+.5f} +- {c.old.se:.5f}",
                 f"{c.new.mean:+.5f} +- {c.new.se:.5f}", f"{c.z:.1f}"] for c in worst]
        lines += ["", markdown_table(["allocation (largest z first)", "orders", "harm before", "harm now", "z"], rows)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old", help="the cache the runs replace: a file, or REV:PATH")
    parser.add_argument("new", help="the regenerated cache: a file, or REV:PATH")
    parser.add_argument("--metric", choices=["end", "path"], default="end",
                        help="the held-out loss at the end (the tables' harm) or over the whole continuation")
    parser.add_argument("--shown", type=int, default=5, help="allocations listed per configuration, largest z first")
    args = parser.parse_args()
    old, new = json.loads(file_text(args.old)), json.loads(file_text(args.new))
    if "allocations" in old and "allocations" in new:  # allocation-level results files
        config = {k: old[k] for k in ("task", "optimizer", "lr", "budget", "steps", "orders") if k in old}
        tables = [(json.dumps(config), compare_allocations(old, new, args.metric))]
    else:
        common = sorted(old.keys() & new.keys())
        if not common:
            sys.exit(f"the two files share no configuration: {sorted(old)} against {sorted(new)}")
        tables = [(c, compare(old[c], new[c], ["end", "path"].index(args.metric))) for c in common]
    for config, comparisons in tables:
        print(report(config, comparisons, args.shown) + "\n")
    print(f"Command: `{command()}`")


if __name__ == "__main__":
    main()
