"""The state dict of an optimizer over sharded parameters, laid out for ``torch.distributed.checkpoint``.

``torch.distributed.checkpoint`` (DCP: Lightning's ``ModelParallelStrategy``, Fabric's FSDP2
``save``/``load``, ``get_optimizer_state_dict``) treats an optimizer state dict in its own way:

- it keeps only ``"state"`` and ``"param_groups"``, and re-keys the state from parameter positions
  to the parameters' fully qualified names;
- a plain tensor or any other value under the same key on every rank is taken as replicated: one
  rank's copy is written. Only a ``DTensor`` is saved shard by shard.

So when the optimizer holds a ``DTensor`` parameter, ``state_dict()`` returns this *distributed
layout*, which carries the same content as the single-process layout
(:mod:`lightning_baoc.optim.checkpoint.layout`) in a form DCP saves whole::

    {"state": {position: {"name": str, "format": str, "steps": int, "m_step": int, "step": FOREIGN_STEP,
                          ["exp_avg": FOREIGN_STEP, "exp_avg_sq": FOREIGN_STEP] (AdamW's),
                          "shape": global shape, "tensors": {key: DTensor (shards, longest)},
                          "checksum": DTensor (shards, 1), "requested": str | None, "nonfinite": int,
                          ["correction": {"kind": str, "tensor": DTensor like the parameter}],
                          ["correction_requested": str]}},
     "param_groups": [{hyperparameters..., "params": [positions], "param_names": [names],
                       "baoc": {"version": 2, "layout": "distributed", "checksum": int, ["rule": str]}}]}

- Every compact tensor of a sharded parameter (8-bit codes, scales, exponents, bf16 or fp32 moments)
  is this rank's flat tensor as one row of a ``DTensor`` with one row per shard, padded to the
  longest shard's length and placed like the parameter (``Shard(0)`` over the shard dimension of its
  mesh, replicated over the others): DCP saves each rank's row. Its length on load follows from the
  format and this rank's shard, so the padding is dropped exactly. The rows are saved as they are,
  so a resume on the same world size continues to the bit; another world size takes
  ``to_adamw_state_dict()`` (whole fp32 moments), which loads into any.
- The entry checksum of a sharded parameter differs per rank: it is a ``DTensor`` too. Everything
  else is the same on every rank (formats, counts, requests, non-finite counts, groups) and is
  covered by the ``"baoc"`` checksum in every group, which leaves out the per-rank checksums.
- A tensor of a parameter that is not sharded is the same on every rank and stays a plain tensor.

:func:`to_distributed` builds the layout from the single-process one, :func:`from_distributed`
takes it back (on load, with this rank's shards), so everything else (validation, checksums of
the tensors, the all-or-nothing load) is the single-process path. DCP loads into a template of the
optimizer's current formats: :func:`saved_formats` reads the saved ones, to set them first.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from lightning_baoc.formats import StateFormat
from lightning_baoc.optim.checkpoint.layout import (
    FOREIGN_STEP,
    LAYOUT,
    STATE_DICT_VERSION,
    CheckpointError,
    digest_value,
    meta_checksum,
)
from lightning_baoc.optim.sharding import (
    DTensor,
    as_dtensor,
    is_sharded,
    largest_shard_shape,
    local,
    shard_count,
    shard_shape,
)



#: The keys of a plain AdamW's state that an AdamW entry of the distributed layout carries (:func:`to_distributed`).
REFUSAL_KEYS = ("exp_avg", "exp_avg_sq")
#: The keys of a plain AdamW's param group that BlockwiseAdamW's groups lack: added with them (DCP fills a plain
#: template key by key: one missing is its error before any load), named in the metadata's ``"added"`` and dropped
#: again at load.
REFUSAL_GROUP_KEYS = {"foreach": None, "fused": None}


def _longest(fmt: StateFormat, p: Tensor) -> dict[str, int]:
    """Each compact tensor's longest length over the shards of ``p`` (the rows of its distributed
    layout): the longest of every shard's layout in the whole parameter's 8-bit groups (a shard starting
    inside a group touches one more than its size: ``formats.frames``)."""
    shards = getattr(shard_shape(p), "shards", None) or [(largest_shard_shape(p), 0)]
    longest: dict[str, int] = {}
    for shape, offset in shards:
        for spec in fmt.shard_layout(shape, offset):
            longest[spec.key] = max(longest.get(spec.key, 0), spec.numel)
    return longest


def _rows(t: Tensor, p: Tensor, longest: int) -> Tensor:
    """``t`` (this rank's flat tensor) as its row of a ``DTensor`` with one row per shard of ``p``."""
    row = torch.zeros(1, longest, dtype=t.dtype, device=t.device)
    row[0, : t.numel()] = t.reshape(-1)
    shards = shard_count(p)
    return DTensor.from_local(row, p.device_mesh, p.placements, run_check=False, shape=(shards, longest),
                              stride=(longest, 1))


def _meta_checksum(entries: Mapping[Any, Mapping[str, Any]], groups: list[Mapping[str, Any]], meta: Mapping[str, Any]) -> int:
    """The checksum of what is the same on every rank: the groups, the meta and each entry but its
    tensors and per-rank checksum."""
    covered_entries = {
        str(e["name"]): {k: v for k, v in e.items() if k not in ("tensors", "checksum", "correction")}
        | {"correction": e["correction"]["kind"] if "correction" in e else None}
        for e in entries.values()
    }
    # positions or names (DCP re-keys them): the names in "param_names" are covered
    covered_groups = [{k: v for k, v in g.items() if k not in ("params", "baoc")} for g in groups]
    return digest_value({"entries": covered_entries, "groups": covered_groups,
                          "meta": {k: v for k, v in meta.items() if k != "checksum"}})


def to_distributed(
    sd: dict[str, Any], params: Sequence[Tensor], registry: Mapping[str, StateFormat], refusal_keys: bool = True
) -> dict[str, Any]:
    """The distributed layout of ``sd``, a single-process state dict (see the module) of an optimizer whose
    param groups hold ``params`` (in order) in the formats of ``registry``. An AdamW entry also carries
    ``"exp_avg"`` and ``"exp_avg_sq"`` (:data:`REFUSAL_KEYS`) holding ``FOREIGN_STEP``, and each group the keys
    of a plain AdamW's group it lacks (:data:`REFUSAL_GROUP_KEYS`), where ``refusal_keys``: DCP loads them into a
    plain AdamW's template, whose ``load_state_dict`` then refuses the dict with that message (without them DCP
    fails first, on a missing key, naming neither BAOC nor the fix)."""
    meta = sd["baoc"]
    position = {name: i for i, name in enumerate(n for saved in sd["param_groups"] for n in saved["params"])}
    corrections = meta.get("corrections", {})
    asked = meta.get("correction_requested", {})
    state: dict[int, dict[str, Any]] = {}
    for name, entry in sd["state"].items():
        p = params[position[name]]
        out = {k: v for k, v in entry.items() if k not in ("tensors", "checksum", "shape")}
        out.update(name=name, shape=[int(s) for s in p.shape], requested=meta["requested"].get(name),
                   nonfinite=int(meta["nonfinite"].get(name, 0)))
        if is_sharded(p):
            fmt = registry[entry["format"]]
            longest = _longest(fmt, p)
            out["tensors"] = {k: _rows(t, p, longest[k]) for k, t in entry["tensors"].items()}
            out["checksum"] = _rows(torch.tensor([entry["checksum"]], dtype=torch.int64, device=local(p).device), p, 1)
        else:
            out["tensors"], out["checksum"] = entry["tensors"], entry["checksum"]
        if name in corrections:
            t = corrections[name]["tensor"]
            out["correction"] = {"kind": corrections[name]["kind"], "tensor": as_dtensor(t, p)}
        if name in asked:
            out["correction_requested"] = asked[name]
        if refusal_keys and "rule" not in meta:
            out.update(dict.fromkeys(REFUSAL_KEYS, FOREIGN_STEP))
        state[position[name]] = out
    groups = []
    added: set[str] = set()
    for saved in sd["param_groups"]:
        g = {k: v for k, v in saved.items() if k != "params"}
        if refusal_keys and "rule" not in meta:
            added.update(k for k in REFUSAL_GROUP_KEYS if k not in g)
            g = {**REFUSAL_GROUP_KEYS, **g}
        g["params"] = [position[n] for n in saved["params"]]
        g["param_names"] = list(saved["params"])
        groups.append(g)
    layout_meta: dict[str, Any] = {"version": meta["version"], "layout": LAYOUT}
    if added:
        layout_meta["added"] = sorted(added)
    if "rule" in meta:
        layout_meta["rule"] = meta["rule"]
    layout_meta["has_corrections"] = "corrections" in meta
    layout_meta["checksum"] = _meta_checksum(state, groups, layout_meta)
    for g in groups:
        g["baoc"] = dict(layout_meta)
    return {"state": state, "param_groups": groups}


def saved_formats(checkpoint: str | os.PathLike[str], key: str) -> dict[str, str]:
    """Parameter name -> format of the optimizer state saved under ``key`` in a distributed checkpoint.

    ``torch.distributed.checkpoint.load`` fills a template built from the optimizer's current formats,
    so a run resuming a sharded optimizer sets the saved ones first (the BAOC callback and
    ``BAOCStrategy`` do it from their own state). Reads the checkpoint's metadata and its format
    entries only; call it on every rank (with a process group, the read is a collective).

    Example:
        >>> opt.set_formats(saved_formats("ckpt", "optim"))  # doctest: +SKIP
        >>> state = {"optim": get_optimizer_state_dict(model, opt)}; dcp.load(state, checkpoint_id="ckpt")  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(os.fspath(checkpoint)).read_metadata().state_dict_metadata
    prefix, suffix = f"{key}.state.", ".format"
    names = sorted(k[len(prefix) : -len(suffix)] for k in metadata if k.startswith(prefix) and k.endswith(suffix))
    if not names:
        held = sorted({k.split(".", 1)[0] for k in metadata})
        raise KeyError(f"the checkpoint {os.fspath(checkpoint)!r} holds no BlockwiseAdamW state under {key!r} "
                       f"(its keys: {held})")
    template: dict[str, Any] = {key: {"state": {name: {"format": ""} for name in names}}}
    dcp.load(template, checkpoint_id=checkpoint)
    return {name: str(template[key]["state"][name]["format"]) for name in names}


def _invalid(msg: str) -> CheckpointError:
    return CheckpointError(f"BlockwiseAdamW state dict (distributed layout): {msg}")


def _local_row(t: Any, length: int, where: str, shards: int) -> Tensor:
    """This rank's first ``length`` elements of ``t``, a row of a saved ``DTensor``."""
    if is_sharded(t):
        if t.shape[0] != shards:
            raise _invalid(
                f"{where} was saved by {t.shape[0]} shards, this run has {shards}: a sharded optimizer state "
                f"resumes on the same world size; for another, save to_adamw_state_dict() (on every rank) and "
                f"load that"
            )
        t = local(t)
    if not isinstance(t, Tensor) or t.dim() != 2 or t.shape[0] != 1 or t.shape[1] < length:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise _invalid(f"{where} is {shape}; expected this rank's row of {length} elements or more")
    return t[0, :length]


def from_distributed(
    sd: Mapping[str, Any], params_by_name: Mapping[str, Tensor], registry: Mapping[str, StateFormat],
    layout: Callable[[str, Tensor], Any],
) -> dict[str, Any]:
    """The single-process state dict of this rank from ``sd`` in the distributed layout (loaded
    through DCP, keyed by names, or kept as ``state_dict()`` returned it, keyed by positions), for an
    optimizer holding the parameters ``params_by_name`` in the formats of ``registry``
    (``layout(format, p)``: the compact tensors of this rank's shard of ``p``)."""
    groups_in = list(sd["param_groups"])
    meta_in = dict(groups_in[0]["baoc"])
    if any(dict(g["baoc"]) != meta_in for g in groups_in):
        raise _invalid("its param groups disagree on their 'baoc' metadata")
    if meta_in.get("version") != STATE_DICT_VERSION:
        raise _invalid(f"version {meta_in.get('version')!r}; this release reads version {STATE_DICT_VERSION}")
    state_in = sd.get("state")
    if not isinstance(state_in, Mapping):
        raise _invalid("'state' is missing")
    entries = {}
    for key, entry in state_in.items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise _invalid(f"state entry {key!r} carries no parameter name")
        entries[entry["name"]] = entry
    groups = []
    for index, g in enumerate(groups_in):
        names = g.get("param_names")
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise _invalid(f"param_groups[{index}] lists no 'param_names'")
        dropped = ("params", "param_names", "baoc", *meta_in.get("added", ()))
        groups.append({**{k: v for k, v in g.items() if k not in dropped}, "params": list(names)})
    # the checksum of what every rank shares (the per-rank tensors are checked by the entries' own)
    if _meta_checksum(entries, groups_in, meta_in) != meta_in.get("checksum"):
        raise _invalid("the checksum of its formats, counts and param groups does not match: the dict is damaged "
                       "or was edited (re-save it from the optimizer)")
    state: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {"version": meta_in["version"], "requested": {}, "nonfinite": {}}
    if "rule" in meta_in:
        meta["rule"] = meta_in["rule"]
    corrections: dict[str, Any] = {}
    asked: dict[str, Any] = {}
    for name, entry in entries.items():
        p = params_by_name.get(name)
        if p is None:
            raise _invalid(f"state entry {name!r} names no parameter of this optimizer: another model")
        fmt_name = entry.get("format")
        if fmt_name not in registry:
            raise _invalid(f"state entry {name!r} has format {fmt_name!r}, which this optimizer does not know")
        shard = local(p)
        out = {k: v for k, v in entry.items()
               if k not in ("name", "requested", "nonfinite", "correction", "correction_requested", "tensors", "checksum",
                            *REFUSAL_KEYS)}
        out["shape"] = list(shard.shape)
        tensors = entry.get("tensors")
        if not isinstance(tensors, Mapping):
            raise _invalid(f"state entry {name!r} holds no tensors")
        if is_sharded(p):
            lengths = {spec.key: spec.numel for spec in layout(fmt_name, p)}  # the shard's framed layout
            shards = shard_count(p)
            out["tensors"] = {k: _local_row(t, lengths.get(k, 0), f"{name!r} {k!r}", shards).clone()
                              for k, t in tensors.items()}
            out["checksum"] = int(_local_row(entry.get("checksum"), 1, f"{name!r} checksum", shards)[0])
        else:
            out["tensors"], out["checksum"] = dict(tensors), entry.get("checksum")
        state[name] = out
        if entry.get("requested") is not None:
            meta["requested"][name] = entry["requested"]
        if entry.get("nonfinite"):
            meta["nonfinite"][name] = entry["nonfinite"]
        if "correction" in entry:
            t = entry["correction"]["tensor"]
            corrections[name] = {"kind": entry["correction"]["kind"], "tensor": local(t) if is_sharded(t) else t}
        if "correction_requested" in entry:
            asked[name] = entry["correction_requested"]
    if meta_in.get("has_corrections"):
        meta["corrections"], meta["correction_requested"] = corrections, asked
    out_sd = {"state": state, "param_groups": groups, "baoc": meta}
    meta["checksum"] = meta_checksum(out_sd)
    return out_sd
