"""Does the risk model predict measured harm? Two tests on real tasks, paired runs.

Every run starts from one shared warm-up (model and BlockwiseAdamW state; fp32, or with ``--start prior`` in the
training controller's start allocation within ``--budget``, the risks then measured against the shadow moments the
controller keeps), switches some blocks to cheaper formats, trains ``--steps`` more steps on a data order shared by
all runs of that order, and reports the held-out loss. Harm = held-out loss minus that of the fp32 continuation
with the same data order (paired), averaged over ``--orders`` data orders; the noise floor is the standard error of
that mean.

(i) allocation level: at a tight budget (``--budget``, a fraction of fp32 AdamW state), the
    risk-minimizing allocation against the risk-maximizing one of the same budget and against
    ``--random`` random allocations of the same budget;
(ii) block level: one block at a time in each of the cheap formats; Spearman correlation of
    predicted risk with measured harm, overall and within each format, each with its noise floor
    (bootstrap over data orders). ``--more-orders FORMAT=N`` measures one format on more data orders
    where its single-block harms sit close to the noise floor.

Tasks: ``digits`` (an 8-layer MLP on scikit-learn's digits), ``chargpt`` (a 4-layer character GPT on the Python
standard library's source) and ``ddpm`` (a small diffusion UNet on digits). Constant learning rate (the stress
recipe, where state-format harms show).

Run from the repository root:

    python benchmarks/risk_validation.py --task digits            # ~10 min on 2 cores
    python benchmarks/risk_validation.py --task chargpt           # ~1-2 h on 2 cores
    python benchmarks/risk_validation.py --task ddpm --warmup 300 # ~1 h on 2 cores
    python benchmarks/risk_validation.py --task digits --quick    # smoke run, writes no docs page
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics as stats
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _report import command, machine, markdown_table, write_docs_section
from _tasks import Task, chargpt_task, ddpm_task, digits_task
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW, partition
from lightning_baoc.formats import format_state_bytes
from lightning_baoc.risk import block_kind, prior_risk, risk_details
from lightning_baoc.costs.instruments import DEFAULT_INSTRUMENT_SHARE, instrument_allowance, size_instruments
from lightning_baoc.risk.shadow import DEFAULT_SHADOW_ELEMENTS, ShadowMoments
from lightning_baoc.sampling import DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS
from lightning_baoc.solver import solve

CHEAP = ["nomomentum", "int8", "factored", "nomomentum_int8", "int8_factored", "bf16"]


def _train(
    task: Task, model: nn.Module, opt: BlockwiseAdamW, steps: int, gen: torch.Generator, eval_points: int = 0,
    shadow: ShadowMoments | None = None,
) -> tuple[float, float]:
    """Train ``steps`` steps; return (end, path): ``end`` is the mean held-out loss at
    ``eval_points`` evenly spaced points of the last fifth of training (averaging damps the
    step-to-step fluctuation of a constant-lr run, the largest part of the noise floor) and
    ``path`` the mean over ``2 * eval_points`` points spread over the whole run (the harm
    accumulated along the way); both nan without evaluation points."""
    at_end = {steps - 1 - i * max(1, steps // (5 * max(eval_points, 1))) for i in range(eval_points)}
    n_path = 2 * eval_points
    at_path = {(i + 1) * steps // n_path - 1 for i in range(n_path)} if eval_points else set()
    end, path = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        task.loss(model, step, gen).backward()
        if shadow is not None:  # fp32 AdamW's moments on a sample, as the controller keeps them
            shadow.update(opt.named_params, {n: tuple(map(float, opt.param_group_of(n)["betas"])) for n in opt.named_params})
        opt.step()
        if step in at_end or step in at_path:
            value = task.heldout(model)
            if step in at_end:
                end.append(value)
            if step in at_path:
                path.append(value)
    return (sum(end) / len(end) if end else math.nan, sum(path) / len(path) if path else math.nan)


def warm_up(task: Task, steps: int) -> tuple[bytes, bytes]:
    """The shared fp32 warm-up: model and optimizer state as bytes."""
    warm, _ = warm_up_in(task, steps)
    return warm


def shadow_elements(model: nn.Module, blocks: dict[str, list[str]], share: float | None) -> int:
    """The shadow's elements per tensor as the training controller sizes its instruments at ``instrument_share``
    ``share`` (:func:`~lightning_baoc.costs.instruments.size_instruments`); ``None``: the unsized default."""
    if share is None:
        return DEFAULT_SHADOW_ELEMENTS
    shapes = dict(model.named_parameters())
    block_shapes = {b: [tuple(shapes[n].shape) for n in names] for b, names in blocks.items()}
    allowance = instrument_allowance(8 * sum(p.numel() for p in model.parameters()), share)
    return size_instruments(block_shapes, DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS, DEFAULT_SHADOW_ELEMENTS,
                            allowance).shadow_elements


def warm_up_in(
    task: Task, steps: int, start: dict[str, str] | None = None, blocks: dict[str, list[str]] | None = None,
    shadow_size: int = DEFAULT_SHADOW_ELEMENTS,
) -> tuple[tuple[bytes, bytes], ShadowMoments | None]:
    """The shared warm-up: fp32, or in the ``start`` allocation (block -> format) with shadow moments
    kept as the training controller keeps them (``shadow_size`` elements per tensor at most); model and
    optimizer state as bytes, and the shadow."""
    model = task.make_model()
    opt = BlockwiseAdamW(model.named_parameters(), lr=task.lr, weight_decay=0.0, min_8bit_numel=0)
    shadow = None
    if start is not None:
        opt.set_formats(start, blocks=blocks)
        shadow = ShadowMoments(opt.named_params, shadow_size)
    _train(task, model, opt, steps, torch.Generator().manual_seed(999), shadow=shadow)
    mbuf, obuf = io.BytesIO(), io.BytesIO()
    torch.save(model.state_dict(), mbuf)
    torch.save(opt.state_dict(), obuf)
    return (mbuf.getvalue(), obuf.getvalue()), shadow


def start_allocation(model: nn.Module, blocks: dict[str, list[str]], budget: float) -> dict[str, str]:
    """The training controller's start: least prior risk within ``budget`` of fp32 AdamW state (CPU menu)."""
    shapes = {n: p.shape for n, p in model.named_parameters()}
    menu = [f for f in FORMATS if f != "offload"]
    kinds = {b: block_kind(model, b) for b in blocks}
    prior = prior_risk({b: [tuple(shapes[n]) for n in names] for b, names in blocks.items()}, kinds, menu, 0)
    memory = {b: {f: sum(format_state_bytes(f, shapes[n], 0) for n in names) for f in menu} for b, names in blocks.items()}
    return dict(solve(prior, memory, budget).formats)


