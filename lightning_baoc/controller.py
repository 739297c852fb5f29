"""The BAOC lifecycle, free of any training framework: sample -> risk -> solve -> set_formats.

:class:`BAOCController` holds everything the Lightning callback (:mod:`lightning_baoc.callback`)
and the Fabric strategy (:mod:`lightning_baoc.fabric`) share; the adapters only translate their
framework's hooks into five calls:

1. :meth:`~BAOCController.install` once, before training: the user's ``torch.optim.AdamW`` /
   ``Adam`` is replaced by a :class:`~lightning_baoc.BlockwiseAdamW` over the same param groups
   (all ``fp32``: identical behaviour), the model is partitioned into blocks and a
   :class:`~lightning_baoc.GradientSampler` is attached. LR schedulers are rebound with
   :func:`rebind_scheduler`. The budgets are checked against the memory (and time) tables right
   away, so an infeasible budget fails before any training is spent on it.
2. :meth:`~BAOCController.observe` once per optimizer step, where gradients are final
   (accumulated, all-reduced, unscaled): it feeds the sampler, every ``sample_every`` steps
   during warm-up and ``sparse_sampling`` times sparser afterwards.
3. :meth:`~BAOCController.maybe_allocate` after an optimizer step has completed (between
   batches, never inside the step in flight): at warm-up end, and later when a re-evaluation is
   pending, it computes the statistics, the risk table (:func:`lightning_baoc.risk.risk_table`),
   solves the allocation (:func:`lightning_baoc.solve`) and converts the formats of the blocks
   whose format changed, in place (state inheritance).
4. :meth:`~BAOCController.epoch_end` and :meth:`~BAOCController.validation_end` schedule
   re-evaluations: every ``reevaluate_every_n_epochs`` epochs and when ``monitor`` has not
   improved for ``patience`` validation checks. :meth:`~BAOCController.set_budget` changes a budget
   mid-training and schedules one too.
5. :meth:`~BAOCController.state_dict` / :meth:`~BAOCController.load_state_dict`: phase,
   allocation, counters and the sampler's ring buffer, as primitives and tensors (loads under
   ``torch.load(weights_only=True)``).

Distributed training: every rank runs the same calls. Decisions (the feasibility check, the
allocation) are computed on rank zero only and handed to the others through the ``broadcast``
callable the adapter passes (``strategy.broadcast``); an error on rank zero is broadcast too and
raised on every rank, so no rank is left waiting.

Hysteresis: a re-evaluation keeps the current allocation unless the new one lowers the total
risk (both scored with the fresh risk table) by more than the relative ``hysteresis``, or the
current one no longer meets the (possibly changed) budgets.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from dataclasses import dataclass, fields
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
from torch import nn

from .blocks import GRANULARITIES, partition
from .budget import format_bytes, parse_memory_budget, parse_time_budget
from .calibration import PRIOR_STEP_COST, calibrate, hardware_mask, memory_table, time_table
from .formats import DEFAULT_MIN_8BIT_NUMEL, FORMATS, format_state_bytes
from .optim import BlockwiseAdamW
from .sampler import DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS, GradientSampler
from .solver import Allocation, BudgetInfeasibleError, solve

#: Format version of :meth:`BAOCController.state_dict`.
STATE_VERSION = 1

#: Ring samples the statistics need before an allocation: a signal-to-noise ratio and a cosine
#: between consecutive samples are undefined with fewer than two.
MIN_SAMPLES = 2

#: Optimizers BAOC can take over (named in the error for any other).
SUPPORTED_OPTIMIZERS = ("torch.optim.AdamW", "torch.optim.Adam (amsgrad=False)", "lightning_baoc.BlockwiseAdamW")

Phase = Literal["warmup", "allocated"]
#: ``risk_fn(optimizer, blocks, statistics, formats=..., horizon=...) -> block -> format -> risk``
RiskFn = Callable[..., Mapping[str, Mapping[str, float]]]
#: ``broadcast(obj) -> obj`` from rank zero (``strategy.broadcast``); identity on one process.
Broadcast = Callable[[Any], Any]


def _default_risk_fn(
    optimizer: BlockwiseAdamW,
    blocks: Mapping[str, Sequence[str]],
    statistics: Mapping[str, Mapping[str, float]] | None,
    formats: Sequence[str] | None = None,
    horizon: int = 200,
) -> Mapping[str, Mapping[str, float]]:
    # Imported at call time so that the lifecycle does not pin the risk model's module at import.
    from .risk import risk_table

    return risk_table(optimizer, blocks, statistics, formats=formats, horizon=horizon)


def _plain(value: Any) -> Any:
    """Containers as plain dicts/lists of primitives (OmegaConf's DictConfig/ListConfig included):
    ``torch.load(weights_only=True)`` rejects anything else in a checkpoint."""
    try:  # omegaconf is a dependency, but keep the lifecycle usable without it
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is installed with the package
        pass
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _check_int(name: str, value: object, minimum: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = " or None" if allow_none else ""
        raise ValueError(f"Invalid {name}={value!r}; expected an int >= {minimum}{none}")
    return int(value)


def _check_float(name: str, value: object, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"Invalid {name}={value!r}; expected a finite number >= {minimum}")
    return float(value)


@dataclass
class BAOCConfig:
    """Every setting of the BAOC lifecycle, validated (the callback's and the strategy's arguments).

    Args:
        memory_budget: optimizer-state memory allowed: a fraction in (0, 1] of the fp32 AdamW
            state (``0.3``, ``"30%"``) or absolute (``"6GB"``, ``"512MiB"``, an int of bytes).
        time_budget: optimizer-step time allowed, a multiple >= 1 of the fp32 AdamW step
            (``1.2``) or absolute (``"12ms"``); priced by a calibration on the device
            (default: ``None``: no limit).
        warmup_steps: optimizer steps in fp32 before the first allocation (default: 200).
        sample_every: sample the gradients every N optimizer steps during warm-up (default: 10).
        granularity: blocks: ``"module"``, ``"layer"`` or ``"param"`` (default: ``"module"``).
        blocks: named glob patterns over parameter names, block name -> glob or list of globs,
            matched before ``granularity`` (default: ``None``).
        formats: the formats the solver may pick (default: ``None``: all of
            :data:`~lightning_baoc.FORMATS` the device serves).
        reevaluate_every_n_epochs: re-evaluate the allocation every N epochs (default: ``None``:
            never on a schedule).
        monitor: a validation metric; a re-evaluation is triggered when it has not improved for
            ``patience`` checks (default: ``None``).
        mode: ``"min"`` or ``"max"``: whether ``monitor`` improves downwards (default: ``"min"``).
        patience: validation checks without improvement before a re-evaluation (default: 3).
        min_delta: smallest change of ``monitor`` counted as an improvement (default: 0.0).
        hysteresis: a re-evaluation migrates only if the new allocation lowers the total risk by
            more than this fraction (or the current one breaks a budget) (default: 0.1).
        horizon: optimizer steps over which the risk model lets update noise average out
            (default: 200).
        sparse_sampling: after warm-up, sample ``sparse_sampling`` times less often (default: 4).
        capacity: ring-buffer samples kept by the sampler (default: 32).
        max_elements: gradient elements sampled per block (default: 4096).
        min_8bit_numel: tensors with fewer elements stay out of the 8-bit formats (default: 4096).
        calibration: step costs for a time budget: ``"auto"`` (measure on the device once, cached)
            or ``"prior"`` (:data:`~lightning_baoc.calibration.PRIOR_STEP_COST`) (default: ``"auto"``).
        calibration_cache_dir: where ``"auto"`` caches its measurement (default: ``None``: the
            user cache directory).
        seed: seed of the gradient sampling indices and of stochastic rounding (default: 0).
        max_block_risk: a cap on the risk of any one block: a format whose risk on a block
            exceeds it is not offered to the solver for that block (on the scale of the risk
            table, where a block's risk is weighted by its share of the update, so the block
            risks add up to the total risk). If the memory budget cannot be met under the cap,
            the budget wins: the cap is lifted for that allocation, with a warning naming the
            memory the cap would need (default: ``None``: no cap).

    Example:
        >>> BAOCConfig(memory_budget=0.3, warmup_steps=100).sample_every
        10
    """

    memory_budget: float | int | str
    time_budget: float | str | None = None
    warmup_steps: int = 200
    sample_every: int = 10
    granularity: str = "module"
    blocks: dict[str, str | list[str]] | None = None
    formats: list[str] | None = None
    reevaluate_every_n_epochs: int | None = None
    monitor: str | None = None
    mode: str = "min"
    patience: int = 3
    min_delta: float = 0.0
    hysteresis: float = 0.1
    horizon: int = 200
    sparse_sampling: int = 4
    capacity: int = DEFAULT_CAPACITY
    max_elements: int = DEFAULT_MAX_ELEMENTS
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL
    calibration: str = "auto"
    calibration_cache_dir: str | None = None
    seed: int = 0
    max_block_risk: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, _plain(getattr(self, f.name)))
        # Budgets: the syntax is checked now (a fraction is resolved against the model later).
        parse_memory_budget(self.memory_budget, fp32_bytes=float(1 << 62))
        if self.time_budget is not None:
            parse_time_budget(self.time_budget, fp32_seconds=1.0)
        self.warmup_steps = _check_int("warmup_steps", self.warmup_steps, 1)
        self.sample_every = _check_int("sample_every", self.sample_every, 1)
        # Two ring samples (steps 0 and sample_every) and the follower of the second (lag-1 cosine).
        least = self.sample_every + (2 if self.sample_every > 1 else 1)
        if self.warmup_steps < least:
            raise ValueError(
                f"Invalid warmup_steps={self.warmup_steps} for sample_every={self.sample_every}: the "
                f"statistics need {MIN_SAMPLES} gradient samples, taken at steps 0 and {self.sample_every}; "
                f"use warmup_steps >= {least} or a smaller sample_every"
            )
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"Invalid granularity={self.granularity!r}; allowed: {list(GRANULARITIES)}")
        if self.blocks is not None and not isinstance(self.blocks, dict):
            raise TypeError(
                f"Invalid blocks={self.blocks!r}; expected a mapping block name -> glob or list of globs"
            )
        if self.formats is not None:
            if isinstance(self.formats, str) or not isinstance(self.formats, list) or not self.formats:
                raise ValueError(f"Invalid formats={self.formats!r}; expected a non-empty list of {list(FORMATS)}")
            unknown = [f for f in self.formats if f not in FORMATS]
            if unknown:
                raise ValueError(f"Invalid formats: unknown {unknown}; allowed: {list(FORMATS)}")
        self.reevaluate_every_n_epochs = _check_int(
            "reevaluate_every_n_epochs", self.reevaluate_every_n_epochs, 1, allow_none=True
        )
        if self.monitor is not None and not isinstance(self.monitor, str):
            raise TypeError(f"Invalid monitor={self.monitor!r}; expected a metric name (str) or None")
        if self.mode not in ("min", "max"):
            raise ValueError(f"Invalid mode={self.mode!r}; allowed: ['min', 'max']")
        self.patience = _check_int("patience", self.patience, 1)
        self.min_delta = _check_float("min_delta", self.min_delta, 0.0)
        self.hysteresis = _check_float("hysteresis", self.hysteresis, 0.0)
        self.horizon = _check_int("horizon", self.horizon, 1)
        self.sparse_sampling = _check_int("sparse_sampling", self.sparse_sampling, 1)
        self.capacity = _check_int("capacity", self.capacity, MIN_SAMPLES)
        self.max_elements = _check_int("max_elements", self.max_elements, 1)
        self.min_8bit_numel = _check_int("min_8bit_numel", self.min_8bit_numel, 0)
        if self.calibration not in ("auto", "prior"):
            raise ValueError(f"Invalid calibration={self.calibration!r}; allowed: ['auto', 'prior']")
        self.seed = _check_int("seed", self.seed, 0)
        if self.max_block_risk is not None:
            self.max_block_risk = _check_float("max_block_risk", self.max_block_risk, 0.0)


@dataclass
class AllocationEvent:
    """What one allocation decided and did (handed to the reports; primitives only).

    Attributes:
        step: optimizer steps completed when it ran.
        reason: ``"warmup"``, ``"epoch"``, ``"plateau"`` or ``"budget"``.
        formats: block -> format now in force.
        changed: block -> (old format, new format) of the blocks converted.
        migrated: parameter name -> (old, new) held formats, as ``set_formats`` reported them.
        kept: whether hysteresis kept the current allocation.
        risk: block -> format -> risk (the fresh risk table).
        total_risk: total risk of ``formats`` under ``risk``.
        solver_risk: total risk of the solver's answer (before hysteresis).
        statistics: block -> sampler statistics.
        block_params: block -> parameter names; ``block_numel``: block -> elements.
        block_bytes: block -> state bytes in its format; ``state_bytes_before`` / ``state_bytes``:
            the optimizer's state bytes before and after; ``fp32_state_bytes``: 8 x the elements.
        memory_budget_bytes: the memory budget in bytes; ``time_budget``: seconds (or ``None``).
        time: step time of ``formats`` in the time table's unit, or ``None``.
    """

    step: int
    reason: str
    formats: dict[str, str]
    changed: dict[str, tuple[str, str]]
    migrated: dict[str, tuple[str, str]]
    kept: bool
    risk: dict[str, dict[str, float]]
    total_risk: float
    solver_risk: float
    statistics: dict[str, dict[str, float]]
    block_params: dict[str, list[str]]
    block_numel: dict[str, int]
    block_bytes: dict[str, int]
    state_bytes_before: int
    state_bytes: int
    fp32_state_bytes: int
    memory_budget_bytes: int
    time_budget: float | None = None
    time: float | None = None

    @property
    def saved_fraction(self) -> float:
        """Fraction of the fp32 AdamW state memory saved: ``1 - state_bytes / fp32_state_bytes``."""
        return 1.0 - self.state_bytes / self.fp32_state_bytes if self.fp32_state_bytes else 0.0


# ---------------------------------------------------------------------------- optimizer swap

_ALIASES: dict[str, type[BlockwiseAdamW]] = {}


def _named_like(name: str) -> type[BlockwiseAdamW]:
    """A BlockwiseAdamW subclass whose ``__name__`` is the user's optimizer class name.

    ``LearningRateMonitor`` names its metrics ``"lr-" + type(optimizer).__name__`` (``lr-AdamW/pg1``);
    keeping the name keeps the user's dashboards and monitors working after the swap. The class is
    registered in this module under ``_BlockwiseAs<name>`` so it pickles by reference.
    """
    alias = _ALIASES.get(name)
    if alias is None:
        qualname = f"_BlockwiseAs{name}"
        alias = type(
            name,
            (BlockwiseAdamW,),
            {"__module__": __name__, "__qualname__": qualname, "__doc__": f"BlockwiseAdamW installed in place of {name}."},
        )
        globals()[qualname] = alias
        _ALIASES[name] = alias
    return alias


def convert_optimizer(
    optimizer: torch.optim.Optimizer, module: nn.Module, min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL, seed: int = 0
) -> BlockwiseAdamW:
    """The user's optimizer as a fp32 :class:`BlockwiseAdamW` (same groups, hyperparameters, state).

    A BlockwiseAdamW is returned as is. The new optimizer's class carries the old one's name
    (``type(new).__name__ == "AdamW"``) so that LR-monitor metric names do not change.

    Raises:
        TypeError: any optimizer other than those of :data:`SUPPORTED_OPTIMIZERS`.

    Example:
        >>> model = nn.Linear(4, 2)
        >>> opt = convert_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
        >>> isinstance(opt, BlockwiseAdamW), type(opt).__name__, opt.param_groups[0]["lr"]
        (True, 'AdamW', 0.001)
    """
    if isinstance(optimizer, BlockwiseAdamW):
        return optimizer
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise TypeError(
            f"BAOC cannot take over {type(optimizer).__name__} ({type(optimizer).__module__}): it converts "
            f"Adam-family optimizer states; supported: {list(SUPPORTED_OPTIMIZERS)}. Return one of them "
            f"from configure_optimizers, or remove the BAOC callback."
        )
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise ValueError(
            f"BAOC cannot take over {type(optimizer).__name__}(amsgrad=True): BlockwiseAdamW implements "
            f"amsgrad=False only; supported: {list(SUPPORTED_OPTIMIZERS)}"
        )
    if _overrides_step(optimizer):
        warnings.warn(
            f"{type(optimizer).__name__} overrides step(); BAOC replaces it by BlockwiseAdamW, which "
            f"implements torch's Adam/AdamW update, so that override no longer runs",
            UserWarning,
            stacklevel=2,
        )
    cls = _named_like(type(optimizer).__name__)
    new = cls.from_optimizer(optimizer, module, min_8bit_numel=min_8bit_numel, seed=seed)
    if getattr(optimizer, "_opt_called", False):
        new._opt_called = True  # type: ignore[attr-defined]
    return new


def _overrides_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a subclass of torch's AdamW/Adam defines its own ``step`` (torch's profiling hook,
    which wraps ``step`` on the class, is seen through)."""
    base = torch.optim.AdamW if isinstance(optimizer, torch.optim.AdamW) else torch.optim.Adam
    reference = getattr(base.step, "__wrapped__", base.step)
    for klass in type(optimizer).__mro__:
        if klass is base:
            return False
        fn = vars(klass).get("step")
        if fn is not None and getattr(fn, "__wrapped__", fn) is not reference:
            return True
    return False


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way torch's LR schedulers do when they are built on it.

    A scheduler rebound to another optimizer would otherwise warn on its first ``step()`` that
    "optimizer.step() has been overridden after learning rate scheduler initialization".
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)
    func = type(optimizer).step

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def rebind_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point an LR scheduler (and the schedulers it chains) at ``optimizer``.

    Param groups are one-to-one with the old optimizer's, so ``base_lrs``, ``LambdaLR``'s lambdas
    and ``ReduceLROnPlateau``'s ``min_lrs`` stay valid; the scheduler's own state is untouched.

    Example:
        >>> model = nn.Linear(4, 2)
        >>> old = torch.optim.AdamW(model.parameters(), lr=1.0)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(old, lambda step: 0.5)
        >>> new = convert_optimizer(old, model)
        >>> rebind_scheduler(sched, new)
        >>> sched.optimizer is new, new.param_groups[0]["lr"]
        (True, 0.5)
    """
    for sub in getattr(scheduler, "_schedulers", None) or ():  # SequentialLR, ChainedScheduler
        rebind_scheduler(sub, optimizer)
    if hasattr(scheduler, "optimizer"):
        scheduler.optimizer = optimizer
        _track_step_called(optimizer)


# ---------------------------------------------------------------------------- rank-zero decisions


def _error_payload(err: BaseException) -> dict[str, Any]:
    if isinstance(err, BudgetInfeasibleError):
        attrs = {k: getattr(err, k) for k in ("memory_budget", "time_budget", "min_memory", "min_time", "exact", "fp32_memory", "fp32_time")}
        return {"infeasible": str(err), "attrs": attrs}
    return {"error": f"{type(err).__name__}: {err}"}


def decide_on_rank_zero(fn: Callable[[], Any], broadcast: Broadcast | None, is_global_zero: bool) -> Any:
    """Run ``fn`` on rank zero, broadcast its result (or its error) and return it on every rank.

    Every rank must call this at the same point. An error raised on rank zero is raised on every
    rank (a :class:`BudgetInfeasibleError` with its attributes; anything else as a
    ``RuntimeError`` naming it), so no rank waits forever on a broadcast that never comes.

    Example:
        >>> decide_on_rank_zero(lambda: {"a": "int8"}, broadcast=None, is_global_zero=True)
        {'a': 'int8'}
    """
    payload: dict[str, Any] | None = None
    local: BaseException | None = None
    if is_global_zero:
        try:
            payload = {"ok": fn()}
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            local = err
            payload = _error_payload(err)
    if broadcast is not None:
        payload = broadcast(payload)
    if payload is None:  # pragma: no cover - a broadcast that returned nothing
        raise RuntimeError("BAOC: rank zero's decision did not arrive (broadcast returned None)")
    if "ok" in payload:
        return payload["ok"]
    if local is not None:
        raise local
    if "infeasible" in payload:
        raise BudgetInfeasibleError(payload["infeasible"], **payload["attrs"])
    raise RuntimeError(f"BAOC: the allocation failed on rank zero: {payload['error']}")


# ---------------------------------------------------------------------------- the controller


class BAOCController:
    """The framework-free BAOC lifecycle (see the module docstring for the calls and their order).

    Args:
        config: the settings (a :class:`BAOCConfig`, or its fields as keyword arguments).
        risk_fn: the risk model, ``risk_fn(optimizer, blocks, statistics, formats=, horizon=)``
            (default: :func:`lightning_baoc.risk.risk_table`).

    Example:
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
        >>> ctl = BAOCController(BAOCConfig(memory_budget=0.5, warmup_steps=12, sample_every=5))
        >>> opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
        >>> for step in range(12):
        ...     opt.zero_grad(); model(torch.randn(32, 64)).pow(2).mean().backward()
        ...     _ = ctl.observe(step); opt.step()
        ...     event = ctl.maybe_allocate(step + 1)
        >>> event.reason, opt.state_bytes() <= 0.5 * event.fp32_state_bytes
        ('warmup', True)
        >>> ctl.close()
    """

    def __init__(self, config: BAOCConfig | None = None, risk_fn: RiskFn | None = None, **kwargs: Any) -> None:
        if config is None:
            config = BAOCConfig(**kwargs)
        elif kwargs:
            raise TypeError(f"pass either config or keyword settings, not both (got {sorted(kwargs)})")
        self.config = config
        self.risk_fn: RiskFn = risk_fn or _default_risk_fn
        self.optimizer: BlockwiseAdamW | None = None
        self.sampler: GradientSampler | None = None
        self.blocks: dict[str, list[str]] = {}
        self.phase: Phase = "warmup"
        self.allocation: dict[str, str] = {}
        self.history: list[dict[str, Any]] = []
        self.last_event: AllocationEvent | None = None
        self.pending: str | None = None
        self.best: float | None = None
        self.wait = 0
        self.ring_samples = 0  # ring samples since the last allocation (fresh statistics)
        self.steps = 0  # optimizer steps seen (adapters without a global step counter use it)
        self._shapes: dict[str, list[tuple[int, ...]]] = {}
        self._numel: dict[str, int] = {}
        self._device = torch.device("cpu")
        self._mask: dict[str, str] = {}
        self._allowed: list[str] = []
        self._memory: dict[str, dict[str, int]] = {}
        self._time: dict[str, dict[str, float]] | None = None
        self._loaded: dict[str, Any] | None = None

    # ------------------------------------------------------------------ properties

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` has run."""
        return self.optimizer is not None

    @property
    def fp32_state_bytes(self) -> int:
        """fp32 AdamW state bytes of the blocks: 8 bytes per trainable element."""
        return 8 * sum(self._numel.values())

    def memory_budget_bytes(self) -> int:
        """The memory budget in bytes (a fraction resolved against :attr:`fp32_state_bytes`)."""
        return parse_memory_budget(self.config.memory_budget, self.fp32_state_bytes)

    # ------------------------------------------------------------------ install

    def install(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> BlockwiseAdamW:
        """Take over ``optimizer`` (fp32, identical behaviour) and attach blocks and sampler.

        Idempotent for the optimizer it returned. Rebinding LR schedulers and swapping the
        optimizer in the framework is the adapter's job (:func:`rebind_scheduler`).

        Args:
            optimizer: a ``torch.optim.AdamW``/``Adam`` or a ``BlockwiseAdamW``.
            module: the model whose ``named_parameters()`` name the optimizer's parameters.

        Raises:
            TypeError: an unsupported optimizer (the message names the supported ones).
            ValueError: the optimizer holds parameters ``module`` does not have.
        """
        if self.optimizer is not None and optimizer is self.optimizer:
            return self.optimizer
        cfg = self.config
        new = convert_optimizer(optimizer, module, cfg.min_8bit_numel, cfg.seed)
        named = new.named_params
        module_params = {id(p) for p in module.parameters()}
        foreign = [n for n, p in named.items() if id(p) not in module_params]
        if foreign:
            raise ValueError(
                f"the optimizer holds {len(foreign)} parameter(s) that are not parameters of the model "
                f"(e.g. {foreign[:3]}); BAOC partitions the model's parameters into blocks: give the "
                f"optimizer the model's parameters only"
            )
        raw = partition(module, cfg.granularity, cfg.blocks)
        blocks = {b: [n for n in names if n in named] for b, names in raw.items()}
        self.blocks = {b: names for b, names in blocks.items() if names}
        if not self.blocks:
            raise ValueError("the optimizer holds no trainable parameter of the model: nothing to allocate")
        self._shapes = {b: [tuple(named[n].shape) for n in names] for b, names in self.blocks.items()}
        self._numel = {b: sum(named[n].numel() for n in names) for b, names in self.blocks.items()}
        self._device = next(iter(named.values())).device
        wanted = list(cfg.formats) if cfg.formats is not None else list(FORMATS)
        self._mask = {f: why for f, why in hardware_mask(self._device).items() if f in wanted}
        self._allowed = [f for f in wanted if f not in self._mask]
        if not self._allowed:
            raise ValueError(
                f"formats={wanted} are all masked on {self._device} ({self._mask}); allow other formats"
            )
        table = memory_table(self._shapes, self._device, sorted(set(self._allowed) | {"fp32"}), new.min_8bit_numel)
        self._memory = table
        self._time = None
        if self.sampler is not None:
            self.sampler.close()
        self.sampler = GradientSampler(
            module, self.blocks, cfg.sample_every, cfg.capacity, cfg.max_elements, seed=cfg.seed
        )
        self.optimizer = new
        self.ring_samples = 0  # a new sampler starts with an empty ring
        if self._loaded is not None:
            self._apply_loaded()
        elif self.phase == "allocated" and self.allocation:
            # A second fit with the same controller: the fresh optimizer starts in the allocation.
            new.set_formats(self.allocation, blocks=self.blocks)
        return new

    # ------------------------------------------------------------------ tables and budgets

    def _time_table(self) -> dict[str, dict[str, float]]:
        if self._time is None:
            cfg = self.config
            if cfg.calibration == "prior":
                costs: Any = PRIOR_STEP_COST
            else:
                costs = calibrate(self._device, cache_dir=cfg.calibration_cache_dir)
            assert self.optimizer is not None
            self._time = time_table(
                self._shapes, costs, sorted(set(self._allowed) | {"fp32"}), self.optimizer.min_8bit_numel
            )
        return self._time

    def _budgets(self) -> tuple[Any, Any, int, float | None]:
        """(memory budget, time budget) as passed to ``solve``, and both in absolute units."""
        cfg = self.config
        mb_bytes = self.memory_budget_bytes()
        tb_abs: float | None = None
        if cfg.time_budget is not None:
            fp32_time = sum(row["fp32"] for row in self._time_table().values())
            tb_abs = parse_time_budget(cfg.time_budget, fp32_time)
        if "fp32" in self._allowed:
            return cfg.memory_budget, cfg.time_budget, mb_bytes, tb_abs  # the solver names fractions
        return mb_bytes, (None if tb_abs is None else f"{tb_abs!r}s"), mb_bytes, tb_abs

    def _solve(self, risk: Mapping[str, Mapping[str, float]]) -> Allocation:
        mem = {b: {f: self._memory[b][f] for f in self._allowed} for b in self.blocks}
        tim = None
        if self.config.time_budget is not None:
            full = self._time_table()
            tim = {b: {f: full[b][f] for f in self._allowed} for b in self.blocks}
        mb, tb, _, _ = self._budgets()
        try:
            return solve(risk, mem, mb, tim, tb)
        except BudgetInfeasibleError as err:
            allowed = ", ".join(self._allowed)
            masked = f"; masked on {self._device}: {sorted(self._mask)}" if self._mask else ""
            raise BudgetInfeasibleError(
                f"BAOC(memory_budget={self.config.memory_budget!r}, time_budget={self.config.time_budget!r}): "
                f"{err} (formats allowed: {allowed}{masked}). No format was converted; the optimizer "
                f"keeps its current formats.",
                memory_budget=err.memory_budget,
                time_budget=err.time_budget,
                min_memory=err.min_memory,
                min_time=err.min_time,
                exact=err.exact,
                fp32_memory=err.fp32_memory,
                fp32_time=err.fp32_time,
            ) from None

    def check_feasible(self, broadcast: Broadcast | None = None, is_global_zero: bool = True) -> None:
        """Raise :class:`BudgetInfeasibleError` now if no allocation can meet the budgets.

        Feasibility depends on the memory and time tables only (not on the risk), so it is known
        before warm-up; checking at install spares a warm-up that could never end in an allocation.
        """
        self._require_installed("check_feasible")

        def check() -> bool:
            self._solve({b: {f: 0.0 for f in self._allowed} for b in self.blocks})
            return True

        decide_on_rank_zero(check, broadcast, is_global_zero)

    def set_budget(self, memory_budget: float | int | str | None = None, time_budget: float | str | None = None) -> None:
        """Change a budget mid-training; the next step boundary re-evaluates against it.

        Call it on every rank. A budget that can no longer be met raises at that re-evaluation,
        before any conversion. ``None`` keeps a budget as it is.

        Example:
            >>> ctl = BAOCController(memory_budget=0.5, warmup_steps=20)
            >>> ctl.set_budget(memory_budget="30%")
            >>> ctl.config.memory_budget
            '30%'
        """
        cfg = self.config
        if memory_budget is not None:
            parse_memory_budget(_plain(memory_budget), fp32_bytes=float(1 << 62))
            cfg.memory_budget = _plain(memory_budget)
        if time_budget is not None:
            parse_time_budget(_plain(time_budget), fp32_seconds=1.0)
            cfg.time_budget = _plain(time_budget)
        if self.phase == "allocated":
            self.pending = "budget"

    # ------------------------------------------------------------------ hot path

    def observe(self, step: int, grad_scale: float | None = None) -> bool:
        """Feed the sampler with the current gradients; call once per optimizer step, before it.

        Args:
            step: optimizer steps completed before this one (Lightning's ``global_step``).
            grad_scale: the loss scale the gradients still carry, if any (fp16 AMP).

        Returns:
            whether a sample was taken.
        """
        if self.sampler is None:
            return False
        every = self.config.sample_every
        if self.phase == "allocated" and self.config.sparse_sampling > 1:
            # Sparser after warm-up: every sparse_sampling-th sampling step (and its follower).
            if (step // every) % self.config.sparse_sampling:
                return False
        took = self.sampler.sample(step, grad_scale)
        if took and (every == 1 or step % every == 0):
            self.ring_samples += 1
        return took

    def due(self, step: int) -> str | None:
        """The reason an allocation should run now (after ``step`` completed steps), or ``None``."""
        if not self.installed or self.ring_samples < MIN_SAMPLES:
            return None
        if self.phase == "warmup":
            return "warmup" if step >= self.config.warmup_steps else None
        return self.pending

    def maybe_allocate(
        self, step: int, broadcast: Broadcast | None = None, is_global_zero: bool = True
    ) -> AllocationEvent | None:
        """Allocate if one is due (:meth:`due`); call between steps, on every rank.

        Args:
            step: optimizer steps completed.
            broadcast: ``strategy.broadcast`` under distributed training (default: none).
            is_global_zero: whether this is rank zero (default: True).
        """
        self.steps = max(self.steps, step)
        reason = self.due(step)
        if reason is None:
            return None
        return self.allocate(step, reason, broadcast, is_global_zero)

    # ------------------------------------------------------------------ allocation

    def _plan(self, reason: str) -> dict[str, Any]:
        """Rank zero: statistics -> risk -> solve -> hysteresis. Primitives only (broadcast)."""
        assert self.sampler is not None and self.optimizer is not None
        stats = {b: {k: float(v) for k, v in s.items()} for b, s in self.sampler.statistics().items()}
        raw = self.risk_fn(self.optimizer, self.blocks, stats, formats=list(self._allowed), horizon=self.config.horizon)
        risk: dict[str, dict[str, float]] = {}
        for b in self.blocks:
            if b not in raw:
                raise ValueError(f"the risk model returned no row for block {b!r}")
            row = {}
            for f in self._allowed:
                value = raw[b].get(f)
                if value is None or not math.isfinite(float(value)) or float(value) < 0:
                    raise ValueError(
                        f"the risk model gave block {b!r} format {f!r} the risk {value!r}; expected a "
                        f"finite number >= 0"
                    )
                row[f] = float(value)
            risk[b] = row
        options = self._capped(risk)
        if options is risk:
            alloc = self._solve(risk)
        else:
            try:
                alloc = self._solve(options)
            except BudgetInfeasibleError as err:
                # Memory is the hard limit (an allocation over it may not fit at all); the cap is a
                # quality preference: lift it rather than fail a training run after warm-up.
                need = "" if err.min_memory is None else f" (under the cap it needs {format_bytes(err.min_memory)})"
                warnings.warn(
                    f"BAOC(max_block_risk={self.config.max_block_risk!r}): the budgets cannot be met with the "
                    f"formats under the risk cap{need}; the cap is lifted for this allocation. Raise "
                    f"memory_budget or max_block_risk to keep it.",
                    UserWarning,
                    stacklevel=2,
                )
                options = risk
                alloc = self._solve(risk)
        formats = dict(alloc.formats)
        kept = False
        if self.phase == "allocated" and self.allocation:
            current = self.allocation
            if all(current.get(b) in options[b] for b in self.blocks):
                current_risk = sum(risk[b][current[b]] for b in self.blocks)
                mb, _, mb_bytes, tb_abs = self._budgets()
                fits = sum(self._memory[b][current[b]] for b in self.blocks) <= mb_bytes
                if fits and tb_abs is not None:
                    fits = sum(self._time_table()[b][current[b]] for b in self.blocks) <= tb_abs
                better = current_risk - alloc.risk > self.config.hysteresis * current_risk
                if fits and not better:
                    formats, kept = dict(current), True
        time = None
        if self.config.time_budget is not None:
            time = float(sum(self._time_table()[b][formats[b]] for b in self.blocks))
        _, _, mb_bytes, tb_abs = self._budgets()
        return {
            "formats": formats,
            "kept": kept,
            "risk": risk,
            "solver_risk": float(alloc.risk),
            "statistics": stats,
            "memory_budget_bytes": int(mb_bytes),
            "time_budget": tb_abs,
            "time": time,
            "reason": reason,
        }

    def _capped(self, risk: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """The solver's options under ``max_block_risk``: formats over the cap dropped per block.

        A block keeps its least risky format(s) even when all are over the cap (only possible
        when neither ``fp32`` nor ``offload``, both of risk 0, is allowed). Returns ``risk``
        itself when there is no cap or it removes nothing.
        """
        cap = self.config.max_block_risk
        if cap is None:
            return risk
        out: dict[str, dict[str, float]] = {}
        changed = False
        for b, row in risk.items():
            kept = {f: r for f, r in row.items() if r <= cap}
            if not kept:
                least = min(row.values())
                kept = {f: r for f, r in row.items() if r == least}
            changed = changed or len(kept) != len(row)
            out[b] = kept
        return out if changed else risk

    def allocate(
        self, step: int, reason: str = "manual", broadcast: Broadcast | None = None, is_global_zero: bool = True
    ) -> AllocationEvent:
        """Statistics -> risk -> solve -> convert the changed blocks in place; on every rank.

        Decided on rank zero and broadcast. Raises :class:`BudgetInfeasibleError` (naming the
        smallest feasible budget) before any conversion when the budgets cannot be met.
        """
        self._require_installed("allocate")
        assert self.optimizer is not None and self.sampler is not None
        plan = decide_on_rank_zero(lambda: self._plan(reason), broadcast, is_global_zero)
        opt = self.optimizer
        before = int(opt.state_bytes())
        current = self._current_formats()
        changed = {b: (current[b], f) for b, f in plan["formats"].items() if current.get(b) != f}
        migrated: dict[str, tuple[str, str]] = {}
        if changed:
            migrated = opt.set_formats({b: new for b, (_, new) in changed.items()}, blocks=self.blocks)
        after = int(opt.state_bytes())
        self.allocation = dict(plan["formats"])
        self.phase = "allocated"
        self.pending = None
        self.wait = 0
        self.sampler.reset()  # the next re-evaluation sees fresh statistics only
        self.ring_samples = 0
        formats = self.allocation
        risk = plan["risk"]
        event = AllocationEvent(
            step=int(step),
            reason=reason,
            formats=dict(formats),
            changed=changed,
            migrated={k: (v[0], v[1]) for k, v in migrated.items()},
            kept=bool(plan["kept"]),
            risk=risk,
            total_risk=float(sum(risk[b][formats[b]] for b in self.blocks)),
            solver_risk=float(plan["solver_risk"]),
            statistics=plan["statistics"],
            block_params={b: list(n) for b, n in self.blocks.items()},
            block_numel=dict(self._numel),
            block_bytes=self._block_bytes(),
            state_bytes_before=before,
            state_bytes=after,
            fp32_state_bytes=self.fp32_state_bytes,
            memory_budget_bytes=int(plan["memory_budget_bytes"]),
            time_budget=plan["time_budget"],
            time=plan["time"],
        )
        self.last_event = event
        self.history.append(
            {
                "step": event.step,
                "reason": reason,
                "kept": event.kept,
                "changed": len(changed),
                "state_bytes": after,
                "total_risk": event.total_risk,
                "memory_budget_bytes": event.memory_budget_bytes,
            }
        )
        return event

    def _current_formats(self) -> dict[str, str]:
        """Block -> the format its parameters are asked to use (their common request)."""
        assert self.optimizer is not None
        named = self.optimizer.named_params
        out = {}
        for b, names in self.blocks.items():
            requested = {self.optimizer.requested_format(named[n]) for n in names}
            out[b] = requested.pop() if len(requested) == 1 else "mixed"
        return out

    def _block_bytes(self) -> dict[str, int]:
        """Block -> state bytes of its parameters in their effective formats."""
        assert self.optimizer is not None
        held = self.optimizer.formats()
        out = {}
        for b, names in self.blocks.items():
            total = 0
            for n, shape in zip(names, self._shapes[b]):
                total += format_state_bytes(held[n], shape, self.optimizer.min_8bit_numel)
            out[b] = int(total)
        return out

    # ------------------------------------------------------------------ triggers

    def epoch_end(self, epoch: int) -> bool:
        """Schedule a re-evaluation at the end of every ``reevaluate_every_n_epochs``-th epoch.

        Args:
            epoch: the 0-based index of the epoch that ended.

        Returns:
            whether a re-evaluation is now pending because of it.
        """
        n = self.config.reevaluate_every_n_epochs
        if self.phase != "allocated" or n is None or (epoch + 1) % n:
            return False
        self.pending = self.pending or "epoch"
        return True

    def validation_end(self, value: float | None) -> bool:
        """Track ``monitor``; schedule a re-evaluation after ``patience`` checks without improvement.

        Call it on every rank with the same value (broadcast rank zero's). Values before the first
        allocation are ignored; the count restarts after each allocation.

        Returns:
            whether a re-evaluation is now pending because of a plateau.
        """
        if self.phase != "allocated" or value is None or not math.isfinite(value):
            return False
        cfg = self.config
        improved = (
            self.best is None
            or (cfg.mode == "min" and value < self.best - cfg.min_delta)
            or (cfg.mode == "max" and value > self.best + cfg.min_delta)
        )
        if improved:
            self.best = float(value)
            self.wait = 0
            return False
        self.wait += 1
        if self.wait >= cfg.patience:
            self.wait = 0
            self.pending = self.pending or "plateau"
            return True
        return False

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Phase, allocation, counters and the sampler's ring, as primitives and tensors.

        The optimizer's own (compact) state is saved by the framework with the optimizer.
        """
        return {
            "version": STATE_VERSION,
            "phase": self.phase,
            "allocation": dict(self.allocation),
            "blocks": {b: list(n) for b, n in self.blocks.items()},
            "pending": self.pending,
            "best": self.best,
            "wait": self.wait,
            "ring_samples": self.ring_samples,
            "steps": self.steps,
            "memory_budget": self.config.memory_budget,
            "time_budget": self.config.time_budget,
            "history": [dict(h) for h in self.history],
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; before :meth:`install` (it is applied there) or after it.

        Installing with a saved allocation asks the optimizer for the saved formats, so a fresh
        optimizer is rebuilt heterogeneous; the optimizer's own ``load_state_dict`` then restores
        the compact states. A budget given now that differs from the saved one schedules a
        re-evaluation.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != STATE_VERSION:
            got = state_dict.get("version") if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(
                f"not a BAOC controller state of version {STATE_VERSION} (got version {got!r}); pass what "
                f"BAOCController.state_dict() returned"
            )
        if state_dict["phase"] not in ("warmup", "allocated"):
            raise ValueError(f"invalid BAOC phase {state_dict['phase']!r} in the state dict")
        self._loaded = dict(state_dict)
        if self.installed:
            self._apply_loaded()

    def _apply_loaded(self) -> None:
        sd, self._loaded = self._loaded, None
        assert sd is not None and self.optimizer is not None and self.sampler is not None
        saved_blocks = {b: list(n) for b, n in sd["blocks"].items()}
        if saved_blocks and saved_blocks != self.blocks:
            raise ValueError(
                f"the checkpoint's BAOC blocks ({list(saved_blocks)[:5]}...) differ from this model's "
                f"({list(self.blocks)[:5]}...); resume with the same model, granularity and blocks patterns"
            )
        self.phase = sd["phase"]
        self.allocation = dict(sd["allocation"])
        self.pending = sd["pending"]
        self.best = sd["best"]
        self.wait = int(sd["wait"])
        self.ring_samples = int(sd["ring_samples"])
        self.steps = int(sd["steps"])
        self.history = [dict(h) for h in sd["history"]]
        if sd["sampler"] is not None:
            self.sampler.load_state_dict(sd["sampler"])
        if self.allocation:
            self.optimizer.set_formats(self.allocation, blocks=self.blocks)
        if self.phase == "allocated" and (sd["memory_budget"], sd["time_budget"]) != (
            self.config.memory_budget,
            self.config.time_budget,
        ):
            self.pending = "budget"

    # ------------------------------------------------------------------ misc

    def close(self) -> None:
        """Stop the sampler's worker thread (statistics stay available)."""
        if self.sampler is not None:
            self.sampler.close()

    def summary(self) -> str:
        """One line: phase, state bytes and budget."""
        if not self.installed:
            return f"BAOC: not installed (phase {self.phase})"
        assert self.optimizer is not None
        return (
            f"BAOC: phase {self.phase}, {len(self.blocks)} blocks, optimizer state "
            f"{format_bytes(self.optimizer.state_bytes())} of {format_bytes(self.fp32_state_bytes)} fp32 "
            f"(budget {format_bytes(self.memory_budget_bytes())})"
        )

    def _require_installed(self, what: str) -> None:
        if not self.installed:
            raise RuntimeError(f"BAOCController.{what}() needs install(optimizer, model) first")


__all__ = [
    "AllocationEvent",
    "BAOCConfig",
    "BAOCController",
    "MIN_SAMPLES",
    "SUPPORTED_OPTIMIZERS",
    "convert_optimizer",
    "decide_on_rank_zero",
    "rebind_scheduler",
]
