"""The relaxation: risk-per-byte frontiers, the greedy, and the Lagrangian multipliers.

For one resource, the LP relaxation of the multiple-choice knapsack is solved exactly by a greedy
over each block's lower convex hull of (resource, cost) (:func:`_frontier`): hull segments of all
blocks are taken in increasing order of cost per unit saved until the budget holds (:func:`_cut`,
:func:`_apply`), the one fractional segment rounded to the saving side. With a time budget,
:func:`_greedy` searches the time multiplier ``mu`` (cost ``r + mu * t``) by a safeguarded
regula falsi (:class:`_TimeMultiplier`), blends the allocations just over and just within the
time budget (:func:`_blend`) and keeps the best Lagrangian lower bound met on the way
(:func:`_dual`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lightning_baoc.solver.problem import _Accept, _Problem, _raw_memory, _raw_ok, _raw_time, _Scaled, _zero_inf

# ---------------------------------------------------------------------------- the frontier


@dataclass
class _Frontier:
    """Per-block lower convex hulls of (resource, cost), cut into segments ("moves").

    Move ``r`` of a block goes from its hull point ``r`` to hull point ``r + 1`` (point 0 is the
    block's cheapest-cost option); moves are stored as ``(steps, blocks)`` arrays.
    """

    start: np.ndarray  # column of each block's cheapest-cost option (lowest resource among ties)
    to: np.ndarray  # column reached by move r of block b; -1 if the block has no such move
    saved: np.ndarray  # resource saved by the move (> 0)
    slope: np.ndarray  # cost added per unit of resource saved (nondecreasing along a block)
    start_use: float  # total resource with every block at its start


def _frontier(cost: np.ndarray, use: np.ndarray) -> _Frontier:
    """The risk-per-byte frontier: each block's lower convex hull of (use, cost) from its
    cheapest-cost option down to its smallest-use option.

    Gift wrapping, vectorized over blocks: from the current hull point, the next one is the
    option with smaller use that adds the least cost per unit of use saved (the farthest one on
    ties, so collinear points are skipped). At most ``formats - 1`` steps, each over the blocks
    whose hull goes on.
    """
    n, k = cost.shape
    rows = np.arange(n)
    finite = np.isfinite(cost) & np.isfinite(use)
    cost = np.where(finite, cost, np.inf)
    use_f = np.where(finite, use, np.inf)
    cmin = cost.min(axis=1)
    start = np.argmin(np.where(cost == cmin[:, None], use_f, np.inf), axis=1)
    to_l, saved_l, slope_l = [], [], []
    act = rows  # blocks whose hull may go on
    cur = start
    for _ in range(k - 1):
        u = use_f[act]
        c = cost[act]
        wc = u[np.arange(len(act)), cur]
        dw = wc[:, None] - u
        cand = dw > 0  # use_f is inf where not allowed: dw is -inf there
        with np.errstate(invalid="ignore", divide="ignore"):
            slope = (c - cost[act, cur][:, None]) / dw
        slope[~cand] = np.inf
        smin = slope.min(axis=1)
        has = smin < np.inf
        if not has.any():
            break
        act, slope, u, dw, smin = act[has], slope[has], u[has], dw[has], smin[has]
        nxt = np.argmin(np.where(slope == smin[:, None], u, np.inf), axis=1)
        sub = np.arange(len(act))
        to = np.full(n, -1, dtype=np.int64)
        saved = np.zeros(n)
        slp = np.full(n, np.inf)
        to[act] = nxt
        saved[act] = dw[sub, nxt]
        slp[act] = np.maximum(smin, 0.0)
        to_l.append(to)
        saved_l.append(saved)
        slope_l.append(slp)
        cur = nxt
    if to_l:
        to_a = np.stack(to_l)
        saved_a = np.stack(saved_l)
        # slopes of a convex hull increase along it; rounding must not reorder a block's moves
        slope_a = np.maximum.accumulate(np.stack(slope_l), axis=0)
    else:
        to_a = np.zeros((0, n), dtype=np.int64)
        saved_a = np.zeros((0, n))
        slope_a = np.zeros((0, n))
    return _Frontier(start, to_a, saved_a, slope_a, float(use_f[rows, start].sum()))


def _cut(front: _Frontier, excess: float) -> tuple[np.ndarray, float] | None:
    """Moves to take so the resource drops by at least ``excess``: the greedy order (least cost
    per unit saved first), as a count per block; and the multiplier (slope of the last move).

    Returns ``None`` if all moves together save less than ``excess``.
    """
    n = front.start.shape[0]
    if excess <= 0:
        return np.zeros(n, dtype=np.int64), 0.0
    valid = front.to >= 0
    flat_slope = front.slope.T[valid.T]  # block-major: a block's moves in order
    flat_saved = front.saved.T[valid.T]
    flat_block = np.nonzero(valid.T)[0]
    if flat_slope.size == 0:
        return None
    order = np.argsort(flat_slope)
    cum = np.cumsum(flat_saved[order])
    pos = int(np.searchsorted(cum, excess, side="left"))
    if pos >= len(cum):
        if cum[-1] < excess * (1 - 1e-12):
            return None
        pos = len(cum) - 1  # short only by rounding: take everything, the raw check decides
    lam = float(flat_slope[order[pos]])
    below = flat_slope < lam
    need = excess - float(flat_saved[below].sum())
    take = below.copy()
    if need > 0:
        # Ties at the threshold are taken in block-major order: a block's tied moves are
        # consecutive, so every block still takes a prefix of its moves.
        tie = np.nonzero(flat_slope == lam)[0]
        cum_tie = np.cumsum(flat_saved[tie])
        upto = min(int(np.searchsorted(cum_tie, need, side="left")) + 1, len(tie))
        take[tie[:upto]] = True
    counts = np.bincount(flat_block[take], minlength=n)
    return counts, lam


def _apply(front: _Frontier, counts: np.ndarray) -> np.ndarray:
    """Each block's column after its first ``counts[b]`` moves."""
    x = front.start.copy()
    moved = counts > 0
    if moved.any():
        idx = np.nonzero(moved)[0]
        x[idx] = front.to[counts[idx] - 1, idx]
    return x


def _extra(front: _Frontier, counts: np.ndarray) -> np.ndarray | None:
    """One more move: the cheapest next move of any block (to fix a rounding shortfall)."""
    n = counts.shape[0]
    steps = front.to.shape[0]
    rows = np.arange(n)
    ok = counts < steps
    if not ok.any():
        return None
    nxt = np.minimum(counts, max(steps - 1, 0))
    valid = ok & (front.to[nxt, rows] >= 0)
    if not valid.any():
        return None
    slope = np.where(valid, front.slope[nxt, rows], np.inf)
    b = int(np.argmin(slope))
    out = counts.copy()
    out[b] += 1
    return out


# ---------------------------------------------------------------------------- the greedy and the multipliers


def _dual(s: _Scaled, lam: float, mu: float) -> float:
    """Lagrangian dual value: a lower bound on the optimal scaled risk for any lam, mu >= 0."""
    red = s.r + lam * _zero_inf(s.m)
    if s.t is not None:
        red = red + mu * _zero_inf(s.t)
    return float(np.min(red, axis=1).sum()) - lam - (mu if s.t is not None else 0.0)


@dataclass
class _Greedy:
    x: np.ndarray | None  # best feasible choice found (None: none found)
    lam: float
    mu: float
    bound: float  # best Lagrangian lower bound (scaled)


def _memory_greedy(p: _Problem, s: _Scaled, cost: np.ndarray, memory_budget: float) -> tuple[np.ndarray | None, float]:
    """Frontier greedy for memory with ``cost`` per option: the choice and its multiplier."""
    x, lam = _frontier_choice(cost, s.m, lambda x: _raw_memory(p, x) <= memory_budget)
    return x, (lam if x is not None else math.inf)


def _greedy(p: _Problem, s: _Scaled, mb: float, tb: float | None) -> _Greedy:
    """Lagrangian greedy over the frontier; bisection on the time multiplier ``mu``."""
    if s.t is None or tb is None:
        x, lam = _memory_greedy(p, s, s.r, mb)
        bound = _dual(s, lam, 0.0) if x is not None else -math.inf
        return _Greedy(x, lam, 0.0, bound)
    walk = _TimeMultiplier(p, s, mb, tb)
    first, _ = walk.evaluate(0.0)
    if first is None:
        return _Greedy(None, 0.0, 0.0, -math.inf)
    if not first:
        bracket = walk.bracket()
        if bracket is not None:
            lo, hi = walk.regula_falsi(*bracket)
            # The bound is concave in mu and peaks near the crossing (not exactly at it, since the
            # crossing is found on the rounded allocation): a few golden-section steps on a
            # bracket around it tighten the reported lower bound, unless it is tight already.
            if walk.best_r - walk.best_bound > 1e-4 * abs(walk.best_r):
                _golden(lambda mu: walk.evaluate(mu)[1], (lo if lo > 0 else hi * 1e-3) / 4.0, hi * 4.0, 4)
            walk.blend()
    return _Greedy(walk.best_x, walk.best_mults[0], walk.best_mults[1], walk.best_bound)


class _TimeMultiplier:
    """The search of :func:`_greedy` for the time multiplier ``mu`` at which the time budget starts
    to hold, and what it meets on the way: the best allocation within both budgets, the best
    Lagrangian bound with its multipliers, and the allocations on both sides of the crossing."""

    def __init__(self, p: _Problem, s: _Scaled, mb: float, tb: float) -> None:
        assert s.t is not None
        self.p, self.s, self.mb, self.tb = p, s, mb, tb
        self.st0 = _zero_inf(s.t)
        self.rows = np.arange(len(p.blocks))
        self.best_x: np.ndarray | None = None
        self.best_r = math.inf
        self.best_bound = -math.inf
        self.best_mults = (0.0, 0.0)
        # the allocations on both sides of the crossing: the last over the time budget (largest mu)
        # and the first within it (smallest mu), as (mu, allocation)
        self.over: tuple[float, np.ndarray | None] = (-math.inf, None)
        self.within: tuple[float, np.ndarray | None] = (math.inf, None)
        self.used = 0.0  # scaled time of the last evaluated allocation

    def evaluate(self, mu: float) -> tuple[bool | None, float]:
        """Greedy at this mu: (time budget met?, Lagrangian bound); None: memory cannot be met."""
        p, s, rows = self.p, self.s, self.rows
        x, lam = _memory_greedy(p, s, s.r + mu * self.st0, self.mb)
        if x is None:
            return None, -math.inf
        self.used = float(self.st0[rows, x].sum())
        bound = _dual(s, lam, mu)
        if bound > self.best_bound:
            self.best_bound, self.best_mults = bound, (lam, mu)
        ok = _raw_time(p, x) <= self.tb
        if ok:
            r = float(s.r[rows, x].sum())
            if r < self.best_r:
                self.best_r, self.best_x = r, x
            if mu < self.within[0]:
                self.within = (mu, x)
        elif mu > self.over[0]:
            self.over = (mu, x)
        return ok, bound

    def bracket(self) -> tuple[float, float, float, float] | None:
        """After ``evaluate(0.0)`` missed the time budget: ``(lo, hi, f_lo, f_hi)`` with the budget
        missed at ``lo`` and met at ``hi`` (``f``: scaled time used - 1), or ``None`` if no
        multiplier meets it."""
        f_lo = self.used - 1.0
        lo, hi = 0.0, 1.0
        state, _ = self.evaluate(hi)
        while state is False and hi < 1e15:
            lo, hi, f_lo = hi, hi * 16.0, self.used - 1.0
            state, _ = self.evaluate(hi)
        f_hi = self.used - 1.0
        if not state:
            return None
        if lo == 0.0:
            while hi > 1e-12:
                got, _ = self.evaluate(hi / 16.0)
                if not got:
                    lo, f_lo = hi / 16.0, self.used - 1.0
                    break
                hi, f_hi = hi / 16.0, self.used - 1.0
        return lo, hi, f_lo, f_hi

    def regula_falsi(self, lo: float, hi: float, f_lo: float, f_hi: float) -> tuple[float, float]:
        """Narrow the bracket around the crossing; returns the final ``(lo, hi)``."""
        # Find the crossing in log(mu): regula falsi on the time used (Illinois variant: the
        # end that stays has its value halved, so both ends move), kept off the ends.
        side = 0
        for _ in range(40):
            if lo <= 0 or hi / lo < 1.0 + 1e-3:
                break
            if self.best_r - self.best_bound <= 1e-9 * abs(self.best_r):
                break  # the bound already proves the allocation (near-)optimal
            a, b = math.log(lo), math.log(hi)
            t = f_lo / (f_lo - f_hi) if f_lo - f_hi > 0 else 0.5
            mid = math.exp(a + min(max(t, 0.05), 0.95) * (b - a))
            got, _ = self.evaluate(mid)
            if got:
                hi, f_hi = mid, self.used - 1.0
                if side == 1:
                    f_lo /= 2.0
                side = 1
            else:
                lo, f_lo = mid, self.used - 1.0
                if side == -1:
                    f_hi /= 2.0
                side = -1
        return lo, hi

    def blend(self) -> None:
        """Keep the blend of the allocations on both sides of the crossing if it is better."""
        over, within = self.over[1], self.within[1]
        if over is not None and within is not None:
            x = _blend(self.p, self.s, over, within, self.mb, self.tb)
            if x is not None and float(self.s.r[self.rows, x].sum()) < self.best_r:
                self.best_x, self.best_r = x, float(self.s.r[self.rows, x].sum())


def _golden(f: Callable[[float], float], a: float, b: float, steps: int) -> None:
    """Golden-section search for the maximum of a concave ``f`` over ``[a, b]`` in log space
    (``f`` records what it sees; the caller keeps the best)."""
    la, lb = math.log(a), math.log(b)
    m1, m2 = lb - 0.618 * (lb - la), la + 0.618 * (lb - la)
    f1, f2 = f(math.exp(m1)), f(math.exp(m2))
    for _ in range(steps):
        if f1 >= f2:
            lb, m2, f2 = m2, m1, f1
            m1 = lb - 0.618 * (lb - la)
            f1 = f(math.exp(m1))
        else:
            la, m1, f1 = m1, m2, f2
            m2 = la + 0.618 * (lb - la)
            f2 = f(math.exp(m2))


def _blend(p: _Problem, s: _Scaled, over: np.ndarray, within: np.ndarray, mb: float, tb: float) -> np.ndarray | None:
    """Round the time dimension like the frontier rounds memory: from the allocation just over the
    time budget, switch blocks to their choice in the allocation just within it, least risk added
    per unit of time saved first, until the time budget holds (memory kept within its budget).

    At the crossing many blocks can switch at once (identical layers switch together), so the
    allocation within the budget can leave much of it unused; the LP would take a fraction of the
    switch, and this takes just as many blocks as needed.
    """
    assert s.t is not None
    diff = np.nonzero(over != within)[0]
    if diff.size == 0:
        return None
    margin = 1e-12
    x = over.copy()
    dr = s.r[diff, within[diff]] - s.r[diff, over[diff]]
    dt = s.t[diff, within[diff]] - s.t[diff, over[diff]]
    dm = s.m[diff, within[diff]] - s.m[diff, over[diff]]
    rows = np.arange(len(x))
    used_t = float(s.t[rows, x].sum())
    used_m = float(s.m[rows, x].sum())
    saving = dt < 0
    ratio = np.where(saving, dr / np.where(saving, -dt, 1.0), np.inf)
    for j in np.argsort(ratio, kind="stable").tolist():
        if used_t <= 1.0 - margin:
            break
        if not saving[j] or used_m + dm[j] > 1.0 - margin:
            continue
        b = diff[j]
        x[b] = within[b]
        used_t += float(dt[j])
        used_m += float(dm[j])
    if used_t > 1.0 - margin or not _raw_ok(p, x, mb, tb):
        return None
    return x


def _frontier_choice(cost: np.ndarray, use: np.ndarray, accept: _Accept) -> tuple[np.ndarray | None, float]:
    """Frontier greedy on (``use``, ``cost``) down to total use 1; ``accept`` checks the raw total
    (rounding in the scaled sums may leave it a hair above: then one more move is taken)."""
    front = _frontier(cost, use)
    cut = _cut(front, front.start_use - 1.0)
    if cut is None:
        return None, 0.0
    counts, lam = cut
    x = _apply(front, counts)
    while not accept(x):
        more = _extra(front, counts)
        if more is None:
            return None, lam
        counts = more
        x = _apply(front, counts)
    return x, lam