def restore(task: Task, warm: tuple[bytes, bytes]) -> tuple[nn.Module, BlockwiseAdamW]:
    model = task.make_model()
    model.load_state_dict(torch.load(io.BytesIO(warm[0]), weights_only=True))
    opt = BlockwiseAdamW(model.named_parameters(), lr=task.lr, weight_decay=0.0, min_8bit_numel=0)
    opt.load_state_dict(torch.load(io.BytesIO(warm[1]), weights_only=True))
    return model, opt


EVAL_POINTS = 5


class Runs:
    """Paired continuations from the shared warm-up, cached on disk (``benchmarks/results/``) by
    configuration, allocation and data order, so an interrupted benchmark resumes where it
    stopped."""

    def __init__(self, task: Task, warm: tuple[bytes, bytes], blocks: dict, steps: int, path: Path, config: dict) -> None:
        self.task, self.warm, self.blocks, self.steps, self.path = task, warm, blocks, steps, path
        self.capped = config.get("start", "fp32") != "fp32"
        self.key = json.dumps(config, sort_keys=True)
        data = json.loads(path.read_text()) if path.exists() else {}
        self.data = data
        self.cache = data.setdefault(self.key, {})

    def __call__(self, formats: dict[str, str], order: int) -> tuple[float, float]:
        key = json.dumps([sorted(formats.items()), order])
        if key not in self.cache:
            model, opt = restore(self.task, self.warm)
            if self.capped:  # the warm-up held other formats: the blocks not under test continue in fp32
                opt.set_formats({**{b: "fp32" for b in self.blocks}, **formats}, blocks=self.blocks)
            elif formats:
                opt.set_formats(formats, blocks=self.blocks)
            self.cache[key] = _train(self.task, model, opt, self.steps, torch.Generator().manual_seed(order), EVAL_POINTS)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data))
        return tuple(self.cache[key])


