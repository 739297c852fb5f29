"""The memory-budget line of ``lightning-baoc check``: feasibility and the state of every phase.

The check builds the :class:`~lightning_baoc.costs.AllocationProblem` the training controller
builds (the same offered formats, tables and budget units) and plans the run through it
(:meth:`~lightning_baoc.costs.AllocationProblem.phases`): the **start** allocation the controller
sets at install (least prior risk, or ``baoc.initial``), the **warm-up** in it (the states are
created in the start formats), the **conversion** at warm-up end (at most ``max(start, steady)``
plus one parameter's ``min(old, new)`` state) and the **steady** allocation (the start's, as no
gradient has been measured). It fails when no allocation meets the budgets (naming the smallest
feasible one), when ``baoc.initial`` does not fit the model, when start, warm-up or steady hold more
than the budget, or when the conversion bound exceeds the budget plus the largest one-parameter
state (the documented transient: only a bug can get there).

The weights train in ``trainer.precision``'s dtype (``bf16-true``: bf16; the ``-mixed`` precisions keep
fp32 weights), so a fractional budget is of torch's optimizer state in that dtype, the controller's
baseline; with ``baoc.corrections`` the options pair formats with corrections and the
phases hold both, as the controller plans them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lightning_baoc.config.budget import (
    absolute_time_with_prior_error,
    format_bytes,
    is_absolute_time,
    parse_memory_budget,
    round_up,
)
from lightning_baoc.config.files import Config
from lightning_baoc.costs import AllocationProblem, StatePhases, baseline_state_bytes
from lightning_baoc.costs.calibration import withheld_formats
from lightning_baoc.costs.options import split_option
from lightning_baoc.formats import RULE_NAMES
from lightning_baoc.costs.options import corrections_menu
from lightning_baoc.formats.correction import corrections_refused
from lightning_baoc.risk.prior import block_kind
from lightning_baoc.solver import BudgetInfeasibleError
from lightning_baoc.tools.result import CheckResult

NAME = "memory budget"


def check_budget(
    config: Config,
    model: nn.Module,
    blocks: dict[str, list[str]],
    served: list[str],
    mask: dict[str, str],
    device: str,
    rule: str = "adamw",
) -> CheckResult:
    """3. memory budget: feasible, and every phase of the run within it (see the module docstring);
    for the optimizer of update rule ``rule`` (its formats, its fp32 state as the reference)."""
    b = config.baoc
    params = dict(model.named_parameters())
    shapes = {name: [tuple(params[n].shape) for n in names] for name, names in blocks.items()}
    dtypes = weight_dtypes(config, params, blocks)
    prior = b.calibration == "prior" or not _local(device)
    problem = _problem(config, shapes, served, device, prior, rule, dtypes)
    if isinstance(problem, CheckResult):
        return problem
    withheld_note = "".join(f"; {f} withheld ({why})" for f, why in problem.withheld.items())
    fp32_bytes = problem.fp32_bytes
    baseline = problem.baseline_bytes or fp32_bytes  # what a fraction is of: the controller's rule
    budget_bytes = parse_memory_budget(b.memory_budget, baseline, argument="baoc.memory_budget")
    time_note = ""
    fp32_time = 0.0
    if b.time_budget is not None:
        fp32_time = problem.fp32_time
        time_note = (
            "; step time priced with the built-in prior costs" if prior else f"; step time priced with a calibration of {device}"
        )
    budget_text = f"baoc.memory_budget={b.memory_budget!r} = {format_bytes(budget_bytes)} ({budget_bytes / baseline:.3f} of {_baseline_name(rule, dtypes)} {format_bytes(baseline)})"
    context = _BudgetContext(
        config, budget_text, budget_bytes, fp32_bytes, fp32_time, time_note, withheld_note,
        list(dict.fromkeys(split_option(o)[0] for o in problem.allowed)), mask,
        baseline, "fp32" if baseline == fp32_bytes else "the baseline",
    )
    problem.budgets(b.memory_budget, b.time_budget)  # a malformed budget is bad input (exit 2), not a FAIL
    kinds = {name: block_kind(model, name) for name in shapes}
    try:
        sampler = {"capacity": b.capacity, "max_elements": b.max_elements,
                   "instrument_share": b.instrument_share}
        phases = problem.phases(kinds, b.memory_budget, b.time_budget, initial=b.initial, sampler=sampler)
    except BudgetInfeasibleError as err:
        return _infeasible(err, context)
    except ValueError as err:  # the budgets parsed above: only baoc.initial is left to refuse
        fix = (
            "set baoc.initial to a baoc_allocation.json written for this model and granularity, or to a "
            "mapping of its block names to allowed formats, or to null (start from the prior)"
        )
        return CheckResult(NAME, False, f"baoc.initial={b.initial!r} does not fit this model: {err}", fix)
    least = sum(min(row.values()) for row in problem.tables(False)[0].values())
    return _phases_result(phases, context, least)


#: The weights' dtype under a Trainer ``precision`` that trains the parameters themselves in it (the
#: ``-mixed`` precisions keep fp32 weights).
TRUE_PRECISION_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64, "64": torch.float64}


def weight_dtypes(config: Config, params: dict[str, torch.Tensor], blocks: dict[str, list[str]]) -> dict[str, list[torch.dtype]]:
    """Block -> the dtypes its parameters train in: ``trainer.precision``'s (``bf16-true``: bf16), else
    the model's own."""
    forced = TRUE_PRECISION_DTYPES.get(str(config.trainer.get("precision", "")).lower())
    return {name: [forced or params[n].dtype for n in names] for name, names in blocks.items()}


