"""``lightning-baoc check`` on the shipped templates as the README writes them (``configs/*.yaml`` name
models of ``examples/``, found there without ``PYTHONPATH``), and the check saying the same bytes as the
callback for the same model and budget."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_baoc import BAOC
from lightning_baoc.config.budget import format_bytes
from lightning_baoc.config.files import load_config
from lightning_baoc.solver import BudgetInfeasibleError
from lightning_baoc.tools.check import run_checks
from lightning_baoc.tools.models import build_component, example_folder

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lightning-baoc ARGS`` in a fresh process whose Python path holds the package and nothing of
    ``examples/`` (``python -m lightning_baoc`` is the console script's ``main``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "lightning_baoc", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow  # checks every template; the templates' configs are held by default in this file
def test_check_finds_the_templates_models_beside_their_configs_and_says_so() -> None:
    """README: ``lightning-baoc check --config configs/vision.yaml`` from the checkout, no PYTHONPATH."""
    out = _cli("check", "--config", "configs/vision.yaml", cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "7 passed, 0 failed" in out.stdout
    assert (f"workloads.ViTDigits: not importable from the Python path; imported from {ROOT / 'examples'} (the "
            f"examples/ folder beside the config's folder)") in out.stdout, out.stdout[:2000]


@pytest.mark.slow  # 11 s: a fresh lightning-baoc process; the templates' check beside it runs by default
def test_a_config_without_examples_beside_it_names_the_fix(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "vision.yaml", tmp_path / "configs" / "vision.yaml")
    out = _cli("check", "--config", "configs/vision.yaml", cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip() == (
        "lightning-baoc check: error: cannot import 'workloads' of model.class_path='workloads.ViTDigits': No module "
        "named 'workloads'; put its directory on PYTHONPATH (PYTHONPATH=examples for the templates' models, when the "
        "config is not in a configs/ folder beside examples/), or pass --model"
    ), out.stderr


def test_example_folder_is_only_the_fallback(tmp_path: Path) -> None:
    config = ROOT / "configs" / "vision.yaml"
    assert example_folder("torch.nn.Linear", config) is None  # importable as it is
    assert example_folder("no_such_module.Model", config) is None  # not in examples/ either
    assert example_folder("workloads.ViTDigits", None) is None  # no config file: nothing to look beside
    assert example_folder("workloads.ViTDigits", tmp_path / "configs" / "x.yaml") is None


def _smallest(text: str) -> str:
    found = re.search(r"smallest feasible (?:budget with the allowed formats \[[^]]*\] )?is ([\d.]+ \w+)", text)
    assert found, text
    return found.group(1)


def test_check_and_the_callback_name_the_same_smallest_feasible_budget() -> None:
    """The language template at 0.1% of AdamW's state: the smallest feasible budget is 63,008 bytes =
    61.53 KiB. The check rounded it to the nearest (61.5 KiB, which is infeasible if given back), the
    callback's error up (61.6 KiB); both round up now, as a smallest feasible figure must."""
    path, overrides = ROOT / "configs" / "language.yaml", ["baoc.memory_budget=0.001"]
    config = load_config(path, overrides)
    meta = build_component(config.model, "meta", search=[ROOT / "examples"])
    check = {r.name: r for r in run_checks(config, meta, "cpu")}["memory budget"]
    assert not check.passed

    torch.manual_seed(0)
    model = build_component(config.model, "cpu", search=[ROOT / "examples"])
    callback = BAOC.from_config(path, overrides)
    with pytest.raises(BudgetInfeasibleError) as info:  # what the callback runs at fit start
        callback.controller.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
        callback.controller.check_feasible()
    callback.controller.close()
    assert _smallest(check.detail) == _smallest(str(info.value)) == format_bytes(63008, up=True) == "61.6 KiB"
    assert ">= 63008 bytes" in check.fix


def test_check_and_the_callback_report_the_same_state_and_budget() -> None:
    """A feasible budget: the check's budget and start state are the callback's after its first step, in
    bytes and as printed."""
    path, overrides = ROOT / "configs" / "vision.yaml", ["baoc.memory_budget=0.026"]
    config = load_config(path, overrides)
    check = {r.name: r for r in run_checks(config, build_component(config.model, search=[ROOT / "examples"]), "cpu")}
    figures = check["memory budget"].figures

    torch.manual_seed(0)
    model = build_component(config.model, "cpu", search=[ROOT / "examples"])
    callback = BAOC.from_config(path, overrides)
    optimizer = callback.controller.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    summary = callback.controller.summary_line()
    callback.controller.close()
    assert (figures["budget_bytes"], figures["start"]) == (callback.controller.memory_budget_bytes(), optimizer.state_bytes())
    assert f"optimizer state {format_bytes(figures['start'])} of" in summary
    assert f"(budget {format_bytes(figures['budget_bytes'])})" in summary
    assert f"start {format_bytes(figures['start'])}," in check["memory budget"].detail
