"""Edge cases of the framework-free controller: parameters added after install, the
offload rule on an accelerator, time budgets priced with the prior, optimizers that name their
parameters their own way, bf16 parameters, and checkpoints resumed under changed settings.

Every test drives :class:`~lightning_baoc.control.controller.BAOCController` with a plain PyTorch loop on
a small MLP; the Lightning-level counterparts are in ``tests/integrations/test_callback_edge_cases.py``.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from support import one_thread  # noqa: F401  (one intra-op thread: see there)
from torch import nn

from lightning_baoc import BlockwiseAdamW, BudgetInfeasibleError
from lightning_baoc.config.files import parse_config
from lightning_baoc.control import controller as controller_module
from lightning_baoc.control.controller import BAOCConfig, BAOCController
from lightning_baoc.costs.calibration import OFFLOAD_NEEDS_TIME_BUDGET, hardware_mask, withheld_formats
from lightning_baoc.risk.prior import block_kind, prior_risk
from lightning_baoc.tools.check import run_checks
from lightning_baoc.tools.plan import plan

WARMUP, EVERY = 12, 4


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


def _batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 64, generator=g)
    return x.to(dtype), (x[:, :10] * 3).argmax(dim=1)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x, y = _batch(step, dtype)
    return nn.functional.cross_entropy(model(x).float(), y)


def _train(
    ctl: BAOCController, model: nn.Module, opt: torch.optim.Optimizer, start: int, steps: int, probe: Any = None
) -> list[Any]:
    """Steps ``start ..``: before_step and observe before each step, maybe_allocate after it;
    ``probe(step)`` after each step."""
    events = []
    for step in range(start, start + steps):
        opt.zero_grad()
        _loss(model, step).backward()
        event = ctl.before_step(step)
        events += [event] if event is not None else []
        ctl.observe(step)
        opt.step()
        event = ctl.maybe_allocate(step + 1)
        events += [event] if event is not None else []
        if probe is not None:
            probe(step)
    return events


def _trained_numel(opt: torch.optim.Optimizer) -> int:
    return sum(p.numel() for g in opt.param_groups for p in g["params"] if p.requires_grad)


# ---------------------------------------------------------------------------- 2: parameters added later


def test_param_group_added_after_allocation_is_allocated_at_once_within_the_budget() -> None:
    model = _model()
    # the first layer is trained later: it is outside the optimizer at install
    opt = torch.optim.AdamW([*model[2].parameters(), *model[4].parameters()], lr=2e-3)
    ctl = BAOCController(memory_budget=0.3, warmup_steps=WARMUP, sample_every=EVERY)
    opt = ctl.install(opt, model)
    (first,) = _train(ctl, model, opt, 0, WARMUP)
    assert first.reason == "warmup" and set(ctl.block_params) == {"2", "4"}
    opt.add_param_group({"params": list(model[0].parameters()), "lr": 1e-3})
    checked: list[int] = []

    def within_budget(step: int) -> None:
        # the budget is a fraction of the AdamW state of every parameter trained now
        assert opt.state_bytes() <= 0.3 * 8 * _trained_numel(opt), step
        checked.append(step)

    events = _train(ctl, model, opt, WARMUP, 6, within_budget)
    assert [e.reason for e in events] == ["params"] and events[0].step == WARMUP
    assert set(ctl.block_params) == {"0", "2", "4"} and ctl.block_params["0"] == ["0.weight", "0.bias"]
    assert ctl.fp32_state_bytes() == 8 * sum(p.numel() for p in model.parameters())
    assert events[0].memory_budget_bytes == int(0.3 * ctl.fp32_state_bytes())
    assert len(checked) == 6 and all(opt.step_count(n) == 6 for n in ctl.block_params["0"])
    # the new block had no state to score: its risks are the planner's prior
    shapes = {b: [tuple(p.shape) for p in model[int(b)].parameters()] for b in ctl.block_params}
    prior = prior_risk(shapes, {b: block_kind(model, b) for b in shapes}, list(events[0].risk["0"]))
    assert events[0].risk["0"] == pytest.approx(prior["0"])
    assert ctl.sampler is not None and set(ctl.sampler.statistics()) == {"0", "2", "4"}
    ctl.close()


def test_param_group_added_during_warmup_joins_the_blocks_and_the_first_allocation() -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.3, warmup_steps=WARMUP, sample_every=EVERY)
    opt = ctl.install(torch.optim.AdamW(model[4].parameters(), lr=2e-3), model)
    assert _train(ctl, model, opt, 0, 4) == []
    opt.add_param_group({"params": [*model[0].parameters(), *model[2].parameters()]})
    (event,) = _train(ctl, model, opt, 4, WARMUP)
    assert event.reason == "warmup" and set(event.formats) == {"0", "2", "4"}
    assert opt.state_bytes() <= 0.3 * 8 * sum(p.numel() for p in model.parameters())
    ctl.close()


def test_unfrozen_parameter_already_held_is_taken_into_the_allocation() -> None:
    model = _model()
    model[0].requires_grad_(False)  # held by the optimizer, frozen: no state, no block
    ctl = BAOCController(memory_budget=0.3, warmup_steps=WARMUP, sample_every=EVERY)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=2e-3), model)
    assert "0" not in ctl.block_params
    _train(ctl, model, opt, 0, WARMUP)
    model[0].requires_grad_(True)
    events = _train(ctl, model, opt, WARMUP, 3)
    assert [e.reason for e in events] == ["params"] and "0" in ctl.block_params
    assert opt.state_bytes() <= 0.3 * 8 * sum(p.numel() for p in model.parameters())
    ctl.close()


def test_frozen_group_added_then_unfrozen_is_taken_into_the_allocation() -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.3, warmup_steps=WARMUP, sample_every=EVERY)
    opt = ctl.install(torch.optim.AdamW(model[4].parameters(), lr=2e-3), model)
    _train(ctl, model, opt, 0, WARMUP)
    model[0].requires_grad_(False)
    opt.add_param_group({"params": list(model[0].parameters())})  # frozen when added: nothing to manage
    assert _train(ctl, model, opt, WARMUP, 1) == [] and "0" not in ctl.block_params
    model[0].requires_grad_(True)
    (event,) = _train(ctl, model, opt, WARMUP + 1, 1)
    assert event.reason == "params" and "0" in ctl.block_params
    assert opt.state_bytes() <= 0.3 * 8 * _trained_numel(opt)
    ctl.close()


def test_added_parameters_that_break_an_absolute_budget_raise_naming_the_smallest() -> None:
    model = _model()
    opt = torch.optim.AdamW(model[4].parameters(), lr=2e-3)
    budget = 8 * sum(p.numel() for p in model[4].parameters())  # fp32 state of the head only
    ctl = BAOCController(memory_budget=budget, warmup_steps=WARMUP, sample_every=EVERY, formats=["fp32", "bf16"])
    opt = ctl.install(opt, model)
    ctl.check_feasible()
    _train(ctl, model, opt, 0, WARMUP)
    opt.add_param_group({"params": list(model[0].parameters())})
    with pytest.raises(BudgetInfeasibleError, match="smallest feasible") as info:
        _train(ctl, model, opt, WARMUP, 1)
    assert info.value.min_memory is not None and info.value.min_memory > budget
    assert all(opt.step_count(n) == 0 for n in ("0.weight", "0.bias"))  # raised before the step
    ctl.close()


def test_parameters_put_into_param_groups_directly_are_refused_naming_the_fix() -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.3, warmup_steps=WARMUP, sample_every=EVERY)
    opt = ctl.install(torch.optim.AdamW(model[4].parameters(), lr=2e-3), model)
    _train(ctl, model, opt, 0, 2)
    opt.param_groups.append({**opt.param_groups[0], "params": list(model[0].parameters())})
    with pytest.raises(ValueError, match=r"2 parameter\(s\) were put into optimizer.param_groups without add_param_group"):
        _train(ctl, model, opt, 2, 1)
    ctl.close()


# ---------------------------------------------------------------------------- 8: offload on an accelerator


@pytest.fixture
def cuda_shaped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller sees a CUDA device: CUDA's memory table (offload: 0 device bytes) and mask."""
    monkeypatch.setattr(controller_module, "_training_device", lambda optimizer: torch.device("cuda"))


