"""Master weights of 16-bit parameters: per-parameter corrections held by the optimizer.

A bf16 or fp16 parameter (Lightning ``precision="bf16-true"``) may carry a correction
(:mod:`lightning_baoc.formats.correction`): ``"ecc8"`` (int8, 1 byte per element) or ``"ecc16"``
(int16, 2 bytes, exact for bf16 but at ties), or ``"none"``. The weight the model holds and its
correction together are the fp32 master the step updates: the step reconstructs it, updates it with
the parameter's state format, and splits it again into weight and correction. The compiled CPU
kernel does it per 1024-element super-block in its one pass over the states; the eager step (and the
factored formats) one parameter at a time, whose fp32 master is then the only transient. fp32
parameters are their own masters and never hold one.

The choice is per parameter: the group's ``weight_correction`` (default ``"none"``), or
:meth:`MasterMixin.set_weight_corrections`. A change takes effect at the next step or at once:
``ecc16 -> ecc8`` requantizes, ``-> none`` drops the correction (the weight already is the master
rounded to nearest), ``none -> ecc8`` starts from a zero correction (the master is the weight).
The corrections' bytes are counted apart from the states' (:meth:`MasterMixin.weight_correction_bytes`)
and saved in checkpoints (``"corrections"``, covered by the checksum).

:class:`MasterMixin` expects ``_records``, ``_names``, ``param_groups`` and ``resolve_names`` of
the optimizer it is mixed into.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from lightning_baoc.formats.correction import (
    WEIGHT_DTYPES,
    check_correction,
    correction_dtype,
    reconstruct,
    split_into,
)
from lightning_baoc.optim.pools import Record
from lightning_baoc.optim.sharding import local


def correction_for(name: str, dtype: torch.dtype) -> str:
    """The correction a parameter of ``dtype`` holds when ``name`` is asked: ``"none"`` for fp32."""
    check_correction(name)
    return name if dtype in WEIGHT_DTYPES else "none"


class MasterMixin:
    """Weight corrections of BlockwiseAdamW (see the module docstring)."""

    _records: dict[Tensor, Record]
    _names: dict[str, Tensor]
    param_groups: list[dict[str, Any]]

    def set_weight_corrections(self, corrections: Mapping[str, str], blocks: Mapping[str, Iterable[str]] | None = None) -> dict[str, tuple[str, str]]:
        """Choose the master-weight correction of parameters (or blocks): ``{name: "ecc8"}``.

        Keys are parameter names, or block names of ``blocks`` (block -> parameter names), as in
        ``set_formats``. A parameter held in fp32 is its own master: asking it for a correction is
        an error naming it. Corrections already held convert at once.

        Returns:
            ``{parameter name: (old, new)}`` for every correction that changed.

        Raises:
            ValueError: an unknown correction, or one asked for an fp32 parameter.
        """
        if not isinstance(corrections, Mapping):
            raise TypeError(f"corrections must be a mapping name -> correction, got {type(corrections).__name__}")
        resolved = self.resolve_names(corrections.keys(), blocks)  # type: ignore[attr-defined]
        requests: dict[Tensor, str] = {}
        for key, kind in corrections.items():
            check_correction(kind)
            for p in resolved[key]:
                if kind != "none" and p.dtype not in WEIGHT_DTYPES:
                    raise ValueError(
                        f"parameter {self._records[p].name!r} is {p.dtype}: it is its own master weight, "
                        f"a correction applies to bf16 and fp16 parameters only"
                    )
                requests[p] = kind
        for p, kind in requests.items():
            self._records[p].correction_requested = kind
        return self._sync_corrections()

    def target_correction(self, p: Tensor) -> str:
        """The correction ``p`` holds from its next step: its request, else its group's default."""
        rec = self._records[p]
        asked = rec.correction_requested or self.param_groups[rec.group].get("weight_correction", "none")
        return correction_for(asked, p.dtype)

    @torch.no_grad()
    def _sync_corrections(self, only: Iterable[Tensor] | None = None) -> dict[str, tuple[str, str]]:
        """Create, convert or drop the corrections whose target differs from what is held (of the
        parameters ``only``, or all)."""
        changes: dict[str, tuple[str, str]] = {}
        pairs = self._records.items() if only is None else ((p, self._records[p]) for p in only)
        for p, rec in pairs:
            if rec.correction == "none" and not rec.correction_requested and \
                    self.param_groups[rec.group].get("weight_correction", "none") == "none":
                continue  # nothing asked, nothing held (the common case, checked on every step)
            target = self.target_correction(p)
            if target == rec.correction:
                continue
            changes[rec.name] = (rec.correction, target)
            store = correction_dtype(target)
            mine = local(p).detach()
            new = None if store is None else torch.zeros(mine.shape, dtype=store, device=p.device)
            if new is not None and rec.master_correction is not None:
                split_into(reconstruct(mine, rec.master_correction), mine.clone(), new)
            self._drop_plans()  # type: ignore[attr-defined] - a plan holds the old correction
            rec.master_correction = new
            rec.correction = target
        return changes

    def held_correction(self, name: str) -> Tensor | None:
        """The correction tensor parameter ``name`` holds now (``None``: none; a view, do not modify)."""
        return self._records[self._names[name]].master_correction

    @property
    def weight_corrections(self) -> dict[str, str]:
        """Parameter name -> correction held, for the parameters holding one."""
        return {rec.name: rec.correction for rec in self._records.values() if rec.correction != "none"}

    def weight_correction_bytes(self, device: torch.device | str | None = None) -> int:
        """Bytes of storage the corrections hold (on ``device``, or everywhere): apart from the states'."""
        total = 0
        for p, rec in self._records.items():
            c = rec.master_correction
            if c is not None and (device is None or c.device == torch.device(device)):
                total += c.untyped_storage().nbytes()
        return total

    @torch.no_grad()
    def master_weights(self) -> dict[str, Tensor]:
        """Parameter name -> its fp32 master weight (a new tensor): the weight plus its correction,
        the weight itself where there is none. The export of a bf16 model trained with corrections."""
        return {rec.name: reconstruct(p.detach(), rec.master_correction) for p, rec in self._records.items()}


__all__ = ["MasterMixin", "correction_for"]
