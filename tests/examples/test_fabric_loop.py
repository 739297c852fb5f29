"""``examples/fabric_loop.py``: it writes where git does not look, and its resume says it resumed (into
which allocation) without a warm-up line before it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import fabric_loop
import pytest

import lightning_baoc.integrations.fabric as fabric_strategy

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_default_output_is_ignored_by_git() -> None:
    written = [f"{fabric_loop.OUT}/{name}" for name in ("checkpoint.pt", "baoc_allocation.json", "baoc_allocation.png")]
    out = subprocess.run(["git", "check-ignore", *written], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == written, out.stdout + out.stderr


def test_the_resume_says_it_resumed_into_the_allocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(fabric_strategy, "rank_zero_info", print)  # the strategy's lines, in order with the loop's
    result = fabric_loop.main(["--epochs", "1", "--warmup", "12", "--out", str(tmp_path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("BAOC: ", "epoch ", "optimizer state"))]
    assert result["resumed_same"] == 1.0
    assert lines[0].startswith("BAOC: phase warmup, 5 blocks, optimizer state ") and " 0 B " not in lines[0], lines
    epoch = max(i for i, line in enumerate(lines) if line.startswith("epoch "))
    after = lines[epoch + 1 :]
    assert len(after) == 2 and after[1].startswith("optimizer state "), after  # the resume: one line, then the check
    assert after[0].startswith("BAOC: resumed at step 22 into the allocation of step 12 (5 blocks: "), after
    assert "phase warmup" not in " ".join(after)
