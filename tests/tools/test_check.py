"""``lightning-baoc check`` (``lightning_baoc.tools.check``): the pre-training checklist of a config for a
model and a device, its PASS/FAIL lines with their fixes, and its exit codes."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_baoc.__main__ import main
from lightning_baoc.config.files import load_config, parse_config, schema_text
from lightning_baoc.tools.check import MAX_SAMPLER_OVERHEAD, CheckResult, run_checks, sampler_overhead

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The templates' model sections name ``workloads.*`` (examples/workloads.py)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["check", *args])
    return code, capsys.readouterr().out


def _by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


@pytest.mark.parametrize("template", ["vision", "language", "diffusion"])
def test_check_passes_on_the_example_configs(capsys: pytest.CaptureFixture[str], template: str) -> None:
    code, out = _check(capsys, "--config", str(CONFIGS / f"{template}.yaml"), "--device", "cpu")
    assert code == 0, out
    assert "FAIL" not in out and out.count("PASS") == 7 and "7 passed, 0 failed" in out


def test_an_infeasible_budget_fails_naming_the_smallest_feasible_budget(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(CONFIGS / "vision.yaml")
    narrow = ["baoc.formats=[fp32,int8]", "baoc.memory_budget=0.1"]
    code, out = _check(capsys, "--config", config, "--device", "cpu", *narrow)
    assert code == 1 and "memory budget" in out and "FAIL" in out
    cfg = load_config(config, narrow)
    from lightning_baoc.tools.check import resolve_model

    model, _ = resolve_model(cfg)
    result = _by_name(run_checks(cfg, model, "cpu"))["memory budget"]
    assert not result.passed and "infeasible" in result.detail
    assert "set baoc.memory_budget >= " in result.fix and "factored" in result.fix  # cheaper formats named
    smallest = result.fix.split(">= ")[1].split(" ")[0]
    # the named budget is feasible, and 0.01 less is not
    ok = _by_name(run_checks(load_config(config, [narrow[0], f"baoc.memory_budget={smallest}"]), model, "cpu"))
    assert ok["memory budget"].passed, ok["memory budget"]
    below = f"{float(smallest) - 0.01:.3f}"
    low = _by_name(run_checks(load_config(config, [narrow[0], f"baoc.memory_budget={below}"]), model, "cpu"))
    assert not low["memory budget"].passed


def test_a_format_the_device_cannot_serve_fails_naming_the_format_and_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _check(
        capsys, "--config", str(CONFIGS / "diffusion.yaml"), "--device", "cpu", "baoc.formats=[fp32,int8,offload]"
    )
    assert code == 1
    cfg = load_config(CONFIGS / "diffusion.yaml", ["baoc.formats=[fp32,int8,offload]"])
    result = _by_name(run_checks(cfg, nn.Linear(128, 128, device="meta"), "cpu"))["formats served"]
    assert not result.passed and "offload" in result.detail and "host memory" in result.detail
    assert "remove 'offload' from baoc.formats" in result.fix and "[fp32, int8]" in result.fix
    assert "offload" in out and "FAIL" in out
    # without formats, the formats the device cannot serve are skipped, and it passes
    auto = _by_name(run_checks(parse_config({"baoc": {"memory_budget": 0.3}}), nn.Linear(128, 128, device="meta"), "cpu"))
    assert auto["formats served"].passed and "offload skipped" in auto["formats served"].detail


def test_sampler_overhead_says_the_figure_and_fails_above_the_design_budget() -> None:
    model = nn.Sequential(*[nn.Linear(512, 512, device="meta") for _ in range(4)])
    roomy = parse_config({"baoc": {"memory_budget": 0.5, "instrument_share": 1.0}})  # nothing lowered
    fine = _by_name(run_checks(roomy, model, "cpu"))["sampler overhead"]
    assert fine.passed and "reads 16,384 gradient elements per sample (1.6% of the gradient)," in fine.detail, fine
    assert "sampler buffers 2.26 MiB, of the instruments' 2.78 MiB" in fine.detail
    # a small model sampled at every step reads too much of its gradient
    small = nn.Sequential(*[nn.Linear(64, 64, device="meta") for _ in range(4)])
    every = parse_config({"baoc": {"memory_budget": 0.5, "sample_every": 1, "warmup_steps": 20}})
    busy = _by_name(run_checks(every, small, "cpu"))["sampler overhead"]
    assert not busy.passed and "reads 1,544 gradient elements per sample (9.3% of the gradient;" in busy.detail, busy
    assert "about 3.29% of a training step" in busy.detail
    assert "baoc.sample_every >= " in busy.fix and "baoc.max_elements <= " in busy.fix
    # either suggestion brings the estimate under the budget, at the 386 elements per block the run samples
    suggested = int(busy.fix.split("sample_every >= ")[1].split(" ")[0])
    elements = int(busy.fix.split("max_elements <= ")[1].split(" ")[0])
    numel = {str(i): 64 * 65 for i in range(4)}
    assert sampler_overhead(numel, 1, 386, 32).overhead > MAX_SAMPLER_OVERHEAD
    assert sampler_overhead(numel, suggested, 386, 32).overhead <= MAX_SAMPLER_OVERHEAD
    assert elements < 386 and sampler_overhead(numel, 1, elements, 32).overhead <= MAX_SAMPLER_OVERHEAD


def test_check_names_each_memory_figure_once_and_they_are_what_the_run_holds() -> None:
    """Issue 61: 'sampler buffers 255 KiB' and 'ring buffer 5.49 MiB' in one table were two sizes of the
    sampler's memory: the first BAOC's instruments (the sampler's buffers and the shadow moments) as the
    run sizes them within baoc.instrument_share, the second the ring at a max_elements the run never
    samples. Now the memory line names the instruments' bytes, the sampler line the sampler's part of them
    at the elements the run samples (and says that they were lowered), and both are the controller's."""
    from lightning_baoc import BAOC

    cfg = load_config(CONFIGS / "vision.yaml")
    from lightning_baoc.tools.check import resolve_model

    results = _by_name(run_checks(cfg, resolve_model(cfg)[0], "cpu"))
    budget, sampler = results["memory budget"], results["sampler overhead"]
    assert "ring buffer" not in sampler.detail and "ring buffer" not in budget.detail
    assert "BAOC's instruments (the sampler's buffers and the shadow moments) hold 255 KiB besides" in budget.detail
    assert budget.figures["instrument_bytes"] == 261_144
    assert "reads 640 gradient elements per sample (0.4% of the gradient; baoc.max_elements=4096 lowered to 32 per block" in sampler.detail
    assert "sampler buffers 122 KiB, of the instruments' 255 KiB (see memory budget)" in sampler.detail

    torch.manual_seed(0)
    model = resolve_model(cfg, config_path=CONFIGS / "vision.yaml")[0].to_empty(device="cpu")
    ctl = BAOC.from_config(CONFIGS / "vision.yaml").controller  # the template's settings, as a run takes them
    ctl.install(torch.optim.AdamW(model.parameters()), model)
    try:  # the run samples those elements and holds at most those bytes
        assert ctl.instruments.max_elements == 32 and ctl.instruments.estimate_bytes == budget.figures["instrument_bytes"]
        assert 0 < ctl.sampler.buffer_bytes() <= 122 * 2**10 + 2**9
    finally:
        ctl.close()


def test_sampler_overhead_estimate_reproduces_its_measured_anchor() -> None:
    # docs/benchmarks/sampler-overhead.md: 1.2M-parameter GPT, 40 blocks, sample_every=10: 0.66% direct
    import sys

    before = list(sys.path)
    try:
        from _models import CharGPT
    finally:  # what its import put on sys.path (nothing when another test imported it first)
        sys.path[:] = before
    from lightning_baoc.sampling.blocks import partition_report

    with torch.device("meta"):
        model = CharGPT(vocab_size=100, block_size=64, n_layer=6, n_head=4, n_embd=128)
    report = partition_report(model)
    est = sampler_overhead(report.numel, 10, 4096, 32)
    assert len(report.blocks) == 40 and math.isclose(est.overhead, 0.0066, rel_tol=0.02)
    assert sampler_overhead(report.numel, 1, 4096, 32).overhead == pytest.approx(5 * est.overhead)


@pytest.mark.parametrize(
    "baoc, check, words",
    [
        ({"warmup_steps": 40, "sample_every": 10}, "warm-up", "baoc.warmup_steps >= 80"),
        ({"warmup_steps": 500}, "warm-up", "about a fifth of the run (e.g. 60)"),
        ({"hysteresis": 0.0, "reevaluate_every_n_epochs": 1}, "risk thresholds", "[0.01, 0.5]"),
        ({"hysteresis": 0.9, "monitor": "val_loss"}, "risk thresholds", "[0.01, 0.5]"),
        ({"max_block_risk": 0.0}, "risk thresholds", "max_block_risk to null"),
        ({"monitor": "val_acc", "mode": "min"}, "re-evaluation trigger", "mode: max"),
        ({"monitor": "val_ppl", "mode": "max"}, "re-evaluation trigger", "mode: min"),
        ({"blocks": {"head": "decoder.*"}}, "blocks", "baoc.blocks"),
    ],
)
def test_insane_settings_fail_with_a_fix(baoc: dict, check: str, words: str) -> None:
    cfg = parse_config({"baoc": {"memory_budget": 0.5, **baoc}, "trainer": {"max_steps": 300}})
    results = _by_name(run_checks(cfg, nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 8)).to("meta"), "cpu"))
    assert not results[check].passed and words in results[check].fix, results[check]
    assert sum(not r.passed for r in results.values()) == 1, [r for r in results.values() if not r.passed]


