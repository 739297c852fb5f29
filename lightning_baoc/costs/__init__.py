"""What an allocation costs and the problem it solves: memory and time tables, calibration, the
hardware mask and the one rule of withheld formats (:mod:`lightning_baoc.costs.calibration`), and
:class:`AllocationProblem`, the one builder of the solver's problem used by the training
controller, ``lightning-baoc check`` and ``lightning-baoc plan``, and the optimizer state of a
run's phases (start, warm-up, conversion, steady: :mod:`lightning_baoc.costs.phases`), and the
memory of BAOC's own instruments, sized with the model (:mod:`lightning_baoc.costs.instruments`).
"""

from lightning_baoc.costs.instruments import InstrumentSizes, instrument_allowance, size_instruments
from lightning_baoc.costs.phases import CONVERSION_BOUND, PHASES, PhaseFigure, StatePhases, state_phases
from lightning_baoc.costs.problem import AllocationProblem, Budgets, CostSource, baseline_state_bytes, with_message

__all__ = [
    "CONVERSION_BOUND",
    "PHASES",
    "AllocationProblem",
    "Budgets",
    "CostSource",
    "InstrumentSizes",
    "PhaseFigure",
    "StatePhases",
    "baseline_state_bytes",
    "instrument_allowance",
    "size_instruments",
    "state_phases",
    "with_message",
]
