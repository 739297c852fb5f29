"""The GPU's step of one param group, planned once and replayed: the host's work per tensor cut to a few reads.

On a GPU the kernels of a step take a fraction of a millisecond; what the host does per tensor to launch
them (decide which kernel serves it, read its states' addresses, build its row of the launch's table,
compute its rounding key) took tens of microseconds per tensor in Python, most of the step
(``docs/benchmarks/step-time.md``). A :class:`DevicePlan` does that work once for the tensors of a
param group whose skips the device decides (:meth:`StepDispatcher.decided_on_device
<lightning_baoc.optim.stepping.StepDispatcher.decided_on_device>`): the Triton kernels' non-factored formats
(:class:`~lightning_baoc.kernels.triton_table.Table`) and torch's fused kernel for fp32 tensors. Each step
then checks that nothing the plan read has changed, advances the counts, and fills the columns that
change (the gradients' addresses, the skip flags', the rounding keys and the step sizes, with numpy
over all rows at once). The results are those of the unplanned step, bit for bit
(``tests/optim/test_device_plan.py``).

A plan holds the tensors it read (the states' views, the corrections): the step drops its plans
whenever a parameter's states or correction are replaced (a conversion, a load), so that no plan keeps
an old state alive past it, and a plan whose tensors are not the records' any more is rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_baoc.formats import StepHyper
from lightning_baoc.formats.fused_adam import MAX_FUSED_STEP, fused_call, shaped
from lightning_baoc.formats.quant import M_SCALE_MAX, V_SCALE_MAX, stream_keys
from lightning_baoc.kernels import M_NONE
from lightning_baoc.optim.pools import DeferredFlags, Record

_M32 = 0xFFFFFFFF


class CountsStore:
    """The step counts of an optimizer's records as the rows of one host array, so that a device plan
    advances all of its tensors' counts with one numpy operation.

    A record's ``counts`` tensor is its row (a view: the compiled step, the getters and checkpoints read
    and write it as before). Records that are not rows yet (new, or made by a load) join at a plan's
    build: the array is made again with every current record of the optimizer, each rebound to its new
    row, so the plans built before see their records' counts changed and are built again. The store
    holds no record (the ids and the rows it gave), so a record dropped by a load frees its states.
    """

    def __init__(self) -> None:
        self.array: np.ndarray = np.zeros((0, 3), dtype=np.int64)
        self._views: list[Tensor] = []  # each row as the tensor its record holds
        self._rows: dict[int, int] = {}  # id of a record -> its row

    def _row(self, rec: Record) -> int | None:
        row = self._rows.get(id(rec))
        return row if row is not None and rec.counts is self._views[row] else None

    def rows(self, records: list[Record], every: Iterable[Record]) -> tuple[np.ndarray, np.ndarray]:
        """The array and the rows of ``records`` in it; where one is not a row yet, the array is made again
        from ``every`` record of the optimizer (``records`` among them) and each is rebound to its row."""
        rows = [self._row(rec) for rec in records]
        if None in rows:
            members = list({id(rec): rec for rec in [*every, *records]}.values())
            for rec in members:
                rec.apply_device_skip()  # a skip decided on the device, taken back before the counts move
            counts = torch.stack([rec.counts for rec in members]) if members else torch.zeros(0, 3, dtype=torch.int64)
            self.array, self._views = counts.numpy(), list(counts.unbind())
            self._rows = {id(rec): i for i, rec in enumerate(members)}
            for rec, view in zip(members, self._views):
                rec.use_counts(view)
            rows = [self._rows[id(rec)] for rec in records]
        return self.array, np.array(rows, dtype=np.int64)


@dataclass(eq=False)
class _Entry:
    """One tensor of a plan and what the plan read of it."""

    param: Tensor
    rec: Record
    format: str
    views: dict[str, Tensor]
    correction: Tensor | None
    address: int  # the parameter's data
    grad_dtype: torch.dtype
    has_momentum: bool
    salt: int
    fused: bool  # torch's fused kernel (fp32), else the Triton kernel
    moments: tuple[Tensor, Tensor] | None = None  # fused: the moments in the parameter's shape
    launch: _Launch | None = None  # the launch of its format and device (fused: the repair's)
    row: int = 0  # its row in that launch's table
    counts: Tensor | None = None  # its record's counts as planned: a row of the CountsStore's array


@dataclass(eq=False)
class _Launch:
    """The tensors of one format, device and kernel (torch's fused or Triton's): their table (and a factored
    format's work)."""

    table: Any  # kernels.triton_table.Table
    work: Any = None  # a factored format's kernels.triton_factored.FactoredWork


class DevicePlan:
    """The tensors of one param group whose skips the device decides, planned for their step.

    ``routes``: each parameter's route from :meth:`StepDispatcher._device_route
    <lightning_baoc.optim.stepping.StepDispatcher._device_route>` (``"fused"``, ``"triton"`` or ``None``);
    ``conditions``: what the routes were decided under (the optimizer's policy and the group's rule), checked
    at every step. ``records``, ``registry``: the optimizer's records table and formats; ``salt(rec)``: the
    hash of a record's name in its rounding keys; ``counts``: the optimizer's :class:`CountsStore`.
    """

    def __init__(
        self, params: list[Tensor], routes: list[str | None], conditions: tuple, records: Mapping[Tensor, Record],
        registry: Mapping[str, Any], salt: Callable[[Record], int], counts: CountsStore,
    ) -> None:
        # lazy: the Triton step imports triton, an optional dependency
        from lightning_baoc.kernels.triton_table import Table

        self.conditions = conditions
        self.entries: list[_Entry] = []
        self.others: list[tuple[Tensor, Record]] = []  # the parameters (and records) it leaves to the unplanned step
        # one launch per format, device and kernel: torch's fused kernel takes the fp32 weights of the fp32 format,
        # the Triton kernel its 16-bit ones (a group mixes them in any order), so no launch decides from one entry
        by_launch: dict[tuple[str, torch.device, bool], list[_Entry]] = {}
        for p, route in zip(params, routes):
            rec = records[p]
            fmt = registry[rec.format]
            if route is None:
                self.others.append((p, rec))
                continue
            entry = _Entry(p, rec, rec.format, rec.views, rec.master_correction, p.data_ptr(), p.grad.dtype,
                           fmt.has_momentum, salt(rec), route == "fused")
            if entry.fused:  # and a table for the Triton kernel's repair
                entry.moments = (shaped(rec.views["exp_avg"], p), shaped(rec.views["exp_avg_sq"], p))
            by_launch.setdefault((rec.format, p.device, entry.fused), []).append(entry)
            self.entries.append(entry)
        # the entries' counts are rows of the optimizer's one host array (CountsStore): a step advances
        # them all with one numpy operation
        self.array, self.index = counts.rows([e.rec for e in self.entries], records.values())
        for e in self.entries:
            e.counts = e.rec.counts
        self.momentum = np.array([e.has_momentum for e in self.entries], dtype=np.int64)
        # what each entry's rounding key and step size read of it (step_columns): its name's hash, its shard's
        # offset, whether its launch steps a momentum (its step size divides by bias_correction1)
        self.salts = np.array([e.salt & _M32 for e in self.entries], dtype=np.uint64)
        self.offsets = np.array([e.rec.shard_offset for e in self.entries], dtype=np.uint64)
        self.has_m = np.array([registry[e.format].kernel_kinds[0] != M_NONE for e in self.entries], dtype=np.int64)
        self.fused = np.array([i for i, e in enumerate(self.entries) if e.fused], dtype=np.int64)
        self.every = np.arange(len(self.entries), dtype=np.int64)
        for (name, _, _), entries in by_launch.items():
            table = Table(registry[name].kernel_kinds, [e.param for e in entries],
                          [e.grad_dtype for e in entries], [e.views for e in entries], [e.correction for e in entries])
            launch = _Launch(table)
            if registry[name].factored:  # the second moment's vectors and factors: two launches for all of them
                # lazy: the Triton step imports triton, an optional dependency
                from lightning_baoc.kernels.triton_factored import FactoredWork

                launch.work = FactoredWork([e.param for e in entries], [e.grad_dtype for e in entries],
                                           [e.views for e in entries], [e.correction for e in entries])
            for row, e in enumerate(entries):
                e.launch, e.row = launch, row

    def select(self, conditions: tuple) -> tuple[Chosen, list[tuple[Tensor, Record]]] | None:
        """The entries that step on the device this step, and the parameters (with their records) left to
        the unplanned step (the plan's others, and fp32 tensors whose counts the fused kernel cannot take); ``None`` where
        the plan is out of date (its conditions, a record's states or counts, a parameter's data or a
        gradient's dtype or layout changed): build it again."""
        if conditions != self.conditions:
            return None
        for e in self.entries:
            p, rec = e.param, e.rec
            grad = p.grad
            if (rec.counts is not e.counts or rec.views is not e.views or rec.master_correction is not e.correction
                    or rec.format != e.format or p.data_ptr() != e.address or grad.dtype != e.grad_dtype
                    or not grad.is_contiguous()):
                return None
            if rec.unread_skip is not None:  # a guard: the step's start applies every unread skip, and one left
                rec.apply_device_skip()  # here would be lost when this step sets its own
        rows, entries, others = self.every, self.entries, self.others
        if len(self.fused):  # the fused kernel's one count: where it cannot take them, the host decides
            counts = self.array[self.index[self.fused]]
            held = self.fused[(counts[:, 0] != counts[:, 1]) | (counts[:, 0] >= MAX_FUSED_STEP)]
            if len(held):
                rows = np.setdiff1d(self.every, held)
                entries = [self.entries[i] for i in rows.tolist()]
                others = others + [(self.entries[i].param, self.entries[i].rec) for i in held.tolist()]
        return Chosen(self, rows, entries), others


@dataclass(eq=False)
class Chosen:
    """The entries of a plan that step on the device this step (``rows``: their indices in the plan, ascending)."""

    plan: DevicePlan
    rows: np.ndarray
    entries: list[_Entry]

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def params(self) -> list[Tensor]:
        return [e.param for e in self.entries]

    def step(self, hyper: StepHyper, seed: int, flags: list[tuple[DeferredFlags, int, Tensor]],
             tensor_lr: bool = False) -> None:
        """Step the entries with their flags (``flags``: each entry's, in order, from
        :meth:`StepDispatcher._device_flags <lightning_baoc.optim.stepping.StepDispatcher._device_flags>`):
        their counts advance now (one numpy operation over the plan's counts), a skip is applied when next
        read (:class:`~lightning_baoc.optim.pools.DeferredFlags`). One launch per format, device and kernel: the
        Triton kernel's (:meth:`Table.launch <lightning_baoc.kernels.triton_table.Table.launch>`), or for
        fp32 tensors torch's fused kernel, then the Triton kernel where it skipped any (``repair``).
        ``tensor_lr``: the fused kernel reads the learning rate from an fp32 tensor, as under a CUDA graph
        (:mod:`lightning_baoc.optim.graph_step`), so that the two steps are the same bits."""
        plan, rows = self.plan, self.rows
        array, at = plan.array, plan.index[rows]
        array[at, 0] += 1
        array[at, 1] += plan.momentum[rows]
        counts = array[at, :2]
        columns = step_columns(seed, counts, plan.has_m[rows], np.zeros(len(rows), dtype=np.int64), [hyper], [hyper.lr],
                               plan.salts[rows], plan.offsets[rows])
        entries = self.entries
        indices = []
        launches: dict[_Launch, tuple[list[int], Tensor]] = {}  # by launch: its entries (indices) and the device's flags
        for k, (e, (deferred, index, skip)) in enumerate(zip(entries, flags)):
            deferred.records[index] = (e.rec, e.has_momentum)
            e.rec.unread_skip = (deferred, index)
            indices.append(index)
            launches.setdefault(e.launch, ([], skip))[0].append(k)  # type: ignore[arg-type] - set for every entry
        run = _Step(columns, counts[:, 0], hyper, np.array(indices, dtype=np.int64))
        for launch, (members, skip) in launches.items():
            launched = [entries[k] for k in members]
            if launch.work is not None:  # factored: the vectors and factors first, into this step's buffers
                arguments = run.launch_arguments(launched, members, skip)
                work = launch.work
                buffers = work.buffers()
                sums, finish = work.tables([e.param.grad.data_ptr() for e in launched], arguments[5],
                                           run.columns[np.array(members, dtype=np.int64), 4], hyper)
                work.launch(sums, finish, buffers, hyper)
                launch.table.launch(*arguments, factors=work.factors(buffers))
                continue
            if not launched[0].fused:
                launch.table.launch(*run.launch_arguments(launched, members, skip))
                continue
            # fp32 tensors of one device: one call of torch's fused kernel, skipped whole where any flag of the
            # device is set; then the Triton kernel steps the finite ones where it was, as the unplanned step does.
            # A tensor alone takes its own flag, with nothing to repair.
            found_inf = run.found_inf(members, skip)
            fused_call(*run.fused_arguments(launched, members), found_inf, tensor_lr)
            if len(launched) > 1:
                launch.table.launch(*run.launch_arguments(launched, members, skip), found_inf)


class _Step:
    """What the launches of one plan's step share: each entry's per-step columns (:func:`step_columns`), its
    step count and its index in its device's skip flags (``indices``); the arguments of each launch."""

    def __init__(self, columns: np.ndarray, steps: np.ndarray, hyper: StepHyper, indices: np.ndarray) -> None:
        self.columns, self.steps, self.hyper, self.indices = columns, steps, hyper, indices

    def launch_arguments(self, entries: list[_Entry], members: list[int], skip: Tensor) -> tuple:
        """The arguments of the Triton launch of ``entries`` (rows of one table, in its order; ``members``:
        their indices in the step; ``skip``: their device's skip flags) but its ``repair``."""
        launch = entries[0].launch
        assert launch is not None  # every entry has its launch
        select = None if len(entries) == len(launch.table.kind) else np.array([e.row for e in entries], dtype=np.int64)
        which = np.array(members, dtype=np.int64)
        columns = self.columns[which]
        flags = skip.data_ptr() + 4 * self.indices[which]  # fp32 elements of the device's flags
        return (self.hyper, M_SCALE_MAX, V_SCALE_MAX, entries[0].param.device, [e.param.grad.data_ptr() for e in entries],
                flags, columns[:, 0], columns[:, 1:3], columns[:, 3], select)

    def found_inf(self, members: list[int], skip: Tensor) -> Tensor:
        """The flag torch's fused kernel skips on: a tensor alone's own, else any tensor's of the device (a
        superset of these: still exact, the Triton kernel repairs the finite ones)."""
        if len(members) == 1:
            index = int(self.indices[members[0]])
            return skip[index : index + 1]
        return skip.amax().view(1)

    def fused_arguments(self, entries: list[_Entry], members: list[int]) -> tuple:
        """The arguments of torch's fused kernel over ``entries`` (fp32 tensors of one device) but its ``found_inf``."""
        moments = [e.moments for e in entries]
        return (entries[0].param.device, [e.param for e in entries], [e.param.grad for e in entries],
                [m for m, _ in moments], [v for _, v in moments],  # type: ignore[misc] - set for fused entries
                self.steps[np.array(members, dtype=np.int64)].tolist(), self.hyper)


def step_columns(seed: int, counts: np.ndarray, has_m: np.ndarray, group_of: np.ndarray, hypers: list[StepHyper],
                 lrs: list[float], salts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each row's per-step columns of its launch's table (int64 ``[rows, 5]``): its rounding key (sign-extended
    32 bits), the fp32 bits of its step size and of its ``1 / sqrt(bias_correction2)``, of the decay factor and of
    its ``bias_correction2`` (a factored format's factors divide by it). ``counts``: each row's (step, m_step), as
    the step takes them; ``has_m``: whether its format steps a momentum; ``group_of``: its group, an index into
    ``hypers`` and ``lrs``; ``salts``, ``offsets``: its name's hash and its shard's offset. The planned step and
    the CUDA graph step (:mod:`lightning_baoc.optim.graph_step`) both take their columns here: one Python
    computation per distinct (step, m_step, momentum, group), numpy over the rows."""
    # lazy: the Triton step imports triton, an optional dependency
    from lightning_baoc.kernels.triton_step import _float_bits, decay_bits, step_scalars

    rows = np.stack([counts[:, 0], counts[:, 1], has_m, group_of], axis=1)
    if len(rows) and (rows == rows[0]).all():  # the common step: every row shares one
        distinct, pair_of = rows[:1], np.zeros(len(rows), dtype=np.int64)
    else:
        distinct, pair_of = np.unique(rows, axis=0, return_inverse=True)
        pair_of = pair_of.reshape(-1)
    steps, bits = [], []
    for s, m, momentum, group in distinct.tolist():
        hyper = hypers[group]
        bc1 = 1.0 - hyper.beta1**m if m else 1.0
        bc2 = 1.0 - hyper.beta2**s
        steps.append(s)
        bits.append((*step_scalars(bc1, bc2, bool(momentum), lrs[group]), decay_bits(hyper), _float_bits(bc2)))
    keys = ((stream_keys(seed, steps, salts, pair_of) + offsets) & np.uint64(_M32)).astype(np.int64)
    out = np.empty((len(rows), 5), dtype=np.int64)
    out[:, 0] = np.where(keys >= 1 << 31, keys - (1 << 32), keys)
    out[:, 1:] = np.array(bits, dtype=np.int64).reshape(-1, 4)[pair_of]
    return out