def test_a_time_budget_is_priced_and_checked() -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).to("meta")
    base = {"memory_budget": 0.3, "formats": ["fp32", "int8", "factored"], "calibration": "prior"}
    ok = _by_name(run_checks(parse_config({"baoc": {**base, "time_budget": 3.0}}), model, "cpu"))["memory budget"]
    assert ok.passed and "prior costs" in ok.detail
    # int8 steps cost 2.4x fp32 (the prior): within a 1.0x time budget only fp32 is fast enough
    slow = _by_name(
        run_checks(parse_config({"baoc": {**base, "formats": ["fp32", "int8"], "time_budget": 1.0}}), model, "cpu")
    )["memory budget"]
    assert not slow.passed and "within the time budget" in slow.detail
    assert "raise baoc.time_budget to >= 2.39" in slow.fix  # int8 everywhere but the small biases


def test_sane_thresholds_pass() -> None:
    cfg = parse_config(
        {
            "baoc": {
                "memory_budget": 0.5,
                "max_block_risk": 0.05, "hysteresis": 0.2,
                "monitor": "val_acc", "mode": "max",
            }
        }
    )
    results = run_checks(cfg, nn.Linear(512, 512, device="meta"), "cpu")
    assert all(r.passed for r in results), [r for r in results if not r.passed]


