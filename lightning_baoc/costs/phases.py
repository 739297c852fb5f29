"""The optimizer state on the device in each phase of a run: start, warm-up, conversion, steady.

A run holds its optimizer state in three allocations over time, and the budget must hold in each:

- **start**: at install the controller solves the allocation of least *start* risk (the prior, or
  what ``initial`` gives: :func:`lightning_baoc.risk.start.start_risk`) within the budgets and sets
  it before any state exists;
- **warm-up**: the states are created in the start formats at the first step, so the warm-up
  holds exactly the start's bytes (no fp32 state beyond the budget);
- **conversion**: at warm-up end the allocation from measured statistics (**steady**) replaces the
  start one, one parameter at a time, shrinking ones first (:mod:`lightning_baoc.optim.pools`). While
  parameter ``p`` converts, the device holds at most ``max(start, steady) + min(old_p, new_p)``, so
  the conversion peaks at most at ``max(start, steady) + max_p min(old_p, new_p)`` over the
  parameters whose format changes (0 more when none does), plus a few MiB of fp32 scratch that is
  not state;
- **steady**: the allocation the run trains in after warm-up.

:class:`StatePhases` holds those figures per tensor as the optimizer allocates them (the memory
table's rule, :func:`~lightning_baoc.costs.calibration.device_state_bytes`: fallbacks per tensor,
``offload`` off an accelerator's memory); :meth:`~lightning_baoc.costs.AllocationProblem.phases`
solves both allocations and builds it, for ``lightning-baoc plan`` and ``lightning-baoc check``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_baoc.config.budget import format_bytes
from lightning_baoc.costs.calibration import device_state_bytes, offload_saves_memory
from lightning_baoc.costs.options import correction_bytes, split_option
from lightning_baoc.costs.peak import PlannedPeak
from lightning_baoc.formats import DEFAULT_MIN_8BIT_NUMEL, formats_of, resolve_in
from lightning_baoc.formats.base import as_shape
from lightning_baoc.solver import Allocation

#: The phases of a run, in order.
PHASES = ("start", "warm-up", "conversion", "steady")

#: What each phase holds (the planner's and the checklist's wording).
PHASE_NOTES = {
    "start": "the start allocation, set at install before any state exists",
    "warm-up": "states created in the start formats: the start's bytes",
    "conversion": "bound while converting to the steady allocation: max(start, steady) + max min(old, new) of one parameter",
    "steady": "the allocation after warm-up",
}

#: The footnote that states the conversion bound.
CONVERSION_BOUND = (
    "conversion: parameters convert one at a time, shrinking ones first; while parameter p converts the "
    "device holds at most max(start, steady) + min(old_p, new_p), so the peak is at most max(start, steady) "
    "+ the largest min(old_p, new_p) over the parameters whose format changes, plus a few MiB of fp32 scratch "
    "that is not state. Its limit is the budget plus the largest one-parameter state."
)


@dataclass(frozen=True)
class PhaseFigure:
    """One phase: its device state bytes and the most it may hold.

    Attributes:
        phase: one of :data:`PHASES`.
        state_bytes: device bytes of optimizer state (for ``conversion`` the bound).
        limit_bytes: the budget; for ``conversion`` the budget plus the largest one-parameter state.
        note: what the phase holds.
    """

    phase: str
    state_bytes: int
    limit_bytes: int
    note: str

    @property
    def within(self) -> bool:
        """Whether the phase holds at most its limit."""
        return self.state_bytes <= self.limit_bytes


@dataclass
class StatePhases:
    """Device state bytes of a run's phases at one memory budget (see the module docstring).

    Attributes:
        budget_bytes: the memory budget in bytes.
        start: the start allocation (block -> format in ``start.formats``).
        steady: the allocation after warm-up.
        start_bytes: device state bytes of the start allocation (the warm-up's too).
        steady_bytes: device state bytes of the steady allocation.
        transient_bytes: the largest ``min(old, new)`` over the parameters whose format changes
            from start to steady (0 when none does).
        largest_tensor_bytes: the largest one-parameter device state of either allocation.
        converted_tensors: how many parameters change format at the conversion.
        converted_blocks: the blocks whose format changes.
        instrument_bytes: what the sampler's buffers and the shadow moments will hold, outside the
            budget (:mod:`lightning_baoc.costs.instruments`; 0 when not computed).
        instrument_allowance: the most they may hold.
        peak: the run's planned peak beyond its weights (:mod:`lightning_baoc.costs.peak`: gradients,
            the backward's, the state's most over the phases, instruments, working memory).
    """

    budget_bytes: int
    start: Allocation
    steady: Allocation
    start_bytes: int
    steady_bytes: int
    transient_bytes: int
    largest_tensor_bytes: int
    converted_tensors: int
    converted_blocks: list[str] = field(default_factory=list)
    instrument_bytes: int = 0
    instrument_allowance: int = 0
    peak: PlannedPeak | None = None

    @property
    def warmup_bytes(self) -> int:
        """The warm-up's state: created in the start formats, so the start's bytes."""
        return self.start_bytes

    @property
    def conversion_bytes(self) -> int:
        """The bound on the state during the conversion: ``max(start, steady) + transient``."""
        return max(self.start_bytes, self.steady_bytes) + self.transient_bytes

    def figures(self) -> list[PhaseFigure]:
        """The four phases in order, each with its limit."""
        budget = self.budget_bytes
        values = {
            "start": (self.start_bytes, budget),
            "warm-up": (self.warmup_bytes, budget),
            "conversion": (self.conversion_bytes, budget + self.largest_tensor_bytes),
            "steady": (self.steady_bytes, budget),
        }
        return [PhaseFigure(p, values[p][0], values[p][1], PHASE_NOTES[p]) for p in PHASES]

    def exceeded(self) -> list[PhaseFigure]:
        """The phases above their limit (none unless something is wrong)."""
        return [f for f in self.figures() if not f.within]

    def summary(self) -> str:
        """One line: every phase's bytes, e.g. ``start 2 MiB, warm-up 2 MiB, conversion <= 2.5 MiB, steady 2 MiB``."""
        parts = []
        for f in self.figures():
            bound = "<= " if f.phase == "conversion" else ""
            parts.append(f"{f.phase} {bound}{format_bytes(f.state_bytes)}")
        changed = (
            f" ({self.converted_tensors} tensor(s) in {len(self.converted_blocks)} block(s) convert)"
            if self.converted_tensors
            else " (nothing converts)"
        )
        return ", ".join(parts) + changed

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every phase's bytes, limit and verdict, the conversion's figures and both allocations."""
        return {
            "budget_bytes": self.budget_bytes,
            "phases": {
                f.phase: {"state_bytes": f.state_bytes, "limit_bytes": f.limit_bytes, "within": f.within}
                for f in self.figures()
            },
            "transient_bytes": self.transient_bytes,
            "largest_tensor_bytes": self.largest_tensor_bytes,
            "converted_tensors": self.converted_tensors,
            "converted_blocks": list(self.converted_blocks),
            "instrument_bytes": self.instrument_bytes,
            "instrument_allowance": self.instrument_allowance,
            "planned_peak": self.peak.to_dict() if self.peak is not None else None,
            "start_formats": dict(self.start.formats),
            "steady_formats": dict(self.steady.formats),
        }


def state_phases(
    shapes: Mapping[str, Sequence[Sequence[int]]],
    device: Any,
    start: Allocation,
    steady: Allocation,
    budget_bytes: int,
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
    rule: str = "adamw",
    dtypes: Mapping[str, Sequence[torch.dtype]] | None = None,
) -> StatePhases:
    """The phases' device state of going from ``start`` to ``steady`` on ``device``, per tensor, in
    the formats of the update rule ``rule`` (default: AdamW's).

    A parameter converts when the format it really gets (:func:`~lightning_baoc.formats.resolve_format`)
    differs between the two allocations; its transient is the smaller of its old and new device states.

    With master-weight corrections the allocations hold options (``"int8+ecc8"``,
    :mod:`lightning_baoc.costs.options`) and ``dtypes`` (block -> its parameters' dtypes) prices the
    corrections of 16-bit weights: a tensor holds its state and its correction. The controller shrinks
    corrections before the states convert and grows them after, one parameter at a time (the old and
    the new correction both held while it converts), so a changed correction adds the smaller of its
    two sizes to the transient as a changed state does.

    Example:
        >>> from lightning_baoc.costs import AllocationProblem
        >>> problem = AllocationProblem({"fc": [(64, 64)]}, "cpu", ["fp32", "int8"])
        >>> risk = {"fc": {"fp32": 0.0, "int8": 0.1}}
        >>> start, steady = problem.solve(risk, 1.0), problem.solve(risk, 0.5)  # fp32, then int8
        >>> p = state_phases(problem.shapes, "cpu", start, steady, 16384)
        >>> p.start_bytes, p.steady_bytes, p.transient_bytes, p.conversion_bytes
        (32768, 8712, 8712, 41480)
    """
    off_device = offload_saves_memory(device)
    registry = formats_of(rule)
    start_bytes = steady_bytes = transient = largest = converted = 0
    blocks: list[str] = []
    for block, block_shapes in shapes.items():
        (old, old_correction), (new, new_correction) = split_option(start.formats[block]), split_option(steady.formats[block])
        changed = False
        for k, s in enumerate(block_shapes):
            before = device_state_bytes(old, s, off_device, min_8bit_numel, rule)
            after = device_state_bytes(new, s, off_device, min_8bit_numel, rule)
            dtype = dtypes[block][k] if dtypes is not None else torch.float32
            corrected = (correction_bytes(s, dtype, old_correction), correction_bytes(s, dtype, new_correction))
            start_bytes, steady_bytes = start_bytes + before + corrected[0], steady_bytes + after + corrected[1]
            largest = max(largest, before + corrected[0], after + corrected[1])
            converts = resolve_in(registry, old, as_shape(s), min_8bit_numel) != resolve_in(registry, new, as_shape(s), min_8bit_numel)
            if converts:
                transient = max(transient, min(before, after))
            if corrected[0] != corrected[1]:
                transient = max(transient, min(corrected))
            if converts or corrected[0] != corrected[1]:
                converted += 1
                changed = True
        if changed:
            blocks.append(block)
    return StatePhases(budget_bytes, start, steady, start_bytes, steady_bytes, transient, largest, converted, blocks)


__all__ = ["CONVERSION_BOUND", "PHASES", "PHASE_NOTES", "PhaseFigure", "StatePhases", "state_phases"]
