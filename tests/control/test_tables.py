"""The blocks' tables and problem (``lightning_baoc.control.tables.BlockTables``), alone: sizes and the
user's baseline, the formats offered on a device, solving under the budgets as they are at the call."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from lightning_baoc import BlockwiseAdamW, BlockwiseSGD, BudgetInfeasibleError
from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.control.blocks import Blocks
from lightning_baoc.control.tables import BlockTables
from lightning_baoc.costs.calibration import OFFLOAD_NEEDS_TIME_BUDGET, memory_table


def _model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).to(dtype)


def _tables(model: nn.Module, opt: torch.optim.Optimizer | None = None, device: str = "cpu", **settings: object) -> BlockTables:
    config = BAOCConfig(**{"memory_budget": 0.5, "calibration": "prior", **settings})  # type: ignore[arg-type]
    opt = opt if opt is not None else BlockwiseAdamW(model.parameters())
    blocks = Blocks(config)
    blocks.build(opt, model)  # type: ignore[arg-type]
    tables = BlockTables(config, blocks)
    tables.refresh(opt, torch.device(device))  # type: ignore[arg-type]
    return tables


def test_before_refresh_the_tables_are_empty_and_the_problem_is_asked_for() -> None:
    config = BAOCConfig(memory_budget=0.5)
    tables = BlockTables(config, Blocks(config))
    assert tables.offered == [] and tables.withheld == {} and tables.fp32_bytes == 0 and tables.baseline == 0
    with pytest.raises(RuntimeError, match=r"BlockTables.solve: call refresh\(\) first"):
        tables.solve({})


def test_sizes_baseline_and_memory_table_of_the_blocks() -> None:
    model = _model()
    tables = _tables(model)
    assert tables.shapes == {"0": [(128, 64), (128,)], "2": [(10, 128), (10,)]}
    assert tables.numel == {"0": 128 * 65, "2": 10 * 129}
    assert tables.baseline == tables.fp32_bytes == 8 * (128 * 65 + 10 * 129)
    assert tables.memory == memory_table(tables.shapes, "cpu", sorted(tables.offered))
    # bf16 weights: torch's AdamW holds bf16 moments, 4 bytes per element: the baseline is half fp32's
    half = _tables(_model(torch.bfloat16))
    assert half.dtypes["0"] == [torch.bfloat16, torch.bfloat16] and 2 * half.baseline == half.fp32_bytes
    # SGD with momentum: one buffer, 4 bytes per fp32 element
    model = _model()
    sgd = _tables(model, BlockwiseSGD(model.parameters(), lr=0.1, momentum=0.9))
    assert sgd.baseline == sgd.fp32_bytes == 4 * (128 * 65 + 10 * 129)


def test_formats_offered_on_the_device() -> None:
    model = _model()
    assert "offload" not in _tables(model).offered  # the CPU: host memory is the device's
    cuda = _tables(model, device="cuda")
    assert cuda.withheld == {"offload": OFFLOAD_NEEDS_TIME_BUDGET} and "offload" not in cuda.offered
    assert "offload" in _tables(model, device="cuda", time_budget=30).offered
    assert _tables(model, formats=["fp32", "int8"]).offered == ["fp32", "int8"]


def test_settings_the_update_rule_or_weights_cannot_take_are_refused_naming_them() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"BAOC\(formats=\['fp32', 'none'\]\): \['none'\] are not formats of AdamW"):
        _tables(model, formats=["fp32", "none"])
    with pytest.raises(ValueError, match=r"BAOC\(corrections=\['ecc8'\]\).*precision='bf16-true'"):
        _tables(model, corrections=["ecc8"])


def test_solve_reads_the_budgets_at_the_call() -> None:
    model = _model()
    tables = _tables(model, formats=["fp32", "bf16", "int8"])
    zero = {b: {f: 0.0 for f in tables.offered} for b in tables.numel}
    for budget in (0.5, 0.35):
        tables.config.memory_budget = budget  # as set_budget changes it
        alloc = tables.solve(zero)
        assert sum(tables.memory[b][f] for b, f in alloc.formats.items()) <= budget * tables.baseline
        assert tables.budgets()[2] == int(budget * tables.baseline)
        assert tables.fits(alloc.formats)
    assert not tables.fits({"0": "fp32", "2": "fp32"}) and not tables.fits({"0": "int8"})  # over; a block without one
    tables.check_feasible()
    tables.config.memory_budget = 0.1
    with pytest.raises(BudgetInfeasibleError) as info:
        tables.check_feasible()
    message = str(info.value)
    assert "BAOC(memory_budget=0.1, time_budget=None)" in message and "smallest feasible" in message
    assert "formats allowed: fp32, bf16, int8" in message and "No format was converted" in message


def test_time_of_an_allocation_and_the_time_budget() -> None:
    model = _model()
    tables = _tables(model, formats=["fp32", "int8"], time_budget=1.5)
    fp32 = {b: "fp32" for b in tables.numel}
    assert tables.time_of(fp32) == pytest.approx(tables.problem.fp32_time)  # type: ignore[union-attr]
    assert tables.budgets()[3] == pytest.approx(1.5 * tables.problem.fp32_time)  # type: ignore[union-attr]
    tables.config.memory_budget = 1.0
    assert tables.fits(fp32)
