"""How much of an allocation is the instruments' sampling noise? The risk tables of one training run scored by
instruments that sample different elements, at the sizes BAOC gives a model today and at the old sizes.

For each workload of ``examples/workloads.py`` (``char_gpt``, ``ddpm_digits``, ``vit_digits``) this trains the
realistic recipe of a 1000-step run (quality.py's) from training seed 0 up to BAOC's first allocation (the end of
its warm-up, step 200, as in quality.py's BAOC rows), once per BAOC seed (the seed that picks which elements the
sampler and the shadow watch), under ``memory_budget=1.0`` so that the warm-up holds fp32 AdamW's state and every
seed trains the same trajectory: what differs between the seeds' risk tables is the instruments' sample alone.
Four instrument settings:

- ``sized``: BAOC's default, the instruments sized from the state they watch (``instrument_share=0.05``, at least
  256 KiB): on these models of 0.15-0.8M parameters, 32 sampled gradient elements per block and 1,024 shadowed
  elements per tensor, the minimums;
- ``1MiB``, ``4MiB``: the instruments' allowance set to 1 MiB or 4 MiB (the share of AdamW's state that gives it);
- ``old``: ``instrument_share=64``, so nothing shrinks: 4,096 sampled elements per block and 16,384 shadowed
  elements per tensor, the sizes before the instruments were sized with the model.

From each seed's risk table, the allocations at budgets 0.15, 0.1 and 0.05 are solved with the run's own memory
table (``controller.problem.solve``). Reported per workload and setting: the share of blocks whose format differs
between two seeds (mean over the pairs of seeds, per budget); the median over (block, format) cells of the risk's
coefficient of variation across the seeds; and Spearman's rank correlation between two seeds' orders of the uniform
formats (the total risk each gets on every block; mean over the pairs). Runs are cached under
``benchmarks/runs/risk_noise/``.

    python benchmarks/risk_noise.py --docs                 # 3 workloads x 4 settings x 4 seeds (~15 min on 2 CPUs)
    python benchmarks/risk_noise.py --workloads vit_digits --seeds 0 1 --report-only
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package

from _report import command, examples_on_path, machine, markdown_table, write_docs_section  # noqa: E402
from frontier import UNIFORM_FORMATS, rank_correlation, uniform_risk  # noqa: E402

examples_on_path()

from workloads import build  # noqa: E402

from lightning_baoc import BAOC  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "runs" / "risk_noise"
PAGE, SECTION = "benchmarks/frontier.md", "risk_noise"
TASKS = ("char_gpt", "ddpm_digits", "vit_digits")
#: setting -> the instruments' allowance in bytes (None: BAOC's default share, 5% of AdamW's state, at least 256 KiB;
#: math.inf: nothing shrinks, the old sizes)
SETTINGS: dict[str, float | None] = {"sized": None, "1MiB": 2.0**20, "4MiB": 4 * 2.0**20, "old": math.inf}
BUDGETS = (0.15, 0.1, 0.05)
STEPS, WARMUP = 1000, 200  # the run whose recipe is followed, and BAOC's warm-up in quality.py's BAOC rows
VERSION = 1


def run_one(workload: str, setting: str, seed: int) -> dict[str, Any]:
    """Train ``workload`` from training seed 0 to BAOC's first allocation with BAOC seed ``seed``; the risk table,
    the allocations it gives at :data:`BUDGETS` and the instruments' sizes."""
    module, data = build(workload, "realistic", STEPS, 0)
    allowance = SETTINGS[setting]
    share = {} if allowance is None else {"instrument_share": 64.0 if math.isinf(allowance) else
                                          allowance / (8 * sum(p.numel() for p in module.parameters()))}
    baoc = BAOC(memory_budget=1.0, warmup_steps=WARMUP, seed=seed, report=False, **share)
    trainer = L.Trainer(max_steps=WARMUP + 1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[baoc])
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, data)
    controller = baoc.controller
    event = controller.last_event
    if event is None:
        raise RuntimeError(f"{workload}: BAOC made no allocation in {WARMUP + 1} steps")
    risk = {b: {f: float(r) for f, r in row.items()} for b, row in event.risk.items()}
    allocations = {f"{b:g}": dict(controller.problem.solve(risk, b).formats) for b in BUDGETS}
    sizes = controller.instruments
    return dict(version=VERSION, workload=workload, setting=setting, seed=seed, step=int(event.step), risk=risk,
                allocations=allocations, max_elements=sizes.max_elements, shadow_elements=sizes.shadow_elements,
                instrument_bytes=int(controller.instrument_bytes()), seconds=round(time.perf_counter() - start, 2),
                machine=machine(), torch=torch.__version__)


