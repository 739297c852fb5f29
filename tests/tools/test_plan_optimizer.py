"""``lightning-baoc plan --optimizer {adamw,sgd,lion}``: the state of SGD's and Lion's momentum is planned
in their own formats (:data:`~lightning_baoc.formats.MOMENTUM_FORMATS`, fp32 = 4 bytes per element), and
AdamW's plan is what it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_baoc import BlockwiseLion, BlockwiseSGD
from lightning_baoc.__main__ import main
from lightning_baoc.costs.calibration import PRIOR_STEP_COSTS
from lightning_baoc.formats import MOMENTUM_FORMATS, format_state_bytes, numel_of, resolve_in
from lightning_baoc.sampling.blocks import partition
from lightning_baoc.tools.plan import plan
from lightning_baoc.tools.presets import build_model

SGD_FORMATS = "['fp32', 'bf16', 'int8', 'none']"


def _tiny_shapes() -> dict[str, list[tuple[int, ...]]]:
    """The tiny preset's blocks and their parameter shapes, from the model itself (not the plan)."""
    model = build_model("tiny")
    names = dict(model.named_parameters())
    return {b: [tuple(names[p].shape) for p in params] for b, params in partition(model).items()}


def test_cli_plans_sgd_momentum_at_0_3(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    assert main(["plan", "--preset", "tiny", "--optimizer", "sgd", "--budget", "0.3", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    shapes = _tiny_shapes()
    params = sum(numel_of(s) for of_block in shapes.values() for s in of_block)
    assert "fp32 SGD state" in out and f"= 4 bytes x {params:,} parameters" in out
    assert "AdamW" not in out and "nomomentum" not in out
    data = json.loads(out_json.read_text())
    assert data["optimizer"] == "SGD" and data["params"] == params
    assert data["fp32_state_bytes"] == 4 * params and "fp32_adamw_state_bytes" not in data
    assert list(data["formats"]) == list(MOMENTUM_FORMATS)
    for name, figure in data["formats"].items():  # every uniform format, as BlockwiseSGD allocates it
        exact = sum(format_state_bytes(name, s, rule="sgd") for of_block in shapes.values() for s in of_block)
        assert figure["device_bytes"] == exact and figure["host_bytes"] == 0, name
    assert data["formats"]["bf16"]["device_bytes"] == 2 * params and data["formats"]["none"]["device_bytes"] == 0

    (entry,) = data["allocations"]
    formats = entry["allocation"]["formats"]
    assert entry["error"] is None and set(formats) == set(shapes) and set(formats.values()) <= set(MOMENTUM_FORMATS)
    by_hand = sum(format_state_bytes(formats[b], s, rule="sgd") for b, of_block in shapes.items() for s in of_block)
    assert by_hand == entry["allocation"]["memory"] == entry["training_memory"]["states"]
    assert by_hand == entry["phases"]["phases"]["steady"]["state_bytes"]
    assert by_hand <= 0.3 * data["fp32_state_bytes"]
    # the budget is 0.3 of SGD's fp32 state, not of AdamW's (twice as large)
    assert entry["phases"]["budget_bytes"] == int(0.3 * 4 * params)


@pytest.mark.parametrize("rule, make", [
    ("sgd", lambda named, **kw: BlockwiseSGD(named, lr=0.1, momentum=0.9, **kw)),
    ("lion", lambda named, **kw: BlockwiseLion(named, lr=1e-4, **kw)),
], ids=["sgd", "lion"])  # fmt: skip
def test_the_momentum_plan_is_what_the_optimizer_allocates(rule: str, make) -> None:  # type: ignore[no-untyped-def]
    """Every uniform figure and every allocation equals the state the real optimizer holds (CPU)."""
    p = plan("tiny", [0.3, 0.15], device="cpu", optimizer=rule)
    assert p.rule == rule and p.fp32_bytes == 4 * p.params and p.fp32_bytes_per_param == 4
    torch.manual_seed(0)
    model = build_model("tiny", device="cpu")

    def stepped(**kw):  # type: ignore[no-untyped-def]
        opt = make(model.named_parameters(), **kw)
        for t in model.parameters():
            t.grad = torch.randn_like(t)
        opt.step()
        return opt

    for fig in p.formats:
        assert stepped(state_format=fig.name).state_bytes() == fig.device_bytes, fig.name
    for entry in p.allocations:
        alloc = entry.allocation
        assert alloc is not None and alloc.memory <= float(entry.budget) * p.fp32_bytes
        opt = stepped()
        opt.set_formats(alloc.formats, partition(model))
        assert opt.state_bytes() == alloc.memory == p.training_memory(alloc.memory)["states"]


def test_sgd_time_budget_prices_sgds_step_costs() -> None:
    p = plan("tiny", [0.3], time_budget=1.2, device="cpu", optimizer="sgd")
    alloc = p.allocations[0].allocation
    assert alloc is not None and alloc.time <= 1.2 * alloc.fp32_time * (1 + 1e-12)
    costs = PRIOR_STEP_COSTS["sgd"]
    by_hand = sum(
        numel_of(s) * costs[resolve_in(MOMENTUM_FORMATS, alloc.formats[b], s, 4096)] for b, of_block in p.blocks.items()
        for s in of_block
    )  # fmt: skip
    assert alloc.time == pytest.approx(by_hand) and alloc.fp32_time == pytest.approx(p.params * costs["fp32"])


def test_an_adamw_format_named_for_sgd_exits_2_naming_sgds_formats(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--preset", "tiny", "--mask", "nomomentum", "--optimizer", "sgd", "--budget", "0.3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'nomomentum' for SGD" in err and SGD_FORMATS in err and "--optimizer adamw" in err
    with pytest.raises(SystemExit) as info:
        main(["plan", "--preset", "tiny", "--optimizer", "adam"])
    assert info.value.code == 2 and "invalid choice: 'adam'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"Invalid optimizer: 'adam'; allowed: \['adamw', 'sgd', 'lion'\]"):
        plan("tiny", optimizer="adam")
    with pytest.raises(ValueError, match=r"mask names unknown format 'none' \(a format of SGD/Lion"):
        plan("tiny", device="cpu", mask=["none"])  # and the other way round
    assert "none" in plan("tiny", [0.3], device="cpu", mask=["none"], optimizer="lion").masked


def test_stats_and_initial_files_are_checked_against_the_optimizers_formats(tmp_path: Path) -> None:
    names = list(_tiny_shapes())
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"blocks": [{"name": b, "risk": {"fp32": 0.0, "factored": 0.1}} for b in names]}))
    with pytest.raises(ValueError, match=r"unknown format 'factored' for SGD .*" + SGD_FORMATS.replace("[", r"\[")):
        plan("tiny", [0.3], device="cpu", statistics=path, optimizer="sgd")
    with pytest.raises(ValueError, match=r"block '.*' has a risk of an unknown format 'factored' for SGD"):
        plan("tiny", [0.3], device="cpu", initial=path, optimizer="sgd")
    assert plan("tiny", [0.3], device="cpu", statistics=path).allocations[0].error is None  # AdamW's formats

    record = {"optimizer": "SGD", "blocks": [{"name": b, "risk": {"fp32": 1.0, "none": 0.0}} for b in names]}
    path.write_text(json.dumps(record))
    sgd = plan("tiny", [0.3], device="cpu", statistics=path, initial=path, optimizer="sgd")
    assert set(sgd.allocations[0].phases.start.formats.values()) == {"none"} == set(sgd.allocations[0].allocation.formats.values())
    for rule, owner in (("lion", "optimizer='sgd'"), ("adamw", "optimizer='sgd'")):
        with pytest.raises(ValueError, match=f"holds the risks of SGD's state, not .*; plan it with {owner}"):
            plan("tiny", [0.3], device="cpu", statistics=path, optimizer=rule)
        with pytest.raises(ValueError, match=r"plan\(initial=...\): the allocation record .* holds the risks of SGD's"):
            plan("tiny", [0.3], device="cpu", initial=path, optimizer=rule)
    with pytest.raises(ValueError, match=r"asks for 'nomomentum', a format not offered here; offered: " + SGD_FORMATS.replace("[", r"\[")):
        plan("tiny", [0.3], device="cpu", initial={names[0]: "nomomentum"}, optimizer="sgd")


def test_adamw_is_the_default_and_its_plan_is_unchanged(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    default, explicit = tmp_path / "default.json", tmp_path / "adamw.json"
    argv = ["plan", "--preset", "tiny", "--device", "cpu", "--budget", "0.3"]
    assert main([*argv, "--json", str(default)]) == 0
    out = capsys.readouterr().out
    assert main([*argv, "--optimizer", "adamw", "--json", str(explicit)]) == 0
    assert capsys.readouterr().out == out and "fp32 AdamW state" in out and "= 8 bytes x 166,208 parameters" in out
    data = json.loads(default.read_text())
    assert data == json.loads(explicit.read_text())
    assert data["optimizer"] == "AdamW" and data["fp32_adamw_state_bytes"] == data["fp32_state_bytes"] == 8 * data["params"]
    assert plan("tiny", [0.3], device="cpu").to_dict() == plan("tiny", [0.3], device="cpu", optimizer="adamw").to_dict()


def test_plan_help_names_the_optimizer_budgets_refer_to(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "of the optimizer state the plain optimizer would hold (AdamW; SGD/Lion with --optimizer)" in out
    assert "a multiple of the fp32 optimizer-step time of the plain optimizer (AdamW; SGD/Lion with --optimizer)" in out
    assert "--optimizer {adamw,sgd,lion}" in out and "plain AdamW" not in out
