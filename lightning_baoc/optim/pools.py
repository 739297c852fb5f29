"""Memory layout of :class:`~lightning_baoc.optim.BlockwiseAdamW`: per-parameter records and pools.

The states of all parameters sharing a format on a device live in one contiguous ``uint8`` pool,
carved into per-parameter views of the format's dtypes. Views are laid out by descending item
size (all 8-byte tensors, then 4-, 2- and 1-byte ones), so no alignment padding is ever needed and
``BlockwiseAdamW.state_bytes`` equals both the sum of the formats' stated bytes and the storage
really allocated. Pools are rebuilt when formats change (``set_formats``) and on a load.

:class:`PoolsMixin` holds the optimizer's pool methods: it expects ``_records`` (parameter ->
:class:`Record`), ``_pools`` and ``_hyper_for`` of the optimizer it is mixed into.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import Tensor

from lightning_baoc.formats import FORMATS, Canonical, StepHyper
from lightning_baoc.formats.base import TensorSpec

HOST = torch.device("cpu")


@dataclass
class Record:
    """Book-keeping of one parameter (never checkpointed as is: see ``state_dict``)."""

    name: str
    group: int
    requested: str | None = None  # explicit request from set_formats; None: the group default
    format: str | None = None  # the format the state is held in; None: no state yet
    step: int = 0
    m_step: int = 0  # steps since the momentum was (re)created: its own bias correction
    views: dict[str, Tensor] | None = None
    nonfinite: int = 0


@dataclass
class Pool:
    """One contiguous buffer holding the states of ``members`` in ``format``."""

    format: str
    storage_device: torch.device
    buffer: Tensor
    members: list[Tensor] = field(default_factory=list)


def device_key(device: torch.device) -> str:
    """The key of a device in pools and generator tables (``"cpu"``, ``"cuda:0"``)."""
    return str(device)


def storage_device(fmt: str, param_device: torch.device) -> torch.device:
    """Where a state of ``fmt`` lives for a parameter on ``param_device`` (host when offloaded)."""
    return HOST if FORMATS[fmt].offloaded else param_device


class PoolsMixin:
    """Pool building and state conversion of BlockwiseAdamW (see the module docstring)."""

    _records: dict[Tensor, Record]
    _pools: dict[tuple[str, str], Pool]
    _hyper_for: Callable[[Tensor], StepHyper]  # the optimizer's: a parameter's group hyperparameters

    def _rebuild(
        self,
        changes: Mapping[Tensor, str],
        sources: Mapping[Tensor, Canonical | dict[str, Tensor] | None] | None = None,
    ) -> None:
        """Move the parameters of ``changes`` to their new formats and rebuild the pools involved.

        ``sources`` optionally gives a parameter's new state: a :class:`Canonical` to encode, a dict
        of compact tensors to copy (checkpoint), or ``None`` for a fresh zero state. Without a
        source a parameter's current state is converted.
        """
        sources = sources or {}
        old_format = {p: self._records[p].format for p in changes}
        affected: set[tuple[str, str]] = set()
        for p, fmt in changes.items():
            dev = device_key(p.device)
            affected.add((fmt, dev))
            if old_format[p] is not None:
                affected.add((old_format[p], dev))
        # Sorted: a set of strings iterates in a per-process hash order, and the pools are encoded
        # (drawing stochastic-rounding offsets from the seeded generator) in this order.
        members: dict[tuple[str, str], list[Tensor]] = {key: [] for key in sorted(affected)}
        for p, rec in self._records.items():
            fmt = changes.get(p, rec.format)
            if fmt is None:
                continue
            key = (fmt, device_key(p.device))
            if key in members:
                members[key].append(p)

        new_pools: dict[tuple[str, str], Pool] = {}
        new_views: dict[Tensor, dict[str, Tensor]] = {}
        for key, params in members.items():
            fmt, dev = key
            if not params:
                continue
            pool, views = self._allocate_pool(fmt, params)
            new_pools[key] = pool
            for p in params:
                rec = self._records[p]
                target = views[p]
                if p in sources:
                    self._fill_from_source(p, fmt, target, sources[p])
                elif p not in changes or old_format[p] == fmt:
                    for k, t in target.items():
                        t.copy_(rec.views[k])  # unchanged member: keep its bytes
                else:
                    self._convert_into(p, old_format[p], fmt, target)
                new_views[p] = target
        for key in affected:
            self._pools.pop(key, None)
        self._pools.update(new_pools)
        for p, views in new_views.items():
            self._records[p].views = views
            self._records[p].format = changes.get(p, self._records[p].format)
        for p, fmt in changes.items():
            if not FORMATS[fmt].has_momentum:
                self._records[p].m_step = 0

    def _fresh_pools(
        self, formats: Mapping[Tensor, str], fill: Callable[[Tensor, str, dict[str, Tensor]], None]
    ) -> tuple[dict[tuple[str, str], Pool], dict[Tensor, dict[str, Tensor]]]:
        """New pools for ``formats`` (parameter -> format), each view filled by ``fill``.

        Touches no record and no existing pool: a caller commits the result only once every
        fallible step (allocation, filling) is done.
        """
        members: dict[tuple[str, str], list[Tensor]] = defaultdict(list)
        for p in self._records:  # the optimizer's order, as in _rebuild
            if p in formats:
                members[(formats[p], device_key(p.device))].append(p)
        pools: dict[tuple[str, str], Pool] = {}
        views: dict[Tensor, dict[str, Tensor]] = {}
        for key in sorted(members):  # sorted: encoding order draws rounding offsets deterministically
            pools[key], pool_views = self._allocate_pool(key[0], members[key])
            for p in members[key]:
                fill(p, key[0], pool_views[p])
                views[p] = pool_views[p]
        return pools, views

    def _allocate_pool(self, fmt: str, params: list[Tensor]) -> tuple[Pool, dict[Tensor, dict[str, Tensor]]]:
        layouts = {p: FORMATS[fmt].layout(p.shape) for p in params}
        storage = storage_device(fmt, params[0].device)
        offsets: dict[Tensor, dict[str, tuple[int, TensorSpec]]] = {p: {} for p in params}
        total = 0
        for itemsize in (8, 4, 2, 1):  # descending item size: every offset stays aligned
            for p in params:
                for spec in layouts[p]:
                    if spec.nbytes and torch.empty((), dtype=spec.dtype).element_size() == itemsize:
                        offsets[p][spec.key] = (total, spec)
                        total += spec.nbytes
        pin = storage.type == "cpu" and FORMATS[fmt].offloaded and torch.cuda.is_available()
        buffer = torch.zeros(total, dtype=torch.uint8, device=storage, pin_memory=pin)
        views: dict[Tensor, dict[str, Tensor]] = {}
        for p in params:
            views[p] = {}
            for spec in layouts[p]:
                if spec.key in offsets[p]:
                    start, _ = offsets[p][spec.key]
                    views[p][spec.key] = buffer[start : start + spec.nbytes].view(spec.dtype)
                else:  # zero-size tensor (empty parameter)
                    views[p][spec.key] = torch.empty(0, dtype=spec.dtype, device=storage)
        return Pool(fmt, storage, buffer, list(params)), views

    def _convert_into(self, p: Tensor, old: str, new: str, target: dict[str, Tensor]) -> None:
        rec = self._records[p]
        canonical = FORMATS[old].decode(rec.views, p.shape)
        self._encode(p, new, canonical, target)

    def _encode(self, p: Tensor, fmt: str, canonical: Canonical, target: dict[str, Tensor]) -> None:
        rec = self._records[p]
        hyper = self._hyper_for(p)
        if FORMATS[fmt].has_momentum and canonical.exp_avg is None:
            grad = p.grad
            if grad is not None and bool(torch.isfinite(grad).all()):
                # re-create the momentum as one EMA step of the current gradient; its own bias
                # correction (m_step = 1) makes m_hat equal that gradient
                canonical.exp_avg = grad.detach().to(torch.float32).mul(1.0 - hyper.beta1)
                rec.m_step = 1
            else:
                canonical.exp_avg = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                rec.m_step = 0
        FORMATS[fmt].encode(canonical, target, hyper)

    def _fill_from_source(
        self, p: Tensor, fmt: str, target: dict[str, Tensor], source: Canonical | dict[str, Tensor] | None
    ) -> None:
        if source is None:
            return  # pools are zero-initialized: a fresh state
        if isinstance(source, Canonical):
            self._encode(p, fmt, source, target)
            return
        for key, t in target.items():
            t.copy_(source[key])
