"""The BAOC controller over SGD and Lion: their momentum formats priced, risked and allocated.

``torch.optim.SGD`` is taken over as a BlockwiseSGD named ``SGD``; a BlockwiseSGD or BlockwiseLion is
kept. The budget refers to the user's own optimizer (one buffer per element), the risk is
:func:`~lightning_baoc.risk.momentum.momentum_risk_table` on the shadow moments, groups without
momentum hold nothing and stay out of the blocks, and errors name SGD's formats and fractions.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from support import controller_steps, one_thread  # noqa: F401  (one_thread: see there)
from torch import nn

from lightning_baoc import MOMENTUM_FORMATS, BlockwiseLion, BlockwiseSGD, BudgetInfeasibleError
from lightning_baoc.control.controller import BAOCConfig, BAOCController
from lightning_baoc.risk import optimizer_risk_table


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))


def _train(ctl: BAOCController, opt: torch.optim.Optimizer, model: nn.Module, steps: int, start: int = 0) -> list:
    gen = torch.Generator().manual_seed(start)

    def loss(step: int) -> torch.Tensor:
        x = torch.randn(32, 64, generator=gen)
        return nn.functional.cross_entropy(model(x), x[:, :4].argmax(1))

    return controller_steps(ctl, opt, loss, start, steps, before=True)


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_allocation_meets_the_budget_of_the_users_optimizer(rule: str) -> None:
    model = _model()
    if rule == "sgd":
        user: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        user = BlockwiseLion(model.named_parameters(), lr=1e-3)
    ctl = BAOCController(BAOCConfig(memory_budget=0.3, warmup_steps=12, sample_every=4))
    opt = ctl.install(user, model)
    if rule == "sgd":
        assert isinstance(opt, BlockwiseSGD) and type(opt).__name__ == "SGD"
    else:
        assert opt is user
    # one fp32 buffer per element: the user's own SGD / Lion state
    assert ctl.baseline_state_bytes() == ctl.fp32_state_bytes() == 4 * _numel(model)
    assert ctl.problem.allowed == list(MOMENTUM_FORMATS)
    assert opt.state_bytes() == 0 and set(ctl.start_allocation.values()) <= set(MOMENTUM_FORMATS)
    events = _train(ctl, opt, model, 16)
    ctl.close()
    assert [e.reason for e in events] == ["warmup"] and events[0].step == 12
    event = events[0]
    assert event.optimizer == {"sgd": "SGD", "lion": "Lion"}[rule]
    assert opt.state_bytes() <= 0.3 * 4 * _numel(model) == pytest.approx(event.memory_budget_bytes, abs=1)
    assert sum(event.block_bytes.values()) == opt.state_bytes()
    # the measured risk: no buffer is the largest harm on every block, fp32 none
    for block, row in event.risk.items():
        assert set(row) == set(MOMENTUM_FORMATS) and row["fp32"] == 0.0
        assert row["none"] > row["int8"] >= 0.0 and row["none"] > row["bf16"], (block, row)
    assert "Lion" in ctl.summary_line() if rule == "lion" else "SGD" in ctl.summary_line()


def test_groups_without_momentum_hold_nothing_and_stay_out_of_the_blocks() -> None:
    model = _model()
    last = list(model[4].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in last)]
    user = torch.optim.SGD([{"params": rest, "momentum": 0.9}, {"params": last, "momentum": 0.0}], lr=0.05)
    ctl = BAOCController(BAOCConfig(memory_budget=0.5, warmup_steps=8, sample_every=2))
    opt = ctl.install(user, model)
    assert "4" not in ctl.block_params and set(ctl.block_params) == {"0", "2"}
    assert ctl.baseline_state_bytes() == 4 * sum(p.numel() for p in rest)
    events = _train(ctl, opt, model, 12)
    ctl.close()
    assert [e.reason for e in events] == ["warmup"]  # no growth loop from the momentum-free group
    assert {opt.formats()[opt.param_name(p)] for p in last} == {"none"}
    assert opt.state_bytes() <= 0.5 * ctl.baseline_state_bytes()


def test_sgd_without_momentum_is_refused_and_foreign_formats_are_named() -> None:
    model = _model()
    with pytest.raises(ValueError, match="without momentum.*nothing to allocate"):
        BAOCController(memory_budget=0.5).install(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match=r"\['nomomentum'\] are not formats of SGD.*\['fp32', 'bf16', 'int8', 'none'\]"):
        BAOCController(memory_budget=0.5, formats=["fp32", "nomomentum"]).install(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model
        )
    with pytest.raises(ValueError, match=r"\['none'\] are not formats of AdamW"):
        BAOCController(memory_budget=0.5, formats=["fp32", "none"]).install(torch.optim.AdamW(model.parameters()), model)


def test_infeasible_budget_names_the_fraction_of_the_sgd_state() -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.01, formats=["fp32", "bf16", "int8"])
    with pytest.raises(BudgetInfeasibleError) as info:
        ctl.install(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    message = str(info.value)
    assert "of fp32 SGD" in message and "AdamW" not in message
    # every block in int8 (the smallest offered), against SGD's 4 bytes per element
    assert info.value.min_memory == pytest.approx(sum(min(r.values()) for r in ctl.problem.memory.values()))
    assert info.value.min_memory / (4 * _numel(model)) > 0.25


def test_time_budget_prices_the_momentum_formats() -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.3, time_budget=1.2, calibration="prior", warmup_steps=8, sample_every=2)
    opt = ctl.install(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    time = ctl.problem.time()
    assert all(row["none"] < row["fp32"] <= row["int8"] for row in time.values())
    assert time["2"]["int8"] == pytest.approx(1.7 * 128 * 128 + 1.0 * 128)  # the 128-element bias stays fp32
    events = _train(ctl, opt, model, 10)
    ctl.close()
    assert events[0].time is not None and events[0].time <= 1.2 * ctl.problem.fp32_time * (1 + 1e-9)
    assert opt.state_bytes() <= 0.3 * ctl.baseline_state_bytes()


def test_resume_refuses_another_optimizers_allocation_and_the_named_sgd_pickles() -> None:
    model = _model()
    ctl = BAOCController(BAOCConfig(memory_budget=0.5, warmup_steps=8, sample_every=2))
    opt = ctl.install(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    _train(ctl, opt, model, 10)
    state = ctl.state_dict()
    ctl.close()
    assert state["rule"] == "sgd" and state["phase"] == "allocated"
    other = BAOCController(BAOCConfig(memory_budget=0.5, warmup_steps=8, sample_every=2))
    other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"holds sgd formats and the optimizer is AdamW"):
        other.install(torch.optim.AdamW(model.parameters()), model)
    # a state saved before any install names no rule: it loads into any optimizer
    blank = BAOCController(BAOCConfig(memory_budget=0.5)).state_dict()
    assert blank["rule"] is None
    fresh = BAOCController(BAOCConfig(memory_budget=0.5))
    fresh.load_state_dict(blank)
    fresh.install(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    assert fresh.phase == "warmup"
    fresh.close()
    copy = pickle.loads(pickle.dumps(opt))
    assert type(copy) is type(opt) and type(copy).__name__ == "SGD" and copy.formats() == opt.formats()


def test_sgd_subclass_overriding_step_warns_and_the_risk_needs_shadow_moments() -> None:
    class MySGD(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def, override]
            return super().step(closure)

    model = _model()
    with pytest.warns(UserWarning, match="MySGD overrides step"):
        opt = BAOCController(memory_budget=0.5).install(MySGD(model.parameters(), lr=0.1, momentum=0.9), model)
    assert type(opt).__name__ == "SGD" and isinstance(opt, BlockwiseSGD)  # named like the torch class it derives from
    with pytest.raises(ValueError, match="measured on shadow moments"):
        optimizer_risk_table(opt, {"0": ["0.weight"]}, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # no gradients: nothing to do, nothing said
