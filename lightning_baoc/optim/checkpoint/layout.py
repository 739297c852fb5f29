"""Checkpoints of :class:`~lightning_baoc.optim.BlockwiseAdamW`: layout, checksums, files, export.

A state dict (version 2) is::

    {"state": {name: {"format": str, "steps": int, "m_step": int, "shape": [int, ...],
                      "tensors": {key: compact tensor}, "checksum": int,
                      "step": FOREIGN_STEP}},
     "param_groups": [{hyperparameters..., "params": [names]}],
     "baoc": {"version": 2, "requested": {name: format}, "nonfinite": {name: count},
              "checksum": int}}

- ``"step"`` is not a count: it is :data:`FOREIGN_STEP`, bytes holding a message. torch's
  ``Adam.__setstate__`` (run inside ``torch.optim.AdamW.load_state_dict``) calls ``float()`` on
  every non-tensor ``step``, so loading this dict into a plain AdamW fails at load with that
  message instead of with ``KeyError: 'exp_avg'`` at the first step. (Bytes, not ``str``: torch's
  loader rebuilds every iterable it meets, and rebuilds a ``str`` as the text of a generator.)
- A BlockwiseSGD or BlockwiseLion dict carries ``"rule"`` in ``"baoc"`` and ends with one param group
  more, of no parameters (:data:`REFUSAL_KEY`): torch's SGD reads nothing of a state entry, so a
  group count it does not have is what makes it (and any Lion built on ``torch.optim.Optimizer``)
  refuse the dict. The checksums do not cover that group; a load takes it off first.
- ``checksum`` of an entry covers its format, shape, counts and tensor bytes; the one of ``"baoc"``
  covers the param groups, the parameter names, the requests, the non-finite counts, every entry's
  checksum, and the generator states that dicts of earlier releases carry (a load ignores them). A
  bit flip anywhere in what a load reads is detected (see :func:`digest_bytes`). A dict edited on purpose is re-sealed with :func:`seal_state_dict`.

Loading validates the whole dict before anything is changed
(:func:`lightning_baoc.optim.checkpoint.validate.plan_load`); every problem raises :class:`CheckpointError`
naming the parameter and the key. Version-1 dicts (no shapes, no
checksums) and ``torch.optim.AdamW``/``Adam`` state dicts (no checksums: torch writes none) load
with every check but the checksums.
"""

from __future__ import annotations

import os
import struct
from typing import IO, Any, Callable, Iterable, Mapping

import torch
from torch import Tensor

from lightning_baoc.formats import FORMATS, Canonical, StateFormat
from lightning_baoc.formats.base import factor_view

STATE_DICT_VERSION = 2
READABLE_VERSIONS = (1, 2)
#: The ``"layout"`` of the ``"baoc"`` metadata in each param group of a sharded optimizer's state dict
#: (:mod:`lightning_baoc.optim.checkpoint.distributed`).
LAYOUT = "distributed"

#: The per-parameter ``"step"`` of a BlockwiseAdamW state dict: what a plain AdamW reports when
#: it is handed this dict (see the module docstring).
FOREIGN_STEP = (
    b"This is a BlockwiseAdamW (BAOC) optimizer state: its moments are held in compact per-parameter "
    b"formats that torch.optim.AdamW cannot read. Resume with the BAOC callback (or a "
    b"lightning_baoc.BlockwiseAdamW), or convert the state first with "
    b"lightning_baoc.export_adamw_state_dict(state_dict) (BlockwiseAdamW.to_adamw_state_dict() "
    b"for a live optimizer)."
)

#: The key of the last param group of a BlockwiseSGD or BlockwiseLion state dict: a group of no parameters
#: whose value says what the dict is. torch's SGD (and every Lion built on ``torch.optim.Optimizer``) reads
#: nothing of a state entry at load, so the AdamW refusal (``"step"``) cannot reach it; one param group
#: more than the optimizer has makes ``load_state_dict`` refuse the dict before it drops the momentum.
REFUSAL_KEY = "baoc_refusal"
FOREIGN_MOMENTUM = (
    b"This is a BlockwiseSGD/BlockwiseLion (BAOC) optimizer state: its momentum buffers are held in compact "
    b"per-parameter formats that torch.optim.SGD or a plain Lion cannot read, and this last param group (of no "
    b"parameters) is there so that they refuse it. Resume with the BAOC callback (or a lightning_baoc.BlockwiseSGD "
    b"or BlockwiseLion), or load it into one and call to_torch_state_dict() for the plain state."
)

