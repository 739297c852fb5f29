"""The allocation solver: exact against brute force, feasible whenever possible, clear errors."""

from __future__ import annotations

import itertools
import json
import math
import random
import time

import numpy as np
import pytest

from lightning_baoc import FORMATS
from lightning_baoc.config.budget import format_bytes, parse_memory_budget, parse_time_budget
from lightning_baoc.solver import (
    KNOWN_FORMATS,
    Allocation,
    BudgetInfeasibleError,
    reference_solve,
    select_boundaries,
    solve,
)

NAMES = list(KNOWN_FORMATS)


def random_instance(rng: random.Random, n: int, k: int, with_time: bool = True, dyadic: bool = False):
    """Real-valued risks and times, integer bytes; each format allowed with probability 0.85."""
    formats = NAMES[:k]
    risk, memory, step = {}, {}, {}
    for b in range(n):
        allowed = [f for f in formats if rng.random() < 0.85] or [formats[0]]
        risk[f"b{b}"] = {f: rng.random() for f in allowed}
        memory[f"b{b}"] = {f: rng.randint(0, 1000) for f in allowed}
        # dyadic times (multiples of 1/1024) add up exactly, so a budget equal to a total is exact
        step[f"b{b}"] = {f: (rng.randint(1, 4096) / 1024 if dyadic else rng.random()) for f in allowed}
    return risk, memory, (step if with_time else None)


def seconds(value: float) -> str:
    """An absolute time budget that parses back to exactly ``value``."""
    return f"{value!r}s"


def totals(table, formats):
    return math.fsum(table[b][f] for b, f in formats.items())


def check_budgets(alloc: Allocation, risk, memory, time_table, mb, tb) -> None:
    assert set(alloc.formats) == set(risk)
    for b, f in alloc.formats.items():
        assert f in risk[b]
    mem = sum(memory[b][f] for b, f in alloc.formats.items())
    assert mem == alloc.memory
    assert mem <= mb
    assert alloc.risk == pytest.approx(totals(risk, alloc.formats), rel=1e-12, abs=1e-12)
    if time_table is not None:
        t = totals(time_table, alloc.formats)
        assert t == pytest.approx(alloc.time, rel=1e-12)
        if tb is not None:
            assert t <= tb


def test_known_formats_match_registry() -> None:
    assert KNOWN_FORMATS == tuple(FORMATS)


@pytest.mark.slow  # 12 s on the 2-core machine; test_tight_budgets_are_met_exactly and the small cases run by default
def test_exact_equals_brute_force_on_random_instances() -> None:
    """>= 500 random instances (<= 12 blocks x <= 6 formats, mostly both budgets);
    the risk equals the brute-force optimum (rel 1e-9), budgets are never exceeded, and infeasible
    budgets raise with the brute-force minima."""
    rng = random.Random(1234)
    feasible = infeasible = both_budgets = 0
    while feasible < 520:
        while True:
            n, k = rng.randint(1, 12), rng.randint(1, 6)
            if k**n <= 200_000:
                break
        risk, memory, step = random_instance(rng, n, k, with_time=rng.random() < 0.85)
        lo = sum(min(v.values()) for v in memory.values())
        hi = sum(max(v.values()) for v in memory.values())
        mb = max(1, rng.randint(lo - 20, hi))
        tb = None
        if step is not None:
            t_lo = math.fsum(min(v.values()) for v in step.values())
            t_hi = math.fsum(max(v.values()) for v in step.values())
            tb = rng.uniform(0.97 * t_lo, t_hi)
            both_budgets += 1
        tb_arg = seconds(tb) if tb is not None else None
        try:
            ref = reference_solve(risk, memory, mb, step, tb_arg)
        except BudgetInfeasibleError as ref_err:
            infeasible += 1
            for method in ("exact", "auto", "greedy"):
                with pytest.raises(BudgetInfeasibleError) as info:
                    solve(risk, memory, mb, step, tb_arg, method=method)
                err = info.value
                assert err.exact
                assert err.min_memory == ref_err.min_memory
                if ref_err.min_time is None:
                    assert err.min_time is None
                else:
                    assert err.min_time == pytest.approx(ref_err.min_time, rel=1e-9)
            continue
        feasible += 1
        for method in ("exact", "auto", "greedy"):
            alloc = solve(risk, memory, mb, step, tb_arg, method=method)
            check_budgets(alloc, risk, memory, step, mb, tb)
            assert alloc.lower_bound <= alloc.risk + 1e-12
            assert alloc.lower_bound <= ref.risk * (1 + 1e-9) + 1e-12
            if method == "greedy":
                assert alloc.risk >= ref.risk - 1e-9 * max(ref.risk, 1e-12)
            else:
                assert alloc.risk == pytest.approx(ref.risk, rel=1e-9, abs=1e-12)
                assert alloc.optimal
    assert feasible >= 500 and infeasible >= 30 and both_budgets >= 450


