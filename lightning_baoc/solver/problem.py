"""The problem: tables -> arrays, budgets, scaling, domination, and the answer's types.

Holds what every algorithm of the solver shares: :class:`Allocation` (the answer),
:class:`BudgetInfeasibleError`, :func:`check_mask`, the validation of the tables into the dense
:class:`_Problem` (:func:`_build`), the budget parsing, the normalized arrays the search works on
(:class:`_Scaled`: budgets 1.0, risks at most 1), the removal of dominated options, and the exact
re-checks of an allocation on the raw numbers.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_baoc.config.budget import parse_memory_budget, parse_time_budget

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

Table = Mapping[str, Mapping[str, float]]
# re-checks a complete allocation (a column per block) on the raw numbers
_Accept = Callable[[np.ndarray], bool]

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
        >>> from lightning_baoc.solver import solve
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
    #: what the fp32 column is, in messages (``"fp32 SGD"`` for SGD's momentum formats)
    reference: str = "fp32 AdamW"

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
    """Validate the tables and the mask into a :class:`_Problem` (the message names a bad value)."""
    blocks, names = _check_tables(risk, memory, time)
    masked = check_mask(mask, names)
    formats = _order_formats(names)
    n, k = len(blocks), len(formats)
    rows, cols, values = _entries(blocks, formats, risk, memory, time, masked)

    def where(j: int) -> tuple[str, str]:
        return blocks[rows[j]], formats[cols[j]]

    memory_int = all(issubclass(t, (int, np.integer)) for t in set(map(type, values["memory"])))
    dense: dict[str, np.ndarray] = {}
    for name, vals in values.items():
        dense[name] = np.full((n, k), np.inf)
        dense[name][rows, cols] = _as_array(vals, name, where)
    R = dense["risk"]
    empty = ~np.isfinite(R).any(axis=1)
    if empty.any():
        b = blocks[int(np.argmax(empty))]
        raise ValueError(
            f"block {b!r} has no allowed format left: it allows {sorted(risk[b])}, and the mask "
            f"excludes {sorted(set(risk[b]) & set(masked))}; allow another format for it or unmask one"
        )
    return _Problem(
        blocks,
        formats,
        R,
        dense["memory"],
        dense.get("time"),
        memory_int,
        masked,
        _fp32_reference(memory, blocks),
        _fp32_reference(time, blocks),
    )


def _check_tables(risk: Table, memory: Table, time: Table | None) -> tuple[list[str], set[str]]:
    """The blocks of ``risk`` (in order) and every format name it uses, after the structural checks."""
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
    return blocks, names


def _entries(
    blocks: list[str],
    formats: list[str],
    risk: Table,
    memory: Table,
    time: Table | None,
    masked: Mapping[str, str],
) -> tuple[list[int], list[int], dict[str, list[Any]]]:
    """The allowed (block, format) cells as row and column indices, and each table's raw values
    there (``"risk"``, ``"memory"`` and, with a time table, ``"time"``; unchecked)."""
    col_of = {f: j for j, f in enumerate(formats)}.__getitem__
    rows: list[int] = []
    cols: list[int] = []
    rvals: list[Any] = []
    values: dict[str, list[Any]] = {"risk": rvals, "memory": []}
    tables: list[tuple[str, Table]] = [("memory", memory)]
    if time is not None:
        values["time"] = []
        tables.append(("time", time))
    for i, b in enumerate(blocks):
        rb = risk[b]
        if masked:
            fs: Any = [f for f in rb if f not in masked]
            rvals.extend([rb[f] for f in fs])
        else:
            fs = rb.keys()
            rvals.extend(rb.values())
        for name, table in tables:
            tb = table.get(b)
            if not isinstance(tb, Mapping):
                raise ValueError(f"{name} has no entry for block {b!r}; every block of risk needs one")
            try:
                values[name].extend([tb[f] for f in fs])
            except KeyError as missing:
                f = missing.args[0]
                raise ValueError(
                    f"{name}[{b!r}] has no {f!r} entry, but risk[{b!r}] allows {f!r}: give its "
                    f"{'bytes' if name == 'memory' else 'step time'}, or drop {f!r} from risk[{b!r}] "
                    f"to disallow it"
                ) from None
        rows.extend([i] * len(fs))
        cols.extend(map(col_of, fs))
    return rows, cols, values


def _as_array(values: list[Any], name: str, where: Callable[[int], tuple[str, str]]) -> np.ndarray:
    """``values`` as float64, each a finite number >= 0 (``where(j)``: the cell of value ``j``)."""
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


def _fp32_reference(table: Table | None, blocks: list[str]) -> float | None:
    """The total of the table's ``"fp32"`` entries, or ``None`` where a block has no usable one."""
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


# ---------------------------------------------------------------------------- what the search works on


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


def _raw_memory(p: _Problem, x: np.ndarray) -> float:
    """Exact total memory of choice ``x`` (an int sum for integer bytes)."""
    vals = p.memory[np.arange(len(x)), x]
    return float(vals.sum()) if p.memory_int else math.fsum(vals.tolist())


def _raw_time(p: _Problem, x: np.ndarray) -> float:
    """Exact total time of choice ``x`` (there must be a time table)."""
    assert p.time is not None
    return math.fsum(p.time[np.arange(len(x)), x].tolist())


def _raw_ok(p: _Problem, x: np.ndarray, mb: float, tb: float | None) -> bool:
    """Whether choice ``x`` meets both budgets on the raw numbers."""
    if _raw_memory(p, x) > mb:
        return False
    if tb is not None and p.time is not None and _raw_time(p, x) > tb:
        return False
    return True


def _parse_budgets(p: _Problem, memory_budget: object, time_budget: object) -> tuple[float, float | None]:
    """The absolute budgets: bytes, and seconds with :data:`TIME_BUDGET_RTOL` of slack (or ``None``)."""
    mb = float(parse_memory_budget(memory_budget, p.fp32_memory))
    tb: float | None = None
    if time_budget is not None:
        if p.time is None:
            raise ValueError(
                f"time_budget={time_budget!r} was given without a time table; pass time= "
                f"(block -> format -> seconds), e.g. from lightning_baoc.costs.calibration.time_table"
            )
        tb = parse_time_budget(time_budget, p.fp32_time) * (1.0 + TIME_BUDGET_RTOL)
    return mb, tb


def _scaled(p: _Problem, mb: float, tb: float | None, keep: np.ndarray) -> _Scaled:
    """The problem normalized by the budgets and the largest risk; options not in ``keep`` get ``inf``."""
    finite = np.where(keep, p.risk, 0.0)
    scale = float(finite.max()) if finite.size else 0.0
    scale = scale if scale > 0 else 1.0
    r = np.where(keep, p.risk / scale, np.inf)
    m = np.where(keep, p.memory / mb, np.inf)
    t = np.where(keep, p.time / tb, np.inf) if (p.time is not None and tb is not None) else None
    return _Scaled(r, m, t, scale)