_MODULUS = 2**31 - 1  # a prime: position weights never coincide within 2 GiB
#: Bytes digested at once: int32 working copies of 256 KiB stay in cache (measured on CPU: 0.17 s per
#: 100 MB against 0.43 s with int64 copies of 1 MiB chunks).
DIGEST_CHUNK = 1 << 16


class CheckpointError(ValueError):
    """An optimizer checkpoint that cannot be loaded: truncated, corrupted, of another model, invalid.

    The message says what is wrong and where (the parameter and the key). Raised before anything is
    changed: the optimizer that refused the load is as it was.
    """


# ---------------------------------------------------------------------------- checksums


def digest_bytes(parts: Iterable[Tensor], chunk: int = DIGEST_CHUNK) -> int:
    """A checksum of the bytes of ``parts``, read as one stream, computed on each tensor's device.

    Two sums over the bytes ``b_i`` (``i`` counting across parts): ``S1 = sum b_i`` and
    ``S2 = sum ((i mod M) + 1) b_i mod M`` with ``M = 2**31 - 1``. Any single bit flip changes S1
    (by +-2**k, k < 8); a pair of flips that cancels in S1 changes S2 unless the two positions are a
    multiple of M apart. Exact integer arithmetic, so every device gives the same value: a chunk's
    products ``b * (j + 1)`` stay below 255 * chunk (int32, chunk <= 2**22) and are summed in int64
    (below 2**39 at the default chunk); the carried position term stays below 2**31 * 255 * chunk.

    Returns:
        ``(S1 mod 2**32) << 31 | S2``, an int below 2**63.
    """
    if not 0 < chunk <= 1 << 22:
        raise ValueError(f"Invalid chunk: {chunk!r}; expected an int in [1, 2**22]")
    total, weighted, position = 0, 0, 0
    for part in parts:
        data = part.detach().contiguous().reshape(-1).view(torch.uint8)
        n = data.numel()
        if n == 0:
            continue
        weights = torch.arange(1, min(chunk, n) + 1, dtype=torch.int32, device=data.device)
        part_total = torch.zeros((), dtype=torch.int64, device=data.device)
        part_weighted = torch.zeros((), dtype=torch.int64, device=data.device)
        for start in range(0, n, chunk):
            block = data[start : start + chunk]
            block_sum = block.sum(dtype=torch.int64)
            part_total += block_sum
            offset = (position + start) % _MODULUS  # global weight (i mod M) + 1 = offset + j + 1 (mod M)
            block_weighted = (block.to(torch.int32) * weights[: block.numel()]).sum(dtype=torch.int64)
            part_weighted = (part_weighted + block_weighted + offset * block_sum) % _MODULUS
        total += int(part_total.item())  # one sync per tensor, none per chunk
        weighted = (weighted + int(part_weighted.item())) % _MODULUS
        position += n
    return ((total % 2**32) << 31) | weighted


def _encode_value(value: Any, out: list[bytes]) -> None:
    """Append an unambiguous byte encoding of a state-dict value (tensors by dtype, shape and digest)."""
    if value is None or isinstance(value, bool):
        out.append(b"N" if value is None else (b"T" if value else b"F"))
    elif isinstance(value, int):
        out.append(b"i%d;" % value)
    elif isinstance(value, float):
        out.append(b"f" + struct.pack("<d", value))
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        out.append(b"s%d;" % len(data) + data)
    elif isinstance(value, bytes):
        out.append(b"b%d;" % len(value) + value)
    elif isinstance(value, Tensor):
        out.append(f"t{value.dtype}{tuple(value.shape)};{digest_bytes([value])};".encode())
    elif isinstance(value, (list, tuple)):  # a tuple saved may come back a list: same encoding
        out.append(b"l%d;" % len(value))
        for item in value:
            _encode_value(item, out)
    elif isinstance(value, Mapping):
        out.append(b"d%d;" % len(value))
        for key in sorted(value, key=repr):
            _encode_value(key, out)
            _encode_value(value[key], out)
    else:
        out.append(b"r" + repr(value).encode())


