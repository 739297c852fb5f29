"""Quality of cheaper optimizer states on the three example workloads (the BAOC paper's table).

For each workload of ``examples/workloads.py`` (ViT on digits, character GPT, DDPM on digits), each
recipe (realistic: warm-up + cosine; stress: constant, higher learning rate) and each row (an
optimizer-state choice a user could make), train from the same seeds and report

- the optimizer-state bytes measured on the optimizer's real tensors at the end of training
  (:func:`measured_state_bytes`),
- the final quality (accuracy / perplexity / held-out denoising loss) as mean +- sample std over
  the seeds,
- the steps the row needs to reach fp32 AdamW's final quality (first validation step at which the
  seed-mean curve is at least as good as fp32's seed-mean final value; validation every
  ``steps / 10`` steps).

Rows: ``fp32`` (the module's own ``torch.optim.AdamW``); the uniform formats of
``BlockwiseAdamW`` (``bf16``, ``int8``, ``nomomentum``, ``factored``); ``fp16_nomomentum``, a naive
fp16-state AdamW without momentum (:class:`NaiveFP16AdamW`, in ``_quality_rows.py``); the peers a user would
pick (bitsandbytes ``AdamW8bit``, torchao ``AdamW8bit``, Adam-mini), each ``unavailable: <reason>``
when it does not import or run on this machine; and the ``BAOC`` callback at budgets 0.5, 0.35 and
0.25 (``pending`` while ``lightning_baoc.BAOC`` does not import). Every run is cached as JSON under
``--results-dir`` (default ``benchmarks/runs/quality/``, tracked: the tables of ``docs/benchmarks/quality.md`` are
rebuilt from it), so an interrupted run resumes and a finished one is never trained again. Below each
workload's table the issue's targets are judged on the same runs (:func:`targets_table`). ``frontier.py``
trains more rows into the same cache (``_quality_rows.FRONTIER_ROWS``: the other uniform formats, BAOC under
0.25), rows of its own page, not of these tables.

Run from the repository root:

    python benchmarks/quality.py --docs                       # everything, 3 seeds (~5 hours on 2 CPUs)
    python benchmarks/quality.py --workloads vit_digits --recipes stress --seeds 3 4 5 6 7
    python benchmarks/quality.py --workloads vit_digits --rows fp32 int8 bf16 --steps 300 --results-dir /tmp/q
    python benchmarks/quality.py --report-only --docs         # tables from the cached runs only
    python benchmarks/quality.py --quick                      # smoke run: 1 workload, 2 rows, 6 steps
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

import lightning as L
import torch
from _report import DOCS, command, examples_on_path, machine, markdown_table, write_docs_section
from torch import Tensor

examples_on_path()

from _quality_rows import (  # noqa: E402
    BAOC_BUDGETS,
    FRONTIER_BAOC_BUDGETS,
    RECORDED_FAMILIES,
    ROWS,
    NaiveFP16AdamW,  # noqa: F401  (the rows' reference optimizer, imported from here by the tests)
    Row,
    _adamw_kwargs,  # noqa: F401  (bf16_weights.py builds its fp32 rows with it)
    _baoc_class,
    _version,
    availability,
    measured_state_bytes,
)
from _quality_tables import (  # noqa: E402
    Summary,
    _fmt_bytes,
    _fmt_quality,
    _mean_sd,
    _noise,
    _seed_text,
    save_plot,
    steps_to_reach,
    summarize,
    targets_table,
)
from workloads import RECIPES, WORKLOADS, Workload, build  # noqa: E402

from lightning_baoc.optim import BlockwiseOptimizer  # noqa: E402

HERE = Path(__file__).resolve().parent
PAGE = "benchmarks/quality.md"  # the docs page (under docs/) the tables go to
# Steps per run: long enough for the differences between rows to outgrow the seed spread on these
# small models (at 200-300 steps they did not); 12 rows x 2 recipes x 3 seeds take about 5 hours of
# 2 CPU cores, most of it the char GPT.
DEFAULT_STEPS = {"vit_digits": 1000, "char_gpt": 1000, "ddpm_digits": 1000}
RECIPE_NAMES = ("realistic", "stress")
CACHE_VERSION = 1  # bump when a change makes cached runs incomparable
# BAOC rows only: 2 since format conversions encode their pools in a fixed order (before, the
# stochastic-rounding noise of a conversion depended on the process's string-hash seed, so a BAOC
# run could not be reproduced bit for bit). Rows without a conversion are unaffected. 3 since the
# warm-up runs in the start allocation, within the budget (before, it held fp32 AdamW state). 4
# since the compiled CPU step and its numerics (stochastic rounding keyed by seed, name and step;
# a correctly rounded square root; two divisions as products by exact reciprocals).
BAOC_CACHE_VERSION = 4
RECORDED_BAOC = {f"{name}_{suffix}": suffix for name in BAOC_BUDGETS for suffix in RECORDED_FAMILIES}
#: Lightning's accelerator of the runs (``--accelerator``); runs elsewhere than the CPU record it in
#: their config, so a cache never mixes devices.
ACCELERATOR = "cpu"


def set_accelerator(name: str) -> None:
    """Train the next runs on ``name`` (``"cpu"`` or ``"cuda"``; tables of cached runs need no device)."""
    global ACCELERATOR
    ACCELERATOR = name


def parse_table_arguments(parser: argparse.ArgumentParser, page: str) -> argparse.Namespace:
    """Add the arguments of a table of cached runs beside this one (``bf16_weights.py``, ``sgd_lion.py``:
    recipes, seeds, steps, threads, accelerator, report only, the docs ``page``), parse the command
    line, and set the threads and the accelerator."""
    parser.add_argument("--recipes", nargs="+", default=list(RECIPE_NAMES), choices=list(RECIPE_NAMES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu",
                        help="where the runs train (default: cpu); cuda runs, their reference's included, are cached apart")
    parser.add_argument("--report-only", action="store_true", help="tables from the cached runs only")
    parser.add_argument("--docs", action="store_true", help=f"write the table into docs/{page}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    set_accelerator(args.accelerator)
    return args


def machine_of(results: Iterable[dict[str, Any]]) -> str:
    """The machine the cached ``results`` were trained on, as they recorded it (this one where none did)."""
    seen = sorted({r["machine"] for r in results if r.get("machine")})
    return "; ".join(seen) if seen else machine()


# ------------------------------------------------------------------------------------ one run


class _Recorder(L.Callback):
    """Records ``(global_step, quality)`` at every validation; stops a run that went non-finite."""

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.curve: list[tuple[int, float]] = []
        self.diverged = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor) and not torch.isfinite(loss).all():
            self.diverged = True
            trainer.should_stop = True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        value = float(metrics[self.metric])
        finite = math.isfinite(value) and all(math.isfinite(float(v)) for k, v in metrics.items() if k.startswith("val_"))
        if not finite:
            self.diverged = True
            trainer.should_stop = True
        if self.curve and self.curve[-1][0] == trainer.global_step:
            self.curve[-1] = (trainer.global_step, value)
        else:
            self.curve.append((trainer.global_step, value))


class _Allocations(L.Callback):
    """Every allocation BAOC made in a run (``controller.last_event`` after each step): the step, the reason,
    the risk table it solved (block -> format -> risk), the formats and the blocks' sizes, so the risk the
    model predicts for any allocation (a uniform one included) can be set beside the quality it reached
    (``frontier.py``)."""

    def __init__(self, baoc: L.Callback) -> None:
        self.baoc = baoc
        self.events: list[dict[str, Any]] = []
        self._last: Any = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        event = getattr(self.baoc.controller, "last_event", None)
        if event is None or event is self._last:
            return
        self._last = event
        self.events.append(dict(step=int(event.step), reason=str(event.reason), formats=dict(event.formats),
                                risk={b: {f: float(r) for f, r in row.items()} for b, row in event.risk.items()},
                                total_risk=float(event.total_risk), block_numel=dict(event.block_numel)))


def _install_optimizer(module: Workload, make: Callable[[Workload], torch.optim.Optimizer]) -> None:
    """Make ``module.configure_optimizers`` return ``make(module)`` with the module's own schedule."""

    def configure_optimizers() -> dict[str, Any]:
        opt = make(module)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, module.lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]