@pytest.mark.slow  # long; budgets are held by default in this file
def test_tight_budgets_are_met_exactly() -> None:
    """A budget equal to the totals of some allocation is feasible: every method returns one."""
    rng = random.Random(7)
    for _ in range(150):
        n, k = rng.randint(2, 9), rng.randint(2, 5)
        risk, memory, step = random_instance(rng, n, k, dyadic=True)
        target = {b: rng.choice(list(risk[b])) for b in risk}
        mb = sum(memory[b][f] for b, f in target.items())
        tb = sum(step[b][f] for b, f in target.items())  # exact: dyadic
        if mb == 0:
            continue
        ref = reference_solve(risk, memory, mb, step, seconds(tb))
        for method in ("exact", "auto", "greedy"):
            alloc = solve(risk, memory, mb, step, seconds(tb), method=method)
            check_budgets(alloc, risk, memory, step, mb, tb)
            if method != "greedy":
                assert alloc.risk == pytest.approx(ref.risk, rel=1e-9, abs=1e-12)
        # one byte less than the smallest memory at this time budget is infeasible, and says so
        smallest = min(
            sum(memory[b][f] for b, f in zip(risk, combo))
            for combo in itertools.product(*(list(risk[b]) for b in risk))
            if sum(step[b][f] for b, f in zip(risk, combo)) <= tb
        )
        if smallest > 1:
            with pytest.raises(BudgetInfeasibleError) as info:
                solve(risk, memory, smallest - 1, step, seconds(tb))
            assert info.value.min_memory == smallest


def test_feasible_answer_where_the_greedy_rounding_fails() -> None:
    """An instance (found by random search) where the Lagrangian greedy finds no allocation that
    meets both budgets (only one does); the exhaustive fallback finds it: feasibility is guaranteed,
    not heuristic."""
    risk = {
        "b0": {"bf16_momentum": 0.23135441156530645},
        "b1": {"fp32": 0.529956262469527, "bf16_momentum": 0.8509476488467974},
        "b2": {"fp32": 0.06635853086597032, "bf16_momentum": 0.22828615362763593},
        "b3": {"bf16_momentum": 0.2563297793907008},
    }
    memory = {
        "b0": {"bf16_momentum": 940},
        "b1": {"fp32": 892, "bf16_momentum": 233},
        "b2": {"fp32": 783, "bf16_momentum": 121},
        "b3": {"bf16_momentum": 831},
    }
    step = {
        "b0": {"bf16_momentum": 2.080078125},
        "b1": {"fp32": 1.041015625, "bf16_momentum": 3.1513671875},
        "b2": {"fp32": 1.244140625, "bf16_momentum": 3.47265625},
        "b3": {"bf16_momentum": 1.5361328125},
    }
    mb, tb = 2787, 8.01171875
    ref = reference_solve(risk, memory, mb, step, seconds(tb))
    greedy = solve(risk, memory, mb, step, seconds(tb), method="greedy")
    assert greedy.method == "search"
    for alloc in (greedy, solve(risk, memory, mb, step, seconds(tb)), solve(risk, memory, mb, step, seconds(tb), method="exact")):
        check_budgets(alloc, risk, memory, step, mb, tb)
        assert alloc.risk == pytest.approx(ref.risk)


