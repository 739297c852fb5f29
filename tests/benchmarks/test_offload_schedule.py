"""``benchmarks/offload_schedule.py`` in its tiny mode on the CPU: every schedule's step and Lightning run measured,
the results written to files, and the page naming the machine, torch's version and the command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import offload_schedule as B
import torch


def test_the_tiny_run_measures_every_schedule_and_writes_its_results(tmp_path: Path) -> None:
    result = B.main(["--tiny", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "offload_schedule.json").read_text())
    assert saved["torch"] == torch.__version__ and saved["device"] == "cpu"
    step = {r["schedule"]: r for r in saved["step"]}
    assert set(step) == {"fp32", "host", "interleaved", "device"}
    for name, row in step.items():
        assert row["params"] == 2_000_000 and row["step_s"] > 0, row
        if name != "fp32":
            # 2M parameters in subgroups of 1 MiB of fp32: 8 subgroups, the model's prediction beside the measure
            assert row["subgroups"] == 8 and row["predicted_s"] > 0 and row["update_s"] > 0, row
    assert step["host"]["device_share"] == 0.0 and step["device"]["device_share"] == 1.0
    assert step["host"]["vs_host"] == 1.0
    train = {r["schedule"]: r for r in saved["train"]}
    assert set(train) == set(step)
    for row in train.values():
        assert row["iteration_s"] > 0 and math.isfinite(row["last_loss"]) and row["last_loss"] < 6.0, row
    # the same trajectory on every schedule: the fp32 step, to fp32 rounding
    losses = [row["last_loss"] for row in train.values()]
    assert max(losses) - min(losses) < 1e-4, losses
    page = (tmp_path / "offload_schedule.md").read_text()
    assert f"torch {torch.__version__}" in page and "Command: `python benchmarks/offload_schedule.py --tiny --out" in page
    assert "| interleaved |" in page and result["step"] == saved["step"]
