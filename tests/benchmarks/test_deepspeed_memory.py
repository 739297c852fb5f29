"""``benchmarks/deepspeed_memory.py``'s dry run on the CPU: BAOC's state under ZeRO-3 within its budget of plain
DeepSpeed AdamW's, the table written (slow: two fresh processes, about 15 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (the deepspeed extra)")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_dry_run_measures_baoc_beside_deepspeed_adamw(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "benchmarks/deepspeed_memory.py", "--accelerator", "cpu", "--size", "tiny",
                           "--steps", "8", "--stages", "3", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    adamw, baoc = json.loads(out.read_text())
    assert adamw["row"] == "adamw" and baoc["row"] == "baoc" and adamw["steps"] == baoc["steps"] == 8
    assert adamw["state_bytes"] == 8 * adamw["params"]  # DeepSpeed's fp32 moments, one rank
    assert 0 < baoc["state_bytes"] <= 0.25 * adamw["state_bytes"] and baoc["formats"] != ["fp32"]
    assert "| ZeRO-3 | BAOC(memory_budget=0.25) |" in proc.stdout and "Command:" in proc.stdout
