"""The step of :meth:`BlockwiseAdamW.step <lightning_baoc.optim.BlockwiseAdamW.step>`: each parameter sent to the
backend of its format and device, each backend's entry called by :meth:`StepDispatcher.step` itself.

- **Compiled CPU kernels** (:func:`~lightning_baoc.kernels.compiled.compiled_step`, one call per param group and
  format): the kernel tests each gradient for inf and NaN, advances the step counts or counts the skip, and says
  which it skipped, so nothing is read from a tensor to launch it.
- **The device's kernels** on a GPU: the Triton kernels (:mod:`lightning_baoc.kernels.triton_step`) and torch's
  fused AdamW read each gradient's finiteness flag on the device (:meth:`StepDispatcher._device_flags`; fp32
  takes one fused call whose ``found_inf`` is the flag of any, then the Triton kernel steps the finite ones
  where it was set): the host advances the counts as if the step happened and applies a skip when a count is
  next read (:class:`~lightning_baoc.optim.pools.DeferredFlags`), so it reads nothing to launch them. The host's
  work of those steps is planned once per param group and replayed (:mod:`lightning_baoc.optim.device_plan`).
- **The eager step** (each format's ``update``, the reference) for every other parameter (a policy of
  ``"eager"``, no compiler, a format without kernels): the host reads which gradients are finite
  (:meth:`StepDispatcher.finite_mask`, one synchronisation per device and step), advances the counts, computes
  the bias corrections and the rounding key.

So the arithmetic is at most four calls from ``step()``: ``step()`` -> :meth:`StepDispatcher.step` -> the
backend's entry (``compiled_step``, ``Chosen.step``, :meth:`StepDispatcher._device_step`, ``StateFormat.update``)
-> the kernel or the format's math (``tests/optim/test_stepping.py`` measures it for every format and backend).
The compiled operator is itself the loop over the super-blocks: it picks its format's ``superblock`` function
once per call (``superblock_steps_for`` in ``cpu_step.cpp``) and runs it on each super-block of its tensors.
The routing (:meth:`StepDispatcher._route`, :meth:`StepDispatcher._prepare`) carries each parameter's record
along with it, in lists, so the host looks each parameter up once per step. All of it works on each
parameter's local part (the shard of a ``DTensor`` parameter on this rank: :mod:`lightning_baoc.optim.sharding`).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from lightning_baoc.formats import StateFormat, StepHyper, StepItem
from lightning_baoc.formats.correction import reconstruct, split_into
from lightning_baoc.formats.frames import framed
from lightning_baoc.formats.fused_adam import (
    MAX_FUSED_STEP,
    fusable,
    fused_available,
    fused_call,
    fused_step_count,
    shaped,
)
from lightning_baoc.formats.quant import M_SCALE_MAX, V_SCALE_MAX, name_salt, stream_key
from lightning_baoc.kernels import M_FP32, V_FP32, use_triton
from lightning_baoc.kernels.compiled import KernelItem, compiled_step, kernel_serves
from lightning_baoc.optim.device_plan import Chosen, CountsStore, DevicePlan
from lightning_baoc.optim.graph_step import GraphSteps
from lightning_baoc.optim.journal import StepJournal
from lightning_baoc.optim.pools import DeferredFlags, Record
from lightning_baoc.optim.sharding import is_sharded, local, mesh_min

#: A param group's hyperparameters as the step reads them (the optimizer's ``_hyper``).
HyperOf = Callable[[Mapping], StepHyper]


@dataclass(frozen=True)
class StepSettings:
    """What an optimizer's step is built with (its constructor's arguments)."""

    seed: int  # of the stochastic rounding
    skip_nonfinite: bool  # skip the update of a parameter whose gradient holds inf or NaN
    kernels: str  # the kernel policy: "auto", "compiled" or "eager" (lightning_baoc.kernels)
    label: str  # the optimizer's name in warnings
    atomic: bool = False  # a step that raises is undone (optim/journal.py)
    graphs: str = "auto"  # the CUDA graph step (optim/graph_step.py): "auto" (on CUDA parameters) or "off"


class StepDispatcher:
    """The step of an optimizer's parameters, each sent to the kernel that serves its format and device.

    Holds: the hashes of the parameters' names in their rounding keys (:attr:`salts`), the names already
    warned of a skipped update (:attr:`warned`), which kernel serves each parameter (:attr:`serving`,
    decided once per format, state tensors and device), the steps whose skips the device decided and the
    host has not read yet (:attr:`unread`), the device's step plans (:attr:`plans`) and the counts they
    advance (:attr:`count_store`).

    Needs: the records table (parameter -> :class:`~lightning_baoc.optim.pools.Record`, shared with the
    optimizer: a record's counts are advanced here), the format registry and the
    :class:`StepSettings`. Each step takes the param groups' parameters and ``hyper_of(group)`` (their
    hyperparameters) from its caller.

    Example:
        >>> stepper = StepDispatcher(records, FORMATS, StepSettings(0, True, "auto", "BlockwiseAdamW"))  # doctest: +SKIP
        >>> stepper.step([(0, group, params_with_grads)], optimizer._hyper)  # doctest: +SKIP
    """

    def __init__(self, records: dict[Tensor, Record], registry: Mapping[str, StateFormat], settings: StepSettings) -> None:
        self.records = records
        self.registry = registry
        self.seed = settings.seed
        self.skip_nonfinite = settings.skip_nonfinite
        self.kernels = settings.kernels
        self.label = settings.label
        self.atomic = settings.atomic
        self.salts: dict[str, int] = {}  # name -> its hash in the rounding keys
        self.warned: set[str] = set()  # names warned of a skipped update
        # whether the compiled CPU step (by name) and the device's kernels (("device", name)) serve a parameter:
        # name -> (what the decision follows from, the decision)
        self.serving: dict[str | tuple[str, str], tuple[tuple, bool]] = {}
        self.unread: list[DeferredFlags] = []  # the steps whose skips the device decided, read at the next step
        self.plans: dict[tuple[int, tuple[str, ...]], DevicePlan] = {}  # by group and parameter names (device_plan.py)
        self.count_store = CountsStore()  # the records' counts as rows of one array, for the plans
        self.generation = 0  # advanced whenever a parameter's states or correction are replaced: a graph is dropped
        self.found_inf: Tensor | None = None  # AMP's scaler's, for the step running (optim/amp.py)
        self._found_read: bool | None = None  # found_inf as the host read it, once per step
        # (weak: the graphs must not hold the dispatcher, which a dropped optimizer frees at once, without a collection)
        self.graphs = GraphSteps(settings.graphs, settings.seed, settings.label, _weakly(self.warn_skipped),
                                 _weakly(self._describe))

    # ------------------------------------------------------------------ rounding keys

    def salt(self, rec: Record) -> int:
        """The hash of ``rec``'s name in its rounding keys (computed once per name)."""
        salt = self.salts.get(rec.name)
        if salt is None:
            salt = self.salts[rec.name] = name_salt(rec.name)
        return salt

    def noise_key(self, rec: Record, salt: int = 0, step: int | None = None) -> int:
        """The rounding key of ``rec``'s parameter at its step count (or ``step``: a step's, a
        conversion's, a load's; ``salt`` tells them apart); shifted by a shard's offset, so a shard
        draws the whole parameter's bits for its elements."""
        at = rec.step if step is None else step
        return (stream_key(self.seed, at, self.salt(rec) ^ salt) + rec.shard_offset) & 0xFFFFFFFF

    # ------------------------------------------------------------------ the step

    def step(self, batches: Sequence[tuple[int, Mapping[str, Any], list[Tensor]]], hyper_of: HyperOf,
             groups: list[dict[str, Any]] | None = None, found_inf: Tensor | None = None, scaled: bool = False) -> None:
        """One step of the parameters of ``batches`` (per param group: its index, the group, its parameters
        with gradients, their states and corrections in place; ``hyper_of(group)``: its hyperparameters).

        Each parameter goes to one backend, by its format and device (:meth:`_route`, :meth:`_prepare`), each
        called here:

        - the compiled CPU kernels (:func:`~lightning_baoc.kernels.compiled.compiled_step`), which test the
          gradients, advance the counts and say which they skipped;
        - on a GPU, the device's planned step (:meth:`Chosen.step <lightning_baoc.optim.device_plan.Chosen.step>`)
          and kernels (:meth:`_device_step`: Triton, torch's fused AdamW), which read each gradient's finiteness
          flag on the device, the host advancing the counts as if the step happened;
        - the eager step (each format's ``update``, the reference), once the host has read which gradients
          are finite.

        With ``atomic`` set, a :class:`~lightning_baoc.optim.journal.StepJournal` is taken first and restored
        if the step raises: the step is then undone whole, and the error goes on. ``groups``: the optimizer's
        param groups, given by its ``step()``: a step whose parameters all took the device's plans may then be
        captured for the next (:class:`~lightning_baoc.optim.graph_step.GraphSteps`). ``found_inf``: AMP's
        scaler's (:mod:`lightning_baoc.optim.amp`): where set, the whole step is skipped, decided on the device
        where every parameter's skip is (it joins their flags), else read on the host first; ``scaled``: the
        scaler handed the gradients' scale too (they were unscaled before this call).
        """
        journal = StepJournal.take([p for _, _, ps in batches for p in ps], self.records, self) if self.atomic else None
        try:
            self.apply_device_skips()
            compiled, rest = self._route(batches, hyper_of)
            self.found_inf, self._found_read = found_inf, None
            if found_inf is not None and compiled and self._scaler_skips():  # the compiled kernels' host decides: skipped
                return
            for fmt, hyper, items, records, check in compiled:
                skipped = compiled_step(fmt, items, hyper, self.seed, check)
                if skipped:
                    self.warn_skipped([records[i] for i in skipped])
            if not rest:
                return
            route = self._prepare(rest)
            tensor_lr = self.graphs.on
            for hyper, chosen, flags in route.planned:
                chosen.step(hyper, self.seed, flags, tensor_lr)
            if groups is not None:  # the optimizer's step: the next may be captured (graph_step.py)
                # every group's parameters all in its plan (then none went to the device's or the eager step)
                complete = not compiled and len(route.indices) == len(rest) and all(route.whole)
                outside = None
                if not complete and route.planned and self.graphs.wants_reason():
                    planned = {id(e.param) for _, chosen, _ in route.planned for e in chosen.entries}
                    outside = [self._describe(p) for _, _, ps, _ in rest for p in ps if id(p) not in planned]
                self.graphs.observe([(index, hyper, chosen) for index, (hyper, chosen, _) in zip(route.indices, route.planned)],
                                    complete, groups, self.generation, self.count_store.array,
                                    "none" if found_inf is None else "scaled" if scaled else "found", outside)
            for fmt, hyper, items, corrections, any_skip in route.device:
                self._device_step(fmt, items, corrections, hyper, any_skip)
            for fmt, hyper, items, corrections in route.eager:
                for batch in _with_masters(items, corrections):
                    fmt.update(batch, hyper)
        except BaseException:
            if journal is not None:
                journal.restore(self)
            raise

    def _route(
        self, batches: Sequence[tuple[int, Mapping[str, Any], list[Tensor]]], hyper_of: HyperOf
    ) -> tuple[list[_CompiledBucket], list[_Rest]]:
        """The compiled CPU kernels' buckets of ``batches`` (by group and format: the format, the group's
        hyperparameters, the kernel's items, their records, whether the kernel tests the gradients), and per
        group the parameters left to the device's kernels and the eager step (:meth:`_prepare`)."""
        skipped = self._skip_sharded_nonfinite([p for _, _, params in batches for p in params])
        compiled: list[_CompiledBucket] = []
        rest: list[_Rest] = []
        for index, group, params in batches:
            hyper = hyper_of(group)
            buckets: dict[str, tuple[list[KernelItem], list[Record], list[Tensor]]] = {}
            others: list[Tensor] = []
            other_records: list[Record] = []
            for p in params:
                if skipped and p in skipped:  # a sharded parameter's non-finite gradient: skipped on every rank
                    continue
                grad = p.grad  # read once: a property of the tensor
                if grad is None or p.numel() == 0:
                    continue
                local_part = local(p)
                rec = self.records[p]
                fmt = self.registry[rec.format]
                if local_part.numel() == 0 and not (fmt.factored or framed(rec.views)):  # no rows of a sharded parameter:
                    rec.step, rec.m_step = rec.step + 1, rec.m_step + int(fmt.has_momentum)  # its counts move alike
                    continue  # (a factored or framed one steps: it takes part in the exchanges among the shards)
                if self._kernel_serves(rec, fmt, local_part):
                    rec.apply_device_skip()
                    bucket = buckets.get(rec.format)
                    if bucket is None:
                        bucket = buckets[rec.format] = ([], [], [])
                    bucket[0].append(KernelItem(local_part, local(grad), rec.views, rec.counts, self.salt(rec),
                                                rec.master_correction, rec.shard_offset))
                    bucket[1].append(rec)
                    bucket[2].append(p)
                else:
                    others.append(p)
                    other_records.append(rec)
            for name, (items, records, owners) in buckets.items():
                # the kernel tests the gradients (but sharded ones, tested across the ranks already)
                check = self.skip_nonfinite and not all(is_sharded(p) for p in owners)
                compiled.append((self.registry[name], hyper, items, records, check))
            if others:
                rest.append((index, hyper, others, other_records))
        return compiled, rest

    def _prepare(self, rest: list[_Rest]) -> _Route:
        """The backends of the parameters the compiled kernels do not serve (``rest``, per group: the group's
        index, its hyperparameters, the parameters and their records): the device's plans, the device's
        kernels and the eager step. Each one's skip is decided on the device (its flag: :meth:`_device_flags`),
        across the ranks (sharded: decided already) or by the host (:meth:`finite_mask`, one synchronisation per
        device); its counts are advanced and its item made (bias corrections, rounding key)."""
        route = _Route()
        kernels_on: dict[torch.device, bool] = {}  # whether the device kernels run there (asked once per step)
        planned: list[tuple[StepHyper, Chosen]] = []
        # per group: the parameters the plans leave, their records, and whether the device decides each one's skip
        unplanned: list[tuple[StepHyper, list[Tensor], list[Record], list[bool]]] = []
        for index, hyper, params, records in rest:
            chosen, others = self._planned(index, hyper, params, records, kernels_on)
            if chosen:
                planned.append((hyper, chosen))
                route.indices.append(index)
                route.whole.append(not others)
            if others:
                ps, recs = [p for p, _ in others], [rec for _, rec in others]
                on_device = [_decided(self._device_route(p, rec, hyper, kernels_on), rec) for p, rec in others]
                unplanned.append((hyper, ps, recs, on_device))
        # decided on the device: the planned ones, then the others a device kernel serves, each in order
        decided = [p for _, chosen in planned for p in chosen.params]
        decided += [p for _, ps, _, on_device in unplanned for p, yes in zip(ps, on_device) if yes]
        flags = iter(self._device_flags(decided))
        for hyper, chosen in planned:
            route.planned.append((hyper, chosen, [next(flags) for _ in range(len(chosen))]))
        # the host reads the others' finiteness (but sharded ones', decided across the ranks already)
        by_ranks = self.skip_nonfinite
        finite = iter(self.finite_mask([p for _, ps, _, on_device in unplanned for p, yes in zip(ps, on_device)
                                        if not yes and not (by_ranks and is_sharded(p))]))
        for hyper, ps, recs, on_device in unplanned:
            buckets: dict[tuple[str, torch.device], tuple[list[StepItem], list[Tensor | None]]] = {}
            any_skip: dict[torch.device, Tensor] = {}  # each device's skip flags (_device_flags)
            powers: dict[tuple[float, int], float] = {}  # the bias corrections, computed once per count
            beta1, beta2 = hyper.beta1, hyper.beta2  # the group's (SGD's momentum is its beta1)
            skipped: list[Record] = []
            for p, rec, yes in zip(ps, recs, on_device):
                flag = next(flags) if yes else None
                if not yes and not (by_ranks and is_sharded(p)) and not next(finite):
                    rec.nonfinite += 1
                    skipped.append(rec)
                    continue
                if not yes and self._scaler_skips():  # AMP's scaler skips the step: read on the host for these
                    continue
                fmt = self.registry[rec.format]
                step, m_step = rec.advance(fmt.has_momentum)
                bc1 = powers.get((beta1, m_step))
                if bc1 is None:
                    bc1 = powers[(beta1, m_step)] = 1.0 - beta1**m_step if m_step else 1.0
                bc2 = powers.get((beta2, step))
                if bc2 is None:
                    bc2 = powers[(beta2, step)] = 1.0 - beta2**step
                count = step if m_step == step else None  # one count for both corrections
                local_part = local(p)
                item = StepItem(local_part, local(p.grad), rec.views, bc1, bc2, count, self.noise_key(rec, step=step),
                                m_step)
                if fmt.factored:
                    item.shards = rec.row_shards
                if flag is not None:  # after every read of the counts: a read applies the skip (it waits for the flags)
                    deferred, at, skip = flag
                    item.skip_flag, any_skip[local_part.device] = skip[at : at + 1], skip
                    deferred.records[at] = (rec, fmt.has_momentum)
                    rec.unread_skip = (deferred, at)
                bucket = buckets.get((rec.format, local_part.device))
                if bucket is None:
                    bucket = buckets[(rec.format, local_part.device)] = ([], [])
                bucket[0].append(item)
                bucket[1].append(rec.master_correction)
            if skipped:
                self.warn_skipped(skipped)
            for (name, device), (items, corrections) in buckets.items():
                fmt = self.registry[name]
                served, items, corrections = self._device_part(fmt, items, corrections, hyper, kernels_on, device)
                if served is not None:
                    route.device.append((fmt, hyper, *served, any_skip.get(device)))
                if items:
                    route.eager.append((fmt, hyper, items, corrections))
        return route

    def _planned(
        self, index: int, hyper: StepHyper, params: list[Tensor], records: list[Record],
        kernels_on: dict[torch.device, bool],
    ) -> tuple[Chosen | tuple[()], list[tuple[Tensor, Record]]]:
        """The entries of ``params`` (with their ``records``: the eager step's of group ``index``) that step
        through the device's plan (:class:`~lightning_baoc.optim.device_plan.DevicePlan`, built on first use
        and kept while it holds; empty: none), and the others."""
        if not self.skip_nonfinite or hyper.rule != "adamw":
            return (), list(zip(params, records))
        conditions = (self.kernels, hyper.decoupled_weight_decay)
        key = (index, tuple(rec.name for rec in records))
        plan = self.plans.get(key)
        chosen = plan.select(conditions) if plan is not None else None
        if chosen is None:
            if len(self.plans) > 2 * len(self.records) + 8:  # steps of ever new subsets: keep the cache small
                self.plans.clear()
            plan = self.plans[key] = DevicePlan(
                params, [self._device_route(p, rec, hyper, kernels_on) for p, rec in zip(params, records)], conditions,
                self.records, self.registry, self.salt, self.count_store)
            chosen = plan.select(conditions)
            assert chosen is not None  # a plan holds for the step it was built for
        return chosen

    def _describe(self, p: Tensor) -> str:
        """A parameter in a message: its name and format."""
        rec = self.records.get(p)
        return "an unknown parameter" if rec is None else f"{rec.name!r} ({rec.format})"

    def _scaler_skips(self) -> bool:
        """Whether AMP's scaler skips this step (its ``found_inf``, read on the host once per step)."""
        if self.found_inf is None:
            return False
        if self._found_read is None:
            self._found_read = bool(self.found_inf)
        return self._found_read

    def forget_plans(self) -> None:
        """Forget the device's step plans and captured step: a parameter's states or correction were replaced
        (a plan holds the tensors it read: it would keep the old ones alive)."""
        self.plans.clear()
        self.generation += 1
        self.graphs.drop()

    def _kernel_serves(self, rec: Record, fmt: StateFormat, local_part: Tensor) -> bool:
        """:func:`kernel_serves` for ``rec``'s parameter (its local part ``local_part``), decided once per
        format, state tensors, device and policy rather than on every step."""
        key = (rec.format, id(rec.views), local_part.device, self.kernels)
        known = self.serving.get(rec.name)
        if known is None or known[0] != key:
            # a factored shard of a parameter split by rows sums over the shards: the eager step's
            serves = kernel_serves(fmt, local_part, rec.views, self.kernels) and not (fmt.factored and rec.row_shards)
            known = self.serving[rec.name] = (key, serves)
        return known[1]

    def apply_device_skips(self) -> None:
        """Apply the skips the device decided at the last step to the counts, and warn of the skipped."""
        self.graphs.apply_skips()
        for deferred in self.unread:
            skipped = deferred.skipped()
            if skipped:
                self.warn_skipped(skipped)
        self.unread.clear()

    def decided_on_device(self, p: Tensor, rec: Record, hyper: StepHyper, kernels_on: dict[torch.device, bool]) -> bool:
        """Whether ``p``'s step (``rec``: its record) is decided on its device: a GPU's kernel reads its
        finiteness flag (:class:`~lightning_baoc.optim.pools.DeferredFlags`), so the host reads nothing to
        launch it. The Triton kernels and torch's fused AdamW do; the eager formats' steps, a sharded
        parameter (decided across ranks) and ``skip_nonfinite=False`` (nothing to decide) do not."""
        return _decided(self._device_route(p, rec, hyper, kernels_on), rec)

    def _device_route(
        self, p: Tensor, rec: Record, hyper: StepHyper, kernels_on: dict[torch.device, bool]
    ) -> str | None:
        """Which kernel serves ``p``'s step (``rec``: its record) on its device, deciding its skip there:
        ``"fused"`` (torch's fused AdamW, fp32: where its counts allow, :func:`_decided`), ``"triton"``, or
        ``None`` (the host decides)."""
        kinds = self.registry[rec.format].kernel_kinds
        if not self.skip_nonfinite or kinds is None or hyper.rule != "adamw" or is_sharded(p):
            return None
        grad, device = p.grad, p.device
        on = kernels_on.get(device)
        if on is None:
            on = kernels_on[device] = use_triton(self.kernels, device)
        if not on or p.numel() == 0:
            return None
        dtype = p.dtype
        fused = kinds == (M_FP32, V_FP32) and dtype == torch.float32  # torch's fused kernel, found_inf
        # what the kernel serves follows from the tensors' kinds: decided once for them, not every step
        key = (rec.format, id(rec.views), id(rec.master_correction), device, dtype, grad.dtype, grad.device,
               p.is_contiguous(), grad.is_contiguous(), hyper.decoupled_weight_decay)
        known = self.serving.get(("device", rec.name))
        if known is None or known[0] != key:
            if fused:  # the fused kernel's own test: offload's host states take the host's decision
                serves = (rec.master_correction is None
                          and fusable(p, grad, rec.views["exp_avg"], rec.views["exp_avg_sq"])
                          and fused_available(device, hyper.decoupled_weight_decay))
            else:
                # lazy: the Triton step imports triton, an optional dependency
                from lightning_baoc.kernels import triton_step

                serves = triton_step.serves(kinds, p, grad, rec.views, rec.master_correction)
            known = self.serving[("device", rec.name)] = (key, serves)
        if not known[1]:
            return None
        return "fused" if fused else "triton"

    def _device_flags(self, params: list[Tensor]) -> list[tuple[DeferredFlags, int, Tensor]]:
        """Each parameter's finiteness flag on its device, in order: (the step's flags, its index in them, and
        the device's skip flags, fp32, one per parameter, 1 where its gradient holds inf or NaN; a parameter's
        flag is the element at its index). One pass over the gradients per device (their largest absolute
        value: NaN propagates, inf is its own maximum), and two operations on the device to make the flags
        (on a GPU each operation's launch costs more than its work); nothing read."""
        by_device: dict[torch.device, list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            by_device[local(p).device].append(i)
        out: list[tuple[DeferredFlags, int, Tensor]] = [None] * len(params)  # type: ignore[list-item] - all set below
        for members in by_device.values():
            max_abs = torch._foreach_norm([local(params[i].grad) for i in members], ord=float("inf"), dtype=torch.float32)
            # x * 0 is 0 for finite x and NaN for inf and NaN: 1 where the gradient was not finite
            skip = torch.stack(max_abs).mul_(0.0).nan_to_num_(nan=1.0)
            found = None
            if self.found_inf is not None:  # AMP's scaler found an inf: every flag set (optim/amp.py)
                found = self.found_inf.reshape(1).to(skip.device, torch.float32).clamp(max=1.0)
                torch.maximum(skip, found, out=skip)
            deferred = DeferredFlags(skip, len(members), found)
            self.unread.append(deferred)
            for k, i in enumerate(members):
                out[i] = (deferred, k, skip)
        return out

    def _skip_sharded_nonfinite(self, params: list[Tensor]) -> set[Tensor]:
        """The sharded parameters whose gradient holds inf or NaN on some rank, skipped on every rank
        (counted, warned): one test of their local gradients and one all-reduce per step, so that no
        rank steps a parameter another skips (their shards and step counts would part)."""
        sharded = [p for p in params if is_sharded(p) and p.grad is not None]
        if not self.skip_nonfinite or not sharded:
            return set()
        ok = torch.tensor(self.finite_mask(sharded), dtype=torch.int32, device=local(sharded[0].grad).device)
        mesh_min(ok, sharded)
        skipped = {p for p, good in zip(sharded, ok.tolist()) if not good}
        for p in skipped:
            self.records[p].nonfinite += 1
        if skipped:
            self.warn_skipped([self.records[p] for p in sharded if p in skipped])
        return skipped

    def finite_mask(self, params: list[Tensor]) -> list[bool]:
        """Whether each parameter's gradient holds only finite values (one host sync per device).

        Tests finiteness, not a norm: a finite 2-norm (accumulated in fp32) proves every element
        finite, and is one fast pass (on the CPU ~20x faster than the largest absolute value). A
        non-finite 2-norm may still come from finite values whose squares overflow (1e19 in fp32),
        so those gradients are decided by their largest absolute value, which is finite for finite
        numbers in any dtype: NaN propagates through the maximum, inf is its own maximum.
        """
        if not self.skip_nonfinite or not params:
            return [True] * len(params)
        by_device: dict[torch.device, list[int]] = defaultdict(list)
        grads_of = [local(p.grad) for p in params]
        for i, g in enumerate(grads_of):
            if g.numel():  # an empty gradient holds nothing non-finite (and has no max)
                by_device[g.device].append(i)
        mask = [True] * len(params)
        for indices in by_device.values():
            grads = [grads_of[i] for i in indices]
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            flags = torch.isfinite(torch.stack(norms)).tolist()
            doubtful = [k for k, ok in enumerate(flags) if not ok]
            if doubtful:  # a NaN or inf, or finite values that overflow the sum of squares
                max_abs = torch._foreach_norm([grads[k] for k in doubtful], ord=float("inf"))
                for k, ok in zip(doubtful, torch.isfinite(torch.stack(max_abs)).tolist()):
                    flags[k] = ok
            for i, ok in zip(indices, flags):
                mask[i] = ok
        return mask

    def warn_skipped(self, records: list[Record]) -> None:
        """Warn once per parameter (per process) whose update was skipped for a non-finite gradient."""
        for rec in records:
            if rec.name not in self.warned:
                self.warned.add(rec.name)
                warnings.warn(
                    f"{self.label}: non-finite gradient for {rec.name!r}; its update is "
                    f"skipped (state and value kept). Counted in nonfinite_counts.",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _device_part(
        self, fmt: StateFormat, items: list[StepItem], corrections: list[Tensor | None], hyper: StepHyper,
        kernels_on: dict[torch.device, bool], device: torch.device,
    ) -> tuple[tuple[list[StepItem], list[Tensor | None]] | None, list[StepItem], list[Tensor | None]]:
        """Of ``items`` (one format, one device; ``corrections``: their master-weight corrections): those the
        device's kernels step (:meth:`_device_step`; ``None``: none), and the others, for the eager step."""
        kinds = fmt.kernel_kinds
        if kinds is None or hyper.rule != "adamw":
            return None, items, corrections
        on = kernels_on.get(device)
        if on is None:
            on = kernels_on[device] = use_triton(self.kernels, device)
        if not on:
            return None, items, corrections
        from lightning_baoc.kernels import triton_step  # lazy: imports triton, an optional dependency, where it runs

        if kinds == (M_FP32, V_FP32) and all(it.param.dtype == torch.float32 for it in items):
            # fp32 moments of fp32 parameters: torch's fused kernel for those decided on the device
            served = [it.skip_flag is not None for it in items]
        else:
            # not a factored shard of rows split among ranks (it sums over them), nor a framed one (it exchanges its edges)
            served = [it.shards is None and not framed(it.views)
                      and (it.skip_flag is not None or triton_step.serves(kinds, it.param, it.grad, it.views, c))
                      for it, c in zip(items, corrections)]
        if not any(served):
            return None, items, corrections
        on_device = ([it for it, ok in zip(items, served) if ok], [c for c, ok in zip(corrections, served) if ok])
        rest = [k for k, ok in enumerate(served) if not ok]
        return on_device, [items[k] for k in rest], [corrections[k] for k in rest]

    def _device_step(
        self, fmt: StateFormat, items: list[StepItem], corrections: list[Tensor | None], hyper: StepHyper,
        any_skip: Tensor | None,
    ) -> None:
        """Step ``items`` (one format, one device, all served: :meth:`_device_part`) through the device's
        kernels: the Triton kernel (:mod:`lightning_baoc.kernels.triton_step`), or for fp32 moments of fp32
        parameters torch's fused kernel, one call for all of them decided on the device, skipped whole where
        any flag is set, then the Triton kernel steps the finite ones where it was (``repair``; it does
        nothing where no flag is set: a rare step, the same math within ulps). ``any_skip``: the device's
        skip flags (:meth:`_device_flags`)."""
        from lightning_baoc.kernels import triton_step  # lazy: imports triton, an optional dependency, where it runs

        kinds = fmt.kernel_kinds
        assert kinds is not None  # _device_part sends only formats with kernels
        if not (kinds == (M_FP32, V_FP32) and all(it.param.dtype == torch.float32 for it in items)):
            triton_step.adamw_step(kinds, items, hyper, M_SCALE_MAX, V_SCALE_MAX, corrections)
            return
        counts = [fused_step_count(it, hyper) for it in items]
        if None in counts:  # the device's decision holds only where the fused kernel takes the counts
            raise RuntimeError("a step decided on the device reached the foreach step, which cannot skip it")
        if len(items) == 1:  # alone (gradient release steps one at a time): its own flag, nothing to repair
            found_inf = items[0].skip_flag
        else:
            assert any_skip is not None  # _device_flags gave every decided item its device's flags
            found_inf = any_skip.amax().view(1)  # any parameter's, on this device (a superset of these: still exact)
        fused_call(items[0].param.device, [it.param for it in items], [it.grad for it in items],
                   [shaped(it.views["exp_avg"], it.param) for it in items],
                   [shaped(it.views["exp_avg_sq"], it.param) for it in items], counts, hyper, found_inf,  # type: ignore[arg-type]
                   self.graphs.on)  # the learning rate as the planned and captured steps read it
        if len(items) > 1:
            triton_step.adamw_step(kinds, items, hyper, M_SCALE_MAX, V_SCALE_MAX, None, repair=found_inf)


#: A compiled CPU kernels' bucket (one group, one format): the format, the group's hyperparameters, the kernel's
#: items, their records, and whether the kernel tests the gradients.
_CompiledBucket = tuple[StateFormat, StepHyper, list[KernelItem], list[Record], bool]
#: A group's parameters the compiled kernels do not serve: the group's index, its hyperparameters, the
#: parameters and their records.
_Rest = tuple[int, StepHyper, list[Tensor], list[Record]]


class _Route:
    """Which backend steps each parameter the compiled kernels do not (:meth:`StepDispatcher._prepare`),
    with what it reads."""

    def __init__(self) -> None:
        #: the device's plans: (hyperparameters, the entries that step, their flags)
        self.planned: list[tuple[StepHyper, Chosen, list[tuple[DeferredFlags, int, Tensor]]]] = []
        #: the device's kernels: (format, hyperparameters, items, their corrections, the device's skip flags)
        self.device: list[tuple[StateFormat, StepHyper, list[StepItem], list[Tensor | None], Tensor | None]] = []
        #: the eager step: (format, hyperparameters, items, their corrections)
        self.eager: list[tuple[StateFormat, StepHyper, list[StepItem], list[Tensor | None]]] = []
        #: each planned entry's param group (its index), and whether the plan took all of the group's parameters
        self.indices: list[int] = []
        self.whole: list[bool] = []


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` called through a weak reference to its object (nothing where the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)
    return call


def _decided(route: str | None, rec: Record) -> bool:
    """Whether a step routed to ``route`` (:meth:`StepDispatcher._device_route`) is decided on the device:
    the Triton kernels' are; torch's fused kernel's where it takes the counts (it derives both bias
    corrections from one count)."""
    if route == "fused":
        step, m_step = rec.step, rec.m_step  # the first read applies an unread device skip
        return step == m_step and step < MAX_FUSED_STEP
    return route is not None


def _with_masters(items: list[StepItem], corrections: list[Tensor | None]) -> Iterator[list[StepItem]]:
    """The batches of ``items`` a format's eager ``update`` steps: those without a master-weight correction
    at once; then each corrected 16-bit weight alone, as its fp32 master (rebuilt from the weight and its
    correction: the one fp32 transient), split back into weight and correction once the update returns."""
    plain = [it for it, c in zip(items, corrections) if c is None]
    if plain:
        yield plain
    for it, correction in zip(items, corrections):
        if correction is not None:
            master = reconstruct(it.param.detach(), correction)
            yield [dataclasses.replace(it, param=master)]
            split_into(master, it.param.detach(), correction)
