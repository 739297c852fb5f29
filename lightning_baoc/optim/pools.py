"""The optimizer's states: per-parameter records, and one pool per format and device.

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

:class:`Record` is one parameter's book-keeping (name, group, format, views, counts, correction), in the
records table every part of the optimizer shares; :class:`StatePools` holds the pools and their
accounting, and converts.
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
from lightning_baoc.optim.convert import StateSlices, convert_state
from lightning_baoc.optim.placement import Placements
from lightning_baoc.optim.sharding import is_sharded, local, mesh_min

HOST = torch.device("cpu")


class DeferredFlags:
    """Which parameters of one step had a finite gradient, decided on their device and read later.

    The CUDA step launches its kernels without reading the gradients' finiteness: each kernel reads
    its parameter's flag on the device and skips the update where it is 0, while the host advances the
    parameter's counts as if it stepped. The flags travel to pinned host memory behind the step (a
    copy that does not wait), and :meth:`Record.apply_device_skip` takes a skipped step back out of the
    counts when a count is next read: at the next step, by which time the copy is done, or at a checkpoint.
    """

    #: read once, then forgotten by each record (a captured step's flags stay: graph_step.GraphSkips)
    persistent = False

    def __init__(self, skip: Tensor, size: int, found_inf: Tensor | None = None) -> None:
        #: (record, whether its format had a momentum) of each flag, set as the step launches
        self.records: list[tuple[Record, bool] | None] = [None] * size
        # AMP's scaler's found_inf (optim/amp.py), where it handed one: set, the whole step was skipped, which is
        # no parameter's non-finite skip; copied beside the flags
        self._found: Tensor | None = None
        if skip.device.type == "cuda":
            self._host = torch.empty(skip.shape, dtype=skip.dtype, pin_memory=True)
            self._host.copy_(skip, non_blocking=True)
            if found_inf is not None:
                self._found = torch.empty(1, dtype=found_inf.dtype, pin_memory=True)
                self._found.copy_(found_inf.reshape(1), non_blocking=True)
            self._event: Any = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event, self._found = skip, None, found_inf
        self._values: Any = None
        self._scaler_skip = False

    @property
    def scaler_skipped(self) -> bool:
        """Whether AMP's scaler skipped the whole step (its ``found_inf``): counts taken back, nothing counted."""
        self.values()
        return self._scaler_skip

    def values(self) -> Any:
        """Whether each parameter stepped (its gradient was finite), a host array: waits for the copy
        of the skip flags (``skip``: nonzero where the kernel skipped) only if it is not done yet."""
        if self._values is None:
            if self._event is not None and not self._event.query():
                self._event.synchronize()
            self._scaler_skip = self._found is not None and bool(self._found.reshape(()).item() != 0)
            self._values = self._host.numpy() == 0
        return self._values

    def skipped(self) -> list[Record]:
        """The records whose update was skipped, each record's device skip applied to its counts."""
        flags = self.values()
        if flags.all():  # the common step: nothing to take back, each record's unread skip forgotten
            for entry in self.records:
                if entry is not None and entry[0].unread_skip is not None and entry[0].unread_skip[0] is self:
                    entry[0].unread_skip = None
            return []
        out = []
        for i, entry in enumerate(self.records):
            if entry is not None:
                entry[0].apply_device_skip()
                if not flags[i]:
                    out.append(entry[0])
        return [] if self.scaler_skipped else out  # a step the scaler skipped is no parameter's to warn of


