"""Plan optimizer-state memory for a large model without allocating it: ``lightning-baoc plan``.

The model is built on the ``meta`` device (shapes only, no memory): a preset (a LLaMA-7B-shaped
decoder, a ViT-B/16, a tiny decoder for tests; :mod:`lightning_baoc.tools.presets`) or any
``package.module:factory``. Its parameters are partitioned into blocks
(:func:`lightning_baoc.sampling.blocks.partition`), and the plan reports the parameter count, the fp32 state
of the optimizer planned for (``optimizer``: AdamW's two moments, 8 bytes per parameter, by default;
``"sgd"`` or ``"lion"``: their one momentum buffer, 4 bytes), every uniform format of that
optimizer's registry (:func:`~lightning_baoc.formats.formats_of`) with its exact bytes (fallbacks for
1-D and small tensors included, as the optimizer allocates them), and allocations of the
:class:`~lightning_baoc.costs.AllocationProblem` the training controller builds, at the budgets given
(a fractional budget is a fraction of the optimizer's state in the weights' dtype, the callback's
baseline: that fp32 state for fp32 weights; ``corrections``: options pairing formats with master-weight
corrections, as ``BAOC(corrections=...)``).

Every budget is planned as a run goes through it (:meth:`~lightning_baoc.costs.AllocationProblem.phases`):
the **start** allocation the controller sets at install (least prior risk, or ``initial`` as
``BAOC(initial=...)``: a previous run's ``baoc_allocation.json``), the **warm-up** in it, the
**conversion** at warm-up end (bounded by ``max(start, steady)`` plus one parameter's state) and the
**steady** allocation. The steady allocation's risk comes from a statistics file saved by a real run
(JSON ``{"blocks": [{"name": ..., "risk": {format: value}}]}``, the shape of
``baoc_allocation.json``'s blocks) or, without one, is the start's (the documented prior,
:func:`lightning_baoc.risk.prior_risk`, or ``initial``'s): the run is then expected to stay where it
started. Step time comes from a calibration of the local device (``calibrate=True``) or the prior
:data:`~lightning_baoc.costs.calibration.PRIOR_STEP_COSTS` of the optimizer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_baoc.config.budget import (
    absolute_time_with_prior_error,
    ceil_significant,
    format_bytes,
    format_decimal_bytes,
    is_absolute_time,
)
from lightning_baoc.costs import CONVERSION_BOUND, AllocationProblem, StatePhases, baseline_state_bytes
from lightning_baoc.costs.calibration import PRIOR_STEP_COSTS, offload_saves_memory
from lightning_baoc.costs.options import correction_bytes, split_option
from lightning_baoc.formats import (
    DEFAULT_MIN_8BIT_NUMEL,
    RULE_NAMES,
    format_state_bytes,
    formats_of,
    numel_of,
    resolve_in,
)  # fmt: skip
from lightning_baoc.costs.options import corrections_menu
from lightning_baoc.formats.correction import check_correction, corrections_refused
from lightning_baoc.risk.prior import block_kind, prior_risk
from lightning_baoc.risk.start import INITIAL_PREFERENCE, AllocationRecord, Initial
from lightning_baoc.sampling.blocks import partition
from lightning_baoc.optim.offload_model import Hardware, OffloadPrediction
from lightning_baoc.optim.offload_model import hardware as offload_hardware
from lightning_baoc.optim.offload_model import predict as offload_predict
from lightning_baoc.solver import Allocation, BudgetInfeasibleError
from lightning_baoc.tools.plan_inputs import check_initial, check_optimizer, checked_mask, load_statistics
from lightning_baoc.tools.presets import build_model

# ---------------------------------------------------------------------------- the plan


@dataclass
class FormatFigure:
    """One uniform format over the whole model."""

    name: str
    device_bytes: int
    host_bytes: int
    fallback_params: int  # parameters that really get another format (1-D, small tensors)


@dataclass
class PlannedAllocation:
    """An allocation at one budget, or why there is none.

    ``allocation`` is the steady allocation (``phases.steady``); ``phases`` holds the device state
    of every phase of the run at this budget (start, warm-up, conversion, steady).
    """

    budget: str
    allocation: Allocation | None = None
    error: str | None = None
    params_by_format: dict[str, int] = field(default_factory=dict)
    min_memory: float | None = None  # where infeasible: the smallest feasible memory budget, bytes
    phases: StatePhases | None = None
    #: with ``hardware``, where the allocation offloads: its update phase, host-only and interleaved
    offload: OffloadPrediction | None = None


@dataclass
class Plan:
    """What :func:`plan` found; :func:`render` prints it, :meth:`to_dict` is JSON-ready."""

    model: str
    device: str
    granularity: str
    params: int
    tensors: int
    blocks: dict[str, list[tuple[int, ...]]]
    fp32_bytes: int
    formats: list[FormatFigure]
    masked: dict[str, str]
    risk_source: str
    time_source: str | None
    time_budget: str | None
    allocations: list[PlannedAllocation]
    start_source: str = ""
    #: what training holds besides the states, in bytes: the weights (in ``weight_dtype``), their
    #: master-weight corrections and the gradients (none with gradient release)
    weight_bytes: int = 0
    correction_bytes: int = 0
    gradient_bytes: int = 0
    weight_dtype: str = "the model's"
    weight_correction: str = "none"
    release: bool = False
    #: the update rule planned for (``"adamw"``, ``"sgd"``, ``"lion"``): its formats, bytes and priors
    rule: str = "adamw"
    #: what a fractional budget is of: the optimizer's state in the weights' dtype (``fp32_bytes`` for fp32)
    baseline_bytes: int = 0
    #: the corrections the solver pairs with the formats (``None``: states alone), and the weights' dtypes
    corrections: list[str] | None = None
    block_dtypes: dict[str, list[torch.dtype]] = field(default_factory=dict)
    #: whether ``device`` is :data:`DEFAULT_DEVICE` because none was given
    device_default: bool = False
    #: the hardware profile the offloaded updates are predicted on (``--hardware``), and the uniform
    #: ``offload`` row's prediction (:mod:`lightning_baoc.optim.offload_model`)
    hardware: str | None = None
    uniform_offload: OffloadPrediction | None = None

    @property
    def device_note(self) -> str:
        """What the device planned for is, in words: the default (and how to change it) or the one given."""
        return device_note(self.device, self.device_default)

    @property
    def optimizer(self) -> str:
        """The optimizer planned for, as reports name it (``"AdamW"``, ``"SGD"``, ``"Lion"``)."""
        return RULE_NAMES[self.rule]

    @property
    def fp32_bytes_per_param(self) -> int:
        """Bytes of the optimizer's fp32 state per parameter element (AdamW 8, SGD and Lion 4)."""
        return format_state_bytes("fp32", (1,), rule=self.rule)

    def chosen_correction_bytes(self, allocation: Allocation) -> int:
        """Bytes of the corrections ``allocation``'s options hold (0 without ``corrections``)."""
        if self.corrections is None:
            return 0
        return sum(correction_bytes(s, d, split_option(allocation.formats[b])[1])
                   for b, shapes in self.blocks.items() for s, d in zip(shapes, self.block_dtypes[b]))

    def training_memory(self, state_bytes: int, chosen_corrections: int = 0) -> dict[str, int]:
        """Weights, corrections, gradients and ``state_bytes``, in bytes, with their total and the
        parameter count (the figures ``lightning_baoc.training_memory`` measures in a run).
        ``chosen_corrections``: the part of ``state_bytes`` that is corrections (an allocation's options)."""
        parts = {"weights": self.weight_bytes, "corrections": self.correction_bytes + int(chosen_corrections),
                 "gradients": self.gradient_bytes, "states": int(state_bytes) - int(chosen_corrections)}
        return {"params": self.params, **parts, "total": sum(parts.values())}

    def memory_of(self, allocation: Allocation) -> dict[str, int]:
        """:meth:`training_memory` of ``allocation`` (its device bytes split into states and corrections)."""
        return self.training_memory(allocation.memory, self.chosen_correction_bytes(allocation))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "device_default": self.device_default,
            "granularity": self.granularity,
            "optimizer": self.optimizer,
            "params": self.params,
            "tensors": self.tensors,
            "blocks": len(self.blocks),
            # the old key stays for AdamW, whose fp32 state it names; fp32_state_bytes is every optimizer's
            **({"fp32_adamw_state_bytes": self.fp32_bytes} if self.rule == "adamw" else {}),
            "fp32_state_bytes": self.fp32_bytes,
            "baseline_state_bytes": self.baseline_bytes or self.fp32_bytes,
            "corrections": self.corrections,
            "hardware": self.hardware,
            "formats": {
                f.name: {"device_bytes": f.device_bytes, "host_bytes": f.host_bytes, "fallback_params": f.fallback_params,
                         **({"offload": self.uniform_offload.to_dict()}
                            if f.name == "offload" and self.uniform_offload is not None else {})}
                for f in self.formats
            },
            "masked": dict(self.masked),
            "risk_source": self.risk_source,
            "start_source": self.start_source,
            "time_source": self.time_source,
            "time_budget": self.time_budget,
            "allocations": [
                {
                    "budget": a.budget,
                    "error": a.error,
                    "params_by_format": a.params_by_format,
                    **({"allocation": a.allocation.to_dict()} if a.allocation is not None else {}),
                    **({"phases": a.phases.to_dict()} if a.phases is not None else {}),
                    **({"training_memory": self.memory_of(a.allocation)} if a.allocation is not None else {}),
                    **({"offload": a.offload.to_dict()} if a.offload is not None else {}),
                }
                for a in self.allocations
            ],
        }


