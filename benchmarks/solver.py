"""Allocation solver: exactness against brute force, speed, and the gap of the fast path.

Three parts:

1. Exact: random instances (<= 12 blocks x <= 6 formats, real-valued risks and step times,
   integer bytes, both budgets) solved by ``solve(method="exact")`` and by brute force
   (``reference_solve``): the optimal risks must agree to 1e-9 and no budget may be exceeded.
2. Structured instances like a real model's: block sizes log-uniform over 1e3..1e7 elements,
   bytes and step cost per element of each format, risk = base(format) x size share x lognormal
   noise; memory budget 0.35 of fp32 AdamW and time budget 1.10x (0.30 / 1.20 for the smaller
   ones). Each method is timed (median of 3 runs for the large ones); the gap is to the exact
   optimum where the exact method runs, else to the Lagrangian lower bound (equal to the LP
   relaxation, which scipy's HiGHS confirms when scipy is installed).
3. Planner instances: the LLaMA-7B and ViT-B/16 presets with the documented risk prior and prior
   step costs (on an accelerator, offload allowed under the time budget).

Exact command (writes the tables between the solver_bench markers of docs/benchmarks/solver.md)::

    python benchmarks/solver.py --docs
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, machine, markdown_table, write_docs_section  # noqa: E402

from lightning_baoc.costs.calibration import PRIOR_STEP_COST, memory_table, time_table  # noqa: E402
from lightning_baoc.risk.prior import block_kind, prior_risk  # noqa: E402
from lightning_baoc.sampling.blocks import partition  # noqa: E402
from lightning_baoc.solver import KNOWN_FORMATS, BudgetInfeasibleError, reference_solve, solve  # noqa: E402
from lightning_baoc.tools.presets import build_model  # noqa: E402

NAMES = list(KNOWN_FORMATS)
PER_BYTE = dict(fp32=8, bf16_momentum=6, bf16=4, nomomentum=4, int8=2.127, int8_factored=1.07,
                nomomentum_int8=1.07, factored=0.01, offload=0)
PER_TIME = dict(fp32=1.0, bf16_momentum=1.3, bf16=1.4, nomomentum=0.8, int8=2.5, int8_factored=2.6,
                nomomentum_int8=1.8, factored=1.3, offload=6.0)
BASE_RISK = dict(fp32=0, bf16_momentum=0.02, bf16=0.05, nomomentum=0.15, int8=0.08, int8_factored=0.12,
                 nomomentum_int8=0.3, factored=0.25, offload=0)


def structured(n: int, seed: int):
    rng = np.random.default_rng(seed)
    numel = np.exp(rng.uniform(np.log(1e3), np.log(1e7), n)).astype(int)
    share = numel / numel.sum()
    risk, memory, step = {}, {}, {}
    for b in range(n):
        noise = rng.lognormal(0, 0.5, len(NAMES))
        risk[f"b{b}"] = {f: float(BASE_RISK[f] * share[b] * noise[i]) for i, f in enumerate(NAMES)}
        memory[f"b{b}"] = {f: int(math.ceil(PER_BYTE[f] * numel[b])) for f in NAMES}
        step[f"b{b}"] = {f: float(PER_TIME[f] * numel[b] * 1e-9) for f in NAMES}
    return risk, memory, step


def exactness(count: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    worst = 0.0
    over = 0
    feasible = infeasible = 0
    t_exact = t_brute = 0.0
    greedy_gaps = []
    while feasible < count:
        while True:
            n, k = rng.randint(1, 12), rng.randint(1, 6)
            if k**n <= 200_000:
                break
        risk, memory, step = {}, {}, {}
        for b in range(n):
            allowed = [f for f in NAMES[:k] if rng.random() < 0.85] or [NAMES[0]]
            risk[b] = {f: rng.random() for f in allowed}
            memory[b] = {f: rng.randint(0, 1000) for f in allowed}
            step[b] = {f: rng.random() for f in allowed}
        lo, hi = sum(min(v.values()) for v in memory.values()), sum(max(v.values()) for v in memory.values())
        mb = max(1, rng.randint(lo, hi))
        t_lo = math.fsum(min(v.values()) for v in step.values())
        t_hi = math.fsum(max(v.values()) for v in step.values())
        tb = f"{rng.uniform(t_lo, t_hi)!r}s"
        start = time.perf_counter()
        try:
            ref = reference_solve(risk, memory, mb, step, tb)
        except BudgetInfeasibleError:
            infeasible += 1
            continue
        t_brute += time.perf_counter() - start
        start = time.perf_counter()
        got = solve(risk, memory, mb, step, tb, method="exact")
        t_exact += time.perf_counter() - start
        greedy = solve(risk, memory, mb, step, tb, method="greedy")
        feasible += 1
        worst = max(worst, abs(got.risk - ref.risk) / max(ref.risk, 1e-12))
        if got.memory > got.memory_budget or got.time > got.time_budget:
            over += 1
        greedy_gaps.append((greedy.risk - ref.risk) / max(ref.risk, 1e-12))
    return {
        "feasible": feasible,
        "infeasible": infeasible,
        "worst_rel_diff": worst,
        "over_budget": over,
        "ms_exact": 1e3 * t_exact / feasible,
        "ms_brute": 1e3 * t_brute / feasible,
        "greedy_mean_gap": statistics.fmean(greedy_gaps),
        "greedy_max_gap": max(greedy_gaps),
    }


def timed(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def highs_lp(risk, memory, step, mb, tb):
    """LP relaxation optimum from scipy's HiGHS (an independent check of the lower bound)."""
    try:
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix
    except ImportError:
        return None
    blocks = list(risk)
    rows, cols, c, m, t = [], [], [], [], []
    for i, b in enumerate(blocks):
        for f in risk[b]:
            rows.append(i)
            cols.append(len(c))
            c.append(risk[b][f])
            m.append(memory[b][f] / mb)
            t.append(step[b][f] / tb)
    a_eq = coo_matrix((np.ones(len(c)), (rows, cols)), shape=(len(blocks), len(c))).tocsr()
    res = linprog(c, A_ub=np.vstack([m, t]), b_ub=[1, 1], A_eq=a_eq, b_eq=np.ones(len(blocks)), bounds=(0, 1), method="highs")
    return float(res.fun) if res.status == 0 else None


