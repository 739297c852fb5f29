"""BlockwiseAdamW: AdamW whose state format is chosen per parameter.

Every parameter's state is held in one of the formats of :data:`lightning_baoc.FORMATS`. The
format is stored per parameter (a param group's ``state_format`` key is only the default), so
param groups stay one-to-one with the user's: LR schedulers, ``LearningRateMonitor`` and code that
indexes ``param_groups`` keep working.

Memory layout: the states of all parameters sharing a format on a device live in one contiguous
``uint8`` pool, carved into per-parameter views of the format's dtypes. Views are laid out by
descending item size (all 4-byte tensors, then 2-byte, then 1-byte), so no alignment padding is
ever needed and :meth:`BlockwiseAdamW.state_bytes` equals both the sum of the formats' stated bytes
and the storage really allocated. Pools are rebuilt when formats change (``set_formats``).

The state is kept outside ``optimizer.state`` on purpose: Lightning moves every tensor found there
to the root device after a restore, which would silently pull host-offloaded states onto the
accelerator (Lightning 2.6's ``Strategy.load_optimizer_state_dict`` calls ``_optimizer_to_device``).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor, nn

from lightning_baoc.formats import (
    DEFAULT_MIN_8BIT_NUMEL,
    FORMATS,
    Canonical,
    StepHyper,
    StepItem,
    check_format_name,
    resolve_format,
)
from lightning_baoc.formats.base import DEFAULT_CHUNK, TensorSpec

_STATE_DICT_VERSION = 1
_HOST = torch.device("cpu")


@dataclass
class _Record:
    """Book-keeping of one parameter (never checkpointed as is: see ``state_dict``)."""

    name: str
    group: int
    requested: str | None = None  # explicit request from set_formats; None: the group default
    format: str | None = None  # the format the state is held in; None: no state yet
    step: int = 0
    m_step: int = 0  # steps since the momentum was (re)created: its own bias correction
    views: dict[str, Tensor] | None = None
    nonfinite: int = 0


@dataclass
class _Pool:
    format: str
    storage_device: torch.device
    buffer: Tensor
    members: list[Tensor] = field(default_factory=list)


def _float(value: Any) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _device_key(device: torch.device) -> str:
    return str(device)


def _storage_device(fmt: str, param_device: torch.device) -> torch.device:
    return _HOST if FORMATS[fmt].offloaded else param_device


class BlockwiseAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with a state format per parameter.

    With every parameter in ``fp32`` it behaves like ``torch.optim.AdamW`` (tested to 1e-6 over 200
    steps). Cheaper formats hold the same state in fewer bytes; :meth:`set_formats` converts live
    state between any two formats (state inheritance) and keeps the step count.

    Args:
        params: parameters, ``(name, parameter)`` pairs (``model.named_parameters()``) or param
            groups; a group may carry ``state_format`` (the default of its parameters).
        lr: learning rate (default: 1e-3).
        betas: coefficients of the moment averages (default: (0.9, 0.999)).
        eps: added to the denominator (default: 1e-8).
        weight_decay: decoupled weight decay (default: 1e-2).
        state_format: default format of every group (default: ``"fp32"``).
        maximize: maximize the objective (default: False).
        decoupled_weight_decay: AdamW's decoupled decay; ``False`` gives Adam's L2 penalty
            (default: True).
        min_8bit_numel: tensors with fewer elements stay out of the 8-bit formats (int8 -> fp32,
            nomomentum_int8 -> nomomentum), as bitsandbytes does (default: 4096).
        skip_nonfinite: skip the update of a parameter whose gradient holds inf or NaN, leaving its
            state and value untouched and counting it in :attr:`nonfinite_counts`, instead of letting
            one bad value poison a whole quantization group forever (default: True).
        seed: seed of the stochastic-rounding generator, saved in the state dict so that a resumed
            run rounds exactly as an uninterrupted one (default: 0).
        chunk_size: elements processed at once by chunked formats (default: 131072).
        param_names: names for plain parameters: a module, or ``(name, parameter)`` pairs
            (default: positional names ``"0"``, ``"1"``, ...).

    Example:
        >>> model = nn.Linear(64, 64)
        >>> opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3)
        >>> model(torch.randn(8, 64)).sum().backward(); opt.step()
        >>> opt.set_formats({"weight": "int8"})
        >>> opt.state_bytes()  # int8 weight (4096 elements) + fp32 bias
        9216
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_format: str = "fp32",
        maximize: bool = False,
        decoupled_weight_decay: bool = True,
        min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
        skip_nonfinite: bool = True,
        seed: int = 0,
        chunk_size: int = DEFAULT_CHUNK,
        param_names: nn.Module | Iterable[tuple[str, Tensor]] | None = None,
    ) -> None:
        if not isinstance(min_8bit_numel, int) or min_8bit_numel < 0:
            raise ValueError(f"Invalid min_8bit_numel: {min_8bit_numel!r}; expected an int >= 0")
        if not isinstance(chunk_size, int) or chunk_size < 32:
            raise ValueError(f"Invalid chunk_size: {chunk_size!r}; expected an int >= 32")
        if not isinstance(seed, int):
            raise TypeError(f"Invalid seed: {seed!r}; expected an int")
        self._records: dict[Tensor, _Record] = {}
        self._names: dict[str, Tensor] = {}
        self._pools: dict[tuple[str, str], _Pool] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._external_names: dict[int, str] = {}
        if param_names is not None:
            items = param_names.named_parameters() if isinstance(param_names, nn.Module) else param_names
            self._external_names = {id(p): n for n, p in items}
        self.min_8bit_numel = min_8bit_numel
        self.skip_nonfinite = bool(skip_nonfinite)
        self.seed = seed
        self.chunk_size = chunk_size
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            state_format=state_format,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
            amsgrad=False,
        )
        _validate_hyper(defaults, "")
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups and names

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (validated); its parameters get positional or given names."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        try:
            _validate_hyper(group, f"param_groups[{index}].")
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if not p.is_floating_point() or p.is_complex():
                    raise TypeError(
                        f"BlockwiseAdamW supports real floating-point parameters only; parameter "
                        f"{i} of group {index} has dtype {p.dtype}. Leave it out of the optimizer "
                        f"or give it a floating dtype."
                    )
                if p.is_sparse:
                    raise TypeError(f"sparse parameter {i} of group {index} is not supported")
                name = names[i] if names else self._external_names.get(id(p), str(len(self._records)))
                if name in self._names:
                    raise ValueError(
                        f"Parameter name {name!r} appears twice; names key the checkpointed state "
                        f"and must be unique"
                    )
                self._names[name] = p
                self._records[p] = _Record(name=name, group=index)
        except (TypeError, ValueError):
            self.param_groups.pop()
            for p in group["params"]:
                rec = self._records.pop(p, None)
                if rec is not None:
                    self._names.pop(rec.name, None)
            raise

    def param_name(self, param: Tensor) -> str:
        """The name under which ``param``'s state is checkpointed."""
        return self._records[param].name

    @property
    def named_params(self) -> dict[str, Tensor]:
        """Parameter name -> parameter, in the optimizer's order."""
        return dict(self._names)

    # ------------------------------------------------------------------ formats

    def requested_format(self, param: Tensor) -> str:
        """The format asked for ``param``: its own request or its group's ``state_format``."""
        rec = self._records[param]
        return rec.requested or self.param_groups[rec.group]["state_format"]

    def target_format(self, param: Tensor) -> str:
        """The format ``param``'s state is (or will be) held in, after shape fallbacks."""
        return resolve_format(self.requested_format(param), param.shape, self.min_8bit_numel)

    def formats(self) -> dict[str, str]:
        """Parameter name -> effective format (held now, or on the first step for fresh ones)."""
        return {rec.name: rec.format or self.target_format(p) for p, rec in self._records.items()}

    def resolve_names(
        self, names: Iterable[str], blocks: Mapping[str, Iterable[str]] | None = None
    ) -> dict[str, list[Tensor]]:
        """Map parameter names, block names or module prefixes to parameters.

        A name is, in order: a block of ``blocks``; a parameter name; a module prefix (every
        parameter whose name starts with ``name + "."``).
        """
        out: dict[str, list[Tensor]] = {}
        for key in names:
            if not isinstance(key, str):
                raise TypeError(f"names must be str, got {key!r} of type {type(key).__name__}")
            if blocks is not None and key in blocks:
                params = []
                for member in blocks[key]:
                    if member not in self._names:
                        raise ValueError(
                            f"block {key!r} names parameter {member!r}, which this optimizer does not hold"
                        )
                    params.append(self._names[member])
            elif key in self._names:
                params = [self._names[key]]
            else:
                prefix = key + "."
                params = [p for n, p in self._names.items() if n.startswith(prefix)]
                if not params:
                    known = list(self._names)[:8]
                    raise ValueError(
                        f"{key!r} names no parameter, block or module of this optimizer; "
                        f"parameter names look like {known}"
                    )
            out[key] = params
        return out

    @torch.no_grad()
    def set_formats(
        self, formats: Mapping[str, str], blocks: Mapping[str, Iterable[str]] | None = None
    ) -> dict[str, tuple[str, str]]:
        """Convert the state of the named parameters or blocks to new formats, in place.

        State is inherited, never reset: quantize / dequantize, factor (row and column means of
        v) / expand (outer product), drop momentum / re-create it from the current gradient (as
        one EMA step, ``m = (1 - beta1) g``, with its own bias-correction count), move to / from
        host memory. Step counts are kept. Pools of the formats involved are rebuilt; at the peak
        the old and new pools of those formats coexist with one parameter's fp32 state.

        Args:
            formats: name -> format, where a name is a parameter name, a block of ``blocks`` or a
                module prefix (``"encoder.layer1"``).
            blocks: optional block name -> parameter names.

        Returns:
            parameter name -> (old format, new format) for every parameter whose format changed.

        Example:
            >>> opt.set_formats({"encoder": "int8", "head": "bf16"})  # doctest: +SKIP
        """
        if not isinstance(formats, Mapping):
            raise TypeError(f"formats must be a mapping name -> format, got {type(formats).__name__}")
        resolved = self.resolve_names(formats.keys(), blocks)
        requests: dict[Tensor, str] = {}
        for key, fmt in formats.items():
            check_format_name(fmt, f"format of {key!r}")
            for p in resolved[key]:
                requests[p] = fmt
        for p, fmt in requests.items():
            self._records[p].requested = fmt
        return self._sync_formats()

    def _sync_formats(self) -> dict[str, tuple[str, str]]:
        """Convert every initialized parameter whose target format differs from its held one."""
        changes: dict[Tensor, str] = {}
        for p, rec in self._records.items():
            if rec.format is None:
                continue
            target = self.target_format(p)
            if target != rec.format:
                changes[p] = target
        if not changes:
            return {}
        report = {self._records[p].name: (self._records[p].format, fmt) for p, fmt in changes.items()}
        self._rebuild(changes)
        return report

    # ------------------------------------------------------------------ pools

    def _rebuild(
        self,
        changes: Mapping[Tensor, str],
        sources: Mapping[Tensor, Canonical | dict[str, Tensor] | None] | None = None,
    ) -> None:
        """Move the parameters of ``changes`` to their new formats and rebuild the pools involved.

        ``sources`` optionally gives a parameter's new state: a :class:`Canonical` to encode, a dict
        of compact tensors to copy (checkpoint), or ``None`` for a fresh zero state. Without a
        source a parameter's current state is converted.
        """
        sources = sources or {}
        old_format = {p: self._records[p].format for p in changes}
        affected: set[tuple[str, str]] = set()
        for p, fmt in changes.items():
            dev = _device_key(p.device)
            affected.add((fmt, dev))
            if old_format[p] is not None:
                affected.add((old_format[p], dev))
        # Sorted: a set of strings iterates in a per-process hash order, and the pools are encoded
        # (drawing stochastic-rounding offsets from the seeded generator) in this order.
        members: dict[tuple[str, str], list[Tensor]] = {key: [] for key in sorted(affected)}
        for p, rec in self._records.items():
            fmt = changes.get(p, rec.format)
            if fmt is None:
                continue
            key = (fmt, _device_key(p.device))
            if key in members:
                members[key].append(p)

        new_pools: dict[tuple[str, str], _Pool] = {}
        new_views: dict[Tensor, dict[str, Tensor]] = {}
        for key, params in members.items():
            fmt, dev = key
            if not params:
                continue
            pool, views = self._allocate_pool(fmt, params)
            new_pools[key] = pool
            for p in params:
                rec = self._records[p]
                target = views[p]
                if p in sources:
                    self._fill_from_source(p, fmt, target, sources[p])
                elif p not in changes or old_format[p] == fmt:
                    for k, t in target.items():
                        t.copy_(rec.views[k])  # unchanged member: keep its bytes
                else:
                    self._convert_into(p, old_format[p], fmt, target)
                new_views[p] = target
        for key in affected:
            self._pools.pop(key, None)
        self._pools.update(new_pools)
        for p, views in new_views.items():
            self._records[p].views = views
            self._records[p].format = changes.get(p, self._records[p].format)
        for p, fmt in changes.items():
            if not FORMATS[fmt].has_momentum:
                self._records[p].m_step = 0

    def _allocate_pool(self, fmt: str, params: list[Tensor]) -> tuple[_Pool, dict[Tensor, dict[str, Tensor]]]:
        layouts = {p: FORMATS[fmt].layout(p.shape) for p in params}
        storage = _storage_device(fmt, params[0].device)
        offsets: dict[Tensor, dict[str, tuple[int, TensorSpec]]] = {p: {} for p in params}
        total = 0
        for itemsize in (8, 4, 2, 1):  # descending item size: every offset stays aligned
            for p in params:
                for spec in layouts[p]:
                    if spec.nbytes and torch.empty((), dtype=spec.dtype).element_size() == itemsize:
                        offsets[p][spec.key] = (total, spec)
                        total += spec.nbytes
        pin = storage.type == "cpu" and FORMATS[fmt].offloaded and torch.cuda.is_available()
        buffer = torch.zeros(total, dtype=torch.uint8, device=storage, pin_memory=pin)
        views: dict[Tensor, dict[str, Tensor]] = {}
        for p in params:
            views[p] = {}
            for spec in layouts[p]:
                if spec.key in offsets[p]:
                    start, _ = offsets[p][spec.key]
                    views[p][spec.key] = buffer[start : start + spec.nbytes].view(spec.dtype)
                else:  # zero-size tensor (empty parameter)
                    views[p][spec.key] = torch.empty(0, dtype=spec.dtype, device=storage)
        return _Pool(fmt, storage, buffer, list(params)), views

    def _hyper_for(self, p: Tensor) -> StepHyper:
        group = self.param_groups[self._records[p].group]
        return self._hyper(group, p.device)

    def _convert_into(self, p: Tensor, old: str, new: str, target: dict[str, Tensor]) -> None:
        rec = self._records[p]
        canonical = FORMATS[old].decode(rec.views, p.shape)
        self._encode(p, new, canonical, target)

    def _encode(self, p: Tensor, fmt: str, canonical: Canonical, target: dict[str, Tensor]) -> None:
        rec = self._records[p]
        hyper = self._hyper_for(p)
        if FORMATS[fmt].has_momentum and canonical.exp_avg is None:
            grad = p.grad
            if grad is not None and bool(torch.isfinite(grad).all()):
                # re-create the momentum as one EMA step of the current gradient; its own bias
                # correction (m_step = 1) makes m_hat equal that gradient
                canonical.exp_avg = grad.detach().to(torch.float32).mul(1.0 - hyper.beta1)
                rec.m_step = 1
            else:
                canonical.exp_avg = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                rec.m_step = 0
        FORMATS[fmt].encode(canonical, target, hyper)

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

    # ------------------------------------------------------------------ step

    def _generator(self, device: torch.device) -> torch.Generator:
        key = _device_key(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[key] = gen
        return gen

    def _hyper(self, group: dict[str, Any], device: torch.device) -> StepHyper:
        beta1, beta2 = group["betas"]
        return StepHyper(
            lr=_float(group["lr"]),
            beta1=_float(beta1),
            beta2=_float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled_weight_decay=bool(group.get("decoupled_weight_decay", True)),
            maximize=bool(group.get("maximize", False)),
            chunk=self.chunk_size,
            generator=self._generator(device),
        )

    @torch.no_grad()
    def _initialize_new(self) -> None:
        fresh = {
            p: self.target_format(p)
            for p, rec in self._records.items()
            if rec.format is None and p.grad is not None
        }
        if fresh:
            self._rebuild(fresh, sources={p: None for p in fresh})

    def _finite_mask(self, params: list[Tensor]) -> list[bool]:
        if not self.skip_nonfinite or not params:
            return [True] * len(params)
        by_device: dict[torch.device, list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            by_device[p.grad.device].append(i)
        mask = [True] * len(params)
        for indices in by_device.values():
            norms = torch._foreach_norm([params[i].grad for i in indices])
            flags = torch.isfinite(torch.stack(norms)).tolist()
            for i, ok in zip(indices, flags):
                mask[i] = ok
        return mask

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D401 - torch's signature
        """Perform one optimization step (``closure`` re-evaluates the model, as in torch)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with_grad = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in with_grad:
            if p.grad.is_sparse:
                raise TypeError(
                    f"BlockwiseAdamW does not support sparse gradients (parameter {self._records[p].name!r}); "
                    f"use torch.optim.SparseAdam for sparse embeddings"
                )
        self._sync_formats()
        self._initialize_new()
        finite = dict(zip(with_grad, self._finite_mask(with_grad)))
        for group in self.param_groups:
            buckets: dict[tuple[str, torch.device], list[StepItem]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                rec = self._records[p]
                if not finite[p]:
                    rec.nonfinite += 1
                    if rec.nonfinite == 1:
                        warnings.warn(
                            f"BlockwiseAdamW: non-finite gradient for {rec.name!r}; its update is "
                            f"skipped (state and value kept). Counted in nonfinite_counts.",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                    continue
                beta1, beta2 = group["betas"]
                rec.step += 1
                if FORMATS[rec.format].has_momentum:
                    rec.m_step += 1
                bc1 = 1.0 - _float(beta1) ** rec.m_step if rec.m_step else 1.0
                bc2 = 1.0 - _float(beta2) ** rec.step
                buckets[(rec.format, p.device)].append(StepItem(p, p.grad, rec.views, bc1, bc2))
            for (fmt, device), items in buckets.items():
                FORMATS[fmt].update(items, self._hyper(group, device))
        return loss

    @property
    def nonfinite_counts(self) -> dict[str, int]:
        """Parameter name -> number of steps skipped because its gradient was not finite."""
        return {rec.name: rec.nonfinite for rec in self._records.values() if rec.nonfinite}

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
            on_host = _storage_device(rec.format, p.device) != p.device
            if on_host == host:
                per_group[rec.group] += FORMATS[rec.format].state_bytes(p.shape)
        return per_group if by_group else sum(per_group)

    def state_tensors(self) -> list[Tensor]:
        """Every tensor of optimizer state (views into the pools), for inspection and tests."""
        return [t for rec in self._records.values() if rec.views for t in rec.views.values()]

    def pool_bytes(self) -> dict[tuple[str, str], int]:
        """(format, parameter device) -> bytes of that pool's storage."""
        return {key: pool.buffer.untyped_storage().nbytes() for key, pool in self._pools.items()}

    def param_state(self, name_or_param: str | Tensor) -> Canonical | None:
        """A parameter's state decoded to fp32 (``None`` before its first step)."""
        p = self._names[name_or_param] if isinstance(name_or_param, str) else name_or_param
        rec = self._records[p]
        if rec.format is None:
            return None
        return FORMATS[rec.format].decode(rec.views, p.shape)

    def step_count(self, name_or_param: str | Tensor) -> int:
        """Number of steps taken by a parameter."""
        p = self._names[name_or_param] if isinstance(name_or_param, str) else name_or_param
        return self._records[p].step

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Compact state keyed by parameter name; loads under ``torch.load(weights_only=True)``.

        Layout::

            {"state": {name: {"format": str, "step": int, "m_step": int,
                              "tensors": {key: compact tensor}}},
             "param_groups": [{hyperparameters..., "params": [names]}],
             "baoc": {"version": 1, "requested": {name: format}, "generators": {...}}}

        8-bit states stay 8-bit. Tensors are copies (views of one pool in several dtypes cannot
        be serialized together).
        """
        state: dict[str, Any] = {}
        for p, rec in self._records.items():
            if rec.format is None:
                continue
            state[rec.name] = {
                "format": rec.format,
                "step": rec.step,
                "m_step": rec.m_step,
                "tensors": {k: t.clone() for k, t in rec.views.items()},
            }
        groups = []
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            saved["params"] = [self._records[p].name for p in group["params"]]
            groups.append(saved)
        return {
            "state": state,
            "param_groups": groups,
            "baoc": {
                "version": _STATE_DICT_VERSION,
                "requested": {r.name: r.requested for r in self._records.values() if r.requested},
                "generators": {k: g.get_state() for k, g in self._generators.items()},
                "nonfinite": self.nonfinite_counts,
            },
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this class, or of ``torch.optim.AdamW``/``Adam``.

        torch's own ``Optimizer.load_state_dict`` would cast every state tensor to the parameter's
        dtype (int8 codes would silently become floats), so this is a full override. A BlockwiseAdamW
        state is matched by parameter name (order may differ); a torch state by position, and its
        fp32 moments are converted into each parameter's target format.
        """
        if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError("state_dict must be an optimizer state dict with 'state' and 'param_groups'")
        if "baoc" in state_dict:
            self._load_own(state_dict)
        else:
            self._load_torch(state_dict)

    def _load_groups(self, saved_groups: list[dict[str, Any]], params_of: list[list[Tensor]]) -> None:
        for group, saved, params in zip(self.param_groups, saved_groups, params_of):
            if set(map(id, params)) != set(map(id, group["params"])):
                raise ValueError("the saved param groups hold other parameters than this optimizer's groups")
            for key, value in saved.items():
                if key not in ("params", "param_names"):
                    group[key] = value

    def _load_own(self, sd: Mapping[str, Any]) -> None:
        meta = sd["baoc"]
        if meta.get("version") != _STATE_DICT_VERSION:
            raise ValueError(f"unsupported BlockwiseAdamW state dict version {meta.get('version')!r}")
        saved_groups = sd["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(saved_groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        params_of = []
        for i, saved in enumerate(saved_groups):
            missing = [n for n in saved["params"] if n not in self._names]
            if missing:
                raise ValueError(f"param group {i} of the state dict names unknown parameters {missing[:5]}")
            params_of.append([self._names[n] for n in saved["params"]])
        self._load_groups(saved_groups, params_of)
        for rec in self._records.values():
            rec.requested = meta.get("requested", {}).get(rec.name)
        changes: dict[Tensor, str] = {}
        sources: dict[Tensor, dict[str, Tensor]] = {}
        for name, entry in sd["state"].items():
            if name not in self._names:
                raise ValueError(f"the state dict holds state of unknown parameter {name!r}")
            p = self._names[name]
            fmt = check_format_name(entry["format"], f"format of {name!r} in the state dict")
            tensors = entry["tensors"]
            for spec in FORMATS[fmt].layout(p.shape):
                t = tensors.get(spec.key)
                if t is None or t.dtype != spec.dtype or t.numel() != spec.numel:
                    raise ValueError(
                        f"state of {name!r} does not match format {fmt!r} for shape {tuple(p.shape)}: "
                        f"{spec.key} should be {spec.dtype} x {spec.numel}, got "
                        f"{None if t is None else (t.dtype, t.numel())}"
                    )
            changes[p] = fmt
            sources[p] = tensors
        self._drop_state()
        if changes:
            self._rebuild(changes, sources)
        for name, entry in sd["state"].items():
            rec = self._records[self._names[name]]
            rec.step = int(entry["step"])
            rec.m_step = int(entry["m_step"])
        for rec in self._records.values():
            rec.nonfinite = int(meta.get("nonfinite", {}).get(rec.name, 0))
        for key, gen_state in meta.get("generators", {}).items():
            gen = self._generator(torch.device(key))
            gen.set_state(gen_state)

    def _drop_state(self) -> None:
        self._pools.clear()
        for rec in self._records.values():
            rec.format = None
            rec.views = None
            rec.step = rec.m_step = 0

    def _load_torch(self, sd: Mapping[str, Any]) -> None:
        saved_groups = sd["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(saved_groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        index_to_param: dict[Any, Tensor] = {}
        params_of = []
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {i} of the state dict has {len(saved['params'])} parameters, "
                    f"this optimizer's has {len(group['params'])}"
                )
            index_to_param.update(zip(saved["params"], group["params"]))
            params_of.append(list(group["params"]))
        for saved in saved_groups:
            if saved.get("amsgrad"):
                raise ValueError("amsgrad state cannot be loaded: BlockwiseAdamW does not implement amsgrad")
        self._load_groups(saved_groups, params_of)
        changes: dict[Tensor, str] = {}
        sources: dict[Tensor, Canonical] = {}
        steps: dict[Tensor, int] = {}
        for index, entry in sd["state"].items():
            p = index_to_param[index]
            if "exp_avg" not in entry or "exp_avg_sq" not in entry:
                raise ValueError(f"state {index!r} is not Adam state (keys {sorted(entry)})")
            canonical = Canonical(
                tuple(p.shape),
                exp_avg=entry["exp_avg"].to(p.device, torch.float32).reshape(p.shape),
                exp_avg_sq=entry["exp_avg_sq"].to(p.device, torch.float32).reshape(p.shape),
            )
            changes[p] = self.target_format(p)
            sources[p] = canonical
            steps[p] = int(_float(entry["step"]))
        self._drop_state()
        for p, step in steps.items():
            self._records[p].step = step
            self._records[p].m_step = step
        if changes:
            self._rebuild(changes, sources)
        for p, step in steps.items():  # _encode may not re-create momentum here: keep counts
            rec = self._records[p]
            rec.step = step
            rec.m_step = step if FORMATS[rec.format].has_momentum else 0

    def to_adamw_state_dict(self) -> dict[str, Any]:
        """Export as a plain ``torch.optim.AdamW`` state dict (fp32, dequantized).

        Factored second moments are expanded; formats without momentum export a zero momentum with
        their own step count (documented loss: a plain AdamW resumes with a cold momentum there).
        """
        state: dict[int, Any] = {}
        groups = []
        index = 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k not in ("params", "param_names", "state_format")}
            saved.update(amsgrad=False, foreach=None, fused=None, capturable=False, differentiable=False)
            saved.setdefault("maximize", False)
            ids = []
            for p in group["params"]:
                rec = self._records[p]
                if rec.format is not None:
                    c = FORMATS[rec.format].decode(rec.views, p.shape)
                    v = c.dense_v().reshape(p.shape).to(p.device)
                    m = c.exp_avg.to(p.device) if c.exp_avg is not None else torch.zeros_like(v)
                    state[index] = {
                        "step": torch.tensor(float(rec.step)),
                        "exp_avg": m.to(p.dtype),
                        "exp_avg_sq": v.to(p.dtype),
                    }
                ids.append(index)
                index += 1
            saved["params"] = ids
            saved["param_names"] = [self._records[p].name for p in group["params"]]
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_optimizer(
        cls,
        optimizer: torch.optim.Optimizer,
        named_parameters: nn.Module | Iterable[tuple[str, Tensor]] | None = None,
        state_format: str | None = None,
        **kwargs: Any,
    ) -> "BlockwiseAdamW":
        """A BlockwiseAdamW over the same param groups and hyperparameters, state inherited.

        Args:
            optimizer: a ``torch.optim.AdamW`` or ``torch.optim.Adam`` (without amsgrad).
            named_parameters: a module or ``(name, parameter)`` pairs naming the parameters
                (default: the groups' ``param_names`` if present, else positional names).
            state_format: default format of every group (default: each group's ``state_format``,
                else ``"fp32"``).
            **kwargs: further constructor arguments (``min_8bit_numel``, ``seed``, ...).

        Example:
            >>> adamw = torch.optim.AdamW(model.parameters(), lr=3e-4)  # doctest: +SKIP
            >>> opt = BlockwiseAdamW.from_optimizer(adamw, model)  # doctest: +SKIP
        """
        if isinstance(optimizer, BlockwiseAdamW):
            return optimizer
        if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
            raise TypeError(
                f"from_optimizer supports torch.optim.AdamW and torch.optim.Adam, got "
                f"{type(optimizer).__name__}; build BlockwiseAdamW directly for other cases"
            )
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        groups = []
        for group in optimizer.param_groups:
            if group.get("amsgrad"):
                raise ValueError("amsgrad=True is not supported by BlockwiseAdamW; use amsgrad=False")
            new = {k: v for k, v in group.items() if k not in ("foreach", "fused", "capturable", "differentiable")}
            new["decoupled_weight_decay"] = decoupled or bool(group.get("decoupled_weight_decay", False))
            if state_format is not None:
                new["state_format"] = state_format
            new["params"] = list(group["params"])
            groups.append(new)
        new_opt = cls(groups, param_names=named_parameters, **kwargs)
        new_opt.defaults.update({k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")})
        if any(optimizer.state.values()):
            sd = optimizer.state_dict()
            new_opt._load_torch({"state": sd["state"], "param_groups": [
                {"params": g["params"]} for g in sd["param_groups"]
            ]})
        return new_opt


def _validate_hyper(group: Mapping[str, Any], where: str) -> None:
    lr = group.get("lr")
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Invalid {where}lr: a Tensor lr must have one element, got shape {tuple(lr.shape)}")
        lr_value = float(lr.item())
    elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
        lr_value = float(lr)
    else:
        raise TypeError(f"Invalid {where}lr: {lr!r}; expected a float >= 0")
    if not lr_value >= 0.0:
        raise ValueError(f"Invalid {where}lr: {lr_value!r}; expected a float >= 0")
    betas = group.get("betas")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid {where}betas: {betas!r}; expected two floats in [0, 1)")
    for i, b in enumerate(betas):
        value = _float(b)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"Invalid {where}betas[{i}]: {value!r}; expected a float in [0, 1)")
    eps = group.get("eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0.0:
        raise ValueError(f"Invalid {where}eps: {eps!r}; expected a float >= 0")
    wd = group.get("weight_decay")
    if not isinstance(wd, (int, float)) or isinstance(wd, bool) or not wd >= 0.0:
        raise ValueError(f"Invalid {where}weight_decay: {wd!r}; expected a float >= 0")
    check_format_name(group.get("state_format"), f"{where}state_format")
    if group.get("amsgrad"):
        raise ValueError(f"Invalid {where}amsgrad: True; BlockwiseAdamW supports amsgrad=False only")
    for key in ("capturable", "differentiable"):
        if group.get(key):
            raise ValueError(f"Invalid {where}{key}: True; BlockwiseAdamW supports {key}=False only")