def _baseline_name(rule: str, dtypes: dict[str, list[torch.dtype]]) -> str:
    """Whose state a fractional budget is of: fp32 AdamW's, or AdamW's in the weights' dtypes."""
    kinds = sorted({str(d).removeprefix("torch.") for row in dtypes.values() for d in row})
    return f"fp32 {RULE_NAMES[rule]}'s" if kinds == ["float32"] else f"{RULE_NAMES[rule]}'s state in the weights' {'/'.join(kinds)},"


def _problem(
    config: Config, shapes: dict[str, list[tuple[int, ...]]], served: list[str], device: str, prior: bool, rule: str,
    dtypes: dict[str, list[torch.dtype]],
) -> AllocationProblem | CheckResult:
    """The problem the training controller builds (its baseline from the weights' dtypes, its options
    paired with ``baoc.corrections``), or the failed check when there is none."""
    b = config.baoc
    corrections = corrections_menu(b.corrections, dtypes.values())  # unset: every one where weights are 16-bit
    refused = corrections_refused(dtypes.values()) if b.corrections is not None else None
    if refused:
        return CheckResult(
            NAME, False, f"baoc.corrections={list(b.corrections)}: {refused} "
            f"(trainer.precision={config.trainer.get('precision')!r})",
            "set trainer.precision: bf16-true, or leave baoc.corrections unset",
        )
    timed = b.time_budget is not None
    if timed and prior and is_absolute_time(b.time_budget):
        # seconds cannot be compared with the unitless prior costs (the callback's rule too)
        where = (
            "set baoc.calibration: auto"
            if b.calibration == "prior"
            else f"run check on a machine with the {device} device, where the step is measured in seconds"
        )
        err = absolute_time_with_prior_error(b.time_budget, "baoc.time_budget", where + ".")
        return CheckResult(NAME, False, str(err), f"baoc.time_budget: 1.2 (a multiple), or {where}")
    try:
        return AllocationProblem(
            shapes,
            device,
            served,
            timed=timed,
            costs="prior" if prior else "calibrate",
            min_8bit_numel=b.min_8bit_numel,
            cache_dir=b.calibration_cache_dir,
            rule=rule,
            baseline_bytes=baseline_state_bytes(shapes, dtypes, rule),
            corrections=corrections,
            dtypes=dtypes,
        )
    except ValueError:
        note = "".join(f"; {f} withheld ({why})" for f, why in withheld_formats(device, timed, served, rule).items())
        fix = "set baoc.time_budget, or allow other formats in baoc.formats"
        return CheckResult(NAME, False, f"no allowed format is offered on {device}{note}", fix)