def largest_blocks(model: nn.Module, blocks: dict[str, list[str]], n: int) -> list[str]:
    """The ``n`` blocks with the most elements in matrices (tensors of 2 or more dimensions), largest first:
    the blocks of the block-level tests (shared with ``int8_mechanism.py`` and the tests)."""
    shapes = {name: p.shape for name, p in model.named_parameters()}
    sizes = {b: sum(shapes[p].numel() for p in names if len(shapes[p]) >= 2) for b, names in blocks.items()}
    return sorted(sizes, key=sizes.get, reverse=True)[:n]


def run_config(args: argparse.Namespace, quick: bool = False) -> dict:
    """The configuration that keys a task's cache of finished runs (shared with ``int8_mechanism.py``)."""
    config = {"task": args.task, "warmup": args.warmup, "steps": args.steps}
    if args.task == "chargpt":
        config.update(layers=args.layers, embd=args.embd, eval_seqs=args.eval_seqs)
    config.update(torch=torch.__version__, quick=quick)
    if getattr(args, "start", "fp32") != "fp32":  # only then: the fp32 caches keep their keys
        config.update(start=args.start, start_budget=args.budget)
    return config


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> torch.Tensor:
        t = torch.tensor(x, dtype=torch.float64)
        order = t.argsort()
        r = torch.empty_like(t)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for v in set(x):  # average ties
            mask = t == v
            r[mask] = r[mask].mean()
        return r

    if len(a) < 3:
        return math.nan
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den else math.nan


@dataclass
class Correlation:
    """Spearman of predicted risk with measured harm, each with its noise floor (the standard deviation
    of the Spearman when the data orders are drawn again with replacement)."""

    rho: float  # over all pairs
    rho_sd: float
    above: int  # harms above noise: beyond twice their standard error
    gains: int  # held-out loss below the fp32 continuation's by as much: no harm
    rho_above: float  # over the harms above noise alone (nan with fewer than 3)
    rho_above_sd: float


def harm_correlation(predicted: list[float], harms: list[list[float]], groups: list[str] | None = None,
                     draws: int = 400, seed: int = 0) -> Correlation:
    """Correlate ``predicted[i]`` with the mean of ``harms[i]`` (one harm per data order). Pairs of the
    same ``groups`` label share their data orders (paired runs), so the bootstrap draws one resample
    of orders per group and applies it to all of that group's pairs."""
    groups = groups if groups is not None else ["all"] * len(harms)
    stats_ = [mean_sem(h) for h in harms]
    mean = [m for m, _ in stats_]
    keep = [i for i, (m, e) in enumerate(stats_) if not math.isnan(e) and m > 2 * e]
    gains = sum(1 for m, e in stats_ if not math.isnan(e) and m < -2 * e)
    gen = torch.Generator().manual_seed(seed)
    drawn: dict[str, list[float]] = {"all": [], "above": []}
    for _ in range(draws if all(len(h) > 1 for h in harms) else 0):
        picks: dict[str, list[int]] = {}
        means = []
        for h, g in zip(harms, groups):
            if g not in picks:
                picks[g] = torch.randint(len(h), (len(h),), generator=gen).tolist()
            means.append(sum(h[j] for j in picks[g]) / len(h))
        drawn["all"].append(spearman(predicted, means))
        if len(keep) >= 3:
            drawn["above"].append(spearman([predicted[i] for i in keep], [means[i] for i in keep]))

    def sd(xs: list[float]) -> float:
        xs = [x for x in xs if not math.isnan(x)]
        return stats.stdev(xs) if len(xs) > 1 else math.nan

    rho_above = spearman([predicted[i] for i in keep], [mean[i] for i in keep]) if len(keep) >= 3 else math.nan
    return Correlation(spearman(predicted, mean), sd(drawn["all"]), len(keep), gains, rho_above, sd(drawn["above"]))


def _with_floor(value: float, floor: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:+.2f} +- {floor:.2f}"