def test_controller_on_an_accelerator_withholds_offload_without_a_time_budget(cuda_shaped: None) -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.3, warmup_steps=WARMUP, sample_every=EVERY)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=2e-3), model)
    assert ctl.tables.device.type == "cuda" and hardware_mask(ctl.tables.device) == {}  # CUDA's mask: offload is served
    assert ctl.tables.withheld == {"offload": OFFLOAD_NEEDS_TIME_BUDGET} and "offload" not in ctl.tables.offered
    (event,) = _train(ctl, model, opt, 0, WARMUP)
    assert "offload" not in event.formats.values() and "offload" not in opt.formats().values()
    assert opt.state_bytes() <= 0.3 * ctl.fp32_state_bytes()
    ctl.close()


def test_controller_on_an_accelerator_offers_offload_with_a_time_budget(cuda_shaped: None) -> None:
    model = _model()
    # below what every other format can reach: only offload (0 device bytes, 20x the step) fits
    ctl = BAOCController(
        memory_budget=0.004, time_budget=30, calibration="prior", warmup_steps=WARMUP, sample_every=EVERY
    )
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=2e-3), model)
    assert "offload" in ctl.tables.offered and ctl.tables.withheld == {}
    (event,) = _train(ctl, model, opt, 0, WARMUP)
    assert "offload" in event.formats.values()
    ctl.close()


