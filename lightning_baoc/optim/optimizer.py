"""BlockwiseAdamW: AdamW whose state format is chosen per parameter.

Every parameter's state is held in one of the formats of :data:`lightning_baoc.FORMATS`. The
format is stored per parameter (a param group's ``state_format`` key is only the default), so
param groups stay one-to-one with the user's: LR schedulers, ``LearningRateMonitor`` and code that
indexes ``param_groups`` keep working.

Memory layout (one contiguous pool per format and device, per-parameter views):
:mod:`lightning_baoc.optim.pools`. Checkpoints, loads, copies and pickles:
:mod:`lightning_baoc.optim.persist`. torch-compatible arguments: :mod:`lightning_baoc.optim.args`.

The state is kept outside ``optimizer.state`` on purpose: Lightning moves every tensor found there
to the root device after a restore, which would silently pull host-offloaded states onto the
accelerator (Lightning 2.6's ``Strategy.load_optimizer_state_dict`` calls ``_optimizer_to_device``).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from lightning_baoc import kernels as _kernels
from lightning_baoc.formats import (
    DEFAULT_MIN_8BIT_NUMEL,
    FORMATS,
    Canonical,
    StateFormat,
    StepHyper,
    check_format_name,
    resolve_in,
)
from lightning_baoc.formats.base import DEFAULT_CHUNK
from lightning_baoc.formats.quant import stream_key
from lightning_baoc.optim.args import PERFORMANCE_HINTS, check_torch_options
from lightning_baoc.optim.args import to_float as _float
from lightning_baoc.optim.args import validate_hyper as _validate_hyper
from lightning_baoc.optim.device_plan import CountsStore
from lightning_baoc.optim.gradient_release import ReleaseMixin
from lightning_baoc.optim.masters import MasterMixin
from lightning_baoc.optim.persist import PersistenceMixin
from lightning_baoc.optim.pools import Pool as _Pool
from lightning_baoc.optim.pools import PoolsMixin
from lightning_baoc.optim.pools import Record as _Record
from lightning_baoc.optim.sharding import (
    check_placements,
    flat_shards,
    local,
    row_shards,
    shard_offset,
)
from lightning_baoc.optim.stepping import StepMixin

#: Mixed into the rounding key of a conversion, so that it never reuses a step's noise.
_CONVERSION_SALT = 0x5A17C0DE


class BlockwiseOptimizer(StepMixin, ReleaseMixin, MasterMixin, PoolsMixin, PersistenceMixin, torch.optim.Optimizer):
    """The machinery of the blockwise optimizers: a state format per parameter, pools, conversions,
    checkpoints, master weights and gradient release (:class:`BlockwiseAdamW`,
    :class:`~lightning_baoc.optim.BlockwiseSGD`, :class:`~lightning_baoc.optim.BlockwiseLion`).

    A subclass sets :attr:`format_registry` and :attr:`rule`, builds its defaults, and says how a
    group's hyperparameters validate (:meth:`_validate_group`) and read (:meth:`_hyper`).
    """

    #: The formats this optimizer's parameters may be held in (name -> format).
    format_registry: Mapping[str, StateFormat] = FORMATS
    #: The update rule its formats run (``StepHyper.rule``).
    rule = "adamw"
    #: The name its messages use (an alias installed in place of a user's optimizer keeps it).
    label = "BlockwiseAdamW"
    #: The hyperparameters every param group of its state dicts carries.
    saved_group_keys: tuple[str, ...] = ("lr", "betas", "eps", "weight_decay", "state_format")

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        min_8bit_numel: int,
        skip_nonfinite: bool,
        seed: int,
        chunk_size: int,
        param_names: nn.Module | Iterable[tuple[str, Tensor]] | None,
        kernels: str | None,
    ) -> None:
        if not isinstance(min_8bit_numel, int) or min_8bit_numel < 0:
            raise ValueError(f"Invalid min_8bit_numel: {min_8bit_numel!r}; expected an int >= 0")
        if not isinstance(chunk_size, int) or chunk_size < 32:
            raise ValueError(f"Invalid chunk_size: {chunk_size!r}; expected an int >= 32")
        if not isinstance(seed, int):
            raise TypeError(f"Invalid seed: {seed!r}; expected an int")
        self.kernels = _kernels.resolve_policy(kernels)
        self._records: dict[Tensor, _Record] = {}
        self._salts: dict[str, int] = {}  # name -> its hash in the rounding keys
        self._warned: set[str] = set()  # names warned of a skipped update
        # decided once, not on every step: name -> (what the decision follows from, the decision)
        self._targets: dict[str, tuple[tuple, str]] = {}  # the format a parameter's request resolves to
        # whether the compiled CPU step (by name) and the device's kernels (("device", name)) serve it
        self._serving: dict[str | tuple[str, str], tuple[tuple, bool]] = {}
        self._deferred: list = []  # the steps whose skips the device decided, settled at the next step
        self._plans: dict = {}  # the device's step plans (optim/device_plan.py), dropped when states are replaced
        self._count_store = CountsStore()  # the records' counts as rows of one array, for the plans
        self._released: set[Tensor] = set()  # stepped by gradient release since the last step()
        self._release_handles: list[Any] = []
        self._gradient_observers: OrderedDict[int, Callable[[Tensor], None]] = OrderedDict()  # see add_gradient_observer
        self._names: dict[str, Tensor] = {}
        self._pools: dict[tuple[str, str], _Pool] = {}
        self._live_bytes = 0
        self._peak_bytes = 0
        self._external_names: dict[int, str] = {}
        if param_names is not None:
            items = param_names.named_parameters() if isinstance(param_names, nn.Module) else param_names
            self._external_names = {id(p): n for n, p in items}
        self.min_8bit_numel = min_8bit_numel
        self.skip_nonfinite = bool(skip_nonfinite)
        self.seed = seed
        self.chunk_size = chunk_size
        self._validate_group(defaults, "")
        super().__init__(params, defaults)
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if any(d.type == "cpu" for d in devices):
            _kernels.use_compiled(self.kernels)  # builds or loads them now, says which step runs
        for device in devices:  # a GPU's kernels: Triton imports now (or the error or warning comes now)
            _kernels.use_triton(self.kernels, device)

    def _validate_group(self, group: Mapping[str, Any], where: str) -> None:
        """Validate a param group's hyperparameters (errors name ``where + key``)."""
        _validate_hyper(group, where)

    # ------------------------------------------------------------------ groups and names

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (validated); its parameters get positional or given names.

        A parameter listed twice in the group (torch warns about it) is held once: two records of
        one tensor would update it twice per step.
        """
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        first = {p: i for i, p in reversed(list(enumerate(group["params"])))}
        if len(first) != len(group["params"]):
            keep = sorted(first.values())
            group["params"] = [group["params"][i] for i in keep]
            if group.get("param_names"):
                group["param_names"] = [group["param_names"][i] for i in keep]
        try:
            self._validate_group(group, f"param_groups[{index}].")
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if not p.is_floating_point() or p.is_complex():
                    raise TypeError(
                        f"{self.label} supports real floating-point parameters only; parameter "
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
                check_placements(p, name)
                self._names[name] = p
                self._records[p] = _Record(name=name, group=index, shard_offset=shard_offset(p), frame=flat_shards(p),
                                           row_shards=row_shards(p))
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
        return self._requested(self._records[param])

    def _requested(self, rec: _Record) -> str:
        """:meth:`requested_format` of ``rec``'s parameter (no tensor hashed: the step asks for every one)."""
        return rec.requested or self.param_groups[rec.group]["state_format"]

    def holds_state(self, param: Tensor) -> bool:
        """Whether ``param`` can hold optimizer state in some format (every parameter of AdamW and
        Lion; not one in a group of BlockwiseSGD without momentum)."""
        return True

    def target_format(self, param: Tensor) -> str:
        """The format ``param``'s state is (or will be) held in, after shape fallbacks."""
        return resolve_in(self.format_registry, self.requested_format(param), param.shape, self.min_8bit_numel)

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
        host memory. Step counts are kept. Parameters convert one at a time, in slices, those whose
        device state shrinks first: at the peak the device holds the larger of the states before and
        after, plus the smaller of one parameter's old and new states, plus a few fp32 slices of
        scratch (see :mod:`lightning_baoc.optim.pools`).

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
            check_format_name(fmt, f"format of {key!r}", self.format_registry)
            for p in resolved[key]:
                requests[p] = fmt
        for p, fmt in requests.items():
            self._records[p].requested = fmt
        return self._sync_formats()

    def _sync_formats(self) -> dict[str, tuple[str, str]]:
        """Convert every initialized parameter whose target format differs from its held one."""
        changes: dict[Tensor, str] = {}
        targets = self._targets
        for p, rec in self._records.items():
            if rec.format is None:
                continue
            key = (self._requested(rec), p.shape, self.min_8bit_numel)
            known = targets.get(rec.name)
            if known is None or known[0] != key:  # resolved once per request, not on every step
                known = targets[rec.name] = (key, self.target_format(p))
            if known[1] != rec.format:
                changes[p] = known[1]
        if not changes:
            return {}
        report = {self._records[p].name: (self._records[p].format, fmt) for p, fmt in changes.items()}
        self._rebuild(changes)
        return report

    def _hyper_for(self, p: Tensor) -> StepHyper:
        """``p``'s group hyperparameters, keyed for the rounding of a conversion at its step count."""
        rec = self._records[p]
        return self._hyper(self.param_groups[rec.group], self._noise_key(rec, _CONVERSION_SALT))

    # ------------------------------------------------------------------ step

    def _noise_key(self, rec: _Record, salt: int = 0, step: int | None = None) -> int:
        """The rounding key of ``rec``'s parameter at its step count (or ``step``: a step's, a
        conversion's, a load's); shifted by a shard's offset, so a shard draws the whole parameter's
        bits for its elements."""
        at = rec.step if step is None else step
        return (stream_key(self.seed, at, self._salt(rec) ^ salt) + rec.shard_offset) & 0xFFFFFFFF

    @torch.no_grad()
    def _initialize_new(self) -> None:
        fresh = {
            p: self.target_format(p)
            for p, rec in self._records.items()
            if rec.format is None and p.grad is not None
        }
        if fresh:
            self._rebuild(fresh, sources={p: None for p in fresh})

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
                    f"{self.label} does not support sparse gradients (parameter {self._records[p].name!r}); "
                    f"use torch.optim.SparseAdam for sparse embeddings"
                )
        self._sync_formats()
        self._initialize_new()
        self._sync_corrections()
        self._released.clear()  # a new window: each parameter may release its gradient once again
        self._step_params(with_grad)
        return loss

    @property
    def nonfinite_counts(self) -> dict[str, int]:
        """Parameter name -> number of steps skipped because its gradient was not finite."""
        return {rec.name: rec.nonfinite for rec in self._records.values() if rec.nonfinite}

    def param_state(self, name_or_param: str | Tensor) -> Canonical | None:
        """A parameter's state decoded to fp32 (``None`` before its first step).

        Of a sharded parameter (FSDP2): this rank's shard. A factored second moment of a shard
        expands over the whole parameter's row mean, summed over the shards: ``dense_v()`` is then a
        collective (call it on every rank)."""
        p = self._names[name_or_param] if isinstance(name_or_param, str) else name_or_param
        rec = self._records[p]
        if rec.format is None:
            return None
        state = self.format_registry[rec.format].decode(rec.views, local(p).shape)
        state.shards = rec.row_shards if self.format_registry[rec.format].factored else None
        return state

    def step_count(self, name_or_param: str | Tensor) -> int:
        """Number of steps taken by a parameter."""
        p = self._names[name_or_param] if isinstance(name_or_param, str) else name_or_param
        return self._records[p].step

    def momentum_step_count(self, name_or_param: str | Tensor) -> int:
        """Steps since a parameter's momentum was (re)created: its own bias-correction count
        (equal to :meth:`step_count` unless a format without momentum was held in between)."""
        p = self._names[name_or_param] if isinstance(name_or_param, str) else name_or_param
        return self._records[p].m_step

    def param_group_of(self, name_or_param: str | Tensor) -> dict[str, Any]:
        """The param group holding a parameter (its hyperparameters)."""
        p = self._names[name_or_param] if isinstance(name_or_param, str) else name_or_param
        return self.param_groups[self._records[p].group]

    def _hyper(self, group: Mapping[str, Any], noise_key: int = 0) -> StepHyper:
        """The group's hyperparameters as a :class:`StepHyper` (plain floats)."""
        raise NotImplementedError

    def _inherit_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Load a torch optimizer's state, matched by position (``from_optimizer``)."""
        if any(optimizer.state.values()):
            sd = optimizer.state_dict()
            self.load_state_dict({"state": sd["state"], "param_groups": [{"params": g["params"]} for g in sd["param_groups"]]})


