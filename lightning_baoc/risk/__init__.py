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

from .model import DEFAULT_HORIZON, DEFAULT_MAX_ELEMENTS, BlockRisk, risk_details, risk_table
from .momentum import momentum_risk_details, momentum_risk_table
from .prior import PRIOR_ATTENTION_NO_MOMENTUM, PRIOR_KIND_WEIGHT, PRIOR_RISK, block_kind, prior_risk
from .start import INITIAL_PREFERENCE, start_risk

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
    "prior_risk",
    "risk_details",
    "risk_table",
    "start_risk",
]
