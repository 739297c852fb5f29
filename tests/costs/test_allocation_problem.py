"""One allocation problem (``lightning_baoc.costs.AllocationProblem``) for the training controller,
``lightning-baoc check`` and ``lightning-baoc plan``: the same allocation and the same infeasibility
minimum for one model and budget, on the CPU's memory table and on a CUDA-shaped one."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import lightning_baoc.control.controller as controller_module
from lightning_baoc.config.files import parse_config
from lightning_baoc.control.controller import BAOCController
from lightning_baoc.costs import AllocationProblem
from lightning_baoc.costs.options import split_option
from lightning_baoc.solver import BudgetInfeasibleError
from lightning_baoc.tools.check import run_checks
from lightning_baoc.tools.plan import plan


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


def test_a_time_budget_prices_each_correction_on_the_16_bit_weights() -> None:
    """An option's step time is its format's plus its correction's per element of the block's bf16
    and fp16 tensors (fp32 tensors hold none); a time budget then trades corrections for time."""
    shapes = {"a": [(64, 64), (64,)], "b": [(64, 64)]}
    dtypes = {"a": [torch.bfloat16, torch.float32], "b": [torch.bfloat16]}
    costs = {"fp32": 1.0, "int8": 2.0, "+ecc8": 0.5, "+ecc16": 0.75}
    problem = AllocationProblem(shapes, "cpu", ["fp32", "int8"], timed=True, costs=costs, corrections=["none", "ecc8", "ecc16"],
                                dtypes=dtypes)
    table = problem.time()
    assert table["a"]["int8"] == 64 * 64 * 2.0 + 64 * 1.0  # the bias falls back to fp32 (min_8bit_numel)
    assert table["a"]["int8+ecc8"] == table["a"]["int8"] + 64 * 64 * 0.5  # the fp32 bias holds no correction
    assert table["b"]["fp32+ecc16"] == 64 * 64 * (1.0 + 0.75)
    assert set(problem.allowed) <= set(table["a"])
    # the corrections lower the risk; with room for them in memory but no time, the solver drops them
    risk = {b: {o: {"none": 1.0, "ecc8": 0.1, "ecc16": 0.05}[split_option(o)[1]] + (0.2 if o.startswith("int8") else 0.0)
                for o in problem.allowed} for b in shapes}
    assert all("+ecc" in o for o in problem.solve(risk, memory_budget=10**9).formats.values())
    assert all("+" not in o for o in problem.solve(risk, memory_budget=10**9, time_budget=1.0).formats.values())
    some = problem.solve(risk, memory_budget=10**9, time_budget=1.3)  # time for one block's correction
    assert sum("+ecc" in o for o in some.formats.values()) == 1 and some.time <= 1.3 * problem.fp32_time