def test_memory_only_and_docstring_example() -> None:
    risk = {"emb": {"fp32": 0.0, "int8": 0.1}, "mlp": {"fp32": 0.0, "int8": 0.02}}
    memory = {"emb": {"fp32": 800, "int8": 212}, "mlp": {"fp32": 1600, "int8": 424}}
    alloc = solve(risk, memory, memory_budget=0.6)
    assert alloc.formats == {"emb": "fp32", "mlp": "int8"}
    assert alloc.memory == 1224 and alloc.time is None and alloc.optimal
    assert solve(risk, memory, 1.0).formats == {"emb": "fp32", "mlp": "fp32"}
    assert solve(risk, memory, "1224B").memory == 1224
    json.dumps(alloc.to_dict())


def test_infeasible_error_names_the_minimum_in_human_units() -> None:
    gib = 2**30
    risk = {"a": {"fp32": 0.0, "int8": 1.0}, "b": {"fp32": 0.0, "int8": 1.0}}
    memory = {"a": {"fp32": 8 * gib, "int8": 2 * gib}, "b": {"fp32": 8 * gib, "int8": 2 * gib}}
    with pytest.raises(BudgetInfeasibleError) as info:
        solve(risk, memory, "3GiB")
    err = info.value
    assert isinstance(err, ValueError)
    assert err.min_memory == 4 * gib and err.min_time is None
    assert "memory_budget 3 GiB" in str(err) and "4 GiB (0.25 of fp32 AdamW)" in str(err)

    step = {"a": {"fp32": 1.0, "int8": 2.0}, "b": {"fp32": 1.0, "int8": 2.0}}
    with pytest.raises(BudgetInfeasibleError) as info:
        solve(risk, memory, 0.3, step, 1.5)  # 0.3 needs both int8: 2x the fp32 time
    err = info.value
    assert err.min_memory == 10 * gib  # one int8 block is all 1.5x allows
    assert err.min_time == pytest.approx(4.0)
    assert "memory_budget 4.8 GiB (0.3 of fp32 AdamW) cannot be met within time_budget 3 s (1.5x" in str(err)
    assert "the smallest feasible is 10 GiB (0.625 of fp32 AdamW)" in str(err)
    assert "the smallest feasible is 4 s (2x the fp32 AdamW step)" in str(err)
    with pytest.raises(BudgetInfeasibleError) as info:
        solve(risk, memory, 1.0, step, "1s")  # faster than any allocation
    assert info.value.min_memory is None and "the fastest is 2 s" in str(info.value)


def test_mask_excludes_and_reports() -> None:
    risk = {"a": {"fp32": 0.5, "offload": 0.0}, "b": {"fp32": 0.5, "offload": 0.0, "int8": 0.1}}
    memory = {"a": {"fp32": 80, "offload": 0}, "b": {"fp32": 80, "offload": 0, "int8": 20}}
    reason = "host memory is the device's memory"
    alloc = solve(risk, memory, 1.0, mask={"offload": reason})
    assert "offload" not in alloc.formats.values()
    assert alloc.masked == {"offload": reason}
    assert solve(risk, memory, 1.0).formats == {"a": "offload", "b": "offload"}
    with pytest.raises(BudgetInfeasibleError):
        solve(risk, memory, 0.5, mask=["offload"])  # offload can no longer make the budget look met
    with pytest.raises(ValueError, match="Unknown format 'int4' in mask; allowed: .*'fp32'"):
        solve(risk, memory, 1.0, mask=["int4"])
    with pytest.raises(ValueError, match="block 'a' has no allowed format left"):
        solve(risk, memory, 1.0, mask=["offload", "fp32"])


