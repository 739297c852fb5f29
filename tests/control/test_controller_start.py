"""The start allocation: the memory budget holds from the first optimizer step.

At install the controller puts every block in the allocation of least prior risk within the budgets
(``lightning_baoc.control.start``), or in what ``initial`` asks (a previous run's
``baoc_allocation.json``, or a mapping block -> format). These tests measure the optimizer's state
at every step of a warm-up, follow a second run that starts from the first one's record, and check
that parameters joining during the warm-up and budgets changed mid-warm-up keep the cap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support import one_thread  # noqa: F401  (one intra-op thread: see there)
from torch import nn

from lightning_baoc import BlockwiseAdamW
from lightning_baoc.control.controller import BAOCController
from lightning_baoc.report.allocation import build_record


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 64, generator=g)
    return x, (x[:, :10] * 3).argmax(dim=1)


def _run(ctl: BAOCController, model: nn.Module, opt: BlockwiseAdamW, start: int, steps: int) -> tuple[list[Any], int]:
    """Train ``steps`` steps; the allocation events and the most state bytes seen after any step."""
    events, most = [], 0
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        ctl.observe(step)
        opt.step()
        most = max(most, opt.state_bytes())
        event = ctl.maybe_allocate(step + 1)
        if event is not None:
            events.append(event)
    return events, most


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_warmup_state_is_within_the_budget_at_every_step(budget: float) -> None:
    model = _model()
    ctl = BAOCController(memory_budget=budget, warmup_steps=12, sample_every=4)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    cap = int(budget * ctl.baseline_state_bytes())
    assert opt.state_bytes() == 0  # no state before the first step, in any format
    _, most = _run(ctl, model, opt, 0, 11)
    assert ctl.phase == "warmup" and 0 < most <= cap and opt.peak_state_bytes() <= cap
    assert most < ctl.fp32_state_bytes()  # what the warm-up held before: fp32 AdamW's state
    (event,), _ = _run(ctl, model, opt, 11, 1)
    largest = max(8 * p.numel() for p in model.parameters())
    assert event.state_bytes <= cap and event.peak_state_bytes <= cap + largest
    ctl.close()


def test_a_second_run_starts_from_the_first_runs_record(tmp_path: Path) -> None:
    model = _model()
    first = BAOCController(memory_budget=0.3, warmup_steps=12, sample_every=4)
    opt = first.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    (event,), _ = _run(first, model, opt, 0, 12)
    record = build_record(event, first.history)
    prior_start = dict(first.start_allocation or {})
    first.close()
    # the record's measured risks, made to disagree with the prior (its formats made costly), so that
    # a start from the record is told apart from a start from the prior
    for block in record["blocks"]:
        block["risk"][prior_start[block["name"]]] += 1.0
    path = tmp_path / "baoc_allocation.json"
    path.write_text(json.dumps(record))
    measured = {b["name"]: b["risk"] for b in record["blocks"]}

    again = _model()
    second = BAOCController(memory_budget=0.3, warmup_steps=12, sample_every=4, initial=str(path))
    opt2 = second.install(torch.optim.AdamW(again.parameters(), lr=1e-3), again)
    expected = second.problem.solve(measured, 0.3, None).formats
    assert second.start_allocation == dict(expected) != prior_start  # the record's risks, not the prior
    _, most = _run(second, again, opt2, 0, 3)
    assert most <= int(0.3 * second.baseline_state_bytes())
    second.close()


def test_a_mapping_is_kept_where_the_budget_allows() -> None:
    model = _model()
    wanted = {"0": "int8", "2": "bf16", "4": "fp32"}
    ctl = BAOCController(memory_budget=0.5, warmup_steps=12, sample_every=4, initial=wanted)
    ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    assert ctl.start_allocation == wanted
    ctl.close()
    tight = BAOCController(memory_budget=0.2, warmup_steps=12, sample_every=4, initial={"0": "fp32"})
    other = _model()
    tight.install(torch.optim.AdamW(other.parameters(), lr=1e-3), other)
    assert tight.start_allocation is not None and tight.start_allocation["0"] != "fp32"  # fp32 does not fit
    tight.close()


@pytest.mark.parametrize(
    "initial,match",
    [
        ({"encoder": "int8"}, r"\['encoder'\] are not blocks of this model \(blocks like \['0', '2', '4'\]\)"),
        ({"0": "int4"}, r"block '0' asks for 'int4', not a format not offered here; offered: \['fp32'"),
        ("missing.json", r"initial='missing.json'\): cannot read the allocation record"),
    ],
)
def test_a_bad_initial_is_refused_naming_it(initial: Any, match: str) -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.5, warmup_steps=12, sample_every=4, initial=initial)
    user = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=match):
        ctl.install(user, model)
    ctl.close()


def test_parameters_joining_during_warmup_start_within_the_budget() -> None:
    model = _model()
    head = list(model[4].parameters())
    body = [p for p in model.parameters() if all(p is not q for q in head)]
    ctl = BAOCController(memory_budget=0.3, warmup_steps=12, sample_every=4)
    opt = ctl.install(torch.optim.AdamW(body, lr=1e-3), model)
    _run(ctl, model, opt, 0, 3)
    opt.add_param_group({"params": head})
    x, y = _batch(3)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    ctl.before_step(3)  # takes the new parameters in: the start allocation is solved again
    opt.step()
    assert set(ctl.start_allocation or {}) == set(ctl.block_params) and "4" in ctl.block_params
    assert opt.state_bytes() <= int(0.3 * ctl.baseline_state_bytes())
    ctl.close()


@pytest.mark.parametrize("budget", [0.2, 0.25, 0.3, 0.45, 0.6])
def test_the_allocation_after_a_capped_warmup_is_the_one_an_fp32_warmup_measures(budget: float) -> None:
    """The shadow moments (lightning_baoc.risk.shadow) score every format against fp32 AdamW's own
    moments: a warm-up held in 8-bit or factored states decides what an fp32 warm-up decides (the
    format in force does not look free because re-encoding it changes nothing)."""
    model = _model()
    capped = BAOCController(memory_budget=budget, warmup_steps=12, sample_every=4)
    opt = capped.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    (event,), most = _run(capped, model, opt, 0, 12)
    assert most <= int(budget * capped.baseline_state_bytes())
    capped.close()

    twin = _model()
    free = BAOCController(memory_budget=1.0, warmup_steps=12, sample_every=4)  # fp32 fits: fp32 warm-up
    opt2 = free.install(torch.optim.AdamW(twin.parameters(), lr=1e-3), twin)
    _run(free, twin, opt2, 0, 11)
    assert set(opt2.formats().values()) == {"fp32"}
    free.config.memory_budget = budget  # decide under the same budget, from the fp32 warm-up's state
    assert free._decide("warmup")["formats"] == event.formats
    free.close()


def test_shadow_moments_are_fp32_adamws_on_their_sample() -> None:
    torch.manual_seed(0)  # a 256 x 128 weight (32,768 elements): shadowed on a sample of 16,384
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 10))
    # the instruments' default sizes (a share large enough that they are not sized down)
    ctl = BAOCController(memory_budget=1.0, warmup_steps=50, sample_every=4, instrument_share=64.0)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.99)), model)
    _run(ctl, model, opt, 0, 7)
    assert ctl.shadow is not None
    for name, entry in ctl.shadow.entries.items():
        state = opt.param_state(name)
        take = (lambda t: t.reshape(-1)) if entry.index is None else (lambda t: t.reshape(-1)[entry.index])
        assert entry.steps == opt.step_count(name) == 7
        torch.testing.assert_close(entry.exp_avg, take(state.exp_avg), rtol=1e-6, atol=0)
        torch.testing.assert_close(entry.exp_avg_sq, take(state.exp_avg_sq), rtol=1e-6, atol=0)
    sampled = [e for e in ctl.shadow.entries.values() if e.index is not None]
    assert len(sampled) == 1 and sampled[0].index.numel() == ctl.shadow.max_elements == 16384
    assert ctl.shadow.nbytes() < 8 * sum(p.numel() for p in model.parameters())
    ctl.close()


def test_a_resume_holds_the_budget_from_its_first_step() -> None:
    """A run resumed from a checkpoint (controller state first, then the optimizer's compact state, as
    Lightning restores them) never holds more than the budget: the fresh optimizer is asked for the
    saved formats before any state exists, and the load builds the states in them."""
    model = _model()
    ctl = BAOCController(memory_budget=0.3, warmup_steps=8, sample_every=4)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    (event,), _ = _run(ctl, model, opt, 0, 8)
    _run(ctl, model, opt, 8, 4)
    saved_ctl, saved_opt, saved_model = ctl.state_dict(), opt.state_dict(), model.state_dict()
    cap = int(0.3 * ctl.baseline_state_bytes())
    ctl.close()

    again = _model(seed=1)
    again.load_state_dict(saved_model)
    resumed = BAOCController(memory_budget=0.3, warmup_steps=8, sample_every=4)
    resumed.load_state_dict(saved_ctl)
    opt2 = resumed.install(torch.optim.AdamW(again.parameters(), lr=1e-3), again)
    # the saved formats are asked for before any state exists: nothing is allocated yet
    assert opt2.state_bytes() == 0 and opt2.formats() == opt.formats()
    opt2.load_state_dict(saved_opt)
    assert opt2.formats() == opt.formats() and opt2.peak_state_bytes() == opt2.state_bytes() <= cap
    _, most = _run(resumed, again, opt2, 12, 4)
    assert most <= cap and resumed.peak_state_bytes() == max(event.peak_state_bytes, opt2.peak_state_bytes())
    resumed.close()