def test_one_offload_rule_for_controller_check_and_plan() -> None:
    assert withheld_formats("cuda", time_budget=False) == {"offload": OFFLOAD_NEEDS_TIME_BUDGET}
    assert withheld_formats("cuda", time_budget=True) == {}
    assert withheld_formats("cuda", time_budget=False, menu=["fp32", "int8"]) == {}
    assert withheld_formats("cpu", time_budget=True) == hardware_mask("cpu")  # offload saves nothing there
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).to("meta")
    # plan: the same reason, whatever the budgets
    assert plan(model, [0.3], device="cuda").masked["offload"] == OFFLOAD_NEEDS_TIME_BUDGET
    assert "offload" not in plan(model, [0.3], device="cuda", time_budget=30).masked
    # check: a budget only offload could meet fails without a time budget and passes with one
    base = {"memory_budget": 0.004, "formats": ["fp32", "factored", "offload"]}
    without = {r.name: r for r in run_checks(parse_config({"baoc": base}), model, "cuda")}["memory budget"]
    assert without.status == "FAIL" and "offload withheld" in without.detail
    timed = parse_config({"baoc": {**base, "time_budget": 30, "calibration": "prior"}})
    assert {r.name: r for r in run_checks(timed, model, "cuda")}["memory budget"].status == "PASS"


# ---------------------------------------------------------------------------- 10: absolute time, prior costs


@pytest.mark.parametrize("time_budget", ["20ms", "100000s", "1.5s"])
def test_absolute_time_budget_with_prior_costs_is_refused_at_construction(time_budget: str) -> None:
    with pytest.raises(ValueError, match=rf"time_budget='{time_budget}': it is an absolute time.*prior.*no unit.*time_budget=1\.2.*calibration='auto'"):
        BAOCConfig(memory_budget=0.3, time_budget=time_budget, calibration="prior")


def test_relative_time_budget_with_prior_and_absolute_with_auto_are_accepted() -> None:
    assert BAOCConfig(memory_budget=0.3, time_budget=1.2, calibration="prior").time_budget == 1.2
    assert BAOCConfig(memory_budget=0.3, time_budget="1.2x", calibration="prior").time_budget == "1.2x"
    assert BAOCConfig(memory_budget=0.3, time_budget="20ms", calibration="auto").time_budget == "20ms"


# ---------------------------------------------------------------------------- 12: the optimizer's own names