#: The device a plan is for when none is given: a GPU. Planning is for sizing a run before it runs,
#: mostly of models that train on accelerators (the presets: LLaMA-7B, ViT-B/16), often on a machine
#: without that GPU (a laptop, a login node); a plan of this machine's CPU would mask ``offload``, the
#: format that matters most there. The plan says so (:func:`device_note`), with ``--device cpu`` to
#: plan for the CPU.
DEFAULT_DEVICE = "cuda"


def device_note(device: str, default: bool) -> str:
    """The device a plan is for, in words: given, or the default and what it assumes here.

    Example:
        >>> device_note("cpu", default=False)
        'cpu (--device)'
    """
    if not default:
        return f"{device} (--device)"
    if torch.cuda.is_available():
        here = f"this machine's GPU, {torch.cuda.get_device_name(0)}, whose bf16 support is checked"
    else:
        here = "a GPU elsewhere: this machine has none, so the GPU's bf16 support is not checked"
    return f"{device}, the default ({here}); --device cpu plans for the CPU"


def plan(
    model: str | nn.Module,
    budgets: Sequence[float | int | str] = (),
    *,
    time_budget: float | str | None = None,
    device: str | None = None,
    granularity: str = "module",
    statistics: str | os.PathLike[str] | None = None,
    initial: Initial = None,
    mask: Sequence[str] | None = None,
    max_boundaries: int | None = None,
    calibrate_time: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
    method: str = "auto", corrections: Sequence[str] | None = None,
    weight_dtype: str | None = None, weight_correction: str = "none", release: bool = False, optimizer: str = "adamw",
    hardware: str | None = None,
) -> Plan:
    """Plan the optimizer-state memory of ``model`` on ``device``.

    Args:
        model: a preset name, ``"package.module:factory"``, or a module (any device).
        budgets: memory budgets: fractions (``0.35``) of the state torch's optimizer holds in the weights' dtype, or sizes (``"6GB"``).
        time_budget: optional time budget: a multiple of the fp32 step (``1.10``), or an absolute
            time (``"12ms"``) with ``calibrate_time=True`` (the prior costs have no unit).
        device: the training device planned for; decides the hardware mask and whether ``offload``
            saves device memory (default: :data:`DEFAULT_DEVICE`, ``"cuda"``, also where no GPU is present;
            the plan records that it is the default, ``Plan.device_default``).
        granularity: block granularity of :func:`~lightning_baoc.sampling.blocks.partition` (default: ``"module"``).
        statistics: a statistics file: the steady allocation's risk (default: the start's).
        initial: the start as ``BAOC(initial=...)``: a ``baoc_allocation.json`` or a mapping block -> format.
        mask: formats to exclude besides the hardware mask (default: none).
        max_boundaries: the format changes at most this many times along the blocks (default: no limit).
        calibrate_time: time costs from a calibration of ``device`` here (cached), not the prior.
        cache_dir: calibration cache directory (default: the user cache directory).
        min_8bit_numel: the optimizer's small-tensor threshold (default: 4096).
        method: the solver's method (default: ``"auto"``).
        weight_dtype, weight_correction, release: the weights' dtype (``"fp32"``, ``"bf16"``, ``"fp16"``;
            default: the model's), their correction (default ``"none"``), gradient release (no gradient).
        optimizer: the optimizer whose state is planned: ``"adamw"`` (default), ``"sgd"`` or ``"lion"``
            (their momentum formats, :data:`~lightning_baoc.formats.MOMENTUM_FORMATS`).
        corrections: as ``BAOC(corrections=...)``: options pairing formats with corrections of 16-bit
            weights (default: none; needs bf16/fp16 weights, ``weight_correction`` left at ``"none"``).
        hardware: a hardware profile (:data:`~lightning_baoc.optim.offload_model.PROFILES`): the update phase of the
            offloaded states predicted, host-only and interleaved, for the uniform ``offload`` row and every
            allocation that offloads (default: none).

    Raises:
        ValueError: a bad model, budget, mask, optimizer, statistics file, ``initial`` or ``corrections``, or an absolute ``time_budget`` without ``calibrate_time``.

    Example:
        >>> p = plan("tiny", [0.5], device="cpu")
        >>> p.params, p.fp32_bytes == 8 * p.params, plan("tiny", device="cpu", optimizer="sgd").fp32_bytes == 4 * p.params
        (166208, True, True)
        >>> phases = p.allocations[0].phases
        >>> phases.warmup_bytes == phases.start_bytes <= 0.5 * p.fp32_bytes
        True
    """
    profile = offload_hardware(hardware) if hardware is not None else None  # a bad name is bad input, before any work
    device_default = device is None
    device = DEFAULT_DEVICE if device is None else device
    rule, initial = _check_inputs(optimizer, time_budget, calibrate_time, initial, corrections)
    module = build_model(model) if isinstance(model, str) else model  # the problem below is the controller's
    blocks, dtypes = _blocks(module, granularity, weight_dtype)
    weights = _weight_figures(module, weight_dtype, weight_correction, release)
    corrections = _checked_corrections(corrections, weight_correction, dtypes)
    uniform = _offload_of(blocks, dtypes, set(blocks), profile) if profile is not None else None
    costs: Any = "calibrate" if calibrate_time else "prior"
    costs_source = None
    if uniform is not None and not calibrate_time and rule == "adamw" and uniform.host:
        # offload's step priced by the interleaved schedule on the profile, relative to the GPU's fp32 step
        params = sum(numel_of(s) for shapes in blocks.values() for s in shapes)
        costs = {**PRIOR_STEP_COSTS[rule], "offload": uniform.interleaved / params * profile.gpu_adam}
        costs_source = (f"prior (PRIOR_STEP_COSTS, relative to fp32), offload {costs['offload']:.3g} from the interleaved "
                        f"schedule on {profile.name}")
    problem = AllocationProblem(
        blocks, device, timed=time_budget is not None, costs=costs, costs_source=costs_source,
        min_8bit_numel=min_8bit_numel, mask=checked_mask(mask, rule), cache_dir=cache_dir, rule=rule,
        baseline_bytes=baseline_state_bytes(blocks, dtypes, rule), corrections=corrections, dtypes=dtypes,
    )  # fmt: skip
    figures, allocations = _format_figures(blocks, device, min_8bit_numel, rule), []
    start_source = risk_source = _prior_source(rule) if initial is None else _initial_source(initial)
    if budgets:
        kinds = {b: block_kind(module, b) for b in blocks}
        steady_risk, risk_source = _steady_risk(kinds, blocks, statistics, min_8bit_numel, start_source, rule,
                                                problem if corrections is not None else None)
        options = {"method": method, "max_boundaries": max_boundaries, "initial": initial, "steady_risk": steady_risk,
                   "release": release}
        allocations = [_allocate(problem, kinds, blocks, budget, time_budget, options) for budget in budgets]
    if profile is not None:
        for entry in allocations:
            if entry.allocation is not None:
                chosen = {b for b, option in entry.allocation.formats.items() if split_option(option)[0] == "offload"}
                entry.offload = _offload_of(blocks, dtypes, chosen, profile) if chosen else None
    return Plan(
        model=model if isinstance(model, str) else type(model).__name__, device=str(device), granularity=granularity,
        params=sum(numel_of(s) for shapes in blocks.values() for s in shapes),
        tensors=sum(len(shapes) for shapes in blocks.values()), blocks=blocks, fp32_bytes=problem.fp32_bytes,
        formats=figures, masked=problem.withheld, risk_source=risk_source,
        time_source=problem.time_source if budgets else None, time_budget=None if time_budget is None else str(time_budget), allocations=allocations,
        start_source=start_source, rule=rule, baseline_bytes=problem.baseline_bytes or problem.fp32_bytes,
        corrections=corrections, block_dtypes=dtypes, device_default=device_default, **weights,
        hardware=hardware, uniform_offload=uniform,
    )  # fmt: skip


