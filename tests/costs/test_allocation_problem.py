"""One allocation problem (``lightning_baoc.costs.AllocationProblem``) for the training controller,
``lightning-baoc check`` and ``lightning-baoc plan``: the same allocation and the same infeasibility
minimum for one model and budget, on the CPU's memory table and on a CUDA-shaped one."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import lightning_baoc.controller as controller_module
from lightning_baoc.check import run_checks
from lightning_baoc.config import parse_config
from lightning_baoc.controller import BAOCController
from lightning_baoc.costs import AllocationProblem
from lightning_baoc.planner import plan
from lightning_baoc.solver import BudgetInfeasibleError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.LayerNorm(256), nn.Linear(256, 10))


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The training device as the three see it: the controller's is patched to CUDA for "cuda"
    (CUDA's memory table: offload costs 0 device bytes, and its mask)."""
    if request.param == "cuda":
        monkeypatch.setattr(controller_module, "_training_device", lambda optimizer: torch.device("cuda"))
    return request.param


def _controller(budget: object, **kwargs: object) -> tuple[BAOCController, nn.Module]:
    model = _model()
    ctl = BAOCController(memory_budget=budget, warmup_steps=4, sample_every=2, **kwargs)
    ctl.install(torch.optim.AdamW(model.parameters()), model)
    return ctl, model


def test_controller_and_planner_allocate_alike(device: str) -> None:
    # a fresh model has no Adam state yet: the controller scores every block with the planner's prior
    ctl, model = _controller(0.3)
    event = ctl.allocate(0, "manual")
    planned = plan(model, [0.3], device=device).allocations[0]
    assert planned.allocation is not None
    assert event.formats == planned.allocation.formats
    assert set(event.formats.values()) - {"fp32"}  # a real allocation, not all fp32
    assert ctl.start_allocation == planned.allocation.formats  # the warm-up started in the plan
    assert ctl.problem.withheld == plan(model, [0.3], device=device).masked
    ctl.close()


def test_controller_check_and_planner_name_the_same_smallest_budget(device: str) -> None:
    budget = 0.01
    ctl, model = _controller(0.3)
    with pytest.raises(BudgetInfeasibleError) as info:
        ctl.problem.smallest(budget)
    from_controller = info.value.min_memory
    ctl.close()
    with pytest.raises(BudgetInfeasibleError) as info:
        _controller(budget)  # the controller's own path: install starts within the budget, or refuses
    assert info.value.min_memory == from_controller

    planned = plan(model, [budget], device=device).allocations[0]
    assert planned.allocation is None and planned.min_memory == from_controller

    config = parse_config({"baoc": {"memory_budget": budget}})
    result = {r.name: r for r in run_checks(config, model.to("meta"), device)}["memory budget"]
    assert not result.passed
    absolute = re.search(r"an absolute size >= (\d+) bytes", result.fix)
    assert absolute and int(absolute.group(1)) == int(from_controller)


def test_withheld_formats_and_tables_come_from_one_rule() -> None:
    shapes = {"a": [(256, 256)], "b": [(256,)]}
    on_gpu = AllocationProblem(shapes, "cuda", ["fp32", "int8", "offload"])
    timed = AllocationProblem(shapes, "cuda", ["fp32", "int8", "offload"], timed=True)
    on_cpu = AllocationProblem(shapes, "cpu", ["fp32", "int8", "offload"], timed=True)
    assert "offload" in on_gpu.withheld and on_gpu.allowed == ["fp32", "int8"]
    assert timed.allowed == ["fp32", "int8", "offload"] and timed.memory["a"]["offload"] == 0
    assert "offload" in on_cpu.withheld  # host memory is the device's memory there
    with pytest.raises(ValueError, match="all withheld"):
        AllocationProblem(shapes, "cpu", ["offload"])
    with pytest.raises(ValueError, match="absolute time.*prior"):
        timed.budgets(0.5, "20ms")
    assert timed.budgets(0.5, 1.2).time_seconds == pytest.approx(1.2 * timed.fp32_time)


def test_fractions_refer_to_the_users_baseline() -> None:
    shapes = {"a": [(256, 256)]}
    bf16 = AllocationProblem(shapes, "cpu", ["fp32", "bf16", "int8"], baseline_bytes=4 * 256 * 256)
    assert bf16.budgets(0.5).memory_bytes == 2 * 256 * 256
    with pytest.raises(BudgetInfeasibleError, match=r"as a fraction of the AdamW state on these parameters"):
        bf16.smallest(0.1)