def test_bad_input_exits_with_code_2(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", "--config", str(CONFIGS / "vision.yaml"), "baoc.memroy_budget=0.2"])
    assert info.value.code == 2 and "baoc.memroy_budget" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["check", "--config", str(CONFIGS / "vision.yaml"), "model.class_path=nowhere.Model"])
    assert info.value.code == 2 and "PYTHONPATH" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["check", "--config", str(CONFIGS / "vision.yaml"), "--model", "no-such-preset"])
    assert info.value.code == 2


def test_model_option_takes_a_preset_over_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _check(capsys, "--config", str(CONFIGS / "language.yaml"), "--model", "tiny", "--device", "cpu")
    # the template's patterns name the example GPT's parameters: the preset has none of them
    assert code == 1 and "blocks" in out and "FAIL" in out
    code, out = _check(
        capsys, "--config", str(CONFIGS / "language.yaml"), "--model", "tiny", "--device", "cpu", "baoc.blocks=null"
    )
    assert code == 0, out


def test_schema_subcommand_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert capsys.readouterr().out == schema_text()


# ---------------------------------------------------------------------------- the state by phase


def test_the_memory_line_reports_every_phase_and_the_warm_up_holds_the_budget() -> None:
    """The warm-up figure is what the run really holds after install and a step: within 0.25 of the
    baseline, where the fp32 warm-up of before (8 bytes per element) held all of it."""
    from lightning_baoc import BlockwiseAdamW
    from lightning_baoc.control.controller import BAOCController
    from lightning_baoc.tools.presets import build_model

    cfg = parse_config({"baoc": {"memory_budget": 0.25}})
    result = _by_name(run_checks(cfg, build_model("tiny"), "cpu"))["memory budget"]
    assert result.passed, result
    for phase in ("start", "warm-up", "conversion <=", "steady"):
        assert f"{phase} " in result.detail
    figures = result.figures
    budget = figures["budget_bytes"]
    assert budget == int(0.25 * figures["fp32_bytes"])

    torch.manual_seed(0)
    model = build_model("tiny", device="cpu")
    numel = sum(p.numel() for p in model.parameters())
    ctl = BAOCController(memory_budget=0.25, warmup_steps=50, sample_every=5)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    fp32 = BlockwiseAdamW(model.named_parameters(), lr=1e-3)  # the old warm-up: fp32 state
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    fp32.step()
    assert figures["warm-up"] == figures["start"] == opt.state_bytes() == opt.peak_state_bytes()
    assert figures["warm-up"] <= budget == ctl.memory_budget_bytes()
    assert fp32.state_bytes() == 8 * numel == figures["fp32_bytes"] > budget  # the old warm-up exceeds it
    assert figures["conversion"] == figures["steady"] == figures["start"]  # nothing measured: nothing converts
    assert f"{fp32.state_bytes() / budget:.2f}x the budget" in result.detail
    ctl.close()