def run_config(workload: str, recipe: str, row: str, seed: int, steps: int) -> dict[str, Any]:
    """What identifies a run in the cache; a cached run with another config is run again."""
    config = dict(version=CACHE_VERSION, workload=workload, recipe=recipe, row=row, seed=seed, steps=steps,
                  eval_every=eval_every(steps), torch=torch.__version__)
    if ACCELERATOR != "cpu":
        config["accelerator"] = ACCELERATOR
    if row in BAOC_BUDGETS or row in FRONTIER_BAOC_BUDGETS:
        config["baoc_version"] = BAOC_CACHE_VERSION
    elif row in RECORDED_BAOC:
        config["baoc_version"] = RECORDED_FAMILIES[RECORDED_BAOC[row]][0]
    return config


def eval_every(steps: int) -> int:
    """Validation interval: ten validations per run (the last at ``steps``)."""
    return max(1, steps // 10)


def result_path(results_dir: Path, config: dict[str, Any]) -> Path:
    """Cache file of one run."""
    c = config
    return results_dir / c["workload"] / c["recipe"] / f"{c['row']}-seed{c['seed']}-steps{c['steps']}.json"


def train_one(workload: str, recipe: str, row: Row, seed: int, steps: int) -> dict[str, Any]:
    """Train one run and return its result (curve, final quality, state bytes, seconds, status)."""
    if ACCELERATOR == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--accelerator cuda: no CUDA device is visible to torch here")
    module, data = build(workload, recipe, steps, seed)
    callbacks: list[L.Callback] = []
    recorder = _Recorder(module.quality_metric)
    baoc = None
    if row.budget is not None:
        BAOC = _baoc_class()
        # The runs here are a few hundred steps: BAOC's warm-up is scaled to a fifth of the run.
        baoc = BAOC(memory_budget=row.budget, warmup_steps=max(20, steps // 5), seed=seed, report=False,
                    **dict(row.baoc))
        callbacks += [baoc, allocations := _Allocations(baoc)]
    elif row.make is not None:
        _install_optimizer(module, row.make)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator=ACCELERATOR,
        devices=1,
        val_check_interval=eval_every(steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, recorder],
        precision=row.precision,
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*non-finite gradient.*")
        trainer.fit(module, data)
        if not recorder.diverged and (not recorder.curve or recorder.curve[-1][0] != trainer.global_step):
            trainer.validate(module, data, verbose=False)
    seconds = time.perf_counter() - start
    optimizer = trainer.optimizers[0]
    # the allocation BAOC ended with: parameters per format
    formats = dict(Counter(optimizer.formats().values())) if isinstance(optimizer, BlockwiseOptimizer) else {}
    # BAOC rows: the allocation per block (BAOCSummary.formats: block -> format), so frontier.py can show
    # the allocations that differ between seeds; every row: the last validation's metrics. The process's
    # measured memory growth is left out: it depends on the runs before in the same process, and a run's
    # record is compared whole between commits (same_results.py)
    extra: dict[str, Any] = {}
    if baoc is not None:
        summary = baoc.summary().to_dict()
        extra["baoc_summary"] = {k: v for k, v in summary.items() if k != "measured_peak_growth_bytes"}
        extra["allocations"] = allocations.events
    extra["final_metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    return dict(
        formats=formats,
        status="diverged" if recorder.diverged else "ok",
        curve=recorder.curve,
        final=recorder.curve[-1][1] if recorder.curve and not recorder.diverged else None,
        steps_done=trainer.global_step,
        state_bytes=measured_state_bytes(optimizer),
        params=module.num_parameters(),
        optimizer=f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        seconds=round(seconds, 2),
        machine=machine(),
        **extra,
    )


def run_cached(results_dir: Path, workload: str, recipe: str, row: Row, seed: int, steps: int, rerun: bool = False) -> dict[str, Any]:
    """One run, from the cache if it holds it with the same config, else trained and cached."""
    config = run_config(workload, recipe, row.name, seed, steps)
    path = result_path(results_dir, config)
    if row.recorded:  # never trained again: the cached run, or a row marked missing
        found = load_cached(results_dir, workload, recipe, row.name, seed, steps)
        return found if found is not None else {"config": config, "status": "not recorded"}
    if path.exists() and not rerun:
        cached = json.loads(path.read_text())
        if cached.get("config") == config:
            return cached
    try:
        result = train_one(workload, recipe, row, seed, steps)
    except Exception as err:  # a peer failing mid-run is a result ("error: ..."), not a crash of the table
        traceback.print_exc()
        result = dict(status="error", error=f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
    result = {"config": config, **result}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return result


def load_cached(
    results_dir: Path, workload: str, recipe: str, row: str, seed: int, steps: int, any_torch: bool = False
) -> dict[str, Any] | None:
    """A cached run, or None; ``any_torch``: whatever torch version trained it (tables of runs made
    on another machine, whose line in the table names its torch)."""
    config = run_config(workload, recipe, row, seed, steps)
    path = result_path(results_dir, config)
    if not path.exists():
        return None
    cached = json.loads(path.read_text())
    found = dict(cached.get("config", {}))
    if any_torch:
        found["torch"] = config["torch"]
    return cached if found == config else None


def tables(results_dir: Path, workloads: list[str], rows: list[str], recipes: list[str], seeds: list[int],
           steps: dict[str, int], unavailable: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The markdown tables (one per workload) from the cached runs, and the data for the plot."""
    out, plot, not_run = [], {}, []
    for w in workloads:
        cls = WORKLOADS[w]
        sums: dict[tuple[str, str], Summary] = {}
        found_runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for recipe in recipes:
            for row in rows:
                found = [load_cached(results_dir, w, recipe, row, seed, steps[w]) for seed in seeds]
                found_runs[recipe, row] = [r for r in found if r is not None]
                sums[recipe, row] = summarize(found_runs[recipe, row])
        headers = ["row", "state bytes", "x fp32 AdamW"]
        for recipe in recipes:
            headers += [f"{recipe}: {cls.quality_label}", f"{recipe}: steps to fp32's final"]
        headers.append("s / run")
        table_rows = []
        for row in rows:
            label = ROWS[row].label
            if row in unavailable:
                table_rows.append([label, unavailable[row]] + ["-"] * (len(headers) - 2))
                continue
            if all(sums[recipe, row].runs == 0 for recipe in recipes):
                not_run.append(f"`{row}` on {w}")
            all_bytes = [b for recipe in recipes for b in (sums[recipe, row].state_bytes or [])]
            params = next((sums[recipe, row].params for recipe in recipes if sums[recipe, row].params), None)
            cells = [label, *_fmt_bytes(all_bytes, params)]
            for recipe in recipes:
                s, ref = sums[recipe, row], sums[recipe, "fp32"] if (recipe, "fp32") in sums else None
                cells.append(_fmt_quality(s, cls.quality_label))
                if ref is not None and ref.finals and s.curve:
                    target = statistics.fmean(ref.finals)
                    reached = steps_to_reach(s.curve, target, cls.higher_is_better)
                    cells.append(str(reached) if reached is not None else f"not in {steps[w]}")
                else:
                    cells.append("-")
                if s.finals and params:
                    plot.setdefault((w, recipe), []).append(
                        (label, statistics.fmean(all_bytes) / (8 * params), statistics.fmean(s.finals),
                         statistics.stdev(s.finals) if len(s.finals) > 1 else 0.0)
                    )
            secs = [x for recipe in recipes for x in (sums[recipe, row].seconds or [])]
            cells.append(f"{statistics.median(secs):.0f}" if secs else "-")
            table_rows.append(cells)
        params = next((s.params for s in sums.values() if s.params), None)
        recipe_text = "; ".join(
            f"{r}: {RECIPES[w][r].schedule} lr {RECIPES[w][r].lr:g}"
            + (f", {RECIPES[w][r].warmup_fraction:.0%} warm-up" if RECIPES[w][r].warmup_fraction else "")
            for r in recipes
        )
        found_seeds = sorted({r["config"]["seed"] for recipe in recipes for row in rows
                              for r in found_runs.get((recipe, row), [])})
        verdicts = targets_table(w, sums, rows, recipes)
        out.append(
            f"**{w}** ({params:,} parameters; {steps[w]} steps, validation every {eval_every(steps[w])}; "
            f"seeds {_seed_text(found_seeds)}; {recipe_text})\n\n" + markdown_table(headers, table_rows)
            + (f"\n\n{verdicts}" if verdicts else "")
            if params else f"**{w}**: no cached runs\n"
        )
    if not_run:
        out.append(
            "Not run in this measurement: " + ", ".join(not_run)
            + " (add them with `--rows NAME ...`; the cached runs are kept)."
        )
    return "\n\n".join(out), plot


def start_comparison(results_dir: Path, workloads: list[str], recipes: list[str], seeds: list[int],
                     steps: dict[str, int], suffix: str = "fp32_warmup") -> str:
    """Today's BAOC rows beside the same rows recorded by a past version (``suffix``, a key of
    :data:`RECORDED_FAMILIES`) and beside fp32 AdamW, on the same seeds: each difference with its
    noise (two standard errors of the difference of the seed means); "within noise" where both are
    inside it."""
    lines = []
    for w in workloads:
        cls = WORKLOADS[w]
        scale = 100.0 if cls.quality_label == "accuracy" else 1.0
        for recipe in recipes:
            def stats_of(row: str) -> tuple[float, float, int] | None:
                found = [load_cached(results_dir, w, recipe, row, seed, steps[w]) for seed in seeds]
                return _mean_sd(summarize([r for r in found if r is not None]))

            ref = stats_of("fp32")
            for name, budget in BAOC_BUDGETS.items():
                now, old = stats_of(name), stats_of(f"{name}_{suffix}")
                if now is None or old is None or ref is None or now[2] != old[2]:
                    continue
                d_old, n_old = now[0] - old[0], _noise(now, old)
                d_ref, n_ref = now[0] - ref[0], _noise(now, ref)
                cells = [f"{x[0] * scale:.4g} ± {x[1] * scale:.2g}" for x in (ref, old, now)]
                lines.append([w, recipe, budget, now[2], *cells, f"{d_old * scale:+.3g} ({n_old * scale:.2g})",
                              f"{d_ref * scale:+.3g} ({n_ref * scale:.2g})",
                              "yes" if abs(d_old) <= n_old and abs(d_ref) <= n_ref else "**no**"])
    if not lines:
        return ""
    label = RECORDED_FAMILIES[suffix][1]
    head = ["workload", "recipe", "budget", "seeds", "fp32 AdamW", f"BAOC, {label}", "BAOC, today",
            "today - recorded (noise)", "today - fp32 (noise)", "within noise of both"]
    intro = {
        "fp32_warmup": "The warm-up in the start allocation (BAOC rows since the budget holds from the first step)",
        "eager_step": "The compiled CPU step and its numerics (keyed stochastic rounding, correctly rounded square "
                      "root; BAOC rows since the kernels)",
    }[suffix]
    return (f"{intro} against the same rows recorded with the {label.replace(' (recorded)', '')} and against fp32 "
            "AdamW, seed means ± std (accuracy in %); noise = two standard errors of the difference:\n\n"
            + markdown_table(head, lines))


def paired_comparison(results_dir: Path, other_dir: Path, workloads: list[str], rows: list[str], recipes: list[str],
                      seeds: list[int], steps: dict[str, int]) -> str:
    """The runs of ``results_dir`` against those of ``other_dir`` (another version's cache), paired by
    seed: per row, the mean of the per-seed differences of the final quality with its standard error,
    and whether it lies within two of them."""
    lines = []
    for w in workloads:
        scale = 100.0 if WORKLOADS[w].quality_label == "accuracy" else 1.0
        for recipe in recipes:
            for row in rows:
                pairs = [(a["final"], b["final"]) for seed in seeds
                         if (a := load_cached(results_dir, w, recipe, row, seed, steps[w])) is not None
                         and (b := load_cached(other_dir, w, recipe, ROWS[row].name, seed, steps[w])) is not None
                         and a.get("final") is not None and b.get("final") is not None]
                if len(pairs) < 2:
                    continue
                diffs = [a - b for a, b in pairs]
                mean, sem = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
                lines.append([w, recipe, ROWS[row].label, len(pairs), f"{statistics.fmean(b for _, b in pairs) * scale:.4g}",
                              f"{statistics.fmean(a for a, _ in pairs) * scale:.4g}", f"{mean * scale:+.3g} ± {sem * scale:.2g}",
                              "yes" if abs(mean) <= 2.0 * sem else "**no**"])
    if not lines:
        return ""
    head = ["workload", "recipe", "row", "seeds", "other runs: mean", "these runs: mean", "paired difference ± sem",
            "within 2 sem"]
    return (f"These runs against `{other_dir}`, paired by seed (accuracy in %):\n\n" + markdown_table(head, lines))


# ---------------------------------------------------------------------------------------- main


def parse_steps(items: list[str] | None, workloads: list[str]) -> dict[str, int]:
    """``["300"]`` or ``["vit_digits=400", "char_gpt=250"]`` -> steps per workload."""
    steps = dict(DEFAULT_STEPS)
    for item in items or []:
        name, _, value = item.rpartition("=")
        try:
            n = int(value)
        except ValueError:
            raise SystemExit(f"Invalid --steps item: {item!r}; expected N or WORKLOAD=N") from None
        if n < 1:
            raise SystemExit(f"Invalid --steps item: {item!r}; steps must be >= 1")
        if name and name not in WORKLOADS:
            raise SystemExit(f"Invalid --steps item: {item!r}; workloads are {sorted(WORKLOADS)}")
        for w in [name] if name else workloads:
            steps[w] = n
    return steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS),
                        help="(default: all)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="(default: all)")
    parser.add_argument("--recipes", nargs="+", choices=RECIPE_NAMES, default=list(RECIPE_NAMES), help="(default: both)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="(default: 0 1 2)")
    parser.add_argument("--steps", nargs="+", default=None,
                        help=f"N for all workloads or WORKLOAD=N (default: {DEFAULT_STEPS})")
    parser.add_argument("--results-dir", type=Path, default=HERE / "runs" / "quality",
                        help="cache of the runs' JSON results (default: benchmarks/runs/quality)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: docs/SECTION.png with --docs, else RESULTS_DIR/SECTION.png)")
    parser.add_argument("--docs", "--readme", dest="docs", action="store_true",
                        help=f"write the tables into docs/{PAGE} (section --section; --readme: former name)")
    parser.add_argument("--section", default="quality",
                        help=f"section of docs/{PAGE} the tables go to (default: quality)")
    parser.add_argument("--report-only", action="store_true", help="no training: tables from the cached runs")
    parser.add_argument("--rerun", action="store_true", help="train the rows named by --rows again, ignoring their cached runs (fp32, added "
                        "as the reference when not named, comes from the cache)")
    parser.add_argument("--paired-with", type=Path, default=None, metavar="DIR",
                        help="also compare these runs with another version's cached runs in DIR, paired by seed")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default: 1: on a shared CPU, threads of models this small wait more "
                        "for each other than they gain)")
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu",
                        help="where the runs train (default: cpu); cuda runs are cached under RESULTS_DIR_cuda")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: vit_digits, rows fp32 and int8, realistic recipe, seed 0, 6 steps, writes no docs page")
    args = parser.parse_args(argv)
    if args.accelerator != "cpu":
        args.results_dir = args.results_dir.with_name(f"{args.results_dir.name}_{args.accelerator}")
    if args.quick:
        explicit = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        if "--workloads" not in explicit:
            args.workloads = ["vit_digits"]
        if "--rows" not in explicit:
            args.rows = ["fp32", "int8"]
        if "--recipes" not in explicit:
            args.recipes = ["realistic"]
        if "--seeds" not in explicit:
            args.seeds = [0]
        if "--steps" not in explicit:
            args.steps = ["6"]
        args.docs = False
    args.named_rows = list(args.rows)  # what --rerun trains again
    if "fp32" not in args.rows:
        args.rows = ["fp32", *args.rows]  # the reference of "steps to fp32's final"
    return args


def main(argv: list[str] | None = None) -> str:
    """Run (or resume) the benchmark; returns the report (markdown)."""
    args = parse_args(argv)
    steps = parse_steps(args.steps, args.workloads)
    torch.set_num_threads(args.threads)
    set_accelerator(args.accelerator)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    rows = [ROWS[r] for r in args.rows]
    unavailable = {r.name: reason for r in rows if (reason := availability(r)) is not None}
    for name, reason in unavailable.items():
        print(f"{name}: {reason}", flush=True)
    if not args.report_only:
        for w in args.workloads:
            for seed in args.seeds:
                for recipe in args.recipes:
                    for row in rows:
                        if row.name in unavailable:
                            continue
                        result = run_cached(args.results_dir, w, recipe, row, seed, steps[w],
                                            args.rerun and row.name in args.named_rows)
                        final = result.get("final")
                        print(f"{w} {recipe} {row.name} seed {seed}: {result['status']}"
                              + (f", {WORKLOADS[w].quality_metric} {final:.4f}" if final is not None else "")
                              + (f", {result['state_bytes']:,} state bytes, {result['seconds']:.0f} s" if "seconds" in result else ""),
                              flush=True)
    body, plot = tables(args.results_dir, args.workloads, args.rows, args.recipes, args.seeds, steps, unavailable)
    # today's rows beside the last version's (the fp32 warm-up rows were compared with version 3's,
    # now the 'eager step' rows: docs/benchmarks/quality.md keeps that comparison's findings)
    comparison = start_comparison(args.results_dir, args.workloads, args.recipes, args.seeds, steps, "eager_step")
    if comparison:
        body += "\n\n" + comparison
    if args.paired_with is not None:
        paired = paired_comparison(args.results_dir, args.paired_with, args.workloads, args.rows, args.recipes,
                                   args.seeds, steps)
        body += "\n\n" + (paired or f"No run of these rows and seeds in both `{args.results_dir}` and `{args.paired_with}`.")
    left_out = [name for name in BAOC_BUDGETS if name not in args.rows]
    if left_out:
        reason = availability(ROWS[left_out[0]])
        body += (f"\n\nBAOC rows {', '.join(f'`{n}`' for n in left_out)}: "
                 + (reason if reason else "not in this measurement; add them with `--rows " + " ".join(left_out) + "`")
                 + ".")
    plot_path = args.plot or (DOCS if args.docs else args.results_dir) / f"{args.section}.png"
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    save_plot(plot, args.workloads, args.recipes, plot_path)
    versions = ", ".join(f"{m} {_version(m)}" for m in ("bitsandbytes", "torchao", "adam_mini") if any(r.module == m for r in rows))
    title = ("Quality: cheaper optimizer states on three workloads" if args.section == "quality"
             else f"Quality, longer runs ({', '.join(f'{w} {steps[w]} steps' for w in args.workloads)})")
    report = (
        f"## {title}\n\n"
        f"Machine: {machine()}. Peers: {versions or 'none'}. Command: `{command()}`\n\n"
        "Every run trains the workload's unchanged LightningModule (`examples/workloads.py`) with the row's "
        "optimizer over the module's two param groups and LR schedule; BAOC rows keep the module's own AdamW and add "
        "`BAOC(memory_budget=B, warmup_steps=max(20, steps // 5), seed=seed)` (warm-up: a fifth of the run). "
        "State bytes: measured on the optimizer's "
        "real tensors after training (`BlockwiseAdamW.state_bytes()`; for other optimizers the unique storages of "
        "`optimizer.state`, per-tensor step counters left out, so fp32 AdamW is exactly 8 bytes per parameter). "
        "Quality: final validation value, mean ± sample std over seeds. Steps to fp32's final: first validation "
        "step at which the row's seed-mean curve is at least as good as fp32 AdamW's seed-mean final value (strict: "
        "no tolerance, so a row 0.01% behind reads 'not in N'). "
        "Diverged: a non-finite training or validation loss (the run is stopped there). s / run: median wall "
        "seconds per run on a shared machine (compile time of torchao's kernels included). "
        + ("These are short runs (a few hundred steps: what fits about an hour of 2 shared CPU cores): a difference"
           if max(steps[w] for w in args.workloads) < 500 else "A difference")
        + " smaller than the seed spread is no evidence either way.\n\n"
        f"{body}\n\n"
        + (f"![state bytes against quality]({Path(os.path.relpath(plot_path, (DOCS / PAGE).parent)).as_posix()})\n\n"
           f"Plot: `{os.path.relpath(plot_path, HERE.parent)}` (state bytes against quality, written by the command)."
           if args.docs else f"Plot: `{plot_path}` (state bytes against quality).")
    )
    print(report)
    if args.docs:
        write_docs_section(PAGE, args.section, report)
    return report


if __name__ == "__main__":
    main()