def _offload_of(blocks: Mapping[str, list[tuple[int, ...]]], dtypes: Mapping[str, list[torch.dtype]], chosen: set[str],
                profile: Hardware) -> OffloadPrediction:
    """The update phase of the tensors of the ``chosen`` blocks held in ``offload`` (gradients and weights
    moved at the weights' width), host-only and interleaved on ``profile``."""
    numels = [numel_of(s) for b in blocks if b in chosen for s in blocks[b]]
    widths = {d.itemsize for b in chosen for d in dtypes[b]}
    w = max(widths) if widths else 4
    return offload_predict(numels, profile, grad_bytes=w, weight_bytes=w)


def _check_inputs(
    optimizer: object, time_budget: float | str | None, calibrate_time: bool, initial: Initial,
    corrections: Sequence[str] | None = None,
) -> tuple[str, Initial]:
    """The update rule of ``optimizer``, after the checks that need no model: the time budget's unit
    and an ``initial`` record's optimizer and formats (options, with ``corrections``)."""
    rule = check_optimizer(optimizer)
    if time_budget is not None and not calibrate_time and is_absolute_time(time_budget):
        fix = "calibrate_time=True (--calibrate) to measure the step in seconds on the device."
        raise absolute_time_with_prior_error(time_budget, "time_budget", fix)
    return rule, check_initial(initial, rule, corrections is not None)


