"""What ``lightning-baoc plan`` prints: the device it planned for (the default said as such) and, for an
infeasible budget, the reason and the smallest feasible budget instead of empty tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_baoc.__main__ import main
from lightning_baoc.tools.plan import DEFAULT_DEVICE, plan


@pytest.fixture(autouse=True)
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """A console wide enough that rich wraps no table cell (it reads COLUMNS)."""
    monkeypatch.setenv("COLUMNS", "300")


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", "--preset", "tiny", *args])
    captured = capsys.readouterr()
    return code, " ".join(captured.out.split()), " ".join(captured.err.split())  # rich wraps long lines


def test_an_infeasible_budget_prints_its_reason_and_the_smallest_feasible_budget(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "plan.json"
    code, out, err = _plan(capsys, "--device", "cpu", "--budget", "0.01", "--json", str(out_json))
    assert code == 1
    reason = ("Budget 0.01 is infeasible: memory_budget 13 KiB (0.01 of fp32 AdamW) cannot be met: the smallest "
              "feasible is 15.4 KiB (0.0119 of fp32 AdamW). Raise a budget, allow more formats, or unmask one")
    assert reason in out, out
    assert ("The smallest feasible budget is 15.4 KiB = 15,744 bytes (0.0119 of fp32 AdamW): pass --budget 0.0119 "
            "or more (or --budget 15.4KiB)") in out, out
    # no table without rows: the phases and the training memory exist for feasible budgets only
    assert "Training memory per parameter" not in out and "by phase" not in out
    assert "lightning-baoc plan: budget 0.01 is infeasible:" in err
    assert json.loads(out_json.read_text())["allocations"][0]["error"].startswith("memory_budget 13 KiB")
    # the budgets it names are feasible
    for given in ("0.0119", "15.4KiB"):
        assert main(["plan", "--preset", "tiny", "--device", "cpu", "--budget", given]) == 0, given
    capsys.readouterr()


def test_a_feasible_and_an_infeasible_budget_print_the_tables_of_the_feasible_one(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan(capsys, "--device", "cpu", "--budget", "0.01", "--budget", "0.5")
    assert code == 1
    assert "Budget 0.01 is infeasible" in out and "Budget 0.5 is infeasible" not in out
    assert "Training memory per parameter" in out and "at budget 0.5" in out and "at budget 0.01" not in out


def test_the_default_device_is_said_with_how_to_change_it(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan(capsys, "--budget", "0.5")
    assert code == 0 and DEFAULT_DEVICE == "cuda"
    if torch.cuda.is_available():
        here = f"this machine's GPU, {torch.cuda.get_device_name(0)}, whose bf16 support is checked"
    else:
        here = "a GPU elsewhere: this machine has none, so the GPU's bf16 support is not checked"
    assert "lightning-baoc plan: tiny on cuda" in out
    assert f"planned for │ cuda, the default ({here}); --device cpu plans for the CPU" in out, out

    code, out, _ = _plan(capsys, "--budget", "0.5", "--device", "cpu")
    assert code == 0 and "planned for │ cpu (--device) │" in out and "the default" not in out


def test_the_plan_records_whether_its_device_was_the_default() -> None:
    assert plan("tiny").device_default and plan("tiny").device == "cuda"
    given = plan("tiny", device="cuda")
    assert not given.device_default and given.to_dict()["device_default"] is False


def test_json_to_standard_output_is_alone_there(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--json -`` wrote a file named ``-``; it writes the plan to standard output, and nothing else goes there
    (the tables go to standard error), so ``lightning-baoc plan --json - | jq`` reads it."""
    monkeypatch.chdir(tmp_path)
    code = main(["plan", "--preset", "tiny", "--device", "cpu", "--budget", "0.5", "--budget", "0.01", "--json", "-"])
    captured = capsys.readouterr()
    assert code == 1 and not (tmp_path / "-").exists() and list(tmp_path.iterdir()) == []
    data = json.loads(captured.out)  # the whole of stdout is the JSON
    expected = json.loads(json.dumps(plan("tiny", ["0.5", "0.01"], device="cpu").to_dict()))
    assert data == expected and [a["budget"] for a in data["allocations"]] == ["0.5", "0.01"]
    assert data["allocations"][1]["error"].startswith("memory_budget 13 KiB")
    err = " ".join(captured.err.split())
    assert "lightning-baoc plan: tiny on cpu" in err and "at budget 0.5" in err  # the tables, on stderr
    assert "lightning-baoc plan: budget 0.01 is infeasible:" in err