def block_orders(specs: list[str], formats: list[str], orders: int) -> dict[str, int]:
    """Data orders of the block-level test per format: ``orders`` unless a ``FORMAT=N`` spec raises it
    (for a format whose single-block harms sit close to the noise floor: the standard error falls as
    one over the square root of the orders)."""
    out = {f: orders for f in formats}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"--more-orders takes FORMAT=N, got {spec!r}")
        if name not in out:
            raise ValueError(f"--more-orders names {name!r}, which is not among --formats {formats}")
        if int(value) < orders:
            raise ValueError(f"--more-orders {spec}: fewer than --orders {orders}")
        out[name] = int(value)
    return out


def mean_sem(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], math.nan
    return stats.mean(xs), stats.stdev(xs) / math.sqrt(len(xs))


def _arguments() -> argparse.Namespace:
    """The command line (``--quick``: a smoke run's sizes)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["digits", "chargpt", "ddpm"], default="digits")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--orders", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--random", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=8, help="blocks in the block-level test")
    parser.add_argument("--formats", nargs="*", default=["nomomentum", "int8", "factored", "nomomentum_int8"])
    parser.add_argument("--layers", type=int, default=4, help="chargpt: transformer blocks (default: 4)")
    parser.add_argument("--embd", type=int, default=128, help="chargpt: embedding width (default: 128)")
    parser.add_argument("--eval-seqs", type=int, default=64, help="chargpt: held-out sequences of 64 tokens (default: 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).parent / "runs",
                        help="cache of finished runs, kept in the repository so the tables of docs/benchmarks/risk-validation.md can be "
                        "regenerated and extended (default: benchmarks/runs)")
    parser.add_argument("--merge", type=Path, nargs="*", default=[],
                        help="other cache files of the same configuration whose finished runs are used too")
    parser.add_argument("--blocks-first-reversed", action="store_true",
                        help="run the block-level test first, last block first (a second process sharing the work "
                        "with --results-dir elsewhere; merge the caches with --merge for the report)")
    parser.add_argument("--groups", type=int, default=0,
                        help="(iii): momentum dropped from half of the block-level blocks at once: the half the "
                        "model ranks safest, the riskiest half, and this many random halves (default: 0, skipped)")
    parser.add_argument("--replicate-from", type=int, default=0,
                        help="also report (ii) over the data orders from this one on alone (held out from the "
                        "measurements the risk model was shaped on; default: 0, off)")
    parser.add_argument("--more-orders", nargs="*", default=[], metavar="FORMAT=N",
                        help="(ii) only: measure these formats' single-block harms on N data orders instead of "
                        "--orders, where they sit close to the noise floor ((i) and (iii) keep --orders)")
    parser.add_argument("--start", choices=["fp32", "prior"], default="fp32",
                        help="the shared warm-up: fp32 (as recorded before the warm-up was capped) or in the training "
                        "controller's start allocation at --budget (least prior risk), with shadow moments for the "
                        "risk model (default: fp32)")
    parser.add_argument("--instrument-share", type=float, default=DEFAULT_INSTRUMENT_SHARE,
                        help="with --start prior: the shadow sized as BAOC sizes its instruments at this "
                        "instrument_share (default: BAOC's); a negative value keeps the unsized default of "
                        f"{DEFAULT_SHADOW_ELEMENTS} elements per tensor. The continuations do not depend on it "
                        "(the shadow only observes), so their cache is shared")
    parser.add_argument("--allocations-only", action="store_true",
                        help="(i) alone: the allocation-level test, on --orders data orders; its own docs section "
                        "(risk_validation_<task>[_capped]_allocations)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.steps, args.orders, args.random, args.blocks = 50, 50, 2, 2, 3
    return args


def _task(args: argparse.Namespace) -> Task:
    if args.task == "chargpt":
        return chargpt_task(args.layers, args.embd, args.eval_seqs)
    return {"digits": digits_task, "ddpm": ddpm_task}[args.task]()


class Harms:
    """An allocation's harm per data order: its held-out loss (``which``: 0 end, 1 path) minus fp32's."""

    def __init__(self, run: Runs, base: dict[int, tuple[float, float]], orders: list[int]) -> None:
        self.run, self.base, self.orders = run, base, orders

    def __call__(self, formats: dict[str, str], which: int, over: list[int] | None = None) -> list[float]:
        return [self.run(formats, o)[which] - self.base[o][which] for o in (self.orders if over is None else over)]


def main() -> None:
    args = _arguments()
    torch.set_num_threads(args.threads)
    task = _task(args)
    model = task.make_model()
    blocks = partition(model)
    start = start_allocation(model, blocks, args.budget) if args.start == "prior" else None
    args.shadow_size = shadow_elements(model, blocks, None if args.instrument_share < 0 else args.instrument_share)
    warm, shadow = warm_up_in(task, args.warmup, start, blocks, args.shadow_size)
    _, opt = restore(task, warm)
    details = risk_details(opt, blocks, horizon=args.steps, shadow=shadow)
    risk = {b: {f: d.risk[f] for f in ["fp32"] + CHEAP} for b, d in details.items()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    memory = {b: {f: sum(format_state_bytes(f, shapes[n], 0) for n in names) for f in risk[b]} for b, names in blocks.items()}
    orders = list(range(args.orders))
    orders_of = {f: list(range(n)) for f, n in block_orders(args.more_orders, args.formats, args.orders).items()}
    config = run_config(args, quick=args.quick)
    run = Runs(task, warm, blocks, args.steps, args.results_dir / f"risk_validation_{args.task}.json", config)
    for other in args.merge:
        run.cache.update({k: v for k, v in json.loads(other.read_text()).get(run.key, {}).items() if k not in run.cache})
    n_base = args.orders if args.allocations_only else max([args.orders, *map(len, orders_of.values())])
    base = {o: run({}, o) for o in range(n_base)}
    chosen = largest_blocks(model, blocks, args.blocks)
    if args.blocks_first_reversed:
        for b in reversed(chosen):
            for f in args.formats:
                for o in orders_of[f]:
                    run({b: f}, o)
    print(f"fp32 continuation held-out loss (end, path) by order: {base}", flush=True)
    base_end = [base[o][0] for o in orders]
    harms = Harms(run, base, orders)
    # (i) allocation level, measured at the end of the continuation
    alloc_rows, harms_of = _allocation_rows(_allocations(args, risk, memory), harms, risk, memory)
    random_means = [stats.mean(harms_of[k]) for k in harms_of if k.startswith("random")]
    median_random = stats.median(random_means) if random_means else math.nan
    texts = (_model_text(args, model), _warm_text(args, start))
    if args.allocations_only:
        allocation_report(args, task, start, base_end, *texts, median_random, harms_of, alloc_rows)
        return
    # (ii) block level: the largest 2-D blocks; harm at the end and along the whole continuation
    block_rows = []
    for b in chosen:
        for f in args.formats:
            row = [b, f, f"{risk[b][f]:.3g}"]
            for which in (0, 1):
                m, s = mean_sem(harms({b: f}, which, orders_of[f]))
                row += [f"{m:+.5f}", f"{s:.5f}"]
            block_rows.append(row)
            print(block_rows[-1], flush=True)
    group_text = ""
    if args.groups:
        group_text = "\n\n" + momentum_groups(run, base, orders, chosen, risk, shapes, blocks, args.groups)
    summary = (
        _summary_head(args, task, *texts, base_end, median_random, harms_of, orders_of, alloc_rows)
        + _block_text(args, harms, orders_of, chosen, risk, block_rows)
        + group_text
    )
    print(summary)
    if not args.quick:
        write_docs_section(
            "benchmarks/risk-validation.md",
            f"risk_validation_{task.name}" + ("" if start is None else "_capped"),
            f"Machine: {machine()}. Command: `{command()}`\n\n{summary}",
        )


def _allocations(args: argparse.Namespace, risk: dict, memory: dict) -> dict[str, dict[str, str]]:
    """(i)'s allocations at the budget: the least and the most risky, and ``--random`` random ones (the
    solver's on random risks)."""
    allocations = {"risk-min": solve(risk, memory, args.budget).formats,
                   "risk-max": riskiest(risk, memory, args.budget)}
    for k in range(args.random):
        gen = torch.Generator().manual_seed(100 + k)
        rnd = {b: {f: float(torch.rand(1, generator=gen)) for f in r} for b, r in risk.items()}
        allocations[f"random {k}"] = solve(rnd, memory, args.budget).formats
    return allocations