def _checked_corrections(
    corrections: Sequence[str] | None, weight_correction: str, dtypes: Mapping[str, list[torch.dtype]]
) -> list[str] | None:
    """``corrections`` as the controller takes them (unset: every one where weights are 16-bit, unless a
    ``weight_correction`` is the optimizer's own: :func:`~lightning_baoc.costs.options.corrections_menu`),
    refused where they cannot apply."""
    if corrections is None:
        return corrections_menu(None, dtypes.values(), own=weight_correction != "none")
    for c in corrections:
        check_correction(c)  # a known correction, or the error naming them
    chosen = list(dict.fromkeys(corrections))
    if weight_correction != "none":
        raise ValueError(f"corrections={chosen} choose each block's correction: leave weight_correction at 'none' "
                         f"(got {weight_correction!r})")
    refused = corrections_refused(dtypes.values())
    if refused:
        raise ValueError(f"corrections={chosen}: {refused}; plan them as trained with weight_dtype='bf16' "
                         f"(--weight-dtype bf16)")
    return chosen


_WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _weight_figures(module: nn.Module, weight_dtype: str | None, correction: str, release: bool) -> dict[str, Any]:
    """The bytes of the weights, corrections and gradients of ``module`` trained as asked."""
    if weight_dtype is not None and weight_dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"Invalid weight_dtype: {weight_dtype!r}; expected one of {', '.join(_WEIGHT_DTYPES)}")
    bits = check_correction(correction)
    weight = correction_bytes = 0
    for p in {id(p): p for p in module.parameters()}.values():
        dtype = _WEIGHT_DTYPES[weight_dtype] if weight_dtype else p.dtype
        size = torch.empty((), dtype=dtype).element_size()
        weight += p.numel() * size
        if bits and dtype in (torch.bfloat16, torch.float16):
            correction_bytes += p.numel() * bits // 8
    return {
        "weight_bytes": weight, "correction_bytes": correction_bytes, "gradient_bytes": 0 if release else weight,
        "weight_dtype": weight_dtype or "the model's", "weight_correction": correction, "release": release,
    }


