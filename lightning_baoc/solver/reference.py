"""The slow reference of :func:`~lightning_baoc.solver.solve`: brute force over every allocation.

Tests and ``benchmarks/solver.py`` hold the solver to it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from lightning_baoc.solver.problem import Allocation, BudgetInfeasibleError, Table, _build, _parse_budgets


def reference_solve(
    risk: Table,
    memory: Table,
    memory_budget: float | int | str,
    time: Table | None = None,
    time_budget: float | str | None = None,
    *,
    mask: Mapping[str, str] | Iterable[str] | None = None,
    max_allocations: int = 5_000_000,
) -> Allocation:
    """The slow reference of :func:`solve`: enumerate every allocation (brute force).

    Same arguments and answers as :func:`solve` (the same optimal risk; among equal risks any
    allocation), for problems with at most ``max_allocations`` allocations.

    Example:
        >>> reference_solve({"a": {"fp32": 0.0, "int8": 1.0}}, {"a": {"fp32": 8, "int8": 2}}, 4).formats
        {'a': 'int8'}
    """
    p = _build(risk, memory, time, mask)
    mb, tb = _parse_budgets(p, memory_budget, time_budget)
    options = [np.nonzero(row)[0] for row in p.allowed]
    count = math.prod(len(o) for o in options)
    if count > max_allocations:
        raise ValueError(f"{count} allocations exceed max_allocations={max_allocations}; use solve()")
    # totals of every allocation, built block by block with broadcasting
    R = np.zeros(1)
    M = np.zeros(1)
    T = np.zeros(1)
    for b, opts in enumerate(options):
        R = (R[:, None] + p.risk[b, opts][None, :]).reshape(-1)
        M = (M[:, None] + p.memory[b, opts][None, :]).reshape(-1)
        if p.time is not None:
            T = (T[:, None] + p.time[b, opts][None, :]).reshape(-1)
    ok_m = M <= mb
    ok_t = T <= tb if (tb is not None and p.time is not None) else np.ones_like(ok_m)
    ok = ok_m & ok_t
    if not ok.any():
        min_memory = float(M[ok_t].min()) if ok_t.any() else None
        min_time = float(T[ok_m].min()) if (tb is not None and ok_m.any()) else None
        if p.memory_int and min_memory is not None:
            min_memory = int(round(min_memory))
        raise BudgetInfeasibleError(
            f"memory_budget {mb} / time_budget {tb} cannot be met (reference)",
            memory_budget=mb,
            time_budget=tb,
            min_memory=min_memory,
            min_time=min_time,
            fp32_memory=p.fp32_memory,
            fp32_time=p.fp32_time,
        )
    flat = int(np.argmin(np.where(ok, R, np.inf)))
    # unravel the flat index into one option per block (last block varies fastest)
    x = np.zeros(len(options), dtype=np.int64)
    for b in range(len(options) - 1, -1, -1):
        flat, rem = divmod(flat, len(options[b]))
        x[b] = options[b][rem]
    risk_total, mem_total, time_total = p.totals(x)
    return Allocation(
        formats={b: p.formats[int(c)] for b, c in zip(p.blocks, x)},
        memory=mem_total,
        time=time_total if p.time is not None else None,
        risk=risk_total,
        memory_budget=mb,
        time_budget=tb,
        lower_bound=risk_total,
        optimal=True,
        method="brute-force",
        masked=dict(p.masked),
        fp32_memory=p.fp32_memory,
        fp32_time=p.fp32_time,
    )
