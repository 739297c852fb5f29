"""The controller's allocation options: state formats, or formats paired with master-weight corrections.

Without ``corrections`` an option is a state format and the controller behaves as it always did.
With ``BAOC(corrections=[...])`` an option pairs a format with the correction of the block's bf16/fp16
weights (:mod:`lightning_baoc.costs.options`: ``"int8+ecc8"``): the risk table is the state formats'
plus the corrections' (:func:`lightning_baoc.risk.correction.correction_risk_table`, or their priors),
the memory table counts both, so the budget caps states and corrections together, and applying an
allocation sets both (:meth:`~lightning_baoc.BlockwiseAdamW.set_formats`,
:meth:`~lightning_baoc.BlockwiseAdamW.set_weight_corrections`), corrections that shrink before the
states convert and those that grow after, so the held bytes only fall while the budget falls.

A mixin of :class:`~lightning_baoc.control.controller.BAOCController`: the lifecycle owns the attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_baoc.costs.options import (
    compose,
    option,
    prior_correction_risk,
    split_option,
)
from lightning_baoc.formats.correction import CORRECTION_BITS, WEIGHT_DTYPES
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.risk.correction import correction_risk_table

Table = Mapping[str, Mapping[str, float]]


class OptionsMixin:
    """Options of the controller (see the module docstring)."""

    # provided by the controller
    config: Any
    optimizer: BlockwiseOptimizer | None
    block_params: dict[str, list[str]]
    shadow: Any
    _offered: list[str]
    _shapes: dict[str, list[tuple[int, ...]]]
    _dtypes: dict[str, list[torch.dtype]]
    _betas: Any

    @property
    def _paired(self) -> bool:
        """Whether options pair formats with corrections (``corrections`` is set)."""
        return self.config.corrections is not None

    def _formats_offered(self) -> list[str]:
        """The state formats offered (the options' formats, in order)."""
        return list(dict.fromkeys(split_option(o)[0] for o in self._offered))

    def _with_corrections(self, by_format: Table, measured: bool) -> dict[str, dict[str, float]]:
        """A risk table over formats extended to the options: the corrections' risk added, measured
        on the shadow moments (``measured``) or the prior."""
        if not self._paired:
            return {b: dict(row) for b, row in by_format.items()}
        corrections = list(self.config.corrections)
        if measured and self.shadow is not None and self.optimizer is not None:
            blocks = {b: self.block_params[b] for b in by_format}
            extra = correction_risk_table(self.optimizer, blocks, self.shadow, self._betas(), corrections)
        else:
            shapes = {b: self._shapes[b] for b in by_format}
            extra = prior_correction_risk(shapes, {b: self._dtypes[b] for b in by_format}, corrections)
        return compose(by_format, extra, self._offered)

    def _current_options(self) -> dict[str, str]:
        """Block -> the option its parameters are asked to hold (``"mixed"`` where they differ)."""
        assert self.optimizer is not None
        opt = self.optimizer
        named = opt.named_params
        out = {}
        for b, names in self.block_params.items():
            held = {opt.requested_format(named[n]) for n in names}
            fmt = held.pop() if len(held) == 1 else "mixed"
            if self._paired and fmt != "mixed":
                sixteen = [n for n in names if named[n].dtype in WEIGHT_DTYPES]
                corrections = {opt.target_correction(named[n]) for n in sixteen} or {"none"}  # type: ignore[attr-defined]
                fmt = option(fmt, corrections.pop()) if len(corrections) == 1 else "mixed"
            out[b] = fmt
        return out

    def _apply_options(self, chosen: Mapping[str, str], blocks: Mapping[str, list[str]] | None = None) -> dict[str, tuple[str, str]]:
        """Put blocks (or parameters, without ``blocks``) in their options; returns the formats that
        changed, as ``set_formats`` reports them."""
        assert self.optimizer is not None
        opt = self.optimizer
        if not self._paired:  # a checkpoint's options, resumed without corrections: their formats
            return opt.set_formats({key: split_option(o)[0] for key, o in chosen.items()}, blocks=blocks)
        formats = {key: split_option(o)[0] for key, o in chosen.items()}
        named = opt.named_params
        corrections: dict[str, str] = {}
        for key, o in chosen.items():
            for n in (blocks[key] if blocks is not None else [key]):
                if named[n].dtype in WEIGHT_DTYPES:
                    corrections[n] = split_option(o)[1]
        held = {n: opt.target_correction(named[n]) for n in corrections}  # type: ignore[attr-defined]
        shrink = {n: c for n, c in corrections.items() if CORRECTION_BITS[c] < CORRECTION_BITS[held[n]]}
        grow = {n: c for n, c in corrections.items() if n not in shrink}
        if shrink:
            opt.set_weight_corrections(shrink)  # type: ignore[attr-defined]
        migrated = opt.set_formats(formats, blocks=blocks)
        if grow:
            opt.set_weight_corrections(grow)  # type: ignore[attr-defined]
        return migrated


__all__ = ["OptionsMixin"]