@pytest.mark.slow  # long; the instruments' allowance is held by default by tests/costs/test_instruments.py
def test_the_instruments_of_a_small_transformer_are_a_fraction_of_its_state() -> None:
    """The tiny decoder (166K parameters, 1.27 MiB of fp32 AdamW state): check reported 10.1 MiB of sampler
    ring and shadow moments before they were sized from the state (a 16 MiB floor); now check's figure and
    what the controller holds (measured) are at most 25% of fp32 AdamW's state, and check's is an upper bound."""
    from lightning_baoc.control.controller import BAOCController
    from lightning_baoc.tools.presets import build_model

    cfg = parse_config({"baoc": {"memory_budget": 0.25}})
    figures = _by_name(run_checks(cfg, build_model("tiny"), "cpu"))["memory budget"].figures
    assert figures["instrument_bytes"] <= 0.25 * figures["fp32_bytes"], figures
    torch.manual_seed(0)
    model = build_model("tiny", device="cpu")
    ctl = BAOCController(memory_budget=0.25, warmup_steps=4, sample_every=1)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    try:
        for step in range(6):
            opt.zero_grad()
            model(torch.randint(0, 512, (2, 16))).float().square().mean().backward()
            ctl.observe(step)
            opt.step()
            ctl.maybe_allocate(step + 1)
        held = ctl.sampler.buffer_bytes() + ctl.shadow.nbytes()
        assert 0 < held <= figures["instrument_bytes"] <= 0.25 * figures["fp32_bytes"], (held, figures)
        assert ctl.last_event is not None and ctl.last_event.instrument_bytes == held
    finally:
        ctl.close()