def _blocks(
    module: nn.Module, granularity: str, weight_dtype: str | None
) -> tuple[dict[str, list[tuple[int, ...]]], dict[str, list[torch.dtype]]]:
    """Block -> its parameters' shapes, and their dtypes as trained (``weight_dtype``'s, else the model's)."""
    names, blocks = dict(module.named_parameters()), partition(module, granularity)
    forced = _WEIGHT_DTYPES.get(weight_dtype) if weight_dtype is not None else None
    shapes = {b: [tuple(names[p].shape) for p in params] for b, params in blocks.items()}
    return shapes, {b: [forced or names[p].dtype for p in params] for b, params in blocks.items()}


def _prior_source(rule: str) -> str:
    table = "PRIOR_RISK" if rule == "adamw" else f"PRIOR_RISKS[{rule!r}]"
    return f"prior ({table} x kind weight x size share)"


def _initial_source(initial: Initial) -> str:
    if isinstance(initial, Mapping):
        return f"initial formats of {len(initial)} blocks (prior + {INITIAL_PREFERENCE:g} for other formats)"
    path = initial.path if isinstance(initial, AllocationRecord) else os.fspath(initial)  # type: ignore[arg-type]
    return f"initial {path!r} (its measured risks; prior for the rest)"


def _steady_risk(
    kinds: Mapping[str, str],
    blocks: Mapping[str, list[tuple[int, ...]]],
    statistics: Any,
    min_8bit_numel: int,
    start_source: str,
    rule: str = "adamw",
    paired: AllocationProblem | None = None,
) -> tuple[dict[str, dict[str, float]] | None, str]:
    """The steady allocation's risk and its source: a statistics file's, the prior for the blocks it
    lacks; without one ``None`` (the start's risk)."""
    if statistics is None:
        return None, start_source
    # with corrections: the options' prior, as the controller composes it
    risk = prior_risk(blocks, kinds, min_8bit_numel=min_8bit_numel, rule=rule) if paired is None else paired.start_risk(kinds)
    measured, missing = load_statistics(statistics, list(blocks), rule, paired is not None)
    for b, row in measured.items():
        risk[b] = {f: row[f] for f in row}
    return risk, f"statistics file ({len(measured)} blocks" + (f"; prior for {len(missing)} missing)" if missing else ")")


