"""First use of the command line: every ``--help``, exit codes, and budgets read as the user meant.

Regression tests of reliability defects 10 (an absolute time budget against the unitless prior
costs, command-line side), 14 (``plan --help`` crashed on a bare ``%``) and 15 (``plan`` exited 0 on
an infeasible budget; a time budget equal to the fastest allocation was infeasible by rounding; an
int memory budget of one byte next to ``1.0``).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from torch import nn

from lightning_baoc.__main__ import SUBCOMMANDS, main
from lightning_baoc.config.budget import SMALL_INT_BUDGET, format_bytes, format_seconds, parse_memory_budget
from lightning_baoc.config.files import parse_config
from lightning_baoc.solver import BudgetInfeasibleError, solve
from lightning_baoc.tools.check import run_checks
from lightning_baoc.tools.plan import plan

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- 14: --help


@pytest.mark.parametrize("command", [[], *([name] for name in SUBCOMMANDS)], ids=lambda c: " ".join(c) or "top")
def test_help_of_every_subcommand_prints_and_exits_0(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lightning-baoc") and "--help" in out


def test_plan_help_shows_the_percent_forms_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "'35%'" in out and "10% slower" in out and "%%" not in out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


# 3-5 s each, a fresh process: under -m slow; the commands' help in this process is held by default by this file
@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["check", "--help"]])
def test_python_m_help_runs_in_a_fresh_process(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lightning_baoc", *argv], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: lightning-baoc")


@pytest.mark.slow  # a fresh process; help through python -m is held by default in this file
def test_console_script_help() -> None:
    script = shutil.which("lightning-baoc")
    if script is None:
        pytest.skip("the lightning-baoc console script is not installed here (pip install -e . installs it)")
    done = subprocess.run([script, "plan", "--help"], capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--time-budget" in done.stdout


# ---------------------------------------------------------------------------- 10: absolute time, prior costs


def test_plan_refuses_an_absolute_time_budget_without_calibration(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--preset", "tiny", "--device", "cpu", "--budget", "0.5", "--time-budget", "20ms"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--time-budget='20ms': it is an absolute time" in err and "--time-budget=1.2" in err and "--calibrate" in err
    with pytest.raises(ValueError, match=r"time_budget='100000s'.*prior.*calibrate_time=True"):
        plan("tiny", [0.5], device="cpu", time_budget="100000s")
    # a multiple is priced with the prior costs, as before
    assert plan("tiny", [0.5], device="cpu", time_budget=1.2).allocations[0].error is None


def test_check_refuses_an_absolute_time_budget_priced_with_the_prior() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8)).to("meta")
    base = {"memory_budget": 0.5, "formats": ["fp32", "int8", "factored"], "time_budget": "20ms"}
    # calibration 'auto', but the device is not here: the step cannot be measured in seconds
    elsewhere = "mps" if sys.platform != "darwin" else "xpu"
    result = {r.name: r for r in run_checks(parse_config({"baoc": base}), model, elsewhere)}["memory budget"]
    assert not result.passed
    assert "absolute time" in result.detail and "no unit" in result.detail
    assert "baoc.time_budget: 1.2" in result.fix and f"the {elsewhere} device" in result.fix
    # with calibration 'prior' the config itself is refused at load, naming the key
    with pytest.raises(ValueError, match=r"time_budget.*absolute time.*calibration='auto'"):
        parse_config({"baoc": {**base, "calibration": "prior"}})


# ---------------------------------------------------------------------------- 15: exit codes, rounding, int budgets


def test_plan_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "tiny", "--device", "cpu", "--budget", "0.5"]) == 0
    assert main(["plan", "--preset", "tiny", "--device", "cpu", "--budget", "0.005"]) == 1
    err = capsys.readouterr().err
    assert "budget 0.005 is infeasible" in err and "smallest feasible is" in err


def test_time_budget_equal_to_the_fastest_allocation_is_feasible() -> None:
    # ten blocks of 0.1 s: sum() gives 0.9999999999999999, math.fsum() 1.0; a budget read from either
    # is the fastest allocation's time and must admit it
    blocks = [f"b{i}" for i in range(10)]
    risk = {b: {"fp32": 0.0, "int8": 1.0} for b in blocks}
    memory = {b: {"fp32": 8000, "int8": 2000} for b in blocks}
    time = {b: {"fp32": 0.1, "int8": 0.24} for b in blocks}
    plain_sum = sum(row["fp32"] for row in time.values())
    assert plain_sum != math.fsum(row["fp32"] for row in time.values())  # the rounding the test is about
    for budget in (f"{plain_sum!r}s", 1.0, "1.0x"):
        alloc = solve(risk, memory, 1.0, time, budget)
        assert set(alloc.formats.values()) == {"fp32"}
    # just below is infeasible, and the message's fastest time, given back, is feasible
    with pytest.raises(BudgetInfeasibleError, match=r"the fastest is 1 s") as info:
        solve(risk, memory, 1.0, time, "0.999s")
    assert info.value.time_budget == pytest.approx(0.999)


def test_smallest_feasible_in_messages_is_rounded_up() -> None:
    risk = {"a": {"fp32": 0.0, "int8": 1.0}}
    memory = {"a": {"fp32": 8000, "int8": 2000}}
    time = {"a": {"fp32": 1.8812, "int8": 2.5}}
    with pytest.raises(BudgetInfeasibleError, match=r"time_budget 1\.88 s .*the fastest is 1\.89 s") as info:
        solve(risk, memory, 1.0, time, "1.88s")
    assert info.value.min_time == pytest.approx(1.8812)
    assert solve(risk, memory, 1.0, time, "1.89s").formats == {"a": "fp32"}  # the printed value works
    with pytest.raises(BudgetInfeasibleError, match=r"smallest feasible is 1\.96 KiB = 2,000 bytes"):
        solve(risk, memory, 1999)
    assert format_bytes(2001, up=True) == "1.96 KiB" and format_bytes(1023.9 * 1024, up=True) == "1 MiB"
    assert format_seconds(0.0009996, up=True) == "1 ms" and format_seconds(2.0, up=True) == "2 s"


def test_an_int_budget_of_a_few_bytes_warns() -> None:
    with pytest.warns(UserWarning, match=r"memory_budget=1 is an int, read as 1 byte.*1\.0 or 100%"):
        assert parse_memory_budget(1, fp32_bytes=8000, warn_small_int=True) == 1
    with pytest.warns(UserWarning, match=r"memory_budget=35 is an int, read as 35 bytes.*0\.35"):
        parse_memory_budget(35, fp32_bytes=8000, warn_small_int=True)
    # where users write budgets (the callback, check and plan all go through AllocationProblem)
    with pytest.warns(UserWarning, match=r"memory_budget=1 is an int"):
        entry = plan("tiny", [1], device="cpu").allocations[0]
    assert entry.allocation is None and entry.min_memory is not None and entry.min_memory > 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_memory_budget(1, fp32_bytes=8000) == 1  # a table in bytes (the solver's API) stays quiet
        assert parse_memory_budget(1.0, fp32_bytes=8000, warn_small_int=True) == 8000
        assert parse_memory_budget(SMALL_INT_BUDGET, fp32_bytes=8000, warn_small_int=True) == SMALL_INT_BUDGET
        assert parse_memory_budget("1KiB", fp32_bytes=None, warn_small_int=True) == 1024
