"""Exact search: depth-first branch-and-bound with per-depth LP bounds.

:func:`_branch_and_bound` minimizes a sum of per-block objectives under up to two sum constraints
(budgets normalized to 1.0). At every node it prunes on the smallest completion of each
constraint and of the objective, on the Lagrangian bound (options are tried in increasing
Lagrangian cost, so one failure prunes the rest of a block's options), and on the LP relaxation of
the blocks below (:class:`_DepthLP`: one resource kept, the other dualized). Identical blocks are
searched in non-decreasing option order, which removes their symmetric copies. It serves the exact
solve, the feasibility search, the tie search and the smallest feasible budgets of an error.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_baoc.solver.problem import _FEAS_EPS, _Accept, _zero_inf
from lightning_baoc.solver.relaxation import _frontier


@dataclass
class _Search:
    value: float  # best objective found (scaled), inf if none
    x: np.ndarray | None
    complete: bool  # the search ran to the end: value is the optimum (or none exists)
    nodes: int


def _branch_and_bound(
    obj: np.ndarray,
    cons: Sequence[np.ndarray],
    mults: Sequence[float],
    accept: _Accept,
    incumbent: tuple[float, np.ndarray] | None = None,
    node_limit: int | None = None,
    stop_below: float | None = None,
    resolution: float = 0.0,
    rel_tol: float = 0.0,
) -> _Search:
    """Depth-first branch-and-bound: minimize ``sum obj`` s.t. ``sum cons[i] <= 1``.

    Bounds at each node: the constraints' smallest completion must fit; the objective's smallest
    completion, and the Lagrangian bound ``sum min(obj + mults . cons) - mults . (1 - used)``
    (valid for any multipliers >= 0), must beat the incumbent. Options of a block are tried in
    increasing Lagrangian cost, so once the Lagrangian bound fails, every later option fails too.
    ``accept(x)`` re-checks a complete allocation on the raw numbers. ``stop_below``: stop at the
    first allocation whose objective is at most this (a feasibility search).
    """
    tree = _Tree.build(obj, cons, mults)
    best = math.inf
    best_x: np.ndarray | None = None
    if incumbent is not None:
        best, best_x = incumbent[0], incumbent[1].copy()
    if stop_below is not None:
        best = min(best, stop_below * (1 + 1e-15) + 1e-300)
    if tree.depth == 0:
        x = tree.fixed_col.copy()
        fits = tree.base_c0 <= 1.0 + _FEAS_EPS and tree.base_c1 <= 1.0 + _FEAS_EPS
        if fits and accept(x) and tree.base_o < _threshold(best, resolution, rel_tol):
            return _Search(tree.base_o, x, True, 1)
        return _Search(best if best_x is not None else math.inf, best_x, True, 1)
    return _depth_first(tree, accept, best, best_x, node_limit, stop_below is not None, resolution, rel_tol)


def _threshold(value: float, resolution: float, rel_tol: float) -> float:
    """The objective an allocation must beat to improve on ``value``.

    Search only for improvements larger than a relative 1e-10 (and than half the objective's
    resolution, e.g. one byte): ties and rounding noise in the bounds then prune instead of
    exploding the tree on problems with many equal-risk allocations. The answer is optimal to
    that tolerance, far below the 1e-9 the tests hold it to.
    """
    if not math.isfinite(value):
        return value
    tol = 1e-10 * abs(value)
    if resolution > 0:
        tol = min(tol, resolution)
    return value - max(tol, rel_tol * abs(value))


@dataclass
class _Tree:
    """The search tree of :func:`_branch_and_bound`: blocks with a single option fixed, the others
    (one per depth) with their options in increasing Lagrangian cost, and the bounds' sums.

    Per depth ``d`` (lists, for fast indexing in the pure-Python loop): ``opt_*[d][i]`` are the
    column, objective, constraint uses and Lagrangian cost of option ``i``; ``smin_*[d]`` and
    ``s_red[d]`` the smallest completions of depths ``d ..`` (the cheapest options' sums).
    """

    free: np.ndarray  # the block at each depth
    fixed_col: np.ndarray  # every block's column when it has a single option (else any)
    base_o: float  # objective and constraint uses of the fixed blocks
    base_c0: float
    base_c1: float
    l0: float  # multipliers of the two constraints (>= 0)
    l1: float
    opt_col: list[list[int]]
    opt_o: list[list[float]]
    opt_c0: list[list[float]]
    opt_c1: list[list[float]]
    smin_o: list[float]
    smin_c0: list[float]
    smin_c1: list[float]
    s_red: list[float]
    same_as_prev: list[bool]  # the block at depth d is identical to the one at d - 1
    lp0: _DepthLP | None  # per-depth LP bounds: constraint 0 kept, constraint 1 dualized
    lp1: _DepthLP | None  # and the other way around (only when constraint 1 is used)

    @property
    def depth(self) -> int:
        return len(self.free)

    def full_x(self, choice: list[int]) -> np.ndarray:
        """The allocation (a column per block) of a choice of option per depth."""
        x = self.fixed_col.copy()
        for d, b in enumerate(self.free):
            x[b] = self.opt_col[d][choice[d]]
        return x

    @staticmethod
    def build(obj: np.ndarray, cons: Sequence[np.ndarray], mults: Sequence[float]) -> _Tree:
        cons = list(cons)[:2]
        mults = list(mults)[: len(cons)]
        while len(cons) < 2:
            cons.append(np.zeros_like(obj))
            mults.append(0.0)
        c0, c1 = cons
        # any multipliers >= 0 give a valid bound; non-finite ones (from a failed greedy) give none
        l0, l1 = (float(m) if math.isfinite(m) and m > 0 else 0.0 for m in mults)
        red = obj + l0 * _zero_inf(c0) + l1 * _zero_inf(c1)
        allowed = np.isfinite(obj)
        single = allowed.sum(axis=1) == 1
        fixed_col = np.argmax(allowed, axis=1)
        free, same_as_prev = _search_order(obj, c0, c1, red, allowed, single)
        base_rows = np.nonzero(single)[0]
        base = [float(a[base_rows, fixed_col[base_rows]].sum()) for a in (obj, c0, c1)]
        options = [_options(b, allowed, red, obj, c0, c1) for b in free]
        opt_col, opt_o, opt_c0, opt_c1, opt_red = (list(col) for col in zip(*options)) if options else ([],) * 5
        depth = len(free)
        smin_o, smin_c0, smin_c1, s_red = ([0.0] * (depth + 1) for _ in range(4))
        for d in range(depth - 1, -1, -1):
            smin_o[d] = smin_o[d + 1] + min(opt_o[d])
            smin_c0[d] = smin_c0[d + 1] + min(opt_c0[d])
            smin_c1[d] = smin_c1[d + 1] + min(opt_c1[d])
            s_red[d] = s_red[d + 1] + opt_red[d][0]
        # LP bounds of the blocks below each depth: one resource kept as a constraint (solved
        # exactly by the frontier), the other dualized with the root multiplier. Much stronger
        # than the root Lagrangian bound deep in the tree; built for moderate depths only (memory
        # ~ depth x moves).
        lp0 = lp1 = None
        if depth > 0:
            lp0 = _DepthLP(obj[free] + l1 * _zero_inf(c1[free]), c0[free])
            if np.any(_zero_inf(c1) != 0):
                lp1 = _DepthLP(obj[free] + l0 * _zero_inf(c0[free]), c1[free])
        return _Tree(
            free=free, fixed_col=fixed_col, base_o=base[0], base_c0=base[1], base_c1=base[2], l0=l0, l1=l1,
            opt_col=opt_col, opt_o=opt_o, opt_c0=opt_c0, opt_c1=opt_c1,
            smin_o=smin_o, smin_c0=smin_c0, smin_c1=smin_c1, s_red=s_red,
            same_as_prev=same_as_prev, lp0=lp0, lp1=lp1,
        )


def _search_order(
    obj: np.ndarray, c0: np.ndarray, c1: np.ndarray, red: np.ndarray, allowed: np.ndarray, single: np.ndarray
) -> tuple[np.ndarray, list[bool]]:
    """The blocks with a choice, in search order (largest spread of Lagrangian cost first), and
    whether each is identical to the one before it."""
    free = np.nonzero(~single)[0]
    spread = np.where(allowed, red, -np.inf).max(axis=1) - np.where(allowed, red, np.inf).min(axis=1)
    # Identical blocks (same options in every table: the repeated layers of a model under a prior)
    # make the tree symmetric: any permutation of their choices is the same allocation. They are
    # placed next to each other and forced to non-decreasing option indices (one representative
    # of each permutation class), which removes the symmetric copies.
    rows_key = np.concatenate([obj, c0, c1], axis=1)[free]
    group = np.unique(rows_key, axis=0, return_inverse=True)[1].reshape(-1) if len(free) else free
    order = np.lexsort((group, -spread[free]))
    free, group = free[order], group[order]
    same_as_prev = [False] + [bool(group[d] == group[d - 1]) for d in range(1, len(free))]
    return free, same_as_prev


def _options(
    b: int, allowed: np.ndarray, red: np.ndarray, obj: np.ndarray, c0: np.ndarray, c1: np.ndarray
) -> tuple[list[int], list[float], list[float], list[float], list[float]]:
    """Block ``b``'s options in increasing Lagrangian cost: columns, objective, uses, costs."""
    cols = np.nonzero(allowed[b])[0]
    cols = cols[np.argsort(red[b, cols], kind="stable")]
    return cols.tolist(), obj[b, cols].tolist(), c0[b, cols].tolist(), c1[b, cols].tolist(), red[b, cols].tolist()


def _depth_first(
    t: _Tree,
    accept: _Accept,
    best: float,
    best_x: np.ndarray | None,
    node_limit: int | None,
    stop_at_first: bool,
    resolution: float,
    rel_tol: float,
) -> _Search:
    """The depth-first loop of :func:`_branch_and_bound` over a tree of depth >= 1."""
    depth = t.depth
    opt_o, opt_c0, opt_c1 = t.opt_o, t.opt_c0, t.opt_c1
    smin_o, smin_c0, smin_c1, s_red = t.smin_o, t.smin_c0, t.smin_c1, t.s_red
    l0, l1, lp0, lp1, same_as_prev = t.l0, t.l1, t.lp0, t.lp1, t.same_as_prev
    thr = _threshold(best, resolution, rel_tol)
    one0 = one1 = 1.0 + _FEAS_EPS
    choice = [0] * depth
    idx = [0] * depth
    po, pc0, pc1 = [0.0] * (depth + 1), [0.0] * (depth + 1), [0.0] * (depth + 1)
    po[0], pc0[0], pc1[0] = t.base_o, t.base_c0, t.base_c1
    nodes = 0
    complete = True
    d = 0
    while d >= 0:
        i = idx[d]
        if i >= len(opt_o[d]):
            d -= 1
            if d >= 0:
                idx[d] += 1
            continue
        nodes += 1
        if node_limit is not None and nodes > node_limit:
            complete = False
            break
        o = po[d] + opt_o[d][i]
        a0 = pc0[d] + opt_c0[d][i]
        a1 = pc1[d] + opt_c1[d][i]
        if o + s_red[d + 1] + l0 * (a0 - 1.0) + l1 * (a1 - 1.0) >= thr:  # the Lagrangian bound
            idx[d] = len(opt_o[d])  # later options have larger Lagrangian cost: all fail
            continue
        if a0 + smin_c0[d + 1] > one0 or a1 + smin_c1[d + 1] > one1 or o + smin_o[d + 1] >= thr:
            idx[d] = i + 1
            continue
        if lp0 is not None and d + 1 <= lp0.max_depth and d + 1 < depth:
            if o + lp0.bound(d + 1, 1.0 - a0) - l1 * (1.0 - a1) >= thr:
                idx[d] = i + 1
                continue
            if (
                lp1 is not None
                and d + 1 <= lp1.max_depth
                and o + lp1.bound(d + 1, 1.0 - a1) - l0 * (1.0 - a0) >= thr
            ):
                idx[d] = i + 1
                continue
        choice[d] = i
        if d == depth - 1:
            x = t.full_x(choice)
            if o < thr and accept(x):
                best, best_x = o, x
                thr = _threshold(best, resolution, rel_tol)
                if stop_at_first:
                    complete = True  # found what a feasibility search looks for
                    break
            idx[d] = i + 1
            continue
        po[d + 1], pc0[d + 1], pc1[d + 1] = o, a0, a1
        d += 1
        idx[d] = choice[d - 1] if same_as_prev[d] else 0
    return _Search(best if best_x is not None else math.inf, best_x, complete, nodes)


#: The per-depth LP bounds keep at most this many moves in all (memory and set-up grow with
#: depth x moves): on large problems they cover the first depths (the largest blocks, which the
#: search branches on first) and deeper nodes use the root Lagrangian bound only.
_LP_BOUND_MAX_ENTRIES = 300_000


class _DepthLP:
    """LP relaxation value of the blocks at depth >= d for a capacity of one resource.

    ``cost`` and ``use`` are ``(depth, formats)`` arrays in search order. For each depth, the
    frontier moves of the deeper blocks are kept in greedy order (least cost per unit saved first)
    with cumulative sums, so :meth:`bound` is a binary search: the LP of a multiple-choice
    knapsack with one constraint takes moves in that order and a fraction of the last one.
    """

    def __init__(self, cost: np.ndarray, use: np.ndarray) -> None:
        n, k = cost.shape
        rows = np.arange(n)
        front = _frontier(cost, use)
        valid = front.to >= 0
        depth_of = np.nonzero(valid.T)[0]
        saved = front.saved.T[valid.T]
        slope = front.slope.T[valid.T]
        # the cost a move adds, from the true costs (the stored slope may be nudged for order)
        to = np.where(valid, front.to, front.start[None, :])  # finite stand-ins where no move
        prev = np.vstack([front.start[None, :], to[:-1]])
        added_all = cost[rows[None, :], to] - cost[rows[None, :], prev]
        added = np.maximum(added_all.T[valid.T], 0.0)
        order = np.argsort(slope, kind="stable")
        depth_of, saved, added = depth_of[order], saved[order], added[order]
        start_use = use[rows, front.start]
        start_cost = cost[rows, front.start]
        su = np.concatenate([np.cumsum(start_use[::-1])[::-1], [0.0]])
        sc = np.concatenate([np.cumsum(start_cost[::-1])[::-1], [0.0]])
        self.start_use = su.tolist()
        self.start_cost = sc.tolist()
        self.cum_saved: list[list[float]] = []
        self.cum_added: list[list[float]] = []
        self.saved: list[list[float]] = []
        self.added: list[list[float]] = []
        self.max_depth = min(n, _LP_BOUND_MAX_ENTRIES // max(1, len(saved)))
        for d in range(self.max_depth + 1):
            keep = depth_of >= d
            sv, ad = saved[keep], added[keep]
            self.saved.append(sv.tolist())
            self.added.append(ad.tolist())
            self.cum_saved.append(np.cumsum(sv).tolist())
            self.cum_added.append(np.cumsum(ad).tolist())

    def bound(self, d: int, capacity: float) -> float:
        """LP value of blocks at depth >= ``d`` with ``capacity`` of the resource (inf: none fits)."""
        excess = self.start_use[d] - capacity
        # capacities are fractions of a budget of 1.0: within _FEAS_EPS is rounding, not excess
        if excess <= _FEAS_EPS:
            return self.start_cost[d]
        cs = self.cum_saved[d]
        p = bisect.bisect_left(cs, excess)
        if p >= len(cs):
            if not cs or excess > cs[-1] + _FEAS_EPS:
                return math.inf
            p = len(cs) - 1
        done_s = cs[p - 1] if p else 0.0
        done_a = self.cum_added[d][p - 1] if p else 0.0
        frac = min(1.0, (excess - done_s) / self.saved[d][p])
        return self.start_cost[d] + done_a + frac * self.added[d][p]
