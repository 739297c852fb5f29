"""The controller choosing master-weight corrections per block (``BAOC(corrections=[...])``).

On a bf16 model the options pair every state format with a correction (``"int8+ecc8"``); the budget
caps the state and the corrections together at every step (the start included); the corrections'
risk is measured on the shadow moments, so at a learning rate whose updates fall under half a bf16
ulp every block keeps a correction; a tight budget still finds an allocation; a crash and resume
through the state dicts is bit-equal; ``initial`` names options (or a previous run's record measured
them); corrections on an fp32 model are refused naming the setting.
"""

from __future__ import annotations

import json

import pytest
import torch
from support import one_thread  # noqa: F401
from torch import nn

from lightning_baoc.config.settings import SettingError
from lightning_baoc.control.controller import BAOCConfig, BAOCController
from lightning_baoc.costs.options import split_option
from lightning_baoc.report.allocation import build_record, validate_record

ALL = ["none", "ecc8", "ecc16"]


def _model(dtype: torch.dtype = torch.bfloat16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4)).to(dtype)


def _run(ctl: BAOCController, opt, model: nn.Module, start: int, stop: int, budget: int | None = None) -> list:  # type: ignore[no-untyped-def]
    events, losses = [], []
    for step in range(start, stop):
        opt.zero_grad()
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        loss = nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), x[:, :4].argmax(1))
        loss.backward()
        losses.append(loss.item())
        ctl.before_step(step)
        ctl.observe(step)
        opt.step()
        if budget is not None:  # the cap holds at every step: states and corrections together
            assert opt.state_bytes() + opt.weight_correction_bytes() <= budget
        event = ctl.maybe_allocate(step + 1)
        if event is not None:
            events.append(event)
    return events, losses


def _controller(budget: float = 0.9, **kwargs) -> BAOCController:  # type: ignore[no-untyped-def]
    return BAOCController(BAOCConfig(memory_budget=budget, warmup_steps=12, sample_every=4, corrections=ALL, **kwargs))


def test_small_updates_keep_a_correction_on_every_block_within_the_budget() -> None:
    model = _model()
    ctl = _controller()
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-5), model)
    budget = ctl.memory_budget_bytes()
    assert budget == int(0.9 * 4 * sum(p.numel() for p in model.parameters()))  # torch AdamW's bf16 moments
    assert all("+ecc" in o for o in ctl.start_allocation.values())  # the prior prices a bf16 weight's losses
    assert "int8+ecc16" in ctl.problem.allowed and "fp32" in ctl.problem.allowed
    events, _ = _run(ctl, opt, model, 0, 16, budget)
    ctl.close()
    event = events[0]
    assert event.reason == "warmup" and all(split_option(o)[1] != "none" for o in event.formats.values())
    for block, row in event.risk.items():  # the measured risk of dropping the correction dominates
        assert row["int8"] > 20 * row["int8+ecc8"] > 0.0 and row["int8+ecc8"] >= row["int8+ecc16"]  # measured: 70x+
    assert event.correction_bytes == opt.weight_correction_bytes() > 0
    assert event.state_bytes + event.correction_bytes <= event.memory_budget_bytes == budget
    assert sum(event.block_bytes.values()) == event.state_bytes + event.correction_bytes
    held = {n: opt.weight_corrections.get(n, "none") for n in opt.named_params}
    for block, chosen in event.formats.items():
        for name in ctl.block_params[block]:
            assert held[name] == split_option(chosen)[1] and opt.requested_format(opt.named_params[name]) == split_option(chosen)[0]
    record = build_record(event)
    validate_record(record)
    assert record["correction_bytes"] == event.correction_bytes


def test_a_tight_budget_trades_corrections_against_states() -> None:
    model = _model()
    ctl = _controller(budget=0.4)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-5), model)
    events, _ = _run(ctl, opt, model, 0, 16, ctl.memory_budget_bytes())
    ctl.close()
    formats = events[0].formats
    assert opt.state_bytes() + opt.weight_correction_bytes() <= 0.4 * ctl.baseline_state_bytes()
    assert len(set(formats.values())) > 1 or any("+ecc" in o for o in formats.values())


