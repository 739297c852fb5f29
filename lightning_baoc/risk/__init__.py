"""Risk: how much harm each state format would do to each block.

- :mod:`lightning_baoc.risk.model`: the risk model measured on a block's live Adam state
  (:func:`risk_details`, :func:`risk_table`); its derivation and validation are in the docs.
- :mod:`lightning_baoc.risk.prior`: the documented prior for blocks without state (planning a
  model, parameters that never stepped).
- :mod:`lightning_baoc.risk.start`: the risk the start allocation minimizes (the prior, or what
  ``initial`` gives), for the controller, ``lightning-baoc plan`` and ``lightning-baoc check``.
- :mod:`lightning_baoc.risk.momentum`: the risk of SGD's and Lion's momentum formats
  (:func:`momentum_risk_table`), measured on shadow moments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from lightning_baoc.risk.model import DEFAULT_HORIZON, DEFAULT_MAX_ELEMENTS, BlockRisk, risk_details, risk_table
from lightning_baoc.risk.momentum import momentum_risk_details, momentum_risk_table
from lightning_baoc.risk.prior import PRIOR_ATTENTION_NO_MOMENTUM, PRIOR_KIND_WEIGHT, PRIOR_RISK, block_kind, prior_risk
from lightning_baoc.risk.start import INITIAL_PREFERENCE, start_risk

if TYPE_CHECKING:
    from lightning_baoc.risk.shadow import ShadowMoments


def optimizer_risk_table(
    optimizer: torch.optim.Optimizer,
    blocks: Mapping[str, Sequence[str]],
    statistics: Mapping[str, Mapping[str, float]] | None,
    formats: Sequence[str] | None = None,
    horizon: int = DEFAULT_HORIZON,
    shadow: ShadowMoments | None = None,
    **sharding: bool,
) -> dict[str, dict[str, float]]:
    """Block -> format -> risk for the optimizer's own formats: :func:`risk_table` for a
    BlockwiseAdamW, :func:`momentum_risk_table` (measured on ``shadow``, which it needs) for a
    BlockwiseSGD or BlockwiseLion. The BAOC controller's risk model. ``sharding``: :func:`risk_details`'
    ``across_shards`` and ``scores_whole`` (AdamW's formats; the momentum formats score this rank's rows).

    Raises:
        ValueError: a BlockwiseSGD or BlockwiseLion without shadow moments.
    """
    if getattr(optimizer, "rule", "adamw") != "adamw":
        if shadow is None:
            raise ValueError(
                f"the risk of {type(optimizer).__name__}'s momentum formats is measured on shadow moments "
                f"(lightning_baoc.risk.shadow.ShadowMoments); pass shadow="
            )
        return momentum_risk_table(optimizer, blocks, shadow, formats=formats, horizon=horizon)
    return risk_table(optimizer, blocks, statistics, formats=formats, horizon=horizon, shadow=shadow, **sharding)  # type: ignore[arg-type]


__all__ = [
    "DEFAULT_HORIZON",
    "DEFAULT_MAX_ELEMENTS",
    "INITIAL_PREFERENCE",
    "PRIOR_ATTENTION_NO_MOMENTUM",
    "PRIOR_KIND_WEIGHT",
    "PRIOR_RISK",
    "BlockRisk",
    "block_kind",
    "momentum_risk_details",
    "momentum_risk_table",
    "optimizer_risk_table",
    "prior_risk",
    "risk_details",
    "risk_table",
    "start_risk",
]
