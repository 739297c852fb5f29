"""The allocation decision, pure: the risk table checked, the risk cap, and hysteresis.

Given the fresh risk table, the solver's answer and the allocation in force, a re-evaluation keeps
the current allocation unless the new one lowers the total risk (both scored with the fresh
table) by more than the relative ``hysteresis``, or the current one no longer meets the budgets
(the caller checks that) or uses a format the cap or the menu no longer offers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

Table = Mapping[str, Mapping[str, float]]


def checked_risk(raw: Table, blocks: Sequence[str], formats: Sequence[str]) -> dict[str, dict[str, float]]:
    """The risk model's table for ``blocks`` x ``formats``, every entry a finite number >= 0.

    Raises:
        ValueError: a block without a row, or an entry missing, non-finite or negative (named).

    Example:
        >>> checked_risk({"a": {"fp32": 0, "int8": 0.5, "bf16": 1}}, ["a"], ["fp32", "int8"])
        {'a': {'fp32': 0.0, 'int8': 0.5}}
    """
    risk: dict[str, dict[str, float]] = {}
    for b in blocks:
        if b not in raw:
            raise ValueError(f"the risk model returned no row for block {b!r}")
        row = {}
        for f in formats:
            value = raw[b].get(f)
            if value is None or not math.isfinite(float(value)) or float(value) < 0:
                raise ValueError(
                    f"the risk model gave block {b!r} format {f!r} the risk {value!r}; expected a finite number >= 0"
                )
            row[f] = float(value)
        risk[b] = row
    return risk


def capped(risk: dict[str, dict[str, float]], cap: float | None) -> dict[str, dict[str, float]]:
    """The solver's options under ``max_block_risk``: formats over the cap dropped per block.

    A block keeps its least risky format(s) even when all are over the cap (only possible when
    neither ``fp32`` nor ``offload``, both of risk 0, is allowed). Returns ``risk`` itself when
    there is no cap or it removes nothing.

    Example:
        >>> capped({"a": {"fp32": 0.0, "int8": 0.3}}, 0.1)
        {'a': {'fp32': 0.0}}
    """
    if cap is None:
        return risk
    out: dict[str, dict[str, float]] = {}
    changed = False
    for b, row in risk.items():
        kept = {f: r for f, r in row.items() if r <= cap}
        if not kept:
            least = min(row.values())
            kept = {f: r for f, r in row.items() if r == least}
        changed = changed or len(kept) != len(row)
        out[b] = kept
    return out if changed else risk


def keeps_current(current: Mapping[str, str], new_risk: float, risk: Table, options: Table, hysteresis: float) -> bool:
    """Whether hysteresis keeps the allocation in force (which meets the budgets) over the solver's.

    It is kept when every block's format is still offered (``options``) and the new allocation
    lowers the total risk by at most ``hysteresis`` of the current one's.

    Example:
        >>> risk = {"a": {"fp32": 0.0, "int8": 0.10, "bf16": 0.095}}
        >>> keeps_current({"a": "int8"}, 0.095, risk, risk, hysteresis=0.1)
        True
    """
    if not all(current.get(b) in options[b] for b in options):
        return False
    current_risk = sum(risk[b][current[b]] for b in options)
    return not current_risk - new_risk > hysteresis * current_risk


__all__ = ["capped", "checked_risk", "keeps_current"]
