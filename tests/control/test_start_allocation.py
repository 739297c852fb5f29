"""The start allocation (``lightning_baoc.control.start.StartAllocation``), alone: the warm-up starts
within the budgets, ``initial`` is kept where they allow, and budgets change in place or are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_baoc import BlockwiseAdamW, BudgetInfeasibleError
from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.control.blocks import Blocks
from lightning_baoc.control.instrumentation import Instrumentation
from lightning_baoc.control.options import Options
from lightning_baoc.control.start import StartAllocation
from lightning_baoc.control.tables import BlockTables


def _model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)).to(dtype)


def _start(model: nn.Module, device: str = "cpu", **settings: Any) -> tuple[StartAllocation, BlockwiseAdamW]:
    opt = BlockwiseAdamW(model.parameters(), lr=1e-3)
    config = BAOCConfig(**{"memory_budget": 0.5, "calibration": "prior", **settings})
    blocks = Blocks(config)
    blocks.build(opt, model)
    tables = BlockTables(config, blocks)
    tables.refresh(opt, torch.device(device))
    return StartAllocation(config, blocks, tables, Options(config, blocks, tables, Instrumentation(config, blocks, tables))), opt


def _held(start: StartAllocation) -> int:
    assert start.formats is not None
    return sum(start.tables.memory[b][f] for b, f in start.formats.items())


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_the_start_is_the_least_prior_risk_within_the_budget_and_the_optimizer_asks_for_it(budget: float) -> None:
    model = _model()
    start, opt = _start(model, memory_budget=budget)
    assert start.formats is None
    start.apply(opt, model)
    assert _held(start) <= budget * start.tables.baseline
    assert start.options.current(opt) == start.formats
    risk = start.risk(model)
    assert set(risk) == set(start.blocks.params) and all(set(row) == set(start.tables.offered) for row in risk.values())


def test_an_initial_mapping_is_kept_where_the_budget_allows() -> None:
    model = _model()
    initial = {"0": "bf16", "2": "int8", "4": "fp32"}
    start, opt = _start(model, memory_budget=0.9, initial=initial)
    start.apply(opt, model)
    assert start.formats == initial
    start, opt = _start(model, memory_budget=0.2, initial=initial)  # too little for it: the budget wins
    start.apply(opt, model)
    assert start.formats != initial and _held(start) <= 0.2 * start.tables.baseline


def test_two_byte_parameters_warm_up_in_bf16_state() -> None:
    model = _model(torch.bfloat16)
    start, opt = _start(model)
    start.warmup_formats(opt)
    named = opt.named_params
    assert {opt.requested_format(named[n]) for n in start.blocks.names()} == {"bf16"}
    fp32_model = _model()
    start, opt = _start(fp32_model)
    start.warmup_formats(opt)  # 4-byte parameters: fp32, as asked
    assert {opt.requested_format(p) for p in opt.named_params.values()} == {"fp32"}


def test_a_budget_changed_before_install_only_changes_the_settings() -> None:
    model = _model()
    start, _ = _start(model)
    start.set_budget(memory_budget="30%", time_budget=2)
    assert (start.config.memory_budget, start.config.time_budget) == ("30%", 2)
    start.set_budget()  # None keeps both
    assert (start.config.memory_budget, start.config.time_budget) == ("30%", 2)
    with pytest.raises(ValueError):
        start.set_budget(memory_budget="a lot")
    assert start.config.memory_budget == "30%"


def test_a_budget_changed_during_warmup_moves_the_start_or_is_refused_as_it_was() -> None:
    model = _model()
    start, opt = _start(model, formats=["fp32", "bf16", "int8"])
    start.apply(opt, model)
    start.set_budget(memory_budget=0.3, opt=opt, module=model)
    assert start.config.memory_budget == 0.3 and _held(start) <= 0.3 * start.tables.baseline
    before = dict(start.formats or {})
    with pytest.raises(BudgetInfeasibleError, match="smallest feasible"):
        start.set_budget(memory_budget=0.05, opt=opt, module=model)  # below int8 everywhere
    assert start.config.memory_budget == 0.3 and start.formats == before