def _allocation_rows(allocations: dict[str, dict[str, str]], harms: Harms, risk: dict,
                     memory: dict) -> tuple[list[list[object]], dict[str, list[float]]]:
    """(i)'s table rows, and each allocation's harms by order (at the end)."""
    rows, harms_of = [], {}
    for label, alloc in allocations.items():
        harms_of[label] = harms(alloc, 0)
        mem = sum(memory[b][f] for b, f in alloc.items()) / sum(memory[b]["fp32"] for b in memory)
        predicted = sum(risk[b][f] for b, f in alloc.items())
        m, s = mean_sem(harms_of[label])
        counts = ", ".join(f"{f} {n}" for f, n in sorted(_count(alloc.values()).items()))
        rows.append([label, f"{mem:.3f}", f"{predicted:.4g}", f"{m:+.4f}", f"{s:.4f}", counts])
        print(rows[-1], flush=True)
    return rows, harms_of


def _paired(harms_of: dict[str, list[float]], n: int) -> tuple[float, float, float, float]:
    """Paired by order: risk-max minus risk-min, and the median random minus risk-min (mean, sem each)."""
    pm, ps = mean_sem([harms_of["risk-max"][i] - harms_of["risk-min"][i] for i in range(n)])
    randoms = [k for k in harms_of if k.startswith("random")]
    rm, rs = mean_sem([stats.median(harms_of[k][i] for k in randoms) - harms_of["risk-min"][i] for i in range(n)])
    return pm, ps, rm, rs