def test_resume_through_the_state_dicts_is_bit_equal() -> None:
    def fresh():  # type: ignore[no-untyped-def]
        model = _model()
        ctl = _controller(reevaluate_every_n_epochs=1)
        return model, ctl, ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-5), model)

    model, ctl, opt = fresh()
    _, straight = _run(ctl, opt, model, 0, 30)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    ctl.close()
    model, ctl, opt = fresh()
    _run(ctl, opt, model, 0, 18)
    saved = (ctl.state_dict(), opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()})
    assert saved[0]["phase"] == "allocated" and saved[0]["settings"]["corrections"] == ALL
    ctl.close()
    model = _model()
    model.load_state_dict(saved[2])
    ctl = _controller(reevaluate_every_n_epochs=1)
    ctl.load_state_dict(saved[0])
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-5), model)
    opt.load_state_dict(saved[1])
    _, resumed = _run(ctl, opt, model, 18, 30)
    ctl.close()
    assert resumed == straight[18:]
    for n, p in model.named_parameters():
        assert torch.equal(p, ref[n]), n


@pytest.mark.parametrize("before,after", [(ALL, None), (None, ALL)], ids=["turned-off", "turned-on"])
def test_resume_with_corrections_turned_off_or_on_reallocates_before_the_next_step(before, after) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    ctl = BAOCController(BAOCConfig(memory_budget=0.9, warmup_steps=12, sample_every=4, corrections=before))
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-5), model)
    _run(ctl, opt, model, 0, 14)
    saved = (ctl.state_dict(), opt.state_dict())
    ctl.close()
    ctl = BAOCController(BAOCConfig(memory_budget=0.9, warmup_steps=12, sample_every=4, corrections=after))
    ctl.load_state_dict(saved[0])
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-5), model)
    opt.load_state_dict(saved[1])
    assert ctl.pending == "settings"
    event = ctl.before_step(14)
    assert event is not None and event.reason == "settings"
    assert all(o in ctl.problem.allowed for o in ctl.allocation.values())
    held = opt.state_bytes() + (opt.weight_correction_bytes() if after else 0)
    assert held <= ctl.memory_budget_bytes()
    ctl.close()


def test_a_time_budget_trades_corrections_for_time() -> None:
    """Under a time budget each option costs its format's step time plus its correction's (the prior,
    PRIOR_CORRECTION_COST): a budget with room in memory but little time keeps fewer corrections than
    the memory budget alone, and the allocation's step time is within the time budget at every step."""
    chosen = {}
    for time_budget in (None, 1.2):
        model = _model()
        ctl = _controller(time_budget=time_budget)
        opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-5), model)
        events, _ = _run(ctl, opt, model, 0, 16, ctl.memory_budget_bytes())
        ctl.close()
        chosen[time_budget] = events[0].formats
        if time_budget is not None:
            table = ctl.problem.time()
            assert sum(table[b][o] for b, o in events[0].formats.items()) <= time_budget * ctl.problem.fp32_time
            assert sum(table[b][o] for b, o in ctl.start_allocation.items()) <= time_budget * ctl.problem.fp32_time
    assert all("+ecc" in o for o in chosen[None].values())
    assert sum("+ecc" in o for o in chosen[1.2].values()) < len(chosen[1.2])


def test_refused_where_corrections_do_not_apply() -> None:
    model = _model(torch.float32)
    with pytest.raises(ValueError, match=r"corrections=.*trains no bf16 or fp16 parameter"):
        _controller().install(torch.optim.AdamW(model.parameters()), model)
    with pytest.raises(SettingError, match="corrections"):
        BAOCConfig(memory_budget=0.5, corrections=["ecc4"])


