"""Does the risk model predict measured harm? Two tests on real tasks, paired runs.

Every run starts from one shared fp32 warm-up (model and BlockwiseAdamW state), switches some
blocks to cheaper formats, trains ``--steps`` more steps on a data order shared by all runs of that
order, and reports the held-out loss. Harm = held-out loss minus that of the fp32 continuation with
the same data order (paired), averaged over ``--orders`` data orders; the noise floor is the
standard error of that mean.

(i) allocation level: at a tight budget (``--budget``, a fraction of fp32 AdamW state), the
    risk-minimizing allocation against the risk-maximizing one of the same budget and against
    ``--random`` random allocations of the same budget;
(ii) block level: one block at a time in each of the cheap formats; Spearman correlation of
    predicted risk with measured harm, overall and within each format.

Tasks: ``digits`` (an 8-layer MLP on scikit-learn's digits) and ``chargpt`` (a 4-layer character
GPT on the Python standard library's source). Constant learning rate (the stress recipe, where
state-format harms show).

Run from the repository root:

    python benchmarks/risk_validation.py --task digits            # ~10 min on 2 cores
    python benchmarks/risk_validation.py --task chargpt           # ~1-2 h on 2 cores
    python benchmarks/risk_validation.py --task digits --quick    # smoke run, no README update
"""

from __future__ import annotations

import argparse
import copy
import io
import math
import statistics as stats
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from _models import CharGPT
from _report import command, machine, markdown_table, write_readme_section
from lightning_baoc import BlockwiseAdamW, partition
from lightning_baoc.formats import format_state_bytes
from lightning_baoc.risk import risk_details
from lightning_baoc.solver import solve

CHEAP = ["nomomentum", "int8", "factored", "nomomentum_int8", "int8_factored", "bf16"]


@dataclass
class Task:
    name: str
    make_model: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, torch.Generator], torch.Tensor]  # training loss of one batch
    heldout: Callable[[nn.Module], float]
    lr: float


def digits_task() -> Task:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    xtr, ytr, xte, yte = x[order[:1400]], y[order[:1400]], x[order[1400:]], y[order[1400:]]

    def make() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(64, 128), nn.GELU()]
        for _ in range(6):
            layers += [nn.Linear(128, 128), nn.GELU()]
        layers.append(nn.Linear(128, 10))
        return nn.Sequential(*layers)

    def loss(model: nn.Module, step: int, gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, len(xtr), (32,), generator=gen)
        return nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])

    def heldout(model: nn.Module) -> float:
        with torch.no_grad():
            return nn.functional.cross_entropy(model(xte), yte).item()

    return Task("digits", make, loss, heldout, lr=3e-3)


