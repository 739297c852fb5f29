"""Allocation: one optimizer-state format per block, minimum total risk under memory and time budgets.

The problem is a multiple-choice knapsack with two resources: every block ``b`` picks one format
``f`` among those it allows, with risk ``r[b, f]``, state bytes ``m[b, f]`` and step time
``t[b, f]``; minimize ``sum r`` subject to ``sum m <= M`` and ``sum t <= T``.

How :func:`solve` works (summarized in README.md, "Allocation: budgets, solver, calibration, planner"):

1. Validate the tables, apply the hardware mask, parse the budgets, and drop options dominated in
   all of risk, memory and time (they can never be needed).
2. Greedy on the risk-per-byte frontier. For a time multiplier ``mu`` the cost of an option is
   ``r + mu * t``; each block's options on the lower convex hull of (bytes, cost) are visited from
   the cheapest-risk end, and all hull segments of all blocks are taken in increasing order of
   cost per byte saved until the memory budget holds. That is the exact LP relaxation for this
   ``mu`` with the one fractional segment rounded to the saving side. ``mu`` is found by a
   safeguarded regula falsi so the time budget holds; the allocations just over and just within
   it are blended the same way (:func:`_blend`); every pair (``lambda``, ``mu``) met on the way
   gives a Lagrangian lower bound on the optimum (reported as :attr:`Allocation.lower_bound`).
3. Local improvement: single-block moves that lower risk within the slack, then pair moves (one
   block up, one block down) while they help; then an exact search among the near-ties of the LP
   solution (:func:`_tie_search`), which rounds repeated identical layers well.
4. Exact: a depth-first branch-and-bound (:func:`_branch_and_bound`) with per-depth LP bounds, the
   Lagrangian bound and symmetry breaking between identical blocks, seeded with the greedy answer
   and run at tightening tolerances. ``method="exact"`` runs it to completion (exact on
   real-valued data, held to brute force by the tests); ``method="auto"`` runs it within a node
   limit on problems of up to :data:`AUTO_EXACT_BLOCKS` blocks; and whenever the greedy finds no
   allocation that meets both budgets, the same search looks for any allocation that does and runs
   to completion, so a feasible answer is returned whenever one exists.

5. Floor: the best uniform allocation (one format on every block) that meets both budgets replaces the
   answer where it risks less, so no method returns an allocation riskier than a uniform format a user
   could have picked (the greedy alone once rounded a large block away to 2.6x uniform bf16's risk).

An infeasible budget raises :class:`BudgetInfeasibleError` with the smallest feasible memory
(at the time budget) and time (at the memory budget), found by the same exact search.

The package, module by module (pure Python and numpy: no torch here):

- :mod:`~lightning_baoc.solver.problem`: the tables as arrays, budgets, scaling, domination,
  :class:`Allocation`, :class:`BudgetInfeasibleError`, :func:`check_mask`;
- :mod:`~lightning_baoc.solver.relaxation`: frontiers (lower convex hulls), the greedy, the
  Lagrangian multipliers and bound (step 2);
- :mod:`~lightning_baoc.solver.improve`: local improvement and the tie search (step 3);
- :mod:`~lightning_baoc.solver.search`: branch-and-bound (step 4);
- :mod:`~lightning_baoc.solver.infeasible`: the smallest feasible budgets and the error message;
- :mod:`~lightning_baoc.solver.pipeline`: the steps in order, on a built problem;
- :mod:`~lightning_baoc.solver.segments`: :func:`select_boundaries` and the segmented solve;
- :mod:`~lightning_baoc.solver.reference`: :func:`reference_solve`, the brute-force reference;
- here: :func:`solve`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from lightning_baoc.config.budget import parse_memory_budget, parse_time_budget
from lightning_baoc.solver.pipeline import _METHODS, AUTO_EXACT_BLOCKS, Method, _solve_problem
from lightning_baoc.solver.problem import (
    KNOWN_FORMATS,
    Allocation,
    BudgetInfeasibleError,
    Table,
    _build,
    _parse_budgets,
    check_mask,
)
from lightning_baoc.solver.reference import reference_solve
from lightning_baoc.solver.segments import _solve_segmented, select_boundaries


def solve(
    risk: Table,
    memory: Table,
    memory_budget: float | int | str,
    time: Table | None = None,
    time_budget: float | str | None = None,
    *,
    mask: Mapping[str, str] | Iterable[str] | None = None,
    method: Method = "auto",
    max_boundaries: int | None = None,
    features: Mapping[str, Sequence[float]] | None = None,
    reference: str = "fp32 AdamW",
) -> Allocation:
    """Pick one state format per block: minimum total risk within the memory and time budgets.

    Args:
        risk: block -> format -> risk (finite, >= 0). The formats a block lists are the ones it
            allows: leave a format out to forbid it there. Blocks keep this order.
        memory: block -> format -> state bytes (finite, >= 0), for every format ``risk`` allows.
        memory_budget: a fraction in (0, 1] of the fp32 AdamW state memory (the sum of the
            ``"fp32"`` entries of ``memory``), or absolute: an int of bytes or a string like
            ``"6GB"`` / ``"512MiB"`` (see :func:`~lightning_baoc.config.budget.parse_memory_budget`).
        time: block -> format -> optimizer-step seconds, or ``None`` (default: ``None``).
        time_budget: a multiple >= 1.0 of the fp32 AdamW step time (``1.10``) or an absolute time
            like ``"12ms"``; needs ``time`` (default: ``None``: no time limit).
        mask: formats to exclude everywhere, as names or name -> reason (e.g. from
            :func:`~lightning_baoc.costs.calibration.hardware_mask`); reported in
            :attr:`Allocation.masked` (default: ``None``).
        method: ``"auto"`` (greedy, then an exact search on small problems), ``"greedy"`` (the
            frontier greedy with local improvement only) or ``"exact"`` (branch-and-bound to proven
            optimality; exponential in the worst case) (default: ``"auto"``).
        max_boundaries: merge neighbouring blocks into at most ``max_boundaries + 1`` segments of
            similar ``features`` (see :func:`select_boundaries`) and give every segment one format,
            so the format changes at most ``max_boundaries`` times along the blocks
            (default: ``None``: no merging).
        features: block -> feature vector (statistics) for the merging; default: each block's
            risk per byte for the formats every block allows (default: ``None``).
        reference: what the ``"fp32"`` column is, as error messages name it (default:
            ``"fp32 AdamW"``; ``"fp32 SGD"`` for SGD's momentum formats).

    Returns:
        The :class:`Allocation`.

    Raises:
        BudgetInfeasibleError: no allocation meets the budgets; it carries the smallest feasible
            memory and time budgets.
        ValueError, TypeError: malformed tables, budgets or mask (the message names the value).

    Example:
        >>> risk = {"emb": {"fp32": 0.0, "int8": 0.1}, "mlp": {"fp32": 0.0, "int8": 0.02}}
        >>> memory = {"emb": {"fp32": 800, "int8": 212}, "mlp": {"fp32": 1600, "int8": 424}}
        >>> alloc = solve(risk, memory, memory_budget=0.6)  # 60% of 2400 bytes
        >>> alloc.formats, alloc.memory, alloc.risk
        ({'emb': 'fp32', 'mlp': 'int8'}, 1224, 0.02)
    """
    if method not in _METHODS:
        raise ValueError(f"Unknown method={method!r}; allowed: {list(_METHODS)}")
    if max_boundaries is not None:
        return _solve_segmented(
            risk, memory, memory_budget, time, time_budget, mask, method, max_boundaries, features, reference
        )
    p = _build(risk, memory, time, mask)
    p.reference = reference
    mb, tb = _parse_budgets(p, memory_budget, time_budget)
    return _solve_problem(p, mb, tb, method)


__all__ = [
    "AUTO_EXACT_BLOCKS",
    "Allocation",
    "BudgetInfeasibleError",
    "KNOWN_FORMATS",
    "check_mask",
    "parse_memory_budget",
    "parse_time_budget",
    "reference_solve",
    "select_boundaries",
    "solve",
]