@pytest.mark.parametrize("form", ["positional", "submodule-named"])
def test_blocks_match_parameters_by_identity_not_by_the_optimizers_names(form: str) -> None:
    holder = nn.Module()
    holder.net = _model()
    if form == "positional":
        opt = BlockwiseAdamW(holder.parameters(), lr=2e-3)  # names "0", "1", ...
    else:
        opt = torch.optim.AdamW(holder.net.named_parameters(), lr=2e-3)  # names without "net."
    ctl = BAOCController(memory_budget=0.3, warmup_steps=WARMUP, sample_every=EVERY)
    opt = ctl.install(opt, holder)
    assert list(ctl.block_params) == ["net.0", "net.2", "net.4"]
    (event,) = _train(ctl, holder.net, opt, 0, WARMUP)
    assert opt.state_bytes() <= 0.3 * ctl.fp32_state_bytes() and event.reason == "warmup"
    assert event.block_params["net.0"] == ["net.0.weight", "net.0.bias"]  # reported in the model's names
    ctl.close()


# ---------------------------------------------------------------------------- 13: bf16 parameters


def _adamw_moment_bytes(model: nn.Module) -> int:
    """Bytes of torch AdamW's moments on ``model`` after one real step."""
    twin = copy.deepcopy(model)
    ref = torch.optim.AdamW(twin.parameters(), lr=2e-3)
    _loss(twin, 0).backward()
    ref.step()
    return sum(t.nbytes for s in ref.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq"))


def test_bf16_parameters_warm_up_in_no_more_than_adamw_and_budget_is_against_it() -> None:
    model = _model().to(torch.bfloat16)
    adamw_bytes = _adamw_moment_bytes(model)
    assert adamw_bytes == 4 * sum(p.numel() for p in model.parameters())
    ctl = BAOCController(memory_budget=0.5, warmup_steps=WARMUP, sample_every=EVERY)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=2e-3), model)
    assert ctl.baseline_state_bytes() == adamw_bytes and ctl.fp32_state_bytes() == 2 * adamw_bytes
    warmup: list[int] = []
    events = _train(ctl, model, opt, 0, WARMUP - 1, lambda step: warmup.append(opt.state_bytes()))
    assert events == [] and len(warmup) == WARMUP - 1 and max(warmup) <= adamw_bytes
    (event,) = _train(ctl, model, opt, WARMUP - 1, 1)
    assert event.memory_budget_bytes == int(0.5 * adamw_bytes) and opt.state_bytes() <= 0.5 * adamw_bytes
    assert event.saved_fraction == pytest.approx(1 - event.state_bytes / adamw_bytes)
    ctl.close()


# ---------------------------------------------------------------------------- 3: settings changed at resume


def _checkpoint(**settings: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """An allocated controller's state and its optimizer's, saved and loaded with weights_only."""
    model = _model()
    ctl = BAOCController(**{"memory_budget": 0.3, "warmup_steps": WARMUP, "sample_every": EVERY, **settings})
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=2e-3), model)
    _train(ctl, model, opt, 0, WARMUP)
    buffer = io.BytesIO()
    torch.save({"baoc": ctl.state_dict(), "optimizer": opt.state_dict(), "model": model.state_dict()}, buffer)
    buffer.seek(0)
    formats = dict(ctl.allocation)
    ctl.close()
    return torch.load(buffer, weights_only=True), formats


def _resume(saved: dict[str, Any], model: nn.Module | None = None, **settings: Any) -> tuple[BAOCController, Any, nn.Module]:
    model = model or _model()
    model.load_state_dict(saved["model"])
    ctl = BAOCController(**{"memory_budget": 0.3, "warmup_steps": WARMUP, "sample_every": EVERY, **settings})
    ctl.load_state_dict(saved["baoc"])  # before install, as Lightning does
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=2e-3), model)
    opt.load_state_dict(saved["optimizer"])
    return ctl, opt, model