def chargpt_task() -> Task:
    import inspect
    import argparse as a, json.decoder as j, textwrap as t, string as s, csv as c, difflib as d, configparser as cp

    text = "".join(inspect.getsource(m) for m in (a, j, t, s, c, d, cp))
    chars = sorted(set(text))
    lookup = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([lookup[ch] for ch in text], dtype=torch.int64)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    block = 64
    vgen = torch.Generator().manual_seed(1234)
    vstarts = torch.randint(len(val) - block - 1, (64,), generator=vgen)
    vx = torch.stack([val[i : i + block] for i in vstarts])
    vy = torch.stack([val[i + 1 : i + 1 + block] for i in vstarts])

    def make() -> nn.Module:
        torch.manual_seed(0)
        return CharGPT(vocab_size=len(chars), block_size=block, n_layer=4, n_head=4, n_embd=128)

    def loss(model: nn.Module, step: int, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(len(train) - block - 1, (32,), generator=gen)
        x = torch.stack([train[i : i + block] for i in starts])
        y = torch.stack([train[i + 1 : i + 1 + block] for i in starts])
        return model(x, y)[1]

    def heldout(model: nn.Module) -> float:
        with torch.no_grad():
            return model(vx, vy)[1].item()

    return Task("chargpt", make, loss, heldout, lr=2e-3)


def _train(
    task: Task, model: nn.Module, opt: BlockwiseAdamW, steps: int, gen: torch.Generator, eval_points: int = 0
) -> float:
    """Train ``steps`` steps; return the mean held-out loss at ``eval_points`` evenly spaced points
    of the last fifth of training (averaging damps the step-to-step fluctuation of a constant-lr
    run, the largest part of the noise floor), or nan without evaluation points."""
    at = {steps - 1 - i * max(1, steps // (5 * max(eval_points, 1))) for i in range(eval_points)}
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        task.loss(model, step, gen).backward()
        opt.step()
        if step in at:
            losses.append(task.heldout(model))
    return sum(losses) / len(losses) if losses else math.nan


def warm_up(task: Task, steps: int) -> tuple[bytes, bytes]:
    model = task.make_model()
    opt = BlockwiseAdamW(model.named_parameters(), lr=task.lr, weight_decay=0.0, min_8bit_numel=0)
    _train(task, model, opt, steps, torch.Generator().manual_seed(999))
    mbuf, obuf = io.BytesIO(), io.BytesIO()
    torch.save(model.state_dict(), mbuf)
    torch.save(opt.state_dict(), obuf)
    return mbuf.getvalue(), obuf.getvalue()


def restore(task: Task, warm: tuple[bytes, bytes]) -> tuple[nn.Module, BlockwiseAdamW]:
    model = task.make_model()
    model.load_state_dict(torch.load(io.BytesIO(warm[0]), weights_only=True))
    opt = BlockwiseAdamW(model.named_parameters(), lr=task.lr, weight_decay=0.0, min_8bit_numel=0)
    opt.load_state_dict(torch.load(io.BytesIO(warm[1]), weights_only=True))
    return model, opt


EVAL_POINTS = 5


def run(task: Task, warm: tuple[bytes, bytes], formats: dict[str, str], blocks: dict, steps: int, order: int) -> float:
    model, opt = restore(task, warm)
    if formats:
        opt.set_formats(formats, blocks=blocks)
    return _train(task, model, opt, steps, torch.Generator().manual_seed(order), EVAL_POINTS)


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


def mean_sem(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], math.nan
    return stats.mean(xs), stats.stdev(xs) / math.sqrt(len(xs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["digits", "chargpt"], default="digits")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--orders", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--random", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=8, help="blocks in the block-level test")
    parser.add_argument("--formats", nargs="*", default=["nomomentum", "int8", "factored", "nomomentum_int8"])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.steps, args.orders, args.random, args.blocks = 50, 50, 2, 2, 3
    torch.set_num_threads(1 if args.task == "digits" else torch.get_num_threads())
    task = digits_task() if args.task == "digits" else chargpt_task()
    model = task.make_model()
    blocks = partition(model)
    warm = warm_up(task, args.warmup)
    _, opt = restore(task, warm)
    details = risk_details(opt, blocks, horizon=args.steps)
    risk = {b: {f: d.risk[f] for f in ["fp32"] + CHEAP} for b, d in details.items()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    memory = {b: {f: sum(format_state_bytes(f, shapes[n], 0) for n in names) for f in risk[b]} for b, names in blocks.items()}
    orders = list(range(args.orders))
    base = {o: run(task, warm, {}, blocks, args.steps, o) for o in orders}
    print(f"fp32 continuation held-out loss by order: {base}", flush=True)

    # (i) allocation level
    lo = solve(risk, memory, args.budget)
    flipped = {b: {f: max(r.values()) - v for f, v in r.items()} for b, r in risk.items()}
    hi = solve(flipped, memory, args.budget)
    allocations = {"risk-min": lo.formats, "risk-max": hi.formats}
    for k in range(args.random):
        gen = torch.Generator().manual_seed(100 + k)
        rnd = {b: {f: float(torch.rand(1, generator=gen)) for f in r} for b, r in risk.items()}
        allocations[f"random {k}"] = solve(rnd, memory, args.budget).formats
    alloc_rows, harms_of = [], {}
    for label, alloc in allocations.items():
        harms = [run(task, warm, alloc, blocks, args.steps, o) - base[o] for o in orders]
        harms_of[label] = harms
        mem = sum(memory[b][f] for b, f in alloc.items()) / sum(memory[b]["fp32"] for b in memory)
        predicted = sum(risk[b][f] for b, f in alloc.items())
        m, s = mean_sem(harms)
        alloc_rows.append([label, f"{mem:.3f}", f"{predicted:.4g}", f"{m:+.4f}", f"{s:.4f}"])
        print(alloc_rows[-1], flush=True)
    random_means = [stats.mean(harms_of[k]) for k in harms_of if k.startswith("random")]
    median_random = stats.median(random_means) if random_means else math.nan

    # (ii) block level: the largest 2-D blocks
    sizes = {b: sum(shapes[n].numel() for n in names if len(shapes[n]) >= 2) for b, names in blocks.items()}
    chosen = sorted(sizes, key=sizes.get, reverse=True)[: args.blocks]
    block_rows, pred_all, harm_all, per_format = [], [], [], {}
    for b in chosen:
        for f in args.formats:
            harms = [run(task, warm, {b: f}, blocks, args.steps, o) - base[o] for o in orders]
            m, s = mean_sem(harms)
            pred_all.append(risk[b][f])
            harm_all.append(m)
            per_format.setdefault(f, ([], [], []))
            per_format[f][0].append(risk[b][f])
            per_format[f][1].append(m)
            per_format[f][2].append(s)
            block_rows.append([b, f, f"{risk[b][f]:.3g}", f"{m:+.5f}", f"{s:.5f}"])
            print(block_rows[-1], flush=True)
    corr_rows = [["all", f"{spearman(pred_all, harm_all):+.2f}", len(pred_all), ""]]
    for f, (p, h, s) in per_format.items():
        above = sum(1 for hh, ss in zip(h, s) if not math.isnan(ss) and abs(hh) > 2 * ss)
        corr_rows.append([f, f"{spearman(p, h):+.2f}", len(p), f"{above}/{len(p)}"])

    paired = [harms_of["risk-max"][i] - harms_of["risk-min"][i] for i in range(len(orders))]
    pm, ps = mean_sem(paired)
    vs_random = [
        stats.median(harms_of[k][i] for k in harms_of if k.startswith("random")) - harms_of["risk-min"][i]
        for i in range(len(orders))
    ]
    rm, rs = mean_sem(vs_random)
    summary = (
        f"Task `{task.name}`: fp32 warm-up {args.warmup} steps, then {args.steps} steps at constant lr "
        f"{task.lr}, {args.orders} data orders (paired). Harm = held-out loss (mean of {EVAL_POINTS} evaluations over the last fifth) minus the fp32 continuation's "
        f"on the same order, mean and standard error (the noise floor) over orders. Budget {args.budget} "
        f"of fp32 AdamW state. fp32 continuation held-out loss: "
        f"{stats.mean(base.values()):.4f} (spread over orders {max(base.values()) - min(base.values()):.4f}).\n\n"
        f"(i) allocations (median harm of the random ones: {median_random:+.4f}); paired by order, "
        f"risk-max minus risk-min {pm:+.4f} +- {ps:.4f} (sem), median random minus risk-min "
        f"{rm:+.4f} +- {rs:.4f}:\n\n"
        + markdown_table(["allocation", "memory / fp32", "predicted risk", "harm", "sem"], alloc_rows)
        + "\n\n(ii) one block at a time, Spearman(predicted risk, measured harm); "
        "'above noise' counts harms beyond 2 sem:\n\n"
        + markdown_table(["formats", "Spearman", "pairs", "above noise"], corr_rows)
        + "\n\n<details><summary>block-level runs</summary>\n\n"
        + markdown_table(["block", "format", "predicted risk", "harm", "sem"], block_rows)
        + "\n\n</details>"
    )
    print(summary)
    if not args.quick:
        write_readme_section(
            f"risk_validation_{task.name}",
            f"Machine: {machine()}. Command: `{command()}`\n\n{summary}",
        )


if __name__ == "__main__":
    main()