def test_initial_names_options_and_a_record_restarts_in_its_allocation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With corrections, ``initial`` names options: the warm-up starts in them (held: formats and
    corrections). A run's ``baoc_allocation.json`` (its measured risk per option) starts the next run
    in the allocation that run chose, corrections included."""
    model = _model()
    named = {"0": "bf16+ecc16", "2": "int8", "4": "nomomentum_int8+ecc8"}  # 0.81 of the budget's bytes
    ctl = _controller(initial=named)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-5), model)
    assert set(ctl.start_allocation) == set(named)
    assert ctl.start_allocation == named
    held = opt.weight_corrections
    assert {n: held.get(n, "none") for n in ("0.weight", "2.weight", "4.weight")} == {"0.weight": "ecc16", "2.weight": "none", "4.weight": "ecc8"}
    assert (opt.formats()["0.weight"], opt.formats()["2.weight"]) == ("bf16", "int8")
    events, _ = _run(ctl, opt, model, 0, 16, ctl.memory_budget_bytes())
    ctl.close()
    record = build_record(events[0])
    validate_record(record)
    path = tmp_path / "baoc_allocation.json"
    path.write_text(json.dumps(record))
    again = _controller(initial=str(path))
    fresh = _model()
    again.install(torch.optim.AdamW(fresh.parameters(), lr=1e-5), fresh)
    assert again.start_allocation == events[0].formats
    assert any("+ecc" in o for o in again.start_allocation.values())


def test_an_option_without_corrections_is_refused_naming_the_setting() -> None:
    model = _model()  # bf16: corrections are offered unless opted out
    ctl = BAOCController(BAOCConfig(memory_budget=0.9, warmup_steps=12, sample_every=4, initial={"0": "int8+ecc8"},
                                    corrections=["none"]))
    with pytest.raises(ValueError, match=r"block '0' asks for 'int8\+ecc8'.*only with BAOC\(corrections=\[\.\.\.\]\)"):
        ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-5), model)


def test_the_summary_holds_the_optimizer_s_figures_in_warm_up_and_after_the_allocation() -> None:
    """``BAOCController.summary()`` (behind ``BAOC.summary()``): the states and the corrections as the optimizer holds
    them, the baseline of torch's bf16 AdamW, the formats and corrections per block; refused before install."""
    model = _model()
    ctl = _controller(budget=0.5)
    with pytest.raises(RuntimeError, match=r"summary\(\) needs install"):
        ctl.summary()
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-5), model)
    _run(ctl, opt, model, 0, 4)
    warm = ctl.summary()
    numel = sum(p.numel() for p in model.parameters())  # 83,460
    assert (warm.phase, warm.step, warm.total_risk) == ("warmup", 4, None)
    assert warm.baseline_state_bytes == 4 * numel == 333_840 and warm.memory_budget_bytes == 166_920
    assert warm.state_bytes == opt.state_bytes() and warm.correction_bytes == opt.weight_correction_bytes()
    assert warm.state_bytes + warm.correction_bytes <= warm.memory_budget_bytes and warm.corrections_in_budget
    assert {b: (warm.formats[b], warm.corrections[b]) for b in warm.formats} == {
        b: split_option(o) for b, o in ctl.start_allocation.items()}
    events, _ = _run(ctl, opt, model, 4, 16)
    ctl.close()
    done = ctl.summary(measured_peak_growth_bytes=123)
    assert (done.phase, done.step, done.measured_peak_growth_bytes) == ("allocated", 16, 123)
    assert done.total_risk == events[0].total_risk and done.correction_bytes == events[0].correction_bytes > 0
    assert done.state_fraction == done.state_bytes / done.baseline_state_bytes and done.peak_state_bytes >= done.state_bytes
    assert {b: (done.formats[b], done.corrections[b]) for b in done.formats} == {b: split_option(o) for b, o in ctl.allocation.items()}
    assert done.metrics()["baoc/correction_bytes"] == done.correction_bytes and "baoc/total_risk" in done.metrics()