@pytest.mark.parametrize(
    ("budget", "pattern"),
    [
        (0.0, r"memory_budget=0.0 must be positive"),
        (-0.2, r"memory_budget=-0.2 must be positive"),
        (0, r"memory_budget=0 must be positive"),
        (-5, r"memory_budget=-5 must be positive"),
        (1.5, r"memory_budget=1.5 is a fraction above 1"),
        ("150%", r"is a fraction above 1"),
        ("6 gigs", r"Unknown unit 'gigs'.*allowed units: B, KB, MB, GB"),
        ("lots", r"Unparsable memory_budget='lots'; allowed: a fraction"),
        (float("nan"), r"must be positive and finite"),
        ("-1GB", r"must be positive"),
    ],
)
def test_bad_memory_budgets(budget, pattern) -> None:
    risk = {"a": {"fp32": 0.0, "int8": 1.0}}
    memory = {"a": {"fp32": 8000, "int8": 2000}}
    with pytest.raises(ValueError, match=pattern):
        solve(risk, memory, budget)


@pytest.mark.parametrize(
    ("budget", "pattern"),
    [
        (0.0, r"time_budget=0.0 must be positive"),
        (-1.0, r"must be positive"),
        (0.1, r"must be >= 1.0 \(1.10 allows a 10% slower step; write 1.1 for a 10% slowdown\)"),
        ("fast", r"Unparsable time_budget='fast'"),
        ("-3ms", r"must be positive"),
        (float("inf"), r"must be positive and finite"),
    ],
)
def test_bad_time_budgets(budget, pattern) -> None:
    risk = {"a": {"fp32": 0.0, "int8": 1.0}}
    memory = {"a": {"fp32": 8000, "int8": 2000}}
    step = {"a": {"fp32": 1.0, "int8": 1.5}}
    with pytest.raises(ValueError, match=pattern):
        solve(risk, memory, 1.0, step, budget)


def test_bad_tables() -> None:
    memory = {"a": {"fp32": 8000, "int8": 2000}}
    with pytest.raises(ValueError, match=r"risk\['a'\]\['int8'\] is NaN; allowed: finite numbers >= 0"):
        solve({"a": {"fp32": 0.0, "int8": float("nan")}}, memory, 1.0)
    with pytest.raises(ValueError, match=r"risk\['a'\]\['int8'\] = -0.5 is negative"):
        solve({"a": {"fp32": 0.0, "int8": -0.5}}, memory, 1.0)
    with pytest.raises(TypeError, match=r"risk\['a'\]\['int8'\] must be a number, got 'high'"):
        solve({"a": {"fp32": 0.0, "int8": "high"}}, memory, 1.0)
    with pytest.raises(ValueError, match=r"memory\['a'\]\['int8'\] = -1 is negative"):
        solve({"a": {"fp32": 0.0, "int8": 1.0}}, {"a": {"fp32": 8, "int8": -1}}, 4)
    with pytest.raises(ValueError, match=r"memory\['a'\] has no 'bf16' entry, but risk\['a'\] allows 'bf16'"):
        solve({"a": {"fp32": 0.0, "bf16": 1.0}}, memory, 1.0)
    with pytest.raises(ValueError, match=r"memory has no entry for block 'b'"):
        solve({"a": {"fp32": 0.0}, "b": {"fp32": 0.0}}, memory, 1.0)
    with pytest.raises(ValueError, match=r"risk is empty"):
        solve({}, memory, 1.0)
    with pytest.raises(ValueError, match=r"risk\['a'\] is empty"):
        solve({"a": {}}, memory, 1.0)
    with pytest.raises(ValueError, match=r"time_budget=1.1 was given without a time table"):
        solve({"a": {"fp32": 0.0}}, memory, 1.0, None, 1.1)
    with pytest.raises(ValueError, match=r"time\['a'\]\['fp32'\] is NaN"):
        solve({"a": {"fp32": 0.0}}, memory, 1.0, {"a": {"fp32": float("nan")}}, 1.1)
    with pytest.raises(ValueError, match=r"Unknown method='fastest'; allowed: \['auto', 'greedy', 'exact'\]"):
        solve({"a": {"fp32": 0.0}}, memory, 1.0, method="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fraction of the fp32 AdamW state memory, which is unknown here"):
        solve({"a": {"int8": 0.0}}, {"a": {"int8": 10}}, 0.5)


