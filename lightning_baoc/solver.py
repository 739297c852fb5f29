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

An infeasible budget raises :class:`BudgetInfeasibleError` with the smallest feasible memory
(at the time budget) and time (at the memory budget), found by the same exact search.

Pure Python and numpy: no torch here.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .budget import ceil_significant, format_bytes, format_seconds, parse_memory_budget, parse_time_budget

#: The format names of :data:`lightning_baoc.FORMATS`, in its order (kept here so the solver
#: imports no torch; a test holds the two equal). Tables may also use other names.
KNOWN_FORMATS: tuple[str, ...] = (
    "fp32",
    "bf16_momentum",
    "bf16",
    "nomomentum",
    "int8",
    "int8_factored",
    "nomomentum_int8",
    "factored",
    "offload",
)

#: ``method="auto"`` improves the greedy answer by branch-and-bound on problems with at most this
#: many blocks that have a choice, within :data:`AUTO_EXACT_NODES` search nodes in all; small
#: problems end proven optimal.
AUTO_EXACT_BLOCKS = 400
#: Node limit of the search under ``method="auto"`` (about a second of pure Python at most).
AUTO_EXACT_NODES = 400_000
# Relative tolerances of the successive search levels (0: exact, up to 1e-10 of rounding).
_SEARCH_TOLERANCES = (1e-2, 1e-3, 1e-4, 0.0)
#: Node limit when computing the smallest feasible budgets for an error message on problems too
#: large to finish: the message then gives the best budget found, marked as not proven minimal.
ERROR_SEARCH_NODES = 1_000_000

Table = Mapping[str, Mapping[str, float]]
# re-checks a complete allocation (a column per block) on the raw numbers
_Accept = Callable[[np.ndarray], bool]
Method = Literal["auto", "greedy", "exact"]
_METHODS = ("auto", "greedy", "exact")

# Relative slack on normalized budgets inside the search (budgets are 1.0 there). Pruning is
# conservative by this much; every accepted allocation is re-checked on the raw numbers.
_FEAS_EPS = 1e-12

# Relative slack on a time budget: step times are measured (or prior) seconds summed in different
# orders by different callers, so a budget equal to an allocation's time up to rounding (a multiple
# of 1.0 of an fp32 step summed by ``sum``, an allocation's time by ``math.fsum``) must admit it.
# Memory is integer bytes and gets none.
TIME_BUDGET_RTOL = 1e-9


class BudgetInfeasibleError(ValueError):
    """No allocation meets the budgets.

    Attributes:
        memory_budget: the memory budget given (absolute, in the memory table's unit: bytes).
        time_budget: the time budget given (absolute seconds), or ``None``.
        min_memory: the smallest total memory of any allocation that meets the time budget (with
            no time budget: of any allocation); ``None`` if no allocation meets the time budget.
        min_time: the smallest total time of any allocation that meets the memory budget; ``None``
            without a time table or if no allocation meets the memory budget.
        exact: whether ``min_memory`` / ``min_time`` are proven minimal (they are, except on very
            large problems where the search hit its limit; they are then achievable budgets).
        fp32_memory: fp32 AdamW state memory of the blocks (the reference of fractional budgets).
        fp32_time: fp32 AdamW step time of the blocks (the reference of time multiples).

    Example:
        >>> risk = {"a": {"fp32": 0.0, "int8": 1.0}}
        >>> memory = {"a": {"fp32": 800, "int8": 212}}
        >>> try:
        ...     solve(risk, memory, memory_budget=100)
        ... except BudgetInfeasibleError as err:
        ...     print(err.min_memory)
        212
    """

    def __init__(
        self,
        message: str,
        *,
        memory_budget: float,
        time_budget: float | None,
        min_memory: float | None,
        min_time: float | None,
        exact: bool = True,
        fp32_memory: float | None = None,
        fp32_time: float | None = None,
    ) -> None:
        super().__init__(message)
        self.memory_budget = memory_budget
        self.time_budget = time_budget
        self.min_memory = min_memory
        self.min_time = min_time
        self.exact = exact
        self.fp32_memory = fp32_memory
        self.fp32_time = fp32_time


