"""The BAOC lifecycle, free of any training framework: sample -> risk -> solve -> set_formats.

:class:`BAOCController` holds everything the Lightning callback (:mod:`lightning_baoc.callback`)
and the Fabric strategy (:mod:`lightning_baoc.fabric`) share; the adapters only translate their
framework's hooks into six calls:

1. :meth:`~BAOCController.install` once, before training: the user's ``torch.optim.AdamW`` /
   ``Adam`` is replaced by a :class:`~lightning_baoc.BlockwiseAdamW` over the same param groups
   (``fp32``: identical behaviour; ``bf16`` on bf16/fp16 parameters, which torch's AdamW holds
   in 4 bytes too), the model is partitioned into blocks (parameters matched by identity, not by
   the optimizer's names) and a :class:`~lightning_baoc.GradientSampler` is attached. LR
   schedulers are rebound with :func:`rebind_scheduler`. The budgets are checked against the
   memory (and time) tables right away, so an infeasible budget fails before any training is
   spent on it.
2. :meth:`~BAOCController.before_step` once per optimizer step, before the step: parameters that
   joined the optimizer since install (``add_param_group``, ``BackboneFinetuning``) are taken
   into the blocks and, after the first allocation, allocated at once within the budget; a
   re-allocation due to settings changed at resume runs here too, before any step.
3. :meth:`~BAOCController.observe` once per optimizer step, where gradients are final
   (accumulated, all-reduced, unscaled): it feeds the sampler, every ``sample_every`` steps
   during warm-up and ``sparse_sampling`` times sparser afterwards.
4. :meth:`~BAOCController.maybe_allocate` after an optimizer step has completed (between
   batches, never inside the step in flight): at warm-up end, and later when a re-evaluation is
   pending, it computes the statistics, the risk table (:func:`lightning_baoc.risk.risk_table`),
   solves the allocation (:func:`lightning_baoc.solve`) and converts the formats of the blocks
   whose format changed, in place (state inheritance).
5. :meth:`~BAOCController.epoch_end` and :meth:`~BAOCController.validation_end` schedule
   re-evaluations: every ``reevaluate_every_n_epochs`` epochs and when ``monitor`` has not
   improved for ``patience`` validation checks. :meth:`~BAOCController.set_budget` changes a budget
   mid-training and schedules one too.
6. :meth:`~BAOCController.state_dict` / :meth:`~BAOCController.load_state_dict`: phase,
   allocation, counters, the settings that shaped the allocation and the sampler's ring buffer,
   as primitives and tensors (loads under ``torch.load(weights_only=True)``).

Budgets: a fractional memory budget is a fraction of the state the user's own
``torch.optim.AdamW`` would hold (:attr:`~BAOCController.baseline_state_bytes`: two moments in
each parameter's dtype), over every parameter trained, those added later included. The formats
offered to the solver follow one rule, :func:`lightning_baoc.calibration.withheld_formats`: the
hardware mask, and ``offload`` only with a time budget.

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
import logging
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
from torch import nn

from .blocks import partition
from .budget import (
    format_bytes,
    parse_memory_budget,
    parse_time_budget,
    round_up,
)
from .calibration import PRIOR_STEP_COST, calibrate, memory_table, time_table, withheld_formats
from .formats import DEFAULT_MIN_8BIT_NUMEL, FORMATS, format_state_bytes
from .optim import BlockwiseAdamW, optimizer_alias
from .planner import block_kind, prior_risk
from .sampler import GradientSampler
from .settings import BAOCConfig
from .solver import Allocation, BudgetInfeasibleError, solve

log = logging.getLogger(__name__)

#: Format version of :meth:`BAOCController.state_dict`.
STATE_VERSION = 1

#: Ring samples the statistics need before an allocation: a signal-to-noise ratio and a cosine
#: between consecutive samples are undefined with fewer than two.
MIN_SAMPLES = 2

#: Optimizers BAOC can take over (named in the error for any other).
SUPPORTED_OPTIMIZERS = ("torch.optim.AdamW", "torch.optim.Adam (amsgrad=False)", "lightning_baoc.BlockwiseAdamW")

#: Re-allocations that run before the next optimizer step, without waiting for fresh statistics:
#: parameters joined the optimizer (they would train unmanaged), and settings that shape the
#: allocation changed at resume (a format may have left the menu).
URGENT_REASONS = ("params", "settings")

#: The settings that shape the allocation, saved with the controller state and compared at resume.
ALLOCATION_SETTINGS = (
    "memory_budget",
    "time_budget",
    "formats",
    "granularity",
    "blocks",
    "min_8bit_numel",
    "max_block_risk",
)

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


def _training_device(optimizer: BlockwiseAdamW) -> torch.device:
    """The device the optimizer's parameters train on: it decides the formats withheld and what
    ``offload`` costs there."""
    return next(iter(optimizer.named_params.values())).device


def _stepped(optimizer: BlockwiseAdamW, param: torch.Tensor) -> bool:
    """Whether ``param`` holds optimizer state (it has stepped, or state was loaded for it)."""
    try:
        return optimizer.step_count(param) > 0
    except KeyError:  # in a param group but never registered (param_groups assigned directly)
        return False


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


@dataclass
class AllocationEvent:
    """What one allocation decided and did (handed to the reports; primitives only).

    Attributes:
        step: optimizer steps completed when it ran.
        reason: ``"warmup"``, ``"epoch"``, ``"plateau"``, ``"budget"`` (a budget changed
            mid-training), ``"settings"`` (settings that shape the allocation changed at resume) or
            ``"params"`` (parameters joined the optimizer after install).
        formats: block -> format now in force.
        changed: block -> (old format, new format) of the blocks converted.
        migrated: parameter name -> (old, new) held formats, as ``set_formats`` reported them.
        kept: whether hysteresis kept the current allocation.
        risk: block -> format -> risk (the fresh risk table).
        total_risk: total risk of ``formats`` under ``risk``.
        solver_risk: total risk of the solver's answer (before hysteresis).
        statistics: block -> sampler statistics.
        block_params: block -> parameter names (the model's); ``block_numel``: block -> elements.
        block_bytes: block -> state bytes in its format; ``state_bytes_before`` / ``state_bytes``:
            the optimizer's state bytes before and after; ``fp32_state_bytes``: 8 x the elements.
        memory_budget_bytes: the memory budget in bytes; ``time_budget``: seconds (or ``None``).
        time: step time of ``formats`` in the time table's unit, or ``None``.
        baseline_state_bytes: the state the user's own ``torch.optim.AdamW`` would hold (two
            moments in each parameter's dtype; ``None``: the fp32 state), what
            :attr:`saved_fraction` and a fractional budget refer to.
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
    baseline_state_bytes: int | None = None

    @property
    def baseline(self) -> int:
        """The user's own AdamW state bytes (:attr:`baseline_state_bytes`, else the fp32 state)."""
        return int(self.baseline_state_bytes if self.baseline_state_bytes is not None else self.fp32_state_bytes)

    @property
    def saved_fraction(self) -> float:
        """Fraction of the user's own AdamW state memory saved: ``1 - state_bytes / baseline``."""
        return 1.0 - self.state_bytes / self.baseline if self.baseline else 0.0


# ---------------------------------------------------------------------------- optimizer swap

def _named_like(name: str) -> type[BlockwiseAdamW]:
    """A BlockwiseAdamW subclass whose ``__name__`` is the user's optimizer class name.

    ``LearningRateMonitor`` names its metrics ``"lr-" + type(optimizer).__name__`` (``lr-AdamW/pg1``);
    keeping the name keeps the user's dashboards and monitors working after the swap. The registry
    lives in :mod:`lightning_baoc.optim` (:func:`~lightning_baoc.optim.optimizer_alias`), which
    resolves the class by name in any process, so pickles load in a fresh one.
    """
    return optimizer_alias(name)


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
        ...     _ = ctl.before_step(step); _ = ctl.observe(step); opt.step()
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
        self.blocks: dict[str, list[str]] = {}  # block -> the optimizer's names of its parameters
        self.phase: Phase = "warmup"
        self.allocation: dict[str, str] = {}
        self.history: list[dict[str, Any]] = []
        self.last_event: AllocationEvent | None = None
        self.pending: str | None = None
        self.best: float | None = None
        self.wait = 0
        self.ring_samples = 0  # ring samples since the last allocation (fresh statistics)
        self.steps = 0  # optimizer steps seen (adapters without a global step counter use it)
        self._module: nn.Module | None = None
        self._model_names: dict[str, str] = {}  # the optimizer's name of a parameter -> the model's
        self._managed: set[int] = set()  # ids of the parameters in the blocks
        self._held_frozen: list[torch.Tensor] = []  # held by the optimizer, frozen, in no block
        self._group_sizes: tuple[int, ...] = ()
        self._shapes: dict[str, list[tuple[int, ...]]] = {}
        self._numel: dict[str, int] = {}
        self._baseline = 0
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

    @property
    def baseline_state_bytes(self) -> int:
        """The state the user's own ``torch.optim.AdamW`` would hold on the blocks' parameters.

        torch's AdamW keeps its two moments in each parameter's dtype: 8 bytes per fp32 element
        (:attr:`fp32_state_bytes`), 4 per bf16 or fp16 element. A fractional memory budget and
        the fraction saved refer to it.
        """
        return self._baseline

    def memory_budget_bytes(self) -> int:
        """The memory budget in bytes (a fraction resolved against :attr:`baseline_state_bytes`)."""
        return parse_memory_budget(self.config.memory_budget, self.baseline_state_bytes)

    # ------------------------------------------------------------------ install

    def install(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> BlockwiseAdamW:
        """Take over ``optimizer`` (identical behaviour) and attach blocks and sampler.

        Idempotent for the optimizer it returned. Rebinding LR schedulers and swapping the
        optimizer in the framework is the adapter's job (:func:`rebind_scheduler`). Parameters
        are matched to the model's blocks by identity, whatever names the optimizer gives them
        (``BlockwiseAdamW(model.parameters())`` names them ``"0"``, ``"1"``...). During warm-up,
        bf16/fp16 parameters hold ``bf16`` state (4 bytes per element, as torch's AdamW holds on
        them), never more than the user's own optimizer would.

        Args:
            optimizer: a ``torch.optim.AdamW``/``Adam`` or a ``BlockwiseAdamW``.
            module: the model whose parameters the optimizer holds.

        Raises:
            TypeError: an unsupported optimizer (the message names the supported ones).
            ValueError: the optimizer holds parameters ``module`` does not have, or no trainable one.
        """
        if self.optimizer is not None and optimizer is self.optimizer:
            return self.optimizer
        cfg = self.config
        new = convert_optimizer(optimizer, module, cfg.min_8bit_numel, cfg.seed)
        self._module = module
        self._managed = set()
        self._build_blocks(new, module)
        self._device = _training_device(new)
        self._refresh_tables(new)
        self._restart_sampler(module)
        self.optimizer = new
        if self._loaded is not None:
            self._apply_loaded()
        elif self.phase == "allocated" and self.allocation:
            # A second fit with the same controller: the fresh optimizer starts in the allocation.
            new.set_formats(self.allocation, blocks=self.blocks)
        if self.phase == "warmup":
            self._warmup_formats()
        return new

    def _build_blocks(self, opt: BlockwiseAdamW, module: nn.Module) -> None:
        """Partition the model and keep the parameters ``opt`` holds, by identity, in its names.

        A held parameter is in a block if it is trainable or holds state: one already in a block,
        or frozen with state loaded from a checkpoint, still takes memory the budget must count.
        """
        cfg = self.config
        model_named = dict(module.named_parameters())
        model_name = {id(p): n for n, p in model_named.items()}
        held = opt.named_params
        foreign = [n for n, p in held.items() if id(p) not in model_name]
        if foreign:
            raise ValueError(
                f"the optimizer holds {len(foreign)} parameter(s) that are not parameters of the model "
                f"(e.g. {foreign[:3]}); BAOC partitions the model's parameters into blocks: give the "
                f"optimizer the model's parameters only"
            )
        opt_name = {id(p): n for n, p in held.items()}
        unnamed = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in opt_name)
        if unnamed:
            raise ValueError(
                f"{unnamed} parameter(s) were put into optimizer.param_groups without add_param_group() "
                f"(param_groups assigned or appended to directly), so the optimizer holds no record of "
                f"them and cannot step them; add them with add_param_group() on the optimizer BAOC "
                f"installed ({type(opt).__name__} at {hex(id(opt))})"
            )
        keep = {model_name[id(p)] for p in held.values() if id(p) in self._managed or _stepped(opt, p)}
        trainable = [n for n, p in model_named.items() if id(p) in opt_name and (p.requires_grad or n in keep)]
        if not trainable:
            raise ValueError(
                f"the optimizer holds no trainable parameter of the model ({len(held)} held, all frozen "
                f"(requires_grad=False)): nothing to allocate; give the optimizer trainable parameters"
            )
        raw = partition(module, cfg.granularity, cfg.blocks, keep=keep)
        chosen = set(trainable)
        blocks = {b: [opt_name[id(model_named[n])] for n in names if n in chosen] for b, names in raw.items()}
        self.blocks = {b: names for b, names in blocks.items() if names}
        self._model_names = {opt_name[id(model_named[n])]: n for n in trainable}
        self._managed = {id(held[n]) for names in self.blocks.values() for n in names}
        self._held_frozen = [p for p in held.values() if id(p) not in self._managed]
        self._group_sizes = tuple(len(g["params"]) for g in opt.param_groups)

    def _refresh_tables(self, opt: BlockwiseAdamW) -> None:
        """Shapes, sizes, the user's baseline, the formats offered and the memory table of the blocks."""
        cfg = self.config
        named = opt.named_params
        self._shapes = {b: [tuple(named[n].shape) for n in names] for b, names in self.blocks.items()}
        self._numel = {b: sum(named[n].numel() for n in names) for b, names in self.blocks.items()}
        # torch's AdamW holds exp_avg and exp_avg_sq in the parameter's dtype
        self._baseline = sum(
            2 * named[n].numel() * named[n].element_size() for names in self.blocks.values() for n in names
        )
        wanted = list(cfg.formats) if cfg.formats is not None else list(FORMATS)
        self._mask = withheld_formats(self._device, cfg.time_budget is not None, wanted)
        self._allowed = [f for f in wanted if f not in self._mask]
        if not self._allowed:
            raise ValueError(
                f"formats={wanted} are all withheld on {self._device} ({self._mask}); allow other formats"
            )
        self._memory = memory_table(self._shapes, self._device, sorted(set(self._allowed) | {"fp32"}), opt.min_8bit_numel)
        self._time = None

    def _restart_sampler(self, module: nn.Module) -> None:
        """A new sampler over the blocks' trainable parameters (the model's names); empty ring."""
        cfg = self.config
        model_named = dict(module.named_parameters())
        sampled = {}
        for b, names in self.blocks.items():
            trainable = [self._model_names[n] for n in names if model_named[self._model_names[n]].requires_grad]
            if trainable:
                sampled[b] = trainable
        if self.sampler is not None:
            self.sampler.close()
        self.sampler = GradientSampler(module, sampled, cfg.sample_every, cfg.capacity, cfg.max_elements, seed=cfg.seed)
        self.ring_samples = 0

    def _warmup_formats(self) -> None:
        """Warm-up state no larger than the user's AdamW: ``bf16`` for 2-byte parameters.

        torch's AdamW holds bf16/fp16 moments on such parameters (4 bytes per element); ``fp32``
        state (8) would double the user's optimizer memory. Only plain ``fp32`` requests change.
        """
        assert self.optimizer is not None
        named = self.optimizer.named_params
        small = [
            n
            for names in self.blocks.values()
            for n in names
            if named[n].element_size() < 4 and self.optimizer.requested_format(named[n]) == "fp32"
        ]
        if not small:
            return
        masked = withheld_formats(self._device, True, ["bf16"])
        if masked:  # emulated bf16 would be slow: fp32, said aloud
            warnings.warn(
                f"BAOC: {len(small)} low-precision parameter tensor(s) warm up with fp32 state (8 bytes per "
                f"element, twice torch AdamW's): bf16 state is withheld on {self._device} ({masked['bf16']})",
                UserWarning,
                stacklevel=3,
            )
            return
        self.optimizer.set_formats({n: "bf16" for n in small})

    # ------------------------------------------------------------------ parameters added later

    def _new_parameters(self) -> bool:
        """Whether the optimizer now trains or holds state for parameters outside the blocks
        (``add_param_group``; a held parameter unfrozen, or given state by a checkpoint loaded after
        install). Cheap when nothing changed: group sizes and the held frozen ones."""
        opt = self.optimizer
        assert opt is not None
        sizes = tuple(len(g["params"]) for g in opt.param_groups)
        if sizes == self._group_sizes and not any(p.requires_grad or _stepped(opt, p) for p in self._held_frozen):
            return False
        self._group_sizes = sizes
        # a group of frozen parameters added now is watched from now on, in case it is unfrozen
        self._held_frozen = [p for g in opt.param_groups for p in g["params"] if id(p) not in self._managed]
        return any(p.requires_grad or _stepped(opt, p) for p in self._held_frozen)

    def _grow(self, broadcast: Broadcast | None, is_global_zero: bool) -> None:
        """Take parameters added after install into the blocks, tables and sampler.

        After the first allocation a re-allocation of every block is made due at once (reason
        ``"params"``), within the budget resolved against all parameters now trained; the new
        parameters have no state yet and get the planner's prior risk until they do. During
        warm-up the budget is checked again (an absolute one may no longer fit). The sampler is
        rebuilt over the new blocks: statistics start afresh (a warm-up ends two samples later).
        """
        assert self.optimizer is not None and self._module is not None
        before = len(self._managed)
        self._build_blocks(self.optimizer, self._module)
        self._refresh_tables(self.optimizer)
        self._restart_sampler(self._module)
        log.info(
            f"BAOC: {len(self._managed) - before} parameter tensor(s) joined the optimizer after install; "
            f"{len(self.blocks)} blocks now, AdamW state {format_bytes(self.baseline_state_bytes)}"
        )
        if self.phase == "allocated":
            self.pending = "params"
        else:
            self._warmup_formats()
            self.check_feasible(broadcast, is_global_zero)

    def before_step(self, step: int, broadcast: Broadcast | None = None, is_global_zero: bool = True) -> AllocationEvent | None:
        """Call once per optimizer step, before :meth:`observe` and the step; on every rank.

        Takes parameters added since install into the allocation (``add_param_group``, e.g.
        ``BackboneFinetuning``), and runs a re-allocation that cannot wait for fresh statistics
        (new parameters, settings changed at resume): it must act before the step, so no step
        runs with unmanaged parameters or a format the settings no longer allow.

        Returns:
            the allocation it ran, if any.

        Raises:
            BudgetInfeasibleError: the budget cannot be met any more (it names the smallest one).
        """
        self._require_installed("before_step")
        if self._new_parameters():
            self._grow(broadcast, is_global_zero)
        if self.phase == "allocated" and self.pending in URGENT_REASONS:
            return self.allocate(step, self.pending, broadcast, is_global_zero)
        return None

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
        if "fp32" in self._allowed and self.baseline_state_bytes == self.fp32_state_bytes:
            # the solver resolves fractions against the fp32 column: the same reference here,
            # and its messages then name fractions
            return cfg.memory_budget, cfg.time_budget, mb_bytes, tb_abs
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
            masked = "".join(f"; {f} withheld: {why}" for f, why in self._mask.items())
            baseline = ""
            if err.min_memory is not None and self.baseline_state_bytes != self.fp32_state_bytes:
                baseline = (
                    f"; as a fraction of the AdamW state on these parameters "
                    f"({format_bytes(self.baseline_state_bytes)}): memory_budget >= "
                    f"{round_up(err.min_memory / self.baseline_state_bytes)}"
                )
            raise BudgetInfeasibleError(
                f"BAOC(memory_budget={self.config.memory_budget!r}, time_budget={self.config.time_budget!r}): "
                f"{err}{baseline} (formats allowed: {allowed}{masked}). No format was converted; the "
                f"optimizer keeps its current formats.",
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
        if not self.installed:
            return None
        if self.phase == "allocated" and self.pending in URGENT_REASONS:
            return self.pending  # no fresh statistics needed (see URGENT_REASONS)
        if self.ring_samples < MIN_SAMPLES:
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
        if self.installed and self._new_parameters():  # adapters that skip before_step
            self._grow(broadcast, is_global_zero)
        reason = self.due(step)
        if reason is None:
            return None
        return self.allocate(step, reason, broadcast, is_global_zero)

    # ------------------------------------------------------------------ allocation

    def _plan(self, reason: str) -> dict[str, Any]:
        """Rank zero: statistics -> risk -> solve -> hysteresis. Primitives only (broadcast)."""
        assert self.sampler is not None and self.optimizer is not None
        stats = {b: {k: float(v) for k, v in s.items()} for b, s in self.sampler.statistics().items()}
        raw = dict(self.risk_fn(self.optimizer, self.blocks, stats, formats=list(self._allowed), horizon=self.config.horizon))
        raw.update(self._prior_rows())
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

    def _prior_rows(self) -> dict[str, dict[str, float]]:
        """The planner's prior risk for the blocks with a parameter that never stepped.

        Without state the risk model sees nothing to lose and would score every format 0 there
        (parameters added after install, or that got no gradient yet): the prior
        (:func:`lightning_baoc.planner.prior_risk`, shares over all the blocks) stands in until
        their state exists.
        """
        assert self.optimizer is not None
        opt = self.optimizer
        fresh = [b for b, names in self.blocks.items() if any(opt.step_count(n) == 0 for n in names)]
        if not fresh:
            return {}
        module = self._module if self._module is not None else nn.Module()
        kinds = {b: block_kind(module, b) for b in fresh}
        table = prior_risk(self._shapes, kinds, list(self._allowed), opt.min_8bit_numel)
        return {b: table[b] for b in fresh}

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
            block_params={b: [self._model_names.get(n, n) for n in names] for b, names in self.blocks.items()},
            block_numel=dict(self._numel),
            block_bytes=self._block_bytes(),
            state_bytes_before=before,
            state_bytes=after,
            fp32_state_bytes=self.fp32_state_bytes,
            memory_budget_bytes=int(plan["memory_budget_bytes"]),
            time_budget=plan["time_budget"],
            time=plan["time"],
            baseline_state_bytes=self.baseline_state_bytes,
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
        """Phase, allocation, counters, the settings that shaped the allocation and the sampler's
        ring, as primitives and tensors.

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
            "settings": self._settings(),
            "history": [dict(h) for h in self.history],
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
        }

    def _settings(self) -> dict[str, Any]:
        """:data:`ALLOCATION_SETTINGS` as primitives (the menu as a sorted list: order is not a change)."""
        out = {k: _plain(getattr(self.config, k)) for k in ALLOCATION_SETTINGS}
        if out["formats"] is not None:
            out["formats"] = sorted(out["formats"])
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; before :meth:`install` (it is applied there) or after it.

        Installing with a saved allocation asks the optimizer for the saved formats, so a fresh
        optimizer is rebuilt heterogeneous; the optimizer's own ``load_state_dict`` then restores
        the compact states. If a setting that shapes the allocation (:data:`ALLOCATION_SETTINGS`:
        budgets, format menu, partition, ``min_8bit_numel``, ``max_block_risk``) differs from the
        saved one, a re-allocation runs before the next optimizer step (reason ``"settings"``,
        see :meth:`before_step`), from the states as they are: no step runs in a format the menu
        no longer holds. A changed partition maps the saved formats onto the new blocks parameter
        by parameter; where that is impossible it raises.

        Raises:
            ValueError: not a controller state; or a changed partition or model that leaves
                parameters of this run without a saved format (the message names the setting
                and the fix).
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
        current = self._settings()
        # states written before the settings were saved carry the budgets only
        saved = sd.get("settings") or {**current, "memory_budget": sd["memory_budget"], "time_budget": sd["time_budget"]}
        changed = [k for k in ALLOCATION_SETTINGS if k in saved and saved[k] != current[k]]
        same_blocks = not saved_blocks or saved_blocks == self.blocks
        per_param = {}
        if not same_blocks and sd["phase"] == "allocated":
            per_param = self._map_allocation(saved_blocks, dict(sd["allocation"]), saved, changed)
        self.phase = sd["phase"]
        self.pending = sd["pending"]
        self.best = sd["best"]
        self.wait = int(sd["wait"])
        self.steps = int(sd["steps"])
        self.history = [dict(h) for h in sd["history"]]
        if same_blocks:
            self.allocation = dict(sd["allocation"])
            self.ring_samples = int(sd["ring_samples"])
            if sd["sampler"] is not None:
                self.sampler.load_state_dict(sd["sampler"])
            if self.allocation:
                self.optimizer.set_formats(self.allocation, blocks=self.blocks)
        else:
            # the saved ring holds samples of other blocks: statistics start afresh
            self.ring_samples = 0
            if per_param:
                self.optimizer.set_formats(per_param)
            self.allocation = {}
            for b, names in self.blocks.items():
                held = {per_param[n] for n in names if n in per_param}
                if len(held) == 1:
                    self.allocation[b] = held.pop()
            if self.phase == "warmup":
                warnings.warn(
                    f"BAOC: the blocks differ from the checkpoint's ({self._setting_change(saved, changed)}); "
                    f"the warm-up statistics gathered so far are dropped and sampling starts again.",
                    UserWarning,
                    stacklevel=3,
                )
        # a format the formats offered here lack (menu changed, or another device: offload
        # checkpointed on a GPU, resumed on a CPU) must not run a step, whatever the state says
        unoffered = {f for f in self.allocation.values() if f not in self._allowed}
        if self.phase == "allocated" and (changed or not same_blocks or unoffered):
            self.pending = "settings"
            log.info("BAOC: %s changed since the checkpoint: re-allocating before the next step", changed or "blocks")

    def _map_allocation(
        self, saved_blocks: Mapping[str, list[str]], allocation: Mapping[str, str], saved: Mapping[str, Any], changed: list[str]
    ) -> dict[str, str]:
        """The saved formats per parameter, for this run's parameters; raises if one has none."""
        per_param = {n: allocation[b] for b, names in saved_blocks.items() if b in allocation for n in names}
        ours = [n for names in self.blocks.values() for n in names]
        missing = [n for n in ours if n not in per_param]
        if missing:
            raise ValueError(
                f"BAOC cannot resume this checkpoint's allocation: {len(missing)} of this run's {len(ours)} "
                f"parameters (e.g. {missing[:3]}) have no format in it ({self._setting_change(saved, changed)}). "
                f"Resume with the checkpoint's settings and model, or start a new BAOC run from the weights "
                f"(load them without ckpt_path), which warms up again."
            )
        return {n: per_param[n] for n in ours}

    def _setting_change(self, saved: Mapping[str, Any], changed: list[str]) -> str:
        """The partition settings that changed, as ``name=checkpoint's -> now``, or the model."""
        now = self._settings()
        parts = [f"{k}={saved[k]!r} in the checkpoint, {now[k]!r} now" for k in changed if k in ("granularity", "blocks")]
        return "; ".join(parts) if parts else "the model's trainable parameters differ from the checkpoint's"

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
            f"{format_bytes(self.optimizer.state_bytes())} of {format_bytes(self.baseline_state_bytes)} AdamW "
            f"(budget {format_bytes(self.memory_budget_bytes())})"
        )

    def _require_installed(self, what: str) -> None:
        if not self.installed:
            raise RuntimeError(f"BAOCController.{what}() needs install(optimizer, model) first")


__all__ = [
    "ALLOCATION_SETTINGS",
    "AllocationEvent",
    "BAOCConfig",
    "BAOCController",
    "MIN_SAMPLES",
    "SUPPORTED_OPTIMIZERS",
    "URGENT_REASONS",
    "convert_optimizer",
    "decide_on_rank_zero",
    "rebind_scheduler",
]