def _model_text(args: argparse.Namespace, model: nn.Module) -> str:
    size = f"{sum(p.numel() for p in model.parameters()):,}"
    if args.task == "chargpt":
        return (f"a {args.layers}-layer character GPT (width {args.embd}, {size} parameters), held-out set "
                f"{args.eval_seqs} x 64 tokens")
    if args.task == "ddpm":
        return (f"a small DDPM UNet on digits ({size} parameters), held-out denoising MSE on 397 images x 8 fixed "
                "(t, noise) draws")
    return f"an 8-layer MLP ({size} parameters)"


def _warm_text(args: argparse.Namespace, start: dict[str, str] | None) -> str:
    if start is None:
        return "fp32 warm-up"
    counts = ", ".join(f"{f} {n}" for f, n in sorted(_count(start.values()).items()))
    sized = ("unsized" if args.instrument_share < 0 else
             f"sized as BAOC sizes its instruments at instrument_share {args.instrument_share}")
    return f"warm-up in the start allocation (least prior risk at budget {args.budget}: {counts}; risks against " \
        f"shadow moments of at most {args.shadow_size} elements per tensor, {sized})"


def _summary_head(args: argparse.Namespace, task: Task, model_text: str, warm_text: str, base_end: list[float],
                  median_random: float, harms_of: dict[str, list[float]], orders_of: dict[str, list[int]],
                  alloc_rows: list[list[object]]) -> str:
    """The task, the recipe and (i)'s table."""
    pm, ps, rm, rs = _paired(harms_of, len(base_end))
    more = {f: len(o) for f, o in orders_of.items() if len(o) > args.orders}
    more_text = (
        " In (ii), " + ", ".join(f"`{f}` is measured on {n} data orders" for f, n in more.items())
        + ": its single-block harms sit close to the noise floor, which falls as one over the square root of the "
        "orders."
        if more else ""
    )
    return (
        f"Task `{task.name}`, {model_text}: {warm_text} {args.warmup} steps, then {args.steps} steps at constant lr "
        f"{task.lr}, {args.orders} data orders (paired). Harm = held-out loss minus the fp32 continuation's "
        f"on the same order, mean and standard error (the noise floor) over orders; 'end' is the mean of "
        f"{EVAL_POINTS} evaluations over the last fifth, 'path' the mean of {2 * EVAL_POINTS} evaluations spread "
        f"over the whole continuation. Budget {args.budget} of fp32 AdamW state. fp32 continuation held-out loss "
        f"(end): {stats.mean(base_end):.4f} (spread over orders {max(base_end) - min(base_end):.4f}).{more_text}\n\n"
        f"(i) allocations, harm at the end (median of the random ones: {median_random:+.4f}); paired by order, "
        f"risk-max minus risk-min {pm:+.4f} +- {ps:.4f} (sem), median random minus risk-min "
        f"{rm:+.4f} +- {rs:.4f}:\n\n"
        + markdown_table(["allocation", "memory / fp32", "predicted risk", "harm", "sem", "blocks per format"], alloc_rows)
    )


