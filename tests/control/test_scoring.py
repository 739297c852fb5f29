"""The controller's risk (``lightning_baoc.control.scoring.Scoring``), alone: the risk model called on the
sampled statistics, a user's risk model called as written, and the prior for blocks without state."""

from __future__ import annotations

from typing import Any

import torch
from support_control import instrumented
from torch import nn

from lightning_baoc import BlockwiseAdamW
from lightning_baoc.control.options import Options
from lightning_baoc.control.scoring import Scoring
from lightning_baoc.risk import optimizer_risk_table


class TwoLayers(nn.Module):
    """Two linear layers; the second is used only when asked (else it gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, both: bool = True) -> torch.Tensor:
        y = self.first(x)
        return self.second(y) if both else y


def _scoring(model: nn.Module, risk_fn: Any = None, **settings: Any) -> tuple[Scoring, BlockwiseAdamW]:
    opt = BlockwiseAdamW(model.parameters(), lr=1e-3)
    inst = instrumented(model, opt, **{"sample_every": 1, **settings})
    config, blocks, tables = inst.config, inst.blocks, inst.tables
    return Scoring(config, blocks, tables, inst, Options(config, blocks, tables, inst), risk_fn), opt


def _steps(scoring: Scoring, model: TwoLayers, opt: BlockwiseAdamW, steps: int, both: bool = True) -> None:
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step)), both).pow(2).mean().backward()
        scoring.instrumentation.observe(opt, step)
        opt.step()


def test_the_default_risk_model_scores_every_block_over_the_formats_offered() -> None:
    model = TwoLayers()
    scoring, opt = _scoring(model, formats=["fp32", "bf16", "int8"])
    assert scoring.risk_fn is optimizer_risk_table
    _steps(scoring, model, opt, 3)
    risk = scoring.risk(opt)
    assert set(risk) == {"first", "second"} and all(set(row) == {"fp32", "bf16", "int8"} for row in risk.values())
    assert risk["first"]["fp32"] == 0.0 and risk["first"]["bf16"] > 0  # (int8 falls back to fp32 on tensors this small)
    assert scoring.risk_across_shards(opt, is_global_zero=True) is None  # no parameter is sharded
    scoring.instrumentation.close()


def test_a_users_risk_model_is_called_as_written_and_can_be_replaced() -> None:
    calls: list[dict[str, Any]] = []

    def risk_fn(optimizer: Any, blocks: Any, statistics: Any, formats: Any = None, horizon: int = 0) -> Any:
        calls.append({"optimizer": optimizer, "blocks": blocks, "statistics": statistics, "formats": formats, "horizon": horizon})
        return {b: {f: 0.0 for f in formats} for b in blocks}

    model = TwoLayers()
    scoring, opt = _scoring(model, risk_fn, formats=["fp32", "int8"], horizon=123)
    _steps(scoring, model, opt, 3)
    stats = scoring.statistics()
    assert scoring.risk(opt, stats) == {"first": {"fp32": 0.0, "int8": 0.0}, "second": {"fp32": 0.0, "int8": 0.0}}
    (call,) = calls  # no shadow, no sharding arguments: the user's signature
    assert call["optimizer"] is opt and call["blocks"] == scoring.blocks.params
    assert call["statistics"] == stats and call["formats"] == ["fp32", "int8"] and call["horizon"] == 123
    assert scoring.risk_across_shards(opt, is_global_zero=True) is None  # a user's model: rank zero alone
    scoring.risk_fn = optimizer_risk_table
    assert set(scoring.risk(opt)["first"]) == {"fp32", "int8"} and len(calls) == 1  # the default model now
    scoring.instrumentation.close()


def test_the_prior_stands_in_for_blocks_whose_parameters_never_stepped() -> None:
    model = TwoLayers()
    scoring, opt = _scoring(model, formats=["fp32", "bf16", "int8"])
    assert set(scoring.prior_rows(opt, model)) == {"first", "second"}  # nothing stepped yet
    _steps(scoring, model, opt, 2, both=False)  # the second layer gets no gradient: no state
    rows = scoring.prior_rows(opt, model)
    assert list(rows) == ["second"] and set(rows["second"]) == {"fp32", "bf16", "int8"}
    assert rows["second"]["fp32"] == 0.0 and rows["second"]["bf16"] > 0
    assert list(scoring.prior_rows(opt, None)) == ["second"]  # without the model: no block kinds, same blocks
    _steps(scoring, model, opt, 1)
    assert scoring.prior_rows(opt, model) == {}
    scoring.instrumentation.close()


def test_with_corrections_the_prior_rows_are_over_the_options() -> None:
    model = TwoLayers().to(torch.bfloat16)
    scoring, opt = _scoring(model, formats=["bf16", "int8"], corrections=["none", "ecc8"])
    rows = scoring.prior_rows(opt, model)
    assert all(set(row) == {"bf16", "bf16+ecc8", "int8", "int8+ecc8"} for row in rows.values())
    scoring.instrumentation.close()