def test_parse_budgets() -> None:
    assert parse_memory_budget(0.35, 1000) == 350
    assert parse_memory_budget("35%", 1000) == 350
    assert parse_memory_budget("0.35", 1000) == 350
    assert parse_memory_budget(0.6, 2400) == 1440  # not 1439 from 1439.9999999999998
    assert parse_memory_budget("6GB", None) == 6 * 10**9
    assert parse_memory_budget("6 gb", None) == 6 * 10**9
    assert parse_memory_budget("512MiB", None) == 512 * 2**20
    assert parse_memory_budget("1.5GiB", None) == 3 * 2**29
    assert parse_memory_budget("2TB", None) == 2 * 10**12
    assert parse_memory_budget(4096, None) == 4096
    assert parse_memory_budget(np.int64(4096), None) == 4096
    with pytest.raises(TypeError, match="memory_budget must be a number or a string"):
        parse_memory_budget([1], 10)
    assert parse_time_budget(1.1, 2.0) == pytest.approx(2.2)
    assert parse_time_budget("1.25x", 2.0) == 2.5
    assert parse_time_budget("12ms", None) == pytest.approx(0.012)
    assert parse_time_budget("3us", None) == pytest.approx(3e-6)
    assert format_bytes(1536 * 2**20) == "1.5 GiB"


