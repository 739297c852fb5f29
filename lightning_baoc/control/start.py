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

A budget changed during warm-up moves the start allocation at once (:meth:`StartAllocation.set_budget`).
"""

from __future__ import annotations

import warnings

from torch import nn

from lightning_baoc.config.budget import parse_memory_budget, parse_time_budget
from lightning_baoc.config.settings import BAOCConfig, plain
from lightning_baoc.control.blocks import Blocks
from lightning_baoc.control.options import Options
from lightning_baoc.control.tables import BlockTables
from lightning_baoc.costs.calibration import withheld_formats
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.risk.prior import block_kind
from lightning_baoc.risk.start import INITIAL_PREFERENCE


class StartAllocation:
    """The warm-up's formats: the start allocation within the budgets, and budget changes.

    Args:
        config: the settings; reads ``initial`` and the budgets, and :meth:`set_budget` writes the budgets.
        blocks: the partition put in its start allocation.
        tables: the problem the start allocation is solved in (its device for the warm-up formats).
        options: how an allocation is applied to the optimizer.

    Attributes:
        formats: block -> the option the warm-up started in (``None`` before :meth:`apply`).

    Example:
        >>> from lightning_baoc import BlockwiseAdamW
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)); opt = BlockwiseAdamW(model.parameters())
        >>> config = BAOCConfig(memory_budget=0.5, calibration="prior")
        >>> blocks = Blocks(config); blocks.build(opt, model); tables = BlockTables(config, blocks); tables.refresh(opt)
        >>> from lightning_baoc.control.instrumentation import Instrumentation
        >>> start = StartAllocation(config, blocks, tables, Options(config, blocks, tables, Instrumentation(config, blocks, tables)))
        >>> start.apply(opt, model)
        >>> sum(tables.memory[b][f] for b, f in start.formats.items()) <= 0.5 * tables.baseline
        True
        >>> start.set_budget(memory_budget="30%", opt=opt, module=model)  # moves the start at once
        >>> config.memory_budget, sum(tables.memory[b][f] for b, f in start.formats.items()) <= 0.3 * tables.baseline
        ('30%', True)
    """

    def __init__(self, config: BAOCConfig, blocks: Blocks, tables: BlockTables, options: Options) -> None:
        self.config = config
        self.blocks = blocks
        self.tables = tables
        self.options = options
        self.formats: dict[str, str] | None = None

    def risk(self, module: nn.Module | None) -> dict[str, dict[str, float]]:
        """The risk table the start allocation minimizes: the prior, or what ``initial`` gives (over
        the options, with corrections): the problem's, as ``lightning-baoc check`` and ``plan`` price it."""
        module = module if module is not None else nn.Module()
        kinds = {b: block_kind(module, b) for b in self.blocks.params}
        problem = self.tables.problem
        assert problem is not None, "the tables are refreshed before the start allocation"
        return problem.start_risk(kinds, self.config.initial)

    def apply(self, opt: BlockwiseOptimizer, module: nn.Module | None) -> None:
        """Put every block in its start allocation (warm-up only; the optimizer may hold no state yet).

        Raises:
            BudgetInfeasibleError: no allocation meets the budgets (it names the smallest one).
            ValueError: ``initial`` names an unknown block or a format not offered here.
        """
        formats = dict(self.tables.solve(self.risk(module)).formats)
        self.options.apply(opt, formats, self.blocks.params)
        self.formats = formats

    def warmup_formats(self, opt: BlockwiseOptimizer) -> None:
        """Warm-up state no larger than the user's AdamW: ``bf16`` for 2-byte parameters.

        torch's AdamW holds bf16/fp16 moments on such parameters (4 bytes per element); ``fp32``
        state (8) would double the user's optimizer memory. Only plain ``fp32`` requests change.
        """
        named = opt.named_params
        small = [
            n for n in self.blocks.names() if named[n].element_size() < 4 and opt.requested_format(named[n]) == "fp32"
        ]
        if not small:
            return
        device = self.tables.device
        masked = withheld_formats(device, True, ["bf16"])
        if masked:  # emulated bf16 would be slow: fp32, said aloud
            warnings.warn(
                f"BAOC: {len(small)} low-precision parameter tensor(s) warm up with fp32 state (8 bytes per "
                f"element, twice torch AdamW's): bf16 state is withheld on {device} ({masked['bf16']})",
                UserWarning,
                stacklevel=3,
            )
            return
        opt.set_formats({n: "bf16" for n in small})

    def set_budget(
        self,
        memory_budget: float | int | str | None = None,
        time_budget: float | str | None = None,
        opt: BlockwiseOptimizer | None = None,
        module: nn.Module | None = None,
    ) -> None:
        """Change the budgets in the settings (``None`` keeps one as it is); with ``opt`` (during
        warm-up, after install) move the start allocation to them at once, so the cap holds from
        the next step.

        Raises:
            ValueError: a malformed budget (it names the value and the forms allowed).
            BudgetInfeasibleError: with ``opt``: the start allocation cannot meet the new budgets;
                the budgets are restored.
        """
        cfg = self.config
        before = (cfg.memory_budget, cfg.time_budget)
        if memory_budget is not None:
            parse_memory_budget(plain(memory_budget), fp32_bytes=float(1 << 62))
            cfg.memory_budget = plain(memory_budget)
        if time_budget is not None:
            parse_time_budget(plain(time_budget), fp32_seconds=1.0)
            cfg.time_budget = plain(time_budget)
        if opt is None:
            return
        # the start allocation follows the budget at once: the cap holds from the next step; a budget
        # it cannot meet is refused here, with the budgets as they were
        try:
            self.apply(opt, module)
        except Exception:
            cfg.memory_budget, cfg.time_budget = before
            raise


__all__ = ["INITIAL_PREFERENCE", "StartAllocation"]
