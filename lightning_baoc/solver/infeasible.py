"""Infeasible budgets: the smallest feasible budgets and the message of the error.

When no allocation meets the budgets, :func:`_infeasible` builds the
:class:`~lightning_baoc.solver.BudgetInfeasibleError`: the smallest memory that meets the time
budget and the smallest time that meets the memory budget (:func:`_min_resource`, found by the
exact search from a frontier-greedy incumbent), worded with budgets rounded so that the printed
smallest feasible value, given back as the budget, is never too small.
"""

from __future__ import annotations

import math

import numpy as np

from lightning_baoc.config.budget import ceil_significant, format_bytes, format_seconds
from lightning_baoc.solver.problem import TIME_BUDGET_RTOL, BudgetInfeasibleError, _Problem, _Scaled
from lightning_baoc.solver.relaxation import _frontier_choice
from lightning_baoc.solver.search import _branch_and_bound

#: Node limit when computing the smallest feasible budgets for an error message on problems too
#: large to finish: the message then gives the best budget found, marked as not proven minimal.
ERROR_SEARCH_NODES = 1_000_000


def _min_resource(
    p: _Problem, s: _Scaled, which: str, mb: float, tb: float | None, node_limit: int | None
) -> tuple[float | None, bool]:
    """Smallest raw total of ``which`` ("memory"/"time") among allocations meeting the other budget."""
    rows_all = np.arange(len(p.blocks))
    if which == "memory":
        obj, other, other_raw, other_budget = s.m, s.t, p.time, tb
        raw_obj = p.memory
    else:
        obj, other, other_raw, other_budget = s.t, s.m, p.memory, mb
        raw_obj = p.time
    assert raw_obj is not None and obj is not None
    if other is None or other_budget is None:
        x = np.argmin(raw_obj, axis=1)
        _, mem, tim = p.totals(x)
        return (mem if which == "memory" else tim), True
    assert other_raw is not None
    # cheapest other resource first: if even that misses its budget, no allocation qualifies
    if math.fsum(np.min(other_raw, axis=1).tolist()) > other_budget:
        return None, True

    def accept(x: np.ndarray) -> bool:
        raw = other_raw[rows_all, x]
        total = float(raw.sum()) if (which == "time" and p.memory_int) else math.fsum(raw.tolist())
        return total <= other_budget

    # incumbent from the frontier greedy on (objective, other resource)
    start_x, lam = _frontier_choice(obj, other, accept)
    incumbent = None
    if start_x is not None:
        incumbent = (float(obj[rows_all, start_x].sum()), start_x)
    # integer bytes: no improvement is smaller than one byte (1 / mb in scaled units)
    resolution = 0.5 / mb if (which == "memory" and p.memory_int) else 0.0
    search = _branch_and_bound(
        obj, [other], [lam if math.isfinite(lam) else 0.0], accept, incumbent, node_limit, resolution=resolution
    )
    if search.x is None:
        return None, search.complete
    _, mem, tim = p.totals(search.x)
    return (mem if which == "memory" else tim), search.complete


def _infeasible(p: _Problem, s: _Scaled, mb: float, tb: float | None, node_limit: int | None, note: str = "") -> BudgetInfeasibleError:
    """The error for budgets no allocation meets, with the smallest feasible ones (``note`` is
    appended to the message)."""
    min_memory, exact_m = _min_resource(p, s, "memory", mb, tb, node_limit)
    min_time: float | None = None
    exact_t = True
    if p.time is not None and tb is not None:
        min_time, exact_t = _min_resource(p, s, "time", mb, tb, node_limit)
    exact = exact_m and exact_t
    about = "" if exact else "about "

    # A budget is shown rounded to the nearest, a smallest feasible one rounded up (and exactly where
    # the two would read the same): giving the printed value back as the budget is never too small.
    def mem_text(v: float, up: bool = False) -> str:
        frac = f" ({(ceil_significant(v / p.fp32_memory) if up else v / p.fp32_memory):.3g} of {p.reference})" if p.fp32_memory else ""
        if not p.memory_int:
            return f"{v:.6g}{frac}"
        # exact where the rounding up shows more than it is
        exact = f" = {int(math.ceil(v)):,} bytes" if up and format_bytes(v, up=True) != format_bytes(v) else ""
        return f"{format_bytes(v, up=up)}{exact}{frac}"

    def time_text(v: float, up: bool = False) -> str:
        frac = f" ({(ceil_significant(v / p.fp32_time) if up else v / p.fp32_time):.3g}x the {p.reference} step)" if p.fp32_time else ""
        text = format_seconds(v, up=up)
        if up and tb is not None and text == format_seconds(tb_given):
            text += f" = {v!r} s"
        return f"{text}{frac}"

    tb_given = None if tb is None else tb / (1.0 + TIME_BUDGET_RTOL)
    parts: list[str] = []
    within_t = f" within time_budget {time_text(tb_given)}" if tb_given is not None else ""
    if min_memory is None:
        fastest = math.fsum(np.min(p.time, axis=1).tolist()) if p.time is not None else math.nan
        parts.append(
            f"time_budget {time_text(tb_given if tb_given is not None else math.nan)} cannot be met by any allocation: "
            f"the fastest is {time_text(fastest, up=True)}"
        )
    elif min_memory > mb:
        parts.append(f"memory_budget {mem_text(mb)} cannot be met{within_t}: the smallest feasible is {about}{mem_text(min_memory, up=True)}")
    if tb is not None and tb_given is not None:
        if min_time is None:
            if min_memory is None or min_memory <= mb:
                smallest = p.totals(np.argmin(p.memory, axis=1))[1]
                parts.append(f"memory_budget {mem_text(mb)} cannot be met by any allocation: the smallest is {mem_text(smallest, up=True)}")
        elif min_time > tb:
            parts.append(
                f"time_budget {time_text(tb_given)} cannot be met within memory_budget {mem_text(mb)}: the smallest "
                f"feasible is {about}{time_text(min_time, up=True)}"
            )
    message = "; ".join(parts) + ". Raise a budget, allow more formats, or unmask one" + note
    return BudgetInfeasibleError(
        message,
        memory_budget=mb,
        time_budget=tb_given,
        min_memory=min_memory,
        min_time=min_time,
        exact=exact,
        fp32_memory=p.fp32_memory,
        fp32_time=p.fp32_time,
    )
