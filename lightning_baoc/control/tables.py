"""The tables of the blocks and their allocation problem, solved under the budgets.

:class:`BlockTables` holds what the solver and the reports need of the blocks: the shapes (a
sharded tensor's largest shard), sizes and dtypes of their parameters, the state the user's own
optimizer would hold on them (the baseline a fractional budget refers to) and the
:class:`~lightning_baoc.costs.AllocationProblem` built from them: the formats offered on the
training device (:func:`lightning_baoc.costs.calibration.withheld_formats`), the memory and time
tables. ``lightning-baoc check`` and ``plan`` build the same problem.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.control.blocks import Blocks
from lightning_baoc.costs import AllocationProblem, baseline_state_bytes, with_message
from lightning_baoc.costs.options import corrections_menu
from lightning_baoc.formats import RULE_NAMES, formats_of
from lightning_baoc.formats.correction import corrections_refused
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.optim.sharding import shard_shape
from lightning_baoc.solver import Allocation, BudgetInfeasibleError

Table = Mapping[str, Mapping[str, float]]


class BlockTables:
    """Shapes, sizes, the user's baseline and the allocation problem of the blocks.

    Args:
        config: the settings; :meth:`refresh` reads ``formats``, ``corrections``, ``time_budget``,
            ``calibration`` and ``calibration_cache_dir``; :meth:`solve`, :meth:`budgets` and
            :meth:`fits` read the budgets as they are at the call (``set_budget`` changes them).
        blocks: the partition the tables are of (read at :meth:`refresh`).

    Attributes:
        device: the training device (given to :meth:`refresh`; it decides the formats withheld and
            what ``offload`` costs).
        shapes: block -> the shapes of its parameters (a sharded tensor's largest shard).
        numel: block -> its elements; ``dtypes``: block -> the dtypes of its parameters.
        baseline: the state the user's own optimizer would hold on the blocks (bytes).
        problem: the allocation problem (``None`` before :meth:`refresh`).

    Example:
        >>> from torch import nn
        >>> from lightning_baoc import BlockwiseAdamW
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)); opt = BlockwiseAdamW(model.parameters())
        >>> config = BAOCConfig(memory_budget=0.5, calibration="prior")
        >>> blocks = Blocks(config); blocks.build(opt, model); tables = BlockTables(config, blocks); tables.refresh(opt)
        >>> tables.numel, tables.baseline == tables.fp32_bytes == 8 * (64 * 65 + 4 * 65)
        ({'0': 4160, '1': 260}, True)
        >>> sorted(tables.solve({b: {f: 0.0 for f in tables.offered} for b in blocks.params}).formats)
        ['0', '1']
    """

    def __init__(self, config: BAOCConfig, blocks: Blocks) -> None:
        self.config = config
        self.blocks = blocks
        self.device = torch.device("cpu")
        self.shapes: dict[str, list[tuple[int, ...]]] = {}
        self.numel: dict[str, int] = {}
        self.dtypes: dict[str, list[torch.dtype]] = {}
        self.baseline = 0
        self.problem: AllocationProblem | None = None
        #: the corrections paired with the formats (``None``: formats alone), decided by :meth:`refresh`
        self.corrections: list[str] | None = None

    # ------------------------------------------------------------------ building

    def refresh(self, opt: BlockwiseOptimizer, device: torch.device | None = None) -> None:
        """Rebuild the tables and the problem over the blocks' parameters as ``opt`` holds them.

        Args:
            opt: the optimizer holding the blocks' parameters.
            device: the training device (default: the last one given; the CPU at first).

        Raises:
            ValueError: ``formats`` names a format of another update rule, or ``corrections`` are
                set where the weights are not 16-bit.
        """
        if device is not None:
            self.device = torch.device(device)
        cfg = self.config
        named = opt.named_params
        params = self.blocks.params
        registry = formats_of(opt.rule)
        # a sharded model (FSDP2) is budgeted per rank, on each tensor's largest shard (the most any rank
        # holds: met there, met on every rank), its formats decided on the whole tensor
        self.shapes = {b: [shard_shape(named[n]) for n in names] for b, names in params.items()}
        self.numel = {b: sum(math.prod(s) for s in shapes) for b, shapes in self.shapes.items()}
        foreign = [f for f in cfg.formats or () if f not in registry]
        if foreign:
            raise ValueError(
                f"BAOC(formats={list(cfg.formats)}): {foreign} are not formats of {RULE_NAMES[opt.rule]} "
                f"({type(opt).__name__}); its formats are {list(registry)}: name those"
            )
        wanted = list(cfg.formats) if cfg.formats is not None else list(registry)
        self.dtypes = dtypes = {b: [named[n].dtype for n in names] for b, names in params.items()}
        self.baseline = baseline_state_bytes(self.shapes, dtypes, opt.rule)  # torch's buffers, in each dtype
        # the corrections offered: the configured ones, or by default all where weights are 16-bit
        # (the optimizer's own: a group default it was built with; BAOC's choices are per parameter)
        own = any(g.get("weight_correction", "none") != "none" for g in opt.param_groups)
        self.corrections = corrections_menu(cfg.corrections, dtypes.values(), own)
        refused = corrections_refused(dtypes.values()) if cfg.corrections is not None else None
        if refused:
            raise ValueError(
                f"BAOC(corrections={list(cfg.corrections)}): {refused}: train the weights in bf16 (precision='bf16-true'), "
                f"or leave corrections unset"
            )
        self.problem = AllocationProblem(
            self.shapes,
            self.device,
            wanted,
            timed=cfg.time_budget is not None,
            costs="prior" if cfg.calibration == "prior" else "calibrate",
            min_8bit_numel=opt.min_8bit_numel,
            baseline_bytes=self.baseline,
            cache_dir=cfg.calibration_cache_dir,
            rule=opt.rule,
            corrections=self.corrections,
            dtypes=dtypes,
        )

    # ------------------------------------------------------------------ the problem's tables

    def _built(self, what: str) -> AllocationProblem:
        if self.problem is None:
            raise RuntimeError(f"BlockTables.{what}: call refresh() first (the controller's install())")
        return self.problem

    @property
    def offered(self) -> list[str]:
        """The options offered to the solver: the menu less the withheld formats (empty before :meth:`refresh`)."""
        return self.problem.allowed if self.problem is not None else []

    @property
    def withheld(self) -> dict[str, str]:
        """Format -> why it is not offered on the training device (empty before :meth:`refresh`)."""
        return dict(self.problem.withheld) if self.problem is not None else {}

    @property
    def memory(self) -> dict[str, dict[str, int]]:
        """Block -> option -> state bytes (the problem's memory table)."""
        return self._built("memory").memory

    @property
    def fp32_bytes(self) -> int:
        """The ``fp32`` column's state bytes: 8 per trainable element (SGD's and Lion's: 4); 0 before :meth:`refresh`."""
        return self.problem.fp32_bytes if self.problem is not None else 0

    def time(self) -> dict[str, dict[str, float]]:
        """Block -> option -> step time (the problem's time table, priced once)."""
        return self._built("time").time()

    # ------------------------------------------------------------------ budgets and solving

    def budgets(self) -> tuple[Any, Any, int, float | None]:
        """(memory budget, time budget) as ``solve`` is handed them, and both in absolute units."""
        b = self._built("budgets").budgets(self.config.memory_budget, self.config.time_budget)
        return b.memory, b.time, b.memory_bytes, b.time_seconds

    def solve(self, risk: Table) -> Allocation:
        """The allocation of least total risk within the budgets over the offered options.

        Raises:
            BudgetInfeasibleError: no allocation meets the budgets; the message names the smallest
                feasible budget, the formats allowed and those withheld, and says nothing was converted.
        """
        cfg = self.config
        try:
            return self._built("solve").solve(risk, cfg.memory_budget, cfg.time_budget)
        except BudgetInfeasibleError as err:
            offered = ", ".join(self.offered)
            withheld = "".join(f"; {f} withheld: {why}" for f, why in self.withheld.items())
            raise with_message(
                err,
                f"BAOC(memory_budget={cfg.memory_budget!r}, time_budget={cfg.time_budget!r}): {err} (formats "
                f"allowed: {offered}{withheld}). No format was converted; the optimizer keeps its current formats.",
            ) from None

    def check_feasible(self) -> None:
        """Raise :class:`BudgetInfeasibleError` if no allocation meets the budgets.

        Feasibility depends on the memory and time tables only (not on the risk): a solve with
        every risk 0 answers it.
        """
        self.solve({b: {f: 0.0 for f in self.offered} for b in self.blocks.params})

    def time_of(self, formats: Mapping[str, str]) -> float:
        """The step time of an allocation (block -> option), in the time table's unit."""
        table = self.time()
        return float(sum(table[b][formats[b]] for b in self.blocks.params))

    def fits(self, formats: Mapping[str, str]) -> bool:
        """Whether an allocation (block -> option) meets the budgets as they are now; ``False`` when a
        block has no option in it (added since) or one no longer offered."""
        _, _, mb_bytes, tb_abs = self.budgets()
        memory, params = self.memory, self.blocks.params
        if any(formats.get(b) not in memory[b] for b in params):
            return False
        fits = sum(memory[b][formats[b]] for b in params) <= mb_bytes
        if fits and tb_abs is not None:
            table = self.time()
            fits = sum(table[b][formats[b]] for b in params) <= tb_abs
        return fits


__all__ = ["BlockTables"]
