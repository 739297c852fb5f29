"""Allocation options that pair a state format with a master-weight correction.

With ``BAOC(corrections=[...])`` the solver chooses, per block, a state format and the correction of
the block's bf16/fp16 weights together (:mod:`lightning_baoc.formats.correction`): an option is the
format's name, plus ``"+ecc8"`` or ``"+ecc16"`` when it holds a correction (``"int8+ecc8"``; a plain
``"int8"`` holds none). Its bytes are the state's plus the correction's (1 or 2 bytes per element of the
block's 16-bit parameters, 0 on fp32 ones, which are their own masters); its risk is the format's plus the
correction's (:func:`lightning_baoc.risk.correction.correction_risk_table`, or the prior
:data:`PRIOR_CORRECTION_RISK` before any gradient is seen).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from lightning_baoc.formats import numel_of
from lightning_baoc.formats.correction import CORRECTION_BITS, WEIGHT_DTYPES, check_correction

#: Separates a format from its correction in an option's name.
SEPARATOR = "+"

#: Prior risk of each correction over a whole 16-bit model, in the units of
#: :data:`~lightning_baoc.risk.prior.PRIOR_RISK`. Measured on a character GPT trained in bf16 with
#: 8-bit states (``benchmarks/bf16_weights.py``, realistic recipe): no correction +0.130 perplexity
#: against fp32, ``ecc8`` +0.016 (noise 0.055), uniform int8 states ~2% at high learning rates (0.022
#: here); ``ecc16`` is exact but at ties.
PRIOR_CORRECTION_RISK: Mapping[str, float] = {"none": 0.12, "ecc8": 0.003, "ecc16": 0.0}


#: The corrections offered by default where a model trains bf16 or fp16 weights (``corrections`` unset).
DEFAULT_CORRECTIONS = ("none", "ecc8", "ecc16")


def corrections_menu(
    configured: Sequence[str] | None, dtypes: Iterable[Iterable[torch.dtype]], own: bool = False
) -> list[str] | None:
    """The corrections the solver pairs with the formats (``None``: it chooses formats alone).

    ``configured`` (``BAOC(corrections=...)``) is taken as given. Unset, every correction
    (:data:`DEFAULT_CORRECTIONS`) is offered where a block trains bf16/fp16 weights (``dtypes``: one
    iterable per block), so that a bf16 run keeps its small updates wherever the budget affords a
    correction, unless the optimizer holds corrections of its own (``own``: a returned BlockwiseAdamW
    built with ``weight_correction``), which are then kept, outside the budget. ``corrections=["none"]``
    opts out.

    Example:
        >>> corrections_menu(None, [[torch.bfloat16, torch.float32]])
        ['none', 'ecc8', 'ecc16']
        >>> corrections_menu(None, [[torch.float32]]), corrections_menu(["none"], [[torch.bfloat16]])
        (None, ['none'])
    """
    if configured is not None:
        return list(configured)
    sixteen = any(d in WEIGHT_DTYPES for row in dtypes for d in row)
    return list(DEFAULT_CORRECTIONS) if sixteen and not own else None


def option(fmt: str, correction: str) -> str:
    """The option holding state format ``fmt`` and ``correction`` (``"none"``: the format's name).

    Example:
        >>> option("int8", "ecc8"), option("int8", "none")
        ('int8+ecc8', 'int8')
    """
    check_correction(correction)
    return fmt if correction == "none" else f"{fmt}{SEPARATOR}{correction}"


def split_option(name: str) -> tuple[str, str]:
    """``(format, correction)`` of an option.

    Example:
        >>> split_option("int8+ecc16"), split_option("bf16")
        (('int8', 'ecc16'), ('bf16', 'none'))
    """
    fmt, sep, correction = name.partition(SEPARATOR)
    if not sep:
        return name, "none"
    check_correction(correction)
    return fmt, correction


def options(formats: Sequence[str], corrections: Sequence[str]) -> list[str]:
    """Every pairing of ``formats`` with ``corrections``, format-major."""
    return [option(f, c) for f in formats for c in corrections]


def correction_bytes(shape: Sequence[int], dtype: torch.dtype, correction: str) -> int:
    """Bytes of the correction a tensor holds: 1 or 2 per element of a bf16/fp16 tensor, else 0."""
    bits = check_correction(correction)
    return numel_of(tuple(shape)) * bits // 8 if dtype in WEIGHT_DTYPES else 0


def compose(
    by_format: Mapping[str, Mapping[str, float]],
    by_correction: Mapping[str, Mapping[str, float]],
    names: Sequence[str],
) -> dict[str, dict[str, float]]:
    """Block -> option -> the format's entry plus the correction's (risks, or bytes)."""
    out: dict[str, dict[str, float]] = {}
    for block, row in by_format.items():
        out[block] = {}
        for name in names:
            fmt, correction = split_option(name)
            out[block][name] = row[fmt] + by_correction[block][correction]
    return out


def correction_table(
    shapes: Mapping[str, Sequence[Sequence[int]]],
    dtypes: Mapping[str, Sequence[torch.dtype]],
    corrections: Sequence[str],
) -> dict[str, dict[str, int]]:
    """Block -> correction -> bytes of the corrections of its 16-bit tensors."""
    return {
        b: {c: sum(correction_bytes(s, d, c) for s, d in zip(shapes[b], dtypes[b])) for c in corrections}
        for b in shapes
    }


def correction_time_table(
    blocks: Mapping[str, Sequence[Sequence[int]]], dtypes: Mapping[str, Sequence[torch.dtype]], costs: Mapping[str, float],
    corrections: Iterable[str],
) -> dict[str, dict[str, float]]:
    """Block -> correction -> the step time its corrections add: the elements of the block's 16-bit
    tensors times the correction's per-element cost (fp32 tensors hold none and add nothing).

    Example:
        >>> correction_time_table({"fc": [(64, 64), (64,)]}, {"fc": [torch.bfloat16, torch.float32]},
        ...                       {"none": 0.0, "ecc8": 2.0}, ["none", "ecc8"])
        {'fc': {'none': 0.0, 'ecc8': 8192.0}}
    """
    names = list(dict.fromkeys(corrections))
    for c in names:
        if c not in costs:
            raise ValueError(f"no step cost for correction {c!r}; costs cover {sorted(costs)}: calibrate it too")
    out: dict[str, dict[str, float]] = {}
    for block, shapes in blocks.items():
        sixteen = sum(numel_of(tuple(s)) for s, d in zip(shapes, dtypes[block]) if d in WEIGHT_DTYPES)
        out[block] = {c: sixteen * costs[c] for c in names}
    return out


def prior_correction_risk(
    shapes: Mapping[str, Sequence[Sequence[int]]],
    dtypes: Mapping[str, Sequence[torch.dtype]],
    corrections: Sequence[str],
) -> dict[str, dict[str, float]]:
    """Block -> correction -> :data:`PRIOR_CORRECTION_RISK` times the share of the model's elements its
    16-bit tensors hold (fp32 tensors lose nothing)."""
    total = sum(numel_of(tuple(s)) for block in shapes.values() for s in block) or 1
    out: dict[str, dict[str, float]] = {}
    for b, block in shapes.items():
        sixteen = sum(numel_of(tuple(s)) for s, d in zip(block, dtypes[b]) if d in WEIGHT_DTYPES)
        out[b] = {c: PRIOR_CORRECTION_RISK[c] * sixteen / total for c in corrections}
    return out


__all__ = [
    "CORRECTION_BITS",
    "PRIOR_CORRECTION_RISK",
    "SEPARATOR",
    "compose",
    "correction_bytes",
    "correction_table",
    "correction_time_table",
    "option",
    "options",
    "prior_correction_risk",
    "split_option",
]
