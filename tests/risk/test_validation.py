"""A reduced ``benchmarks/risk_validation.py`` (its three measured tests are marked slow: ``pytest -m slow``):

A 2-layer character GPT (width 32) on the standard library's source, a shared fp32 warm-up, then
paired continuations (same data order) at a constant learning rate under a tight budget (0.2 of
fp32 AdamW state). The risk-minimizing allocation must end with a lower held-out loss than the
risk-maximizing one and than the median of random allocations of the same memory, in every data
order and on average by more than the noise floor (twice the standard error of the paired
differences). The full benchmark (more steps, orders, a block-level Spearman test, a digits task)
writes its tables into ``docs/benchmarks/risk-validation.md``.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import risk_validation as rv  # noqa: E402
import torch

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


@pytest.mark.slow  # the measurement behind them: about 100 s on 2 cores (pytest -m slow)
def test_allocations_use_the_same_memory(measured: dict) -> None:
    for label, fraction in measured["fraction"].items():
        assert fraction <= BUDGET + 1e-9, label
        assert fraction > 0.9 * BUDGET, (label, fraction)  # all spend the budget: a fair comparison


@pytest.mark.slow  # the measurement behind them: about 100 s on 2 cores (pytest -m slow)
def test_risk_min_beats_risk_max_beyond_noise(measured: dict) -> None:
    harm = measured["harm"]
    paired = [hi - lo for hi, lo in zip(harm["risk-max"], harm["risk-min"])]
    mean, floor = _mean_and_floor(paired)
    assert all(d > 0 for d in paired), paired
    assert mean > floor, (mean, floor, paired)


@pytest.mark.slow  # the measurement behind them: about 100 s on 2 cores (pytest -m slow)
def test_risk_min_beats_the_median_random_allocation_beyond_noise(measured: dict) -> None:
    harm = measured["harm"]
    randoms = [k for k in harm if k.startswith("random")]
    paired = [statistics.median(harm[k][i] for k in randoms) - harm["risk-min"][i] for i in range(len(ORDERS))]
    mean, floor = _mean_and_floor(paired)
    assert all(d > 0 for d in paired), paired
    assert mean > floor, (mean, floor, paired)


def test_harm_correlation_counts_harms_above_noise_and_ranks_them_alone() -> None:
    predicted = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # per-order harms: means -0.5, 0.05, 0.3, 0.2, 0.6, 0.9 with standard errors 0.1, 0.1, 0.1, 0.05, 0.1, 0.5
    harms = [[-0.4, -0.6], [0.15, -0.05], [0.4, 0.2], [0.25, 0.15], [0.7, 0.5], [1.4, 0.4]]
    c = rv.harm_correlation(predicted, harms)
    assert c.rho == pytest.approx(1 - 6 * 2 / (6 * 35))  # one swapped pair (3, 4) over all six
    assert c.above == 3  # 0.3, 0.2, 0.6 stand beyond 2 sem; 0.05 and 0.9 (sem 0.5) do not
    assert c.gains == 1  # -0.5 is a gain, not a harm
    assert c.rho_above == pytest.approx(0.5)  # ranks 2,1,3 against 1,2,3
    assert c.rho_above_sd == 0.0  # every redraw of the two orders keeps the ranks 2,1,3
    assert 0.0 < c.rho_sd < 0.5
    assert math.isnan(rv.harm_correlation([1.0, 2.0], [[1.0, 1.1], [2.0, 2.1]]).rho_above)


def test_harm_correlation_noise_floor_shrinks_with_orders() -> None:
    """The bootstrap noise floor of the Spearman comes from the spread over data orders: ten times the
    orders of the same noisy harms give a tighter correlation."""
    gen = torch.Generator().manual_seed(0)
    predicted = [float(i) for i in range(8)]

    def harms(orders: int) -> list[list[float]]:
        return [(0.1 * i + torch.randn(orders, generator=gen)).tolist() for i in range(8)]

    few, many = rv.harm_correlation(predicted, harms(4)), rv.harm_correlation(predicted, harms(400))
    assert many.rho > 0.9 and many.rho_sd < 0.5 * few.rho_sd, (few, many)
    exact = rv.harm_correlation(predicted, [[0.1 * i] * 5 for i in range(8)])
    assert exact.rho == pytest.approx(1.0) and exact.rho_sd == 0.0


def test_block_orders_raise_one_format_and_refuse_bad_specs() -> None:
    formats = ["int8", "int8_factored"]
    assert rv.block_orders([], formats, 6) == {"int8": 6, "int8_factored": 6}
    assert rv.block_orders(["int8_factored=24"], formats, 6) == {"int8": 6, "int8_factored": 24}
    with pytest.raises(ValueError, match="FORMAT=N"):
        rv.block_orders(["int8_factored:24"], formats, 6)
    with pytest.raises(ValueError, match="'bf16'"):
        rv.block_orders(["bf16=24"], formats, 6)
    with pytest.raises(ValueError, match="fewer than --orders 6"):
        rv.block_orders(["int8=4"], formats, 6)


@pytest.mark.slow
def test_block_level_int8_risk_ranks_ddpm_harms_above_noise(tmp_path: Path) -> None:
    """(ii) reduced (about 9 minutes on one core; ``pytest -m slow``): the DDPM of the benchmark, every one of its
    10 largest blocks alone in ``int8`` over 3 paired data orders. Most single-block harms stand above noise,
    and the risk ranks them: Spearman >= 0.5 over the harms above noise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        task = rv.ddpm_task()
        model = task.make_model()
        blocks = partition(model)
        warm = rv.warm_up(task, 300)
        _, opt = rv.restore(task, warm)
        risk = {b: d.risk["int8"] for b, d in rv.risk_details(opt, blocks, horizon=600).items()}
        chosen = rv.largest_blocks(model, blocks, 10)
        run = rv.Runs(task, warm, blocks, 600, tmp_path / "cache.json", {"test": 2})
        orders = (3, 4, 5)
        base = {o: run({}, o)[0] for o in orders}
        harms = [[run({b: "int8"}, o)[0] - base[o] for o in orders] for b in chosen]
    finally:
        torch.set_num_threads(threads)
    c = rv.harm_correlation([risk[b] for b in chosen], harms)
    print(c)
    assert c.above >= 5, c
    assert c.rho_above >= 0.5, c
