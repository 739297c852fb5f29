"""LightningCLI: BAOC as ``--trainer.callbacks+=lightning_baoc.BAOC`` (plain LightningCLI and
``examples/cli.py``), its ``--help``, and ``examples/cli.py``'s ``baoc`` section from a template."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.cli import LightningCLI

from lightning_baoc import BAOC

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
    for key in ("--baoc.memory_budget", "--baoc.allowed_configs", "--baoc.block_id.patterns",
                "--baoc.risk_thresholds.max_block_risk", "--baoc.re_evaluation_trigger.monitor",
                "--baoc.sampler.sample_every"):
        assert key in out, key


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
    assert info.value.code != 0 and "memroy_budget" in capsys.readouterr().err


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
            "--baoc.warmup_steps=8", "--baoc.sampler.sample_every=3", "--baoc.report=false",
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
        "--data.init_args.batch_size=16", "--baoc.warmup_steps=4", "--baoc.sampler.sample_every=2",
        "--baoc.report=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    ]
    for _ in range(2):
        the_cli = cli.main(args)
        assert the_cli.trainer.global_step == steps
    saved = tmp_path / "lightning_logs" / "vision" / "config.yaml"
    assert saved.is_file() and "memory_budget: 0.25" in saved.read_text()
