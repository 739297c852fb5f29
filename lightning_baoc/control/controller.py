"""The BAOC lifecycle, free of any training framework: sample -> risk -> solve -> set_formats.

:class:`BAOCController` holds everything the Lightning callback (:mod:`lightning_baoc.integrations.callback`)
and the Fabric strategy (:mod:`lightning_baoc.integrations.fabric`) share; the adapters only translate their
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
``torch.optim.AdamW`` would hold (:meth:`~BAOCController.baseline_state_bytes`: two moments in
each parameter's dtype), over every parameter trained, those added later included. The formats
offered to the solver follow one rule, :func:`lightning_baoc.costs.calibration.withheld_formats`: the
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

import dataclasses

import logging
import warnings
from typing import Any, Literal

import torch
from torch import nn

from lightning_baoc.config.budget import format_bytes, parse_memory_budget
from lightning_baoc.config.settings import MIN_SAMPLES, BAOCConfig
from lightning_baoc.control.blocks import Blocks
from lightning_baoc.control.checkpoint import ALLOCATION_SETTINGS, ControllerCheckpoint
from lightning_baoc.control.decision import capped, checked_risk, keeps_current
from lightning_baoc.control.events import AllocationEvent
from lightning_baoc.control.instrumentation import Instrumentation
from lightning_baoc.control.options import Options
from lightning_baoc.control.protocol import Broadcast, decide_on_rank_zero
from lightning_baoc.control.released_gradients import ReleasedGradientObserver
from lightning_baoc.control.scoring import RiskFn, Scoring
from lightning_baoc.control.start import StartAllocation
from lightning_baoc.control.summary import BAOCSummary, state_fraction
from lightning_baoc.control.tables import BlockTables
from lightning_baoc.control.triggers import Triggers
from lightning_baoc.costs import AllocationProblem
from lightning_baoc.costs.instruments import InstrumentSizes
from lightning_baoc.costs.memory import training_memory
from lightning_baoc.costs.peak import PlannedPeak
from lightning_baoc.formats import DEFAULT_MIN_8BIT_NUMEL, RULE_NAMES
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.optim.swap import SUPPORTED_OPTIMIZERS, convert_optimizer, rebind_scheduler
from lightning_baoc.risk.prior import block_kind
from lightning_baoc.risk.shadow import ShadowMoments
from lightning_baoc.sampling import GradientSampler
from lightning_baoc.solver import BudgetInfeasibleError

log = logging.getLogger(__name__)

#: Re-allocations that run before the next optimizer step, without waiting for fresh statistics:
#: parameters joined the optimizer (they would train unmanaged), and settings that shape the
#: allocation changed at resume (a format may have left the menu).
URGENT_REASONS = ("params", "settings")


Phase = Literal["warmup", "allocated"]


def _training_device(optimizer: BlockwiseOptimizer) -> torch.device:
    """The device the optimizer's parameters train on: it decides the formats withheld and what
    ``offload`` costs there."""
    return next(iter(optimizer.named_params.values())).device


# ---------------------------------------------------------------------------- the controller


class BAOCController:
    """The framework-free BAOC lifecycle (see the module docstring for the calls and their order).

    The controller runs the lifecycle and holds its state (phase, allocation, history, the reason
    of a pending re-evaluation); its parts, each a class with its own interface and tests, hold the rest:

    - ``blocks`` (:class:`~lightning_baoc.control.blocks.Blocks`): the partition, in the optimizer's names;
    - ``tables`` (:class:`~lightning_baoc.control.tables.BlockTables`): shapes, baseline, the allocation
      problem, solved under the budgets;
    - ``instrumentation`` (:class:`~lightning_baoc.control.instrumentation.Instrumentation`): the sampler,
      the shadow moments and when they sample;
    - ``release_observer`` (:class:`~lightning_baoc.control.released_gradients.ReleasedGradientObserver`):
      their feed under gradient release;
    - ``options`` (:class:`~lightning_baoc.control.options.Options`): formats x corrections, the options
      held, applied, and their risk;
    - ``scoring`` (:class:`~lightning_baoc.control.scoring.Scoring`): the risk model on the statistics,
      the prior where no state is;
    - ``start`` (:class:`~lightning_baoc.control.start.StartAllocation`): the warm-up's formats, budget changes;
    - ``triggers`` (:class:`~lightning_baoc.control.triggers.Triggers`): the epoch and plateau triggers;
    - ``checkpoint`` (:class:`~lightning_baoc.control.checkpoint.ControllerCheckpoint`): the state dict's
      codec, and a state loaded before install.

    Args:
        config: the settings (a :class:`BAOCConfig`, or its fields as keyword arguments).
        risk_fn: the risk model, ``risk_fn(optimizer, blocks, statistics, formats=, horizon=)``
            (default: :func:`lightning_baoc.risk.optimizer_risk_table`: AdamW's risk model, or SGD's and Lion's).

    Attributes:
        optimizer: the blockwise optimizer installed (``None`` before :meth:`install`).
        phase: ``"warmup"`` until the first allocation, ``"allocated"`` after it.
        allocation: block -> the option in force (empty during warm-up).
        pending: the reason of the re-evaluation due at the next step boundary (``"epoch"``,
            ``"plateau"``, ``"budget"``, ``"params"``, ``"settings"``), or ``None``.
        history: one summary per allocation; ``last_event``: the last :class:`AllocationEvent`.
        steps: optimizer steps seen (adapters without a global step counter use it).

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
        self.optimizer: BlockwiseOptimizer | None = None
        self.phase: Phase = "warmup"
        self.allocation: dict[str, str] = {}
        self.history: list[dict[str, Any]] = []
        self.last_event: AllocationEvent | None = None
        self.pending: str | None = None
        self.steps = 0
        self._module: nn.Module | None = None
        self._peak = 0  # peak state bytes of earlier optimizers of this run (see peak_state_bytes)
        self.blocks = Blocks(config)
        self.tables = BlockTables(config, self.blocks)
        self.instrumentation = Instrumentation(config, self.blocks, self.tables)
        self.release_observer = ReleasedGradientObserver(self.instrumentation)
        self.options = Options(config, self.blocks, self.tables, self.instrumentation)
        self.scoring = Scoring(config, self.blocks, self.tables, self.instrumentation, self.options, risk_fn)
        self.start = StartAllocation(config, self.blocks, self.tables, self.options)
        self.triggers = Triggers(config)
        self.checkpoint = ControllerCheckpoint(config)

    # ------------------------------------------------------------------ properties

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` has run."""
        return self.optimizer is not None

    @property
    def risk_fn(self) -> RiskFn:
        """The risk model (:attr:`Scoring.risk_fn <lightning_baoc.control.scoring.Scoring.risk_fn>`)."""
        return self.scoring.risk_fn

    @risk_fn.setter
    def risk_fn(self, risk_fn: RiskFn) -> None:
        self.scoring.risk_fn = risk_fn

    @property
    def block_params(self) -> dict[str, list[str]]:
        """The partition, block -> the optimizer's names of its parameters (set at :meth:`install`;
        the setting ``config.blocks`` holds the glob patterns that shape it)."""
        return self.blocks.params

    @property
    def sampler(self) -> GradientSampler | None:
        """The gradient sampler over the blocks (``None`` before :meth:`install`)."""
        return self.instrumentation.sampler

    @property
    def shadow(self) -> ShadowMoments | None:
        """fp32 moments on a sample of each tensor, for the risk (``None`` before :meth:`install`)."""
        return self.instrumentation.shadow

    @property
    def instruments(self) -> InstrumentSizes | None:
        """The sampler's and the shadow's sizes within the instruments' allowance (``None`` before :meth:`install`)."""
        return self.instrumentation.sizes

    def instrument_bytes(self) -> int:
        """Bytes the sampler's buffers and the shadow moments hold now (outside the state budget)."""
        return self.instrumentation.nbytes()

    @property
    def ring_samples(self) -> int:
        """Ring samples since the last allocation (fresh statistics)."""
        return self.instrumentation.ring_samples

    @property
    def start_allocation(self) -> dict[str, str] | None:
        """Block -> the option the warm-up started in (``None`` before :meth:`install`)."""
        return self.start.formats

    def fp32_state_bytes(self) -> int:
        """The fp32 state bytes of the blocks: fp32 AdamW's 8 bytes per trainable element (SGD's and
        Lion's fp32 momentum: 4), the problem's ``fp32`` column."""
        return self.tables.fp32_bytes

    def baseline_state_bytes(self) -> int:
        """The state the user's own ``torch.optim.AdamW`` (``SGD``, Lion) would hold on the blocks'
        parameters.

        torch's AdamW keeps its two moments in each parameter's dtype: 8 bytes per fp32 element
        (:meth:`fp32_state_bytes`), 4 per bf16 or fp16 element; SGD and Lion one buffer (4, 2). A
        fractional memory budget and the fraction saved refer to it.
        """
        return self.tables.baseline

    @property
    def problem(self) -> AllocationProblem:
        """The allocation problem of the blocks: tables, offered formats, budget units (after install)."""
        if self.tables.problem is None:
            raise RuntimeError("BAOCController.problem: call install() first")
        return self.tables.problem

    def planned_peak(self) -> PlannedPeak | None:
        """The run's planned peak beyond its weights, as ``lightning-baoc check`` plans it on this model
        (:mod:`lightning_baoc.costs.peak`); ``None`` before install or where the plan cannot be made
        (its budgets infeasible, which the run itself has said)."""
        if self.tables.problem is None:
            return None
        cfg = self.config
        kinds = {b: block_kind(self._module or nn.Module(), b) for b in self.blocks.params}
        try:
            phases = self.tables.problem.phases(
                kinds, cfg.memory_budget, cfg.time_budget, initial=cfg.initial,
                sampler={"capacity": cfg.capacity, "max_elements": cfg.max_elements, "instrument_share": cfg.instrument_share},
                release=self.optimizer is not None and self.optimizer.releases_gradients)
        except (BudgetInfeasibleError, ValueError):
            return None
        if self.optimizer is None:
            return phases.peak
        return dataclasses.replace(phases.peak, staging=self.optimizer.offload_working_bytes())  # offload's staging

    def peak_state_bytes(self) -> int:
        """The most optimizer state held on the training devices at any moment of the run (resumes
        included: the figure is checkpointed), conversion transients included."""
        held = self.optimizer.peak_state_bytes() if self.optimizer is not None else 0
        self._peak = max(self._peak, int(held))
        return self._peak

    def memory_budget_bytes(self) -> int:
        """The memory budget in bytes (a fraction resolved against :meth:`baseline_state_bytes`)."""
        return parse_memory_budget(self.config.memory_budget, self.baseline_state_bytes())

    # ------------------------------------------------------------------ install

    def install(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> BlockwiseOptimizer:
        """Take over ``optimizer`` (identical behaviour) and attach blocks and sampler.

        Idempotent for the optimizer it returned. Rebinding LR schedulers and swapping the
        optimizer in the framework is the adapter's job (:func:`rebind_scheduler`). Parameters
        are matched to the model's blocks by identity, whatever names the optimizer gives them
        (``BlockwiseAdamW(model.parameters())`` names them ``"0"``, ``"1"``...). During warm-up,
        bf16/fp16 parameters hold ``bf16`` state (4 bytes per element, as torch's AdamW holds on
        them), never more than the user's own optimizer would.

        A ``torch.optim.SGD`` becomes a :class:`~lightning_baoc.BlockwiseSGD`; a BlockwiseSGD or
        BlockwiseLion is kept: their momentum formats (``fp32``, ``bf16``, ``int8``, ``none``) are
        allocated, risked by :func:`~lightning_baoc.risk.momentum.momentum_risk_table`.

        Args:
            optimizer: a ``torch.optim.AdamW``/``Adam``/``SGD`` or a blockwise optimizer.
            module: the model whose parameters the optimizer holds.

        Raises:
            TypeError: an unsupported optimizer (the message names the supported ones).
            ValueError: the optimizer holds parameters ``module`` does not have, or no trainable one.
        """
        if self.optimizer is not None and optimizer is self.optimizer:
            return self.optimizer
        cfg = self.config
        own = optimizer.min_8bit_numel if isinstance(optimizer, BlockwiseOptimizer) else None
        if own is not None and cfg.min_8bit_numel not in (own, DEFAULT_MIN_8BIT_NUMEL):
            raise ValueError(
                f"BAOC(min_8bit_numel={cfg.min_8bit_numel}) and the {type(optimizer).__name__} returned by "
                f"configure_optimizers (min_8bit_numel={own}) differ: a blockwise optimizer keeps its own threshold, "
                f"and BAOC's applies to an optimizer it converts. Set min_8bit_numel={cfg.min_8bit_numel} on the "
                f"{type(optimizer).__name__}, or drop it from BAOC."
            )
        new = convert_optimizer(optimizer, module, cfg.min_8bit_numel, cfg.seed)
        self._module = module
        self.blocks.forget()
        self.blocks.build(new, module)
        self.tables.refresh(new, _training_device(new))
        self.instrumentation.restart_sampler(module)
        self.optimizer = new
        self.release_observer.watch(new)
        self.instrumentation.restart_shadow(new)
        if self.checkpoint.loaded is not None:
            self._apply_loaded()
        elif self.phase == "allocated" and self.allocation:
            # A second fit with the same controller: the fresh optimizer starts in the allocation.
            self.options.apply(new, self.allocation, self.blocks.params)
        if self.phase == "warmup":
            self.start.warmup_formats(new)
            self.start.apply(new, module)
        return new

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
        opt = self._require_installed("before_step")
        if self.blocks.new_parameters(opt):
            self._grow(broadcast, is_global_zero)
        if self.phase == "allocated" and self.pending in URGENT_REASONS:
            return self.allocate(step, self.pending, broadcast, is_global_zero)
        return None

    def _grow(self, broadcast: Broadcast | None, is_global_zero: bool) -> None:
        """Take parameters added after install into the blocks, tables and instruments.

        After the first allocation a re-allocation of every block is made due at once (reason
        ``"params"``), within the budget resolved against all parameters now trained; the new
        parameters have no state yet and get the planner's prior risk until they do. During
        warm-up the budget is checked again (an absolute one may no longer fit). The sampler is
        rebuilt over the new blocks: statistics start afresh (a warm-up ends two samples later).
        """
        opt, module = self.optimizer, self._module
        assert opt is not None and module is not None
        before = self.blocks.size
        self.blocks.build(opt, module)
        self.tables.refresh(opt)
        self.instrumentation.restart_sampler(module)
        self.instrumentation.restart_shadow(opt)
        log.info(
            f"BAOC: {self.blocks.size - before} parameter tensor(s) joined the optimizer after install; "
            f"{len(self.blocks.params)} blocks now, {RULE_NAMES[opt.rule]} state "
            f"{format_bytes(self.baseline_state_bytes())}"
        )
        if self.phase == "allocated":
            self.pending = "params"
        else:
            self.start.warmup_formats(opt)
            self.start.apply(opt, module)  # the new blocks start within the budget too
            self.check_feasible(broadcast, is_global_zero)

    def check_feasible(self, broadcast: Broadcast | None = None, is_global_zero: bool = True) -> None:
        """Raise :class:`BudgetInfeasibleError` now if no allocation can meet the budgets.

        Feasibility depends on the memory and time tables only (not on the risk), so it is known
        before warm-up; checking at install spares a warm-up that could never end in an allocation.
        """
        self._require_installed("check_feasible")

        def check() -> bool:
            self.tables.check_feasible()
            return True

        decide_on_rank_zero(check, broadcast, is_global_zero)

    def set_budget(self, memory_budget: float | int | str | None = None, time_budget: float | str | None = None) -> None:
        """Change a budget mid-training; call it between steps, on every rank.

        After the first allocation the next step boundary re-evaluates against it (a budget that can
        no longer be met raises there, before any conversion). During warm-up the start allocation is
        solved again at once, so the cap holds from the next step; a budget it cannot meet raises
        here and the budgets stay as they were. ``None`` keeps a budget as it is.

        A lowered budget after the first allocation holds from the end of that re-evaluation's
        conversion: until then the state chosen for the old budget stays on the device (and during
        the conversion, shrinking parameters first, at most that plus one parameter's state).

        Example:
            >>> ctl = BAOCController(memory_budget=0.5, warmup_steps=20)
            >>> ctl.set_budget(memory_budget="30%")
            >>> ctl.config.memory_budget
            '30%'
        """
        allocated = self.phase == "allocated"
        self.start.set_budget(memory_budget, time_budget, opt=None if allocated else self.optimizer, module=self._module)
        if allocated:
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
        return self.instrumentation.observe(self.optimizer, step, grad_scale, allocated=self.phase == "allocated")

    def open_released_step(self, step: int, grad_scale: float | None = None) -> None:
        """With gradient release, call before the step's backward (on every rank): each parameter's
        gradient then feeds the shadow moments and the sampler inside the release hook, just before
        the parameter steps, and :meth:`close_released_step` completes the step's observation. The
        two calls take the place of :meth:`observe`, and store the same numbers
        (:class:`~lightning_baoc.control.released_gradients.ReleasedGradientObserver`)."""
        self._require_installed("open_released_step")
        self.release_observer.open(step, grad_scale, allocated=self.phase == "allocated")

    @property
    def release_open(self) -> bool:
        """Whether a step's observation under gradient release is open (:meth:`open_released_step`)."""
        return self.release_observer.is_open

    def close_released_step(self) -> bool:
        """Complete the observation :meth:`open_released_step` opened: parameters that kept their
        gradient (not released) are observed now. Returns whether a sample was taken."""
        return self.release_observer.close()

    def due(self, step: int) -> str | None:
        """The reason an allocation should run now (after ``step`` completed steps), or ``None``."""
        if not self.installed:
            return None
        if self.phase == "allocated" and self.pending in URGENT_REASONS:
            return self.pending  # no fresh statistics needed (see URGENT_REASONS)
        if self.instrumentation.ring_samples < MIN_SAMPLES:
            return None
        if self.phase == "warmup":
            return "warmup" if step >= self.config.warmup_steps else None
        return self.pending

    def step_completed(self) -> int:
        """Count one optimizer step, for adapters without a step counter of their own (Fabric);
        returns the steps completed, the ``step`` to pass to the other calls."""
        self.steps += 1
        return self.steps

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
        if self.optimizer is not None and self.blocks.new_parameters(self.optimizer):  # adapters that skip before_step
            self._grow(broadcast, is_global_zero)
        reason = self.due(step)
        if reason is None:
            return None
        return self.allocate(step, reason, broadcast, is_global_zero)

    # ------------------------------------------------------------------ triggers

    def epoch_end(self, epoch: int) -> bool:
        """Schedule a re-evaluation at the end of every ``reevaluate_every_n_epochs``-th epoch.

        Args:
            epoch: the 0-based index of the epoch that ended.

        Returns:
            whether a re-evaluation is now pending because of it.
        """
        if self.phase != "allocated" or not self.triggers.epoch_due(epoch):
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
        if self.phase != "allocated":
            return False
        due, reason = self.triggers.evaluate(value)
        if due:
            self.pending = self.pending or reason
        return due

    # ------------------------------------------------------------------ allocation

    def _decide(self, reason: str, scored: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
        """Rank zero: statistics -> risk (``scored``: computed on every rank already) -> solve ->
        hysteresis. Primitives only (broadcast)."""
        opt = self.optimizer
        assert opt is not None
        cfg, tables = self.config, self.tables
        stats = self.scoring.statistics()
        raw = self.options.with_corrections(opt, scored if scored is not None else self.scoring.risk(opt, stats), measured=True)
        raw.update(self.scoring.prior_rows(opt, self._module))
        risk = checked_risk(raw, list(self.blocks.params), tables.offered)
        options = capped(risk, cfg.max_block_risk)
        if options is risk:
            alloc = tables.solve(risk)
        else:
            try:
                alloc = tables.solve(options)
            except BudgetInfeasibleError as err:
                # Memory is the hard limit (an allocation over it may not fit at all); the cap is a
                # quality preference: lift it rather than fail a training run after warm-up.
                need = "" if err.min_memory is None else f" (under the cap it needs {format_bytes(err.min_memory)})"
                warnings.warn(
                    f"BAOC(max_block_risk={cfg.max_block_risk!r}): the budgets cannot be met with the "
                    f"formats under the risk cap{need}; the cap is lifted for this allocation. Raise "
                    f"memory_budget or max_block_risk to keep it.",
                    UserWarning,
                    stacklevel=2,
                )
                options = risk
                alloc = tables.solve(risk)
        formats, kept = dict(alloc.formats), False
        if self.phase == "allocated" and self.allocation and tables.fits(self.allocation):
            if keeps_current(self.allocation, alloc.risk, risk, options, cfg.hysteresis):
                formats, kept = dict(self.allocation), True
        time = tables.time_of(formats) if cfg.time_budget is not None else None
        _, _, mb_bytes, tb_abs = tables.budgets()
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

    def allocate(
        self, step: int, reason: str = "manual", broadcast: Broadcast | None = None, is_global_zero: bool = True
    ) -> AllocationEvent:
        """Statistics -> risk -> solve -> convert the changed blocks in place; on every rank.

        Decided on rank zero and broadcast. Raises :class:`BudgetInfeasibleError` (naming the
        smallest feasible budget) before any conversion when the budgets cannot be met.
        """
        opt = self._require_installed("allocate")
        scored = self.scoring.risk_across_shards(opt, is_global_zero)  # every rank at once (a sharded model), else None
        decision = decide_on_rank_zero(lambda: self._decide(reason, scored), broadcast, is_global_zero)
        before = int(opt.state_bytes())
        current = self.options.current(opt)
        changed = {b: (current[b], f) for b, f in decision["formats"].items() if current.get(b) != f}
        migrated: dict[str, tuple[str, str]] = {}
        if changed:
            migrated = self.options.apply(opt, {b: new for b, (_, new) in changed.items()}, self.blocks.params)
        after = int(opt.state_bytes())
        self.allocation = dict(decision["formats"])
        self.phase = "allocated"
        self.pending = None
        self.triggers.restart()
        self.instrumentation.restart_statistics()  # the next re-evaluation sees fresh statistics only
        formats = self.allocation
        risk = decision["risk"]
        event = AllocationEvent(
            step=int(step),
            reason=reason,
            formats=dict(formats),
            changed=changed,
            migrated={k: (v[0], v[1]) for k, v in migrated.items()},
            kept=bool(decision["kept"]),
            risk=risk,
            total_risk=float(sum(risk[b][formats[b]] for b in self.blocks.params)),
            solver_risk=float(decision["solver_risk"]),
            statistics=decision["statistics"],
            block_params=self.blocks.model_params(),
            block_numel=dict(self.tables.numel),
            block_bytes=self.options.held_bytes(opt),
            state_bytes_before=before,
            state_bytes=after,
            fp32_state_bytes=self.fp32_state_bytes(),
            memory_budget_bytes=int(decision["memory_budget_bytes"]),
            time_budget=decision["time_budget"],
            time=decision["time"],
            baseline_state_bytes=self.baseline_state_bytes(),
            peak_state_bytes=self.peak_state_bytes(),
            instrument_bytes=self.instrument_bytes(),
            training_memory=training_memory(self._module, opt).to_dict() if self._module is not None else None,
            optimizer=RULE_NAMES[opt.rule],
            correction_bytes=int(opt.weight_correction_bytes()),
            corrections_in_budget=self.options.paired,
            corrections=self.options.corrections(opt),
        )
        self.last_event = event
        self.history.append(
            {
                "step": event.step,
                "reason": reason,
                "kept": event.kept,
                "changed": len(changed),
                "state_bytes": after,
                "peak_state_bytes": event.peak_state_bytes,
                "total_risk": event.total_risk,
                "memory_budget_bytes": event.memory_budget_bytes,
            }
        )
        return event

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Phase, allocation, counters, the settings that shaped the allocation and the sampler's
        ring, as primitives and tensors (:class:`~lightning_baoc.control.checkpoint.ControllerCheckpoint`).

        The optimizer's own (compact) state is saved by the framework with the optimizer.
        """
        inst = self.instrumentation
        return self.checkpoint.encode(
            phase=self.phase,
            allocation=self.allocation,
            blocks=self.blocks.params,
            pending=self.pending,
            best=self.triggers.best,
            wait=self.triggers.wait,
            ring_samples=inst.ring_samples,
            steps=self.steps,
            history=self.history,
            sampler=inst.sampler,
            shadow=inst.shadow,
            peak_state_bytes=self.peak_state_bytes(),
            rule=self.optimizer.rule if self.optimizer is not None else self.checkpoint.saved_rule(),
        )

    def load_state_dict(self, state_dict: Any) -> None:
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
            ValueError: not a controller state; a state of another optimizer (AdamW's formats
                resumed with SGD); or a changed partition or model that leaves
                parameters of this run without a saved format (the message names the setting
                and the fix).
        """
        self.checkpoint.accept(state_dict)
        if self.installed:
            self._apply_loaded()

    def _apply_loaded(self) -> None:
        """Restore the state the checkpoint part holds into this run's optimizer and parts."""
        opt, sd = self.optimizer, self.checkpoint.take()
        assert opt is not None and sd is not None
        saved = self.checkpoint.resume(sd, opt.rule, type(opt).__name__, self.blocks.params)
        inst = self.instrumentation
        self.phase = saved.phase  # type: ignore[assignment]
        self.pending = saved.pending
        self.triggers.best = saved.best
        self.triggers.wait = saved.wait
        self.steps = saved.steps
        self.history = saved.history
        self._peak = max(self._peak, saved.peak_state_bytes)
        inst.ring_samples = saved.ring_samples
        if saved.same_blocks:
            self.allocation = saved.allocation
            if saved.sampler is not None:
                assert inst.sampler is not None
                inst.sampler.load_state_dict(saved.sampler)
            if saved.shadow is not None and inst.shadow is not None:
                fresh = inst.shadow.load_state_dict(saved.shadow)
                if fresh:
                    warnings.warn(
                        f"BAOC: the shadow moments (the risk model's fp32 reference) of {len(fresh)} parameters restart "
                        f"from zero at this resume, e.g. {fresh[0]}; the next allocations score them on fresh moments",
                        UserWarning, stacklevel=3,
                    )
            if self.allocation:
                self.options.apply(opt, self.allocation, self.blocks.params)
        else:
            if saved.per_param:
                self.options.apply(opt, saved.per_param)
            self.allocation = saved.allocation
            if saved.warning is not None:
                warnings.warn(saved.warning, UserWarning, stacklevel=3)
        # a format the formats offered here lack (menu changed, or another device: offload
        # checkpointed on a GPU, resumed on a CPU) must not run a step, whatever the state says
        unoffered = {f for f in self.allocation.values() if f not in self.tables.offered}
        if self.phase == "allocated" and (saved.changed or not saved.same_blocks or unoffered):
            self.pending = "settings"
            log.info("BAOC: %s changed since the checkpoint: re-allocating before the next step", saved.changed or "blocks")

    # ------------------------------------------------------------------ misc

    def close(self) -> None:
        """Stop the sampler's worker thread (statistics stay available)."""
        self.instrumentation.close()

    def summary(self, measured_peak_growth_bytes: int | None = None) -> BAOCSummary:
        """The run's figures now, as the documented record ``BAOC.summary()`` returns.

        Args:
            measured_peak_growth_bytes: what the adapter measured of the device's memory at its peak, over its
                level at fit start (default: ``None``, not known).

        Raises:
            RuntimeError: before :meth:`install` (there is no optimizer to summarize yet).

        Example:
            >>> s = controller.summary()  # doctest: +SKIP
            >>> s.state_bytes + (s.correction_bytes if s.corrections_in_budget else 0) <= s.memory_budget_bytes  # doctest: +SKIP
            True
        """
        opt = self._require_installed("summary")
        state, baseline = int(opt.state_bytes()), self.baseline_state_bytes()
        return BAOCSummary(
            phase=self.phase,
            step=self.steps,
            optimizer=RULE_NAMES[opt.rule],
            state_bytes=state,
            baseline_state_bytes=baseline,
            state_fraction=state_fraction(state, baseline),
            correction_bytes=int(opt.weight_correction_bytes()),
            corrections_in_budget=self.options.paired,
            memory_budget_bytes=self.memory_budget_bytes(),
            peak_state_bytes=self.peak_state_bytes(),
            measured_peak_growth_bytes=measured_peak_growth_bytes,
            total_risk=float(self.history[-1]["total_risk"]) if self.history else None,
            formats=self.options.state_formats(opt),
            corrections=self.options.corrections(opt),
        )

    def summary_line(self) -> str:
        """One line: phase, state bytes (and the corrections') and budget; printed after the run's first step.

        Example:
            >>> controller.summary_line()  # doctest: +SKIP
            'BAOC: phase warmup, 5 blocks, optimizer state 201 KiB of 672 KiB AdamW (budget 202 KiB)'
        """
        if self.optimizer is None:
            return f"BAOC: not installed (phase {self.phase})"
        return f"BAOC: phase {self.phase}, {len(self.blocks.params)} blocks, {self._state_line()}"

    def _state_line(self) -> str:
        """``"optimizer state X of Y AdamW (budget Z)"`` of the installed optimizer, the corrections' bytes
        beside the states' where there are any (``"... AdamW, weight corrections C (budget Z for both)"``)."""
        opt = self.optimizer
        assert opt is not None  # the callers say so otherwise
        corrections = int(opt.weight_correction_bytes())
        line = f"optimizer state {format_bytes(opt.state_bytes())} of {format_bytes(self.baseline_state_bytes())} {RULE_NAMES[opt.rule]}"
        budget = f"budget {format_bytes(self.memory_budget_bytes())}"
        if self.options.paired:
            return f"{line}, weight corrections {format_bytes(corrections)} ({budget} for both)"
        if corrections:
            return f"{line} ({budget}), weight corrections {format_bytes(corrections)} outside the budget"
        return f"{line} ({budget})"

    def resumed_line(self) -> str:
        """One line after a resume (the optimizer's state restored): the step, the phase and the allocation
        resumed into, and the state.

        Example:
            >>> controller.resumed_line()  # doctest: +SKIP
            'BAOC: resumed at step 120 into the allocation of step 60 (5 blocks: int8 2, fp32 2, bf16_momentum 1); optimizer state 201 KiB of 672 KiB AdamW (budget 202 KiB)'
        """
        if not self.installed:
            return "BAOC: the checkpoint's state is applied when the optimizer is installed"
        counts: dict[str, int] = {}
        for fmt in (self.allocation if self.phase == "allocated" else self.start_allocation or {}).values():
            counts[fmt] = counts.get(fmt, 0) + 1
        formats = ", ".join(f"{f} {n}" for f, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        if self.phase == "allocated":
            since = f" of step {self.history[-1]['step']}" if self.history else ""
            where = f"the allocation{since} ({len(self.block_params)} blocks: {formats})"
        else:
            left = max(self.config.warmup_steps - self.steps, 0)
            where = f"the warm-up, {left} step(s) before the first allocation" + (f" (start formats: {formats})" if formats else "")
        return f"BAOC: resumed at step {self.steps} into {where}; {self._state_line()}"

    def _require_installed(self, what: str) -> BlockwiseOptimizer:
        """The installed optimizer; raises naming ``what`` if there is none."""
        if self.optimizer is None:
            raise RuntimeError(f"BAOCController.{what}() needs install(optimizer, model) first")
        return self.optimizer


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
