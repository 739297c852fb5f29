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
``torch.optim.AdamW`` would hold (:attr:`~BAOCController.baseline_state_bytes`: two moments in
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

import logging
import warnings
from typing import Any, Callable, Literal, Mapping

import torch
from torch import nn

from lightning_baoc.config.budget import format_bytes, parse_memory_budget
from lightning_baoc.config.settings import MIN_SAMPLES, BAOCConfig
from lightning_baoc.control.blocks import BlocksMixin
from lightning_baoc.control.checkpoint import ALLOCATION_SETTINGS, CheckpointMixin
from lightning_baoc.control.decision import capped, checked_risk, keeps_current
from lightning_baoc.control.events import AllocationEvent
from lightning_baoc.control.options import OptionsMixin
from lightning_baoc.control.protocol import Broadcast, decide_on_rank_zero
from lightning_baoc.control.release import ReleaseObservationMixin
from lightning_baoc.control.scoring import ScoringMixin
from lightning_baoc.control.start import StartMixin
from lightning_baoc.control.triggers import TriggersMixin
from lightning_baoc.costs import AllocationProblem, with_message
from lightning_baoc.costs.memory import training_memory
from lightning_baoc.formats import RULE_NAMES, format_state_bytes
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.optim.swap import (
    SUPPORTED_OPTIMIZERS,
    convert_optimizer,
    rebind_scheduler,
)
from lightning_baoc.risk import optimizer_risk_table
from lightning_baoc.risk.prior import block_kind, prior_risk
from lightning_baoc.risk.shadow import ShadowMoments
from lightning_baoc.sampling import GradientSampler
from lightning_baoc.solver import Allocation, BudgetInfeasibleError

log = logging.getLogger(__name__)

#: Re-allocations that run before the next optimizer step, without waiting for fresh statistics:
#: parameters joined the optimizer (they would train unmanaged), and settings that shape the
#: allocation changed at resume (a format may have left the menu).
URGENT_REASONS = ("params", "settings")


Phase = Literal["warmup", "allocated"]
#: ``risk_fn(optimizer, blocks, statistics, formats=..., horizon=...) -> block -> format -> risk``
RiskFn = Callable[..., Mapping[str, Mapping[str, float]]]



def _training_device(optimizer: BlockwiseOptimizer) -> torch.device:
    """The device the optimizer's parameters train on: it decides the formats withheld and what
    ``offload`` costs there."""
    return next(iter(optimizer.named_params.values())).device


# ---------------------------------------------------------------------------- the controller


class BAOCController(
    BlocksMixin, StartMixin, TriggersMixin, CheckpointMixin, ReleaseObservationMixin, OptionsMixin, ScoringMixin
):
    """The framework-free BAOC lifecycle (see the module docstring for the calls and their order).

    Args:
        config: the settings (a :class:`BAOCConfig`, or its fields as keyword arguments).
        risk_fn: the risk model, ``risk_fn(optimizer, blocks, statistics, formats=, horizon=)``
            (default: :func:`lightning_baoc.risk.optimizer_risk_table`: AdamW's risk model, or SGD's and Lion's).

    Attributes:
        block_params: the partition, block -> the optimizer's names of its parameters (set at
            :meth:`install`; the setting ``config.blocks`` holds the glob patterns that shape it).

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
        self.risk_fn: RiskFn = risk_fn or optimizer_risk_table
        self.optimizer: BlockwiseOptimizer | None = None
        self.sampler: GradientSampler | None = None
        self.block_params: dict[str, list[str]] = {}  # the partition (see Attributes)
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
        self._dtypes: dict[str, list[torch.dtype]] = {}
        self._device = torch.device("cpu")
        self._withheld: dict[str, str] = {}  # format -> why it is not offered (the problem's ``withheld``)
        self._offered: list[str] = []  # the menu less the withheld formats (the problem's ``allowed``)
        self._memory: dict[str, dict[str, int]] = {}
        self._problem: AllocationProblem | None = None
        self._loaded: dict[str, Any] | None = None
        self.start_allocation: dict[str, str] | None = None  # block -> format the warm-up started in
        self.shadow: ShadowMoments | None = None  # fp32 moments on a sample of each tensor (risk)
        self._peak = 0  # peak state bytes of earlier optimizers of this run (see peak_state_bytes)
        self._betas_cache: tuple[Any, dict[str, tuple[float, float]]] | None = None  # see _betas
        self._observer_handle: Any = None  # the optimizer's gradient observer (gradient release)
        # the step observed under gradient release: (step, grad scale, sampling, names observed)
        self._release_open: tuple[int, float | None, bool, set[str]] | None = None
        self._shadow_samples: list[Any] = []  # the shadow's samples of the released gradients

    # ------------------------------------------------------------------ properties

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` has run."""
        return self.optimizer is not None

    @property
    def fp32_state_bytes(self) -> int:
        """The fp32 state bytes of the blocks: fp32 AdamW's 8 bytes per trainable element (SGD's and
        Lion's fp32 momentum: 4), the problem's ``fp32`` column."""
        return self._problem.fp32_bytes if self._problem is not None else 0

    @property
    def baseline_state_bytes(self) -> int:
        """The state the user's own ``torch.optim.AdamW`` (``SGD``, Lion) would hold on the blocks'
        parameters.

        torch's AdamW keeps its two moments in each parameter's dtype: 8 bytes per fp32 element
        (:attr:`fp32_state_bytes`), 4 per bf16 or fp16 element; SGD and Lion one buffer (4, 2). A
        fractional memory budget and the fraction saved refer to it.
        """
        return self._baseline

    @property
    def problem(self) -> AllocationProblem:
        """The allocation problem of the blocks: tables, offered formats, budget units (after install)."""
        if self._problem is None:
            raise RuntimeError("BAOCController.problem: call install() first")
        return self._problem

    @property
    def peak_state_bytes(self) -> int:
        """The most optimizer state held on the training devices at any moment of the run (resumes
        included: the figure is checkpointed), conversion transients included."""
        held = self.optimizer.peak_state_bytes if self.optimizer is not None else 0
        self._peak = max(self._peak, int(held))
        return self._peak

    def memory_budget_bytes(self) -> int:
        """The memory budget in bytes (a fraction resolved against :attr:`baseline_state_bytes`)."""
        return parse_memory_budget(self.config.memory_budget, self.baseline_state_bytes)

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
        new = convert_optimizer(optimizer, module, cfg.min_8bit_numel, cfg.seed)
        self._module = module
        self._managed = set()
        self._build_blocks(new, module)
        self._device = _training_device(new)
        self._refresh_tables(new)
        self._restart_sampler(module)
        self.optimizer = new
        self._watch_released_gradients(new)
        self._restart_shadow()
        if self._loaded is not None:
            self._apply_loaded()
        elif self.phase == "allocated" and self.allocation:
            # A second fit with the same controller: the fresh optimizer starts in the allocation.
            self._apply_options(self.allocation, self.block_params)
        if self.phase == "warmup":
            self._warmup_formats()
            self._start_within_budget()
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
        self._require_installed("before_step")
        if self._new_parameters():
            self._grow(broadcast, is_global_zero)
        if self.phase == "allocated" and self.pending in URGENT_REASONS:
            return self.allocate(step, self.pending, broadcast, is_global_zero)
        return None

    # ------------------------------------------------------------------ tables and budgets

    def _time_table(self) -> dict[str, dict[str, float]]:
        return self.problem.time()

    def _budgets(self) -> tuple[Any, Any, int, float | None]:
        """(memory budget, time budget) as passed to ``solve``, and both in absolute units."""
        b = self.problem.budgets(self.config.memory_budget, self.config.time_budget)
        return b.memory, b.time, b.memory_bytes, b.time_seconds

    def _solve(self, risk: Mapping[str, Mapping[str, float]]) -> Allocation:
        cfg = self.config
        try:
            return self.problem.solve(risk, cfg.memory_budget, cfg.time_budget)
        except BudgetInfeasibleError as err:
            offered = ", ".join(self._offered)
            withheld = "".join(f"; {f} withheld: {why}" for f, why in self._withheld.items())
            raise with_message(
                err,
                f"BAOC(memory_budget={cfg.memory_budget!r}, time_budget={cfg.time_budget!r}): {err} (formats "
                f"allowed: {offered}{withheld}). No format was converted; the optimizer keeps its current formats.",
            ) from None

    def check_feasible(self, broadcast: Broadcast | None = None, is_global_zero: bool = True) -> None:
        """Raise :class:`BudgetInfeasibleError` now if no allocation can meet the budgets.

        Feasibility depends on the memory and time tables only (not on the risk), so it is known
        before warm-up; checking at install spares a warm-up that could never end in an allocation.
        """
        self._require_installed("check_feasible")

        def check() -> bool:
            self._solve({b: {f: 0.0 for f in self._offered} for b in self.block_params})
            return True

        decide_on_rank_zero(check, broadcast, is_global_zero)

    # ------------------------------------------------------------------ hot path

    def observe(self, step: int, grad_scale: float | None = None) -> bool:
        """Feed the sampler with the current gradients; call once per optimizer step, before it.

        Args:
            step: optimizer steps completed before this one (Lightning's ``global_step``).
            grad_scale: the loss scale the gradients still carry, if any (fp16 AMP).

        Returns:
            whether a sample was taken.
        """
        if self.shadow is not None and self.optimizer is not None:
            self.shadow.update(self.optimizer.named_params, self._betas(), grad_scale)
        if self.sampler is None or not self._sampling_step(step):
            return False
        return self._counted(step, self.sampler.sample(step, grad_scale))

    def _sampling_step(self, step: int) -> bool:
        """Whether the sampler may sample at ``step`` (sparser after warm-up)."""
        every = self.config.sample_every
        if self.phase == "allocated" and self.config.sparse_sampling > 1:
            # Sparser after warm-up: every sparse_sampling-th sampling step (and its follower).
            if (step // every) % self.config.sparse_sampling:
                return False
        return True

    def _counted(self, step: int, took: bool) -> bool:
        every = self.config.sample_every
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
        if self.installed and self._new_parameters():  # adapters that skip before_step
            self._grow(broadcast, is_global_zero)
        reason = self.due(step)
        if reason is None:
            return None
        return self.allocate(step, reason, broadcast, is_global_zero)

    # ------------------------------------------------------------------ allocation

    def _decide(self, reason: str, scored: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
        """Rank zero: statistics -> risk (``scored``: computed on every rank already) -> solve ->
        hysteresis. Primitives only (broadcast)."""
        stats = self._statistics()
        raw = self._with_corrections(scored if scored is not None else self._risk(stats), measured=True)
        raw.update(self._prior_rows())
        risk = checked_risk(raw, list(self.block_params), self._offered)
        options = capped(risk, self.config.max_block_risk)
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
        formats, kept = dict(alloc.formats), False
        if self.phase == "allocated" and self.allocation and self._current_fits():
            if keeps_current(self.allocation, alloc.risk, risk, options, self.config.hysteresis):
                formats, kept = dict(self.allocation), True
        time = None
        if self.config.time_budget is not None:
            time = float(sum(self._time_table()[b][formats[b]] for b in self.block_params))
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
        (:func:`lightning_baoc.risk.prior_risk`, shares over all the blocks) stands in until
        their state exists.
        """
        assert self.optimizer is not None
        opt = self.optimizer
        fresh = [b for b, names in self.block_params.items() if any(opt.step_count(n) == 0 for n in names)]
        if not fresh:
            return {}
        module = self._module if self._module is not None else nn.Module()
        kinds = {b: block_kind(module, b) for b in fresh}
        table = prior_risk(self._shapes, kinds, self._formats_offered(), opt.min_8bit_numel, opt.rule)
        return self._with_corrections({b: table[b] for b in fresh}, measured=False)

    def _current_fits(self) -> bool:
        """Whether the allocation in force still meets the (possibly changed) budgets."""
        _, _, mb_bytes, tb_abs = self._budgets()
        current = self.allocation
        if any(current.get(b) not in self._memory[b] for b in self.block_params):
            return False  # a block without a format in force (added since), or one no longer offered
        fits = sum(self._memory[b][current[b]] for b in self.block_params) <= mb_bytes
        if fits and tb_abs is not None:
            fits = sum(self._time_table()[b][current[b]] for b in self.block_params) <= tb_abs
        return fits

    def allocate(
        self, step: int, reason: str = "manual", broadcast: Broadcast | None = None, is_global_zero: bool = True
    ) -> AllocationEvent:
        """Statistics -> risk -> solve -> convert the changed blocks in place; on every rank.

        Decided on rank zero and broadcast. Raises :class:`BudgetInfeasibleError` (naming the
        smallest feasible budget) before any conversion when the budgets cannot be met.
        """
        self._require_installed("allocate")
        assert self.optimizer is not None and self.sampler is not None
        scored = self._risk_across_shards(is_global_zero)  # every rank at once (a sharded model), else None
        decision = decide_on_rank_zero(lambda: self._decide(reason, scored), broadcast, is_global_zero)
        opt = self.optimizer
        before = int(opt.state_bytes())
        current = self._current_options()
        changed = {b: (current[b], f) for b, f in decision["formats"].items() if current.get(b) != f}
        migrated: dict[str, tuple[str, str]] = {}
        if changed:
            migrated = self._apply_options({b: new for b, (_, new) in changed.items()}, self.block_params)
        after = int(opt.state_bytes())
        self.allocation = dict(decision["formats"])
        self.phase = "allocated"
        self.pending = None
        self.wait = 0
        self.sampler.reset()  # the next re-evaluation sees fresh statistics only
        self.ring_samples = 0
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
            total_risk=float(sum(risk[b][formats[b]] for b in self.block_params)),
            solver_risk=float(decision["solver_risk"]),
            statistics=decision["statistics"],
            block_params={b: [self._model_names.get(n, n) for n in names] for b, names in self.block_params.items()},
            block_numel=dict(self._numel),
            block_bytes=self._block_bytes(),
            state_bytes_before=before,
            state_bytes=after,
            fp32_state_bytes=self.fp32_state_bytes,
            memory_budget_bytes=int(decision["memory_budget_bytes"]),
            time_budget=decision["time_budget"],
            time=decision["time"],
            baseline_state_bytes=self.baseline_state_bytes,
            peak_state_bytes=self.peak_state_bytes,
            instrument_bytes=self.instrument_bytes,
            training_memory=training_memory(self._module, opt).to_dict() if self._module is not None else None,
            optimizer=RULE_NAMES[opt.rule],
            correction_bytes=int(opt.weight_correction_bytes()) if self._paired else None,
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

    def _block_bytes(self) -> dict[str, int]:
        """Block -> state bytes of its parameters in their effective formats (and the bytes of their
        corrections, where options pair them)."""
        assert self.optimizer is not None
        opt = self.optimizer
        held = opt.formats()
        out = {}
        for b, names in self.block_params.items():
            total = 0
            for n, shape in zip(names, self._shapes[b]):
                total += format_state_bytes(held[n], shape, opt.min_8bit_numel, opt.rule)
                correction = opt.held_correction(n) if self._paired else None
                if correction is not None:
                    total += correction.untyped_storage().nbytes()
            out[b] = int(total)
        return out

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
            f"BAOC: phase {self.phase}, {len(self.block_params)} blocks, optimizer state "
            f"{format_bytes(self.optimizer.state_bytes())} of {format_bytes(self.baseline_state_bytes)} "
            f"{RULE_NAMES[self.optimizer.rule]} "
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
