"""What an allocation costs and the problem it solves: memory and time tables, calibration, the
hardware mask and the one rule of withheld formats (:mod:`lightning_baoc.calibration`), and
:class:`AllocationProblem`, the one builder of the solver's problem used by the training
controller, ``lightning-baoc check`` and ``lightning-baoc plan``.
"""

from .problem import AllocationProblem, Budgets, CostSource, with_message

__all__ = ["AllocationProblem", "Budgets", "CostSource", "with_message"]