@dataclass(frozen=True)
class Allocation:
    """The answer of :func:`solve`: a format per block and its totals.

    Attributes:
        formats: block -> chosen format, in the order of the risk table.
        memory: total memory of the choice (an int when the memory table holds ints).
        time: total step time of the choice, or ``None`` without a time table.
        risk: total risk of the choice.
        memory_budget: the memory budget it meets (absolute).
        time_budget: the time budget it meets (absolute seconds), or ``None``.
        lower_bound: a proven lower bound on the optimal risk (equal to ``risk`` when optimal).
        optimal: whether ``risk`` is proven to be the minimum.
        method: what produced the answer: ``"greedy"`` (frontier greedy and local improvement),
            ``"search"`` (the exhaustive feasibility search, when the greedy found nothing that
            meets both budgets), ``"...+search"`` (then improved by branch-and-bound), ``"exact"``.
        masked: formats excluded by the mask -> reason.
        segments: with boundary selection, the blocks of each segment (one format per segment).
        fp32_memory: the fp32 AdamW state memory of the blocks, when every block has ``fp32``.
        fp32_time: the fp32 AdamW step time of the blocks, when every block has ``fp32``.
    """

    formats: dict[str, str]
    memory: float
    time: float | None
    risk: float
    memory_budget: float
    time_budget: float | None = None
    lower_bound: float = 0.0
    optimal: bool = False
    method: str = "greedy"
    masked: dict[str, str] = field(default_factory=dict)
    segments: tuple[tuple[str, ...], ...] | None = None
    fp32_memory: float | None = None
    fp32_time: float | None = None

    @property
    def gap(self) -> float:
        """Relative gap between :attr:`risk` and :attr:`lower_bound` (0 when proven optimal)."""
        if self.optimal or self.risk <= self.lower_bound:
            return 0.0
        return (self.risk - self.lower_bound) / max(abs(self.risk), 1e-300)

    @property
    def boundaries(self) -> int:
        """Number of places where the format changes between consecutive blocks."""
        chosen = list(self.formats.values())
        return sum(1 for a, b in zip(chosen, chosen[1:]) if a != b)

    def counts(self) -> dict[str, int]:
        """Format -> number of blocks that use it."""
        out: dict[str, int] = {}
        for fmt in self.formats.values():
            out[fmt] = out.get(fmt, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready form (primitives only)."""
        return {
            "formats": dict(self.formats),
            "memory": self.memory,
            "time": self.time,
            "risk": self.risk,
            "memory_budget": self.memory_budget,
            "time_budget": self.time_budget,
            "lower_bound": self.lower_bound,
            "optimal": self.optimal,
            "method": self.method,
            "masked": dict(self.masked),
            "segments": [list(s) for s in self.segments] if self.segments is not None else None,
        }


# ---------------------------------------------------------------------------- the problem


@dataclass
class _Problem:
    """The tables as dense arrays: rows are blocks, columns formats; ``inf`` where not allowed."""

    blocks: list[str]
    formats: list[str]
    risk: np.ndarray
    memory: np.ndarray
    time: np.ndarray | None
    memory_int: bool
    masked: dict[str, str]
    fp32_memory: float | None
    fp32_time: float | None

    @property
    def allowed(self) -> np.ndarray:
        return np.isfinite(self.risk)

    def totals(self, x: np.ndarray) -> tuple[float, float, float | None]:
        """Exact totals (risk, memory, time) of choice ``x`` (column per block)."""
        rows = np.arange(len(x))
        risk = math.fsum(self.risk[rows, x].tolist())
        if self.memory_int:
            memory: float = sum(int(v) for v in self.memory[rows, x].tolist())
        else:
            memory = math.fsum(self.memory[rows, x].tolist())
        time = math.fsum(self.time[rows, x].tolist()) if self.time is not None else None
        return risk, memory, time


def _order_formats(names: Iterable[str]) -> list[str]:
    known = {name: i for i, name in enumerate(KNOWN_FORMATS)}
    return sorted(set(names), key=lambda n: (known.get(n, len(known)), n))


def _check_number(value: object, table: str, block: str, fmt: str, *, nonneg: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{table}[{block!r}][{fmt!r}] must be a number, got {value!r} of type {type(value).__name__}"
        )
    v = float(value)
    if math.isnan(v):
        raise ValueError(f"{table}[{block!r}][{fmt!r}] is NaN; allowed: finite numbers >= 0")
    if math.isinf(v):
        raise ValueError(f"{table}[{block!r}][{fmt!r}] is {v}; allowed: finite numbers >= 0")
    if nonneg and v < 0:
        raise ValueError(
            f"{table}[{block!r}][{fmt!r}] = {value!r} is negative; allowed: finite numbers >= 0 "
            f"(a risk is an expected harm, a memory or time a cost)"
        )


def check_mask(mask: Mapping[str, str] | Iterable[str] | None, known: Iterable[str] = ()) -> dict[str, str]:
    """Validate a mask of excluded formats: names -> reasons (or just names).

    Args:
        mask: excluded format names, or a mapping of them to the reason (default reason: "masked").
        known: further accepted names besides :data:`KNOWN_FORMATS` (e.g. a table's formats).

    Raises:
        ValueError: a name that is not a known format; the message lists the allowed ones.
        TypeError: the mask is not a mapping or an iterable of strings.

    Example:
        >>> check_mask(["offload"])
        {'offload': 'masked'}
    """
    if mask is None:
        return {}
    if isinstance(mask, str):
        mask = [mask]
    if isinstance(mask, Mapping):
        items = [(k, v) for k, v in mask.items()]
    else:
        try:
            items = [(k, "masked") for k in mask]
        except TypeError:
            raise TypeError(
                f"mask must be a mapping format -> reason or an iterable of format names, got "
                f"{mask!r} of type {type(mask).__name__}"
            ) from None
    allowed = _order_formats([*KNOWN_FORMATS, *known])
    out: dict[str, str] = {}
    for name, reason in items:
        if not isinstance(name, str) or name not in allowed:
            raise ValueError(f"Unknown format {name!r} in mask; allowed: {allowed}")
        out[name] = str(reason)
    return out


def _build(
    risk: Table, memory: Table, time: Table | None, mask: Mapping[str, str] | Iterable[str] | None
) -> _Problem:
    for name, table in (("risk", risk), ("memory", memory), ("time", time)):
        if table is None and name == "time":
            continue
        if not isinstance(table, Mapping):
            raise TypeError(
                f"{name} must be a mapping block -> format -> number, got {type(table).__name__}"
            )
    if not risk:
        raise ValueError("risk is empty; expected at least one block: block -> format -> number")
    blocks = list(risk)
    for name, table in (("memory", memory), ("time", time)):
        if table is None:
            continue
        extra = [b for b in table if b not in risk]
        if extra:
            raise ValueError(
                f"{name} has blocks that risk does not have: {extra[:5]}; the tables must describe "
                f"the same blocks"
            )
    names: set[str] = set()
    for b in blocks:
        rb = risk[b]
        if not isinstance(rb, Mapping):
            raise TypeError(f"risk[{b!r}] must be a mapping format -> number, got {type(rb).__name__}")
        if not rb:
            raise ValueError(f"risk[{b!r}] is empty: block {b!r} allows no format")
        names.update(rb)
    for f in names:
        if not isinstance(f, str):
            raise TypeError(f"format names must be strings, got {f!r}")
    masked = check_mask(mask, names)
    formats = _order_formats(names)
    col = {f: j for j, f in enumerate(formats)}
    n, k = len(blocks), len(formats)

    rows: list[int] = []
    cols: list[int] = []
    rvals: list[Any] = []
    mvals: list[Any] = []
    tvals: list[Any] = []
    tables = [("memory", memory)] + ([("time", time)] if time is not None else [])
    outs = [mvals] + ([tvals] if time is not None else [])
    col_of = col.__getitem__
    for i, b in enumerate(blocks):
        rb = risk[b]
        if masked:
            fs: Any = [f for f in rb if f not in masked]
            rvals.extend([rb[f] for f in fs])
        else:
            fs = rb.keys()
            rvals.extend(rb.values())
        for (name, table), out in zip(tables, outs):
            tb = table.get(b)
            if not isinstance(tb, Mapping):
                raise ValueError(f"{name} has no entry for block {b!r}; every block of risk needs one")
            try:
                out.extend([tb[f] for f in fs])
            except KeyError as missing:
                f = missing.args[0]
                raise ValueError(
                    f"{name}[{b!r}] has no {f!r} entry, but risk[{b!r}] allows {f!r}: give its "
                    f"{'bytes' if name == 'memory' else 'step time'}, or drop {f!r} from risk[{b!r}] "
                    f"to disallow it"
                ) from None
        rows.extend([i] * len(fs))
        cols.extend(map(col_of, fs))

    def where(j: int) -> tuple[str, str]:
        return blocks[rows[j]], formats[cols[j]]

    def as_array(values: list[Any], name: str) -> np.ndarray:
        # fast path: plain ints and floats; anything else is checked one by one
        if not set(map(type, values)) <= {int, float}:
            for j, v in enumerate(values):
                if type(v) not in (int, float):
                    _check_number(v, name, *where(j), nonneg=True)
        arr = np.asarray(values, dtype=np.float64)
        bad = ~np.isfinite(arr) | (arr < 0)
        if bad.any():
            j = int(np.argmax(bad))
            _check_number(values[j], name, *where(j), nonneg=True)
        return arr

    memory_int = all(issubclass(t, (int, np.integer)) for t in set(map(type, mvals)))
    R = np.full((n, k), np.inf)
    M = np.full((n, k), np.inf)
    R[rows, cols] = as_array(rvals, "risk")
    M[rows, cols] = as_array(mvals, "memory")
    T = None
    if time is not None:
        T = np.full((n, k), np.inf)
        T[rows, cols] = as_array(tvals, "time")
    empty = ~np.isfinite(R).any(axis=1)
    if empty.any():
        b = blocks[int(np.argmax(empty))]
        raise ValueError(
            f"block {b!r} has no allowed format left: it allows {sorted(risk[b])}, and the mask "
            f"excludes {sorted(set(risk[b]) & set(masked))}; allow another format for it or unmask one"
        )

    def reference(table: Table | None) -> float | None:
        if table is None:
            return None
        values = [table[b].get("fp32") for b in blocks]
        types = set(map(type, values))
        if not types <= {int, float} and any(
            v is None or isinstance(v, bool) or not isinstance(v, numbers.Real) for v in values
        ):
            return None
        if not np.isfinite(np.asarray(values, dtype=np.float64)).all():
            return None
        if all(issubclass(t, (int, np.integer)) for t in types):
            return sum(values)
        return math.fsum(values)

    return _Problem(blocks, formats, R, M, T, memory_int, masked, reference(memory), reference(time))


def _dominated(R: np.ndarray, M: np.ndarray, T: np.ndarray | None) -> np.ndarray:
    """Options no better than another option of the same block in risk, memory and time."""
    Tz = T if T is not None else np.zeros_like(R)
    allowed = np.isfinite(R)
    r_i, r_j = R[:, :, None], R[:, None, :]
    m_i, m_j = M[:, :, None], M[:, None, :]
    t_i, t_j = Tz[:, :, None], Tz[:, None, :]
    k = R.shape[1]
    # i dominates j: no worse everywhere, and strictly better somewhere or equal with a lower index
    no_worse = (r_i <= r_j) & (m_i <= m_j) & (t_i <= t_j)
    better = (r_i < r_j) | (m_i < m_j) | (t_i < t_j) | (np.arange(k)[:, None] < np.arange(k)[None, :])
    dom = no_worse & better & allowed[:, :, None] & allowed[:, None, :]
    np.einsum("bii->bi", dom)[...] = False
    return dom.any(axis=1)


# ---------------------------------------------------------------------------- greedy: the frontier


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


@dataclass
class _Scaled:
    """Normalized arrays for the search: budgets are 1.0, risks scaled to at most 1."""

    r: np.ndarray
    m: np.ndarray
    t: np.ndarray | None
    risk_scale: float


def _zero_inf(a: np.ndarray) -> np.ndarray:
    """``a`` with disallowed (infinite) entries set to 0, for products with a multiplier that may be
    0 (``0 * inf`` is NaN); the risk term keeps those entries infinite."""
    return np.where(np.isfinite(a), a, 0.0)


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


def _raw_memory(p: _Problem, x: np.ndarray) -> float:
    vals = p.memory[np.arange(len(x)), x]
    return float(vals.sum()) if p.memory_int else math.fsum(vals.tolist())


def _raw_time(p: _Problem, x: np.ndarray) -> float:
    assert p.time is not None
    return math.fsum(p.time[np.arange(len(x)), x].tolist())


def _greedy(p: _Problem, s: _Scaled, mb: float, tb: float | None) -> _Greedy:
    """Lagrangian greedy over the frontier; bisection on the time multiplier ``mu``."""
    if s.t is None or tb is None:
        x, lam = _memory_greedy(p, s, s.r, mb)
        bound = _dual(s, lam, 0.0) if x is not None else -math.inf
        return _Greedy(x, lam, 0.0, bound)
    st0 = _zero_inf(s.t)

    best_x: np.ndarray | None = None
    best_r = math.inf
    best_bound = -math.inf
    best_mults = (0.0, 0.0)
    rows = np.arange(len(p.blocks))

    # the allocations on both sides of the crossing: the last over the time budget (largest mu)
    # and the first within it (smallest mu)
    over: list[Any] = [-math.inf, None]
    within: list[Any] = [math.inf, None]

    used = [0.0]  # scaled time of the last evaluated allocation

    def evaluate(mu: float) -> tuple[bool | None, float]:
        """Greedy at this mu: (time budget met?, Lagrangian bound); None: memory cannot be met."""
        nonlocal best_x, best_r, best_bound, best_mults
        x, lam = _memory_greedy(p, s, s.r + mu * st0, mb)
        if x is None:
            return None, -math.inf
        used[0] = float(st0[rows, x].sum())
        bound = _dual(s, lam, mu)
        if bound > best_bound:
            best_bound, best_mults = bound, (lam, mu)
        ok = _raw_time(p, x) <= tb
        if ok:
            r = float(s.r[rows, x].sum())
            if r < best_r:
                best_r, best_x = r, x
            if mu < within[0]:
                within[:] = [mu, x]
        elif mu > over[0]:
            over[:] = [mu, x]
        return ok, bound

    first, _ = evaluate(0.0)
    if first is None:
        return _Greedy(None, 0.0, 0.0, -math.inf)
    if not first:
        # bracket the multiplier at which the time budget starts to hold
        f_lo = used[0] - 1.0
        lo, hi = 0.0, 1.0
        state, _ = evaluate(hi)
        while state is False and hi < 1e15:
            lo, hi, f_lo = hi, hi * 16.0, used[0] - 1.0
            state, _ = evaluate(hi)
        f_hi = used[0] - 1.0
        if state:
            if lo == 0.0:
                while hi > 1e-12:
                    got, _ = evaluate(hi / 16.0)
                    if not got:
                        lo, f_lo = hi / 16.0, used[0] - 1.0
                        break
                    hi, f_hi = hi / 16.0, used[0] - 1.0
            # Find the crossing in log(mu): regula falsi on the time used (Illinois variant: the
            # end that stays has its value halved, so both ends move), kept off the ends.
            side = 0
            for _ in range(40):
                if lo <= 0 or hi / lo < 1.0 + 1e-3:
                    break
                if best_r - best_bound <= 1e-9 * abs(best_r):
                    break  # the bound already proves the allocation (near-)optimal
                a, b = math.log(lo), math.log(hi)
                t = f_lo / (f_lo - f_hi) if f_lo - f_hi > 0 else 0.5
                mid = math.exp(a + min(max(t, 0.05), 0.95) * (b - a))
                got, _ = evaluate(mid)
                if got:
                    hi, f_hi = mid, used[0] - 1.0
                    if side == 1:
                        f_lo /= 2.0
                    side = 1
                else:
                    lo, f_lo = mid, used[0] - 1.0
                    if side == -1:
                        f_hi /= 2.0
                    side = -1
            # The bound is concave in mu and peaks near the crossing (not exactly at it, since the
            # crossing is found on the rounded allocation): a few golden-section steps on a
            # bracket around it tighten the reported lower bound, unless it is tight already.
            if best_r - best_bound > 1e-4 * abs(best_r):
                _golden(lambda mu: evaluate(mu)[1], (lo if lo > 0 else hi * 1e-3) / 4.0, hi * 4.0, 4)
            if over[1] is not None and within[1] is not None:
                x = _blend(p, s, over[1], within[1], mb, tb)
                if x is not None and float(s.r[rows, x].sum()) < best_r:
                    best_x, best_r = x, float(s.r[rows, x].sum())
    return _Greedy(best_x, best_mults[0], best_mults[1], best_bound)


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


# ---------------------------------------------------------------------------- local improvement


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


def _raw_ok(p: _Problem, x: np.ndarray, mb: float, tb: float | None) -> bool:
    if _raw_memory(p, x) > mb:
        return False
    if tb is not None and p.time is not None and _raw_time(p, x) > tb:
        return False
    return True


# ---------------------------------------------------------------------------- exact: branch-and-bound


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
    n, k = obj.shape
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

    # Fix blocks with a single option; order the rest by the spread of their Lagrangian cost.
    single = allowed.sum(axis=1) == 1
    fixed_col = np.argmax(allowed, axis=1)
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
    base_rows = np.nonzero(single)[0]
    base_o = float(obj[base_rows, fixed_col[base_rows]].sum())
    base_c0 = float(c0[base_rows, fixed_col[base_rows]].sum())
    base_c1 = float(c1[base_rows, fixed_col[base_rows]].sum())

    depth = len(free)
    opt_col: list[list[int]] = []
    opt_o: list[list[float]] = []
    opt_c0: list[list[float]] = []
    opt_c1: list[list[float]] = []
    opt_red: list[list[float]] = []
    for b in free:
        cols = np.nonzero(allowed[b])[0]
        cols = cols[np.argsort(red[b, cols], kind="stable")]
        opt_col.append(cols.tolist())
        opt_o.append(obj[b, cols].tolist())
        opt_c0.append(c0[b, cols].tolist())
        opt_c1.append(c1[b, cols].tolist())
        opt_red.append(red[b, cols].tolist())
    smin_o = [0.0] * (depth + 1)
    smin_c0 = [0.0] * (depth + 1)
    smin_c1 = [0.0] * (depth + 1)
    s_red = [0.0] * (depth + 1)
    for d in range(depth - 1, -1, -1):
        smin_o[d] = smin_o[d + 1] + min(opt_o[d])
        smin_c0[d] = smin_c0[d + 1] + min(opt_c0[d])
        smin_c1[d] = smin_c1[d + 1] + min(opt_c1[d])
        s_red[d] = s_red[d + 1] + opt_red[d][0]

    same_as_prev = [False] + [bool(group[d] == group[d - 1]) for d in range(1, depth)]

    def full_x(choice: list[int]) -> np.ndarray:
        x = fixed_col.copy()
        for d, b in enumerate(free):
            x[b] = opt_col[d][choice[d]]
        return x

    best = math.inf
    best_x: np.ndarray | None = None
    if incumbent is not None:
        best, best_x = incumbent[0], incumbent[1].copy()
    if stop_below is not None:
        best = min(best, stop_below * (1 + 1e-15) + 1e-300)

    # Search only for improvements larger than a relative 1e-10 (and than half the objective's
    # resolution, e.g. one byte): ties and rounding noise in the bounds then prune instead of
    # exploding the tree on problems with many equal-risk allocations. The answer is optimal to
    # that tolerance, far below the 1e-9 the tests hold it to.
    def threshold(value: float) -> float:
        if not math.isfinite(value):
            return value
        tol = 1e-10 * abs(value)
        if resolution > 0:
            tol = min(tol, resolution)
        return value - max(tol, rel_tol * abs(value))

    thr = threshold(best)
    one0 = 1.0 + _FEAS_EPS
    one1 = 1.0 + _FEAS_EPS

    # LP bounds of the blocks below each depth: one resource kept as a constraint (solved exactly
    # by the frontier), the other dualized with the root multiplier. Much stronger than the root
    # Lagrangian bound deep in the tree; built for moderate depths only (memory ~ depth x moves).
    lp_bounds: list[_DepthLP] = []
    if depth > 0:
        sub = free
        lp_bounds.append(_DepthLP(obj[sub] + l1 * _zero_inf(c1[sub]), c0[sub]))
        if np.any(_zero_inf(c1) != 0):
            lp_bounds.append(_DepthLP(obj[sub] + l0 * _zero_inf(c0[sub]), c1[sub]))
    lp0 = lp_bounds[0] if lp_bounds else None
    lp1 = lp_bounds[1] if len(lp_bounds) > 1 else None

    if depth == 0:
        x = fixed_col.copy()
        ok = base_c0 <= one0 and base_c1 <= one1 and accept(x)
        if ok and base_o < thr:
            return _Search(base_o, x, True, 1)
        return _Search(best if best_x is not None else math.inf, best_x, True, 1)

    choice = [0] * depth
    idx = [0] * depth
    po = [0.0] * (depth + 1)
    pc0 = [0.0] * (depth + 1)
    pc1 = [0.0] * (depth + 1)
    po[0], pc0[0], pc1[0] = base_o, base_c0, base_c1
    nodes = 0
    complete = True
    d = 0
    found_target = False
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
        lag = o + s_red[d + 1] + l0 * (a0 - 1.0) + l1 * (a1 - 1.0)
        if lag >= thr:
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
            x = full_x(choice)
            if o < thr and accept(x):
                best, best_x = o, x
                thr = threshold(best)
                if stop_below is not None:
                    found_target = True
                    break
            idx[d] = i + 1
            continue
        po[d + 1], pc0[d + 1], pc1[d + 1] = o, a0, a1
        d += 1
        idx[d] = choice[d - 1] if same_as_prev[d] else 0
    if found_target:
        complete = True
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


# ---------------------------------------------------------------------------- minima for errors


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


def _infeasible(p: _Problem, s: _Scaled, mb: float, tb: float | None, node_limit: int | None, note: str = "") -> BudgetInfeasibleError:
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
        frac = f" ({(ceil_significant(v / p.fp32_memory) if up else v / p.fp32_memory):.3g} of fp32 AdamW)" if p.fp32_memory else ""
        if not p.memory_int:
            return f"{v:.6g}{frac}"
        # exact where the rounding up shows more than it is
        exact = f" = {int(math.ceil(v)):,} bytes" if up and format_bytes(v, up=True) != format_bytes(v) else ""
        return f"{format_bytes(v, up=up)}{exact}{frac}"

    def time_text(v: float, up: bool = False) -> str:
        frac = f" ({(ceil_significant(v / p.fp32_time) if up else v / p.fp32_time):.3g}x the fp32 AdamW step)" if p.fp32_time else ""
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


# ---------------------------------------------------------------------------- solve


def _parse_budgets(p: _Problem, memory_budget: object, time_budget: object) -> tuple[float, float | None]:
    mb = float(parse_memory_budget(memory_budget, p.fp32_memory))
    tb: float | None = None
    if time_budget is not None:
        if p.time is None:
            raise ValueError(
                f"time_budget={time_budget!r} was given without a time table; pass time= "
                f"(block -> format -> seconds), e.g. from lightning_baoc.calibration.time_table"
            )
        tb = parse_time_budget(time_budget, p.fp32_time) * (1.0 + TIME_BUDGET_RTOL)
    return mb, tb


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
) -> Allocation:
    """Pick one state format per block: minimum total risk within the memory and time budgets.

    Args:
        risk: block -> format -> risk (finite, >= 0). The formats a block lists are the ones it
            allows: leave a format out to forbid it there. Blocks keep this order.
        memory: block -> format -> state bytes (finite, >= 0), for every format ``risk`` allows.
        memory_budget: a fraction in (0, 1] of the fp32 AdamW state memory (the sum of the
            ``"fp32"`` entries of ``memory``), or absolute: an int of bytes or a string like
            ``"6GB"`` / ``"512MiB"`` (see :func:`~lightning_baoc.budget.parse_memory_budget`).
        time: block -> format -> optimizer-step seconds, or ``None`` (default: ``None``).
        time_budget: a multiple >= 1.0 of the fp32 AdamW step time (``1.10``) or an absolute time
            like ``"12ms"``; needs ``time`` (default: ``None``: no time limit).
        mask: formats to exclude everywhere, as names or name -> reason (e.g. from
            :func:`~lightning_baoc.calibration.hardware_mask`); reported in
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
        return _solve_segmented(risk, memory, memory_budget, time, time_budget, mask, method, max_boundaries, features)
    p = _build(risk, memory, time, mask)
    mb, tb = _parse_budgets(p, memory_budget, time_budget)
    return _solve_problem(p, mb, tb, method)


def _scaled(p: _Problem, mb: float, tb: float | None, keep: np.ndarray) -> _Scaled:
    finite = np.where(keep, p.risk, 0.0)
    scale = float(finite.max()) if finite.size else 0.0
    scale = scale if scale > 0 else 1.0
    r = np.where(keep, p.risk / scale, np.inf)
    m = np.where(keep, p.memory / mb, np.inf)
    t = np.where(keep, p.time / tb, np.inf) if (p.time is not None and tb is not None) else None
    return _Scaled(r, m, t, scale)


def _solve_problem(p: _Problem, mb: float, tb: float | None, method: str, note: str = "") -> Allocation:
    allowed = p.allowed
    keep = allowed & ~_dominated(p.risk, p.memory, p.time if tb is not None else None)
    s = _scaled(p, mb, tb, keep)
    rows = np.arange(len(p.blocks))

    # Each resource alone: its cheapest allocation must fit.
    min_m = _raw_memory(p, np.argmin(np.where(allowed, p.memory, np.inf), axis=1))
    min_t = _raw_time(p, np.argmin(np.where(allowed, p.time, np.inf), axis=1)) if (tb is not None and p.time is not None) else 0.0
    if min_m > mb or (tb is not None and min_t > tb):
        raise _infeasible(p, s, mb, tb, None if method == "exact" else ERROR_SEARCH_NODES, note)

    def accept(x: np.ndarray) -> bool:
        return _raw_ok(p, x, mb, tb)

    g = _greedy(p, s, mb, tb)
    x = g.x
    used = "greedy"
    bound = g.bound
    mults = [g.lam] + ([g.mu] if s.t is not None else [])
    cons = [s.m] + ([s.t] if s.t is not None else [])
    optimal = False
    if x is None:
        # The greedy found nothing that meets both budgets: search exhaustively for any allocation
        # that does (this is what guarantees a feasible answer whenever one exists).
        search = _branch_and_bound(s.r, cons, mults, accept, None, None, stop_below=math.inf)
        if search.x is None:
            raise _infeasible(p, s, mb, tb, None if method == "exact" else ERROR_SEARCH_NODES, note)
        x = search.x
        used = "search"
    if method != "exact":
        x = _improve(p, s, x, mb, tb)
        value = float(s.r[rows, x].sum())
        if value - bound > _TIE_MIN_GAP * value:  # else the bound already shows x near-optimal
            x = _tie_search(p, s, x, mults, accept)
    proven_tol: float | None = None  # the search proved x optimal to this relative tolerance
    free_blocks = int((keep.sum(axis=1) > 1).sum())
    if method == "exact" or (method == "auto" and free_blocks <= AUTO_EXACT_BLOCKS):
        # Tighten the tolerance step by step: a loose search finds a much better incumbent fast
        # (a depth-first search aiming at 1e-10 right away can stay stuck in one corner), and each
        # completed level proves the answer within its tolerance.
        budget = None if method == "exact" else AUTO_EXACT_NODES
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
        used = "exact" if method == "exact" else used + "+search"
    if proven_tol == 0.0:
        optimal = True
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
        method=used,
        masked=dict(p.masked),
        fp32_memory=p.fp32_memory,
        fp32_time=p.fp32_time,
    )


# ---------------------------------------------------------------------------- boundary selection


def select_boundaries(
    features: Sequence[Sequence[float]] | np.ndarray,
    max_boundaries: int,
    *,
    weights: Sequence[float] | None = None,
    standardize: bool = True,
    allowed: np.ndarray | None = None,
) -> list[tuple[int, int]]:
    """Cut an ordered list of blocks into at most ``max_boundaries + 1`` contiguous segments.

    Optimal 1-D segmentation by dynamic programming: minimizes the total within-segment weighted
    sum of squared distances of the feature vectors to their segment mean.

    Args:
        features: one feature vector (statistics) per block, in block order.
        max_boundaries: the most cuts allowed (>= 0); ``0`` gives one segment.
        weights: per-block weights of the squared distances (default: all 1).
        standardize: scale every feature to unit variance first, so no statistic dominates by its
            units (default: True).
        allowed: optional ``(blocks, formats)`` boolean array; segments must share at least one
            allowed format (default: no constraint).

    Returns:
        Half-open ``(start, stop)`` index ranges covering ``0 .. len(features)`` in order.

    Example:
        >>> select_boundaries([[0.0], [0.1], [5.0], [5.2], [0.0]], max_boundaries=2)
        [(0, 2), (2, 4), (4, 5)]
    """
    if isinstance(max_boundaries, bool) or not isinstance(max_boundaries, numbers.Integral) or max_boundaries < 0:
        raise ValueError(f"max_boundaries must be an int >= 0, got {max_boundaries!r}")
    X = np.asarray(features, dtype=np.float64)
    if X.ndim == 1:
        X = X[:, None]
    if X.ndim != 2 or X.shape[0] == 0:
        raise ValueError(f"features must be a non-empty list of equal-length vectors, got shape {X.shape}")
    if not np.isfinite(X).all():
        bad = int(np.argmax(~np.isfinite(X).all(axis=1)))
        raise ValueError(f"features[{bad}] = {X[bad].tolist()} is not finite; allowed: finite numbers")
    n = X.shape[0]
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not np.isfinite(w).all() or (w <= 0).any():
        raise ValueError(f"weights must be {n} finite positive numbers, got {weights!r}")
    if standardize:
        sd = X.std(axis=0)
        X = (X - X.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
    segments = min(int(max_boundaries) + 1, n)
    # prefix sums give the cost of any segment [i, j) in O(1)
    W = np.concatenate([[0.0], np.cumsum(w)])
    S1 = np.vstack([np.zeros(X.shape[1]), np.cumsum(w[:, None] * X, axis=0)])
    S2 = np.concatenate([[0.0], np.cumsum(w * (X * X).sum(axis=1))])
    bad_prefix = None
    if allowed is not None:
        A = np.asarray(allowed, dtype=bool)
        bad_prefix = np.vstack([np.zeros(A.shape[1], dtype=np.int64), np.cumsum(~A, axis=0)])

    def cost_row(i: np.ndarray | int, j: np.ndarray | int) -> np.ndarray:
        ww = W[j] - W[i]
        lin = S1[j] - S1[i]
        with np.errstate(divide="ignore", invalid="ignore"):
            c = (S2[j] - S2[i]) - (lin * lin).sum(axis=-1) / ww
        c = np.maximum(c, 0.0)
        if bad_prefix is not None:
            common = ((bad_prefix[j] - bad_prefix[i]) == 0).any(axis=-1)
            c = np.where(common, c, np.inf)
        return np.where(np.asarray(j) > np.asarray(i), c, np.inf)

    ii = np.arange(n + 1)
    if n <= 2048:
        C = cost_row(ii[:, None], ii[None, :])  # C[i, j]: cost of segment [i, j)
    else:
        C = None
    D = np.full(n + 1, np.inf)
    D[0] = 0.0
    arg = np.zeros((segments + 1, n + 1), dtype=np.int64)
    for sgm in range(1, segments + 1):
        if C is not None:
            tot = D[:, None] + C
            arg[sgm] = np.argmin(tot, axis=0)
            newD = tot[arg[sgm], ii]
        else:
            newD = np.full(n + 1, np.inf)
            for j in range(1, n + 1):
                tot = D[:j] + cost_row(ii[:j], j)
                a = int(np.argmin(tot))
                arg[sgm, j], newD[j] = a, tot[a]
        D = newD
    # Exactly `segments` pieces: splitting a segment never raises its cost nor removes a shared
    # format, so the best cut into at most that many pieces has exactly that many.
    if not np.isfinite(D[n]):
        raise ValueError(
            "no segmentation exists in which every segment shares an allowed format; allow more "
            "boundaries or more formats"
        )
    cuts: list[tuple[int, int]] = []
    j = n
    for sgm in range(segments, 0, -1):
        i = int(arg[sgm, j])
        cuts.append((i, j))
        j = i
        if j == 0:
            break
    cuts.reverse()
    return cuts


def _default_features(p: _Problem) -> np.ndarray:
    """Risk per byte for the formats every block allows (the risk profile of a block)."""
    common = p.allowed.all(axis=0)
    if not common.any():
        common = np.ones(p.risk.shape[1], dtype=bool)
    size = np.where(p.allowed, p.memory, 0.0).max(axis=1)
    size = np.where(size > 0, size, 1.0)
    risk = np.where(p.allowed, p.risk, 0.0)
    return risk[:, common] / size[:, None]


def _solve_segmented(
    risk: Table,
    memory: Table,
    memory_budget: object,
    time: Table | None,
    time_budget: object,
    mask: Any,
    method: str,
    max_boundaries: int,
    features: Mapping[str, Sequence[float]] | None,
) -> Allocation:
    p = _build(risk, memory, time, mask)
    mb, tb = _parse_budgets(p, memory_budget, time_budget)
    if features is None:
        feats = _default_features(p)
    else:
        missing = [b for b in p.blocks if b not in features]
        if missing:
            raise ValueError(f"features has no entry for blocks {missing[:5]}; give one vector per block")
        feats = np.asarray([list(features[b]) for b in p.blocks], dtype=np.float64)
    cuts = select_boundaries(feats, max_boundaries, allowed=p.allowed)
    groups = [p.blocks[a:b] for a, b in cuts]
    names = [f"segment{i}" for i in range(len(cuts))]
    seg_allowed = np.stack([p.allowed[a:b].all(axis=0) for a, b in cuts])

    def merged(arr: np.ndarray | None) -> np.ndarray | None:
        if arr is None:
            return None
        out = np.stack([np.where(p.allowed[a:b], arr[a:b], 0.0).sum(axis=0) for a, b in cuts])
        return np.where(seg_allowed, out, np.inf)

    q = _Problem(
        blocks=names,
        formats=p.formats,
        risk=merged(p.risk),  # type: ignore[arg-type]
        memory=merged(p.memory),  # type: ignore[arg-type]
        time=merged(p.time),
        memory_int=p.memory_int,
        masked=p.masked,
        fp32_memory=p.fp32_memory,
        fp32_time=p.fp32_time,
    )
    alloc = _solve_problem(q, mb, tb, method, note=f" (with max_boundaries={max_boundaries})")
    formats = {}
    for name, members in zip(names, groups):
        for b in members:
            formats[b] = alloc.formats[name]
    return Allocation(
        formats=formats,
        memory=alloc.memory,
        time=alloc.time,
        risk=alloc.risk,
        memory_budget=alloc.memory_budget,
        time_budget=alloc.time_budget,
        lower_bound=alloc.lower_bound,
        optimal=alloc.optimal,
        method=alloc.method,
        masked=alloc.masked,
        segments=tuple(tuple(g) for g in groups),
        fp32_memory=alloc.fp32_memory,
        fp32_time=alloc.fp32_time,
    )


# ---------------------------------------------------------------------------- reference


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
