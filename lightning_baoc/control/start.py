"""The start allocation: the budgets hold from the first optimizer step, before any gradient is seen.

At install, during warm-up, every block is put in the allocation of least *prior* risk that meets the
budgets (:func:`lightning_baoc.risk.prior_risk`: block kinds and sizes, the formats offered on the
device), or in the allocation a previous run found (``initial``: its ``baoc_allocation.json``, whose
measured risks replace the prior, or a mapping block -> format). The optimizer holds no state yet,
so the warm-up's states are created in those formats: no fp32 state ever exists beyond the budget.
The warm-up then samples the gradients, and the allocation at its end starts from the states as they
are (decoded from their formats; blocks held without momentum take their signal from the sampled
gradients, as at a re-evaluation).

The risk table is :meth:`lightning_baoc.costs.AllocationProblem.start_risk` (the prior or ``initial``,
:func:`lightning_baoc.risk.start.start_risk`, over the options with corrections), which ``lightning-baoc
plan`` and ``lightning-baoc check`` call too (:meth:`~lightning_baoc.costs.AllocationProblem.phases`),
so the start they report is this one.

:class:`StartMixin` expects the controller's ``problem``, ``block_params``,
``_module``, ``optimizer``, ``config`` and ``_solve``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch import nn

from lightning_baoc.config.budget import parse_memory_budget, parse_time_budget
from lightning_baoc.control.checkpoint import plain as _plain
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.risk.prior import block_kind
from lightning_baoc.risk.start import INITIAL_PREFERENCE
from lightning_baoc.solver import Allocation


class StartMixin:
    """The start allocation of the controller (see the module docstring)."""

    # provided by the controller
    config: Any
    optimizer: BlockwiseOptimizer | None
    block_params: dict[str, list[str]]
    _module: nn.Module | None
    problem: Any  # the controller's AllocationProblem
    _solve: Callable[[Mapping[str, Mapping[str, float]]], Allocation]
    start_allocation: dict[str, str] | None
    _apply_options: Callable[..., Any]
    phase: str
    pending: str | None
    installed: bool

    def set_budget(self, memory_budget: float | int | str | None = None, time_budget: float | str | None = None) -> None:
        """Change a budget mid-training; call it between steps, on every rank.

        After the first allocation the next step boundary re-evaluates against it (a budget that can
        no longer be met raises there, before any conversion). During warm-up the start allocation is
        solved again at once, so the cap holds from the next step; a budget it cannot meet raises
        here and the budgets stay as they were. ``None`` keeps a budget as it is.

        A lowered budget after the first allocation holds from the end of that re-evaluation's
        conversion: until then the state chosen for the old budget stays on the device (and during
        the conversion, shrinking parameters first, at most that plus one parameter's state).

        Example:
            >>> ctl = BAOCController(memory_budget=0.5, warmup_steps=20)
            >>> ctl.set_budget(memory_budget="30%")
            >>> ctl.config.memory_budget
            '30%'
        """
        cfg = self.config
        before = (cfg.memory_budget, cfg.time_budget)
        if memory_budget is not None:
            parse_memory_budget(_plain(memory_budget), fp32_bytes=float(1 << 62))
            cfg.memory_budget = _plain(memory_budget)
        if time_budget is not None:
            parse_time_budget(_plain(time_budget), fp32_seconds=1.0)
            cfg.time_budget = _plain(time_budget)
        if self.phase == "allocated":
            self.pending = "budget"
        elif self.installed:
            # during warm-up the start allocation follows the budget at once: the cap holds from the
            # next step; a budget it cannot meet is refused here, with the budgets as they were
            try:
                self._start_within_budget()
            except Exception:
                cfg.memory_budget, cfg.time_budget = before
                raise

    def _start_within_budget(self) -> None:
        """Put every block in its start allocation (warm-up only; the optimizer may hold no state yet).

        Raises:
            BudgetInfeasibleError: no allocation meets the budgets (it names the smallest one).
            ValueError: ``initial`` names an unknown block or a format not offered here.
        """
        assert self.optimizer is not None
        formats = dict(self._solve(self._start_risk()).formats)
        self._apply_options(formats, self.block_params)
        self.start_allocation = formats

    def _start_risk(self) -> dict[str, dict[str, float]]:
        """The risk table the start allocation minimizes: the prior, or what ``initial`` gives (over
        the options, with corrections): the problem's, as ``lightning-baoc check`` and ``plan`` price it."""
        assert self.optimizer is not None
        module = self._module if self._module is not None else nn.Module()
        kinds = {b: block_kind(module, b) for b in self.block_params}
        return self.problem.start_risk(kinds, self.config.initial)


__all__ = ["INITIAL_PREFERENCE", "StartMixin"]
