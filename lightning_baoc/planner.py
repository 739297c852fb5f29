"""The old home of ``lightning-baoc plan``, kept so existing imports work.

The planner now lives in :mod:`lightning_baoc.tools.plan`, its models in
:mod:`lightning_baoc.tools.presets` and the risk prior in :mod:`lightning_baoc.risk.prior`.
"""

from __future__ import annotations

from .risk.prior import PRIOR_ATTENTION_NO_MOMENTUM, PRIOR_KIND_WEIGHT, PRIOR_RISK, block_kind, prior_risk
from .tools.plan import FormatFigure, Plan, PlannedAllocation, load_statistics, plan, render
from .tools.presets import PRESETS, Decoder, DecoderConfig, DecoderLayer, ViT, ViTBlock, build_model

__all__ = [
    "PRESETS",
    "PRIOR_ATTENTION_NO_MOMENTUM",
    "PRIOR_KIND_WEIGHT",
    "PRIOR_RISK",
    "Decoder",
    "DecoderConfig",
    "DecoderLayer",
    "FormatFigure",
    "Plan",
    "PlannedAllocation",
    "ViT",
    "ViTBlock",
    "block_kind",
    "build_model",
    "load_statistics",
    "plan",
    "prior_risk",
    "render",
]