def row(name, method, seconds, alloc, exact=None, note=""):
    if exact is not None:
        gap = f"{(alloc.risk - exact) / exact:.2e} (to exact)" if exact > 0 else "0"
    else:
        gap = f"<= {alloc.gap:.2e} (to bound)"
    return [name, method, f"{seconds:.3f}", f"{alloc.risk:.6g}", gap, "yes" if alloc.optimal else "no", note]


def structured_rows(quick: bool) -> list[list[object]]:
    rows: list[list[object]] = []
    for n, mb, tb, seed in ((12, 0.3, 1.2, 1), (40, 0.3, 1.2, 1), (100, 0.3, 1.2, 1)):
        risk, memory, step = structured(n, seed)
        exact, secs = timed(lambda: solve(risk, memory, mb, step, tb, method="exact"), 1)
        name = f"{n} x 9, both budgets"
        for method in ("greedy", "auto"):
            alloc, s = timed(lambda: solve(risk, memory, mb, step, tb, method=method), 3)
            rows.append(row(name, method, s, alloc, exact.risk))
        rows.append(row(name, "exact", secs, exact, exact.risk))
    sizes = (1000, 10_000) if not quick else (1000,)
    for n in sizes:
        risk, memory, step = structured(n, 0)
        name = f"{n:,} x 9, both budgets"
        alloc, s = timed(lambda: solve(risk, memory, 0.35, step, 1.10), 3)
        lp = highs_lp(risk, memory, step, alloc.memory_budget, alloc.time_budget)
        note = f"HiGHS LP bound {lp:.6g}" if lp is not None else ""
        rows.append(row(name, "auto (= greedy)", s, alloc, note=note))
        # without a time budget offload (no risk, no device bytes) would win everywhere: masked
        alloc, s = timed(lambda: solve(risk, memory, 0.35, mask=["offload"]), 3)
        rows.append(row(f"{n:,} x 8, memory only", "auto (= greedy)", s, alloc))
    return rows


def planner_rows() -> list[list[object]]:
    rows: list[list[object]] = []
    for preset, budgets in (("llama-7b", ((0.35, 1.10), (0.25, 1.10))), ("vit-b16", ((0.3, 1.2), (0.1, 1.2)))):
        model = build_model(preset)
        params = dict(model.named_parameters())
        blocks = {b: [tuple(params[p].shape) for p in ps] for b, ps in partition(model).items()}
        risk = prior_risk(blocks, {b: block_kind(model, b) for b in blocks})
        memory = memory_table(blocks, "cuda")
        step = time_table(blocks, PRIOR_STEP_COST)
        for mb, tb in budgets:
            name = f"{preset} ({len(blocks)} blocks), {mb} / {tb}x"
            for method in ("greedy", "auto"):
                alloc, s = timed(lambda: solve(risk, memory, mb, step, tb, method=method), 1)
                rows.append(row(name, method, s, alloc))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", "--readme", dest="docs", action="store_true",
                        help="write the tables into docs/benchmarks/solver.md (--readme: former name)")
    parser.add_argument("--quick", action="store_true", help="skip the 10,000-block instances")
    parser.add_argument("--instances", type=int, default=500, help="random instances of part 1 (default: 500)")
    args = parser.parse_args()

    ex = exactness(args.instances)
    part1 = (
        f"**Exact.** {ex['feasible']} random feasible instances (<= 12 blocks x <= 6 formats, both budgets; "
        f"{ex['infeasible']} infeasible draws skipped, their minima are checked in the tests): the largest "
        f"relative difference to brute force is {ex['worst_rel_diff']:.1e}, budgets exceeded: "
        f"{ex['over_budget']}. Mean time: exact {ex['ms_exact']:.1f} ms, brute force {ex['ms_brute']:.1f} ms. "
        f"The greedy alone is {ex['greedy_mean_gap']:.1%} above the optimum on average "
        f"(worst {ex['greedy_max_gap']:.0%}); `method=\"auto\"` runs the exact search on such sizes."
    )
    print(part1)
    headers = ["instance", "method", "seconds", "risk", "gap", "proven optimal", "note"]
    part2 = markdown_table(headers, structured_rows(args.quick))
    print(part2)
    part3 = markdown_table(headers, planner_rows())
    print(part3)
    body = "\n\n".join(
        [
            f"Machine: {machine()}. Command: `{command()}`",
            part1,
            "**Structured instances** (sizes log-uniform 1e3..1e7 elements; 0.30 / 1.20x budgets for "
            "12-100 blocks, 0.35 / 1.10x for the large ones; median of 3 runs except `exact`):",
            part2,
            "**Planner presets** (documented risk prior, prior step costs, memory budget / time budget):",
            part3,
        ]
    )
    if args.docs:
        write_docs_section("benchmarks/solver.md", "solver_bench", body)


if __name__ == "__main__":
    main()