CORRELATION_HEADERS = ["harm", "formats", "Spearman", "pairs", "harms above noise", "gains",
                       "Spearman over harms above noise"]


def _correlations(args: argparse.Namespace, harms: Harms, orders_of: dict[str, list[int]], chosen: list[str],
                  risk: dict, start: int = 0) -> list[list[object]]:
    """The Spearman rows of (ii), from the harms measured on each format's data orders from ``start`` on."""
    rows = []
    for which, name in ((0, "end"), (1, "path")):
        pairs = [(f, risk[b][f], harms({b: f}, which, orders_of[f][start:])) for f in args.formats for b in chosen]
        for label in [*args.formats, "all"]:
            sub = [x for x in pairs if label == "all" or x[0] == label]
            c = harm_correlation([p for _, p, _ in sub], [h for _, _, h in sub], [f for f, _, _ in sub])
            rows.append([name, label, _with_floor(c.rho, c.rho_sd), len(sub), f"{c.above}/{len(sub)}",
                         f"{c.gains}/{len(sub)}", _with_floor(c.rho_above, c.rho_above_sd)])
    return rows


def _block_text(args: argparse.Namespace, harms: Harms, orders_of: dict[str, list[int]], chosen: list[str],
                risk: dict, block_rows: list[list[object]]) -> str:
    """(ii): the correlations, over every order and over the held-out orders, and the block-level runs."""
    replicate_text = ""
    if 0 < args.replicate_from < args.orders:
        k = args.replicate_from
        replicate_text = (
            f"\n\nThe same over data orders {k}..{args.orders - 1}"
            + "".join(f" ({f}: {k}..{len(o) - 1})" for f, o in orders_of.items() if len(o) > args.orders)
            + " alone: the risk model's 8-bit v term was last changed after "
            f"orders 0..{k - 1} had been measured, so these orders test it on data it was not shaped on:\n\n"
            + markdown_table(CORRELATION_HEADERS, _correlations(args, harms, orders_of, chosen, risk, k))
        )
    return (
        "\n\n(ii) one block at a time, Spearman(predicted risk, measured harm); 'harms above noise' counts "
        "harms beyond +2 sem, 'gains' held-out losses below fp32's by more than 2 sem, and the last column is "
        "the Spearman over the harms above noise alone. Beside each Spearman, its noise floor: the standard "
        "deviation over 400 redraws of the data orders with replacement (one redraw per format, shared by its "
        "blocks, as the runs are paired):\n\n"
        + markdown_table(CORRELATION_HEADERS, _correlations(args, harms, orders_of, chosen, risk))
        + replicate_text
        + "\n\n<details markdown=\"1\"><summary>block-level runs</summary>\n\n"
        + markdown_table(["block", "format", "predicted risk", "harm (end)", "sem", "harm (path)", "sem"], block_rows)
        + "\n\n</details>"
    )


def allocation_report(args: argparse.Namespace, task: Any, start: Any, base_end: list[float], model_text: str,
                      warm_text: str, median_random: float, harms_of: dict[str, list[float]], alloc_rows: list) -> None:
    """Print (i) alone and write it into its docs section (``--allocations-only``)."""
    pm, ps, rm, rs = _paired(harms_of, len(base_end))
    summary = (
        f"Task `{task.name}`, {model_text}: {warm_text} {args.warmup} steps, then {args.steps} steps at constant lr "
        f"{task.lr}, {args.orders} data orders (paired). Harm = held-out loss minus the fp32 continuation's "
        f"on the same order at the end (the mean of {EVAL_POINTS} evaluations over the last fifth), mean and "
        f"standard error (the noise floor) over orders. Budget {args.budget} of fp32 AdamW state. fp32 "
        f"continuation held-out loss (end): {stats.mean(base_end):.4f} (spread over orders "
        f"{max(base_end) - min(base_end):.4f}).\n\n"
        f"(i) allocations (median of the random ones: {median_random:+.4f}); paired by order, risk-max minus "
        f"risk-min {pm:+.4f} +- {ps:.4f} (sem), median random minus risk-min {rm:+.4f} +- {rs:.4f}:\n\n"
        + markdown_table(["allocation", "memory / fp32", "predicted risk", "harm", "sem", "blocks per format"], alloc_rows)
    )
    print(summary)
    if not args.quick:
        section = f"risk_validation_{task.name}" + ("" if start is None else "_capped") + "_allocations"
        write_docs_section("benchmarks/risk-validation.md", section,
                           f"Machine: {machine()}. Command: `{command()}`\n\n{summary}")