def cached(workload: str, setting: str, seed: int, train: bool) -> dict[str, Any] | None:
    path = RESULTS / workload / f"{setting}-seed{seed}.json"
    if path.exists():
        found = json.loads(path.read_text())
        if found.get("version") == VERSION and found.get("torch") == torch.__version__:
            return found
    if not train:
        return None
    result = run_one(workload, setting, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"{workload} {setting} seed {seed}: {result['seconds']} s", flush=True)
    return result


def flip_share(a: dict[str, str], b: dict[str, str]) -> float:
    """The share of blocks whose format differs between two allocations.

    Example:
        >>> flip_share({"x": "int8", "y": "fp32"}, {"x": "int8", "y": "bf16"})
        0.5
    """
    return sum(a[k] != b.get(k) for k in a) / len(a)


def risk_cv(runs: list[dict[str, Any]]) -> float | None:
    """Median over the (block, format) cells with a positive mean risk of the coefficient of variation of the risk
    across the runs (sample std / mean)."""
    cvs = []
    for block, row in runs[0]["risk"].items():
        for fmt in row:
            values = [r["risk"][block][fmt] for r in runs]
            mean = statistics.fmean(values)
            if mean > 0 and len(values) > 1:
                cvs.append(statistics.stdev(values) / mean)
    return statistics.median(cvs) if cvs else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    pairs = list(itertools.combinations(runs, 2))
    flips = {f"{b:g}": statistics.fmean(flip_share(x["allocations"][f"{b:g}"], y["allocations"][f"{b:g}"])
                                        for x, y in pairs) if pairs else None for b in BUDGETS}
    orders = []
    for x, y in pairs:
        fx = [uniform_risk(x["risk"], f) for f in UNIFORM_FORMATS.values()]
        fy = [uniform_risk(y["risk"], f) for f in UNIFORM_FORMATS.values()]
        keep = [(a, b) for a, b in zip(fx, fy) if a is not None and b is not None]
        if (rho := rank_correlation([a for a, _ in keep], [b for _, b in keep])) is not None:
            orders.append(rho)
    return dict(flips=flips, cv=risk_cv(runs) if len(runs) > 1 else None,
                order=statistics.fmean(orders) if orders else None, n=len(runs),
                max_elements=runs[0]["max_elements"], shadow_elements=runs[0]["shadow_elements"],
                instrument_bytes=runs[0]["instrument_bytes"])


def report(workloads: list[str], seeds: list[int]) -> str:
    rows, results = [], []
    for w in workloads:
        for setting in SETTINGS:
            runs = [r for s in seeds if (r := cached(w, setting, s, train=False)) is not None]
            results += runs
            if len(runs) < 2:
                rows.append([w, setting, f"{len(runs)} of {len(seeds)} seeds run", "", "", *([""] * len(BUDGETS))])
                continue
            s = summarize(runs)
            fmt = lambda v: "n/a" if v is None else f"{v:.0%}"  # noqa: E731
            rows.append([w, setting, f"{s['max_elements']:,} / {s['shadow_elements']:,} ({s['instrument_bytes'] / 2**10:,.0f} KiB)",
                         "n/a" if s["cv"] is None else f"{s['cv']:.2f}",
                         "n/a" if s["order"] is None else f"{s['order']:+.2f}",
                         *(fmt(s["flips"][f"{b:g}"]) for b in BUDGETS)])
    machines = sorted({r["machine"] for r in results}) or [machine()]
    table = markdown_table(["workload", "instruments", "sampled per block / shadowed per tensor",
                            "risk's median CV across seeds", "uniform order: Spearman between seeds",
                            *(f"blocks flipped at {b:g}" for b in BUDGETS)], rows)
    return (f"Machine: {'; '.join(machines)}. Command: `{command()}`. {len(seeds)} BAOC seeds per setting, one "
            f"training trajectory (training seed 0, fp32 state through the warm-up), the risk tables of step {WARMUP}."
            f"\n\n{table}")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3], help="BAOC seeds (default: 0 1 2 3)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--docs", action="store_true", help=f"write the table into docs/{PAGE}")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if not args.report_only:
        for seed in args.seeds:
            for w in args.workloads:
                for setting in SETTINGS:
                    cached(w, setting, seed, train=True)
    text = report(args.workloads, args.seeds)
    print(text)
    if args.docs:
        write_docs_section(PAGE, SECTION, text)
    return text


if __name__ == "__main__":
    main()
