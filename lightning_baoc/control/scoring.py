"""The risk of the live state, scored on rank zero or, over a sharded model, on every rank.

Rank zero decides the allocation from the risk table (:mod:`lightning_baoc.control.protocol`). A
parameter whose rows FSDP2 splits among ranks is held a part on each: there every rank scores its
own rows with AdamW's risk model and the terms (sums over elements) are summed over the shards, so
the risk is the whole parameter's, as one process would score it (the factored formats' estimate
over the whole matrix's row and column means). That is a collective, run by every rank before the
decision (:meth:`ScoringMixin._risk_across_shards`); without such parameters, or with a risk
function of the user's, rank zero scores everything alone, as before.
"""

from __future__ import annotations

from typing import Any

from lightning_baoc.optim.sharding import splits_rows
from lightning_baoc.risk import optimizer_risk_table


class ScoringMixin:
    """The risk of the live state for :class:`~lightning_baoc.control.controller.BAOCController`."""

    # provided by the controller this is mixed into
    sampler: Any
    optimizer: Any
    shadow: Any
    risk_fn: Any
    config: Any
    block_params: dict[str, list[str]]
    _formats_offered: Any

    def _statistics(self) -> dict[str, dict[str, float]]:
        """The sampled per-block statistics (local: the samples are whole already)."""
        return {b: {k: float(v) for k, v in s.items()} for b, s in self.sampler.statistics().items()}

    def _risk(self, stats: dict[str, dict[str, float]] | None = None, **sharding: bool) -> dict[str, dict[str, float]]:
        """The risk table of the live state on ``stats`` (default: the sampler's)."""
        stats = self._statistics() if stats is None else stats
        extra: dict[str, Any] = {"shadow": self.shadow, **sharding} if self.risk_fn is optimizer_risk_table else {}
        return self.risk_fn(  # a user's risk_fn: as before
            self.optimizer, self.block_params, stats, formats=self._formats_offered(), horizon=self.config.horizon, **extra
        )

    def _risk_across_shards(self, is_global_zero: bool) -> dict[str, dict[str, float]] | None:
        """The risk table scored on every rank at once when parameters' rows are split among ranks
        (see the module); ``None`` otherwise (rank zero then scores alone)."""
        opt = self.optimizer
        if self.risk_fn is not optimizer_risk_table or opt.rule != "adamw":
            return None
        named = opt.named_params
        if not any(splits_rows(named[n]) for names in self.block_params.values() for n in names):
            return None
        return self._risk(across_shards=True, scores_whole=is_global_zero)


__all__ = ["ScoringMixin"]
