"""Persistence of the blockwise optimizers: state dicts, loads, copies, pickles.

:class:`CheckpointCodec` turns an optimizer's state into its state dict and back (layout and checksums:
:mod:`~lightning_baoc.optim.checkpoint.layout`; validation: :mod:`~lightning_baoc.optim.checkpoint.validate`;
the layout of sharded parameters: :mod:`~lightning_baoc.optim.checkpoint.distributed`), and into the state
of a ``copy.deepcopy`` or ``pickle`` and back. A load validates everything first and then commits at once,
so a refused dict leaves the optimizer unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from lightning_baoc.formats import Canonical, StateFormat, StepHyper, resolve_in
from lightning_baoc.formats.frames import framed
from lightning_baoc.optim.checkpoint.distributed import from_distributed, to_distributed
from lightning_baoc.optim.checkpoint.layout import (
    STATE_DICT_VERSION,
    adamw_export,
    decode_entry,
    is_distributed_layout,
    make_entry,
    momentum_export,
    seal_state_dict,
    with_refusal,
    without_refusal,
)
from lightning_baoc.optim.checkpoint.validate import LoadPlan
from lightning_baoc.optim.pools import Record, StatePools
from lightning_baoc.optim.sharding import gather_full, is_sharded, local
from lightning_baoc.optim.stepping import StepDispatcher

#: Attributes that only tie an optimizer to its process (hooks, an LR scheduler's wrapper of
#: ``step``): not copied or pickled, as torch's own ``Optimizer.__getstate__`` does not.
RUNTIME_ONLY = frozenset({
    "step", "_opt_called", "_zero_grad_profile_name", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
})
#: Mixed into the rounding key of a state encoded at load (a torch state into a bf16 format).
_LOAD_SALT = 0x10AD5A17
#: The key of a copy's state that :meth:`CheckpointCodec.copy_state` adds (compact copies of the states).
_COPIED = "_copied_states"

HyperOf = Callable[[Mapping[str, Any], int], StepHyper]


@dataclasses.dataclass(eq=False)
class CheckpointCodec:
    """An optimizer's state as a state dict and as a copy's state, and back.

    Holds nothing of its own: it reads and writes the records, the names and the pools.

    Needs: the records table and the names table (name -> parameter), shared with the optimizer; its
    :class:`~lightning_baoc.optim.pools.StatePools` (new pools for a load or a copy, the bytes recounted)
    and :class:`~lightning_baoc.optim.stepping.StepDispatcher` (the rounding keys of a state encoded at
    load, the skips the device decided applied before a dict or a copy is taken, the warned names a copy
    keeps, the step's plans dropped); the format registry, the optimizer's update rule and label (a dict
    records its rule) and ``min_8bit_numel`` (the formats a torch state is encoded into). The param
    groups, ``hyper_of(group, noise_key)`` and the validation of a dict against the optimizer
    (``validate(state_dict) -> LoadPlan``: :func:`~lightning_baoc.optim.checkpoint.validate.plan_load` over
    the optimizer's :class:`~lightning_baoc.optim.checkpoint.validate.LoadTarget`) come from the caller.

    Example:
        >>> codec = CheckpointCodec(records, names, pools, stepper, FORMATS, "adamw", "BlockwiseAdamW", 4096)  # doctest: +SKIP
        >>> sd = codec.state_dict(optimizer.param_groups)  # doctest: +SKIP
        >>> codec.load(sd, optimizer.param_groups, lambda sd: plan_load(target, sd), optimizer._hyper)  # doctest: +SKIP
    """

    records: dict[Tensor, Record]
    names: dict[str, Tensor]
    pools: StatePools
    stepper: StepDispatcher
    registry: Mapping[str, StateFormat]
    rule: str
    label: str
    min_8bit_numel: int
    #: whether the distributed layout carries the keys of a plain AdamW's state, which make it refuse the dict
    #: (:func:`~lightning_baoc.optim.checkpoint.distributed.to_distributed`); off for the template of a checkpoint saved by
    #: an earlier release without them (:func:`~lightning_baoc.integrations.checkpoints.check_saved_shards`)
    refusal_keys: bool = True

    # ------------------------------------------------------------------ state dicts

    def state_dict(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        """The optimizer's state dict (see ``BlockwiseAdamW.state_dict``): the single-process layout, or
        the distributed one over sharded parameters."""
        state_dict = self.local_state_dict(groups)
        if any(is_sharded(p) for p in self.records):
            state_dict = to_distributed(state_dict, [p for g in groups for p in g["params"]], self.registry,
                                        self.refusal_keys)
        return state_dict if self.rule == "adamw" else with_refusal(state_dict)  # a plain SGD or Lion refuses it

    def local_state_dict(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        """The state dict of this rank in the single-process layout (:mod:`lightning_baoc.optim.checkpoint.layout`)."""
        state: dict[str, Any] = {}
        for p, rec in self.records.items():
            if rec.format is None:
                continue
            tensors = {k: t.clone() for k, t in rec.views.items()}
            state[rec.name] = make_entry(rec.format, local(p).shape, rec.step, rec.m_step, tensors)
        saved_groups = []
        for group in groups:
            saved = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            saved["params"] = [self.records[p].name for p in group["params"]]
            saved_groups.append(saved)
        meta = {
            "version": STATE_DICT_VERSION,
            "requested": {r.name: r.requested for r in self.records.values() if r.requested},
            "nonfinite": {r.name: r.nonfinite for r in self.records.values() if r.nonfinite},
        }
        if self.rule != "adamw":  # BlockwiseAdamW's dicts keep the layout of earlier releases
            meta["rule"] = self.rule
        corrections = {
            r.name: {"kind": r.correction, "tensor": r.master_correction.clone()}
            for r in self.records.values()
            if r.master_correction is not None
        }
        asked = {r.name: r.correction_requested for r in self.records.values() if r.correction_requested}
        if corrections or asked:  # dicts without corrections keep the layout of earlier releases
            meta["corrections"] = corrections
            meta["correction_requested"] = asked
        return seal_state_dict({"state": state, "param_groups": saved_groups, "baoc": meta})

    def to_adamw_state_dict(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        """A plain ``torch.optim.AdamW`` state dict (see ``BlockwiseAdamW.to_adamw_state_dict``)."""
        if self.rule != "adamw":
            raise TypeError(
                f"to_adamw_state_dict exports AdamW's state; {self.label} holds a {self.rule} momentum: "
                f"its to_torch_state_dict() is the plain {self.rule} state"
            )

        out = adamw_export(self.local_state_dict(groups), self._decode_held)
        params = [p for group in groups for p in group["params"]]
        for index, entry in out["state"].items():  # the whole of a sharded parameter's moments
            state = self.pools.decode(params[index])
            if state is not None and state.shards is not None:  # a factored shard: over the whole row mean
                entry["exp_avg_sq"] = state.dense_v().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = gather_full(entry[key], params[index])
        return out

    def to_momentum_state_dict(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        """A plain ``torch.optim.SGD`` or Lion state dict (see ``BlockwiseSGD.to_torch_state_dict``)."""
        out = momentum_export(self.local_state_dict(groups), self._decode_held)
        params = [p for group in groups for p in group["params"]]
        key = "momentum_buffer" if self.rule == "sgd" else "exp_avg"
        for index, entry in out["state"].items():  # the whole of a sharded parameter's buffer
            entry[key] = gather_full(entry[key], params[index])
        return out

    def _decode_held(self, name: str, fmt: str, shape: tuple[int, ...], tensors: Mapping[str, Tensor]) -> Canonical:
        """The state of entry ``name`` of this optimizer's own dict: a shard in the whole parameter's 8-bit
        groups read as held, any other entry decoded from its tensors."""
        p = self.names[name]
        if framed(self.records[p].views):
            return self.pools.decode(p)  # type: ignore[return-value] - it holds a state
        return decode_entry(name, fmt, shape, tensors, self.registry)

    # ------------------------------------------------------------------ loads

    @torch.no_grad()
    def load(
        self, state_dict: Mapping[str, Any], groups: list[dict[str, Any]], validate: Callable[[Any], LoadPlan],
        hyper_of: HyperOf,
    ) -> None:
        """Load ``state_dict`` (see ``BlockwiseAdamW.load_state_dict``): validated whole by ``validate``
        first, then committed at once. Parameters put into ``groups`` directly are taken in first."""
        state_dict = without_refusal(state_dict)  # the group that makes a plain SGD or Lion refuse the dict
        if is_distributed_layout(state_dict):  # a sharded optimizer's dict: this rank's shards
            state_dict = from_distributed(state_dict, self.names, self.registry, self.pools.layout)
        undo = self._adopt_assigned(state_dict, groups)
        try:
            plan = validate(state_dict)
        except BaseException:
            undo()
            raise
        self._apply(plan, groups, hyper_of)

    def _adopt_assigned(self, state_dict: Any, groups: list[dict[str, Any]]) -> Callable[[], None]:
        """Take in parameters put into the param groups directly, named by position from the state dict.

        Lightning's ``BaseFinetuning`` restores the param groups of a resumed run by assigning
        ``optimizer.param_groups``: the backbone it had added is there, but never passed through
        ``add_param_group``, so the optimizer has no record (no name) of it. The state dict being
        loaded names every parameter of every group; where a group holds as many parameters as the
        saved one, an unrecorded parameter takes the saved name at its position, as torch's own
        ``load_state_dict`` matches parameters by position. Returns the undo (the load may still
        be refused: then the optimizer is left exactly as it was).
        """
        before = {p: rec.group for p, rec in self.records.items()}
        adopted: list[Tensor] = []

        def undo() -> None:
            for p in adopted:
                rec = self.records.pop(p)
                self.names.pop(rec.name, None)
            for p, group in before.items():
                self.records[p].group = group

        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) and "baoc" in state_dict else None
        if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(groups):
            return undo
        for index, group in enumerate(groups):
            saved = saved_groups[index]
            listed = saved.get("params") if isinstance(saved, Mapping) else None
            if not isinstance(listed, (list, tuple)) or len(listed) != len(group["params"]):
                continue
            for p, name in zip(group["params"], listed):
                rec = self.records.get(p)
                if rec is not None:
                    rec.group = index  # the groups may have been re-ordered too
                elif (
                    isinstance(p, Tensor)
                    and isinstance(name, str)
                    and name not in self.names
                    and p.is_floating_point()
                    and not p.is_complex()
                    and not p.is_sparse
                ):
                    self.names[name] = p
                    self.records[p] = Record(name=name, group=index)
                    adopted.append(p)
        return undo

    def _apply(self, plan: LoadPlan, groups: list[dict[str, Any]], hyper_of: HyperOf) -> None:
        """Commit a validated load: build the new pools first, then swap everything in at once (or,
        where every parameter keeps the format it holds, write the states in place)."""
        merged = [
            {**{k: v for k, v in group.items() if k != "params"}, **update}
            for group, update in zip(groups, plan.groups)
        ]
        requested = plan.requested if plan.requested is not None else {p: r.requested for p, r in self.records.items()}
        formats: dict[Tensor, str] = {}
        for p, loaded in plan.entries.items():
            group = merged[self.records[p].group]
            formats[p] = loaded.format or resolve_in(
                self.registry, requested[p] or group["state_format"], p.shape, self.min_8bit_numel
            )

        def fill(p: Tensor, fmt: str, target: dict[str, Tensor]) -> None:
            source = plan.entries[p].source
            if isinstance(source, Canonical):
                rec = self.records[p]
                key = self.stepper.noise_key(rec, _LOAD_SALT, plan.entries[p].steps)
                self.registry[fmt].encode(source, target, hyper_of(merged[rec.group], key))
            else:
                for k, t in target.items():
                    t.copy_(source[k])

        held = {p: rec.format for p, rec in self.records.items() if rec.format is not None and rec.views is not None}
        if held == formats:
            # the same formats as held (a load into the template torch.distributed.checkpoint filled):
            # the states are written in place, so the load holds no second copy of them
            pools = self.pools.pools
            views = {p: self.records[p].views for p in formats}
            for p, fmt in formats.items():
                fill(p, fmt, views[p])
        else:
            pools, views = self.pools.fresh(formats, fill)
        corrections = None if plan.corrections is None else {
            p: (kind, None if t is None else t.to(p.device).clone(), asked)
            for p, (kind, t, asked) in plan.corrections.items()
        }
        # commit: nothing below can fail
        for group, update in zip(groups, plan.groups):
            group.update(update)
        self.pools.install(pools)
        for p, rec in self.records.items():
            loaded = plan.entries.get(p)
            rec.requested = requested[p]
            rec.nonfinite = plan.nonfinite.get(p, 0)
            rec.format = formats.get(p)
            rec.views = views.get(p)
            rec.step = loaded.steps if loaded else 0
            rec.m_step = loaded.m_step if loaded and self.registry[formats[p]].has_momentum else 0
            if corrections is not None:
                rec.correction, rec.master_correction, rec.correction_requested = corrections[p]
        self.pools.recount()

    # ------------------------------------------------------------------ copies

    def copy_state(self, attributes: Mapping[str, Any]) -> dict[str, Any]:
        """The state of a copy (``copy.deepcopy``, ``pickle``) of an optimizer whose plain attributes are
        ``attributes``: compact copies of the states, no pool views.

        torch's ``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``; here
        every attribute is kept except those tied to this process (:data:`RUNTIME_ONLY`) and the
        parameter ids naming groups added later. Records stay keyed by parameter, so deepcopy maps them
        through its memo to the copied parameters, as it does torch's ``state``. A skip the device decided
        is applied to the counts first.
        """
        self.stepper.apply_device_skips()
        state = {k: v for k, v in attributes.items() if k not in RUNTIME_ONLY}
        state["_external_names"] = {}  # ids of this process's tensors mean nothing in a copy
        state["_records"] = {p: dataclasses.replace(rec, views=None, unread_skip=None, counts=rec.counts.clone())
                             for p, rec in self.records.items()}
        state[_COPIED] = {
            "views": {p: {k: t.clone() for k, t in rec.views.items()}
                      for p, rec in self.records.items() if rec.views is not None},
            "peak_bytes": self.pools.peak_bytes,
            "warned": set(self.stepper.warned),
        }
        return state

    @staticmethod
    def take_copied(state: dict[str, Any]) -> dict[str, Any]:
        """The states :meth:`copy_state` added to ``state``, taken out of it."""
        return state.pop(_COPIED)

    def restore(self, copied: Mapping[str, Any]) -> None:
        """Build the pools of a copy from :meth:`copy_state`'s compact copies (``copied``: from
        :meth:`take_copied`)."""
        saved_views = copied["views"]
        self.stepper.warned.update(copied["warned"])
        self.pools.peak_bytes = copied["peak_bytes"]
        self.pools.live_bytes = 0  # the copy holds no state until its pools are built
        formats = {p: rec.format for p, rec in self.records.items() if rec.format is not None}

        def fill(p: Tensor, fmt: str, target: dict[str, Tensor]) -> None:
            for k, t in target.items():
                t.copy_(saved_views[p][k])

        pools, views = self.pools.fresh(formats, fill)
        self.pools.install(pools)
        for p, v in views.items():
            self.records[p].views = v
