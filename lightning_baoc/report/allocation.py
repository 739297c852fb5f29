"""Allocation reports: a rich table, ``baoc_allocation.json``, a PNG figure and logger scalars.

Everything here is a pure function of an :class:`~lightning_baoc.control.controller.AllocationEvent` (or
of the JSON record built from it), so the Lightning callback and the Fabric strategy report the
same way; they call it on rank zero only.

The JSON record (``baoc_allocation.json``, schema :data:`ALLOCATION_SCHEMA`)::

    {"step": int, "reason": str, "memory_budget_bytes": int, "state_bytes": int,
     "state_bytes_before": int, "peak_state_bytes": int, "instrument_bytes": int, "fp32_state_bytes": int,
     "baseline_state_bytes": int, "optimizer": str,
     "state_fraction": float, "saved_fraction": float,
     "correction_bytes": int, "corrections_in_budget": bool, "measured_peak_growth_bytes": int | null,
     "total_risk": float, "time_budget": float | null, "time": float | null, "kept": bool,
     "blocks": [{"name": str, "params": int, "param_names": [str], "format": str,
                 "state_format": str, "correction": str, "state_bytes": int, "risk": {format: float}, "format_risk": float,
                 "changed": bool,
                 "stats": {"stability": float | null, "anisotropy": float | null,
                           "snr": float | null, ...}}],
     "history": [{"step", "reason", "kept", "changed", "state_bytes", "total_risk", ...}],
     "training_memory": {"params": int, "weights": int, "corrections": int, "gradients": int,
                         "states": int, "total": int}}

The run's figures carry the names of :class:`lightning_baoc.BAOCSummary`'s fields (``BAOC.summary()``) and of
the logger scalars (``baoc/<name>``): ``state_bytes``, ``baseline_state_bytes``, ``state_fraction`` (``state_bytes /
baseline_state_bytes``; ``saved_fraction`` is one minus it), ``correction_bytes``, ``memory_budget_bytes``,
``peak_state_bytes``, ``measured_peak_growth_bytes`` (how far the training device's memory rose above its
fit-start level, at its peak so far; ``null``: not known), ``total_risk``.

``correction_bytes`` is what the master-weight corrections of bf16/fp16 weights hold (0: none). With
``corrections_in_budget`` (``BAOC(corrections=...)``, or its default on 16-bit weights) the budget caps
``state_bytes`` plus it, and a block's ``format`` names the option, its state format and its correction
(``"int8+ecc8"``); otherwise corrections the optimizer holds of its own (``weight_correction=``) are outside the
budget. A block's ``state_format`` and ``correction`` are the two parts, whatever chose them; its
``state_bytes`` holds its corrections' bytes too where they are in the budget (the blocks' sum is then
``state_bytes`` plus ``correction_bytes``). Records of earlier
versions have ``correction_bytes`` only where the corrections are in the budget, and none of
``state_fraction``, ``corrections_in_budget``, ``measured_peak_growth_bytes``, ``state_format``, ``correction``.
``optimizer`` names the optimizer whose state was allocated (``"AdamW"``; ``"SGD"``, ``"Lion"``: their
momentum formats; records without it are AdamW's). ``fp32_state_bytes`` is its fp32 state (AdamW: 8
bytes per element; SGD and Lion: 4); ``baseline_state_bytes`` the state the user's own optimizer
would hold (its buffers in each parameter's dtype: the same for fp32 parameters, half of it for
bf16 ones), which ``saved_fraction`` and a fractional memory budget refer to. ``instrument_bytes`` is what BAOC's sampler buffers and shadow moments held
at the allocation, outside the budget (:mod:`lightning_baoc.costs.instruments`). ``params`` is the number of parameter elements of the block. ``risk`` holds the block's risk for
every format the solver could pick (so ``lightning-baoc plan --stats baoc_allocation.json`` can
re-plan from a real run), ``format_risk`` the risk of the format chosen. Undefined statistics
(``nan``) are written as ``null``. ``snr`` is the gradient signal-to-noise ratio; records written
before it was renamed call it ``noise`` (:data:`RENAMED_STATS`), and the schema, the table and the
figure read those too. ``training_memory`` is what training held after the allocation, measured from
storages (:func:`lightning_baoc.training_memory`): the weights, their master-weight corrections, the
gradients and the optimizer's states, in bytes, and the parameter elements they serve (records written
before it existed have none).

The PNG needs matplotlib, an optional dependency: :func:`png_enabled` decides at construction
(of the callback or the strategy) whether it is drawn, so a plain install never fails after a
whole warm-up for want of it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from lightning_baoc.config.budget import format_bytes
from lightning_baoc.config.settings import ReportSetting
from lightning_baoc.control.events import AllocationEvent
from lightning_baoc.control.summary import METRIC_NAMES, state_fraction
from lightning_baoc.costs.options import split_option

#: File names written into the log directory.
JSON_NAME = "baoc_allocation.json"
PNG_NAME = "baoc_allocation.png"

#: Whether matplotlib (optional: the PNG only) can be imported; checked once, at import, as
#: Lightning's ``RichProgressBar`` checks rich.
_MATPLOTLIB_AVAILABLE: bool = importlib.util.find_spec("matplotlib") is not None

#: The logger scalars, one value per allocation (the names of :class:`~lightning_baoc.BAOCSummary`'s figures).
SCALAR_NAMES = METRIC_NAMES

_NUMBER_OR_NULL = {"type": ["number", "null"]}

#: Statistics renamed since older records were written: former name -> name. A record that
#: holds a former name still validates and is shown (:func:`block_stat`).
RENAMED_STATS: dict[str, str] = {"noise": "snr"}

#: JSON Schema (draft 2020-12) of ``baoc_allocation.json``.
ALLOCATION_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "baoc_allocation.json",
    "type": "object",
    "required": ["step", "memory_budget_bytes", "state_bytes", "fp32_state_bytes", "blocks"],
    "properties": {
        "step": {"type": "integer", "minimum": 0},
        "reason": {"type": "string"},
        "memory_budget_bytes": {"type": "integer", "minimum": 0},
        "state_bytes": {"type": "integer", "minimum": 0},
        "state_bytes_before": {"type": "integer", "minimum": 0},
        "peak_state_bytes": {"type": "integer", "minimum": 0},
        "instrument_bytes": {"type": "integer", "minimum": 0},
        "fp32_state_bytes": {"type": "integer", "minimum": 0},
        "baseline_state_bytes": {"type": "integer", "minimum": 0},
        "optimizer": {"type": "string"},
        "correction_bytes": {"type": "integer", "minimum": 0},
        "corrections_in_budget": {"type": "boolean"},
        "measured_peak_growth_bytes": {"type": ["integer", "null"], "minimum": 0},
        "state_fraction": {"type": "number", "minimum": 0},
        "saved_fraction": {"type": "number"},
        "total_risk": {"type": "number", "minimum": 0},
        "time_budget": _NUMBER_OR_NULL,
        "time": _NUMBER_OR_NULL,
        "kept": {"type": "boolean"},
        "training_memory": {
            "type": "object",
            "required": ["params", "weights", "corrections", "gradients", "states", "total"],
            "properties": {k: {"type": "integer", "minimum": 0}
                           for k in ("params", "weights", "corrections", "gradients", "states", "total")},
        },
        "blocks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "params", "format", "state_bytes", "risk", "stats"],
                "properties": {
                    "name": {"type": "string"},
                    "params": {"type": "integer", "minimum": 0},
                    "param_names": {"type": "array", "items": {"type": "string"}},
                    "format": {"type": "string"},
                    "state_format": {"type": "string"},
                    "correction": {"type": "string"},
                    "state_bytes": {"type": "integer", "minimum": 0},
                    "risk": {"type": "object", "additionalProperties": {"type": "number", "minimum": 0}},
                    "format_risk": {"type": "number", "minimum": 0},
                    "changed": {"type": "boolean"},
                    "stats": {
                        "type": "object",
                        "required": ["stability", "anisotropy"],
                        # the SNR, under its name or (older records) its former one
                        "anyOf": [{"required": ["snr"]}, {"required": ["noise"]}],
                        "properties": {
                            "stability": _NUMBER_OR_NULL,
                            "anisotropy": _NUMBER_OR_NULL,
                            "snr": _NUMBER_OR_NULL,
                            "noise": {**_NUMBER_OR_NULL, "description": "former name of snr, in older records"},
                        },
                        "additionalProperties": _NUMBER_OR_NULL,
                    },
                },
            },
        },
        "history": {"type": "array", "items": {"type": "object"}},
    },
}


def _finite(value: Any) -> float | int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


def build_record(
    event: AllocationEvent, history: list[Mapping[str, Any]] | None = None, measured_peak_growth_bytes: int | None = None
) -> dict[str, Any]:
    """The JSON record of an allocation (see the module docstring; primitives only, no NaN).

    ``measured_peak_growth_bytes`` is what the adapter measured of the device's memory, over its fit-start
    level (default: ``None``, not known).

    Example:
        >>> record = build_record(event)  # doctest: +SKIP
        >>> record["blocks"][0]["format"], record["state_bytes"] <= record["memory_budget_bytes"]  # doctest: +SKIP
        ('int8', True)
    """
    blocks = []
    for name, fmt in event.formats.items():
        stats = {k: _finite(v) for k, v in event.statistics.get(name, {}).items()}
        for key in ("stability", "anisotropy", "snr"):
            stats.setdefault(key, None)
        risk = {f: float(r) for f, r in event.risk.get(name, {}).items()}
        state_format, correction = split_option(fmt)
        if event.corrections is not None and not event.corrections_in_budget:
            correction = event.corrections.get(name, correction)  # the optimizer's own, not in the option
        blocks.append(
            {
                "name": name,
                "params": int(event.block_numel[name]),
                "param_names": list(event.block_params[name]),
                "format": fmt,
                "state_format": state_format,
                "correction": correction,
                "state_bytes": int(event.block_bytes[name]),
                "risk": risk,
                "format_risk": float(risk.get(fmt, 0.0)),
                "changed": name in event.changed,
                "stats": stats,
            }
        )
    return {
        "step": int(event.step),
        "reason": event.reason,
        "memory_budget_bytes": int(event.memory_budget_bytes),
        "state_bytes": int(event.state_bytes),
        "state_bytes_before": int(event.state_bytes_before),
        "peak_state_bytes": int(event.peak_state_bytes if event.peak_state_bytes is not None else
                                max(event.state_bytes, event.state_bytes_before)),
        "instrument_bytes": int(event.instrument_bytes or 0),
        "fp32_state_bytes": int(event.fp32_state_bytes),
        "baseline_state_bytes": int(event.baseline),
        "optimizer": event.optimizer,
        **({"correction_bytes": int(event.correction_bytes)} if event.correction_bytes is not None else {}),
        "corrections_in_budget": bool(event.corrections_in_budget),
        "measured_peak_growth_bytes": None if measured_peak_growth_bytes is None else int(measured_peak_growth_bytes),
        "state_fraction": float(state_fraction(event.state_bytes, event.baseline)),
        "saved_fraction": float(event.saved_fraction),
        "total_risk": float(event.total_risk),
        "time_budget": _finite(event.time_budget),
        "time": _finite(event.time),
        "kept": bool(event.kept),
        "blocks": blocks,
        "history": [dict(h) for h in (history or [])],
        **({"training_memory": {k: int(v) for k, v in event.training_memory.items()}} if event.training_memory else {}),
    }


def validate_record(record: Mapping[str, Any]) -> None:
    """Check a record against :data:`ALLOCATION_SCHEMA` (with ``jsonschema``), and that every number
    in it is finite (JSON Schema's ``number`` admits NaN and infinities; the record must not).

    Raises:
        ValueError: naming every violation found (at most 10), with its JSON path.

    Example:
        >>> validate_record({"step": 0, "memory_budget_bytes": 1, "state_bytes": 1,
        ...                  "fp32_state_bytes": 8, "blocks": []})
    """
    from jsonschema import Draft202012Validator

    problems = [_problem(e) for e in sorted(Draft202012Validator(ALLOCATION_SCHEMA).iter_errors(record), key=str)]
    _nonfinite(record, "$", problems)
    if problems:
        raise ValueError("baoc_allocation.json does not match its schema: " + "; ".join(problems[:10]))


def _path(parts: Any) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _problem(error: Any) -> str:
    """A schema violation in the words of the record: where, and what was expected."""
    where = _path(error.absolute_path)
    if error.validator == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        return f"{where} misses {missing[0]!r}" if missing else f"{where}: {error.message}"
    if error.validator == "anyOf" and all(set(s) == {"required"} for s in error.validator_value):
        return f"{where} misses {error.validator_value[0]['required'][0]!r}"  # a key or its former name
    if error.validator == "type":
        expected = error.validator_value if isinstance(error.validator_value, str) else " or ".join(error.validator_value)
        return f"{where} should be {expected}, got {type(error.instance).__name__}"
    if error.validator == "minimum":
        return f"{where} = {error.instance!r} is below {error.validator_value}"
    return f"{where}: {error.message}"


def _nonfinite(value: Any, where: str, problems: list[str]) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        problems.append(f"{where} is not finite ({value!r})")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _nonfinite(item, f"{where}.{key}", problems)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _nonfinite(item, f"{where}[{i}]", problems)


def _optimizer(record: Mapping[str, Any]) -> str:
    """The optimizer whose state a record allocated (records of older versions: AdamW)."""
    return str(record.get("optimizer") or "AdamW")


def _baseline(record: Mapping[str, Any]) -> int:
    """The state the user's own AdamW would hold (records of older versions: the fp32 state)."""
    return int(record.get("baseline_state_bytes") or record["fp32_state_bytes"])


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The logger scalars of a record (:data:`SCALAR_NAMES`, the names of :meth:`lightning_baoc.BAOCSummary.metrics`):
    ``baoc/state_bytes``, ``baoc/baseline_state_bytes`` (the user's own optimizer's state), ``baoc/state_fraction``
    and ``baoc/saved_fraction`` (of it), ``baoc/correction_bytes``, ``baoc/memory_budget_bytes``,
    ``baoc/peak_state_bytes`` (the high-water mark so far, transients included; the state bytes in records without
    it), ``baoc/measured_peak_growth_bytes`` (where known) and ``baoc/total_risk``. Records of earlier versions
    read as they were written (the fp32 state as the baseline where none is named, no corrections where none are).

    Example:
        >>> scalars({"state_bytes": 300, "fp32_state_bytes": 1000, "memory_budget_bytes": 350, "total_risk": 0.5})
        ... # doctest: +NORMALIZE_WHITESPACE
        {'baoc/state_bytes': 300.0, 'baoc/baseline_state_bytes': 1000.0, 'baoc/state_fraction': 0.3,
         'baoc/saved_fraction': 0.7, 'baoc/correction_bytes': 0.0, 'baoc/memory_budget_bytes': 350.0,
         'baoc/peak_state_bytes': 300.0, 'baoc/total_risk': 0.5}
    """
    baseline = _baseline(record)
    fraction = state_fraction(record["state_bytes"], baseline)
    out = {
        "baoc/state_bytes": float(record["state_bytes"]),
        "baoc/baseline_state_bytes": float(baseline),
        "baoc/state_fraction": float(fraction),
        "baoc/saved_fraction": float(1.0 - fraction),
        "baoc/correction_bytes": float(record.get("correction_bytes", 0)),
        "baoc/memory_budget_bytes": float(record["memory_budget_bytes"]),
        "baoc/peak_state_bytes": float(record.get("peak_state_bytes", record["state_bytes"])),
    }
    if record.get("measured_peak_growth_bytes") is not None:
        out["baoc/measured_peak_growth_bytes"] = float(record["measured_peak_growth_bytes"])
    out["baoc/total_risk"] = float(record["total_risk"])
    return out


def block_stat(stats: Mapping[str, Any], key: str) -> Any:
    """A block's statistic ``key`` from a record's ``stats``, found under its former name
    (:data:`RENAMED_STATS`) in records written by older versions; ``None`` if absent.

    Example:
        >>> block_stat({"snr": 0.5}, "snr"), block_stat({"noise": 0.5}, "snr"), block_stat({}, "snr")
        (0.5, 0.5, None)
    """
    if key in stats:
        return stats[key]
    for old, new in RENAMED_STATS.items():
        if new == key and old in stats:
            return stats[old]
    return None


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    value = float(value)
    if not math.isfinite(value):
        return "-"
    if value != 0 and (abs(value) < 10 ** -digits or abs(value) >= 1e4):
        return f"{value:.2e}"
    return f"{value:.{digits}f}"


def allocation_table(record: Mapping[str, Any]) -> Any:
    """A ``rich.table.Table``: block, parameters, stability, anisotropy, SNR, risk, format, bytes,
    with the totals (state bytes before and after, fraction saved) in the footer and caption."""
    from rich.table import Table

    title = f"BAOC allocation at step {record['step']} ({record.get('reason', 'allocation')})"
    if record.get("kept"):
        title += ": kept (hysteresis)"
    table = Table(title=title, show_footer=True)
    total_params = sum(b["params"] for b in record["blocks"])
    total_risk = record.get("total_risk", 0.0)
    table.add_column("block", footer="total")
    table.add_column("parameters", justify="right", footer=f"{total_params:,}")
    table.add_column("stability", justify="right")
    table.add_column("anisotropy", justify="right")
    table.add_column("SNR", justify="right")
    table.add_column("risk", justify="right", footer=_num(total_risk, 4))
    table.add_column("format")
    # a block's bytes hold its corrections' too where they are in the budget: the footer is their sum
    table.add_column("bytes", justify="right", footer=format_bytes(sum(b["state_bytes"] for b in record["blocks"])))
    for b in record["blocks"]:
        stats = b["stats"]
        fmt = f"[bold]{b['format']}[/bold]" if b.get("changed") else b["format"]
        table.add_row(
            b["name"],
            f"{b['params']:,}",
            _num(stats.get("stability")),
            _num(stats.get("anisotropy")),
            _num(block_stat(stats, "snr"), 4),
            _num(b.get("format_risk"), 4),
            fmt,
            format_bytes(b["state_bytes"]),
        )
    baseline, after = _baseline(record), record["state_bytes"]
    before = record.get("state_bytes_before", baseline)
    saved = 1.0 - after / baseline if baseline else 0.0
    table.caption = (
        f"optimizer state {format_bytes(before)} -> {format_bytes(after)} "
        f"({_optimizer(record)} {format_bytes(baseline)}, budget {format_bytes(record['memory_budget_bytes'])}); "
        f"saved {saved:.1%} of {_optimizer(record)}'s state"
    )
    corrections = int(record.get("correction_bytes", 0))
    if corrections:
        where = "in the budget" if record.get("corrections_in_budget", True) else "outside the budget"
        table.caption += f"; weight corrections {format_bytes(corrections)} ({where})"
    whole = record.get("training_memory")
    if whole and whole.get("params"):
        n = whole["params"]
        parts = ", ".join(f"{k} {whole[k] / n:.2f}" for k in ("weights", "corrections", "gradients", "states"))
        table.caption += f"; training holds {whole['total'] / n:.2f} bytes per parameter ({parts})"
    return table


def print_report(record: Mapping[str, Any], console: Any = None) -> None:
    """Print :func:`allocation_table` with rich (to ``console``, default a new stdout console)."""
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and CI: rich would wrap the table at 80 columns
            console.width = max(console.width, 132)
    console.print(allocation_table(record))


def write_json(record: Mapping[str, Any], directory: str | os.PathLike[str], name: str = JSON_NAME) -> Path:
    """Write the record as ``directory/baoc_allocation.json`` (atomically); returns the path."""
    validate_record(record)
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, allow_nan=False), encoding="utf-8")
    tmp.replace(path)
    return path


#: One colour per state format in the figure (stable across runs); a master-weight correction
#: hatches its format's colour (:data:`CORRECTION_HATCHES`).
FORMAT_COLORS: dict[str, str] = {
    "fp32": "#4c72b0", "bf16_momentum": "#64b5cd", "bf16": "#55a868", "nomomentum": "#c44e52", "int8": "#dd8452",
    "int8_factored": "#8172b3", "nomomentum_int8": "#937860", "factored": "#da8bc3", "offload": "#8c8c8c",
    "none": "#e5ae38",  # SGD's and Lion's buffer dropped
}
CORRECTION_HATCHES: dict[str, str] = {"none": "", "ecc8": "//", "ecc16": "xx"}


def _option_style(name: str) -> tuple[str, str]:
    """(colour, hatch) of an option: its state format's colour, its correction's hatch."""
    fmt, _, correction = name.partition("+")
    return FORMAT_COLORS.get(fmt, "#333333"), CORRECTION_HATCHES.get(correction or "none", "")


def plot_allocation(record: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """A PNG of the per-block statistics (stability, anisotropy, SNR), risk and state bytes, the
    bars coloured by the chosen format; returns the path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    blocks = record["blocks"]
    names = [b["name"] for b in blocks]
    styles = [_option_style(b["format"]) for b in blocks]
    panels = [
        ("stability (lag-1 cosine)", [b["stats"].get("stability") for b in blocks], False),
        ("anisotropy (CV of row norms)", [b["stats"].get("anisotropy") for b in blocks], False),
        ("gradient SNR", [block_stat(b["stats"], "snr") for b in blocks], True),
        ("risk of the chosen format", [b.get("format_risk", 0.0) for b in blocks], True),
        ("state bytes", [b["state_bytes"] for b in blocks], True),
    ]
    height = max(2.5, 0.28 * len(blocks) + 1.5)
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), height), sharey=True)
    y = list(range(len(blocks)))
    for ax, (title, values, log) in zip(axes, panels):
        clean = [0.0 if v is None or not math.isfinite(float(v)) else float(v) for v in values]
        for bar, (_, hatch) in zip(ax.barh(y, clean, color=[c for c, _ in styles]), styles):
            bar.set_hatch(hatch)
        ax.set_title(title, fontsize=9)
        if log and any(v > 0 for v in clean):
            ax.set_xscale("symlog", linthresh=max(min((v for v in clean if v > 0), default=1e-6), 1e-12))
        ax.tick_params(labelsize=7)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(names, fontsize=7)
    axes[0].invert_yaxis()
    used = list(dict.fromkeys(b["format"] for b in blocks))
    fig.legend(
        handles=[Patch(facecolor=_option_style(f)[0], hatch=_option_style(f)[1], label=f) for f in used],
        loc="lower center",
        ncol=min(len(used), 6),
        fontsize=8,
    )
    saved = record.get("saved_fraction")
    fig.suptitle(
        f"BAOC allocation at step {record['step']}: {format_bytes(record['state_bytes'])} of "
        f"{format_bytes(_baseline(record))} ({_optimizer(record)})"
        + (f" ({saved:.0%} saved)" if saved is not None else ""),
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def png_enabled(report: object, owner: str = "BAOC") -> bool:
    """Whether reports under ``report`` (a :data:`ReportSetting`) draw the PNG; call at construction.

    ``True`` draws it when matplotlib is installed and otherwise warns (once per construction)
    that it is skipped and how to get it; ``"png"`` requires it; ``"json"`` and ``False`` do not
    draw it.

    Raises:
        ValueError: ``report`` is not one of ``True``, ``False``, ``"json"``, ``"png"``.
        ModuleNotFoundError: ``report="png"`` without matplotlib installed.

    Example:
        >>> png_enabled("json"), png_enabled(False)
        (False, False)
    """
    if not (isinstance(report, bool) or report in ("json", "png")):
        raise ValueError(
            f"Invalid {owner}(report={report!r}); allowed: True (table and baoc_allocation.json, and the "
            f"PNG when matplotlib is installed), 'json' (no PNG), 'png' (PNG required), False (no report)"
        )
    if report == "png" and not _MATPLOTLIB_AVAILABLE:
        raise ModuleNotFoundError(
            f"{owner}(report='png') draws baoc_allocation.png with matplotlib, which is not installed. "
            f"Install it (pip install matplotlib), or pass report=True or report='json' for the table and "
            f"baoc_allocation.json only."
        )
    if report is True and not _MATPLOTLIB_AVAILABLE:
        warnings.warn(
            f"{owner}(report=True): matplotlib is not installed, so baoc_allocation.png is skipped (the table "
            f"and baoc_allocation.json are written). Install matplotlib for the figure (pip install "
            f"matplotlib), or pass report='json' to silence this warning.",
            UserWarning,
            stacklevel=3,
        )
    return report is True and _MATPLOTLIB_AVAILABLE or report == "png"


def write_reports(
    record: Mapping[str, Any],
    directory: str | os.PathLike[str] | None,
    console: Any = None,
    table: bool = True,
    png: bool | None = None,
) -> dict[str, Path]:
    """Print the table and write the JSON and the PNG into ``directory`` (files skipped if ``None``).

    Args:
        record: the JSON record (:func:`build_record`).
        directory: where the files go (``None``: the table only).
        console: a ``rich`` console for the table (default: a new stdout console).
        table: print the table (default: True).
        png: draw the PNG (default: ``None``: when matplotlib is installed).

    Returns:
        ``{"json": path, "png": path}`` for the files written.
    """
    if table:
        print_report(record, console)
    if directory is None:
        return {}
    out = {"json": write_json(record, directory)}
    if _MATPLOTLIB_AVAILABLE if png is None else png:
        out["png"] = plot_allocation(record, Path(directory) / PNG_NAME)
    return out


def announce(written: Mapping[str, Path]) -> str:
    """Where :func:`write_reports` wrote, for a log line: ``dir/baoc_allocation.json`` or
    ``dir/{baoc_allocation.json, baoc_allocation.png}``.

    Example:
        >>> announce({"json": Path("logs") / JSON_NAME})
        'logs/baoc_allocation.json'
    """
    paths = list(written.values())
    if not paths:
        return "(nothing written)"
    names = [p.name for p in paths]
    folder = str(paths[0].parent)
    return os.path.join(folder, names[0] if len(names) == 1 else "{" + ", ".join(names) + "}")


class AllocationReporter:
    """The reports of each allocation, as both adapters (the callback and the Fabric strategy) give
    them: the record built on every rank, and on rank zero the files (``report``), the logger
    scalars and one line saying what the allocation did; where the files are is said once.

    Args:
        report: the :data:`ReportSetting` (optional dependencies are checked here, at construction).
        owner: the adapter's name, for the warning about a missing optional dependency.

    Attributes:
        last_record: the JSON record of the last allocation (``None`` before the first).
        last_metrics: its logger scalars (``{}`` before the first).
    """

    def __init__(self, report: ReportSetting = True, owner: str = "BAOC") -> None:
        self.enabled = report is not False
        self.png = png_enabled(report, owner)
        self.last_record: dict[str, Any] | None = None
        self.last_metrics: dict[str, float] = {}
        self._announced = False

    def __call__(
        self,
        event: AllocationEvent,
        history: list[Mapping[str, Any]],
        directory: str | os.PathLike[str] | None,
        is_global_zero: bool,
        loggers: Iterable[Any] = (),
        info: Callable[[str], Any] = print,
        measured_peak_growth_bytes: int | None = None,
    ) -> dict[str, Path]:
        """Report ``event``; returns the files written (none off rank zero or with reports off).

        ``measured_peak_growth_bytes``: the adapter's measurement of the device's memory over its fit-start
        level, for the record and the scalars (default: ``None``, not known).
        """
        record = build_record(event, history, measured_peak_growth_bytes)
        self.last_record, self.last_metrics = record, scalars(record)
        if not is_global_zero:
            return {}
        written = write_reports(record, directory, png=self.png) if self.enabled else {}
        for logger in loggers:
            logger.log_metrics(self.last_metrics, step=event.step)
        info(allocation_line(event))
        if written and not self._announced:
            self._announced = True
            info(f"BAOC: allocation report written to {announce(written)} (rewritten at each allocation)")
        return written


def allocation_line(event: AllocationEvent) -> str:
    """The line said at each allocation: what it did, the state before and after, the fraction saved, the
    corrections' bytes beside the states' (where weights hold any), and the total risk.

    Example:
        >>> allocation_line(event)  # doctest: +SKIP
        "BAOC: warmup allocation at step 20: 3 block(s) converted; optimizer state 1,200,000 -> 508,304 bytes
        (84.9% of AdamW's state saved; peak so far 1,200,000); weight corrections 60,000 bytes (0.40 B/param),
        with the state 568,304 of the 600,000-byte budget; total risk 0.0123"
    """
    what = "kept" if event.kept else f"{len(event.changed)} block(s) converted"
    line = (
        f"BAOC: {event.reason} allocation at step {event.step}: {what}; optimizer state "
        f"{event.state_bytes_before:,} -> {event.state_bytes:,} bytes "
        f"({event.saved_fraction:.1%} of {event.optimizer}'s state saved; peak so far {event.peak_state_bytes or 0:,})"
    )
    corrections = int(event.correction_bytes or 0)
    if event.corrections_in_budget or corrections:
        params = sum(event.block_numel.values())
        per_param = f" ({corrections / params:.2f} B/param)" if params else ""
        line += f"; weight corrections {corrections:,} bytes{per_param}"
        if event.corrections_in_budget:
            line += (f", with the state {event.state_bytes + corrections:,} of the "
                     f"{event.memory_budget_bytes:,}-byte budget")
        else:
            line += ", outside the budget (the optimizer's own weight_correction)"
    return f"{line}; total risk {event.total_risk:.4g}"


__all__ = [
    "AllocationReporter", "ALLOCATION_SCHEMA", "CORRECTION_HATCHES", "FORMAT_COLORS", "JSON_NAME", "PNG_NAME",
    "RENAMED_STATS", "SCALAR_NAMES", "allocation_line", "allocation_table", "announce", "block_stat", "ReportSetting",
    "build_record", "plot_allocation", "png_enabled", "print_report", "scalars", "validate_record",
    "write_json", "write_reports",
]