def _phases_result(phases: StatePhases, c: _BudgetContext, least: int) -> CheckResult:
    """The check of a feasible budget: every phase's state against its limit."""
    fp32_bytes, budget_bytes = c.fp32_bytes, c.budget_bytes
    fp32_warmup = f"an fp32 warm-up would hold {format_bytes(fp32_bytes)}"
    if budget_bytes:
        fp32_warmup += f", {fp32_bytes / budget_bytes:.2f}x the budget"
    detail = (
        f"{c.budget_text} is feasible: the cheapest allocation of the allowed formats needs {format_bytes(least, up=True)} "
        f"({round_up(least / c.baseline_bytes)} of {c.unit}){c.time_note}{c.withheld_note}; state by phase: {phases.summary()}; "
        f"the warm-up's states are created in the start formats ({fp32_warmup}); BAOC's instruments (the sampler's "
        f"buffers and the shadow moments) hold {format_bytes(phases.instrument_bytes)} besides, outside the budget "
        f"(at most {format_bytes(phases.instrument_allowance)}, baoc.instrument_share)"
        + (f"; planned peak {phases.peak.line()}" if phases.peak is not None else "")
    )
    figures = {"budget_bytes": budget_bytes, "fp32_bytes": fp32_bytes, **{f.phase: f.state_bytes for f in phases.figures()},
               "instrument_bytes": phases.instrument_bytes,
               "planned_peak": phases.peak.to_dict() if phases.peak is not None else None}
    over = phases.exceeded()
    if not over:
        return CheckResult(NAME, True, detail, figures=figures)
    named = "; ".join(f"{f.phase} {format_bytes(f.state_bytes)} > {format_bytes(f.limit_bytes)}" for f in over)
    steady = [f for f in over if f.phase != "conversion"]
    if steady:
        worst = max(f.state_bytes for f in steady)
        fix = (
            f"set baoc.memory_budget >= {round_up(worst / c.baseline_bytes)} (or an absolute size >= {int(math.ceil(worst))} "
            f"bytes) to hold the {'/'.join(f.phase for f in steady)} state; an allocation above its budget is a bug: "
            f"please report it"
        )
    else:
        room = budget_bytes - (phases.conversion_bytes - over[0].limit_bytes)
        fix = (
            f"set baoc.memory_budget <= {max(room, 0) / c.baseline_bytes:.3f} to leave the device room for the conversion; "
            f"a conversion above the budget plus one parameter's state is a bug: please report it"
        )
    return CheckResult(NAME, False, f"{detail}; over the limit: {named}", fix, figures)


@dataclass
class _BudgetContext:
    """What the memory-budget check found, for the message of an infeasible budget."""

    config: Config
    budget_text: str
    budget_bytes: int
    fp32_bytes: int
    fp32_time: float
    time_note: str
    withheld_note: str
    served: list[str]
    mask: dict[str, str]
    baseline_bytes: int  # what a fractional budget is of (fp32_bytes for fp32 weights)
    unit: str  # its name in the messages: "fp32", "the baseline"


def _infeasible(err: BudgetInfeasibleError, c: _BudgetContext) -> CheckResult:
    """The failed memory-budget check of an infeasible budget, with the smallest feasible one."""
    b = c.config.baoc
    budget_text, budget_bytes, fp32_time = c.budget_text, c.budget_bytes, c.fp32_time
    time_note, withheld_note, served, mask = c.time_note, c.withheld_note, c.served, c.mask
    if err.min_memory is None:
        return CheckResult(
            NAME,
            False,
            f"{budget_text}: no allocation of the allowed formats meets baoc.time_budget={b.time_budget!r}{time_note}",
            "raise baoc.time_budget (or allow faster formats: fp32, bf16_momentum, nomomentum, factored)",
        )
    need = float(err.min_memory)
    if need <= budget_bytes:  # memory fits: the time budget is what fails
        return CheckResult(
            NAME,
            False,
            f"{budget_text}: it fits in memory, but not within baoc.time_budget={b.time_budget!r}{time_note}",
            "raise baoc.time_budget, or lower the memory pressure (a larger baoc.memory_budget)",
        )
    cheaper = [f for f in ("factored", "nomomentum_int8", "int8_factored") if f not in served and f not in mask]
    allow = f", or allow cheaper formats in baoc.formats ({', '.join(cheaper)})" if cheaper else ""
    if b.time_budget is not None:
        # the memory needed is the least within the time budget: a looser one may need less
        slower = (
            f"raise baoc.time_budget to >= {round_up(err.min_time / fp32_time)} (x fp32)"
            if err.min_time is not None and fp32_time
            else "raise baoc.time_budget"
        )
        allow += f", or {slower}"
    return CheckResult(
        NAME,
        False,
        f"{budget_text} is infeasible for this model: the smallest feasible budget with the allowed formats "
        f"{served} is {format_bytes(need, up=True)} ({round_up(need / c.baseline_bytes)} of {c.unit})"
        f"{' within the time budget' if b.time_budget is not None else ''}{time_note}{withheld_note}",
        f"set baoc.memory_budget >= {round_up(need / c.baseline_bytes)} (or an absolute size >= {int(math.ceil(need))} "
        f"bytes){allow}",
    )


def _local(device: str) -> bool:
    kind = torch.device(device).type
    return kind == "cpu" or (kind == "cuda" and torch.cuda.is_available())


__all__ = ["check_budget"]