def _format_figures(
    blocks: Mapping[str, list[tuple[int, ...]]], device: str, min_8bit_numel: int, rule: str = "adamw"
) -> list[FormatFigure]:
    """Every format of ``rule`` uniformly over the model: device and host bytes, elements that fall back."""
    off_device, registry = offload_saves_memory(device), formats_of(rule)
    shapes = [s for of_block in blocks.values() for s in of_block]
    figures = []
    for f in registry:
        total = sum(format_state_bytes(f, s, min_8bit_numel, rule) for s in shapes)
        fallback = sum(numel_of(s) for s in shapes if resolve_in(registry, f, s, min_8bit_numel) != f)
        on_host = registry[f].offloaded and off_device
        figures.append(FormatFigure(f, 0 if on_host else total, total if on_host else 0, fallback))
    return figures


def _allocate(
    problem: AllocationProblem,
    kinds: Mapping[str, str],
    blocks: Mapping[str, list[tuple[int, ...]]],
    budget: float | int | str,
    time_budget: float | str | None,
    options: Mapping[str, Any],
) -> PlannedAllocation:
    """The phases at one budget, or why there is none (with the smallest feasible budget)."""
    entry = PlannedAllocation(str(budget))
    try:
        phases = problem.phases(kinds, budget, time_budget, owner="plan", **options)
    except BudgetInfeasibleError as err:
        entry.error, entry.min_memory = str(err), err.min_memory
        return entry
    entry.phases = phases
    alloc = entry.allocation = phases.steady
    for b, f in alloc.formats.items():
        entry.params_by_format[f] = entry.params_by_format.get(f, 0) + sum(numel_of(s) for s in blocks[b])
    return entry


def _bytes(n: float) -> str:
    return f"{format_decimal_bytes(n)} ({format_bytes(n)})"