def test_resume_with_a_format_dropped_from_the_menu_reallocates_before_the_first_step() -> None:
    saved, formats = _checkpoint()
    used = sorted(set(formats.values()) - {"fp32"})
    assert used
    menu = [f for f in ("fp32", "bf16_momentum", "bf16", "nomomentum", "int8", "int8_factored", "factored") if f not in used]
    ctl, opt, model = _resume(saved, formats=menu)
    assert ctl.pending == "settings" and set(opt.formats().values()) & set(used)  # as loaded
    seen: list[set[str]] = []
    original = opt.step

    def step(*args: Any, **kwargs: Any) -> Any:
        seen.append(set(opt.formats().values()))
        return original(*args, **kwargs)

    opt.step = step  # type: ignore[method-assign]
    events = _train(ctl, model, opt, WARMUP, 2)
    assert [e.reason for e in events] == ["settings"] and events[0].step == WARMUP
    assert seen and all(s <= set(menu) for s in seen) and set(ctl.allocation.values()) <= set(menu)
    assert opt.state_bytes() <= 0.3 * ctl.fp32_state_bytes()
    ctl.close()


def test_resume_of_a_state_without_saved_settings_still_never_steps_in_a_format_not_offered() -> None:
    saved, formats = _checkpoint()
    del saved["baoc"]["settings"]  # a state written before the settings were saved
    used = set(formats.values()) - {"fp32"}
    menu = ["fp32", "bf16", "factored", "nomomentum"]
    assert used and not used & set(menu)
    ctl, opt, model = _resume(saved, formats=menu)
    assert ctl.pending == "settings"
    (event,) = _train(ctl, model, opt, WARMUP, 1)
    assert event.reason == "settings" and set(opt.formats().values()) <= set(menu)
    ctl.close()


def test_resume_with_unchanged_settings_keeps_the_allocation_without_reevaluating() -> None:
    saved, formats = _checkpoint()
    ctl, opt, model = _resume(saved)
    assert ctl.pending is None and ctl.allocation == formats
    assert _train(ctl, model, opt, WARMUP, 2) == []
    ctl.close()


@pytest.mark.parametrize(
    "change",
    [{"memory_budget": 0.2}, {"max_block_risk": 0.0}, {"min_8bit_numel": 0}, {"granularity": "param"}],
    ids=["budget", "risk-cap", "min_8bit_numel", "granularity"],
)
def test_resume_with_changed_allocation_settings_reevaluates_at_once(change: dict[str, Any]) -> None:
    saved, _ = _checkpoint()
    ctl, opt, model = _resume(saved, **change)
    assert ctl.phase == "allocated" and ctl.pending == "settings"
    (event,) = _train(ctl, model, opt, WARMUP, 1)
    assert event.reason == "settings" and event.step == WARMUP
    budget = change.get("memory_budget", 0.3)
    assert opt.state_bytes() <= budget * ctl.fp32_state_bytes()
    if "granularity" in change:
        assert set(event.formats) == {n for n, _ in model.named_parameters()}
    ctl.close()


def test_frozen_parameter_given_state_by_the_checkpoint_stays_counted_in_the_budget() -> None:
    saved, _ = _checkpoint()
    model = _model()
    model[0].requires_grad_(False)  # frozen in this run, yet the checkpoint holds its state
    ctl, opt, model = _resume(saved, model)
    assert "0" not in ctl.block_params and opt.step_count("0.weight") == WARMUP  # state loaded after install
    (event,) = _train(ctl, model, opt, WARMUP, 1)
    assert event.reason == "params" and "0" in ctl.block_params
    assert ctl.fp32_state_bytes() == 8 * sum(p.numel() for p in model.parameters())
    assert opt.state_bytes() <= 0.3 * ctl.fp32_state_bytes()
    ctl.close()


def test_resume_whose_blocks_cannot_be_mapped_is_refused_naming_the_cause() -> None:
    saved, _ = _checkpoint()
    model = _model()
    model.add_module("extra", nn.Linear(10, 10))  # parameters the checkpoint has no format for
    ctl = BAOCController(memory_budget=0.3, warmup_steps=WARMUP, sample_every=EVERY)
    ctl.load_state_dict(saved["baoc"])
    with pytest.raises(ValueError, match=r"extra\.weight.*have no format.*trainable parameters differ.*without ckpt_path"):
        ctl.install(torch.optim.AdamW(model.parameters(), lr=2e-3), model)
    ctl.close()
