"""Validation of an optimizer state dict before a load (:func:`plan_load`): nothing is changed here.

The whole dict is checked against what the optimizer holds (a :class:`LoadTarget`: groups,
hyperparameters, parameter names, every entry's format, counts, shape, tensors and checksum) and turned
into a :class:`LoadPlan`; ``BlockwiseAdamW.load_state_dict`` commits it only after building the new pools,
so every problem raises :class:`~lightning_baoc.optim.checkpoint.CheckpointError` with the optimizer untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from lightning_baoc.formats import Canonical, StateFormat, check_format_name
from lightning_baoc.formats.correction import CORRECTIONS, WEIGHT_DTYPES, correction_dtype
from lightning_baoc.optim.args import PERFORMANCE_HINTS
from lightning_baoc.optim.checkpoint.layout import (
    READABLE_VERSIONS,
    check_entry_fields,
    check_layout,
    invalid,
    meta_checksum,
    require_count,
    require_mapping,
)
from lightning_baoc.optim.pools import Record
from lightning_baoc.optim.sharding import local, this_shard

_TORCH_IMPLEMENTATION_KEYS = PERFORMANCE_HINTS + ("capturable", "differentiable")


@dataclass(frozen=True)
class LoadTarget:
    """What a state dict is validated against: the optimizer's groups, parameters and update rule, as it
    holds them now (the optimizer builds one for each load; nothing here is changed).

    Attributes:
        param_groups: the optimizer's param groups.
        names: parameter name -> parameter (read when the load is validated: parameters adopted from the
            dict's names first are in it).
        records: parameter -> its record (its name, and where its shard starts).
        format_registry: the formats its parameters may be held in.
        rule: its update rule (``"adamw"``, ``"sgd"``, ``"lion"``); a dict of another rule is refused.
        label: the name its messages use.
        saved_group_keys: the hyperparameters every param group of its own dicts carries.
        validate_group: validates a merged group's hyperparameters (errors name ``where + key``).
    """

    param_groups: list[dict[str, Any]]
    names: Mapping[str, Tensor]
    records: Mapping[Tensor, Record]
    format_registry: Mapping[str, StateFormat]
    rule: str
    label: str
    saved_group_keys: tuple[str, ...]
    validate_group: Callable[[Mapping[str, Any], str], None]

    def param_name(self, p: Tensor) -> str:
        """The name ``p`` is held under."""
        return self.records[p].name


@dataclass
class LoadedState:
    """One parameter's state as validated: compact tensors of ``format``, or fp32 moments to encode."""

    format: str | None  # None: the parameter's target format (a torch state is encoded into it)
    source: dict[str, Tensor] | Canonical
    steps: int
    m_step: int


@dataclass
class LoadPlan:
    """Everything a load changes, validated; applying it cannot fail on the dict's contents."""

    groups: list[dict[str, Any]]  # per group: the saved keys (params excluded) to set
    entries: dict[Tensor, LoadedState]
    requested: dict[Tensor, str | None] | None  # None: keep the requests (torch dicts carry none)
    nonfinite: dict[Tensor, int]
    #: parameter -> (correction, its tensor or None, the explicit request or None); None: keep them
    corrections: dict[Tensor, tuple[str, Tensor | None, str | None]] | None = None



def plan_load(target: LoadTarget, state_dict: Any) -> LoadPlan:
    """Validate a whole state dict against ``target`` (the optimizer as it is) and return what loading it changes.

    Raises:
        CheckpointError: anything wrong, named; nothing is touched.
    """
    sd = require_mapping(state_dict, "state_dict")
    for key in ("state", "param_groups"):
        if key not in sd:
            raise invalid(f"the key {key!r} is missing (expected an optimizer state dict with 'state' and 'param_groups')")
    if not isinstance(sd["param_groups"], (list, tuple)):
        raise invalid(f"'param_groups' should be a list, got {type(sd['param_groups']).__name__}")
    if len(sd["param_groups"]) != len(target.param_groups):
        raise invalid(
            f"the state dict has {len(sd['param_groups'])} param groups, this optimizer has "
            f"{len(target.param_groups)}: it was saved from another model or optimizer setup"
        )
    require_mapping(sd["state"], "'state'")
    if "baoc" in sd:
        return _plan_own(target, sd)
    return _plan_torch(target, sd)


def _merged_hyper(target: LoadTarget, index: int, saved: Mapping[str, Any], drop: tuple[str, ...]) -> dict[str, Any]:
    update = {k: v for k, v in saved.items() if k not in ("params", "param_names") + drop}
    merged = {k: v for k, v in target.param_groups[index].items() if k not in ("params", "param_names")}
    merged.update(update)
    try:
        target.validate_group(merged, f"param_groups[{index}].")
    except (TypeError, ValueError) as err:
        raise invalid(str(err)) from err
    return update


def _plan_own(target: LoadTarget, sd: Mapping[str, Any]) -> LoadPlan:
    meta = require_mapping(sd["baoc"], "'baoc'")
    version = meta.get("version")
    if version not in READABLE_VERSIONS:
        raise invalid(
            f"'baoc'['version'] is {version!r}; this release reads versions {list(READABLE_VERSIONS)}: "
            f"save it with a matching lightning_baoc release"
        )
    if version >= 2:
        if not isinstance(meta.get("checksum"), int):
            raise invalid("the field 'checksum' of 'baoc' is missing or not an int")
        try:
            actual = meta_checksum(sd)
        except (TypeError, AttributeError, KeyError) as err:
            raise invalid(f"the 'baoc' section's checksum cannot be computed: {err!r}") from err
        if actual != meta["checksum"]:
            raise invalid(
                "the checksum of the state dict's metadata (param groups, parameter names, "
                "requested formats, non-finite counts, entries) does not match: the "
                "checkpoint is corrupted, or was edited (re-seal a deliberate edit with "
                "lightning_baoc.optim.checkpoint.seal_state_dict)"
            )
    rule = meta.get("rule", "adamw")  # dicts of BlockwiseAdamW carry no rule
    if rule != target.rule:
        raise invalid(
            f"the state dict was saved by an optimizer with the {rule!r} update rule, this is "
            f"{target.label} ({target.rule!r}): their states do not carry over; load it into the "
            f"optimizer that saved it"
        )
    names = target.names
    groups = []
    for i, saved in enumerate(sd["param_groups"]):
        saved = require_mapping(saved, f"param_groups[{i}]")
        listed = saved.get("params")
        if not isinstance(listed, (list, tuple)) or not all(isinstance(n, str) for n in listed):
            raise invalid(f"param_groups[{i}]['params'] should be a list of parameter names, got {listed!r:.80}")
        unknown = [n for n in listed if n not in names]
        if unknown:
            raise invalid(f"param group {i} of the state dict names unknown parameters {unknown[:5]}; it was saved from another model")
        ours = [target.param_name(p) for p in target.param_groups[i]["params"]]
        if sorted(listed) != sorted(ours):
            raise invalid(
                f"param group {i} of the state dict holds the parameters {sorted(set(listed) ^ set(ours))[:5]} "
                f"that this optimizer's group {i} does not (or lacks them): another model or grouping"
            )
        for key in target.saved_group_keys:
            if key not in saved:
                raise invalid(f"param_groups[{i}]: the field {key!r} is missing")
        groups.append(_merged_hyper(target, i, saved, ()))
    entries: dict[Tensor, LoadedState] = {}
    for name, entry in sd["state"].items():
        if name not in names:
            raise invalid(f"the state dict holds state of unknown parameter {name!r}; it was saved from another model")
        entries[names[name]] = _own_entry(name, entry, names[name], version, target.format_registry,
                                          target.records[names[name]].shard_offset)
    return LoadPlan(
        groups=groups,
        entries=entries,
        requested=_requested(meta.get("requested", {}), names, target.format_registry),
        nonfinite=_nonfinite(meta.get("nonfinite", {}), names),
        corrections=_corrections(meta.get("corrections", {}), meta.get("correction_requested", {}), names),
    )

def _own_entry(name: str, entry: Any, p: Tensor, version: int, registry: Mapping[str, StateFormat],
               offset: int) -> LoadedState:
    """The checked state of parameter ``p`` (its shard, starting at element ``offset`` of the whole, the
    record's ``shard_offset``)."""
    fmt, steps, m_step, tensors = check_entry_fields(name, entry, version, registry)
    if version >= 2 and list(entry["shape"]) != list(local(p).shape):
        raise invalid(
            f"state of {name!r}: saved for shape {list(entry['shape'])}, the parameter has shape "
            f"{tuple(local(p).shape)}: the state dict is of another model"
        )
    check_layout(name, fmt, tuple(local(p).shape), tensors, exact_shape=version >= 2, registry=registry,
                 offset=offset)
    return LoadedState(fmt, tensors, steps, m_step)


def _requested(value: Any, names: Mapping[str, Tensor], registry: Mapping[str, StateFormat]) -> dict[Tensor, str | None]:
    requested = require_mapping(value, "'baoc'['requested']")
    out: dict[Tensor, str | None] = {p: None for p in names.values()}
    for name, fmt in requested.items():
        if name not in names:
            raise invalid(f"'requested' names unknown parameter {name!r}")
        try:
            out[names[name]] = check_format_name(fmt, f"requested format of {name!r}", registry)
        except (TypeError, ValueError) as err:
            raise invalid(str(err)) from err
    return out


def _nonfinite(value: Any, names: Mapping[str, Tensor]) -> dict[Tensor, int]:
    counts = require_mapping(value, "'baoc'['nonfinite']")
    out: dict[Tensor, int] = {}
    for name in counts:
        if name not in names:
            raise invalid(f"'nonfinite' names unknown parameter {name!r}")
        out[names[name]] = require_count(counts, name, "'baoc'['nonfinite']")
    return out


def _corrections(
    held: Any, asked: Any, names: Mapping[str, Tensor]
) -> dict[Tensor, tuple[str, Tensor | None, str | None]]:
    """The master-weight corrections of a dict: every parameter's (kind, tensor, request)."""
    held = require_mapping(held, "'baoc'['corrections']")
    asked = require_mapping(asked, "'baoc'['correction_requested']")
    out: dict[Tensor, tuple[str, Tensor | None, str | None]] = {p: ("none", None, None) for p in names.values()}
    for name, kind in asked.items():
        if name not in names:
            raise invalid(f"'correction_requested' names unknown parameter {name!r}")
        if kind not in CORRECTIONS:
            raise invalid(f"'correction_requested' of {name!r} is {kind!r}; allowed: {list(CORRECTIONS)}")
        out[names[name]] = ("none", None, kind)
    for name, entry in held.items():
        where = f"'baoc'['corrections'][{name!r}]"
        if name not in names:
            raise invalid(f"'corrections' names unknown parameter {name!r}")
        p = names[name]
        entry = require_mapping(entry, where)
        kind, tensor = entry.get("kind"), entry.get("tensor")
        if kind not in CORRECTIONS or kind == "none":
            raise invalid(f"{where}: 'kind' is {kind!r}; allowed: {[k for k in CORRECTIONS if k != 'none']}")
        if p.dtype not in WEIGHT_DTYPES:
            raise invalid(f"{where}: the parameter is {p.dtype}, a correction belongs to a bf16 or fp16 parameter: another model or precision")
        dtype = correction_dtype(kind)
        if not isinstance(tensor, Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != tuple(local(p).shape):
            got = f"{tensor.dtype} of shape {tuple(tensor.shape)}" if isinstance(tensor, Tensor) else type(tensor).__name__
            raise invalid(f"{where}: 'tensor' should be {dtype} of shape {tuple(local(p).shape)}, got {got}")
        out[p] = (kind, tensor, out[p][2])
    return out


def _plan_torch(target: LoadTarget, sd: Mapping[str, Any]) -> LoadPlan:
    index_to_param: dict[Any, Tensor] = {}
    groups = []
    for i, (saved, group) in enumerate(zip(sd["param_groups"], target.param_groups)):
        saved = require_mapping(saved, f"param_groups[{i}]")
        listed = saved.get("params")
        if not isinstance(listed, (list, tuple)):
            raise invalid(f"param_groups[{i}]['params'] should be a list, got {listed!r:.80}")
        if len(listed) != len(group["params"]):
            raise invalid(
                f"param group {i} of the state dict has {len(listed)} parameters, this optimizer's "
                f"has {len(group['params'])}: another model or grouping"
            )
        if saved.get("amsgrad") and target.rule == "adamw":
            raise invalid(f"param_groups[{i}] has amsgrad=True: BlockwiseAdamW does not implement amsgrad")
        index_to_param.update(zip(listed, group["params"]))
        groups.append(_merged_hyper(target, i, saved, _TORCH_IMPLEMENTATION_KEYS))
    entries: dict[Tensor, LoadedState] = {}
    for key, entry in sd["state"].items():
        if key not in index_to_param:
            raise invalid(f"state entry {key!r} belongs to no parameter of the state dict's param groups")
        p = index_to_param[key]
        if target.rule == "adamw":
            entries[p] = _torch_entry(target.param_name(p), key, entry, p)
        else:
            entries[p] = _torch_momentum_entry(target, target.param_name(p), key, entry, p)
    return LoadPlan(groups=groups, entries=entries, requested=None, nonfinite={})


#: Why an entry comes without its section: torch.distributed.checkpoint keeps only "state" and
#: "param_groups" of an optimizer's dict.
_STRIPPED = (
    " (torch.distributed.checkpoint's get_/set_optimizer_state_dict keep only 'state' and 'param_groups', as "
    "Lightning's ModelParallelStrategy and Fabric's FSDP2 checkpoints do: they cannot carry these states yet; "
    "checkpoint the optimizer's own state_dict() per rank, or to_adamw_state_dict() on every rank)"
)


def _torch_entry(name: str, key: Any, entry: Any, p: Tensor) -> LoadedState:
    where = f"state of {name!r} (entry {key!r})"
    entry = require_mapping(entry, where)
    if "format" in entry and "tensors" in entry:
        raise invalid(f"{where} is a BlockwiseAdamW entry, but the dict's 'baoc' section is missing{_STRIPPED}")
    if "max_exp_avg_sq" in entry:
        raise invalid(f"{where} holds amsgrad state (max_exp_avg_sq): BlockwiseAdamW does not implement amsgrad")
    moments = {}
    for k in ("exp_avg", "exp_avg_sq"):
        t = entry.get(k)
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise invalid(f"{where}: {k!r} is missing or not a floating-point tensor (keys {sorted(map(str, entry))})")
        t = this_shard(t, p)  # a whole state into a sharded parameter: this rank's rows
        if tuple(t.shape) != tuple(local(p).shape):
            raise invalid(f"{where}: {k} has shape {tuple(t.shape)}, the parameter has shape {tuple(local(p).shape)}: another model")
        moments[k] = t.to(p.device, torch.float32)
        if not bool(torch.isfinite(moments[k]).all()) or (k == "exp_avg_sq" and bool((moments[k] < 0).any())):
            raise invalid(f"{where}: {k} holds {'negative or ' if k == 'exp_avg_sq' else ''}non-finite values")
    step = entry.get("step")
    if isinstance(step, Tensor) and step.numel() == 1:
        step = step.item()
    if not isinstance(step, (int, float)) or isinstance(step, bool) or not (math.isfinite(step) and step >= 0 and step == int(step)):
        raise invalid(f"{where}: 'step' is {entry.get('step')!r}; expected a whole number >= 0")
    canonical = Canonical(tuple(local(p).shape), exp_avg=moments["exp_avg"], exp_avg_sq=moments["exp_avg_sq"])
    return LoadedState(None, canonical, int(step), int(step))


#: The key of the momentum buffer in the state of torch's SGD and of the usual Lion implementations.
_TORCH_BUFFERS = {"sgd": "momentum_buffer", "lion": "exp_avg"}


def _torch_momentum_entry(target: LoadTarget, name: str, key: Any, entry: Any, p: Tensor) -> LoadedState:
    """An entry of ``torch.optim.SGD`` (``momentum_buffer``, possibly ``None``) or of a Lion
    implementation (``exp_avg``): the buffer, taken as already started (one step counted)."""
    where = f"state of {name!r} (entry {key!r})"
    entry = require_mapping(entry, where)
    if "format" in entry and "tensors" in entry:
        raise invalid(f"{where} is a {target.label} entry, but the dict's 'baoc' section is missing{_STRIPPED}")
    buffer_key = _TORCH_BUFFERS[target.rule]
    if buffer_key not in entry:
        raise invalid(f"{where}: {buffer_key!r} is missing (keys {sorted(map(str, entry))}): not a {target.rule} state")
    t = entry[buffer_key]
    if t is None:  # torch's SGD without momentum
        return LoadedState(None, Canonical(tuple(local(p).shape)), 0, 0)
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise invalid(f"{where}: {buffer_key!r} is not a floating-point tensor")
    t = this_shard(t, p)
    if tuple(t.shape) != tuple(local(p).shape):
        raise invalid(f"{where}: {buffer_key} has shape {tuple(t.shape)}, the parameter has shape {tuple(local(p).shape)}: another model")
    buffer = t.to(p.device, torch.float32)
    if not bool(torch.isfinite(buffer).all()):
        raise invalid(f"{where}: {buffer_key} holds non-finite values")
    return LoadedState(None, Canonical(tuple(local(p).shape), exp_avg=buffer), 1, 1)
