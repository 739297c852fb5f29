"""A reduced ``benchmarks/risk_validation.py``: does the risk model predict measured harm?

A 2-layer character GPT (width 32) on the standard library's source, a shared fp32 warm-up, then
paired continuations (same data order) at a constant learning rate under a tight budget (0.2 of
fp32 AdamW state). The risk-minimizing allocation must end with a lower held-out loss than the
risk-maximizing one and than the median of random allocations of the same memory, in every data
order and on average by more than the noise floor (twice the standard error of the paired
differences). The full benchmark (more steps, orders, a block-level Spearman test, a digits task)
writes its tables into the README.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import risk_validation as rv  # noqa: E402

from lightning_baoc import partition  # noqa: E402
from lightning_baoc.formats import format_state_bytes  # noqa: E402
from lightning_baoc.solver import solve  # noqa: E402

BUDGET = 0.2
ORDERS = (0, 1, 2)
RANDOM = 3


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        task = rv.chargpt_task(n_layer=2, n_embd=32, eval_seqs=32)
        model = task.make_model()
        blocks = partition(model)
        warm = rv.warm_up(task, 150)
        _, opt = rv.restore(task, warm)
        steps = 120
        details = rv.risk_details(opt, blocks, horizon=steps)
        risk = {b: {f: d.risk[f] for f in ["fp32", *rv.CHEAP]} for b, d in details.items()}
        shapes = {n: p.shape for n, p in model.named_parameters()}
        memory = {
            b: {f: sum(format_state_bytes(f, shapes[n], 0) for n in names) for f in risk[b]} for b, names in blocks.items()
        }
        allocations = {"risk-min": solve(risk, memory, BUDGET).formats}
        allocations["risk-max"] = rv.riskiest(risk, memory, BUDGET)
        for k in range(RANDOM):
            gen = torch.Generator().manual_seed(100 + k)
            rnd = {b: {f: float(torch.rand(1, generator=gen)) for f in r} for b, r in risk.items()}
            allocations[f"random {k}"] = solve(rnd, memory, BUDGET).formats
        run = rv.Runs(task, warm, blocks, steps, tmp_path_factory.mktemp("rv") / "cache.json", {"test": 1})
        base = {o: run({}, o)[0] for o in ORDERS}
        harm = {label: [run(a, o)[0] - base[o] for o in ORDERS] for label, a in allocations.items()}
        fraction = {
            label: sum(memory[b][f] for b, f in a.items()) / sum(m["fp32"] for m in memory.values())
            for label, a in allocations.items()
        }
    finally:
        torch.set_num_threads(threads)
    for label, h in harm.items():  # shown with -s
        print(f"{label}: memory {fraction[label]:.3f} of fp32, harm by order {[round(x, 4) for x in h]}")
    return {"harm": harm, "fraction": fraction}


def _mean_and_floor(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), 2 * statistics.stdev(xs) / math.sqrt(len(xs))


def test_allocations_use_the_same_memory(measured: dict) -> None:
    for label, fraction in measured["fraction"].items():
        assert fraction <= BUDGET + 1e-9, label
        assert fraction > 0.9 * BUDGET, (label, fraction)  # all spend the budget: a fair comparison


def test_risk_min_beats_risk_max_beyond_noise(measured: dict) -> None:
    harm = measured["harm"]
    paired = [hi - lo for hi, lo in zip(harm["risk-max"], harm["risk-min"])]
    mean, floor = _mean_and_floor(paired)
    assert all(d > 0 for d in paired), paired
    assert mean > floor, (mean, floor, paired)


def test_risk_min_beats_the_median_random_allocation_beyond_noise(measured: dict) -> None:
    harm = measured["harm"]
    randoms = [k for k in harm if k.startswith("random")]
    paired = [statistics.median(harm[k][i] for k in randoms) - harm["risk-min"][i] for i in range(len(ORDERS))]
    mean, floor = _mean_and_floor(paired)
    assert all(d > 0 for d in paired), paired
    assert mean > floor, (mean, floor, paired)
