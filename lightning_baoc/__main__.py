"""The ``lightning-baoc`` command line (also ``python -m lightning_baoc``).

Subcommands register themselves in :data:`SUBCOMMANDS`: a name -> (add arguments, run) pair, so a
new one (``check``, ...) is one function pair and one entry.

Example:
    python -m lightning_baoc plan --preset llama-7b --budget 0.35 --budget 0.25
    lightning-baoc plan --preset llama-7b --budget 0.3 --json - | jq '.allocations[0].formats'
    lightning-baoc plan --model mypkg.models:build --device cuda --budget 6GB --time-budget 1.10
    lightning-baoc plan --preset llama-7b --optimizer sgd --budget 0.3
    lightning-baoc check --config configs/vision.yaml baoc.memory_budget=0.25 --device cpu
    python -m lightning_baoc schema > configs/baoc.schema.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from lightning_baoc.config.budget import (
    MEMORY_BUDGET_FORMS,
    TIME_BUDGET_FORMS,
    absolute_time_with_prior_error,
    is_absolute_time,
)
from lightning_baoc.config.files import schema_text
from lightning_baoc.formats import RULE_FORMATS, RULE_NAMES
from lightning_baoc.formats.correction import CORRECTIONS
from lightning_baoc.optim.offload_model import PROFILES
from lightning_baoc.sampling.blocks import GRANULARITIES
from lightning_baoc.tools import check
from lightning_baoc.tools.plan import plan, render
from lightning_baoc.tools.presets import PRESETS


def _literal(text: str) -> str:
    """Help text shown as written: argparse %-formats help strings, so a bare ``%`` ("35%") must be doubled."""
    return text.replace("%", "%%")


#: What a fractional ``--budget`` and a ``--time-budget`` multiple of ``lightning-baoc plan`` refer to
#: (budget.py's forms say AdamW's; plan's budgets are of the optimizer planned for, ``--optimizer``).
_PLAIN_OPTIMIZER = "the plain optimizer would hold (AdamW; SGD/Lion with --optimizer)"
_PLAIN_STEP = "the fp32 optimizer-step time of the plain optimizer (AdamW; SGD/Lion with --optimizer)"


def _add_plan(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help=_literal("a built-in model: " + "; ".join(f"{k}: {v[1]}" for k, v in PRESETS.items()) + " (default: llama-7b)"),
    )
    which.add_argument("--model", metavar="PACKAGE.MODULE:FACTORY", help="a factory called with no arguments")
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="BUDGET",
        help=_literal("memory budget, repeatable: "
                      + MEMORY_BUDGET_FORMS.replace("plain AdamW would hold", _PLAIN_OPTIMIZER)),
    )  # fmt: skip
    parser.add_argument(
        "--time-budget",
        metavar="MULTIPLE|TIME",
        help=_literal("time budget: " + TIME_BUDGET_FORMS.replace("the fp32 AdamW optimizer-step time", _PLAIN_STEP)
                      + "; an absolute time needs --calibrate"),
    )  # fmt: skip
    parser.add_argument(
        "--optimizer",
        choices=list(RULE_FORMATS),
        default="adamw",
        help="the optimizer whose state is planned: "
        + "; ".join(f"{r}: {RULE_NAMES[r]}'s formats {', '.join(reg)}" for r, reg in RULE_FORMATS.items())
        + " (default: adamw; fp32 AdamW holds 8 bytes per parameter, SGD's and Lion's momentum 4)",
    )
    parser.add_argument(
        "--device",
        help="the training device planned for; decides the hardware mask (default: cuda, a GPU run, also on a "
        "machine without one: the plan's first table says which device it is for)",
    )
    parser.add_argument("--granularity", choices=list(GRANULARITIES), default="module", help="block granularity (default: module)")
    parser.add_argument(
        "--stats",
        metavar="FILE",
        help='the steady allocation\'s risks from a statistics file: {"blocks": [{"name": ..., "risk": {format: value}}]} '
        "(default: the start's)",
    )
    parser.add_argument(
        "--initial",
        metavar="FILE",
        help="start the warm-up as BAOC(initial=FILE) does: a previous run's baoc_allocation.json, whose measured "
        "risks replace the prior (default: the allocation of least prior risk)",
    )
    every_format = list(dict.fromkeys(f for registry in RULE_FORMATS.values() for f in registry))
    parser.add_argument("--mask", action="append", default=[], choices=every_format, metavar="FORMAT",
                        help="exclude a format of the --optimizer's (repeatable)")
    parser.add_argument("--max-boundaries", type=int, metavar="N", help="the format changes at most N times along the blocks")
    parser.add_argument("--calibrate", action="store_true", help="time costs from a calibration of --device here (cached)")
    parser.add_argument("--min-8bit-numel", type=int, default=4096, help="small-tensor threshold of the 8-bit formats (default: 4096)")
    parser.add_argument("--method", choices=["auto", "greedy", "exact"], default="auto", help="solver method (default: auto)")
    parser.add_argument("--weight-dtype", choices=["fp32", "bf16", "fp16"],
                        help="the weights' dtype in training (bf16-true: bf16; default: the model's own)")
    parser.add_argument("--weight-correction", choices=list(CORRECTIONS), default="none",
                        help="master-weight correction of 16-bit weights (default: none)")
    parser.add_argument("--release", action="store_true", help="gradient release: no gradient is held")
    parser.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), metavar="CORRECTION",
                        help="as BAOC(corrections=...): the solver pairs each block's format with one of these "
                             f"corrections of its 16-bit weights ({', '.join(CORRECTIONS)}; needs --weight-dtype bf16 or fp16)")
    parser.add_argument("--hardware", choices=sorted(PROFILES), metavar="NAME",
                        help="predict the update phase of the offloaded states on this machine, host-only and "
                             f"interleaved, for the uniform offload row and every allocation that offloads ({', '.join(sorted(PROFILES))})")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the plan as JSON to FILE; '-': to standard output, alone there (the tables "
                             "then go to standard error), e.g. lightning-baoc plan --json - | jq .allocations")


def _run_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.time_budget is not None and not args.calibrate and is_absolute_time(args.time_budget):
        raise absolute_time_with_prior_error(
            args.time_budget, "--time-budget", "pass --calibrate to measure the step in seconds on this machine's device."
        )
    model = args.model or args.preset or "llama-7b"
    result = plan(
        model,
        args.budget,
        time_budget=args.time_budget,
        device=args.device,
        granularity=args.granularity,
        statistics=args.stats,
        initial=args.initial,
        mask=args.mask,
        max_boundaries=args.max_boundaries,
        calibrate_time=args.calibrate,
        min_8bit_numel=args.min_8bit_numel,
        method=args.method,
        weight_dtype=args.weight_dtype,
        weight_correction=args.weight_correction,
        release=args.release,
        optimizer=args.optimizer,
        corrections=args.corrections,
        hardware=args.hardware,
    )
    to_stdout = args.json == "-"  # the JSON alone on stdout, for a pipe: the tables go to stderr
    render(result, Console(file=sys.stderr if to_stdout else None, width=max(Console().width, 120)))
    if to_stdout:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result.to_dict(), fh, indent=2)
    failed = [a for a in result.allocations if a.error is not None]
    for a in failed:
        print(f"lightning-baoc plan: budget {a.budget} is infeasible: {a.error}", file=sys.stderr)
    over = [(a, f) for a in result.allocations if a.phases is not None for f in a.phases.exceeded()]
    for a, f in over:  # only a bug gets here: the solver keeps every allocation within its budget
        print(f"lightning-baoc plan: budget {a.budget}: the {f.phase} holds {f.state_bytes} bytes > {f.limit_bytes}", file=sys.stderr)
    return 1 if failed or over else 0


def _add_check(parser: argparse.ArgumentParser) -> None:
    check.add_arguments(parser)


def _run_check(args: argparse.Namespace) -> int:
    return check.run(args)


def _add_schema(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", "-o", metavar="FILE", help="write to FILE instead of stdout")


def _run_schema(args: argparse.Namespace) -> int:
    text = schema_text()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


#: name -> (help, add arguments, run)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "plan": (
        "plan optimizer-state memory of a model built on the meta device: fp32 AdamW (SGD, Lion: --optimizer), "
        "every format, allocations "
        "and the state of each phase of the run (start, warm-up, conversion, steady); "
        "exit 0 if every budget is feasible, 1 if one is not (the smallest feasible is printed), 2 on bad input",
        _add_plan,
        _run_plan,
    ),
    "check": (
        "pre-training checklist of a config for a model and device: formats served, budget feasible in every "
        "phase (start, warm-up, conversion, steady), "
        "sampler overhead, thresholds; exit 0 if all pass, 1 if one fails",
        _add_check,
        _run_check,
    ),
    "schema": (
        "print the JSON Schema of config files (python -m lightning_baoc schema > configs/baoc.schema.json)",
        _add_schema,
        _run_schema,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="lightning-baoc", description="Budget-aware, block-wise optimizer-state formats for PyTorch Lightning."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=_literal(help_text), description=_literal(help_text))
        add(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-baoc`` and ``python -m lightning_baoc``; returns the exit code.

    Bad input (a budget, a model, a file) ends with a one-line error and exit code 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except (ValueError, TypeError) as err:
        parser.exit(2, f"lightning-baoc {args.command}: error: {err}\n")
    return 2  # pragma: no cover - parser.exit raises


if __name__ == "__main__":
    sys.exit(main())