def momentum_groups(run: "Runs", base: dict, orders: list[int], chosen: list[str], risk: dict, shapes: dict,
                    blocks: dict, n_random: int) -> str:
    """(iii) Dropping momentum is not additive over blocks (one block alone can even gain, most blocks at once
    diverge), so it is also measured on groups: ``nomomentum`` on half of the block-level blocks at once,
    the half with the lowest predicted risk against the highest and ``n_random`` random halves."""
    ranked = sorted(chosen, key=lambda b: risk[b]["nomomentum"])
    half = len(ranked) // 2
    groups = {"safest half": ranked[:half], "riskiest half": ranked[-half:]}
    for k in range(n_random):
        perm = torch.randperm(len(chosen), generator=torch.Generator().manual_seed(200 + k)).tolist()
        groups[f"random half {k}"] = sorted(chosen[i] for i in perm[:half])
    total = sum(shapes[n].numel() for names in blocks.values() for n in names)
    rows, harm = [], {}
    for label, members in groups.items():
        harm[label] = [run({b: "nomomentum" for b in members}, o)[0] - base[o][0] for o in orders]
        m, s = mean_sem(harm[label])
        params = sum(shapes[n].numel() for b in members for n in blocks[b]) / total
        predicted = sum(risk[b]["nomomentum"] for b in members)
        rows.append([label, f"{params:.2f}", f"{predicted:.4g}", f"{m:+.4f}", f"{s:.4f}", ", ".join(members)])
        print(rows[-1], flush=True)
    randoms = [k for k in harm if k.startswith("random")]
    vs_random = [stats.median(harm[k][i] for k in randoms) - harm["safest half"][i] for i in range(len(orders))]
    vs_riskiest = [harm["riskiest half"][i] - harm["safest half"][i] for i in range(len(orders))]
    (rm, rs), (xm, xs) = mean_sem(vs_random), mean_sem(vs_riskiest)
    rho = spearman([sum(risk[b]["nomomentum"] for b in members) for members in groups.values()],
                   [stats.mean(h) for h in harm.values()])
    return (
        "(iii) momentum dropped from half of those blocks at once (harm at the end); paired by order, riskiest "
        f"minus safest half {xm:+.4f} +- {xs:.4f} (sem), median random minus safest {rm:+.4f} +- {rs:.4f}; "
        f"Spearman(predicted risk, harm) over the {len(groups)} groups {rho:+.2f}:\n\n"
        + markdown_table(["group", "parameters / model", "predicted risk", "harm", "sem", "blocks"], rows)
    )


def riskiest(risk: dict, memory: dict, budget: float, spend: float = 0.95) -> dict[str, str]:
    """The risk-maximizing allocation that spends (nearly) the same memory: at least ``spend`` of
    the budget. Maximizing risk alone would also save memory (the riskiest formats are the
    cheapest), so unused memory is priced too; its price grows until the budget is spent."""
    top = max(v for r in risk.values() for v in r.values()) or 1.0
    total = sum(m["fp32"] for m in memory.values())
    most = {b: max(m.values()) for b, m in memory.items()}
    weight = 1.0
    while True:
        cost = {
            b: {f: (top - v) / top + weight * (most[b] - memory[b][f]) / total for f, v in r.items()}
            for b, r in risk.items()
        }
        formats = solve(cost, memory, budget).formats
        used = sum(memory[b][f] for b, f in formats.items()) / total
        if used >= spend * budget or weight > 1e6:
            return formats
        weight *= 4.0


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


if __name__ == "__main__":
    main()
