"""The allocation problem of one model on one device: the one place it is built.

:class:`AllocationProblem` turns the blocks' parameter shapes, the device, the format menu and the
budgets into what :func:`~lightning_baoc.solve` needs: the formats offered (the menu less
:func:`~lightning_baoc.costs.calibration.withheld_formats`, the one rule of what is withheld, and a
user's mask), the memory table, the time table (priced by a calibration of the device or by the
prior costs), and the budgets in the units of those tables. The training controller,
``lightning-baoc check`` and ``lightning-baoc plan`` all build one, so they cannot disagree on
what is offered or on what a budget means (``tests/costs/test_allocation_problem.py``).

Budgets are passed to :meth:`AllocationProblem.solve` rather than stored: the controller's can
change mid-run (``set_budget``). A fractional memory budget is a fraction of
:attr:`AllocationProblem.baseline_bytes`, the state the user's own optimizer would hold (the
``fp32`` format's bytes unless told otherwise: fp32 AdamW's 8 per element, SGD's and Lion's 4); an absolute time budget is refused where step
times are the unitless prior costs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import torch

from lightning_baoc.config.budget import (
    absolute_time_with_prior_error,
    format_bytes,
    is_absolute_time,
    parse_memory_budget,
    parse_time_budget,
    round_up,
)
from lightning_baoc.costs.calibration import (
    PRIOR_CORRECTION_COST,
    PRIOR_STEP_COSTS,
    Calibration,
    calibrate,
    memory_table,
    time_table,
    withheld_formats,
)
from lightning_baoc.costs.instruments import (
    DEFAULT_INSTRUMENT_SHARE,
    InstrumentSizes,
    instrument_allowance,
    size_instruments,
)
from lightning_baoc.costs.options import (
    SEPARATOR,
    compose,
    correction_table,
    correction_time_table,
    options,
    prior_correction_risk,
    split_option,
)
from lightning_baoc.costs.peak import planned_peak
from lightning_baoc.costs.phases import StatePhases, state_phases
from lightning_baoc.formats import DEFAULT_MIN_8BIT_NUMEL, RULE_NAMES, formats_of
from lightning_baoc.risk.shadow import DEFAULT_SHADOW_ELEMENTS
from lightning_baoc.risk.start import Initial, prefer_initial, start_risk
from lightning_baoc.sampling import DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS
from lightning_baoc.solver import Allocation, BudgetInfeasibleError, solve

Shape = Sequence[int]
Table = Mapping[str, Mapping[str, float]]
#: Where step times come from: a calibration of the device here (cached), the built-in prior
#: (relative to fp32, no unit), or given per-element costs.
CostSource = Union[Literal["calibrate", "prior"], Calibration, Mapping[str, float]]


def run_instruments(
    shapes: Mapping[str, Sequence[Shape]],
    baseline_bytes: int,
    device: str | torch.device,
    capacity: int = DEFAULT_CAPACITY,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    instrument_share: float = DEFAULT_INSTRUMENT_SHARE,
) -> InstrumentSizes:
    """The sampler's and the shadow's sizes a run gives them on blocks of these shapes: within
    ``max(instrument_share x baseline_bytes, INSTRUMENT_FLOOR)``
    (:func:`~lightning_baoc.costs.instruments.size_instruments`), device buffers counted on an accelerator.
    The controller sizes its instruments with it, and ``lightning-baoc check`` reports them with it.

    Example:
        >>> sizes = run_instruments({"a": [(1024, 1024)]}, baseline_bytes=8 * 2**20, device="cpu")
        >>> sizes.scaled, sizes.estimate_bytes <= sizes.allowance
        (True, True)
    """
    allowance = instrument_allowance(baseline_bytes, instrument_share)
    return size_instruments(shapes, capacity, max_elements, DEFAULT_SHADOW_ELEMENTS, allowance,
                            accelerator=torch.device(device).type != "cpu")


def with_message(err: BudgetInfeasibleError, message: str) -> BudgetInfeasibleError:
    """``err`` with another message and the same figures (callers add their context)."""
    return BudgetInfeasibleError(
        message,
        memory_budget=err.memory_budget,
        time_budget=err.time_budget,
        min_memory=err.min_memory,
        min_time=err.min_time,
        exact=err.exact,
        fp32_memory=err.fp32_memory,
        fp32_time=err.fp32_time,
    )


@dataclass
class Budgets:
    """A problem's budgets: as handed to :func:`~lightning_baoc.solve`, and in absolute units.

    Attributes:
        memory: the memory budget for ``solve`` (the user's fraction where ``solve`` resolves it
            against the same reference, so its messages name fractions; else bytes).
        time: the time budget for ``solve`` (``None``: no limit).
        memory_bytes: the memory budget in bytes.
        time_seconds: the time budget in the time table's unit (``None``: no limit).
    """

    memory: Any
    time: Any
    memory_bytes: int
    time_seconds: float | None


@dataclass
class AllocationProblem:
    """Tables, offered formats and budget units of one model on one device.

    Args:
        shapes: block -> the shapes of its parameters, in block order.
        device: the training device (its mask and whether ``offload`` saves device memory).
        menu: the formats asked for (default: all of :data:`~lightning_baoc.FORMATS`).
        timed: whether a time budget will be set (``offload`` is withheld on an accelerator
            without one; step times are priced only then) (default: False).
        costs: where step times come from (default: ``"prior"``); read only when ``timed``.
        min_8bit_numel: the optimizer's small-tensor threshold (default: 4096).
        mask: formats the user excludes besides the rule, name -> reason (default: none).
        baseline_bytes: the state a fractional memory budget refers to (default: the ``fp32``
            format's bytes of the blocks).
        cache_dir: calibration cache directory (default: the user cache directory).
        rule: the optimizer's update rule (``BlockwiseOptimizer.rule``): ``"adamw"`` (default,
            :data:`~lightning_baoc.FORMATS`), ``"sgd"`` or ``"lion"`` (the momentum formats of
            :data:`~lightning_baoc.formats.MOMENTUM_FORMATS`, one buffer: ``fp32`` is 4 bytes per
            element). Formats, bytes, priors and step costs are the rule's.
        corrections: master-weight corrections the solver pairs with every format
            (:mod:`lightning_baoc.costs.options`: options ``"int8+ecc8"``; default: ``None``, formats
            alone); needs ``dtypes``. Under a time budget an option's step time is its format's
            plus what its correction adds per element of the block's 16-bit weights
            (:data:`~lightning_baoc.costs.calibration.PRIOR_CORRECTION_COST`, or measured by
            :func:`~lightning_baoc.costs.calibration.calibrate` with ``corrections``; given costs name it
            ``"+ecc8"``).
        dtypes: block -> the dtypes of its parameters, in block order (the corrections' bytes).
        costs_source: what ``costs`` given as a mapping are, in words (``time_source``).

    Raises:
        ValueError: every format of the menu is withheld (the message names why).

    Example:
        >>> p = AllocationProblem({"fc": [(64, 64)], "out": [(10, 64)]}, "cpu", ["fp32", "int8"])
        >>> p.allowed, p.fp32_bytes
        (['fp32', 'int8'], 37888)
        >>> p.solve({"fc": {"fp32": 0.0, "int8": 0.1}, "out": {"fp32": 0.0, "int8": 0.5}}, 0.9).formats
        {'fc': 'int8', 'out': 'fp32'}
    """

    shapes: Mapping[str, Sequence[Shape]]
    device: str | torch.device
    menu: Sequence[str] | None = None
    timed: bool = False
    costs: CostSource = "prior"
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL
    mask: Mapping[str, str] = field(default_factory=dict)
    baseline_bytes: int | None = None
    cache_dir: str | os.PathLike[str] | None = None
    rule: str = "adamw"
    corrections: Sequence[str] | None = None
    dtypes: Mapping[str, Sequence[torch.dtype]] | None = None
    #: what given ``costs`` (a mapping) are, for ``time_source`` (default: "given costs")
    costs_source: str | None = None
    withheld: dict[str, str] = field(init=False)
    allowed: list[str] = field(init=False)
    memory: dict[str, dict[str, int]] = field(init=False)

    def __post_init__(self) -> None:
        registry = formats_of(self.rule)
        wanted = list(registry) if self.menu is None else list(self.menu)
        self.withheld = {
            **withheld_formats(self.device, self.timed, wanted, self.rule),
            **{f: why for f, why in self.mask.items() if f in wanted},
        }
        self.allowed = [f for f in wanted if f not in self.withheld]
        if not self.allowed:
            raise ValueError(f"formats={wanted} are all withheld on {self.device} ({self.withheld}); allow other formats")
        self.formats = list(self.allowed)  # the state formats offered (the options pair them with corrections)
        tabulated = sorted(set(self.allowed) | {"fp32"})
        self.memory = memory_table(self.shapes, self.device, tabulated, self.min_8bit_numel, self.rule)
        if self.corrections is not None:
            self._pair_corrections(tabulated)
        self.fp32_bytes = sum(row["fp32"] for row in self.memory.values())
        if self.baseline_bytes is None:
            self.baseline_bytes = self.fp32_bytes
        self._time: dict[str, dict[str, float]] | None = None
        self._per_element: Mapping[str, float] | None = None
        self._per_correction: Mapping[str, float] = {"none": 0.0}
        self.time_source: str | None = None

    def _pair_corrections(self, tabulated: list[str]) -> None:
        """Options pairing every offered format with every correction: bytes of both."""
        if self.dtypes is None:
            raise ValueError("corrections need dtypes: block -> the dtypes of its parameters")
        corrections = list(dict.fromkeys(self.corrections or ()))
        if not corrections:
            raise ValueError("corrections=[] offers no option; give at least one of 'none', 'ecc8', 'ecc16'")
        self.corrections = corrections
        extra = correction_table(self.shapes, self.dtypes, sorted(set(corrections) | {"none"}))
        self.allowed = options(self.formats, corrections)
        names = sorted(set(self.allowed) | set(tabulated))
        self.memory = {b: {k: int(v) for k, v in row.items()} for b, row in compose(self.memory, extra, names).items()}

    # ------------------------------------------------------------------ step times

    @property
    def priced_by_prior(self) -> bool:
        """Whether step times are the unitless prior costs (an absolute time budget is refused)."""
        return isinstance(self.costs, str) and self.costs == "prior"

    def _costs(self) -> Mapping[str, float]:
        if self._per_element is None:
            corrections = [c for c in self.corrections or () if c != "none"]
            if isinstance(self.costs, str) and self.costs == "prior":
                self._per_element = PRIOR_STEP_COSTS[self.rule]
                self._per_correction = dict(PRIOR_CORRECTION_COST)
                self.time_source = "prior (PRIOR_STEP_COSTS, relative to fp32)"
            elif isinstance(self.costs, str) and self.costs == "calibrate":
                cal = calibrate(self.device, cache_dir=self.cache_dir, rule=self.rule, corrections=corrections)
                self._per_element, self._per_correction = cal.seconds_per_element, cal.correction_seconds_per_element
                self.time_source = f"calibration of {cal.device} ({cal.device_name}, torch {cal.torch_version})"
            elif isinstance(self.costs, Calibration):
                self._per_element, self.time_source = self.costs.seconds_per_element, f"calibration of {self.costs.device}"
                self._per_correction = self.costs.correction_seconds_per_element
            else:
                given = dict(self.costs)
                self._per_element, self.time_source = given, self.costs_source or "given costs"
                # a correction's cost given beside the formats' (key "+ecc8"); none: nothing added
                self._per_correction = {"none": 0.0, **{k[len(SEPARATOR):]: v for k, v in given.items() if k.startswith(SEPARATOR)}}
        return self._per_element

    def time(self) -> dict[str, dict[str, float]]:
        """Step time per block and format (the offered ones and ``fp32``), priced once."""
        if self._time is None:
            costs = self._costs()
            priced = sorted(f for f in set(self.formats) | {"fp32"} if f in costs)
            table = time_table(self.shapes, costs, priced, self.min_8bit_numel, self.rule)
            if self.corrections is not None:  # an option's time: its format's plus its correction's
                assert self.dtypes is not None  # _pair_corrections checked it
                extra = correction_time_table(self.shapes, self.dtypes, self._per_correction, self.corrections)
                names = sorted({o for o in self.allowed if split_option(o)[0] in priced} | set(priced))
                table = compose(table, extra, names)
            self._time = table
        return self._time

    @property
    def fp32_time(self) -> float:
        """The ``fp32`` format's step time of the blocks (the reference of a time multiple)."""
        return sum(row["fp32"] for row in self.time().values())

    # ------------------------------------------------------------------ budgets

    def budgets(self, memory_budget: object, time_budget: object = None, argument: str = "time_budget") -> Budgets:
        """Both budgets in the tables' units, and as ``solve`` is handed them.

        Raises:
            ValueError: a malformed budget, or an absolute time budget priced with the prior
                costs (named as ``argument``).
        """
        memory_bytes = parse_memory_budget(memory_budget, self.baseline_bytes, warn_small_int=True)
        time_seconds: float | None = None
        if time_budget is not None:
            if self.priced_by_prior and is_absolute_time(time_budget):
                raise absolute_time_with_prior_error(
                    time_budget, argument, "price the step with a calibration of the device (seconds)."
                )
            time_seconds = parse_time_budget(time_budget, self.fp32_time, argument=argument)
        if "fp32" in self.allowed and self.baseline_bytes == self.fp32_bytes:
            # solve resolves fractions against the same fp32 column: its messages then name fractions
            return Budgets(memory_budget, time_budget, memory_bytes, time_seconds)
        return Budgets(memory_bytes, None if time_seconds is None else f"{time_seconds!r}s", memory_bytes, time_seconds)

    # ------------------------------------------------------------------ solving

    def tables(self, timed: bool) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, float]] | None]:
        """The memory and (with ``timed``) time tables restricted to the offered formats."""
        offered = self.offered(timed)
        memory = {b: {f: row[f] for f in offered} for b, row in self.memory.items()}
        if not timed:
            return memory, None
        full = self.time()
        return memory, {b: {f: full[b][f] for f in offered} for b in self.memory}

    def offered(self, timed: bool) -> list[str]:
        """The formats ``solve`` is offered: the allowed ones, and with a time budget only those
        with a step cost."""
        if not timed:
            return list(self.allowed)
        costs = self._costs()
        return [f for f in self.allowed if split_option(f)[0] in costs and split_option(f)[1] in self._per_correction]

    def solve(self, risk: Table, memory_budget: object, time_budget: object = None, **options: Any) -> Allocation:
        """Least total risk within the budgets over the offered formats (``risk`` rows may list
        more formats: only the offered ones are read).

        Raises:
            BudgetInfeasibleError: no allocation meets the budgets; it names the smallest
                feasible ones, with the memory minimum also as a fraction of
                :attr:`baseline_bytes` where that differs from fp32 AdamW's.
        """
        timed = time_budget is not None
        budgets = self.budgets(memory_budget, time_budget)
        memory, time = self.tables(timed)
        rows = {b: {f: float(risk[b][f]) for f in memory[b] if f in risk[b]} for b in memory}
        try:
            return solve(rows, memory, budgets.memory, time, budgets.time, reference=f"fp32 {RULE_NAMES[self.rule]}", **options)
        except BudgetInfeasibleError as err:
            if err.min_memory is None or self.baseline_bytes == self.fp32_bytes:
                raise
            assert self.baseline_bytes is not None
            raise with_message(
                err,
                f"{err}; as a fraction of the {RULE_NAMES[self.rule]} state on these parameters ({format_bytes(self.baseline_bytes)}): "
                f"memory_budget >= {round_up(err.min_memory / self.baseline_bytes)}",
            ) from None

    def start_risk(self, kinds: Mapping[str, str], initial: Initial = None, owner: str = "BAOC") -> dict[str, dict[str, float]]:
        """The risk the start allocation minimizes, over :attr:`allowed` (the training controller's):
        :func:`~lightning_baoc.risk.start.start_risk` (the prior, or ``initial``); with corrections the
        formats' prior paired with the corrections' prior (:func:`~lightning_baoc.costs.options.compose`),
        then ``initial`` over the options."""
        if self.corrections is None:
            return start_risk(self.shapes, kinds, self.allowed, self.min_8bit_numel, initial, owner, self.rule)
        prior = start_risk(self.shapes, kinds, self.formats, self.min_8bit_numel, None, owner, self.rule)
        extra = prior_correction_risk(self.shapes, self.dtypes or {}, self.corrections)
        return prefer_initial(compose(prior, extra, self.allowed), initial, self.allowed, owner)

    def phases(
        self,
        kinds: Mapping[str, str],
        memory_budget: object,
        time_budget: object = None,
        *,
        initial: Initial = None,
        steady_risk: Table | None = None,
        owner: str = "BAOC",
        sampler: Mapping[str, Any] | None = None,
        release: bool = False,
        **options: Any,
    ) -> StatePhases:
        """The device state of a run's phases at these budgets: start, warm-up, conversion, steady
        (:mod:`lightning_baoc.costs.phases`).

        The start allocation is solved as the training controller solves it at install: least
        :func:`~lightning_baoc.risk.start.start_risk` (the prior, or ``initial``), no solver options.
        The steady one is least ``steady_risk`` (default: the start's risk, so without measured
        risk the run is expected to stay where it started) with ``options`` (``method``,
        ``max_boundaries``).

        Args:
            kinds: block -> kind (:func:`~lightning_baoc.risk.prior.block_kind`).
            memory_budget, time_budget: the budgets, as for :meth:`solve`.
            initial: as ``BAOC(initial=...)``: a ``baoc_allocation.json`` path, a mapping block ->
                format (an option, with ``corrections``), or ``None``.
            steady_risk: the risk the steady allocation minimizes (a statistics file's).
            owner: who was given ``initial``, for error messages.
            sampler: ``capacity``, ``max_elements``, ``instrument_share`` of the run (default: BAOC's
                defaults), for the instruments' bytes (:mod:`lightning_baoc.costs.instruments`).
            release: gradient release: the planned peak holds no gradients (:mod:`lightning_baoc.costs.peak`).

        Raises:
            BudgetInfeasibleError: no allocation meets the budgets.
            ValueError: a bad budget, or an ``initial`` that does not fit this model.
        """
        risk = self.start_risk(kinds, initial, owner)
        start = self.solve(risk, memory_budget, time_budget)
        steady = self.solve(risk if steady_risk is None else steady_risk, memory_budget, time_budget, **options)
        budget_bytes = self.budgets(memory_budget, time_budget).memory_bytes
        phases = state_phases(self.shapes, self.device, start, steady, budget_bytes, self.min_8bit_numel, self.rule,
                              self.dtypes if self.corrections is not None else None)
        sizes = self.instruments(**(sampler or {}))
        phases.instrument_bytes, phases.instrument_allowance = sizes.estimate_bytes, sizes.allowance
        dtypes = self.dtypes or {b: [torch.float32] * len(row) for b, row in self.shapes.items()}
        phases.peak = planned_peak(self.shapes, dtypes, max(f.state_bytes for f in phases.figures()), phases.instrument_bytes,
                                   release=release)
        return phases

    def instruments(
        self, capacity: int = DEFAULT_CAPACITY, max_elements: int = DEFAULT_MAX_ELEMENTS,
        instrument_share: float = DEFAULT_INSTRUMENT_SHARE,
    ) -> InstrumentSizes:
        """The sampler's and the shadow's sizes on these blocks (the controller's rule, :func:`run_instruments`)."""
        assert self.baseline_bytes is not None  # set in __post_init__
        return run_instruments(self.shapes, self.baseline_bytes, self.device, capacity, max_elements, instrument_share)

    def smallest(self, memory_budget: object, time_budget: object = None) -> Allocation:
        """Check feasibility: an allocation meeting the budgets whatever the risk (all risks 0).

        Feasibility depends on the memory and time tables only, so it is known before any
        gradient is seen.
        """
        zero = {b: {f: 0.0 for f in self.allowed} for b in self.memory}
        return self.solve(zero, memory_budget, time_budget)


def baseline_state_bytes(
    shapes: Mapping[str, Sequence[Sequence[int]]], dtypes: Mapping[str, Sequence[torch.dtype]], rule: str = "adamw"
) -> int:
    """The state torch's optimizer of update rule ``rule`` holds for these tensors: its buffers (AdamW two,
    SGD and Lion one) in each parameter's dtype. A fractional memory budget is of it (the training
    controller's, ``lightning-baoc check``'s and ``plan``'s rule): fp32 AdamW's 8 bytes per element, 4 for
    bf16 weights."""
    moments = formats_of(rule)["fp32"].state_bytes((1,)) // 4
    return sum(moments * math.prod(s) * d.itemsize for b, row in shapes.items() for s, d in zip(row, dtypes[b]))


__all__ = ["AllocationProblem", "Budgets", "CostSource", "baseline_state_bytes", "run_instruments", "with_message"]
