"""What BAOC saved, as one documented record: :class:`BAOCSummary`.

``BAOC.summary()`` and ``BAOCStrategy.summary()`` return it; its numbers are what BAOC logs at each
allocation (:meth:`BAOCSummary.metrics`, the names in :data:`METRIC_NAMES`) and what
``baoc_allocation.json`` holds under the same names. A script reads these figures here, not from the
controller, whose internals may change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: The logger scalars, one value per allocation: ``baoc/<field>`` of :class:`BAOCSummary` (and of
#: ``baoc_allocation.json``). ``baoc/measured_peak_growth_bytes`` is logged where the peak is known,
#: ``baoc/total_risk`` once an allocation has been scored.
METRIC_NAMES: tuple[str, ...] = (
    "baoc/state_bytes",
    "baoc/baseline_state_bytes",
    "baoc/state_fraction",
    "baoc/saved_fraction",
    "baoc/correction_bytes",
    "baoc/memory_budget_bytes",
    "baoc/peak_state_bytes",
    "baoc/measured_peak_growth_bytes",
    "baoc/total_risk",
)


@dataclass(frozen=True)
class BAOCSummary:
    """The figures of a BAOC run: its optimizer state against the baseline, the formats, the
    master-weight corrections and the peaks (``BAOC.summary()``, ``BAOCStrategy.summary()``).

    Attributes:
        phase: ``"warmup"`` (the start allocation, before the first allocation from measured
            statistics) or ``"allocated"``.
        step: optimizer steps completed.
        optimizer: whose state the formats hold: ``"AdamW"``, ``"SGD"`` or ``"Lion"``.
        state_bytes: optimizer state held on the training devices now (the storage allocated).
        baseline_state_bytes: the state the user's own optimizer would hold on the same parameters
            (torch's AdamW: two moments in each parameter's dtype, 8 bytes per fp32 element, 4 per bf16
            one); what a fractional ``memory_budget`` is a fraction of.
        state_fraction: ``state_bytes / baseline_state_bytes``; :attr:`saved_fraction` is ``1 -`` it.
        correction_bytes: bytes the master-weight corrections of bf16/fp16 weights hold (0: none).
        corrections_in_budget: whether the memory budget caps the states and the corrections together
            (``BAOC(corrections=...)``, or its default on bf16/fp16 weights); ``False`` where the
            optimizer holds its own corrections (``weight_correction=``), kept outside the budget.
        memory_budget_bytes: the memory budget, in bytes.
        peak_state_bytes: the most optimizer state held at any moment of the run (resumes included),
            the transients of conversions included.
        measured_peak_growth_bytes: how far the training device's memory rose above its level at fit start
            (the Fabric strategy: at set-up), at its peak since: CUDA's max allocated, the CPU's peak
            resident set (``BAOC.measured_memory()`` has the readings); ``None`` where it is not known (not
            measurable here, or the process peaked before fit start).
        total_risk: the total risk of the allocation in force (``None`` before the first allocation).
        formats: block -> the state format its parameters hold (``"mixed"`` where they differ).
        corrections: block -> the master-weight correction of its bf16/fp16 weights (``"none"``,
            ``"ecc8"``, ``"ecc16"``; ``"none"`` for fp32 weights, their own masters; ``"mixed"``).

    Example:
        >>> s = BAOCSummary(phase="allocated", step=200, optimizer="AdamW", state_bytes=300, baseline_state_bytes=1000,
        ...                 state_fraction=0.3, correction_bytes=0, corrections_in_budget=False, memory_budget_bytes=350,
        ...                 peak_state_bytes=400, measured_peak_growth_bytes=None, total_risk=0.01, formats={"0": "int8"},
        ...                 corrections={"0": "none"})
        >>> s.saved_fraction, s.metrics()["baoc/state_fraction"], "baoc/measured_peak_growth_bytes" in s.metrics()
        (0.7, 0.3, False)
    """

    phase: str
    step: int
    optimizer: str
    state_bytes: int
    baseline_state_bytes: int
    state_fraction: float
    correction_bytes: int
    corrections_in_budget: bool
    memory_budget_bytes: int
    peak_state_bytes: int
    measured_peak_growth_bytes: int | None
    total_risk: float | None
    formats: dict[str, str] = field(default_factory=dict)
    corrections: dict[str, str] = field(default_factory=dict)

    @property
    def saved_fraction(self) -> float:
        """Fraction of the baseline's state saved: ``1 - state_fraction`` (the states alone; the
        corrections are in :attr:`correction_bytes`)."""
        return 1.0 - self.state_fraction

    def metrics(self) -> dict[str, float]:
        """The figures under their logger names (:data:`METRIC_NAMES`), as floats; the measured peak and
        the total risk only where known."""
        out = {
            "baoc/state_bytes": float(self.state_bytes),
            "baoc/baseline_state_bytes": float(self.baseline_state_bytes),
            "baoc/state_fraction": float(self.state_fraction),
            "baoc/saved_fraction": float(self.saved_fraction),
            "baoc/correction_bytes": float(self.correction_bytes),
            "baoc/memory_budget_bytes": float(self.memory_budget_bytes),
            "baoc/peak_state_bytes": float(self.peak_state_bytes),
        }
        if self.measured_peak_growth_bytes is not None:
            out["baoc/measured_peak_growth_bytes"] = float(self.measured_peak_growth_bytes)
        if self.total_risk is not None:
            out["baoc/total_risk"] = float(self.total_risk)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (JSON-ready), ``saved_fraction`` included."""
        return {**asdict(self), "saved_fraction": self.saved_fraction}


def state_fraction(state_bytes: int, baseline_state_bytes: int) -> float:
    """``state_bytes / baseline_state_bytes`` (0 for an empty baseline).

    Example:
        >>> state_fraction(300, 1000), state_fraction(0, 0)
        (0.3, 0.0)
    """
    return state_bytes / baseline_state_bytes if baseline_state_bytes else 0.0


__all__ = ["BAOCSummary", "METRIC_NAMES", "state_fraction"]
