"""Local improvement of a feasible allocation: single and pair moves, then the tie search.

:func:`_improve` takes the best single-block move that lowers risk within the slack, repeated,
then pair moves (one block up, one down) while they help. :func:`_tie_search` then searches the
near-ties of the LP solution exactly, which rounds repeated identical layers well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lightning_baoc.solver.problem import _Accept, _Problem, _raw_ok, _Scaled, _zero_inf
from lightning_baoc.solver.search import _branch_and_bound


def _improve(p: _Problem, s: _Scaled, x: np.ndarray, mb: float, tb: float | None, rounds: int = 64) -> np.ndarray:
    """Local search from a feasible ``x``: the best single move that lowers risk within the slack,
    repeated; when none is left, the best pair move (one block to a lower-risk format, another to
    a format that frees what the first needs). Feasibility is re-checked on the raw numbers."""
    n, k = s.r.shape
    rows = np.arange(n)
    x = x.copy()
    R, Mm = s.r, s.m
    Tt = s.t if s.t is not None else np.zeros_like(R)
    finite = np.isfinite(R)
    margin = 1e-12  # stay clear of the budgets by rounding noise
    for _ in range(rounds):
        slack_m = 1.0 - float(Mm[rows, x].sum()) - margin
        slack_t = (1.0 - float(Tt[rows, x].sum()) - margin) if s.t is not None else math.inf
        dr = R - R[rows, x][:, None]
        dm = Mm - Mm[rows, x][:, None]
        dt = Tt - Tt[rows, x][:, None]
        gain = np.where(finite & (dm <= slack_m) & (dt <= slack_t), dr, np.inf)
        b, f = divmod(int(np.argmin(gain)), k)
        if gain[b, f] < 0:
            trial = x.copy()
            trial[b] = f
            if _raw_ok(p, trial, mb, tb):
                x = trial
                continue
        up = np.where(finite & (dr < 0), dr, np.inf).reshape(-1)
        count = int(np.isfinite(up).sum())
        if count == 0:
            break
        cand = np.argpartition(up, min(15, count - 1))[: min(16, count)]
        cand = cand[np.argsort(up[cand])]
        improved = False
        for flat in cand.tolist():
            b, f = divmod(flat, k)
            # partner (c, g), c != b: together the two moves must fit the slack
            fits = finite & (dm <= slack_m - dm[b, f]) & (dt <= slack_t - dt[b, f])
            fits[b, :] = False
            cost = np.where(fits, dr, np.inf)
            c, g = divmod(int(np.argmin(cost)), k)
            total = cost[c, g] + up[flat]
            if total < 0 and abs(total) > 1e-13 * max(1e-300, abs(float(R[rows, x].sum()))):
                trial = x.copy()
                trial[b] = f
                trial[c] = g
                if _raw_ok(p, trial, mb, tb):
                    x = trial
                    improved = True
                    break
        if not improved:
            break
    return x


#: Relative width of the near-ties :func:`_tie_search` explores, and its node limit per width.
_TIE_WIDTHS = (1e-4, 1e-2)
_TIE_NODES = 20_000
#: The tie search runs only when the greedy answer is further than this from the lower bound.
_TIE_MIN_GAP = 1e-4


def _tie_search(p: _Problem, s: _Scaled, x: np.ndarray, mults: Sequence[float], accept: _Accept) -> np.ndarray:
    """Round the LP solution exactly among near-ties: at the best multipliers, keep for every
    block only the options whose Lagrangian cost is within a small relative width of its minimum,
    and search that reduced problem exhaustively (within a node limit) for a better allocation.

    The LP optimum is fractional in at most two blocks, or, with identical blocks (the repeated
    layers of a model), in at most two groups of them; the greedy's two roundings (memory, then
    time) can then miss the best integer split by several percent, which this finds in a few
    thousand nodes (the search's symmetry breaking enumerates counts per group, not orders).
    """
    rows = np.arange(len(x))
    lam = mults[0] if mults else 0.0
    mu = mults[1] if len(mults) > 1 else 0.0
    red = s.r + lam * _zero_inf(s.m)
    size = np.abs(_zero_inf(s.r)) + lam * _zero_inf(s.m)
    if s.t is not None:
        red = red + mu * _zero_inf(s.t)
        size = size + mu * _zero_inf(s.t)
    best_red = red.min(axis=1)
    scale = np.where(np.isfinite(red), size, 0.0).max(axis=1)
    cons = [s.m] + ([s.t] if s.t is not None else [])
    for width in _TIE_WIDTHS:
        near = red <= (best_red + width * scale)[:, None]
        if not (near.sum(axis=1) > 1).any():
            continue
        value = float(s.r[rows, x].sum())
        search = _branch_and_bound(
            np.where(near, s.r, np.inf),
            [np.where(near, c, np.inf) for c in cons],
            list(mults),
            accept,
            (value, x),
            _TIE_NODES,
        )
        if search.x is not None and search.value < value:
            x = search.x
    return x