def digest_value(value: Any) -> int:
    """The checksum of a state-dict value (tensors by dtype, shape and bytes; containers by their items)."""
    out: list[bytes] = []
    _encode_value(value, out)
    return digest_bytes([torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8)])


def entry_checksum(entry: Mapping[str, Any]) -> int:
    """The checksum of one parameter's entry: format, shape, counts and tensor bytes."""
    head = {k: entry.get(k) for k in ("format", "shape", "steps", "m_step", "step")}
    tensors = entry.get("tensors", {})
    head["tensors"] = [(k, str(t.dtype), tuple(t.shape)) for k, t in sorted(tensors.items())]
    return digest_value([digest_value(head), digest_bytes([tensors[k] for k in sorted(tensors)])])


def meta_checksum(sd: Mapping[str, Any]) -> int:
    """The checksum of a dict's metadata: groups (names sorted), 'baoc' fields, entry checksums."""
    meta = sd["baoc"]
    groups = []
    for group in sd["param_groups"]:
        # names sorted: entries are matched by name, a reordered list loads the same state
        groups.append({k: (sorted(v) if k == "params" else v) for k, v in group.items() if k != "param_names"})
    covered = {k: v for k, v in meta.items() if k != "checksum"}
    covered["param_groups"] = groups
    covered["entries"] = {name: entry.get("checksum") for name, entry in sd["state"].items()}
    return digest_value(covered)


def make_entry(fmt: str, shape: Iterable[int], steps: int, m_step: int, tensors: dict[str, Tensor]) -> dict[str, Any]:
    """One parameter's checkpoint entry, with its checksum."""
    entry: dict[str, Any] = {
        "format": fmt,
        "step": FOREIGN_STEP,
        "steps": int(steps),
        "m_step": int(m_step),
        "shape": [int(s) for s in shape],
        "tensors": tensors,
    }
    entry["checksum"] = entry_checksum(entry)
    return entry


def seal_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """(Re)compute every checksum of a version-2 state dict, in place, and return it.

    For a dict changed on purpose (hyperparameters edited, a request removed): a load refuses any
    change it did not see sealed. Tensors of the entries must be in their compact layout.

    Example:
        >>> sd = opt.state_dict()  # doctest: +SKIP
        >>> sd["param_groups"][0]["lr"] = 1e-4; opt.load_state_dict(seal_state_dict(sd))  # doctest: +SKIP
    """
    for entry in state_dict["state"].values():
        entry["checksum"] = entry_checksum(entry)
    state_dict["baoc"]["checksum"] = meta_checksum(state_dict)
    return state_dict


# ---------------------------------------------------------------------------- files


def load_checkpoint(path_or_file: str | os.PathLike[str] | IO[bytes], map_location: Any = "cpu") -> Any:
    """``torch.load(..., weights_only=True)`` whose failures on damaged files are a CheckpointError.

    Loads to ``map_location`` (default: the CPU), so a checkpoint written on an accelerator loads
    anywhere; ``BlockwiseAdamW.load_state_dict`` then places each state on its parameter's device.

    Raises:
        CheckpointError: the file is truncated or corrupted (or holds more than tensors and
            primitives). A missing or unreadable file raises the usual ``OSError``.

    Example:
        >>> opt.load_state_dict(load_checkpoint("optimizer.pt"))  # doctest: +SKIP
    """
    if isinstance(path_or_file, (str, os.PathLike)):
        where = repr(os.fspath(path_or_file))
        with open(path_or_file, "rb") as f:  # a missing file is an OSError, not a damaged one
            return _load_file(f, where, map_location)
    return _load_file(path_or_file, "the checkpoint file", map_location)


def _load_file(f: IO[bytes], where: str, map_location: Any) -> Any:
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises a dozen types on damaged zips and pickles
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise CheckpointError(
            f"{where} is not a readable checkpoint: the file is truncated or corrupted "
            f"({type(err).__name__}: {detail}). Load an intact copy (an earlier checkpoint)."
        ) from err


# ---------------------------------------------------------------------------- entries


def invalid(message: str) -> CheckpointError:
    """The error for an invalid state dict (raise it)."""
    return CheckpointError(f"Invalid optimizer state dict: {message}")


