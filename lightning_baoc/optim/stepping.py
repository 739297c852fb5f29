"""The step of :meth:`BlockwiseAdamW.step <lightning_baoc.optim.BlockwiseAdamW.step>`: which kernel steps each
parameter, by its format and device, and the eager step.

:class:`StepDispatcher` sends the (param group, format) buckets the compiled CPU kernels serve to
:func:`~lightning_baoc.kernels.compiled.compiled_step`: the kernel tests each gradient for inf and
NaN, advances the step counts or counts the skip, and says which it skipped, so nothing is read
from a tensor to launch it. Every other parameter (CUDA, a policy of ``"eager"``, no compiler) takes
the eager step here: the host reads which gradients are finite (:meth:`StepDispatcher.finite_mask`, one
synchronisation per device and step), advances the counts, computes the bias corrections and the
rounding key, and runs each format's ``update``. On a GPU the Triton kernels
(:mod:`lightning_baoc.kernels.triton_step`) and torch's fused AdamW serve the formats instead, and read
each gradient's finiteness flag on the device (:meth:`StepDispatcher._device_flags`; fp32 takes one fused
call whose ``found_inf`` is the flag of any, then the Triton kernel steps the finite ones where it was
set): the host advances the counts as if the step happened and applies a skip when a count is next read
(:class:`~lightning_baoc.optim.pools.DeferredFlags`), so it reads nothing to launch them. The host's work
of those steps is planned once per param group and replayed (:mod:`lightning_baoc.optim.device_plan`).
Both work on each parameter's local part (the shard of a ``DTensor`` parameter on this rank:
:mod:`lightning_baoc.optim.sharding`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

from lightning_baoc.formats import StateFormat, StepHyper, StepItem
from lightning_baoc.formats.correction import reconstruct, split_into
from lightning_baoc.formats.frames import framed
from lightning_baoc.formats.fused_adam import (
    MAX_FUSED_STEP,
    fusable,
    fused_available,
    fused_dense_fp32,
)
from lightning_baoc.formats.quant import M_SCALE_MAX, V_SCALE_MAX, name_salt, stream_key
from lightning_baoc.kernels import M_FP32, V_FP32, use_triton
from lightning_baoc.kernels.compiled import KernelItem, compiled_step, kernel_serves
from lightning_baoc.optim.device_plan import Chosen, CountsStore, DevicePlan
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


class StepDispatcher:
    """The step of an optimizer's parameters, each sent to the kernel that serves its format and device.

    Holds: the hashes of the parameters' names in their rounding keys (:attr:`salts`), the names already
    warned of a skipped update (:attr:`warned`), which kernel serves each parameter (:attr:`serving`,
    decided once per format, state tensors and device), the steps whose skips the device decided and the
    host has not read yet (:attr:`unread`), the device's step plans (:attr:`plans`) and the counts they
    advance (:attr:`count_store`).

    Needs: the records table (parameter -> :class:`~lightning_baoc.optim.pools.Record`, shared with the
    optimizer: a record's counts are advanced here), the format registry and the
    :class:`StepSettings`. Each step takes the param groups and ``hyper_of(group)`` (their
    hyperparameters) from its caller.

    Example:
        >>> stepper = StepDispatcher(records, FORMATS, StepSettings(0, True, "auto", "BlockwiseAdamW"))  # doctest: +SKIP
        >>> stepper.step(params_with_grads, optimizer.param_groups, optimizer._hyper)  # doctest: +SKIP
    """

    def __init__(self, records: dict[Tensor, Record], registry: Mapping[str, StateFormat], settings: StepSettings) -> None:
        self.records = records
        self.registry = registry
        self.seed = settings.seed
        self.skip_nonfinite = settings.skip_nonfinite
        self.kernels = settings.kernels
        self.label = settings.label
        self.salts: dict[str, int] = {}  # name -> its hash in the rounding keys
        self.warned: set[str] = set()  # names warned of a skipped update
        # whether the compiled CPU step (by name) and the device's kernels (("device", name)) serve a parameter:
        # name -> (what the decision follows from, the decision)
        self.serving: dict[str | tuple[str, str], tuple[tuple, bool]] = {}
        self.unread: list[DeferredFlags] = []  # the steps whose skips the device decided, read at the next step
        self.plans: dict[tuple[int, tuple[int, ...]], DevicePlan] = {}  # by group and parameters (device_plan.py)
        self.count_store = CountsStore()  # the records' counts as rows of one array, for the plans

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

    def step(self, params: list[Tensor], groups: list[dict], hyper_of: HyperOf) -> None:
        """One step of ``params`` (with gradients, states and corrections in place), by group of
        ``groups`` (the optimizer's param groups; ``hyper_of(group)``: their hyperparameters)."""
        self.apply_device_skips()
        skipped_sharded = self._skip_sharded_nonfinite(params)
        chosen = {id(p) for p in params if not skipped_sharded or p not in skipped_sharded}  # ids: hashing a tensor is a Python call
        eager: list[tuple[int, StepHyper, list[Tensor]]] = []
        for index, group in enumerate(groups):
            hyper = hyper_of(group)
            compiled: dict[str, list[KernelItem]] = defaultdict(list)
            owners: dict[int, Tensor] = {}  # id of a local part -> its parameter
            rest: list[Tensor] = []
            for p in group["params"]:
                if id(p) not in chosen:
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
                    item = KernelItem(local_part, local(grad), rec.views, rec.counts, self.salt(rec), rec.master_correction,
                                      rec.shard_offset)
                    owners[id(local_part)] = p
                    compiled[rec.format].append(item)
                else:
                    rest.append(p)
            for fmt, items in compiled.items():
                # the kernel tests the gradients (but sharded ones, tested across the ranks already),
                # advances the counts and says which it skipped
                check = self.skip_nonfinite and not all(is_sharded(owners[id(it.param)]) for it in items)
                skipped = compiled_step(self.registry[fmt], items, hyper, self.seed, check)
                if skipped:
                    self.warn_skipped([self.records[owners[id(it.param)]] for it in skipped])
            if rest:
                eager.append((index, hyper, rest))
        if eager:
            kernels_on: dict[torch.device, bool] = {}  # whether the device kernels run there (asked once per step)
            planned, unplanned = [], []  # the device's planned steps; the others, by group
            for index, hyper, params in eager:
                chosen, others = self._planned(index, hyper, params, kernels_on)
                if chosen:
                    planned.append((hyper, chosen))
                if others:
                    unplanned.append((hyper, others))
            every = [p for _, params in unplanned for p in params]
            decided = [p for _, chosen in planned for p in chosen.params]
            decided += [p for hyper, ps in unplanned for p in ps if self.decided_on_device(p, hyper, kernels_on)]
            flags = self._device_flags(decided)
            # decided already (ids): on the device, or (sharded) across the ranks by _skip_sharded_nonfinite
            known = set(flags)
            if self.skip_nonfinite:
                known.update(id(p) for p in every if is_sharded(p))
            finite = iter(self.finite_mask([p for p in every if id(p) not in known]))
            for hyper, chosen in planned:
                chosen.step(hyper, self.seed, flags)
            for hyper, params in unplanned:
                self._eager_step(hyper, params, [True if id(p) in known else next(finite) for p in params], flags)

    def _planned(
        self, index: int, hyper: StepHyper, params: list[Tensor], kernels_on: dict[torch.device, bool]
    ) -> tuple[Chosen | tuple[()], list[Tensor]]:
        """The entries of ``params`` (the eager step's of group ``index``) that step through the device's
        plan (:class:`~lightning_baoc.optim.device_plan.DevicePlan`, built on first use and kept while
        it holds; empty: none), and the others."""
        if not self.skip_nonfinite or hyper.rule != "adamw":
            return (), params
        conditions = (self.kernels, hyper.decoupled_weight_decay)
        key = (index, tuple(id(p) for p in params))
        plan = self.plans.get(key)
        chosen = plan.select(conditions) if plan is not None else None
        if chosen is None:
            if len(self.plans) > 2 * len(self.records) + 8:  # steps of ever new subsets: keep the cache small
                self.plans.clear()
            plan = self.plans[key] = DevicePlan(
                params, [self._device_route(p, hyper, kernels_on) for p in params], conditions, self.records,
                self.registry, self.salt, self.count_store)
            chosen = plan.select(conditions)
            assert chosen is not None  # a plan holds for the step it was built for
        return chosen

    def forget_plans(self) -> None:
        """Forget the device's step plans: a parameter's states or correction were replaced (a plan holds
        the tensors it read: it would keep the old ones alive)."""
        self.plans.clear()

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
        for deferred in self.unread:
            skipped = deferred.skipped()
            if skipped:
                self.warn_skipped(skipped)
        self.unread.clear()

    def decided_on_device(self, p: Tensor, hyper: StepHyper, kernels_on: dict[torch.device, bool]) -> bool:
        """Whether ``p``'s step is decided on its device: a GPU's kernel reads its finiteness flag
        (:class:`~lightning_baoc.optim.pools.DeferredFlags`), so the host reads nothing to launch it.
        The Triton kernels and torch's fused AdamW do; the eager formats' steps, a sharded parameter
        (decided across ranks) and ``skip_nonfinite=False`` (nothing to decide) do not."""
        route = self._device_route(p, hyper, kernels_on)
        if route == "fused":  # the kernel derives both bias corrections from one count
            rec = self.records[p]
            step, m_step = rec.step, rec.m_step  # the first read applies an unread device skip
            return step == m_step and step < MAX_FUSED_STEP
        return route is not None

    def _device_route(self, p: Tensor, hyper: StepHyper, kernels_on: dict[torch.device, bool]) -> str | None:
        """Which kernel serves ``p``'s step on its device, deciding its skip there: ``"fused"`` (torch's
        fused AdamW, fp32: where its counts allow, :meth:`decided_on_device`), ``"triton"``, or ``None``
        (the host decides)."""
        rec = self.records[p]
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
                from lightning_baoc.kernels import triton_step

                serves = triton_step.serves(kinds, p, grad, rec.views, rec.master_correction)
            known = self.serving[("device", rec.name)] = (key, serves)
        if not known[1]:
            return None
        return "fused" if fused else "triton"

    def _device_flags(self, params: list[Tensor]) -> dict[int, tuple[DeferredFlags, int, Tensor]]:
        """Each parameter's (by ``id``) finiteness flag on its device: (the step's flags, its index in them, and
        the device's skip flags, fp32, one per parameter, 1 where its gradient holds inf or NaN; a parameter's
        flag is the element at its index). One pass over the gradients per device (their largest absolute
        value: NaN propagates, inf is its own maximum), and two operations on the device to make the flags (on a GPU each operation's
        launch costs more than its work); nothing read."""
        by_device: dict[torch.device, list[Tensor]] = defaultdict(list)
        for p in params:
            by_device[local(p).device].append(p)
        out: dict[int, tuple[DeferredFlags, int, Tensor]] = {}  # ids: hashing a tensor is a Python call
        for members in by_device.values():
            max_abs = torch._foreach_norm([local(p.grad) for p in members], ord=float("inf"), dtype=torch.float32)
            # x * 0 is 0 for finite x and NaN for inf and NaN: 1 where the gradient was not finite
            skip = torch.stack(max_abs).mul_(0.0).nan_to_num_(nan=1.0)
            deferred = DeferredFlags(skip, len(members))
            self.unread.append(deferred)
            for i, p in enumerate(members):
                out[id(p)] = (deferred, i, skip)
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

    def _triton_update(
        self, fmt: StateFormat, items: list[StepItem], corrections: list[Tensor | None], hyper: StepHyper,
        any_skip: Tensor | None = None,
    ) -> tuple[list[StepItem], list[Tensor | None]]:
        """Step the ``items`` (one format, one device; ``corrections``: their master-weight corrections)
        the Triton kernels serve on a GPU (:mod:`lightning_baoc.kernels.triton_step`); the others.
        ``any_skip``: the device's skip flags (:meth:`_device_flags`), one per parameter decided there."""
        kinds = fmt.kernel_kinds
        if not items or kinds is None or hyper.rule != "adamw" or not use_triton(self.kernels, items[0].param.device):
            return items, corrections
        from lightning_baoc.kernels import (
            triton_step,  # imports triton: only where it runs
        )

        if kinds == (M_FP32, V_FP32) and all(it.param.dtype == torch.float32 for it in items):
            # fp32 moments of fp32 parameters: torch's fused kernel, one call for all those decided on the
            # device, skipped whole where any flag is set; then the finite ones step through the Triton
            # kernel, which does nothing where no flag is set (a rare step, the same math within ulps)
            decided = [it for it in items if it.skip_flag is not None]
            if len(decided) == 1:  # alone (gradient release steps one at a time): its own flag, nothing to repair
                fused_dense_fp32(decided, hyper, "exp_avg", "exp_avg_sq", found_inf=decided[0].skip_flag)
            elif decided:
                assert any_skip is not None  # _device_flags gave every decided item its device's flags
                found_inf = any_skip.amax().view(1)  # any parameter's, on this device (a superset of these: still exact)
                fused_dense_fp32(decided, hyper, "exp_avg", "exp_avg_sq", found_inf=found_inf)
                triton_step.adamw_step(kinds, decided, hyper, M_SCALE_MAX, V_SCALE_MAX, None, repair=found_inf)
            rest = [k for k, it in enumerate(items) if it.skip_flag is None]
            return [items[k] for k in rest], [corrections[k] for k in rest]

        # not a factored shard of rows split among ranks (it sums over them), nor a framed one (it exchanges its edges)
        served = [it.shards is None and not framed(it.views)
                  and (it.skip_flag is not None or triton_step.serves(kinds, it.param, it.grad, it.views, c))
                  for it, c in zip(items, corrections)]
        if any(served):
            triton_step.adamw_step(kinds, [it for it, ok in zip(items, served) if ok], hyper, M_SCALE_MAX, V_SCALE_MAX,
                                   [c for c, ok in zip(corrections, served) if ok])
        rest = [k for k, ok in enumerate(served) if not ok]
        return [items[k] for k in rest], [corrections[k] for k in rest]

    def _eager_step(
        self, hyper: StepHyper, params: list[Tensor], finite: list[bool],
        flags: Mapping[int, tuple[DeferredFlags, int, Tensor]] | None = None,
    ) -> None:
        """The step of ``params`` but those the compiled CPU kernels serve: the eager step (the
        reference) of those whose gradients' finiteness the host has read (:meth:`finite_mask`, one
        synchronisation per device and step), the device kernels' of those it decides (``flags``:
        :meth:`_device_flags`, by the parameters' ids; their counts advance now and a skip is taken back
        when next read)."""
        flags = flags or {}
        if not params:
            return
        beta1, beta2 = hyper.beta1, hyper.beta2  # the group's (SGD's momentum is its beta1)
        buckets: dict[tuple[str, torch.device], list[StepItem]] = defaultdict(list)
        any_skip: dict[torch.device, Tensor] = {}  # each device's skip flags (_device_flags)
        powers: dict[tuple[float, int], float] = {}  # the bias corrections, computed once per count
        skipped: list[Record] = []
        records: dict[int, Record] = {}  # id of a local part -> its parameter's record
        for p, ok in zip(params, finite):
            rec = self.records[p]
            if not ok:
                rec.nonfinite += 1
                skipped.append(rec)
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
            records[id(local_part)] = rec
            item = StepItem(local_part, local(p.grad), rec.views, bc1, bc2, count, self.noise_key(rec, step=step), m_step)
            if fmt.factored:
                item.shards = rec.row_shards
            flag = flags.get(id(p))
            if flag is not None:  # after every read of the counts: a read applies the skip (it waits for the flags)
                deferred, index, skip = flag
                item.skip_flag, any_skip[local_part.device] = skip[index : index + 1], skip
                deferred.records[index] = (rec, fmt.has_momentum)
                rec.unread_skip = (deferred, index)
            buckets[(rec.format, local_part.device)].append(item)
        if skipped:
            self.warn_skipped(skipped)
        for (fmt, device), items in buckets.items():
            state_format = self.registry[fmt]
            corrections = [records[id(it.param)].master_correction for it in items]
            items, corrections = self._triton_update(state_format, items, corrections, hyper, any_skip.get(device))
            plain = [it for it, c in zip(items, corrections) if c is None]
            if plain:
                state_format.update(plain, hyper)
            for it, correction in zip(items, corrections):  # corrected 16-bit weights: one fp32 master at a time
                if correction is not None:
                    master = reconstruct(it.param.detach(), correction)
                    state_format.update([dataclasses.replace(it, param=master)], hyper)
                    split_into(master, it.param.detach(), correction)
