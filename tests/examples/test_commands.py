"""The documented commands, run for real (issue 61): a typo in every form ``docs/configuration.md`` shows is
answered in one line that names the key, the key meant and what to write, with nothing else printed (no
traceback, no usage text), and under Hydra each BAOC log line prints once.

The forms: LightningCLI's ``--trainer.callbacks.KEY`` and a YAML file with BAOC under ``trainer.callbacks``
(``examples/cli.py``), Hydra's overrides with and without ``+`` (``examples/hydra_baoc.py``), and OmegaConf
dotlists (``lightning-baoc check``, and ``load_config`` in Python). Each command runs in its own process, as
typed; they start together (the first test to ask starts them all): about 38 s of CPU in all (each 3-8 s,
most of it importing Lightning), so about 20 s on 2 idle cores.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from lightning_baoc.config.files import ConfigError, lightning_cli_errors, load_config, override_errors

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "examples" / "cli.py"
HYDRA = ROOT / "examples" / "hydra_baoc.py"
VISION = ROOT / "configs" / "vision.yaml"
HAS_HYDRA = importlib.util.find_spec("hydra") is not None
#: six commands in processes of their own (about 20 s on 2 cores): under -m slow. The messages themselves are held
#: by default in one process by tests/config/test_files.py (lightning_cli_errors, override_errors, load_config)
pytestmark = pytest.mark.slow
NEEDS_HYDRA = pytest.mark.skipif(not HAS_HYDRA, reason="hydra-core is an optional dependency (the test extra has it)")

#: The LightningCLI command of docs/configuration.md, with a typo in its last argument.
CLI_TYPO = [
    "fit", "--model", "workloads.ViTDigits", "--data", "workloads.DigitsDataModule", "--trainer.max_steps=300",
    "--trainer.callbacks+=lightning_baoc.BAOC", "--trainer.callbacks.memory_budget=0.3",
    "--trainer.callbacks.warmup_stepz=100",
]
#: A short Hydra run of the vision template: warm-up ends at step 8, the allocation report is written.
HYDRA_TRAIN = [
    "baoc.memory_budget=0.3", "baoc.warmup_steps=8", "baoc.sample_every=3", "baoc.report=json",
    "trainer.max_steps=12", "trainer.val_check_interval=6", "data.init_args.batch_size=32",
    "+trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false",
]


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def _commands(tmp: Path) -> dict[str, list[str]]:
    callbacks_yaml = tmp / "callbacks.yaml"
    callbacks_yaml.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "lightning_baoc.BAOC", "init_args": {"memory_budget": 0.3, "warmup_stepz": 100}}]}}))
    py = sys.executable
    commands = {
        "cli_argument": [py, str(CLI), *CLI_TYPO],
        "cli_yaml": [py, str(CLI), "fit", "--model", "workloads.ViTDigits", "--data", "workloads.DigitsDataModule",
                     "--config", str(callbacks_yaml)],
        "omegaconf": [py, "-m", "lightning_baoc", "check", "--config", str(VISION), "baoc.memory_budgett=0.25"],
    }
    if HAS_HYDRA:
        commands["hydra"] = [py, str(HYDRA), "baoc.memory_budgett=0.25"]
        commands["hydra_plus"] = [py, str(HYDRA), "+baoc.memory_budgett=0.25"]
        commands["hydra_train"] = [py, str(HYDRA), *HYDRA_TRAIN, f"trainer.default_root_dir={tmp / 'run'}",
                                   f"hydra.run.dir={tmp / 'hydra'}"]
    return commands


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """Every command, started at once and waited for; output to files (no pipe fills while another is read)."""
    tmp = tmp_path_factory.mktemp("commands")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               LIGHTNING_BAOC_KERNELS="eager", OMP_NUM_THREADS="1")
    env.pop("HYDRA_FULL_ERROR", None)
    started = {}
    for name, argv in _commands(tmp).items():
        out, err = open(tmp / f"{name}.out", "w"), open(tmp / f"{name}.err", "w")  # noqa: SIM115 - closed below
        started[name] = (subprocess.Popen(argv, cwd=tmp, env=env, stdout=out, stderr=err, text=True), out, err)
    done = {}
    for name, (process, out, err) in started.items():
        process.wait(timeout=600)
        out.close()
        err.close()
        done[name] = Ran(process.returncode, (tmp / f"{name}.out").read_text(), (tmp / f"{name}.err").read_text())
    return done


def _only_line(run: Ran) -> str:
    """The one line a refused command printed: on stderr, exit code 2, nothing on stdout."""
    assert run.returncode == 2, run
    assert run.stdout == "" and "Traceback" not in run.stderr and "usage:" not in run.stderr, run
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


# ---------------------------------------------------------------------------- LightningCLI


def test_lightning_cli_argument_typo_is_one_line_with_the_argument_to_write(ran: dict[str, Ran]) -> None:
    line = _only_line(ran["cli_argument"])
    assert line == (
        "cli.py: error: argument '--trainer.callbacks.warmup_stepz=100': trainer.callbacks.warmup_stepz: unknown key "
        "(did you mean trainer.callbacks.warmup_steps?); write --trainer.callbacks.warmup_steps=100"
    )
    # the argument to write, in place of the typo, passes the same check
    import cli  # examples/cli.py

    fixed = [*CLI_TYPO[:-1], line.rpartition("; write ")[2]]
    assert [e for item in cli.cli_inputs(fixed)
            for e in lightning_cli_errors(item.data, item.source, argument=item.argument, callback=item.callback)] == []


def test_lightning_cli_yaml_typo_under_trainer_callbacks_is_one_line_with_the_key_to_rename(ran: dict[str, Ran]) -> None:
    line = _only_line(ran["cli_yaml"])
    path = line.split(": ")[2]
    assert path.endswith("callbacks.yaml") and line == (
        f"cli.py: error: {path}: trainer.callbacks[0].init_args.warmup_stepz: unknown key (did you mean "
        "trainer.callbacks[0].init_args.warmup_steps?); rename warmup_stepz to warmup_steps"
    )


# ---------------------------------------------------------------------------- Hydra


@NEEDS_HYDRA
@pytest.mark.parametrize("name, written", [("hydra", "baoc.memory_budgett=0.25"), ("hydra_plus", "+baoc.memory_budgett=0.25")])
def test_hydra_override_typo_with_or_without_plus_is_one_line_with_the_override_to_write(
    ran: dict[str, Ran], name: str, written: str
) -> None:
    # Hydra itself would answer the first with its advice to write +baoc.memory_budgett=0.25, and apply the second
    assert _only_line(ran[name]) == (
        f"hydra_baoc.py: error: override '{written}': baoc.memory_budgett: unknown key (did you mean "
        "baoc.memory_budget?); write baoc.memory_budget=0.25"
    )
    # what to write composes (the template has memory_budget: no '+'), and passes the check
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(VISION.parent), version_base=None):
        assert compose(config_name="vision", overrides=["baoc.memory_budget=0.25"]).baoc.memory_budget == 0.25
    assert override_errors(["baoc.memory_budget=0.25"], yaml.safe_load(VISION.read_text())) == []


@NEEDS_HYDRA
def test_hydra_run_prints_each_baoc_log_line_once(ran: dict[str, Ran]) -> None:
    run = ran["hydra_train"]
    assert run.returncode == 0, run.stderr[-3000:]
    lines = (run.stdout + run.stderr).splitlines()
    # Hydra's format: "[time][logger][INFO] - message"
    events = [line.partition("][INFO] - ")[2] for line in lines if "][lightning_baoc.integrations][INFO] - " in line]
    starts = ["BAOC: phase warmup, 20 blocks", "BAOC: warmup allocation at step 8: ",
              "BAOC: allocation report written to ", "BAOC memory: planned peak "]
    assert [next((e for e in events if e.startswith(s)), None) is not None for s in starts] == [True] * 4, events
    assert len(events) == 4, events
    for event in events:  # once in all the output: no second handler printed it in another format
        assert sum(event in line for line in lines) == 1, (event, lines)
    assert sum("`Trainer.fit` stopped" in line for line in lines) == 1, lines  # Lightning's own lines too
    assert Counter(line for line in lines if "BAOC" in line).most_common(1)[0][1] == 1


# ---------------------------------------------------------------------------- OmegaConf dotlists


def test_omegaconf_override_typo_is_one_line_with_the_override_to_write(ran: dict[str, Ran]) -> None:
    expected = (
        "override 'baoc.memory_budgett=0.25': baoc.memory_budgett: unknown key (did you mean baoc.memory_budget?); "
        "write baoc.memory_budget=0.25"
    )
    assert _only_line(ran["omegaconf"]) == f"lightning-baoc check: error: {expected}"
    with pytest.raises(ConfigError) as info:  # the same line from Python's load_config (BAOC.from_config)
        load_config(VISION, ["baoc.memory_budgett=0.25"])
    assert str(info.value) == expected and info.value.fix == "write baoc.memory_budget=0.25"
    assert load_config(VISION, ["baoc.memory_budget=0.25"]).baoc.memory_budget == 0.25