class BlockwiseAdamW(BlockwiseOptimizer):
    """AdamW (decoupled weight decay, bias correction) with a state format per parameter.

    With every parameter in ``fp32`` it behaves like ``torch.optim.AdamW`` (tested to 1e-6 over 200
    steps; bit for bit like ``AdamW(fused=True)``, whose kernel it runs). Cheaper formats hold the same state in fewer bytes; :meth:`set_formats` converts live
    state between any two formats (state inheritance) and keeps the step count.

    Args:
        params: parameters, ``(name, parameter)`` pairs (``model.named_parameters()``) or param
            groups; a group may carry ``state_format`` (the default of its parameters).
        lr: learning rate (default: 1e-3).
        betas: coefficients of the moment averages (default: (0.9, 0.999)).
        eps: added to the denominator (default: 1e-8).
        weight_decay: decoupled weight decay (default: 1e-2).
        amsgrad: torch's AMSGrad variant; not implemented: only ``False`` is accepted (default: False).
        maximize: maximize the objective (default: False).
        foreach: a hint choosing torch's kernels, accepted for drop-in compatibility with
            ``torch.optim.AdamW``; BlockwiseAdamW runs its own per-format kernels, so it changes
            nothing (default: None).
        capturable: CUDA-graph capture of the step; not implemented: only ``False`` (default: False).
        differentiable: autograd through the step; not implemented: only ``False`` (default: False).
        fused: a hint like ``foreach``, accepted and not needed (default: None).
        state_format: default format of every group (default: ``"fp32"``).
        weight_correction: default master-weight correction of the bf16 and fp16 parameters of every
            group: ``"none"``, ``"ecc8"`` or ``"ecc16"`` (:mod:`lightning_baoc.optim.masters`; fp32
            parameters are their own masters). Per parameter: :meth:`set_weight_corrections`
            (default: ``"none"``).
        decoupled_weight_decay: AdamW's decoupled decay; ``False`` gives Adam's L2 penalty
            (default: True).
        min_8bit_numel: tensors with fewer elements stay out of the 8-bit formats (int8 -> fp32,
            nomomentum_int8 -> nomomentum), as bitsandbytes does (default: 4096).
        skip_nonfinite: skip the update of a parameter whose gradient holds inf or NaN, leaving its
            state and value untouched and counting it in :attr:`nonfinite_counts`, instead of letting
            one bad value poison a whole quantization group forever (default: True).
        seed: seed of the stochastic rounding (bf16 states). The rounding of a parameter at a step
            is a function of the seed, the parameter's name and its step count
            (:func:`~lightning_baoc.formats.quant.stream_key`), so a resumed run rounds exactly as an
            uninterrupted one (default: 0).
        chunk_size: elements processed at once by chunked formats (default: 131072).
        param_names: names for plain parameters: a module, or ``(name, parameter)`` pairs
            (default: positional names ``"0"``, ``"1"``, ...).
        kernels: which step runs: ``"auto"`` (the compiled kernels, on the CPU where they build and
            on CUDA where Triton imports, else the eager step with one warning), ``"compiled"`` (the
            kernels or an error), ``"eager"`` (the reference, nothing built); default: the environment
            variable ``LIGHTNING_BAOC_KERNELS``, else ``"auto"`` (:mod:`lightning_baoc.kernels`). The
            CPU kernels are built on the first construction that needs them and cached; the CUDA ones
            (:mod:`lightning_baoc.kernels.triton_step`) compile at their first launch.

    Raises:
        ValueError: an invalid hyperparameter, or ``amsgrad``/``capturable``/``differentiable``
            set; the inputs ``torch.optim.AdamW`` rejects raise torch's error type (see
            :mod:`lightning_baoc.optim.args`).

    Copies: ``copy.deepcopy`` gives an independent optimizer (parameters mapped through the memo,
    as for torch's optimizers) and pickles load in a fresh process; hooks and an LR scheduler's
    wrapper of ``step`` are not copied, as with torch.

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
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_format: str = "fp32",
        weight_correction: str = "none",
        decoupled_weight_decay: bool = True,
        min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
        skip_nonfinite: bool = True,
        seed: int = 0,
        chunk_size: int = DEFAULT_CHUNK,
        param_names: nn.Module | Iterable[tuple[str, Tensor]] | None = None,
        kernels: str | None = None,
    ) -> None:
        check_torch_options(lr, betas, foreach, fused, capturable, differentiable)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            state_format=state_format,
            weight_correction=weight_correction,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
            amsgrad=amsgrad,
            capturable=capturable,
            differentiable=differentiable,
        )
        super().__init__(
            params,
            defaults,  # refuses amsgrad, capturable, differentiable set to True
            min_8bit_numel=min_8bit_numel,
            skip_nonfinite=skip_nonfinite,
            seed=seed,
            chunk_size=chunk_size,
            param_names=param_names,
            kernels=kernels,
        )

    def _hyper(self, group: Mapping[str, Any], noise_key: int = 0) -> StepHyper:
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
            noise_key=noise_key,
            kernels=self.kernels,
        )

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
        name = type(optimizer).__name__
        hints: dict[str, None] = {}  # ordered set: each hint named once, however many groups carry it
        groups = []
        for i, group in enumerate(optimizer.param_groups):
            for key in ("amsgrad", "capturable", "differentiable"):
                if group.get(key):
                    raise ValueError(
                        f"Invalid {name}({key}=True) (param group {i}): BlockwiseAdamW does not implement "
                        f"{key}; build the {name} with {key}=False"
                    )
            hints.update({f"{key}={group[key]!r}": None for key in PERFORMANCE_HINTS if group.get(key) is not None})
            new = {k: v for k, v in group.items() if k not in PERFORMANCE_HINTS + ("capturable", "differentiable")}
            new["decoupled_weight_decay"] = decoupled or bool(group.get("decoupled_weight_decay", False))
            if state_format is not None:
                new["state_format"] = state_format
            new["params"] = list(group["params"])
            groups.append(new)
        if hints:
            warnings.warn(
                f"{name}({', '.join(hints)}): performance hints choosing torch's own AdamW kernels. "
                f"BlockwiseAdamW runs its own per-format kernels, so they are not needed and not used "
                f"(the update is the same).",
                UserWarning,
                stacklevel=2,
            )
        new_opt = cls(groups, param_names=named_parameters, **kwargs)
        new_opt.defaults.update({k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")})
        new_opt._inherit_state(optimizer)
        return new_opt


# ---------------------------------------------------------------------------- public path

#: Where pickles find the optimizers and their aliases: the public path, not this file's, so a
#: pickle survives a move of the implementation.
PUBLIC_MODULE = "lightning_baoc.optim"
BlockwiseOptimizer.__module__ = PUBLIC_MODULE
BlockwiseAdamW.__module__ = PUBLIC_MODULE

