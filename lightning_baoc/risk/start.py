"""The risk the start allocation minimizes: the prior, or what a previous run gives (``initial``).

A run starts its warm-up in the allocation of least risk within the budgets before any gradient is
seen. That risk is the documented prior (:func:`~lightning_baoc.risk.prior.prior_risk`), or, with
``initial``:

- a path to a previous run's ``baoc_allocation.json``: its measured risk per format replaces the
  prior on the blocks it names (a format it did not measure gets the prior plus
  :data:`INITIAL_PREFERENCE`);
- a mapping block -> format: the named format costs 0 and every other the prior plus
  :data:`INITIAL_PREFERENCE`, so the named one is kept wherever the budgets allow.

The training controller (:mod:`lightning_baoc.control.start`) and the planner
(``lightning-baoc plan --initial``, ``lightning-baoc check`` with ``baoc.initial``) build it here,
so the start they report is the start the run takes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Iterable, Union

from lightning_baoc.formats import DEFAULT_MIN_8BIT_NUMEL, RULE_FORMATS
from lightning_baoc.risk.prior import prior_risk

#: Added to the prior risk of every format but the one ``initial`` names for a block, so that the
#: solver keeps the named format wherever the budgets allow (prior risks are shares, below 1).
INITIAL_PREFERENCE = 1.0

@dataclass(frozen=True)
class AllocationRecord:
    """A ``baoc_allocation.json`` read once: its path (for messages) and its parsed contents, so that a
    caller that checks the record (``lightning-baoc plan``) and the start risk read the same bytes."""

    path: str
    data: Any


#: What ``initial`` may be: a path to a ``baoc_allocation.json`` (or the record read from one), a
#: mapping block -> format, or none.
Initial = Union[str, "os.PathLike[str]", AllocationRecord, Mapping[str, str], None]


def start_risk(
    shapes: Mapping[str, Sequence[Sequence[int]]],
    kinds: Mapping[str, str],
    offered: Sequence[str],
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
    initial: Initial = None,
    owner: str = "BAOC",
    rule: str = "adamw",
) -> dict[str, dict[str, float]]:
    """The risk table the start allocation minimizes (see the module docstring).

    Args:
        shapes: block -> the shapes of its parameters.
        kinds: block -> its kind (:func:`~lightning_baoc.risk.prior.block_kind`).
        offered: the formats offered on the device.
        min_8bit_numel: the optimizer's small-tensor threshold (default: 4096).
        initial: a ``baoc_allocation.json`` path, a mapping block -> format, or ``None`` (the prior).
        owner: who was given ``initial``, for error messages (``"BAOC"``: ``BAOC(initial=...)``).
        rule: the optimizer's update rule (its formats and priors; default: ``"adamw"``).

    Raises:
        ValueError: ``initial`` names blocks the model does not have, a format not offered, or a
            file that is not a readable ``baoc_allocation.json``.

    Example:
        >>> start_risk({"fc": [(64, 64)]}, {"fc": "other"}, ["fp32", "int8"], initial={"fc": "int8"})
        {'fc': {'fp32': 1.0, 'int8': 0.0}}
    """
    return prefer_initial(prior_risk(shapes, kinds, list(offered), min_8bit_numel, rule), initial, offered, owner)


def prefer_initial(
    risk: Mapping[str, Mapping[str, float]], initial: Initial, offered: Sequence[str], owner: str = "BAOC"
) -> dict[str, dict[str, float]]:
    """``risk`` (block -> choice -> prior risk) with ``initial`` applied: the named choice of a block
    costs 0 and every other its prior plus :data:`INITIAL_PREFERENCE`, or a record's measured risks
    replace the prior where it measured them (the others get the prior plus the preference).

    The choices are state formats, or, with master-weight corrections, options (a format paired
    with a correction, :mod:`lightning_baoc.costs.options`: ``"int8+ecc8"``, and ``"int8"`` for the
    format without one); a ``baoc_allocation.json`` of a run with corrections measured its options,
    one without them its formats, the options without a correction.

    Example:
        >>> prefer_initial({"fc": {"int8": 0.2, "int8+ecc8": 0.1}}, {"fc": "int8"}, ["int8", "int8+ecc8"])
        {'fc': {'int8': 0.0, 'int8+ecc8': 1.1}}
    """
    out = {b: dict(row) for b, row in risk.items()}
    if initial is None:
        return out
    if isinstance(initial, Mapping):
        for block, name in initial_formats(initial, list(out), offered, owner).items():
            out[block] = {f: (0.0 if f == name else r + INITIAL_PREFERENCE) for f, r in out[block].items()}
        return out
    for block, measured in initial_record(initial, list(out), owner).items():  # type: ignore[arg-type]
        out[block] = {f: float(measured[f]) if f in measured else r + INITIAL_PREFERENCE for f, r in out[block].items()}
    return out


def initial_formats(
    initial: Mapping[str, str], blocks: Sequence[str], offered: Sequence[str], owner: str = "BAOC"
) -> dict[str, str]:
    """``initial`` as a mapping block -> format, checked against the blocks and the formats offered."""
    _refuse_unknown(initial, blocks, f"{owner}(initial=...): {{}} are not blocks", "use the block names of baoc_allocation.json")
    refused = {b: f for b, f in initial.items() if f not in offered}
    if refused:
        b, f = next(iter(refused.items()))
        fmt, paired, _ = str(f).partition("+")  # an option pairs a format with a correction: "int8+ecc8"
        known = "a format" if any(fmt in registry for registry in RULE_FORMATS.values()) else "not a format"
        hint = ""
        if paired and not any("+" in o for o in offered):
            hint = f" (a master-weight correction is chosen only with {owner}(corrections=[...]); name the format alone)"
        raise ValueError(
            f"{owner}(initial=...): block {b!r} asks for {f!r}, {known} not offered here{hint}; offered: {list(offered)}"
        )
    return dict(initial)


def read_record(path: str | os.PathLike[str], owner: str = "BAOC") -> AllocationRecord:
    """A ``baoc_allocation.json``, read and parsed once.

    Raises:
        ValueError: the file cannot be read or is not JSON (the message names ``owner``'s setting).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            return AllocationRecord(os.fspath(path), json.load(fh))
    except (OSError, ValueError) as err:
        raise ValueError(f"{owner}(initial={os.fspath(path)!r}): cannot read the allocation record: {err}") from None


def initial_record(
    source: str | os.PathLike[str] | AllocationRecord, blocks: Sequence[str], owner: str = "BAOC"
) -> dict[str, dict[str, float]]:
    """Block -> measured risk per format, from a previous run's ``baoc_allocation.json`` (a path, or
    the record :func:`read_record` gave)."""
    loaded = source if isinstance(source, AllocationRecord) else read_record(source, owner)
    path, record = loaded.path, loaded.data
    entries = record.get("blocks") if isinstance(record, Mapping) else None
    if not isinstance(entries, list):
        raise ValueError(f"{owner}(initial={path!r}): not a baoc_allocation.json (no 'blocks' list)")
    out: dict[str, dict[str, float]] = {}
    for entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("risk"), Mapping):
            raise ValueError(f"{owner}(initial={path!r}): a block without its 'risk' per format: {entry!r}")
        out[str(entry.get("name"))] = {
            str(f): float(r) for f, r in entry["risk"].items() if isinstance(r, (int, float)) and r == r
        }
    _refuse_unknown(out, blocks, f"{owner}(initial={path!r}): blocks {{}} are not blocks",
                    "was the record written for another model or granularity?")
    return out


def _refuse_unknown(named: Iterable[str], blocks: Sequence[str], what: str, fix: str) -> None:
    """Raise naming the first few of ``named`` that are not ``blocks`` (``what`` has a ``{}`` for them)."""
    known = set(blocks)
    unknown = [b for b in named if b not in known]
    if unknown:
        raise ValueError(f"{what.format(unknown[:3])} of this model (blocks like {list(blocks)[:3]}); {fix}")


__all__ = [
    "INITIAL_PREFERENCE", "AllocationRecord", "Initial", "initial_formats", "initial_record", "prefer_initial", "read_record",
    "start_risk",
]
