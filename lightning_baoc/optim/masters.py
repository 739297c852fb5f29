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
:meth:`BlockwiseAdamW.set_weight_corrections <lightning_baoc.optim.BlockwiseAdamW.set_weight_corrections>`.
A change takes effect at the next step or at once:
``ecc16 -> ecc8`` requantizes, ``-> none`` drops the correction (the weight already is the master
rounded to nearest), ``none -> ecc8`` starts from a zero correction (the master is the weight).
The corrections' bytes are counted apart from the states' (:meth:`MasterWeights.nbytes`) and saved in
checkpoints (``"corrections"``, covered by the checksum). :class:`MasterWeights` holds the requests,
conversions and the export of an optimizer's corrections.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor

from lightning_baoc.formats.correction import WEIGHT_DTYPES, check_correction, correction_dtype, reconstruct, split_into
from lightning_baoc.optim.pools import Record
from lightning_baoc.optim.sharding import local


def correction_for(name: str, dtype: torch.dtype) -> str:
    """The correction a parameter of ``dtype`` holds when ``name`` is asked: ``"none"`` for fp32."""
    check_correction(name)
    return name if dtype in WEIGHT_DTYPES else "none"


class MasterWeights:
    """The master-weight corrections of an optimizer's 16-bit parameters (see the module docstring).

    Holds nothing of its own: each parameter's correction (``correction``, ``master_correction``) and its
    request (``correction_requested``) live in its record.

    Needs: the records table (parameter -> :class:`~lightning_baoc.optim.pools.Record`, shared with the
    optimizer) and ``on_replace``, called before a correction tensor is replaced (the step's device plans
    hold them: ``StepDispatcher.forget_plans``). The param groups (their ``weight_correction``, the
    default of their parameters) come from the caller of :meth:`target` and :meth:`sync`.

    Example:
        >>> masters = MasterWeights(records)  # doctest: +SKIP
        >>> masters.request({"w": "ecc8"}, {"w": [p]}, optimizer.param_groups)  # {"w": ("none", "ecc8")}  # doctest: +SKIP
    """

    def __init__(self, records: dict[Tensor, Record], on_replace: Callable[[], None] = lambda: None) -> None:
        self.records = records
        self.on_replace = on_replace

    def request(
        self, corrections: Mapping[str, str], resolved: Mapping[str, list[Tensor]], groups: list[dict[str, Any]]
    ) -> dict[str, tuple[str, str]]:
        """Ask the parameters of each key of ``corrections`` (``resolved``: key -> its parameters) for the
        key's correction, validated (a known kind; none but ``"none"`` for an fp32 parameter, its own
        master), and convert the corrections held at once.

        Returns:
            ``{parameter name: (old, new)}`` for every correction that changed.

        Raises:
            ValueError: an unknown correction, or one asked for an fp32 parameter.
        """
        requests: dict[Tensor, str] = {}
        for key, kind in corrections.items():
            check_correction(kind)
            for p in resolved[key]:
                if kind != "none" and p.dtype not in WEIGHT_DTYPES:
                    raise ValueError(
                        f"parameter {self.records[p].name!r} is {p.dtype}: it is its own master weight, "
                        f"a correction applies to bf16 and fp16 parameters only"
                    )
                requests[p] = kind
        for p, kind in requests.items():
            self.records[p].correction_requested = kind
        return self.sync(groups)

    def target(self, p: Tensor, groups: list[dict[str, Any]]) -> str:
        """The correction ``p`` holds from its next step: its request, else its group's default."""
        rec = self.records[p]
        asked = rec.correction_requested or groups[rec.group].get("weight_correction", "none")
        return correction_for(asked, p.dtype)

    @torch.no_grad()
    def sync(self, groups: list[dict[str, Any]], only: Iterable[Tensor] | None = None) -> dict[str, tuple[str, str]]:
        """Create, convert or drop the corrections whose target differs from what is held (of the
        parameters ``only``, or all); ``{name: (old, new)}`` of those that changed."""
        changes: dict[str, tuple[str, str]] = {}
        pairs = self.records.items() if only is None else ((p, self.records[p]) for p in only)
        for p, rec in pairs:
            if rec.correction == "none" and not rec.correction_requested and \
                    groups[rec.group].get("weight_correction", "none") == "none":
                continue  # nothing asked, nothing held (the common case, checked on every step)
            target = self.target(p, groups)
            if target == rec.correction:
                continue
            changes[rec.name] = (rec.correction, target)
            store = correction_dtype(target)
            weight = local(p).detach()
            new = None if store is None else torch.zeros(weight.shape, dtype=store, device=p.device)
            if new is not None and rec.master_correction is not None:
                split_into(reconstruct(weight, rec.master_correction), weight.clone(), new)
            self.on_replace()  # a plan holds the old correction
            rec.master_correction = new
            rec.correction = target
        return changes

    def held(self) -> dict[str, str]:
        """Parameter name -> correction held, for the parameters holding one."""
        return {rec.name: rec.correction for rec in self.records.values() if rec.correction != "none"}

    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes of storage the corrections hold (on ``device``, or everywhere): apart from the states'."""
        total = 0
        for rec in self.records.values():
            c = rec.master_correction
            if c is not None and (device is None or c.device == torch.device(device)):
                total += c.untyped_storage().nbytes()
        return total

    @torch.no_grad()
    def master_weights(self) -> dict[str, Tensor]:
        """Parameter name -> its fp32 master weight (a new tensor): the weight plus its correction,
        the weight itself where there is none."""
        return {rec.name: reconstruct(p.detach(), rec.master_correction) for p, rec in self.records.items()}


__all__ = ["MasterWeights", "correction_for"]
