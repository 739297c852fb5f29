"""``benchmarks/correction_risk_validation.py``: its ``--quick`` run holds the budget in the correction bytes the
optimizer really allocates, orders the allocations by predicted risk, and writes its results."""

from __future__ import annotations

import json
import math

import correction_risk_validation as V
import pytest
import torch

from lightning_baoc import partition


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.slow  # long; correction risk is held by default by tests/risk/test_correction_risk.py
def test_quick_run_meets_the_budget_and_orders_the_allocations_by_risk(tmp_path) -> None:
    path = tmp_path / "results.json"
    V.main(["--quick", "--json", str(path)])
    results = json.loads(path.read_text())
    for key in ("task", "lr", "warmup_lr", "budget", "warmup", "steps", "orders", "blocks", "risk", "memory",
                "reference", "uniform_none", "allocations", "summary", "same_memory_allocations", "machine",
                "command", "torch"):
        assert key in results, key
    assert results["quick"] is True and results["lr"] == V.LR and results["budget"] == V.BUDGET
    allocs = results["allocations"]
    assert set(allocs) == {"risk-min", "risk-max", "random 0", "random 1"}

    # the budget holds in the bytes the optimizer measures, and those are the table's; the states never change
    full = results["ecc16_bytes"]
    assert results["reference"]["correction_bytes"] == full == 2 * results["parameters"]
    assert results["uniform_none"]["correction_bytes"] == results["uniform_none"]["memory"] == 0
    states = {results["reference"]["state_bytes"]} | {a["state_bytes"] for a in allocs.values()}
    assert len(states) == 1
    for label, a in allocs.items():
        assert a["correction_bytes"] == a["memory"] <= results["budget"] * full, label
        assert set(a["corrections"].values()) <= {"none", "ecc8", "ecc16"}
    # the budget is tight: some block must drop to none; risk-max and the randoms spend the same memory
    assert "none" in allocs["risk-min"]["corrections"].values()
    for label in ("risk-max", "random 0", "random 1"):
        assert allocs[label]["memory"] >= V.SPEND * results["budget"] * full, label

    # predicted risk: risk-min <= every random allocation <= risk-max, and risk falls with more correction bits
    lo, hi = allocs["risk-min"]["predicted_risk"], allocs["risk-max"]["predicted_risk"]
    for k in ("random 0", "random 1"):
        assert lo <= allocs[k]["predicted_risk"] <= hi, k
    assert lo < hi
    for block, row in results["risk"].items():
        assert row["none"] >= row["ecc8"] >= row["ecc16"] >= 0.0, block

    # one paired harm per data order, finite; the summary is computed from them
    for a in [*allocs.values(), results["uniform_none"]]:
        assert len(a["harm_end"]) == len(a["harm_path"]) == results["orders"] == 2
        assert all(math.isfinite(h) for h in a["harm_end"] + a["harm_path"])
    diffs = [h - lo_h for h, lo_h in zip(allocs["risk-max"]["harm_end"], allocs["risk-min"]["harm_end"])]
    assert results["summary"]["max_minus_min"]["mean"] == pytest.approx(sum(diffs) / 2)


def test_memory_table_is_the_optimizers_own_accounting() -> None:
    task = V.bf16_digits_task(V.LR)
    model = task.make_model()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    blocks = partition(model)
    opt = V.make_optimizer(model, task.lr)
    table = V.memory_table(opt, blocks)
    corrections = {b: c for b, c in zip(blocks, ["none", "ecc8", "ecc16"] * 3)}
    task.loss(model, 0, torch.Generator().manual_seed(0)).backward()
    opt.step()
    opt.set_weight_corrections(corrections, blocks=blocks)
    assert opt.weight_correction_bytes() == sum(table[b][c] for b, c in corrections.items())