def render(p: Plan, console: Any = None) -> None:
    """Print a plan as rich tables (to ``console``, default: stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    head = Table(title=f"lightning-baoc plan: {p.model} on {p.device}", show_header=False)
    head.add_column("", style="bold")
    head.add_column("")
    head.add_row("planned for", p.device_note)
    head.add_row("parameters", f"{p.params:,} ({p.params / 1e9:.3g}B)" if p.params >= 1e8 else f"{p.params:,}")
    head.add_row("tensors / blocks", f"{p.tensors:,} / {len(p.blocks):,} ({p.granularity} granularity)")
    head.add_row(f"fp32 {p.optimizer} state", f"{_bytes(p.fp32_bytes)} = {p.fp32_bytes_per_param} bytes x {p.params:,} parameters")
    if p.baseline_bytes and p.baseline_bytes != p.fp32_bytes:
        head.add_row("a fractional budget is of", f"{_bytes(p.baseline_bytes)}: {p.optimizer}'s state in the weights' dtype")
    if p.corrections is not None:
        head.add_row("corrections per block", f"{p.corrections} (options: a format and a correction; the budget holds both)")
    console.print(head)

    table = Table(title="Uniform formats (exact bytes as allocated, fallbacks included)")
    for col in ("format", "device bytes", "of fp32", "bytes/param", "note"):
        table.add_column(col, justify="right" if col not in ("format", "note") else "left")
    for f in p.formats:
        notes = []
        if f.host_bytes:
            notes.append(f"+ {_bytes(f.host_bytes)} in host memory")
        if f.fallback_params:
            notes.append(f"{f.fallback_params:,} params fall back (1-D or < 8-bit threshold)")
        if f.name in p.masked:
            notes.append("masked (see below)")
        table.add_row(
            f.name,
            _bytes(f.device_bytes),
            f"{f.device_bytes / p.fp32_bytes:.3f}" if p.fp32_bytes else "-",
            f"{f.device_bytes / p.params:.3f}" if p.params else "-",
            "; ".join(notes),
        )
    console.print(table)

    if p.allocations:
        title = f"Allocations (risk: {p.risk_source}"
        title += f"; time: {p.time_source}, budget {p.time_budget}x)" if p.time_source else ")"
        alloc_table = Table(title=title)
        for col in ("budget", "state memory", "of fp32", "step time", "risk", "parameters by format", "solver"):
            alloc_table.add_column(col, justify="left" if col in ("parameters by format", "budget") else "right")
        for entry in p.allocations:
            a = entry.allocation
            if a is None:
                alloc_table.add_row(entry.budget, "infeasible", "-", "-", "-", "see below", "-")
                continue
            shares = sorted(entry.params_by_format.items(), key=lambda kv: -kv[1])
            mix = ", ".join(f"{f} {n / p.params:.0%}" if n >= 0.005 * p.params else f"{f} <1%" for f, n in shares)
            step = f"{a.time / a.fp32_time:.3f}x" if (a.time is not None and a.fp32_time) else "-"
            solver = "optimal" if a.optimal else f"gap <= {a.gap:.1e}"
            alloc_table.add_row(
                entry.budget, _bytes(a.memory), f"{a.memory / p.fp32_bytes:.3f}", step, f"{a.risk:.4g}", mix, solver
            )
        console.print(alloc_table)
        _render_infeasible(p, console)
        _render_phases(p, console)
        _render_training_memory(p, console)
    _render_offload(p, console)
    if p.masked:
        console.print("Masked: " + "; ".join(f"{k}: {v}" for k, v in p.masked.items()))


def _render_offload(p: Plan, console: Any) -> None:
    """With ``--hardware``: the offloaded bytes and the predicted update phase, host-only and interleaved, of the
    uniform ``offload`` row and of every allocation that offloads."""
    from rich.table import Table

    if p.hardware is None:
        return
    rows = [("uniform offload", p.uniform_offload)] + [(f"budget {e.budget}", e.offload) for e in p.allocations if e.offload]
    table = Table(title=f"Offloaded states' update phase on {p.hardware} (lightning_baoc.optim.offload_model: simulated, "
                        f"all gradients final at once)")
    for col in ("", "offloaded state", "subgroups", "host-only", "interleaved", "interleaved / host", "on the GPU"):
        table.add_column(col, justify="left" if not col else "right")
    for name, o in rows:
        if o is None:
            continue
        table.add_row(name, _bytes(o.bytes), f"{o.subgroups:,}", f"{o.host * 1e3:.1f} ms", f"{o.interleaved * 1e3:.1f} ms",
                      f"{o.interleaved / o.host:.2f}x" if o.host else "-", f"{o.device_share:.0%}")
    console.print(table)
    if not any(e.offload for e in p.allocations) and p.allocations:
        console.print("No allocation offloads: their update phase has no host part.")


def _render_infeasible(p: Plan, console: Any) -> None:
    """For each infeasible budget, why, and the smallest feasible budget (the solver's
    :class:`~lightning_baoc.solver.BudgetInfeasibleError` names it, rounded up: given back, it is feasible)."""
    from rich.text import Text

    for entry in p.allocations:
        if entry.allocation is not None:
            continue
        console.print(Text(f"Budget {entry.budget} is infeasible: {entry.error}"))
        if entry.min_memory is not None and p.baseline_bytes:
            size = format_bytes(entry.min_memory, up=True)
            fraction = ceil_significant(entry.min_memory / p.baseline_bytes)
            of = f"fp32 {p.optimizer}" if p.baseline_bytes == p.fp32_bytes else f"{p.optimizer}'s state in the weights' dtype"
            console.print(Text(f"The smallest feasible budget is {size} = {int(math.ceil(entry.min_memory)):,} bytes "
                               f"({fraction:.3g} of {of}): pass --budget {fraction:.3g} or more (or --budget "
                               f"{size.replace(' ', '')})"))


def _render_training_memory(p: Plan, console: Any) -> None:
    """For each feasible budget, what training holds per parameter: weights, corrections, gradients, states
    (no table where no budget is feasible)."""
    from rich.table import Table

    if not any(entry.allocation is not None for entry in p.allocations) or not p.params:
        return

    held = "corrections chosen per block" if p.corrections is not None else f"correction {p.weight_correction}"
    title = f"Training memory per parameter (weights {p.weight_dtype}, {held}{', gradient release' if p.release else ''})"
    table = Table(title=title)
    for col in ("budget", "weights", "corrections", "gradients", "states", "total", "bytes"):
        table.add_column(col, justify="left" if col == "budget" else "right")
    for entry in p.allocations:
        if entry.allocation is None or not p.params:
            continue
        whole = p.memory_of(entry.allocation)
        per = {k: f"{whole[k] / p.params:.3f}" for k in ("weights", "corrections", "gradients", "states", "total")}
        table.add_row(entry.budget, per["weights"], per["corrections"], per["gradients"], per["states"], per["total"],
                      _bytes(whole["total"]))
    console.print(table)


def _render_phases(p: Plan, console: Any) -> None:
    """For each feasible budget, the device state of every phase of the run, against its limit."""
    from rich.table import Table

    shown = False
    for entry in p.allocations:
        phases = entry.phases
        if phases is None:
            continue
        budget = phases.budget_bytes
        title = f"Optimizer state on the device by phase at budget {entry.budget} = {_bytes(budget)}"
        if p.start_source != p.risk_source:
            title += f" (start risk: {p.start_source})"
        caption = f"an fp32 warm-up would hold {_bytes(p.fp32_bytes)}" + (
            f", {p.fp32_bytes / budget:.2f}x the budget" if budget else ""
        ) + (
            f"; BAOC's instruments (the sampler's buffers and the shadow moments): {_bytes(phases.instrument_bytes)} besides, outside the "
            f"budget (at most {_bytes(phases.instrument_allowance)})"
        ) + (f"; planned peak {phases.peak.line()}" if phases.peak is not None else "")
        table = Table(title=title, caption=caption)
        for col in ("phase", "state bytes", "of budget", "within budget", "what"):
            table.add_column(col, justify="right" if col in ("state bytes", "of budget") else "left")
        for f in phases.figures():
            if f.phase == "conversion":
                size = f"<= {_bytes(f.state_bytes)}"
                extra = f.limit_bytes - budget
                verdict = f"{'yes' if f.within else 'NO'}: <= budget + one parameter's state ({format_bytes(extra)})"
                what = (
                    f"{phases.converted_tensors:,} tensor(s) in {len(phases.converted_blocks):,} block(s) convert; "
                    f"+ {format_bytes(phases.transient_bytes)} transient"
                    if phases.converted_tensors
                    else "nothing converts: steady = start"
                )
            else:
                size, verdict, what = _bytes(f.state_bytes), "yes" if f.within else "NO", f.note
            table.add_row(f.phase, size, f"{f.state_bytes / budget:.3f}" if budget else "-", verdict, what)
        console.print(table)
        shown = True
    if shown:
        console.print(CONVERSION_BOUND)


__all__ = ["DEFAULT_DEVICE", "FormatFigure", "Plan", "PlannedAllocation", "device_note", "load_statistics", "plan", "render"]
