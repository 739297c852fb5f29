"""The inputs of ``lightning-baoc plan`` checked before any model is built: the optimizer planned for,
the mask, an ``initial`` record and a statistics file, each against the optimizer's formats (with
master-weight corrections, options: a format and a correction, ``"int8+ecc8"``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from lightning_baoc.costs.options import split_option
from lightning_baoc.formats import RULE_FORMATS, RULE_NAMES, formats_of
from lightning_baoc.risk.start import AllocationRecord, Initial, read_record
from lightning_baoc.solver import check_mask

# ---------------------------------------------------------------------------- the optimizer planned for


def check_optimizer(optimizer: object) -> str:
    """The update rule ``optimizer`` names (``"adamw"``, ``"sgd"``, ``"lion"``), or a ``ValueError``."""
    if not isinstance(optimizer, str) or optimizer not in RULE_FORMATS:
        raise ValueError(
            f"Invalid optimizer: {optimizer!r}; allowed: {list(RULE_FORMATS)} (the optimizer whose state is planned: "
            f"{', '.join(f'{r} = {n}' for r, n in RULE_NAMES.items())})"
        )
    return optimizer


def unknown_format(fmt: object, rule: str) -> str:
    """``unknown format 'x'; allowed: [...]`` for ``rule``'s registry, naming the optimizer whose format
    ``x`` is instead (AdamW's message is the one it always was)."""
    registry, name = formats_of(rule), RULE_NAMES[rule]
    owners = [r for r, reg in RULE_FORMATS.items() if reg is not registry and fmt in reg]
    text = f"unknown format {fmt!r}" + ("" if rule == "adamw" else f" for {name}")
    if owners:
        who = "/".join(dict.fromkeys(RULE_NAMES[r] for r in owners))
        text += f" (a format of {who}: plan it with optimizer={owners[0]!r}, --optimizer {owners[0]})"
    return text + f"; allowed: {list(registry)}" + ("" if rule == "adamw" else f" ({name}'s momentum formats)")


def checked_mask(mask: Sequence[str] | Mapping[str, str] | None, rule: str) -> dict[str, str]:
    """The user's mask, name -> reason, every name one of ``rule``'s formats."""
    if not mask:
        return {}
    named = [mask] if isinstance(mask, str) else mask if isinstance(mask, Mapping) else list(mask)
    for f in named:
        if isinstance(f, str) and f not in formats_of(rule):
            raise ValueError(f"mask names {unknown_format(f, rule)}")
    return check_mask(named, known=list(formats_of(rule)))


def check_written_for(data: object, path: str | os.PathLike[str], rule: str, what: str) -> None:
    """Refuse a file that says it was written for another optimizer (``baoc_allocation.json``'s
    ``"optimizer"``; a file without it is not checked here: its format names are)."""
    written = data.get("optimizer") if isinstance(data, Mapping) else None
    if written is None or written == RULE_NAMES[rule]:
        return
    other = next((r for r, n in RULE_NAMES.items() if n == written), None)
    fix = f"plan it with optimizer={other!r} (--optimizer {other})" if other else f"give a file of a {RULE_NAMES[rule]} run"
    raise ValueError(f"{what} {os.fspath(path)!r} holds the risks of {written}'s state, not {RULE_NAMES[rule]}'s; {fix}")


def known_choice(name: str, rule: str, options: bool) -> bool:
    """Whether ``name`` is one of ``rule``'s formats, or (``options``: with corrections) an option of one."""
    if not options or "+" not in name:
        return name in formats_of(rule)
    try:
        return split_option(name)[0] in formats_of(rule)
    except ValueError:  # not a correction after the separator
        return False


def check_initial(initial: Initial, rule: str, options: bool = False) -> Initial:
    """An ``initial`` record written for ``rule``: its optimizer and format names (``options``: with
    corrections, options of them); returns it read once
    (:class:`~lightning_baoc.risk.start.AllocationRecord`), which the start risk reads in turn (a
    malformed record is left to :func:`~lightning_baoc.risk.start.initial_record`, which says why)."""
    if initial is None or isinstance(initial, (Mapping, AllocationRecord)):
        return initial
    loaded = read_record(initial, "plan")  # an unreadable file: the error names it
    data = loaded.data
    what = "plan(initial=...): the allocation record"
    check_written_for(data, initial, rule, what)
    entries = data.get("blocks") if isinstance(data, Mapping) else None
    for entry in entries if isinstance(entries, list) else ():
        risk = entry.get("risk") if isinstance(entry, Mapping) else None
        for f in risk if isinstance(risk, Mapping) else ():
            if not known_choice(f, rule, options):
                where = f"{what} {os.fspath(initial)!r}: block {entry.get('name')!r}"
                raise ValueError(f"{where} has a risk of an {unknown_format(f, rule)}")
    return loaded


def load_statistics(
    path: str | os.PathLike[str], blocks: Sequence[str], rule: str = "adamw", options: bool = False
) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Per-format risks from a statistics file; returns (risk of the blocks found, blocks missing).

    The file is JSON ``{"blocks": [{"name": ..., "risk": {format: value}}, ...]}``. Blocks of the
    file that the model does not have are an error (a different model or granularity), and so are
    formats that are not ``rule``'s (default: AdamW's; ``options``: planned with corrections, also
    options of them, ``"int8+ecc8"``) and a file whose ``"optimizer"`` is another.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read statistics file {os.fspath(path)!r}: {err}") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("blocks"), list):
        raise ValueError(
            f"statistics file {os.fspath(path)!r} must hold {{\"blocks\": [{{\"name\": ..., \"risk\": "
            f"{{format: value}}}}, ...]}}"
        )
    check_written_for(data, path, rule, "statistics file")
    known = set(blocks)
    risk: dict[str, dict[str, float]] = {}
    for i, entry in enumerate(data["blocks"]):
        if not isinstance(entry, Mapping) or "name" not in entry or "risk" not in entry:
            raise ValueError(f"statistics blocks[{i}] needs 'name' and 'risk', got {entry!r}")
        name, values = entry["name"], entry["risk"]
        if name not in known:
            raise ValueError(
                f"statistics block {name!r} is not a block of this model (blocks like "
                f"{list(blocks)[:3]}); was the file saved with another model or granularity?"
            )
        if not isinstance(values, Mapping):
            raise ValueError(
                f"statistics block {name!r} has risk {values!r}: planning needs a risk per format "
                f"({{format: value}}), not the risk of one chosen format"
            )
        for f in values:
            if not known_choice(f, rule, options):
                raise ValueError(f"statistics block {name!r} names {unknown_format(f, rule)}")
        risk[name] = {f: float(v) for f, v in values.items()}
    missing = [b for b in blocks if b not in risk]
    return risk, missing


__all__ = ["check_initial", "check_optimizer", "checked_mask", "known_choice", "load_statistics", "unknown_format"]
