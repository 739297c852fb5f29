"""LightningCLI: BAOC as ``--trainer.callbacks+=lightning_baoc.BAOC`` (plain LightningCLI and
``examples/cli.py``), its ``--help``, ``examples/cli.py``'s ``baoc`` section from a template, and the
errors of a config on that path: all of them at once, each with its suggestion, without the usage text."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI

from lightning_baoc import BAOC
from lightning_baoc.config.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[2]

import cli  # noqa: E402  (examples/cli.py)
import workloads  # noqa: E402

QUIET = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # pytest's own arguments are not the CLI's
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _baoc(trainer) -> BAOC:
    (baoc,) = [cb for cb in trainer.callbacks if isinstance(cb, BAOC)]
    return baoc


CALLBACK_ARGS = [
    "--trainer.callbacks+=lightning_baoc.BAOC",
    "--trainer.callbacks.memory_budget=0.3",
    "--trainer.callbacks.warmup_steps=50",
]


def test_plain_lightning_cli_takes_baoc_as_a_callback(tmp_path: Path) -> None:
    the_cli = LightningCLI(
        workloads.ViTDigits,
        workloads.DigitsDataModule,
        run=False,
        args=[*CALLBACK_ARGS, *QUIET, f"--trainer.default_root_dir={tmp_path}"],
    )
    baoc = _baoc(the_cli.trainer)
    assert baoc.config.memory_budget == 0.3 and baoc.config.warmup_steps == 50
    assert baoc.config.sample_every == 10  # the other arguments keep their defaults


def test_example_cli_takes_baoc_as_a_callback(tmp_path: Path) -> None:
    the_cli = cli.main(
        ["--model=workloads.ViTDigits", "--data=workloads.DigitsDataModule", *CALLBACK_ARGS, *QUIET,
         f"--trainer.default_root_dir={tmp_path}"],
        run=False,
    )
    assert _baoc(the_cli.trainer).config.memory_budget == 0.3


def test_callback_help_lists_the_baoc_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        LightningCLI(workloads.ViTDigits, workloads.DigitsDataModule, run=False,
                     args=["--trainer.callbacks.help", "lightning_baoc.BAOC"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in inspect.signature(BAOC.__init__).parameters:
        if name != "self":
            assert f"--trainer.callbacks.{name}" in out, name
    assert "memory budget" in out.lower() or "memory_budget" in out


def test_example_cli_help_lists_the_baoc_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--baoc.help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for s in SETTINGS:  # the section's options are BAOC's arguments, as the callback's are
        assert f"--baoc.{s.name} " in out, s.name


def test_example_cli_reads_a_template_and_a_budget_override(tmp_path: Path) -> None:
    the_cli = cli.main(
        ["--config", str(ROOT / "configs" / "language.yaml"), "--baoc.memory_budget=0.25", *QUIET,
         f"--trainer.default_root_dir={tmp_path}"],
        run=False,
    )
    baoc = _baoc(the_cli.trainer)
    assert baoc.config.memory_budget == 0.25
    assert baoc.config.monitor == "val_ppl" and "nomomentum_int8" not in baoc.config.formats
    assert baoc.config.blocks["head"] == ["lm_head.*"]
    assert isinstance(the_cli.model, workloads.CharGPT) and the_cli.model.max_steps == 400  # ${trainer.max_steps}


def test_example_cli_rejects_an_unknown_baoc_key_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--config", str(ROOT / "configs" / "vision.yaml"), "--baoc.memroy_budget=0.2"], run=False)
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "cli.py: error: argument '--baoc.memroy_budget=0.2': baoc.memroy_budget: unknown key (did you mean "
        "baoc.memory_budget?); write --baoc.memory_budget=0.2\n"
    )


def test_example_cli_checks_the_callbacks_arguments_of_the_last_callback_added_when_it_is_baoc(tmp_path: Path) -> None:
    # jsonargparse's rule: --trainer.callbacks.KEY sets the last callback added, by an argument or a config file
    path = tmp_path / "callbacks.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [{"class_path": "lightning_baoc.BAOC"}]}}))
    args = [
        "--config", str(path), "--trainer.callbacks.sampel_every=5",  # BAOC, from the file
        "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping", "--trainer.callbacks.patiense=3",  # not ours
        "--trainer.callbacks+=lightning_baoc.BAOC", "--trainer.callbacks.init_args.memroy_budget", "0.3",
        "--trainer.callbacks.help", "lightning_baoc.BAOC",
    ]
    inputs = [item for item in cli.cli_inputs(args) if item.argument is not None]
    assert [(item.argument, item.data, item.callback) for item in inputs] == [
        ("--trainer.callbacks.sampel_every=5", {"trainer": {"callbacks": {"sampel_every": 5}}}, "lightning_baoc.BAOC"),
        ("--trainer.callbacks.init_args.memroy_budget 0.3",
         {"trainer": {"callbacks": {"init_args": {"memroy_budget": 0.3}}}}, "lightning_baoc.BAOC"),
    ]


def _typos(d: dict[str, Any]) -> None:
    d["baoc"]["sampel_every"] = d["baoc"].pop("sample_every")
    d["baoc"]["calibration"] = {"mode": "prior"}  # 0.1.0's nested key
    d["baoc"]["hysteresis"] = -1
    d["trainer"]["max_step"] = 10


def test_example_cli_reports_every_error_of_a_config_with_suggestions_not_the_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load((ROOT / "configs" / "vision.yaml").read_text())
    _typos(data)
    data["trainer"]["callbacks"] = [{"class_path": "lightning_baoc.BAOC", "init_args": {"memory_budget": 0.3, "warmup": 9}}]
    path = tmp_path / "typos.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", str(path), "--trainer.max_epoch=2", "--baoc.granularity", "layers"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == "\n".join([
        "cli.py: error: 7 errors in the LightningCLI config:",
        f"  {path}: baoc.hysteresis: invalid value -1; expected a finite number >= 0.0",
        f"  {path}: baoc.calibration.mode: unknown key; the key is now baoc.calibration",
        f"  {path}: baoc.sampel_every: unknown key (did you mean baoc.sample_every?); rename sampel_every to sample_every",
        f"  {path}: trainer.max_step: unknown key (did you mean trainer.max_steps?): not an argument of lightning.Trainer; "
        "rename max_step to max_steps",
        f"  {path}: trainer.callbacks[0].init_args.warmup: unknown key (did you mean "
        "trainer.callbacks[0].init_args.warmup_steps?); rename warmup to warmup_steps",
        "  argument '--trainer.max_epoch=2': trainer.max_epoch: unknown key (did you mean trainer.max_epochs?): not an "
        "argument of lightning.Trainer; write --trainer.max_epochs=2",
        "  argument '--baoc.granularity layers': baoc.granularity: invalid value 'layers'; allowed: ['module', "
        "'layer', 'param'] (did you mean 'layer'?)",
        "",
    ])
    assert "usage:" not in err


def test_example_cli_reports_a_rule_of_the_merged_section_without_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    # each input is fine alone; merged, the template's warm-up (100 steps) is too short for sample_every=150
    with pytest.raises(SystemExit) as info:
        cli.main(["--config", str(ROOT / "configs" / "vision.yaml"), "--baoc.sample_every=150", *QUIET], run=False)
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "cli.py: error: the baoc section (--config files and --baoc arguments merged): baoc.warmup_steps: Invalid "
        "warmup_steps=100 for sample_every=150: the statistics need 2 gradient samples, taken at steps 0 and 150; "
        "use warmup_steps >= 152 or a smaller sample_every\n"
    )


def test_example_cli_refuses_baoc_twice(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="configured twice"):
        cli.main(["--config", str(ROOT / "configs" / "vision.yaml"), *CALLBACK_ARGS, *QUIET], run=False)


def test_example_cli_fit_allocates(tmp_path: Path) -> None:
    steps = 14
    the_cli = cli.main(
        [
            "fit",
            "--config", str(ROOT / "configs" / "vision.yaml"),
            f"--trainer.max_steps={steps}", f"--model.init_args.max_steps={steps}",
            "--trainer.val_check_interval=7", "--data.init_args.batch_size=32",
            "--baoc.warmup_steps=8", "--baoc.sample_every=3", "--baoc.report=false",
            *QUIET, f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    baoc = _baoc(the_cli.trainer)
    assert the_cli.trainer.global_step == steps and baoc.phase == "allocated"
    opt = the_cli.trainer.optimizers[0]
    fp32 = 8 * sum(p.numel() for p in the_cli.model.parameters())
    assert opt.state_bytes() <= 0.35 * fp32


def test_documented_template_command_runs_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/configuration.md's command as written (the template's own default_root_dir, logger: false), run twice in
    # one directory: the second run must not stop on the config.yaml the first one saved
    monkeypatch.chdir(tmp_path)
    steps = 6
    args = [
        "fit", "--config", str(ROOT / "configs" / "vision.yaml"), "--baoc.memory_budget=0.25",
        f"--trainer.max_steps={steps}", f"--model.init_args.max_steps={steps}", "--trainer.val_check_interval=3",
        "--data.init_args.batch_size=16", "--baoc.warmup_steps=4", "--baoc.sample_every=2",
        "--baoc.report=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    ]
    for _ in range(2):
        the_cli = cli.main(args)
        assert the_cli.trainer.global_step == steps
    saved = tmp_path / "lightning_logs" / "vision" / "config.yaml"
    assert saved.is_file() and "memory_budget: 0.25" in saved.read_text()
