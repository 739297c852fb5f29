"""The controller's allocation options: state formats, or formats paired with master-weight corrections.

Without ``corrections`` an option is a state format. With ``BAOC(corrections=[...])`` an option pairs a
format with the correction of the block's bf16/fp16 weights (:mod:`lightning_baoc.costs.options`:
``"int8+ecc8"``): the risk table is the state formats' plus the corrections'
(:func:`lightning_baoc.risk.correction.correction_risk_table`, or their priors), the memory table counts
both, so the budget caps states and corrections together, and applying an allocation sets both
(:meth:`~lightning_baoc.BlockwiseAdamW.set_formats`, :meth:`~lightning_baoc.BlockwiseAdamW.set_weight_corrections`),
corrections that shrink before the states convert and those that grow after, so the held bytes only
fall while the budget falls.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.control.blocks import Blocks
from lightning_baoc.control.instrumentation import Instrumentation
from lightning_baoc.control.tables import BlockTables
from lightning_baoc.costs.options import compose, option, prior_correction_risk, split_option
from lightning_baoc.formats import format_state_bytes
from lightning_baoc.formats.correction import CORRECTION_BITS, WEIGHT_DTYPES
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.risk.correction import correction_risk_table

Table = Mapping[str, Mapping[str, float]]


class Options:
    """The options of the blocks: what the optimizer is asked to hold, risk tables over them, applying them.

    Args:
        config: the settings; reads ``corrections`` (``None``: an option is a state format).
        blocks: the partition (an option is applied to a block's parameters).
        tables: the options offered, the shapes and dtypes of the blocks.
        instrumentation: the shadow moments the corrections' risk is measured on.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from lightning_baoc.control.controller import BAOCController
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
        >>> controller = BAOCController(memory_budget=0.5, calibration="prior")  # it builds the parts
        >>> opt = controller.install(torch.optim.AdamW(model.parameters()), model); options = controller.options
        >>> _ = options.apply(opt, {"0": "int8"}, controller.blocks.params)  # created in int8 at the first step
        >>> options.current(opt)  # block 1 as the start allocation put it under the budget
        {'0': 'int8', '1': 'bf16'}
    """

    def __init__(self, config: BAOCConfig, blocks: Blocks, tables: BlockTables, instrumentation: Instrumentation) -> None:
        self.config = config
        self.blocks = blocks
        self.tables = tables
        self.instrumentation = instrumentation

    @property
    def paired(self) -> bool:
        """Whether options pair formats with corrections (set, or by default where weights are 16-bit:
        :func:`~lightning_baoc.costs.options.corrections_menu`)."""
        return self.tables.corrections is not None

    def formats_offered(self) -> list[str]:
        """The state formats offered (the options' formats, in order)."""
        return list(dict.fromkeys(split_option(o)[0] for o in self.tables.offered))

    def with_corrections(self, opt: BlockwiseOptimizer, by_format: Table, measured: bool) -> dict[str, dict[str, float]]:
        """A risk table over formats extended to the options: the corrections' risk added, measured
        on the shadow moments (``measured``) or the prior."""
        if not self.paired:
            return {b: dict(row) for b, row in by_format.items()}
        corrections = list(self.tables.corrections or ())
        shadow = self.instrumentation.shadow
        if measured and shadow is not None:
            blocks = {b: self.blocks.params[b] for b in by_format}
            extra = correction_risk_table(opt, blocks, shadow, self.instrumentation.betas(opt), corrections)
        else:
            shapes = {b: self.tables.shapes[b] for b in by_format}
            extra = prior_correction_risk(shapes, {b: self.tables.dtypes[b] for b in by_format}, corrections)
        return compose(by_format, extra, self.tables.offered)

    def current(self, opt: BlockwiseOptimizer) -> dict[str, str]:
        """Block -> the option its parameters are asked to hold (``"mixed"`` where they differ)."""
        named = opt.named_params
        out = {}
        for b, names in self.blocks.params.items():
            held = {opt.requested_format(named[n]) for n in names}
            fmt = held.pop() if len(held) == 1 else "mixed"
            if self.paired and fmt != "mixed":
                sixteen = [n for n in names if named[n].dtype in WEIGHT_DTYPES]
                corrections = {opt.target_correction(named[n]) for n in sixteen} or {"none"}  # type: ignore[attr-defined]
                fmt = option(fmt, corrections.pop()) if len(corrections) == 1 else "mixed"
            out[b] = fmt
        return out

    def state_formats(self, opt: BlockwiseOptimizer) -> dict[str, str]:
        """Block -> the state format its parameters are asked to hold (``"mixed"`` where they differ),
        the correction left out."""
        named = opt.named_params
        out = {}
        for b, names in self.blocks.params.items():
            held = {opt.requested_format(named[n]) for n in names}
            out[b] = held.pop() if len(held) == 1 else "mixed"
        return out

    def corrections(self, opt: BlockwiseOptimizer) -> dict[str, str]:
        """Block -> the master-weight correction its bf16/fp16 weights hold from their next step, chosen by
        the options or by the optimizer's own ``weight_correction`` (``"none"`` where there is none or the
        weights are fp32, ``"mixed"`` where they differ)."""
        named = opt.named_params
        out = {}
        for b, names in self.blocks.params.items():
            held = {opt.target_correction(named[n]) for n in names if named[n].dtype in WEIGHT_DTYPES} or {"none"}
            out[b] = held.pop() if len(held) == 1 else "mixed"
        return out

    def apply(
        self, opt: BlockwiseOptimizer, chosen: Mapping[str, str], blocks: Mapping[str, list[str]] | None = None
    ) -> dict[str, tuple[str, str]]:
        """Put blocks (or parameters, without ``blocks``) in their options; returns the formats that
        changed, as ``set_formats`` reports them."""
        if not self.paired:  # a checkpoint's options, resumed without corrections: their formats
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

    def held_bytes(self, opt: BlockwiseOptimizer) -> dict[str, int]:
        """Block -> state bytes of its parameters in their effective formats (and the bytes of their
        corrections, where options pair them)."""
        held = opt.formats()
        out = {}
        for b, names in self.blocks.params.items():
            total = 0
            for n, shape in zip(names, self.tables.shapes[b]):
                total += format_state_bytes(held[n], shape, opt.min_8bit_numel, opt.rule)
                correction = opt.held_correction(n) if self.paired else None
                if correction is not None:
                    total += correction.untyped_storage().nbytes()
            out[b] = int(total)
        return out


__all__ = ["Options"]
