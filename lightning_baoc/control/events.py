"""What one allocation decided and did: :class:`AllocationEvent`, handed to the reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AllocationEvent:
    """What one allocation decided and did (handed to the reports; primitives only).

    Attributes:
        step: optimizer steps completed when it ran.
        reason: ``"warmup"``, ``"epoch"``, ``"plateau"``, ``"budget"`` (a budget changed
            mid-training), ``"settings"`` (settings that shape the allocation changed at resume) or
            ``"params"`` (parameters joined the optimizer after install).
        formats: block -> format now in force.
        changed: block -> (old format, new format) of the blocks converted.
        migrated: parameter name -> (old, new) held formats, as ``set_formats`` reported them.
        kept: whether hysteresis kept the current allocation.
        risk: block -> format -> risk (the fresh risk table).
        total_risk: total risk of ``formats`` under ``risk``.
        solver_risk: total risk of the solver's answer (before hysteresis).
        statistics: block -> sampler statistics.
        block_params: block -> parameter names (the model's); ``block_numel``: block -> elements.
        block_bytes: block -> state bytes in its format; ``state_bytes_before`` / ``state_bytes``:
            the optimizer's state bytes before and after; ``fp32_state_bytes``: the ``fp32`` format's
            (AdamW: 8 x the elements; SGD, Lion: 4 x).
        memory_budget_bytes: the memory budget in bytes; ``time_budget``: seconds (or ``None``).
        time: step time of ``formats`` in the time table's unit, or ``None``.
        baseline_state_bytes: the state the user's own ``torch.optim.AdamW`` would hold (two
            moments in each parameter's dtype; ``None``: the fp32 state), what
            :attr:`saved_fraction` and a fractional budget refer to.
        peak_state_bytes: the most optimizer state held on the training devices at any moment of
            the run so far, conversion transients included (``BlockwiseAdamW.peak_state_bytes``;
            ``None``: not known).
        instrument_bytes: what BAOC's sampler buffers and shadow moments hold, outside the budget
            (``None``: not known).
        training_memory: what training holds after the allocation, from storages
            (:meth:`lightning_baoc.TrainingMemory.to_dict`: weights, corrections, gradients, states,
            total, params; ``None``: not known).
        optimizer: the optimizer whose formats were allocated (``"AdamW"``, ``"SGD"``, ``"Lion"``).
        correction_bytes: the master-weight corrections' bytes after the allocation (0: none; ``None``:
            not known).
        corrections_in_budget: whether the options pair formats with corrections (``BAOC(corrections=...)``,
            or its default on bf16/fp16 weights): the budget then caps ``state_bytes`` plus
            ``correction_bytes``; otherwise corrections the optimizer holds of its own are outside it.
        corrections: block -> the correction of its bf16/fp16 weights (``"none"``, ``"ecc8"``, ``"ecc16"``,
            ``"mixed"``; ``None``: not known).
    """

    step: int
    reason: str
    formats: dict[str, str]
    changed: dict[str, tuple[str, str]]
    migrated: dict[str, tuple[str, str]]
    kept: bool
    risk: dict[str, dict[str, float]]
    total_risk: float
    solver_risk: float
    statistics: dict[str, dict[str, float]]
    block_params: dict[str, list[str]]
    block_numel: dict[str, int]
    block_bytes: dict[str, int]
    state_bytes_before: int
    state_bytes: int
    fp32_state_bytes: int
    memory_budget_bytes: int
    time_budget: float | None = None
    time: float | None = None
    baseline_state_bytes: int | None = None
    peak_state_bytes: int | None = None
    instrument_bytes: int | None = None
    training_memory: dict[str, int] | None = None
    optimizer: str = "AdamW"
    correction_bytes: int | None = None
    corrections_in_budget: bool = False
    corrections: dict[str, str] | None = None

    @property
    def baseline(self) -> int:
        """The user's own AdamW state bytes (:attr:`baseline_state_bytes`, else the fp32 state)."""
        return int(self.baseline_state_bytes if self.baseline_state_bytes is not None else self.fp32_state_bytes)

    @property
    def saved_fraction(self) -> float:
        """Fraction of the user's own AdamW state memory saved: ``1 - state_bytes / baseline``."""
        return 1.0 - self.state_bytes / self.baseline if self.baseline else 0.0


__all__ = ["AllocationEvent"]
