"""The steps of :func:`~lightning_baoc.solver.solve` on a built problem, in order.

:func:`_solve_problem` drops dominated options, checks that each resource alone can be met, runs
the frontier greedy (or, when it finds nothing within both budgets, the exhaustive feasibility
search), improves the answer locally and among near-ties, runs the exact search at tightening
tolerances where the method asks for it, and reports the :class:`Allocation` with its proven lower
bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

from lightning_baoc.solver.improve import _TIE_MIN_GAP, _improve, _tie_search
from lightning_baoc.solver.infeasible import ERROR_SEARCH_NODES, _infeasible
from lightning_baoc.solver.problem import (
    TIME_BUDGET_RTOL,
    Allocation,
    _Accept,
    _dominated,
    _Problem,
    _raw_memory,
    _raw_ok,
    _raw_time,
    _Scaled,
    _scaled,
)
from lightning_baoc.solver.relaxation import _greedy
from lightning_baoc.solver.search import _branch_and_bound

#: ``method="auto"`` improves the greedy answer by branch-and-bound on problems with at most this
#: many blocks that have a choice, within :data:`AUTO_EXACT_NODES` search nodes in all; small
#: problems end proven optimal.
AUTO_EXACT_BLOCKS = 400
#: Node limit of the search under ``method="auto"`` (about a second of pure Python at most).
AUTO_EXACT_NODES = 400_000
# Relative tolerances of the successive search levels (0: exact, up to 1e-10 of rounding).
_SEARCH_TOLERANCES = (1e-2, 1e-3, 1e-4, 0.0)

Method = Literal["auto", "greedy", "exact"]
_METHODS = ("auto", "greedy", "exact")


def _solve_problem(p: _Problem, mb: float, tb: float | None, method: str, note: str = "") -> Allocation:
    """Solve a built problem within the absolute budgets ``mb`` and ``tb`` (``tb`` with its slack)."""
    keep = p.allowed & ~_dominated(p.risk, p.memory, p.time if tb is not None else None)
    s = _scaled(p, mb, tb, keep)
    error_nodes = None if method == "exact" else ERROR_SEARCH_NODES
    if not _each_resource_fits(p, mb, tb):
        raise _infeasible(p, s, mb, tb, error_nodes, note)

    def accept(x: np.ndarray) -> bool:
        return _raw_ok(p, x, mb, tb)

    g = _greedy(p, s, mb, tb)
    x = g.x
    used = "greedy"
    mults = [g.lam] + ([g.mu] if s.t is not None else [])
    cons = [s.m] + ([s.t] if s.t is not None else [])
    if x is None:
        # The greedy found nothing that meets both budgets: search exhaustively for any allocation
        # that does (this is what guarantees a feasible answer whenever one exists).
        search = _branch_and_bound(s.r, cons, mults, accept, None, None, stop_below=math.inf)
        if search.x is None:
            raise _infeasible(p, s, mb, tb, error_nodes, note)
        x = search.x
        used = "search"
    if method != "exact":
        x = _improve(p, s, x, mb, tb)
        value = float(s.r[np.arange(len(p.blocks)), x].sum())
        if value - g.bound > _TIE_MIN_GAP * value:  # else the bound already shows x near-optimal
            x = _tie_search(p, s, x, mults, accept)
    proven_tol: float | None = None  # the search proved x optimal to this relative tolerance
    free_blocks = int((keep.sum(axis=1) > 1).sum())
    if method == "exact" or (method == "auto" and free_blocks <= AUTO_EXACT_BLOCKS):
        budget = None if method == "exact" else AUTO_EXACT_NODES
        x, proven_tol = _exact_search(s, x, cons, mults, accept, budget)
        used = "exact" if method == "exact" else used + "+search"
    floor = _best_uniform(p, accept)
    if floor is not None and p.totals(floor)[0] < p.totals(x)[0]:
        x, used, proven_tol = floor, used + "+uniform", None
    return _allocation(p, s, x, mb, tb, used, g.bound, proven_tol)


def _best_uniform(p: _Problem, accept: _Accept) -> np.ndarray | None:
    """The uniform allocation (one format on every block) of least risk that meets the budgets, or ``None``.

    A floor under every answer: whatever the limits of the greedy and the search, the solver never returns
    an allocation that risks more than a uniform one a user could have picked within the same budgets."""
    best, best_risk = None, math.inf
    for j in range(len(p.formats)):
        if not p.allowed[:, j].all():
            continue
        x = np.full(len(p.blocks), j, dtype=np.int64)
        if accept(x) and (risk := p.totals(x)[0]) < best_risk:
            best, best_risk = x, risk
    return best


def _each_resource_fits(p: _Problem, mb: float, tb: float | None) -> bool:
    """Whether each resource alone can be met: its cheapest allocation fits its budget."""
    allowed = p.allowed
    min_m = _raw_memory(p, np.argmin(np.where(allowed, p.memory, np.inf), axis=1))
    if tb is not None and p.time is not None:
        min_t = _raw_time(p, np.argmin(np.where(allowed, p.time, np.inf), axis=1))
    else:
        min_t = 0.0
    return not (min_m > mb or (tb is not None and min_t > tb))


def _exact_search(
    s: _Scaled,
    x: np.ndarray,
    cons: Sequence[np.ndarray],
    mults: Sequence[float],
    accept: _Accept,
    budget: int | None,
) -> tuple[np.ndarray, float | None]:
    """Branch-and-bound from ``x`` within ``budget`` nodes (``None``: to the end): the best
    allocation, and the relative tolerance to which it is proven optimal (``None``: not proven)."""
    rows = np.arange(len(x))
    proven_tol: float | None = None
    # Tighten the tolerance step by step: a loose search finds a much better incumbent fast
    # (a depth-first search aiming at 1e-10 right away can stay stuck in one corner), and each
    # completed level proves the answer within its tolerance.
    for tol in _SEARCH_TOLERANCES:
        value = float(s.r[rows, x].sum())
        search = _branch_and_bound(s.r, cons, mults, accept, (value, x), budget, rel_tol=tol)
        if search.x is not None:
            x = search.x
        if not search.complete:
            break
        proven_tol = tol
        if budget is not None:
            budget -= search.nodes
            if budget <= 0:
                break
    return x, proven_tol


def _allocation(
    p: _Problem,
    s: _Scaled,
    x: np.ndarray,
    mb: float,
    tb: float | None,
    method: str,
    bound: float,
    proven_tol: float | None,
) -> Allocation:
    """The :class:`Allocation` of ``x``, with the best proven lower bound: the Lagrangian ``bound``
    (scaled) or what the search proved."""
    optimal = proven_tol == 0.0
    risk_total, mem_total, time_total = p.totals(x)
    lower = max(0.0, bound * s.risk_scale)
    if proven_tol is not None:
        lower = max(lower, risk_total * (1.0 - max(proven_tol, 1e-10)))
    lower = risk_total if optimal else min(risk_total, lower)
    if not optimal and lower >= risk_total * (1 - 1e-12):
        optimal = True  # the Lagrangian bound proves it
        lower = risk_total
    if p.time is None:
        time_total = None
    return Allocation(
        formats={b: p.formats[int(c)] for b, c in zip(p.blocks, x)},
        memory=mem_total,
        time=time_total,
        risk=risk_total,
        memory_budget=mb,
        time_budget=None if tb is None else tb / (1.0 + TIME_BUDGET_RTOL),
        lower_bound=lower,
        optimal=optimal,
        method=method,
        masked=dict(p.masked),
        fp32_memory=p.fp32_memory,
        fp32_time=p.fp32_time,
    )
