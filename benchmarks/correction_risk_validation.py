"""Does the correction risk predict harm? The allocation-level test of master-weight corrections, paired runs.

The bf16-weight counterpart of ``momentum_risk_validation.py`` (same digits task, same design). The digits
MLP of ``risk_validation.py`` is held in bf16 (``model.to(torch.bfloat16)``, Lightning's ``precision="bf16-true"``;
the loss in fp32 on the bf16 logits) and trained by BlockwiseAdamW with int8 states on every tensor
(``min_8bit_numel=0``, no weight decay, as ``risk_validation.py``), fixed: only the master-weight corrections
(``none``, ``ecc8``, ``ecc16``; :mod:`lightning_baoc.optim.masters`) vary. One shared warm-up with ecc16 on
every block keeps shadow moments at every step; :func:`~lightning_baoc.risk.correction.correction_risk_table`
then scores the three corrections on every block (``lightning_baoc.partition``: the 8 linear layers) at the
continuation's learning rate, and the solver (``lightning_baoc.solver.solve``, exact) picks the risk-minimizing
allocation within ``--budget`` of the corrections' bytes of ecc16 on every block (2 bytes per parameter; the
states are the same in every run and not counted). Against it: the risk-maximizing allocation and ``--random``
random allocations of the same memory: all 3**8 allocations are enumerated, risk-max is the highest predicted
risk among those holding 0.95 to 1 of the budget, the random ones are drawn uniformly among them. Each
allocation continues the warm-up for ``--steps`` steps on ``--orders`` data orders shared by all runs of that
order. Harm = held-out loss minus that of the reference continuation (ecc16 on every block: the exact fp32
master) on the same order (paired; 'end' and 'path' as ``momentum_risk_validation.py``), mean and standard
error over orders. Every block without a correction is run too, as the harm at stake (outside the comparison).

Regime (chosen on data order 0, nothing tuned beyond it). Lost updates matter where the learning rate is
small next to the weights' bf16 spacing, so the continuation runs at a constant low learning rate. Tried:
warm-up 300 steps at the continuation's own rate, from the initialization: at 3e-5 the model stays on the
ln 10 plateau (held-out 2.30 after the warm-up) and at 1e-4 reaches 1.55, i.e. early training; uniform
``none`` against ecc16 after 600 more steps: +0.24 (1e-4), +0.62 (3e-5). Warm-up 300 steps at the digits
task's AdamW rate 3e-3 (held-out 0.219), then 600 steps at the low rate (the annealed tail of a run): uniform
``none`` harms +0.022 at 1e-4 (0.158 -> 0.180) and +0.043 at 3e-5 (0.167 -> 0.209); uniform ``ecc8`` is within
4e-5 of ecc16 at both. Recorded: warm-up at 3e-3, continuation at 1e-4 (``none`` measurably harms there, while
not every update is lost). Budget 0.35 of ecc16 everywhere: at 0.3 no allocation holds 0.95 to 1 of the
budget (the blocks' corrections come in steps of 8,320 and 16,512 bytes), at 0.35 180 do; it holds ecc8 on the
first layer, the head and 4 of the 6 hidden layers at most: two hidden layers must drop to ``none``.

Run from the repository root (1 torch thread):

    python benchmarks/correction_risk_validation.py --threads 1           # ~17 min on 1 core
    python benchmarks/correction_risk_validation.py --threads 1 --quick   # smoke run, writes no docs page

Without ``--quick`` the results go to ``benchmarks/runs/correction_risk_validation_<task>.json`` and to the
section ``correction_risk_validation_<task>`` of ``docs/benchmarks/risk-validation.md`` (a learning rate other
than the recorded one: ``..._lr<lr>``, its own file and section).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import statistics as stats
from typing import Any, Sequence

import torch
from _report import markdown_table
from _tasks import Task, digits_task
from momentum_risk_validation import (
    SPEND,
    _cell,
    allocations_in_range,
    parse_run_arguments,
    publish,
    run_warm_up,
    summarize,
    verdict,
)
from risk_validation import EVAL_POINTS, _count, _train
from torch import nn

from lightning_baoc import BlockwiseAdamW, partition
from lightning_baoc.formats.correction import CORRECTIONS, WEIGHT_DTYPES, correction_dtype
from lightning_baoc.risk.correction import correction_risk_table
from lightning_baoc.risk.shadow import ShadowMoments
from lightning_baoc.solver import solve

#: The reference continuation's correction on every block (and the warm-up's): the exact fp32 master for bf16.
REFERENCE = "ecc16"
#: AdamW's betas (the shadow follows them).
BETAS = (0.9, 0.999)
#: The continuation's constant learning rate (see the module docstring).
LR = 1e-4
#: The warm-up's learning rate: the digits task's AdamW rate (``_tasks.digits_task``).
WARMUP_LR = 3e-3
#: The corrections' budget, a fraction of ecc16 on every block (see the module docstring).
BUDGET = 0.35


class BF16Net(nn.Module):
    """A model held in bf16 (Lightning's ``precision="bf16-true"``): fp32 inputs are cast to bf16 and the
    bf16 logits back to fp32, so the loss is computed in fp32."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(torch.bfloat16)).float()


def bf16_digits_task(lr: float) -> Task:
    """``_tasks.digits_task`` (data, batches, held-out loss, the MLP and its initialization) with
    the model in bf16 and learning rate ``lr``."""
    base = digits_task()
    return dataclasses.replace(base, make_model=lambda: BF16Net(base.make_model()), lr=lr)


def make_optimizer(model: nn.Module, lr: float) -> BlockwiseAdamW:
    """BlockwiseAdamW: int8 states on every tensor (``min_8bit_numel=0``), ecc16 corrections, no weight decay."""
    return BlockwiseAdamW(model.named_parameters(), lr=lr, betas=BETAS, weight_decay=0.0, state_format="int8",
                          weight_correction=REFERENCE, min_8bit_numel=0)


def set_lr(opt: BlockwiseAdamW, lr: float) -> None:
    """Every group's learning rate to ``lr`` (a loaded state dict brings back the warm-up's)."""
    for group in opt.param_groups:
        group["lr"] = lr


def warm_up(task: Task, steps: int, lr: float) -> tuple[tuple[bytes, bytes], ShadowMoments]:
    """The shared warm-up (bf16 weights, ecc16 corrections, int8 states) at learning rate ``lr`` with shadow
    moments kept at every step: model and optimizer state as bytes, and the shadow."""
    model = task.make_model()
    opt = make_optimizer(model, lr)
    return run_warm_up(task, model, opt, {name: BETAS for name in opt.named_params}, steps)


def restore(task: Task, warm: tuple[bytes, bytes]) -> tuple[nn.Module, BlockwiseAdamW]:
    """Model and optimizer as the warm-up left them, at the task's learning rate."""
    model = task.make_model()
    model.load_state_dict(torch.load(io.BytesIO(warm[0]), weights_only=True))
    opt = make_optimizer(model, task.lr)
    opt.load_state_dict(torch.load(io.BytesIO(warm[1]), weights_only=True))
    set_lr(opt, task.lr)
    return model, opt


def memory_table(opt: BlockwiseAdamW, blocks: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """Block -> correction -> bytes of its corrections (0 for fp32 tensors: their own masters)."""

    def nbytes(c: str, p: torch.Tensor) -> int:
        store = correction_dtype(c)
        return 0 if store is None or p.dtype not in WEIGHT_DTYPES else p.numel() * store.itemsize

    named = opt.named_params
    return {b: {c: sum(nbytes(c, named[n]) for n in names) for c in CORRECTIONS} for b, names in blocks.items()}


def continuation(
    task: Task, warm: tuple[bytes, bytes], blocks: dict[str, list[str]], corrections: dict[str, str], steps: int,
    order: int,
) -> tuple[float, float, int, int]:
    """The warm-up continued ``steps`` steps on data order ``order`` with ``corrections`` (block -> correction;
    empty: ecc16 everywhere): held-out loss (end, path) as ``risk_validation._train`` measures it, and the
    correction and state bytes the optimizer holds at the end."""
    model, opt = restore(task, warm)
    if corrections:
        opt.set_weight_corrections(corrections, blocks=blocks)
    end, path = _train(task, model, opt, steps, torch.Generator().manual_seed(order), EVAL_POINTS)
    return end, path, opt.weight_correction_bytes(), opt.state_bytes()


def choose_allocations(
    risk: dict[str, dict[str, float]], memory: dict[str, dict[str, int]], budget: float, n_random: int
) -> tuple[dict[str, dict[str, str]], int]:
    """Label -> block -> correction, and how many allocations hold ``SPEND`` to 1 of the budget: risk-min (the
    solver's, within ``budget`` of ecc16 everywhere), risk-max (the highest predicted risk among those
    allocations) and ``n_random`` drawn uniformly among them (so risk-min <= every random <= risk-max)."""
    full = sum(m[REFERENCE] for m in memory.values())
    out = {"risk-min": dict(solve(risk, memory, int(budget * full), method="exact").formats)}
    candidates = allocations_in_range(memory, memory, budget, reference=REFERENCE) or []
    if not candidates:
        raise ValueError(f"budget={budget}: no allocation holds {SPEND} to 1 of it (the blocks' bytes come in "
                         f"coarse steps); choose another budget")
    out["risk-max"] = max(candidates, key=lambda a: sum(risk[b][c] for b, c in a.items()))
    picks = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(100))[:n_random].tolist()
    out.update({f"random {k}": candidates[i] for k, i in enumerate(picks)})
    return out, len(candidates)


def _entry(risk: dict, memory: dict, corrections: dict[str, str], runs: list, base: list) -> dict[str, Any]:
    """One allocation's record: its corrections, bytes (table and measured), predicted risk, paired harms."""
    return {
        "corrections": corrections,
        "memory": sum(memory[b][c] for b, c in corrections.items()),
        "correction_bytes": runs[0][2],
        "state_bytes": runs[0][3],
        "predicted_risk": sum(risk[b][c] for b, c in corrections.items()),
        "harm_end": [r[0] - b[0] for r, b in zip(runs, base)],
        "harm_path": [r[1] - b[1] for r, b in zip(runs, base)],
    }


def validate(
    budget: float, warmup: int, warmup_lr: float, steps: int, orders: int, n_random: int, lr: float,
    log: bool = False,
) -> dict[str, Any]:
    """Run the test; the results as a JSON-ready dict: the setting, ``blocks``, ``risk`` and ``memory`` (block
    -> correction), ``reference`` (the ecc16 continuation's held-out losses by order, its bytes), ``uniform_none``
    (every block without a correction: the harm at stake, outside the comparison), ``allocations`` (label ->
    :func:`_entry`) and ``momentum_risk_validation.summarize``'s ``summary``."""
    task = bf16_digits_task(lr)
    blocks = partition(task.make_model())
    warm, shadow = warm_up(task, warmup, warmup_lr)
    _, opt = restore(task, warm)
    risk = correction_risk_table(opt, blocks, shadow, {name: BETAS for name in opt.named_params}, CORRECTIONS)
    memory = memory_table(opt, blocks)
    full = sum(m[REFERENCE] for m in memory.values())
    base = [continuation(task, warm, blocks, {}, steps, o) for o in range(orders)]
    results: dict[str, Any] = {
        "task": task.name, "lr": lr, "warmup_lr": warmup_lr, "budget": budget, "warmup": warmup, "steps": steps,
        "orders": orders, "random": n_random, "corrections": list(CORRECTIONS), "state_format": "int8",
        "parameters": sum(p.numel() for p in opt.named_params.values()), "ecc16_bytes": full,
        "budget_bytes": budget * full, "blocks": blocks, "risk": risk, "memory": memory,
        "reference": {"end": [b[0] for b in base], "path": [b[1] for b in base], "correction_bytes": base[0][2],
                      "state_bytes": base[0][3]},
        "allocations": {},
    }
    none = {b: "none" for b in blocks}
    runs = [continuation(task, warm, blocks, none, steps, o) for o in range(orders)]
    results["uniform_none"] = _entry(risk, memory, none, runs, base)
    chosen, results["same_memory_allocations"] = choose_allocations(risk, memory, budget, n_random)
    for label, corrections in chosen.items():
        runs = [continuation(task, warm, blocks, corrections, steps, o) for o in range(orders)]
        entry = results["allocations"][label] = _entry(risk, memory, corrections, runs, base)
        if log:
            print(label, json.dumps({k: v for k, v in entry.items() if k != "corrections"}), flush=True)
    results["summary"] = summarize(results)
    return results


def report(results: dict[str, Any]) -> str:
    """The markdown body of the docs section: intro, setting, the allocation table, the risk table."""
    allocs, s, full = results["allocations"], results["summary"], results["ecc16_bytes"]
    rows = []
    for label, a in allocs.items():
        counts = ", ".join(f"{c} {n}" for c, n in sorted(_count(a["corrections"].values()).items()))
        rows.append([label, f"{a['memory'] / full:.3f}", f"{a['correction_bytes'] / full:.3f}",
                     f"{a['predicted_risk']:.4g}", _cell(a["harm_end"]), _cell(a["harm_path"]), counts])
    end, none = results["reference"]["end"], results["uniform_none"]
    risk_rows = [[b, f"{results['memory'][b][REFERENCE]:,}", *(f"{results['risk'][b][c]:.3g}" for c in CORRECTIONS),
                  allocs["risk-min"]["corrections"][b], allocs["risk-max"]["corrections"][b]] for b in results["blocks"]]
    return (
        f"## Master-weight corrections: bf16 weights, digits MLP, lr {results['lr']:g}\n\n"
        "The allocation-level test for the master-weight corrections of bf16 weights "
        "(`benchmarks/correction_risk_validation.py`; the risk term of `lightning_baoc.risk.correction`): within a "
        "tight budget of the corrections' bytes, does the allocation that minimizes the predicted risk harm "
        "training less than random allocations and than the riskiest one of the same memory? "
        f"Outcome: {verdict(s)}\n\n"
        f"Machine: {results['machine']}. Command: `{results['command']}`\n\n"
        f"Task `{results['task']}`, the 8-layer MLP ({results['parameters']:,} parameters) in bf16 (the loss in "
        f"fp32 on the bf16 logits), BlockwiseAdamW with int8 states on every tensor (fixed; no weight decay): a "
        f"shared warm-up of {results['warmup']} steps at lr {results['warmup_lr']:g} with ecc16 corrections and "
        f"shadow moments, then {results['steps']} steps at constant lr {results['lr']:g}, {results['orders']} data "
        "orders (paired). Harm = held-out loss minus the reference continuation's (ecc16 on every block, the exact "
        "fp32 master) on the same order, mean +- standard error (the noise floor) over orders; 'end' is the mean "
        f"of {EVAL_POINTS} evaluations over the last fifth (the measure of record), 'path' the mean of "
        f"{2 * EVAL_POINTS} over the whole continuation. Budget {results['budget']} of the bytes of ecc16 on every "
        f"block ({full:,} bytes, 2 per parameter); corrections {', '.join(CORRECTIONS)}. Reference continuation "
        f"held-out loss (end): {stats.mean(end):.4f} (spread over orders {max(end) - min(end):.4f}); every block "
        f"without a correction (0 bytes, outside the comparison): harm {_cell(none['harm_end'])} (end), "
        f"{_cell(none['harm_path'])} (path), predicted risk {none['predicted_risk']:.4g}.\n\n"
        f"Risk-max is the highest predicted risk among the {results['same_memory_allocations']:,} allocations "
        f"holding {SPEND} to 1 of the budget, the random ones are drawn uniformly among them. "
        f"Median random allocation's harm {s['median_random_harm']:+.4f}; paired by order, median random minus "
        f"risk-min {s['median_random_minus_min']['mean']:+.4f} +- {s['median_random_minus_min']['sem']:.4f}, "
        f"risk-max minus risk-min {s['max_minus_min']['mean']:+.4f} +- {s['max_minus_min']['sem']:.4f}; "
        f"{s['randoms_above_min']} of {len(allocs) - 2} random allocations harm more than risk-min on average; "
        f"Spearman(predicted risk, harm) over the {len(allocs)} allocations {s['spearman']:+.2f}. 'memory' is the "
        "table's correction bytes, 'measured' the optimizer's `weight_correction_bytes()` after the continuation, "
        "both over ecc16 everywhere:\n\n"
        + markdown_table(["allocation", "memory / ecc16", "measured / ecc16", "predicted risk", "harm (end)",
                          "harm (path)", "blocks per correction"], rows)
        + "\n\n<details markdown=\"1\"><summary>risk table and the two extreme allocations</summary>\n\n"
        + markdown_table(["block", "ecc16 bytes", *CORRECTIONS, "risk-min", "risk-max"], risk_rows)
        + "\n\n</details>"
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["digits"], default="digits")
    parser.add_argument("--budget", type=float, default=BUDGET,
                        help=f"fraction of the bytes of ecc16 on every block (default: {BUDGET})")
    parser.add_argument("--warmup", type=int, default=300, help="shared warm-up steps (default: 300)")
    parser.add_argument("--warmup-lr", type=float, default=WARMUP_LR,
                        help=f"the warm-up's learning rate (default: {WARMUP_LR:g}, the digits task's)")
    parser.add_argument("--lr", type=float, default=LR, help=f"the continuation's learning rate (default: {LR:g})")
    args = parse_run_arguments(parser, argv, "correction_risk_validation_<task>")
    results = validate(args.budget, args.warmup, args.warmup_lr, args.steps, args.orders, args.random, args.lr,
                       log=True)
    # a learning rate other than the recorded one is a run of its own: its own file and docs section
    name = f"correction_risk_validation_{args.task}" + (f"_lr{args.lr:g}" if args.lr != LR else "")
    return publish(results, report, name, args)


if __name__ == "__main__":
    main()