@dataclass
class Record:
    """Book-keeping of one parameter (never checkpointed as is: see ``state_dict``).

    The step counts live in ``counts``, a host int64 tensor ``[step, m_step, nonfinite]`` that the
    compiled step advances itself (it decides which parameters step, so the optimizer never reads
    a count to launch it); ``step``, ``m_step`` and ``nonfinite`` read and write it, after applying a
    skip the device decided that the host has not read yet (``unread_skip``: :class:`DeferredFlags`).
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
    #: the last step's skip, decided on the device and not read yet: (the step's flags, this record's index in them)
    unread_skip: tuple[DeferredFlags, int] | None = None
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

    def apply_device_skip(self) -> None:
        """Read the skip the device decided (:attr:`unread_skip`): a step it skipped (a non-finite gradient)
        is taken back out of the counts."""
        if self.unread_skip is None:
            return
        deferred, index = self.unread_skip
        if deferred.persistent:  # a captured step's flags (optim/graph_step.py): all its records' at once
            deferred.apply()
            return
        self.unread_skip = None
        if not deferred.values()[index]:
            counts = self._counts()
            counts[0] -= 1
            counts[1] -= int(deferred.records[index][1])  # type: ignore[index] - set as the step launched
            counts[2] += int(not deferred.scaler_skipped)  # AMP's scaler's skip is no non-finite gradient's

    def advance(self, momentum: bool) -> tuple[int, int]:
        """Count one step (and one of the momentum's, where the format has one): the new (step, m_step)."""
        if self.unread_skip is not None:
            self.apply_device_skip()
        counts = self._counts()
        step = int(counts[0]) + 1
        m_step = int(counts[1]) + 1 if momentum else int(counts[1])
        counts[0], counts[1] = step, m_step
        return step, m_step

    @property
    def step(self) -> int:
        """Steps taken (skipped ones not counted)."""
        if self.unread_skip is not None:
            self.apply_device_skip()
        return int(self._counts()[0])

    @step.setter
    def step(self, value: int) -> None:
        if self.unread_skip is not None:
            self.apply_device_skip()
        self._counts()[0] = value

    @property
    def m_step(self) -> int:
        """Steps since the momentum was (re)created: its own bias correction."""
        if self.unread_skip is not None:
            self.apply_device_skip()
        return int(self._counts()[1])

    @m_step.setter
    def m_step(self, value: int) -> None:
        if self.unread_skip is not None:
            self.apply_device_skip()
        self._counts()[1] = value

    @property
    def nonfinite(self) -> int:
        """Steps skipped because the gradient held inf or NaN."""
        if self.unread_skip is not None:
            self.apply_device_skip()
        return int(self._counts()[2])

    @nonfinite.setter
    def nonfinite(self, value: int) -> None:
        if self.unread_skip is not None:
            self.apply_device_skip()
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


class StatePools:
    """The states of an optimizer's parameters: their pools, the bytes they hold, and conversions.

    Holds: the pools (:attr:`pools`, (format, device) -> :class:`Pool`, one segment per parameter), the
    state bytes allocated on the training devices now and at their high-water mark (:attr:`live_bytes`,
    :attr:`peak_bytes`, transient segments included).

    Needs: the records table (parameter -> :class:`Record`, shared with the optimizer; a record's
    ``format`` and ``views`` are written here, its ``shard_offset``, ``frame`` and ``row_shards`` read),
    the format registry, ``on_replace``, called before a parameter's state tensors are replaced
    (the step's device plans hold them: ``StepDispatcher.forget_plans``), and the optimizer's
    :class:`~lightning_baoc.optim.placement.Placements` (the shape whose bytes order conversions, the
    same on every rank). Conversions take the parameter's hyperparameters (``hyper_for(p)``: the slice
    size, its momentum's beta, the rounding key) from their caller.

    Example:
        >>> records = {p: Record(name="w", group=0)}  # doctest: +SKIP
        >>> pools = StatePools(records, FORMATS)  # doctest: +SKIP
        >>> pools.rebuild({p: "int8"}, hyper_for)  # a fresh zero state  # doctest: +SKIP
        >>> pools.held_bytes(host=False)  # {group: bytes}  # doctest: +SKIP
    """

    def __init__(
        self,
        records: dict[Tensor, Record],
        registry: Mapping[str, StateFormat],
        on_replace: Callable[[], None] = lambda: None,
        placements: Placements | None = None,
    ) -> None:
        self.records = records
        self.registry = registry
        self.on_replace = on_replace
        self.placements = Placements() if placements is None else placements
        self.pools: dict[tuple[str, str], Pool] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    # ------------------------------------------------------------------ accounting

    def holds_offloaded(self) -> bool:
        """Whether any parameter's state is in an offloaded format (a look at the pools, not the parameters)."""
        return any(self.registry[fmt].offloaded for fmt, _ in self.pools)

    def count_allocated(self, nbytes: int) -> None:
        """Count ``nbytes`` of state allocated (negative: released) on a training device."""
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def held_bytes(self, host: bool) -> dict[int, int]:
        """Param group index -> bytes of state its parameters hold on the training devices (``host``: the
        bytes offloaded to host memory for parameters that train on an accelerator instead)."""
        per_group: dict[int, int] = defaultdict(int)
        for p, rec in self.records.items():
            if rec.format is None:
                continue
            on_host = storage_device(rec.format, p.device, self.registry) != p.device
            if on_host == host:
                per_group[rec.group] += sum(spec.nbytes for spec in self.layout(rec.format, p))
        return per_group

    def recount(self) -> None:
        """Set :attr:`live_bytes` to the bytes the records' states hold on the training devices (after a
        load replaced every pool)."""
        self.live_bytes = sum(self.held_bytes(host=False).values())

    def reset_peak(self) -> None:
        """Start :attr:`peak_bytes` again from the state held now."""
        self.peak_bytes = self.live_bytes

    def state_tensors(self) -> list[Tensor]:
        """Every tensor of state (views into the pools)."""
        return [t for rec in self.records.values() if rec.views for t in rec.views.values()]

    def pool_bytes(self) -> dict[tuple[str, str], int]:
        """(format, parameter device) -> bytes of that pool's storage (its segments, one per parameter)."""
        return {key: pool.nbytes for key, pool in self.pools.items()}

    def decode(self, p: Tensor) -> Canonical | None:
        """``p``'s state decoded to fp32 (of a shard: this rank's; ``None`` before it holds one)."""
        rec = self.records[p]
        if rec.format is None:
            return None
        fmt = self.registry[rec.format]
        state = fmt.decode(rec.views, local(p).shape)
        state.shards = rec.row_shards if fmt.factored else None
        return state

    def slices(self, p: Tensor, chunk: int, shards: Any = None) -> StateSlices | None:
        """``p``'s state read in fp32 slices of ``chunk`` elements (``None`` before it holds one);
        ``shards``: read a factored state of a shard over the whole parameter's rows (:class:`StateSlices`)."""
        rec = self.records[p]
        if rec.format is None:
            return None
        fmt = self.registry[rec.format]
        return StateSlices(fmt, rec.views, tuple(local(p).shape), chunk, shards)

    # ------------------------------------------------------------------ conversion

    def rebuild(
        self,
        changes: Mapping[Tensor, str],
        hyper_for: Callable[[Tensor], StepHyper],
        on_commit: Callable[[Tensor], None] = lambda p: None,
    ) -> None:
        """Move the parameters of ``changes`` to their new formats, one parameter at a time.

        A parameter without a state yet starts from a zero state; one that holds a state has it
        converted, in slices (``hyper_for(p)``: its hyperparameters, keyed for the rounding of the
        conversion). Parameters whose device state shrinks go first, then the records' order (which fixes
        the draws of stochastic rounding). Each parameter is committed when its new segment is filled
        (then ``on_commit(p)`` is called): if a conversion fails, every parameter holds a complete state,
        in its old format or its new one.
        """
        position = {p: i for i, p in enumerate(self.records)}
        order = sorted(changes, key=lambda p: (self._device_growth(p, changes[p]) > 0, position[p]))
        for p in order:
            fmt, rec = changes[p], self.records[p]
            old = rec.format
            views = self.allocate_segment(fmt, p)
            if old == fmt:
                for k, t in views.items():
                    t.copy_(rec.views[k])
            elif old is not None:
                rec.m_step = convert_state(
                    self.registry[old], rec.views, self.registry[fmt], views, tuple(local(p).shape), hyper_for(p),
                    None if p.grad is None else local(p.grad), rec.m_step, rec.row_shards, _agreement(p),
                )
            self._commit_segment(p, fmt, views)
            on_commit(p)
            if not self.registry[fmt].has_momentum:
                rec.m_step = 0

    def _device_growth(self, p: Tensor, fmt: str) -> int:
        """Bytes on ``p``'s device that moving ``p`` to ``fmt`` adds (negative: frees)."""
        old = self.records[p].format
        # a sharded parameter or a fragment: bytes the same on every rank, so that every rank converts in the
        # same order (a factored or 8-bit conversion of a shard is a collective)
        shape = self.placements.ordering_shape(p)

        def on_device(f: str | None) -> int:
            if f is None or storage_device(f, p.device, self.registry) != p.device:
                return 0
            return self.registry[f].state_bytes(shape)

        return on_device(fmt) - on_device(old)

    def _commit_segment(self, p: Tensor, fmt: str, views: dict[str, Tensor]) -> None:
        """Make ``views`` (one new segment) ``p``'s state; its old segment is released."""
        rec, dev = self.records[p], device_key(p.device)
        if rec.format is not None:
            old_key = (rec.format, dev)
            pool = self.pools.get(old_key)
            if pool is not None:
                released = pool.segments.pop(p, None)
                if released is not None and pool.storage_device == p.device:
                    self.live_bytes -= released.untyped_storage().nbytes()
                if not pool.segments:
                    del self.pools[old_key]
        pool = self.pools.setdefault((fmt, dev), Pool(fmt, storage_device(fmt, p.device, self.registry)))
        pool.segments[p] = _segment_of(views)
        self.on_replace()  # a plan holds the old views
        rec.views = views
        rec.format = fmt

    def fresh(
        self, formats: Mapping[Tensor, str], fill: Callable[[Tensor, str, dict[str, Tensor]], None]
    ) -> tuple[dict[tuple[str, str], Pool], dict[Tensor, dict[str, Tensor]]]:
        """New pools for ``formats`` (parameter -> format), each view filled by ``fill``.

        Touches no record and no existing pool (their allocation is counted): a caller commits the
        result with :meth:`install` only once every fallible step (allocation, filling) is done.
        """
        members: dict[tuple[str, str], list[Tensor]] = defaultdict(list)
        for p in self.records:  # the records' order, as in rebuild
            if p in formats:
                members[(formats[p], device_key(p.device))].append(p)
        pools: dict[tuple[str, str], Pool] = {}
        views: dict[Tensor, dict[str, Tensor]] = {}
        for key in sorted(members):  # sorted: encoding order draws rounding offsets deterministically
            pools[key] = Pool(key[0], storage_device(key[0], members[key][0].device, self.registry))
            for p in members[key]:
                views[p] = self.allocate_segment(key[0], p)
                fill(p, key[0], views[p])
                pools[key].segments[p] = _segment_of(views[p])
        return pools, views

    def install(self, pools: dict[tuple[str, str], Pool]) -> None:
        """Make ``pools`` (from :meth:`fresh`) the pools, the old ones released; the caller points the
        records at their views, then calls :meth:`recount`."""
        self.pools = pools
        self.on_replace()  # a plan holds the old views

    def layout(self, fmt: str, p: Tensor) -> tuple[TensorSpec, ...]:
        """The compact tensors of ``p``'s state (of this rank's shard) in ``fmt``."""
        return self.registry[fmt].shard_layout(local(p).shape, self.records[p].shard_offset)

    def allocate_segment(self, fmt: str, p: Tensor) -> dict[str, Tensor]:
        """Zeroed views of ``p``'s state in ``fmt``, carved from one new ``uint8`` buffer (a shard's 8-bit
        states laid out in the whole parameter's groups: :class:`~lightning_baoc.formats.frames.FramedViews`)."""
        layout = self.layout(fmt, p)
        storage = storage_device(fmt, p.device, self.registry)
        offsets: dict[str, int] = {}
        total = 0
        for itemsize in (8, 4, 2, 1):  # descending item size: every offset stays aligned
            for spec in layout:
                if spec.nbytes and torch.empty((), dtype=spec.dtype).element_size() == itemsize:
                    offsets[spec.key] = total
                    total += spec.nbytes
        pin = storage.type == "cpu" and self.registry[fmt].offloaded and torch.cuda.is_available()
        buffer = torch.zeros(total, dtype=torch.uint8, device=storage, pin_memory=pin)
        if storage == p.device:  # host memory of an accelerator's parameter is not device state
            self.count_allocated(total)
        frame = self.records[p].frame
        views: dict[str, Tensor] = FramedViews(frame) if frame is not None and self.registry[fmt].quantized else {}
        for spec in layout:
            if spec.key in offsets:
                start = offsets[spec.key]
                views[spec.key] = buffer[start : start + spec.nbytes].view(spec.dtype)
            else:  # zero-size tensor (empty parameter)
                views[spec.key] = torch.empty(0, dtype=spec.dtype, device=storage)
        return views


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
