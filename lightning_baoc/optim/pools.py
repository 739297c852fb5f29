"""Memory layout of :class:`~lightning_baoc.optim.BlockwiseAdamW`: per-parameter records and pools.

The states of all parameters sharing a format on a device form one pool, made of one segment per
parameter: a ``uint8`` buffer carved into the views of the format's dtypes. Views are laid out by
descending item size (all 8-byte tensors, then 4-, 2- and 1-byte ones), so no alignment padding is
ever needed and ``BlockwiseAdamW.state_bytes`` equals both the sum of the formats' stated bytes and
the storage really allocated.

Conversions (``set_formats``) move one parameter at a time: its new segment is allocated and filled
from the old one in slices of ``chunk_size`` elements (:func:`~lightning_baoc.optim.convert.convert_state`),
then the old segment is freed. Parameters whose state shrinks on the device go first. So at any moment
of a conversion the state on the device is at most ``max(before, after) + min(old, new)`` of the one
parameter being converted, plus the slice's fp32 scratch (a few MiB): the transient above the steady
state is at most one parameter's old state (tests/optim/test_conversion_memory.py measures it on the
allocator).

:class:`PoolsMixin` holds the optimizer's pool methods: it expects ``_records`` (parameter ->
:class:`Record`), ``_pools`` and ``_hyper_for`` of the optimizer it is mixed into.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from lightning_baoc.formats import FORMATS, Canonical, StateFormat, StepHyper
from lightning_baoc.formats.base import TensorSpec
from lightning_baoc.formats.frames import FramedViews
from lightning_baoc.optim.convert import convert_state
from lightning_baoc.optim.sharding import (
    is_sharded,
    largest_shard_shape,
    local,
    mesh_min,
)

HOST = torch.device("cpu")


class DeferredFlags:
    """Which parameters of one step had a finite gradient, decided on their device and read later.

    The CUDA step launches its kernels without reading the gradients' finiteness: each kernel reads
    its parameter's flag on the device and skips the update where it is 0, while the host advances the
    parameter's counts as if it stepped. The flags travel to pinned host memory behind the step (a
    copy that does not wait), and :meth:`Record.settle` takes a skipped step back out of the counts
    when a count is next read: at the next step, by which time the copy is done, or at a checkpoint.
    """

    def __init__(self, skip: Tensor, size: int) -> None:
        #: (record, whether its format had a momentum) of each flag, set as the step launches
        self.records: list[tuple[Record, bool] | None] = [None] * size
        if skip.device.type == "cuda":
            self._host = torch.empty(skip.shape, dtype=skip.dtype, pin_memory=True)
            self._host.copy_(skip, non_blocking=True)
            self._event: Any = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = skip, None
        self._values: Any = None

    def values(self) -> Any:
        """Whether each parameter stepped (its gradient was finite), a host array: waits for the copy
        of the skip flags (``skip``: nonzero where the kernel skipped) only if it is not done yet."""
        if self._values is None:
            if self._event is not None and not self._event.query():
                self._event.synchronize()
            self._values = self._host.numpy() == 0
        return self._values

    def skipped(self) -> list[Record]:
        """The records whose update was skipped, their counts settled."""
        flags = self.values()
        if flags.all():  # the common step: nothing to take back, each record's pending step forgotten
            for entry in self.records:
                if entry is not None and entry[0].pending is not None and entry[0].pending[0] is self:
                    entry[0].pending = None
            return []
        out = []
        for i, entry in enumerate(self.records):
            if entry is not None:
                entry[0].settle()
                if not flags[i]:
                    out.append(entry[0])
        return out


@dataclass
class Record:
    """Book-keeping of one parameter (never checkpointed as is: see ``state_dict``).

    The step counts live in ``counts``, a host int64 tensor ``[step, m_step, nonfinite]`` that the
    compiled step advances itself (it decides which parameters step, so the optimizer never reads
    a count to launch it); ``step``, ``m_step`` and ``nonfinite`` read and write it, after settling a
    step whose skip was decided on the device (``pending``: :class:`DeferredFlags`).
    """

    name: str
    group: int
    requested: str | None = None  # explicit request from set_formats; None: the group default
    format: str | None = None  # the format the state is held in; None: no state yet
    views: dict[str, Tensor] | None = None
    counts: Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.int64))
    correction: str = "none"  # the master-weight correction held (optim/masters.py)
    correction_requested: str | None = None  # explicit request; None: the group default
    master_correction: Tensor | None = None  # its int8/int16 tensor, the parameter's shape
    shard_offset: int = 0  # where this rank's shard starts in the global flat parameter (optim/sharding.py)
    #: a shard of a parameter whose shards do not all start on an 8-bit super-block (sharding.FlatShards)
    frame: Any = None
    #: a shard of a parameter whose rows are split among ranks (sharding.RowShards): factored formats sum over them
    row_shards: Any = None
    #: the step whose skip the device decides: (its flags, this record's index in them)
    pending: tuple[DeferredFlags, int] | None = None
    _array: Any = field(default=None, init=False, repr=False, compare=False)  # counts as a numpy array (a view)

    def _counts(self) -> Any:
        """``counts`` as a numpy view (made once: the getters run several times per step)."""
        if self._array is None:
            self._array = self.counts.numpy()
        return self._array

    def use_counts(self, counts: Tensor) -> None:
        """Hold the counts in ``counts`` (a host int64 tensor of 3 holding this record's counts already): a row
        of the optimizer's ``CountsStore`` (optim/device_plan.py), whose plans advance many rows at once."""
        self.counts, self._array = counts, None

    def settle(self) -> None:
        """Take a step the device skipped (a non-finite gradient) back out of the counts."""
        if self.pending is None:
            return
        deferred, index = self.pending
        self.pending = None
        if not deferred.values()[index]:
            counts = self._counts()
            counts[0] -= 1
            counts[1] -= int(deferred.records[index][1])  # type: ignore[index] - set as the step launched
            counts[2] += 1

    def advance(self, momentum: bool) -> tuple[int, int]:
        """Count one step (and one of the momentum's, where the format has one): the new (step, m_step)."""
        if self.pending is not None:
            self.settle()
        counts = self._counts()
        step = int(counts[0]) + 1
        m_step = int(counts[1]) + 1 if momentum else int(counts[1])
        counts[0], counts[1] = step, m_step
        return step, m_step

    @property
    def step(self) -> int:
        """Steps taken (skipped ones not counted)."""
        if self.pending is not None:
            self.settle()
        return int(self._counts()[0])

    @step.setter
    def step(self, value: int) -> None:
        if self.pending is not None:
            self.settle()
        self._counts()[0] = value

    @property
    def m_step(self) -> int:
        """Steps since the momentum was (re)created: its own bias correction."""
        if self.pending is not None:
            self.settle()
        return int(self._counts()[1])

    @m_step.setter
    def m_step(self, value: int) -> None:
        if self.pending is not None:
            self.settle()
        self._counts()[1] = value

    @property
    def nonfinite(self) -> int:
        """Steps skipped because the gradient held inf or NaN."""
        if self.pending is not None:
            self.settle()
        return int(self._counts()[2])

    @nonfinite.setter
    def nonfinite(self, value: int) -> None:
        if self.pending is not None:
            self.settle()
        self._counts()[2] = value


@dataclass
class Pool:
    """The states held in ``format`` on one device: one ``uint8`` segment per member parameter."""

    format: str
    storage_device: torch.device
    segments: dict[Tensor, Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of storage the segments hold."""
        return sum(seg.untyped_storage().nbytes() for seg in self.segments.values())


def device_key(device: torch.device) -> str:
    """The key of a device in the pool table (``"cpu"``, ``"cuda:0"``)."""
    return str(device)


def storage_device(fmt: str, param_device: torch.device, registry: Mapping[str, StateFormat] = FORMATS) -> torch.device:
    """Where a state of ``fmt`` (of ``registry``) lives for a parameter on ``param_device`` (host when offloaded)."""
    return HOST if registry[fmt].offloaded else param_device


class PoolsMixin:
    """Pool building and state conversion of BlockwiseAdamW (see the module docstring)."""

    _records: dict[Tensor, Record]
    _pools: dict[tuple[str, str], Pool]
    _hyper_for: Callable[[Tensor], StepHyper]  # the optimizer's: a parameter's group hyperparameters
    format_registry: Mapping[str, StateFormat]  # the optimizer's formats
    param_groups: list[dict[str, Any]]
    _live_bytes: int  # state bytes allocated on the training devices, transient segments included
    _peak_bytes: int  # the high-water mark of _live_bytes

    def _count_allocated(self, nbytes: int) -> None:
        self._live_bytes += nbytes
        self._peak_bytes = max(self._peak_bytes, self._live_bytes)

    # ------------------------------------------------------------------ accounting

    def state_bytes(self, by_group: bool = False) -> int | list[int]:
        """Bytes of optimizer state held on the training devices.

        Equal to the storage really allocated (every pool counted once, codes, scales and factors
        included). Host-offloaded state of accelerator parameters is not device memory and is
        reported by :meth:`host_state_bytes`; when training runs on the CPU, ``offload`` states are
        on the training device and counted here in full.

        Args:
            by_group: return a list with the bytes of each param group instead of the total.
        """
        return self._bytes(host=False, by_group=by_group)

    def host_state_bytes(self, by_group: bool = False) -> int | list[int]:
        """Bytes of state offloaded to host memory for parameters that train on an accelerator."""
        return self._bytes(host=True, by_group=by_group)

    def _bytes(self, host: bool, by_group: bool) -> int | list[int]:
        per_group = [0] * len(self.param_groups)
        for p, rec in self._records.items():
            if rec.format is None:
                continue
            on_host = storage_device(rec.format, p.device, self.format_registry) != p.device
            if on_host == host:
                per_group[rec.group] += sum(spec.nbytes for spec in self._layout(rec.format, p))
        return per_group if by_group else sum(per_group)

    @property
    def peak_state_bytes(self) -> int:
        """The most state bytes held on the training devices at any moment since construction or
        :meth:`reset_peak_state_bytes`, the transients of conversions and loads included.

        Counted where segments are allocated and released, so it is exact for the state itself;
        the fp32 scratch of a conversion (a few slices of ``chunk_size`` elements) is not state.
        """
        return self._peak_bytes

    def reset_peak_state_bytes(self) -> None:
        """Start :attr:`peak_state_bytes` again from the state held now."""
        self._peak_bytes = self._live_bytes

    def state_tensors(self) -> list[Tensor]:
        """Every tensor of optimizer state (views into the pools), for inspection and tests."""
        return [t for rec in self._records.values() if rec.views for t in rec.views.values()]

    def pool_bytes(self) -> dict[tuple[str, str], int]:
        """(format, parameter device) -> bytes of that pool's storage (its segments, one per parameter)."""
        return {key: pool.nbytes for key, pool in self._pools.items()}

    # ------------------------------------------------------------------ conversion

    def _rebuild(
        self,
        changes: Mapping[Tensor, str],
        sources: Mapping[Tensor, Canonical | dict[str, Tensor] | None] | None = None,
    ) -> None:
        """Move the parameters of ``changes`` to their new formats, one parameter at a time.

        ``sources`` optionally gives a parameter's new state: a :class:`Canonical` to encode, a dict
        of compact tensors to copy (checkpoint), or ``None`` for a fresh zero state. Without a
        source a parameter's current state is converted, in slices. Parameters whose device state
        shrinks go first, then the optimizer's order (which fixes the draws of stochastic rounding).
        Each parameter is committed when its new segment is filled: if a conversion fails, every
        parameter holds a complete state, in its old format or its new one.
        """
        sources = sources or {}
        position = {p: i for i, p in enumerate(self._records)}
        order = sorted(changes, key=lambda p: (self._device_growth(p, changes[p]) > 0, position[p]))
        for p in order:
            fmt, rec = changes[p], self._records[p]
            old = rec.format
            views = self._allocate_segment(fmt, p)
            if p in sources:
                self._fill_from_source(p, fmt, views, sources[p])
            elif old == fmt:
                for k, t in views.items():
                    t.copy_(rec.views[k])
            elif old is not None:
                self._convert_into(p, old, fmt, views)
            self._commit_segment(p, fmt, views)
            if not self.format_registry[fmt].has_momentum:
                rec.m_step = 0

    def _device_growth(self, p: Tensor, fmt: str) -> int:
        """Bytes on ``p``'s device that moving ``p`` to ``fmt`` adds (negative: frees)."""
        old = self._records[p].format

        # a sharded parameter: its largest shard's bytes, the same on every rank, so that every rank
        # converts in the same order (a factored conversion of a shard is a collective)
        shape = largest_shard_shape(p) if is_sharded(p) else local(p).shape

        def on_device(f: str | None) -> int:
            if f is None or storage_device(f, p.device, self.format_registry) != p.device:
                return 0
            return self.format_registry[f].state_bytes(shape)

        return on_device(fmt) - on_device(old)

    def _commit_segment(self, p: Tensor, fmt: str, views: dict[str, Tensor]) -> None:
        """Make ``views`` (one new segment) ``p``'s state; its old segment is released."""
        rec, dev = self._records[p], device_key(p.device)
        if rec.format is not None:
            old_key = (rec.format, dev)
            pool = self._pools.get(old_key)
            if pool is not None:
                released = pool.segments.pop(p, None)
                if released is not None and pool.storage_device == p.device:
                    self._live_bytes -= released.untyped_storage().nbytes()
                if not pool.segments:
                    del self._pools[old_key]
        pool = self._pools.setdefault((fmt, dev), Pool(fmt, storage_device(fmt, p.device, self.format_registry)))
        pool.segments[p] = _segment_of(views)
        self._drop_plans()  # type: ignore[attr-defined] - a plan holds the old views
        rec.views = views
        rec.format = fmt
        self._mark_state(p)

    def _mark_state(self, p: Tensor) -> None:
        """Keep torch's ``optimizer.state`` saying which parameters hold state, and in which format.

        The states live in the pools, not in ``state``; but tools read ``state`` to learn whether an
        optimizer holds any: ``torch.distributed.checkpoint``'s state-dict functions take an empty one
        for a fresh optimizer and step it once with zero gradients to create its states, which here
        would advance the step counts and decay the moments of a trained one.
        """
        fmt = self._records[p].format
        if fmt is None:
            self.state.pop(p, None)  # type: ignore[attr-defined]
        else:
            self.state[p] = {"format": fmt}  # type: ignore[attr-defined]

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
            pools[key] = Pool(key[0], storage_device(key[0], members[key][0].device, self.format_registry))
            for p in members[key]:
                views[p] = self._allocate_segment(key[0], p)
                fill(p, key[0], views[p])
                pools[key].segments[p] = _segment_of(views[p])
        return pools, views

    def _layout(self, fmt: str, p: Tensor) -> tuple[TensorSpec, ...]:
        """The compact tensors of ``p``'s state (of this rank's shard) in ``fmt``."""
        return self.format_registry[fmt].shard_layout(local(p).shape, self._records[p].shard_offset)

    def _allocate_segment(self, fmt: str, p: Tensor) -> dict[str, Tensor]:
        """Zeroed views of ``p``'s state in ``fmt``, carved from one new ``uint8`` buffer (a shard's 8-bit
        states laid out in the whole parameter's groups: :class:`~lightning_baoc.formats.frames.FramedViews`)."""
        layout = self._layout(fmt, p)
        storage = storage_device(fmt, p.device, self.format_registry)
        offsets: dict[str, int] = {}
        total = 0
        for itemsize in (8, 4, 2, 1):  # descending item size: every offset stays aligned
            for spec in layout:
                if spec.nbytes and torch.empty((), dtype=spec.dtype).element_size() == itemsize:
                    offsets[spec.key] = total
                    total += spec.nbytes
        pin = storage.type == "cpu" and self.format_registry[fmt].offloaded and torch.cuda.is_available()
        buffer = torch.zeros(total, dtype=torch.uint8, device=storage, pin_memory=pin)
        if storage == p.device:  # host memory of an accelerator's parameter is not device state
            self._count_allocated(total)
        frame = self._records[p].frame
        views: dict[str, Tensor] = FramedViews(frame) if frame is not None and self.format_registry[fmt].quantized else {}
        for spec in layout:
            if spec.key in offsets:
                start = offsets[spec.key]
                views[spec.key] = buffer[start : start + spec.nbytes].view(spec.dtype)
            else:  # zero-size tensor (empty parameter)
                views[spec.key] = torch.empty(0, dtype=spec.dtype, device=storage)
        return views

    def _convert_into(self, p: Tensor, old: str, new: str, target: dict[str, Tensor]) -> None:
        rec = self._records[p]
        rec.m_step = convert_state(
            self.format_registry[old], rec.views, self.format_registry[new], target, tuple(local(p).shape),
            self._hyper_for(p), None if p.grad is None else local(p.grad), rec.m_step, rec.row_shards,
            _agreement(p),
        )

    def _encode(self, p: Tensor, fmt: str, canonical: Canonical, target: dict[str, Tensor]) -> None:
        rec = self._records[p]
        hyper = self._hyper_for(p)
        if self.format_registry[fmt].has_momentum and canonical.exp_avg is None:
            grad = None if p.grad is None else local(p.grad)
            finite = grad is not None and bool(torch.isfinite(grad).all())
            agree = _agreement(p)
            finite = agree(finite) if agree is not None and hyper.rule == "adamw" else finite
            if hyper.rule == "adamw" and finite:
                # re-create the momentum as one EMA step of the current gradient; its own bias
                # correction (m_step = 1) makes m_hat equal that gradient
                canonical.exp_avg = grad.detach().to(torch.float32).mul(1.0 - hyper.beta1)
                rec.m_step = 1
            else:
                canonical.exp_avg = torch.zeros(local(p).shape, dtype=torch.float32, device=p.device)
                rec.m_step = 0
        canonical.shards = rec.row_shards  # a shard's rows: factored forms over every rank's rows
        self.format_registry[fmt].encode(canonical, target, hyper)

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


def _agreement(p: Tensor) -> Callable[[bool], bool] | None:
    """For a sharded ``p``: the finding of every shard from this one's (all must hold; a collective)."""
    if not is_sharded(p):
        return None

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=local(p).device)  # NCCL: on the device
        mesh_min(flag, [p])
        return bool(flag.item())

    return agree


def _segment_of(views: Mapping[str, Tensor]) -> Tensor:
    """A view of the buffer a parameter's views were carved from (its storage is the segment)."""
    for t in views.values():
        if t.numel():
            return t
    return torch.empty(0, dtype=torch.uint8)
