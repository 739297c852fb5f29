"""Do the risk terms of SGD's and Lion's momentum formats predict harm? The allocation-level test, paired runs.

The BlockwiseSGD / BlockwiseLion counterpart of test (i) of ``risk_validation.py`` (AdamW's), on its
digits task. One shared fp32 warm-up keeps shadow moments at every step (the betas of
:func:`~lightning_baoc.risk.momentum.shadow_betas`); :func:`~lightning_baoc.risk.momentum.momentum_risk_table`
then scores ``fp32``, ``bf16``, ``int8`` and ``none`` on every block (``lightning_baoc.partition``), and
the multiple-choice knapsack (``lightning_baoc.solver.solve``) picks the risk-minimizing allocation within
``--budget`` of the fp32 momentum state (4 bytes per element). Against it: the risk-maximizing allocation and
``--random`` random allocations, all of the same memory (between 0.95 and 1 of the budget, the range of
``risk_validation.riskiest``): on the digits MLP's 8 blocks every allocation in that range is enumerated, so
risk-max is the exact maximum of predicted risk and the random ones are drawn uniformly among them (where
that is too many to enumerate: ``risk_validation.py``'s ``riskiest`` and random risk tables). Each
allocation continues the warm-up for ``--steps`` steps on ``--orders`` data orders shared by all runs of that
order. Harm = held-out loss minus that of the fp32
continuation on the same order (paired; 'end': the mean of 5 evaluations over the last fifth, the measure
of record; 'path': the mean of 10 over the whole continuation), mean and standard error over orders.

The model is the digits task's 8-layer MLP with He (Kaiming-normal, zero bias) initialization: from
torch's default initialization SGD with momentum 0.9 stays at the ln 10 plateau for 900 steps at every
constant learning rate up to 0.6 and diverges at 1.0 (measured on this task). Learning rates (stress
recipe: constant, 3x a realistic peak, as ``sgd_lion.py``'s stress recipe): SGD 0.03 (momentum 0.9;
0.01 trains well, 0.1 diverges), Lion 3e-4 (betas 0.9, 0.99; the task's AdamW learning rate over 10), no
weight decay (as ``risk_validation.py``).

Run from the repository root (1 torch thread):

    python benchmarks/momentum_risk_validation.py --optimizer sgd            # ~7 min on 1 core
    python benchmarks/momentum_risk_validation.py --optimizer lion           # ~7 min on 1 core
    python benchmarks/momentum_risk_validation.py --optimizer sgd --quick    # smoke run, writes no docs page

Without ``--quick`` the results go to ``benchmarks/runs/momentum_risk_validation_<task>_<optimizer>.json``
and to the section ``momentum_risk_validation_<task>_<optimizer>`` of ``docs/benchmarks/risk-validation.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import json
import math
import statistics as stats
from pathlib import Path
from typing import Any, Sequence

import torch
from _report import command, machine, markdown_table, write_docs_section
from _tasks import Task, digits_task
from risk_validation import EVAL_POINTS, _count, _train, mean_sem, riskiest, spearman
from torch import nn

from lightning_baoc import BlockwiseLion, BlockwiseSGD, partition
from lightning_baoc.formats import MOMENTUM_FORMATS, resolve_in
from lightning_baoc.risk.momentum import momentum_risk_table, shadow_betas
from lightning_baoc.risk.shadow import ShadowMoments
from lightning_baoc.solver import solve

#: The momentum formats offered to every block.
FORMATS = ("fp32", "bf16", "int8", "none")
#: Constant (stress) learning rates on the digits MLP (see the module docstring).
LR = {"sgd": 0.03, "lion": 3e-4}
#: risk-max and the random allocations hold at least this fraction of the budget (``risk_validation.riskiest``'s).
SPEND = 0.95
#: Seed of the shared warm-up's data order (``risk_validation.py``'s).
WARMUP_SEED = 999
#: A fact about each optimizer's ``none`` that the tables do not show (appended to the outcome).
NOTE = {
    "sgd": (" Without a buffer (`none`), BlockwiseSGD steps by `lr * g` (torch's SGD, dampening 0); the buffer "
            "sums the gradients, so with it the step is about `lr * g / (1 - momentum)`, 10x larger: dropping a "
            "block's momentum also divides its step by 10. The risk model scores that as a bias (`(1 - c)^2`, "
            "0.81 at momentum 0.9), but at this stress learning rate the smaller step helps (momentum dropped on "
            "every block: -0.022 +- 0.011; fp32 at a 10x lower learning rate: -0.021 +- 0.011, 6 orders), and a "
            "risk, a size of deviation from the fp32 run, never predicts a gain: on this task the ordering "
            "risk-min < random is not shown for SGD."),
    "lion": "",
}
RUNS = Path(__file__).resolve().parent / "runs"


def make_optimizer(optimizer: str, model: nn.Module, lr: float) -> BlockwiseSGD | BlockwiseLion:
    """BlockwiseSGD (momentum 0.9) or BlockwiseLion (betas 0.9, 0.99), fp32 buffers, no weight decay."""
    if optimizer == "sgd":
        return BlockwiseSGD(model.named_parameters(), lr=lr, momentum=0.9)
    if optimizer == "lion":
        return BlockwiseLion(model.named_parameters(), lr=lr, betas=(0.9, 0.99))
    raise ValueError(f"Unknown optimizer={optimizer!r}; allowed: ['sgd', 'lion']")


def momentum_digits_task(lr: float) -> Task:
    """``_tasks.digits_task`` (data, batches, held-out loss, architecture) with He initialization
    (SGD does not leave the plateau of torch's default one) and learning rate ``lr``."""
    base = digits_task()

    def make() -> nn.Module:
        model = base.make_model()  # seeds torch's generator: the initialization below is fixed too
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
        return model

    return dataclasses.replace(base, make_model=make, lr=lr)


def warm_up(task: Task, optimizer: str, steps: int) -> tuple[tuple[bytes, bytes], ShadowMoments]:
    """The shared fp32 warm-up with shadow moments kept at every step: model and optimizer state as
    bytes, and the shadow."""
    model = task.make_model()
    opt = make_optimizer(optimizer, model, task.lr)
    return run_warm_up(task, model, opt, shadow_betas(opt), steps)


def run_warm_up(
    task: Task, model: nn.Module, opt: torch.optim.Optimizer, betas: dict[str, tuple[float, float]], steps: int
) -> tuple[tuple[bytes, bytes], ShadowMoments]:
    """``steps`` steps of ``opt`` on the task's shared warm-up data, shadow moments kept with ``betas``:
    model and optimizer state as bytes, and the shadow."""
    shadow = ShadowMoments(opt.named_params)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(WARMUP_SEED)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        task.loss(model, step, gen).backward()
        shadow.update(opt.named_params, betas)
        opt.step()
    mbuf, obuf = io.BytesIO(), io.BytesIO()
    torch.save(model.state_dict(), mbuf)
    torch.save(opt.state_dict(), obuf)
    return (mbuf.getvalue(), obuf.getvalue()), shadow


def restore(task: Task, optimizer: str, warm: tuple[bytes, bytes]) -> tuple[nn.Module, BlockwiseSGD | BlockwiseLion]:
    """Model and optimizer as the warm-up left them."""
    model = task.make_model()
    model.load_state_dict(torch.load(io.BytesIO(warm[0]), weights_only=True))
    opt = make_optimizer(optimizer, model, task.lr)
    opt.load_state_dict(torch.load(io.BytesIO(warm[1]), weights_only=True))
    return model, opt


def memory_table(opt: BlockwiseSGD | BlockwiseLion, blocks: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """Block -> momentum format -> exact state bytes, each tensor in the format it really gets."""
    shapes = {name: tuple(p.shape) for name, p in opt.named_params.items()}

    def nbytes(fmt: str, shape: tuple[int, ...]) -> int:
        return MOMENTUM_FORMATS[resolve_in(MOMENTUM_FORMATS, fmt, shape, opt.min_8bit_numel)].state_bytes(shape)

    return {b: {f: sum(nbytes(f, shapes[n]) for n in names) for f in FORMATS} for b, names in blocks.items()}


def allocations_in_range(risk: dict, memory: dict, budget: float, spend: float = SPEND,
                         limit: int = 1 << 20, reference: str = "fp32") -> list[dict[str, str]] | None:
    """Every allocation that holds between ``spend`` and all of ``budget`` (a fraction of the ``reference``
    column's total; the memory ``risk_validation.riskiest`` spends), in enumeration order; None where there
    are more than ``limit`` allocations to enumerate."""
    blocks = list(risk)
    if math.prod(len(risk[b]) for b in blocks) > limit:
        return None
    total = sum(memory[b][reference] for b in blocks)
    low, high = spend * budget * total, budget * total
    out = []
    for combo in itertools.product(*(list(risk[b]) for b in blocks)):
        if low <= sum(memory[b][f] for b, f in zip(blocks, combo)) <= high:
            out.append(dict(zip(blocks, combo)))
    return out


def choose_allocations(
    risk: dict, memory: dict, budget: float, n_random: int
) -> tuple[dict[str, dict[str, str]], int | None]:
    """Label -> block -> format, and how many allocations of the same memory there are (None: not
    enumerated). The allocations: risk-min (the solver's), risk-max and ``n_random`` random allocations of the
    same memory. Where the allocations holding ``SPEND`` to 1 of the budget can be enumerated, risk-max is the
    exact maximum of predicted risk among them and the random ones are drawn uniformly from them (so risk-min
    <= every random <= risk-max); else ``risk_validation.py``'s: ``riskiest``'s priced search and the least
    risky allocations under random risk tables."""
    out = {"risk-min": dict(solve(risk, memory, budget).formats)}
    candidates = allocations_in_range(risk, memory, budget)
    gen = torch.Generator().manual_seed(100)
    if candidates:
        out["risk-max"] = max(candidates, key=lambda a: sum(risk[b][f] for b, f in a.items()))
        picks = torch.randperm(len(candidates), generator=gen)[:n_random].tolist()
        out.update({f"random {k}": candidates[i] for k, i in enumerate(picks)})
        return out, len(candidates)
    out["risk-max"] = riskiest(risk, memory, budget, SPEND)
    for k in range(n_random):
        rnd = {b: {f: float(torch.rand(1, generator=gen)) for f in r} for b, r in risk.items()}
        out[f"random {k}"] = dict(solve(rnd, memory, budget).formats)
    return out, None


def continuation(
    task: Task, optimizer: str, warm: tuple[bytes, bytes], blocks: dict[str, list[str]], formats: dict[str, str],
    steps: int, order: int,
) -> tuple[float, float, int]:
    """The warm-up continued ``steps`` steps on data order ``order`` with ``formats`` (block -> format;
    empty: fp32): held-out loss (end, path) as ``risk_validation._train`` measures it, and the state
    bytes the optimizer holds at the end."""
    model, opt = restore(task, optimizer, warm)
    if formats:
        opt.set_formats(formats, blocks=blocks)
    end, path = _train(task, model, opt, steps, torch.Generator().manual_seed(order), EVAL_POINTS)
    return end, path, opt.state_bytes()


def validate(
    optimizer: str, budget: float, warmup: int, steps: int, orders: int, n_random: int, lr: float | None = None,
    log: bool = False,
) -> dict[str, Any]:
    """Run the test on the digits task; the results as a JSON-ready dict: the setting, ``blocks``, ``risk`` and
    ``memory`` (block -> format), ``fp32`` (the continuation's held-out losses by order, its state bytes),
    ``allocations`` (label -> ``formats``, ``memory`` from the table, measured ``state_bytes``,
    ``predicted_risk``, paired ``harm_end`` and ``harm_path`` by order) and :func:`summarize`'s ``summary``."""
    task = momentum_digits_task(LR[optimizer] if lr is None else lr)
    blocks = partition(task.make_model())
    warm, shadow = warm_up(task, optimizer, warmup)
    _, opt = restore(task, optimizer, warm)
    risk = momentum_risk_table(opt, blocks, shadow, formats=FORMATS, horizon=steps, seed=0)
    memory = memory_table(opt, blocks)
    fp32_bytes = sum(m["fp32"] for m in memory.values())
    base = [continuation(task, optimizer, warm, blocks, {}, steps, o) for o in range(orders)]
    results: dict[str, Any] = {
        "task": task.name, "optimizer": optimizer, "lr": task.lr, "budget": budget, "warmup": warmup,
        "steps": steps, "orders": orders, "random": n_random, "horizon": steps, "formats": list(FORMATS),
        "min_8bit_numel": opt.min_8bit_numel, "parameters": sum(p.numel() for p in opt.named_params.values()),
        "fp32_state_bytes": fp32_bytes, "budget_bytes": budget * fp32_bytes, "blocks": blocks, "risk": risk,
        "memory": memory, "fp32": {"end": [b[0] for b in base], "path": [b[1] for b in base], "state_bytes": base[0][2]},
        "allocations": {},
    }
    chosen, results["same_memory_allocations"] = choose_allocations(risk, memory, budget, n_random)
    for label, formats in chosen.items():
        runs = [continuation(task, optimizer, warm, blocks, formats, steps, o) for o in range(orders)]
        entry = {
            "formats": formats,
            "memory": sum(memory[b][f] for b, f in formats.items()),
            "state_bytes": runs[0][2],
            "predicted_risk": sum(risk[b][f] for b, f in formats.items()),
            "harm_end": [r[0] - b[0] for r, b in zip(runs, base)],
            "harm_path": [r[1] - b[1] for r, b in zip(runs, base)],
        }
        results["allocations"][label] = entry
        if log:
            print(label, json.dumps({k: v for k, v in entry.items() if k != "formats"}), flush=True)
    results["summary"] = summarize(results)
    return results


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """The paired comparisons: risk-max and the median random allocation against risk-min (per order,
    mean and sem), and the Spearman of predicted risk with mean harm over all the allocations."""
    allocs = results["allocations"]
    randoms = [k for k in allocs if k.startswith("random")]
    lo, hi = allocs["risk-min"]["harm_end"], allocs["risk-max"]["harm_end"]
    n = len(lo)
    median_random = [stats.median(allocs[k]["harm_end"][i] for k in randoms) for i in range(n)] if randoms else []
    out: dict[str, Any] = {}
    for name, diffs in (("max_minus_min", [hi[i] - lo[i] for i in range(n)]),
                        ("median_random_minus_min", [median_random[i] - lo[i] for i in range(n)] if randoms else [])):
        m, s = mean_sem(diffs) if diffs else (math.nan, math.nan)
        out[name] = {"mean": m, "sem": s}
    means = {k: stats.mean(a["harm_end"]) for k, a in allocs.items()}
    out["median_random_harm"] = stats.median(means[k] for k in randoms) if randoms else math.nan
    out["randoms_above_min"] = sum(1 for k in randoms if means[k] > means["risk-min"])
    out["spearman"] = spearman([a["predicted_risk"] for a in allocs.values()], list(means.values()))
    return out


def _cell(xs: list[float]) -> str:
    m, s = mean_sem(xs)
    return f"{m:+.4f} +- {s:.4f}"


def verdict(summary: dict[str, Any]) -> str:
    """One sentence on the outcome, from the numbers alone (beyond 2 sem: a difference; else: within noise)."""

    def compare(key: str, what: str) -> str:
        m, s = summary[key]["mean"], summary[key]["sem"]
        if math.isnan(m) or math.isnan(s):
            return f"{what}: not measured"
        if m > 2 * s:
            return f"risk-min harms less than {what} ({m:+.4f} +- {s:.4f}, beyond 2 sem)"
        if m < -2 * s:
            return f"risk-min harms MORE than {what} ({-m:+.4f} +- {s:.4f}, beyond 2 sem): the risk model fails here"
        return f"risk-min and {what} are within noise of each other ({m:+.4f} +- {s:.4f})"

    return (compare("median_random_minus_min", "the median random allocation") + "; "
            + compare("max_minus_min", "risk-max") + ".")


def report(results: dict[str, Any]) -> str:
    """The markdown body of the docs section: intro, setting, the allocation table, the risk table."""
    allocs, s = results["allocations"], results["summary"]
    fp32 = results["fp32"]["state_bytes"]
    rows = []
    for label, a in allocs.items():
        counts = ", ".join(f"{f} {n}" for f, n in sorted(_count(a["formats"].values()).items()))
        rows.append([label, f"{a['memory'] / fp32:.3f}", f"{a['state_bytes'] / fp32:.3f}", f"{a['predicted_risk']:.4g}",
                     _cell(a["harm_end"]), _cell(a["harm_path"]), counts])
    name = {"sgd": "BlockwiseSGD (momentum 0.9)", "lion": "BlockwiseLion (betas 0.9, 0.99)"}[results["optimizer"]]
    end = results["fp32"]["end"]
    recorded = results["lr"] == LR[results["optimizer"]]  # the stress learning rate the NOTE is about
    title = name if recorded else f"{name} at lr {results['lr']:g}"
    note = NOTE[results["optimizer"]] if recorded else ""
    risk_rows = [[b, *(f"{results['risk'][b][f]:.3g}" for f in FORMATS),
                  allocs["risk-min"]["formats"][b], allocs["risk-max"]["formats"][b]] for b in results["blocks"]]
    return (
        f"## Momentum formats: {title}, digits MLP\n\n"
        "The allocation-level test for the momentum formats of BlockwiseSGD and BlockwiseLion "
        "(`benchmarks/momentum_risk_validation.py`; the risk terms of `lightning_baoc.risk.momentum`): within a "
        "tight budget of the fp32 momentum state, does the allocation that minimizes the predicted risk harm "
        "training less than random allocations and than the riskiest one of the same memory? "
        f"Outcome: {verdict(s)}{note}\n\n"
        f"Machine: {results['machine']}. Command: `{results['command']}`\n\n"
        f"Task `{results['task']}`, the 8-layer MLP ({results['parameters']:,} parameters) with He initialization: "
        f"fp32 warm-up {results['warmup']} steps with shadow moments, then {results['steps']} steps at constant lr "
        f"{results['lr']}, {results['orders']} data orders (paired). Harm = held-out loss minus the fp32 "
        f"continuation's on the same order, mean +- standard error (the noise floor) over orders; 'end' is the mean "
        f"of {EVAL_POINTS} evaluations over the last fifth (the measure of record), 'path' the mean of "
        f"{2 * EVAL_POINTS} over the whole continuation. Budget {results['budget']} of the fp32 momentum state "
        f"({fp32:,} bytes); formats {', '.join(FORMATS)}; horizon {results['horizon']}. fp32 continuation "
        f"held-out loss (end): {stats.mean(end):.4f} (spread over orders {max(end) - min(end):.4f}).\n\n"
        + (f"Risk-max is the highest predicted risk among the {results['same_memory_allocations']:,} allocations "
           f"holding {SPEND} to 1 of the budget, the random ones are drawn uniformly among them. "
           if results["same_memory_allocations"] else "Risk-max and the random allocations as in `risk_validation.py`. ")
        + f"Median random allocation's harm {s['median_random_harm']:+.4f}; paired by order, median random minus "
        f"risk-min {s['median_random_minus_min']['mean']:+.4f} +- {s['median_random_minus_min']['sem']:.4f}, "
        f"risk-max minus risk-min {s['max_minus_min']['mean']:+.4f} +- {s['max_minus_min']['sem']:.4f}; "
        f"{s['randoms_above_min']} of {len(allocs) - 2} random allocations harm more than risk-min on average; "
        f"Spearman(predicted risk, harm) over the {len(allocs)} allocations {s['spearman']:+.2f}. 'memory' is the "
        "solver's table, 'measured' the optimizer's `state_bytes()` after the continuation, both over the fp32 "
        "state:\n\n"
        + markdown_table(["allocation", "memory / fp32", "measured / fp32", "predicted risk", "harm (end)",
                          "harm (path)", "blocks per format"], rows)
        + "\n\n<details markdown=\"1\"><summary>risk table and the two extreme allocations</summary>\n\n"
        + markdown_table(["block", *FORMATS, "risk-min", "risk-max"], risk_rows)
        + "\n\n</details>"
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", choices=["sgd", "lion"], required=True)
    parser.add_argument("--task", choices=["digits"], default="digits")
    parser.add_argument("--budget", type=float, default=0.25, help="fraction of the fp32 momentum state (default: 0.25)")
    parser.add_argument("--warmup", type=int, default=300, help="shared fp32 warm-up steps (default: 300)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: sgd 0.03, lion 3e-4)")
    args = parse_run_arguments(parser, argv, "momentum_risk_validation_<task>_<optimizer>")
    results = validate(args.optimizer, args.budget, args.warmup, args.steps, args.orders, args.random, args.lr, log=True)
    # a learning rate other than the recorded one is a run of its own: its own file and docs section
    name = f"momentum_risk_validation_{args.task}_{args.optimizer}" + (f"_lr{args.lr:g}" if args.lr is not None else "")
    return publish(results, report, name, args)


def parse_run_arguments(parser: argparse.ArgumentParser, argv: list[str] | None, name: str) -> argparse.Namespace:
    """Add the arguments every allocation-level validation takes (continuation steps, data orders,
    random allocations, threads, results file ``benchmarks/runs/<name>.json``, smoke run), parse
    ``argv``, shrink a ``--quick`` run and set the threads."""
    parser.add_argument("--steps", type=int, default=600, help="steps of every continuation (default: 600)")
    parser.add_argument("--orders", type=int, default=10, help="data orders, paired (default: 10)")
    parser.add_argument("--random", type=int, default=10, help="random allocations (default: 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"results file (default: benchmarks/runs/{name}.json; with --quick: none)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny settings, writes no docs page")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.steps, args.orders, args.random = 50, 50, 2, 2
    torch.set_num_threads(args.threads)
    return args


def publish(results: dict[str, Any], render: Any, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Record the machine, torch and the command in ``results``, print ``render(results)``, write the JSON
    (``--json``, else ``benchmarks/runs/<name>.json`` unless ``--quick``) and, unless ``--quick``, the
    docs section ``name`` of the risk-validation page."""
    results.update(machine=machine(), command=command(), torch=torch.__version__, threads=args.threads, quick=args.quick)
    body = render(results)
    print(body)
    path = args.json or (None if args.quick else RUNS / f"{name}.json")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"results in {path}")
    if not args.quick:
        write_docs_section("benchmarks/risk-validation.md", name, body)
    return results


if __name__ == "__main__":
    main()