def test_select_boundaries_is_optimal() -> None:
    """The DP segmentation equals exhaustive search over every set of cuts."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 9))
        feats = rng.normal(size=(n, 2))
        for cuts in range(0, 4):
            got = select_boundaries(feats, cuts, standardize=False)
            assert got[0][0] == 0 and got[-1][1] == n and len(got) <= cuts + 1
            assert all(a[1] == b[0] for a, b in zip(got, got[1:]))

            def sse(segs):
                return sum(((feats[a:b] - feats[a:b].mean(axis=0)) ** 2).sum() for a, b in segs)

            best = min(
                sse(list(zip((0,) + c, c + (n,))))
                for m in range(0, min(cuts, n - 1) + 1)
                for c in itertools.combinations(range(1, n), m)
            )
            assert sse(got) == pytest.approx(best, abs=1e-9)
    assert select_boundaries([[0.0], [0.1], [5.0], [5.2], [0.0]], 2) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError, match="max_boundaries must be an int >= 0, got -1"):
        select_boundaries([[0.0]], -1)
    with pytest.raises(ValueError, match=r"features\[1\] = \[nan\] is not finite"):
        select_boundaries([[0.0], [float("nan")]], 1)


def test_solve_with_max_boundaries() -> None:
    rng = random.Random(3)
    names = [f"layer{i}" for i in range(24)]
    risk, memory, step = {}, {}, {}
    for i, b in enumerate(names):
        sensitive = 8 <= i < 16  # a run of similar, sensitive layers in the middle
        risk[b] = {"fp32": 0.0, "bf16": (0.5 if sensitive else 0.01) * rng.uniform(0.9, 1.1),
                   "int8": (2.0 if sensitive else 0.05) * rng.uniform(0.9, 1.1)}
        memory[b] = {"fp32": 8000, "bf16": 4000, "int8": 2125}
        step[b] = {"fp32": 1.0, "bf16": 1.1, "int8": 1.4}
    free = solve(risk, memory, 0.4, step, 1.3)
    for n in (0, 1, 2, 3):
        try:
            alloc = solve(risk, memory, 0.4, step, 1.3, max_boundaries=n)
        except BudgetInfeasibleError as err:
            assert n == 0 and "max_boundaries=0" in str(err)
            continue
        check_budgets(alloc, risk, memory, step, alloc.memory_budget, alloc.time_budget)
        assert alloc.boundaries <= n
        assert alloc.segments is not None and len(alloc.segments) <= n + 1
        assert [b for seg in alloc.segments for b in seg] == names
        assert alloc.risk >= free.risk - 1e-12
    two = solve(risk, memory, 0.4, step, 1.3, max_boundaries=2)
    assert two.segments == (tuple(names[:8]), tuple(names[8:16]), tuple(names[16:]))
    with pytest.raises(ValueError, match="features has no entry for blocks"):
        solve(risk, memory, 0.4, max_boundaries=2, features={"layer0": [1.0]})


def structured_instance(n: int, seed: int):
    """Realistic tables: block sizes log-uniform 1e3..1e7, bytes and step costs per element per
    format, risks ~ base[format] x size share x noise."""
    rng = np.random.default_rng(seed)
    per_byte = dict(fp32=8, bf16_momentum=6, bf16=4, nomomentum=4, int8=2.127, int8_factored=1.07,
                    nomomentum_int8=1.07, factored=0.01, offload=0)
    per_time = dict(fp32=1.0, bf16_momentum=1.3, bf16=1.4, nomomentum=0.8, int8=2.5, int8_factored=2.6,
                    nomomentum_int8=1.8, factored=1.3, offload=6.0)
    base = dict(fp32=0, bf16_momentum=0.02, bf16=0.05, nomomentum=0.15, int8=0.08, int8_factored=0.12,
                nomomentum_int8=0.3, factored=0.25, offload=0)
    numel = np.exp(rng.uniform(np.log(1e3), np.log(1e7), n)).astype(int)
    share = numel / numel.sum()
    risk, memory, step = {}, {}, {}
    for b in range(n):
        noise = rng.lognormal(0, 0.5, len(NAMES))
        risk[f"b{b}"] = {f: float(base[f] * share[b] * noise[i]) for i, f in enumerate(NAMES)}
        memory[f"b{b}"] = {f: int(math.ceil(per_byte[f] * numel[b])) for f in NAMES}
        step[f"b{b}"] = {f: float(per_time[f] * numel[b] * 1e-9) for f in NAMES}
    return risk, memory, step


def test_structured_medium_instances_proven_optimal() -> None:
    """On 12-40 realistic blocks, auto mode ends proven optimal and matches the exact method."""
    for n, seed in ((12, 1), (20, 1), (40, 2)):
        risk, memory, step = structured_instance(n, seed)
        auto = solve(risk, memory, 0.3, step, 1.2)
        exact = solve(risk, memory, 0.3, step, 1.2, method="exact")
        assert auto.optimal and exact.optimal
        assert auto.risk == pytest.approx(exact.risk, rel=1e-9)
        check_budgets(auto, risk, memory, step, auto.memory_budget, auto.time_budget)


def test_large_instance_greedy_gap() -> None:
    """2,000 blocks x 9 formats, both budgets: feasible, and within 1% of the Lagrangian bound."""
    risk, memory, step = structured_instance(2000, 0)
    alloc = solve(risk, memory, 0.3, step, 1.2)
    check_budgets(alloc, risk, memory, step, alloc.memory_budget, alloc.time_budget)
    assert alloc.gap < 1e-2
    assert alloc.lower_bound <= alloc.risk


@pytest.mark.slow
def test_ten_thousand_blocks_within_a_second() -> None:
    """Scale (the benchmark measures it too): 10,000 blocks x 9 formats, both budgets."""
    risk, memory, step = structured_instance(10_000, 0)
    solve(risk, memory, 0.35, step, 1.10)  # warm-up
    start = time.perf_counter()
    alloc = solve(risk, memory, 0.35, step, 1.10)
    assert time.perf_counter() - start <= 1.0
    assert alloc.gap < 1e-3