def test_a_warm_up_above_the_budget_fails_the_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old behaviour (the warm-up in fp32 whatever the budget) fails the check; the start
    allocation within the budget passes it."""
    from lightning_baoc.costs import AllocationProblem, state_phases

    args = ["--config", str(CONFIGS / "language.yaml"), "--device", "cpu", "baoc.memory_budget=0.25"]
    code, out = _check(capsys, *args)
    assert code == 0 and "7 passed" in out and "warm-up" in out

    solved = AllocationProblem.phases

    def fp32_warmup(self: AllocationProblem, *a: object, **kw: object):  # type: ignore[no-untyped-def]
        phases = solved(self, *a, **kw)
        fp32 = dataclasses.replace(phases.start, formats={b: "fp32" for b in phases.start.formats})
        return state_phases(self.shapes, self.device, fp32, phases.steady, phases.budget_bytes, self.min_8bit_numel)

    monkeypatch.setattr(AllocationProblem, "phases", fp32_warmup)
    code, out = _check(capsys, *args)
    assert code == 1 and "1 failed: memory budget" in out
    cfg = load_config(args[1], args[-1:])
    from lightning_baoc.tools.check import resolve_model

    result = _by_name(run_checks(cfg, resolve_model(cfg)[0], "cpu"))["memory budget"]
    assert not result.passed
    assert "over the limit: start" in result.detail and "warm-up" in result.detail and "conversion" in result.detail
    assert result.figures["warm-up"] == result.figures["fp32_bytes"] > result.figures["budget_bytes"]
    assert "set baoc.memory_budget >= 1" in result.fix


def test_an_initial_that_does_not_fit_fails_naming_baoc_initial(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).to("meta")
    good = _by_name(run_checks(parse_config({"baoc": {"memory_budget": 0.4, "initial": {"0": "int8"}}}), model, "cpu"))
    assert good["memory budget"].passed, good["memory budget"]
    bad = parse_config({"baoc": {"memory_budget": 0.4, "initial": {"encoder": "int8"}}})
    result = _by_name(run_checks(bad, model, "cpu"))["memory budget"]
    assert not result.passed and "baoc.initial" in result.detail and "not blocks of this model" in result.detail
    assert "baoc.initial" in result.fix
    missing = parse_config({"baoc": {"memory_budget": 0.4, "initial": str(tmp_path / "nothing.json")}})
    result = _by_name(run_checks(missing, model, "cpu"))["memory budget"]
    assert not result.passed and "cannot read the allocation record" in result.detail


def test_check_for_sgd_and_lion_allows_their_formats_and_budgets_their_state(capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 64)).to("meta")
    numel = sum(p.numel() for p in model.parameters())
    for rule, name in (("sgd", "SGD"), ("lion", "Lion")):
        cfg = parse_config({"baoc": {"memory_budget": 0.3, "formats": ["fp32", "bf16", "int8", "none"]}})
        results = _by_name(run_checks(cfg, model, "cpu", rule))
        budget = results["memory budget"]
        assert results["formats served"].passed and budget.passed, budget.detail
        assert f"of fp32 {name}'s" in budget.detail and budget.figures["fp32_bytes"] == 4 * numel
        assert budget.figures["budget_bytes"] == int(0.3 * 4 * numel)
        # AdamW's formats are not the optimizer's: named, with the fix
        adamw = parse_config({"baoc": {"memory_budget": 0.3, "formats": ["fp32", "int8_factored"]}})
        served = _by_name(run_checks(adamw, model, "cpu", rule))["formats served"]
        assert not served.passed and "['int8_factored']" in served.detail and f"not formats of {name}" in served.detail
    # AdamW's check of the same config: 'none' is not AdamW's
    cfg = parse_config({"baoc": {"memory_budget": 0.3, "formats": ["fp32", "none"]}})
    assert not _by_name(run_checks(cfg, model, "cpu"))["formats served"].passed
    code, out = _check(capsys, "--config", str(CONFIGS / "vision.yaml"), "--device", "cpu", "--optimizer", "sgd",
                       "baoc.formats=[fp32,bf16,int8,none]")
    assert code == 0 and "with SGD on cpu" in out and "of fp32 SGD's" in out
    with pytest.raises(ValueError, match="Invalid optimizer: 'adam'"):
        run_checks(cfg, model, "cpu", "adam")


@pytest.mark.parametrize("corrections", [None, ["none", "ecc8", "ecc16"]], ids=["states", "corrections"])
def test_bf16_true_weights_are_budgeted_as_the_run_budgets_them(corrections: list[str] | None) -> None:
    """``trainer.precision: bf16-true``: a fractional budget is of torch AdamW's state in bf16 (the
    controller's baseline, half of fp32's), and with ``corrections`` the planned start
    is the controller's, states and corrections, byte for byte."""
    from lightning_baoc.control.controller import BAOCController
    from lightning_baoc.tools.presets import build_model

    baoc: dict = {"memory_budget": 0.3}
    if corrections is not None:
        baoc["corrections"] = corrections
    cfg = parse_config({"baoc": baoc, "trainer": {"precision": "bf16-true"}})
    result = _by_name(run_checks(cfg, build_model("tiny"), "cpu"))["memory budget"]
    assert result.passed, result
    assert "of AdamW's state in the weights' bfloat16" in result.detail

    torch.manual_seed(0)
    model = build_model("tiny", device="cpu").to(torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    ctl = BAOCController(memory_budget=0.3, warmup_steps=50, sample_every=5, corrections=corrections)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    figures = result.figures
    assert figures["budget_bytes"] == ctl.memory_budget_bytes() == int(0.3 * 4 * numel)
    assert figures["start"] == figures["warm-up"] == opt.state_bytes() + opt.weight_correction_bytes()
    if corrections is not None:
        assert opt.weight_correction_bytes() > 0  # the start holds corrections, counted in the plan
    ctl.close()


def test_corrections_on_fp32_weights_fail_naming_the_precision() -> None:
    cfg = parse_config({"baoc": {"memory_budget": 0.3, "corrections": ["none", "ecc8"]}})
    result = _by_name(run_checks(cfg, nn.Linear(128, 128, device="meta"), "cpu"))["memory budget"]
    assert not result.passed and "trains no bf16 or fp16 parameter" in result.detail
    assert "trainer.precision: bf16-true" in result.fix