def require_mapping(value: Any, where: str) -> Mapping[Any, Any]:
    """``value`` if it is a mapping, else the CheckpointError naming ``where``."""
    if not isinstance(value, Mapping):
        raise invalid(f"{where} should be a dict, got {type(value).__name__}")
    return value


def require_count(entry: Mapping[str, Any], key: str, where: str) -> int:
    """``entry[key]`` if it is an int >= 0, else the CheckpointError naming ``where`` and ``key``."""
    value = entry.get(key)
    if key not in entry:
        raise invalid(f"{where}: the field {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise invalid(f"{where}: {key!r} is {value!r}; expected an int >= 0")
    return value

def check_entry_fields(
    name: str, entry: Any, version: int, registry: Mapping[str, StateFormat] = FORMATS
) -> tuple[str, int, int, dict[str, Tensor]]:
    """Presence, types and ranges of an entry's fields, then its checksum (version 2); the format
    is one of ``registry`` (the optimizer's, :data:`FORMATS` for BlockwiseAdamW).

    Returns:
        ``(format, steps, m_step, tensors)``.
    """
    where = f"state of {name!r}"
    entry = require_mapping(entry, where)
    if "format" not in entry:
        raise invalid(f"{where}: the field 'format' is missing")
    fmt = entry["format"]
    if not isinstance(fmt, str) or fmt not in registry:
        raise invalid(f"{where}: 'format' is {fmt!r}; allowed: {list(registry)}")
    steps = require_count(entry, "steps" if version >= 2 else "step", where)
    m_step = require_count(entry, "m_step", where)
    if m_step > steps:
        raise invalid(f"{where}: 'm_step' is {m_step}, more than the {steps} steps taken; the momentum cannot be older than the state")
    tensors = require_mapping(entry.get("tensors"), f"{where}: 'tensors'")
    bad = [k for k, t in tensors.items() if not isinstance(k, str) or not isinstance(t, Tensor)]
    if bad:
        raise invalid(f"{where}: tensors {bad[:5]} are not (name, tensor) pairs")
    if version >= 2:
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise invalid(f"{where}: 'shape' is {shape!r:.80}; expected a list of ints >= 0")
        if entry.get("step") != FOREIGN_STEP:
            raise invalid(f"{where}: the field 'step' is missing or altered (it holds the notice for torch's AdamW)")
        if not isinstance(entry.get("checksum"), int):
            raise invalid(f"{where}: the field 'checksum' is missing or not an int")
        if entry_checksum(entry) != entry["checksum"]:
            raise invalid(
                f"{where}: its checksum does not match its contents (format, shape, steps, m_step, "
                f"tensors): the checkpoint is corrupted"
            )
    return fmt, steps, m_step, dict(tensors)


def check_layout(
    name: str,
    fmt: str,
    shape: tuple[int, ...],
    tensors: Mapping[str, Tensor],
    exact_shape: bool = True,
    registry: Mapping[str, StateFormat] = FORMATS,
    offset: int = 0,
) -> None:
    """The compact tensors are those ``fmt`` (of ``registry``) stores for ``shape``: keys, dtypes, sizes
    (of a shard starting at element ``offset`` of its parameter: :meth:`StateFormat.shard_layout`)."""
    where = f"state of {name!r}"
    # a shard of a sharded parameter may hold one row or none: the layout needs 2 dimensions only
    if registry[fmt].factored and factor_view(shape) is None:
        raise invalid(f"{where}: format {fmt!r} cannot hold shape {shape} (it needs a 2-D or larger shape)")
    specs = {spec.key: spec for spec in registry[fmt].shard_layout(shape, offset)}
    if set(tensors) != set(specs):
        raise invalid(
            f"{where}: tensors {sorted(tensors)} do not match format {fmt!r}, which stores {sorted(specs)}"
        )
    for key, spec in specs.items():
        t = tensors[key]
        if t.dtype != spec.dtype or t.numel() != spec.numel or (exact_shape and t.dim() != 1):
            raise invalid(
                f"{where}: tensors[{key!r}] should be {spec.dtype} x {spec.numel} (1-D) for format {fmt!r} "
                f"and shape {shape}, got {t.dtype} of shape {tuple(t.shape)}"
            )

# ---------------------------------------------------------------------------- export


def export_adamw_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A BlockwiseAdamW state dict (version 2) as a plain ``torch.optim.AdamW`` state dict.

    Needs no model: every entry records its shape. States are decoded to fp32: 8-bit states are
    dequantized, factored second moments expanded; formats without momentum export a zero momentum
    (a plain AdamW resumes with a cold momentum there). For a Lightning checkpoint, convert each of
    ``checkpoint["optimizer_states"]`` and save the checkpoint again.

    Raises:
        CheckpointError: the dict is damaged, of version 1 (which records no shapes: load it into
            a BlockwiseAdamW and call ``to_adamw_state_dict()``), or in the distributed layout of a sharded
            optimizer (its tensors are each rank's shards: call ``to_adamw_state_dict()`` on every rank).

    Example:
        >>> ckpt = load_checkpoint("last.ckpt")  # doctest: +SKIP
        >>> ckpt["optimizer_states"] = [export_adamw_state_dict(s) for s in ckpt["optimizer_states"]]  # doctest: +SKIP
    """
    state_dict = without_refusal(state_dict)
    meta = state_dict.get("baoc") if isinstance(state_dict, Mapping) else None
    rule = meta.get("rule", "adamw") if isinstance(meta, Mapping) else "adamw"
    if rule in ("sgd", "lion"):
        raise CheckpointError(
            f"export_adamw_state_dict: this is the state dict of a Blockwise{'SGD' if rule == 'sgd' else 'Lion'} "
            f"({rule} momentum buffers), not an AdamW one; load it into that optimizer and call "
            f"to_torch_state_dict() for its plain state"
        )
    if is_distributed_layout(state_dict):
        raise CheckpointError(
            "export_adamw_state_dict: this is the distributed layout of a sharded optimizer's state dict (FSDP2, "
            "ModelParallelStrategy: param_groups carry the 'baoc' metadata, the tensors are each rank's shards), "
            "which no single process can decode. Call optimizer.to_adamw_state_dict() on every rank of the live "
            "sharded optimizer (it gathers the whole moments and loads into any world size), or load the "
            "checkpoint into the sharded BlockwiseAdamW first."
        )
    return adamw_export(state_dict, decode_entry)



def decode_entry(
    name: str, fmt: str, shape: tuple[int, ...], tensors: Mapping[str, Tensor], registry: Mapping[str, StateFormat] = FORMATS
) -> Canonical:
    """The state of one entry of a state dict (its format of ``registry``), its layout checked (a whole parameter's)."""
    check_layout(name, fmt, shape, tensors, registry=registry)
    return registry[fmt].decode(tensors, shape)


def adamw_export(
    state_dict: Mapping[str, Any], decode: Callable[[str, str, tuple[int, ...], Mapping[str, Tensor]], Canonical]
) -> dict[str, Any]:
    """:func:`export_adamw_state_dict` with each entry's state read by ``decode(name, format, shape,
    tensors)`` (the optimizer's own reader of a shard's states: ``BlockwiseAdamW.to_adamw_state_dict``)."""
    sd = require_mapping(state_dict, "state_dict")
    meta = require_mapping(sd.get("baoc"), "'baoc'")
    if meta.get("version") != STATE_DICT_VERSION:
        raise invalid(
            f"only version-{STATE_DICT_VERSION} dicts record shapes (got version {meta.get('version')!r}); "
            f"load it into a BlockwiseAdamW and call to_adamw_state_dict()"
        )
    if meta_checksum(sd) != meta.get("checksum"):
        raise invalid("the checksum of the state dict's metadata does not match: the checkpoint is corrupted")
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for saved in sd["param_groups"]:
        group = {k: v for k, v in saved.items() if k not in ("params", "param_names", "state_format")}
        group.update(amsgrad=False, foreach=None, fused=None, capturable=False, differentiable=False)
        group.setdefault("maximize", False)
        group["params"], group["param_names"] = [], list(saved["params"])
        for name in saved["params"]:
            if name in sd["state"]:
                fmt, steps, _, tensors = check_entry_fields(name, sd["state"][name], STATE_DICT_VERSION)
                shape = tuple(sd["state"][name]["shape"])
                decoded = decode(name, fmt, shape, tensors)
                v = decoded.dense_v().reshape(shape).to(torch.float32)
                m = decoded.exp_avg.reshape(shape) if decoded.exp_avg is not None else torch.zeros_like(v)
                state[index] = {"step": torch.tensor(float(steps)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
            group["params"].append(index)
            index += 1
        groups.append(group)
    return {"state": state, "param_groups": groups}


def with_refusal(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (of BlockwiseSGD or BlockwiseLion) with the param group that makes a plain optimizer
    refuse it (:data:`REFUSAL_KEY`) last; its checksums do not cover that group."""
    return {**state_dict, "param_groups": [*state_dict["param_groups"], {"params": [], REFUSAL_KEY: FOREIGN_MOMENTUM}]}


def without_refusal(state_dict: Any) -> Any:
    """``state_dict`` without :func:`with_refusal`'s group (a copy; as is where it has none, or is no dict)."""
    if not isinstance(state_dict, Mapping):
        return state_dict
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not groups:
        return state_dict
    last = groups[-1]
    if not (isinstance(last, Mapping) and REFUSAL_KEY in last):
        return state_dict
    return {**state_dict, "param_groups": list(groups[:-1])}


#: The hyperparameters of a plain optimizer's param group, by update rule, with the defaults its
#: constructor adds (``torch.optim.SGD``'s; a Lion's: ``lr``, ``betas``, ``weight_decay``).
_PLAIN_GROUPS = {
    "sgd": (("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
            {"foreach": None, "differentiable": False, "fused": None}),
    "lion": (("lr", "betas", "weight_decay", "maximize"), {}),
}


def momentum_export(
    state_dict: Mapping[str, Any], decode: Callable[[str, str, tuple[int, ...], Mapping[str, Tensor]], Canonical]
) -> dict[str, Any]:
    """A BlockwiseSGD or BlockwiseLion state dict (version 2, its own) as a plain ``torch.optim.SGD`` state
    dict (``momentum_buffer``) or Lion one (``exp_avg``: lion-pytorch's, timm's and optimi's key), fp32;
    each entry's state read by ``decode(name, format, shape, tensors)``. A parameter held without a buffer
    (format ``none``, or SGD without momentum) exports no state: the plain optimizer starts its buffer
    afresh there, as it would have."""
    sd = require_mapping(without_refusal(state_dict), "state_dict")
    meta = require_mapping(sd.get("baoc"), "'baoc'")
    rule = meta.get("rule")
    if rule not in _PLAIN_GROUPS:
        raise invalid(f"the state dict's rule is {rule!r}; the momentum export reads 'sgd' and 'lion' dicts")
    if meta_checksum(sd) != meta.get("checksum"):
        raise invalid("the checksum of the state dict's metadata does not match: the checkpoint is corrupted")
    keys, extra = _PLAIN_GROUPS[rule]
    buffer = "momentum_buffer" if rule == "sgd" else "exp_avg"
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for saved in sd["param_groups"]:
        group = {k: saved[k] for k in keys if k in saved}
        group.update(extra)
        group["params"], group["param_names"] = [], list(saved["params"])
        for name in saved["params"]:
            if name in sd["state"]:
                fmt, _, _, tensors = check_entry_fields(name, sd["state"][name], STATE_DICT_VERSION)
                decoded = decode(name, fmt, tuple(sd["state"][name]["shape"]), tensors)
                if decoded.exp_avg is not None:
                    state[index] = {buffer: decoded.exp_avg.to(torch.float32).clone()}
            group["params"].append(index)
            index += 1
        groups.append(group)
    return {"state": state, "param_groups": groups}


def is_distributed_layout(sd: Any) -> bool:
    """Whether ``sd`` is a state dict in the distributed layout (:mod:`lightning_baoc.optim.checkpoint.distributed`)."""
    if not isinstance(sd, Mapping) or "baoc" in sd:
        return False
    groups = sd.get("param_groups")
    return (
        isinstance(groups, (list, tuple))
        and bool(groups)
        and all(isinstance(g, Mapping) and isinstance(g.get("baoc"), Mapping) for g in groups)
        and all(g["baoc"].get("layout") == LAYOUT for g in groups)
    )
