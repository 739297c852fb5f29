"""``benchmarks/momentum_risk_validation.py``: its ``--quick`` run for both optimizers holds the budget in
the bytes the optimizer really allocates, orders the allocations by predicted risk, and writes its results."""

from __future__ import annotations

import json
import math

import momentum_risk_validation as V
import pytest
import torch

from lightning_baoc import partition


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("lion", marks=pytest.mark.slow)])  # Lion: the same script
def test_quick_run_meets_the_budget_and_orders_the_allocations_by_risk(optimizer: str, tmp_path) -> None:
    path = tmp_path / "results.json"
    V.main(["--optimizer", optimizer, "--quick", "--json", str(path)])
    results = json.loads(path.read_text())
    for key in ("task", "optimizer", "lr", "budget", "warmup", "steps", "orders", "blocks", "risk", "memory",
                "fp32", "allocations", "summary", "machine", "command", "torch"):
        assert key in results, key
    assert results["optimizer"] == optimizer and results["quick"] is True
    allocs = results["allocations"]
    assert set(allocs) == {"risk-min", "risk-max", "random 0", "random 1"}

    # the budget holds in the bytes the optimizer measures, and those are the solver's table
    fp32 = results["fp32_state_bytes"]
    assert results["fp32"]["state_bytes"] == fp32 == 4 * results["parameters"]
    for label, a in allocs.items():
        assert a["state_bytes"] == a["memory"] <= results["budget"] * fp32, label
        assert set(a["formats"].values()) <= set(V.FORMATS)
    # the budget (0.25 of fp32) is tight: int8 alone does not fit, some block must drop its momentum
    assert "none" in allocs["risk-min"]["formats"].values()
    assert allocs["risk-max"]["memory"] >= 0.95 * results["budget"] * fp32  # risk-max spends the same memory

    # predicted risk: risk-min <= every random allocation <= risk-max
    lo, hi = allocs["risk-min"]["predicted_risk"], allocs["risk-max"]["predicted_risk"]
    for k in ("random 0", "random 1"):
        assert lo <= allocs[k]["predicted_risk"] <= hi, k
    assert lo < hi

    # one paired harm per data order, finite; the summary is computed from them
    for a in allocs.values():
        assert len(a["harm_end"]) == len(a["harm_path"]) == results["orders"] == 2
        assert all(math.isfinite(h) for h in a["harm_end"] + a["harm_path"])
    diffs = [h - lo_h for h, lo_h in zip(allocs["risk-max"]["harm_end"], allocs["risk-min"]["harm_end"])]
    assert results["summary"]["max_minus_min"]["mean"] == pytest.approx(sum(diffs) / 2)


def test_memory_table_is_the_optimizers_own_accounting() -> None:
    task = V.momentum_digits_task(0.01)
    model = task.make_model()
    blocks = partition(model)
    opt = V.make_optimizer("sgd", model, task.lr)
    table = V.memory_table(opt, blocks)
    formats = {b: fmt for b, fmt in zip(blocks, ["none", "int8", "bf16", "fp32"] * 2)}
    task.loss(model, 0, torch.Generator().manual_seed(0)).backward()
    opt.step()
    opt.set_formats(formats, blocks=blocks)
    assert opt.state_bytes() == sum(table[b][f] for b, f in formats.items())
    head = list(blocks)[-1]  # the 1,280-element head stays out of 8 bits (min_8bit_numel)
    assert table[head]["int8"] == table[head]["fp32"]
