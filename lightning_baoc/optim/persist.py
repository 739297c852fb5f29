"""Persistence of :class:`~lightning_baoc.optim.BlockwiseAdamW`: state dicts, loads, copies, pickles.

:class:`PersistenceMixin` holds the optimizer's ``state_dict``/``load_state_dict`` (layout and
checksums: :mod:`lightning_baoc.optim.checkpoint`; validation: :mod:`lightning_baoc.optim.validate`)
and its ``copy.deepcopy``/``pickle`` support. A load validates everything first and then commits
at once, so a refused dict leaves the optimizer unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from typing import IO, Any, Callable, Mapping

import torch
from torch import Tensor

from lightning_baoc.formats import Canonical, StepHyper, resolve_in
from lightning_baoc.formats.frames import framed
from lightning_baoc.optim.checkpoint import (
    STATE_DICT_VERSION,
    CheckpointError,
    adamw_export,
    decode_entry,
    load_checkpoint,
    make_entry,
    seal_state_dict,
)
from lightning_baoc.optim.device_plan import CountsStore
from lightning_baoc.optim.distributed import (
    from_distributed,
    is_distributed_layout,
    to_distributed,
)
from lightning_baoc.optim.pools import Pool, Record
from lightning_baoc.optim.sharding import gather_full, is_sharded, local
from lightning_baoc.optim.validate import LoadPlan, plan_load

#: Attributes that only tie an optimizer to its process (hooks, an LR scheduler's wrapper of
#: ``step``): not copied or pickled, as torch's own ``Optimizer.__getstate__`` does not.
_RUNTIME_ONLY = frozenset({
    "step", "_opt_called", "_zero_grad_profile_name", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
})
#: Mixed into the rounding key of a state encoded at load (a torch state into a bf16 format).
_LOAD_SALT = 0x10AD5A17


class PersistenceMixin:
    """State dicts, loads and copies of BlockwiseAdamW (see the module docstring)."""

    # provided by the optimizer this is mixed into
    _records: dict[Tensor, Record]
    _names: dict[str, Tensor]
    _pools: dict[tuple[str, str], Pool]
    param_groups: list[dict[str, Any]]
    seed: int
    min_8bit_numel: int
    nonfinite_counts: dict[str, int]
    _optimizer_state_dict_pre_hooks: dict[int, Callable[..., Any]]
    _optimizer_state_dict_post_hooks: dict[int, Callable[..., Any]]
    _optimizer_load_state_dict_pre_hooks: dict[int, Callable[..., Any]]
    _optimizer_load_state_dict_post_hooks: dict[int, Callable[..., Any]]
    _hyper: Callable[..., StepHyper]
    _fresh_pools: Callable[..., tuple[dict[tuple[str, str], Pool], dict[Tensor, dict[str, Tensor]]]]

    def __getstate__(self) -> dict[str, Any]:
        """State for ``copy.deepcopy`` and ``pickle``: compact copies of the states, no pool views.

        torch's ``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``;
        here every attribute is kept except those tied to this process (:data:`_RUNTIME_ONLY`) and
        the parameter ids naming groups added later. Records stay keyed by parameter, so deepcopy
        maps them through its memo to the copied parameters, as it does torch's ``state``.
        """
        self._settle_deferred()  # type: ignore[attr-defined] - a step decided on the device: its counts settled
        state = {k: v for k, v in self.__dict__.items() if k not in _RUNTIME_ONLY}
        state["_deferred"] = []
        state["_serving"] = {}  # keyed by this process's state tensors: decided again in a copy
        state["_plans"] = {}  # they hold this process's state tensors: planned again in a copy
        state["_count_store"] = CountsStore()  # each copied record holds its own counts (below)
        # gradient release: hooks live on this process's parameters; the copy registers its own
        state["_release_handles"], state["_released"] = [], set()
        state["_gradient_observers"] = OrderedDict()  # like hooks: the copy has none
        state["_release_on"] = bool(self.__dict__.get("_release_handles"))
        state["_records"] = {p: dataclasses.replace(rec, views=None, pending=None, counts=rec.counts.clone())
                             for p, rec in self._records.items()}
        state["_pools"] = {}
        state["_external_names"] = {}  # ids of this process's tensors mean nothing in a copy
        state["_saved_views"] = {
            p: {k: t.clone() for k, t in rec.views.items()} for p, rec in self._records.items() if rec.views is not None
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the pools from :meth:`__getstate__`'s compact copies (see there)."""
        saved_views = state.pop("_saved_views", {})
        release_on = state.pop("_release_on", False)
        state.setdefault("_release_handles", [])
        state.setdefault("_released", set())
        state.setdefault("_gradient_observers", OrderedDict())
        state.setdefault("_salts", {})
        state.setdefault("_warned", set())
        state.setdefault("_deferred", [])
        state.setdefault("_targets", {})
        state.setdefault("_serving", {})
        state.setdefault("_plans", {})
        state.setdefault("_count_store", CountsStore())
        state.pop("_generators", None)  # pickles of earlier releases: the rounding is keyed now
        state.setdefault("kernels", "auto")
        super().__setstate__(state)  # torch's: hooks, the profiled step
        formats = {p: rec.format for p, rec in self._records.items() if rec.format is not None}

        def fill(p: Tensor, fmt: str, target: dict[str, Tensor]) -> None:
            for k, t in target.items():
                t.copy_(saved_views[p][k])

        self._live_bytes = 0  # the copy holds no state until its pools are built
        self._pools, views = self._fresh_pools(formats, fill)
        self._drop_plans()  # type: ignore[attr-defined] - a plan holds the old views
        for p, v in views.items():
            self._records[p].views = v
        if release_on:
            self.release_gradients()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Compact state keyed by parameter name; loads under ``torch.load(weights_only=True)``.

        Layout and checksums: :mod:`lightning_baoc.optim.checkpoint`. 8-bit states stay 8-bit. Tensors
        are copies (views of one pool in several dtypes cannot be serialized together). Handed to
        a plain ``torch.optim.AdamW``, the dict fails at load with a message that names BAOC and
        the fix (resume with the callback, or :func:`~lightning_baoc.export_adamw_state_dict`).
        Over sharded parameters (FSDP2's ``DTensor``) the dict is in the distributed layout
        (:mod:`lightning_baoc.optim.distributed`), which ``torch.distributed.checkpoint`` saves and
        loads whole: each rank's compact tensors as its row of a ``DTensor``.
        Hooks registered with torch's ``register_state_dict_pre_hook``/``post_hook`` run as in torch.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._local_state_dict()
        if any(is_sharded(p) for p in self._records):
            state_dict = to_distributed(state_dict, self)  # type: ignore[arg-type]
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    def _local_state_dict(self) -> dict[str, Any]:
        """The state dict of this rank in the single-process layout (:mod:`lightning_baoc.optim.checkpoint`)."""
        state: dict[str, Any] = {}
        for p, rec in self._records.items():
            if rec.format is None:
                continue
            tensors = {k: t.clone() for k, t in rec.views.items()}
            state[rec.name] = make_entry(rec.format, local(p).shape, rec.step, rec.m_step, tensors)
        groups = []
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            saved["params"] = [self._records[p].name for p in group["params"]]
            groups.append(saved)
        meta = {
            "version": STATE_DICT_VERSION,
            "requested": {r.name: r.requested for r in self._records.values() if r.requested},
            "nonfinite": self.nonfinite_counts,
        }
        if self.rule != "adamw":  # BlockwiseAdamW's dicts keep the layout of earlier releases
            meta["rule"] = self.rule
        corrections = {
            r.name: {"kind": r.correction, "tensor": r.master_correction.clone()}
            for r in self._records.values()
            if r.master_correction is not None
        }
        asked = {r.name: r.correction_requested for r in self._records.values() if r.correction_requested}
        if corrections or asked:  # dicts without corrections keep the layout of earlier releases
            meta["corrections"] = corrections
            meta["correction_requested"] = asked
        return seal_state_dict({"state": state, "param_groups": groups, "baoc": meta})

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this class (versions 1 and 2), or of ``torch.optim.AdamW``/``Adam``.

        The whole dict is validated first (groups, hyperparameters, every entry's format, counts,
        shape, tensors and checksum); only then is anything changed, so a refused
        dict leaves the optimizer exactly as it was. A BlockwiseAdamW state is matched by parameter
        name (order may differ); a torch state by position, its fp32 moments encoded into each
        parameter's target format. torch's own ``Optimizer.load_state_dict`` would cast every state
        tensor to the parameter's dtype (int8 codes would become floats): this is a full override.

        The stochastic rounding needs no saved state (it is keyed by seed, name and step count):
        the generator states that dicts of earlier releases carry are ignored (their checksum still
        covers them). Hooks registered with torch's
        ``register_load_state_dict_pre_hook``/``post_hook`` run as in torch.

        Raises:
            CheckpointError: the dict is damaged, invalid or of another model; the message names
                the parameter and the key.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        if is_distributed_layout(state_dict):  # a sharded optimizer's dict: this rank's shards
            state_dict = from_distributed(state_dict, self)  # type: ignore[arg-type]
        undo = self._adopt_assigned(state_dict)
        try:
            plan = plan_load(self, state_dict)
        except BaseException:
            undo()
            raise
        self._apply(plan)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _adopt_assigned(self, state_dict: Any) -> Callable[[], None]:
        """Take in parameters put into ``param_groups`` directly, named by position from the state dict.

        Lightning's ``BaseFinetuning`` restores the param groups of a resumed run by assigning
        ``optimizer.param_groups``: the backbone it had added is there, but never passed through
        :meth:`add_param_group`, so the optimizer has no record (no name) of it. The state dict being
        loaded names every parameter of every group; where a group holds as many parameters as the
        saved one, an unrecorded parameter takes the saved name at its position, as torch's own
        ``load_state_dict`` matches parameters by position. Returns the undo (the load may still
        be refused: then the optimizer is left exactly as it was).
        """
        before = {p: rec.group for p, rec in self._records.items()}
        adopted: list[Tensor] = []

        def undo() -> None:
            for p in adopted:
                rec = self._records.pop(p)
                self._names.pop(rec.name, None)
            for p, group in before.items():
                self._records[p].group = group

        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) and "baoc" in state_dict else None
        if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(self.param_groups):
            return undo
        for index, group in enumerate(self.param_groups):
            saved = saved_groups[index]
            listed = saved.get("params") if isinstance(saved, Mapping) else None
            if not isinstance(listed, (list, tuple)) or len(listed) != len(group["params"]):
                continue
            for p, name in zip(group["params"], listed):
                rec = self._records.get(p)
                if rec is not None:
                    rec.group = index  # the groups may have been re-ordered too
                elif (
                    isinstance(p, Tensor)
                    and isinstance(name, str)
                    and name not in self._names
                    and p.is_floating_point()
                    and not p.is_complex()
                    and not p.is_sparse
                ):
                    self._names[name] = p
                    self._records[p] = Record(name=name, group=index)
                    adopted.append(p)
        return undo

    def load_checkpoint(self, path_or_file: str | os.PathLike[str] | IO[bytes]) -> None:
        """Load an optimizer state dict saved with ``torch.save`` (damaged files: CheckpointError).

        The file holds this optimizer's ``state_dict()``, or is a Lightning checkpoint with exactly
        one optimizer state (``"optimizer_states"``).

        Example:
            >>> opt.load_checkpoint("optimizer.pt")  # doctest: +SKIP
        """
        loaded = load_checkpoint(path_or_file)
        if isinstance(loaded, Mapping) and "optimizer_states" in loaded and "state" not in loaded:
            states = loaded["optimizer_states"]
            if not isinstance(states, (list, tuple)) or len(states) != 1:
                count = len(states) if isinstance(states, (list, tuple)) else type(states).__name__
                raise CheckpointError(
                    f"the checkpoint holds {count} optimizer states; load the one of this optimizer "
                    f"with load_state_dict(load_checkpoint(path)['optimizer_states'][i])"
                )
            loaded = states[0]
        self.load_state_dict(loaded)

    def _apply(self, plan: LoadPlan) -> None:
        """Commit a validated load: build the new pools first, then swap everything in at once (or,
        where every parameter keeps the format it holds, write the states in place)."""
        merged = [
            {**{k: v for k, v in group.items() if k != "params"}, **update}
            for group, update in zip(self.param_groups, plan.groups)
        ]
        requested = plan.requested if plan.requested is not None else {p: r.requested for p, r in self._records.items()}
        formats: dict[Tensor, str] = {}
        for p, loaded in plan.entries.items():
            group = merged[self._records[p].group]
            formats[p] = loaded.format or resolve_in(
                self.format_registry, requested[p] or group["state_format"], p.shape, self.min_8bit_numel
            )

        def fill(p: Tensor, fmt: str, target: dict[str, Tensor]) -> None:
            source = plan.entries[p].source
            if isinstance(source, Canonical):
                rec = self._records[p]
                key = self._noise_key(rec, _LOAD_SALT, plan.entries[p].steps)
                hyper = self._hyper(merged[rec.group], key)
                self.format_registry[fmt].encode(source, target, hyper)
            else:
                for k, t in target.items():
                    t.copy_(source[k])

        held = {p: rec.format for p, rec in self._records.items() if rec.format is not None and rec.views is not None}
        if held == formats:
            # the same formats as held (a load into the template torch.distributed.checkpoint filled):
            # the states are written in place, so the load holds no second copy of them
            pools = self._pools
            views = {p: self._records[p].views for p in formats}
            for p, fmt in formats.items():
                fill(p, fmt, views[p])
        else:
            pools, views = self._fresh_pools(formats, fill)
        corrections = None if plan.corrections is None else {
            p: (kind, None if t is None else t.to(p.device).clone(), asked)
            for p, (kind, t, asked) in plan.corrections.items()
        }
        # commit: nothing below can fail
        for group, update in zip(self.param_groups, plan.groups):
            group.update(update)
        self._pools = pools
        self._drop_plans()  # type: ignore[attr-defined] - a plan holds the old views
        self._live_bytes = 0  # recounted below, once the records point at the new pools
        for p, rec in self._records.items():
            loaded = plan.entries.get(p)
            rec.requested = requested[p]
            rec.nonfinite = plan.nonfinite.get(p, 0)
            rec.format = formats.get(p)
            rec.views = views.get(p)
            self._mark_state(p)
            rec.step = loaded.steps if loaded else 0
            rec.m_step = loaded.m_step if loaded and self.format_registry[formats[p]].has_momentum else 0
            if corrections is not None:
                rec.correction, rec.master_correction, rec.correction_requested = corrections[p]
        self._live_bytes = int(self.state_bytes())  # type: ignore[attr-defined]

    def to_adamw_state_dict(self) -> dict[str, Any]:
        """Export as a plain ``torch.optim.AdamW`` state dict (fp32, dequantized).

        Factored second moments are expanded; formats without momentum export a zero momentum with
        their own step count (documented loss: a plain AdamW resumes with a cold momentum there).
        Same as :func:`~lightning_baoc.export_adamw_state_dict` of :meth:`state_dict`. Over sharded
        parameters (FSDP2) it holds the whole moments, gathered from every rank: call it on every rank;
        it loads into a run of any world size, one process included (each rank takes its rows).
        """
        if self.rule != "adamw":
            raise TypeError(
                f"to_adamw_state_dict exports AdamW's state; {self.label} holds a {self.rule} momentum: "
                f"save its state_dict(), or read each buffer with param_state(name).exp_avg"
            )
        def decode(name: str, fmt: str, shape: tuple[int, ...], tensors: Mapping[str, Tensor]) -> Canonical:
            p = self._names[name]  # type: ignore[attr-defined]
            if framed(self._records[p].views):  # a shard in the whole parameter's 8-bit groups: read as held
                return self.param_state(p)  # type: ignore[attr-defined]
            return decode_entry(name, fmt, shape, tensors)

        out = adamw_export(self._local_state_dict(), decode)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entry in out["state"].items():  # the whole of a sharded parameter's moments
            state = self.param_state(params[index])  # type: ignore[attr-defined]
            if state is not None and state.shards is not None:  # a factored shard: over the whole row mean
                entry["exp_avg_sq"] = state.dense_v().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = gather_full(entry[key], params[index])
        return out
