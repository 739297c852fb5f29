"""The risk of the live state: the risk model on the sampled statistics, and the prior where no state is.

Rank zero decides the allocation from the risk table (:mod:`lightning_baoc.control.protocol`). A
parameter whose rows FSDP2 splits among ranks is held a part on each, and under DeepSpeed ZeRO every
parameter is a fragment on each rank (all of it, a run of it, or none: ``sharding.Piece``): there
every rank scores its own part with AdamW's risk model and the terms (sums over elements) are summed over the shards, so
the risk is the whole parameter's, as one process would score it (the factored formats' estimate
over the whole matrix's row and column means). That is a collective, run by every rank before the
decision (:meth:`Scoring.risk_across_shards`); without such parameters, or with a risk function of
the user's, rank zero scores everything alone.

A block with a parameter that never stepped has no state for the risk model to score (it would
see nothing to lose and score every format 0): the planner's prior stands in for it
(:meth:`Scoring.prior_rows`) until its state exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from torch import nn

from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.control.blocks import Blocks
from lightning_baoc.control.instrumentation import Instrumentation
from lightning_baoc.control.options import Options
from lightning_baoc.control.tables import BlockTables
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.optim.sharding import piece, splits_rows
from lightning_baoc.risk import optimizer_risk_table
from lightning_baoc.risk.prior import block_kind, prior_risk

#: ``risk_fn(optimizer, blocks, statistics, formats=..., horizon=...) -> block -> format -> risk``
RiskFn = Callable[..., Mapping[str, Mapping[str, float]]]


class Scoring:
    """The risk table of the blocks' live state, from the sampled statistics and the shadow moments.

    Args:
        config: the settings; reads ``horizon`` (the steps over which a format's harm is modelled).
        blocks: the partition scored.
        tables: the blocks' shapes (the prior's sizes).
        instrumentation: the sampler (statistics) and the shadow moments.
        options: the formats offered and the corrections' risk added to the formats'.
        risk_fn: the risk model, ``risk_fn(optimizer, blocks, statistics, formats=, horizon=)``
            (default: :func:`lightning_baoc.risk.optimizer_risk_table`, which also reads the shadow
            moments and scores a sharded model across its ranks; a user's risk model is called as
            written).

    Attributes:
        risk_fn: the risk model in use (it may be replaced between allocations).

    Example:
        >>> import torch
        >>> from lightning_baoc.control.controller import BAOCController
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        >>> controller = BAOCController(memory_budget=0.5, sample_every=1, calibration="prior")  # it builds the parts
        >>> opt = controller.install(torch.optim.AdamW(model.parameters()), model)
        >>> scoring, inst = controller.scoring, controller.instrumentation
        >>> sorted(scoring.prior_rows(opt, model))  # no parameter has stepped: the prior for every block
        ['0', '1']
        >>> for step in range(3):
        ...     model(torch.randn(4, 8)).sum().backward(); _ = inst.observe(opt, step); opt.step(); opt.zero_grad()
        >>> risk = scoring.risk(opt)
        >>> sorted(risk), risk["0"]["fp32"], scoring.prior_rows(opt, model)
        (['0', '1'], 0.0, {})
        >>> inst.close()
    """

    def __init__(
        self,
        config: BAOCConfig,
        blocks: Blocks,
        tables: BlockTables,
        instrumentation: Instrumentation,
        options: Options,
        risk_fn: RiskFn | None = None,
    ) -> None:
        self.risk_fn: RiskFn = risk_fn or optimizer_risk_table
        self.config = config
        self.blocks = blocks
        self.tables = tables
        self.instrumentation = instrumentation
        self.options = options

    def statistics(self) -> dict[str, dict[str, float]]:
        """The sampled per-block statistics (local: the samples are whole already)."""
        return self.instrumentation.statistics()

    def risk(
        self, opt: BlockwiseOptimizer, stats: dict[str, dict[str, float]] | None = None, **sharding: bool
    ) -> dict[str, dict[str, float]]:
        """The risk table of ``opt``'s live state on ``stats`` (default: the sampler's), over the
        state formats offered."""
        stats = self.statistics() if stats is None else stats
        extra: dict[str, Any] = {"shadow": self.instrumentation.shadow, **sharding} if self.risk_fn is optimizer_risk_table else {}
        return self.risk_fn(  # a user's risk_fn: as written
            opt, self.blocks.params, stats, formats=self.options.formats_offered(), horizon=self.config.horizon, **extra
        )

    def risk_across_shards(self, opt: BlockwiseOptimizer, is_global_zero: bool) -> dict[str, dict[str, float]] | None:
        """The risk table scored on every rank at once when parameters' rows are split among ranks
        (see the module); ``None`` otherwise (rank zero then scores alone)."""
        if self.risk_fn is not optimizer_risk_table or opt.rule != "adamw":
            return None
        named = opt.named_params
        if not any(splits_rows(named[n]) or piece(named[n]) is not None for n in self.blocks.names()):
            return None
        return self.risk(opt, across_shards=True, scores_whole=is_global_zero)

    def prior_rows(self, opt: BlockwiseOptimizer, module: nn.Module | None) -> dict[str, dict[str, float]]:
        """The planner's prior risk (:func:`lightning_baoc.risk.prior_risk`, shares over all the
        blocks) over the options, for the blocks with a parameter that never stepped."""
        fresh = [b for b, names in self.blocks.params.items() if any(opt.step_count(n) == 0 for n in names)]
        if not fresh:
            return {}
        module = module if module is not None else nn.Module()
        kinds = {b: block_kind(module, b) for b in fresh}
        table = prior_risk(self.tables.shapes, kinds, self.options.formats_offered(), opt.min_8bit_numel, opt.rule)
        return self.options.with_corrections(opt, {b: table[b] for b in fresh}, measured=False)


__all__ = ["RiskFn", "Scoring"]
