"""BAOC: the Lightning callback, a thin adapter over :class:`~lightning_baoc.control.controller.BAOCController`.

Hook by hook (Lightning 2.6; README.md, "The BAOC callback", has the whole lifecycle):

- ``setup``: refuses strategies that flatten the parameters into one state dtype (FSDP1);
  ``ModelParallelStrategy`` (FSDP2) runs, each rank holding its shards' states. Under
  ``DeepSpeedStrategy`` (ZeRO 1-3) ``configure_optimizers`` is wrapped so that DeepSpeed builds its
  engine over BAOC's client optimizer (:mod:`lightning_baoc.integrations.deepspeed`): each rank holds
  the states of its fragments of DeepSpeed's flat partitions, the gradients are observed inside
  DeepSpeed's step, checkpoints go through DeepSpeed's own.
- ``on_fit_start``: installs once: the optimizer ``configure_optimizers`` returned becomes a fp32
  :class:`~lightning_baoc.BlockwiseAdamW` over the same param groups (``strategy.optimizers``
  and every LR scheduler are rebound, so Lightning, the schedulers, ``LearningRateMonitor`` and
  checkpoints hold that one object from then on); an infeasible budget fails here, before
  training. On resume the callback state is already loaded (Lightning loads callback state
  before ``configure_optimizers``), so the saved allocation is requested here and the optimizer
  state, which Lightning loads after this hook, lands in the saved formats.
- ``on_before_optimizer_step``: first takes parameters added since install into the allocation
  (``BackboneFinetuning`` and any ``add_param_group``: allocated at once, within the budget) and
  runs a re-allocation due to settings changed at resume, both before the step; then samples the
  gradients. Here, not in ``on_after_backward``:
  Lightning calls it once per optimizer step, after the closure has run the backward of the
  micro-batch that completes the accumulation window, so the gradients are accumulated over the
  whole window, all-reduced under DDP (every rank samples the same gradient), unscaled under
  fp16 AMP and not yet clipped. ``on_after_backward`` fires on every micro-batch, with partial
  sums, unsynchronized gradients and the loss scale still applied.
- ``on_train_batch_end``, after a batch whose optimizer step completed (``global_step`` moved):
  the allocation at warm-up end and pending re-evaluations run here, between batches, never
  inside the step in flight (a conversion inside ``on_before_optimizer_step`` would act on the
  step that is running).
- ``on_validation_end`` (plateau of ``monitor``) and ``on_train_epoch_end`` (every N epochs)
  schedule re-evaluations; they run at once when the last batch completed a step, else at the
  next step boundary.
- ``state_dict`` / ``load_state_dict``: the controller's state (allocation, counters, the
  settings that shaped the allocation, sampler ring); the compact optimizer state is saved by
  Lightning with the optimizer. A resume with other settings (budgets, menu, even the partition
  that the state key names) finds its state and re-evaluates, or refuses, instead of silently
  starting over.

Reports (rank zero, at each allocation): a rich table, ``baoc_allocation.json`` and, when
matplotlib is installed, ``baoc_allocation.png`` in ``trainer.log_dir`` (its path is printed once),
and the scalars of :meth:`BAOC.summary`'s figures (``baoc/state_bytes``, ``baoc/state_fraction``, ...:
:data:`lightning_baoc.control.summary.METRIC_NAMES`) to every logger. :meth:`BAOC.summary` returns the run's
figures at any time after install, as a :class:`~lightning_baoc.BAOCSummary`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_baoc.config.files import baoc_kwargs, load_config
from lightning_baoc.config.settings import FormatName, ReportSetting, settings_of, split_settings
from lightning_baoc.control.controller import AllocationEvent, BAOCController, rebind_scheduler
from lightning_baoc.control.summary import BAOCSummary
from lightning_baoc.integrations.checkpoints import check_saved_shards, distributed_metadata
from lightning_baoc.integrations.deepspeed import check_offload, fragment_module, wrap_configure_optimizers, zero_client_of
from lightning_baoc.integrations.logs import rank_zero_info  # BAOC's lines, once under Hydra too
from lightning_baoc.optim import BlockwiseAdamW
from lightning_baoc.optim.deepspeed import check_deepspeed_version
from lightning_baoc.report.allocation import AllocationReporter
from lightning_baoc.report.memory import MeasuredPeak, MemoryMeter


def _refused_strategy(strategy: Any) -> str | None:
    """Why BAOC cannot run under ``strategy`` (None if it can)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    name = type(strategy).__name__
    if isinstance(strategy, DeepSpeedStrategy):
        return None  # the DeepSpeed branch (setup, on_fit_start, the batch hooks)
    if isinstance(strategy, FSDPStrategy):
        return (
            f"BAOC cannot run under {name}: FSDP's flat parameters hold one state dtype and parameter-shaped "
            f"states per flat parameter, which formats per block do not have. Use strategy='ddp' (or a single "
            f"device) with BAOC; to shard, FSDP2 (ModelParallelStrategy) steps BlockwiseAdamW per shard."
        )
    if isinstance(strategy, ModelParallelStrategy) and not getattr(strategy, "_save_distributed_checkpoint", True):
        return (
            f"BAOC cannot run under {name}(save_distributed_checkpoint=False): a full checkpoint gathers every "
            f"state on rank zero in the layout of torch's AdamW, which compact per-rank states do not have. Keep "
            f"the default save_distributed_checkpoint=True (each rank saves its shards; resume on the same "
            f"world size), and export a whole state with BlockwiseAdamW.to_adamw_state_dict() for another one."
        )
    return None


class BAOC(Callback):
    """Budget-aware optimizer-state formats per block, chosen from gradient statistics.

    Trains ``warmup_steps`` optimizer steps in fp32 (AdamW, exactly), sampling per-block gradient
    statistics; then scores the risk of every cheaper state format per block, solves for the
    allocation of least total risk within the budgets and converts the optimizer's states in
    place. Re-evaluates every ``reevaluate_every_n_epochs`` epochs and when ``monitor`` plateaus.

    The arguments are the settings of :data:`lightning_baoc.config.settings.SETTINGS`, in its order
    (``memory_budget`` first, the only one required), each spelled out in ``__init__`` with its type,
    default and help, so ``help(BAOC.__init__)`` and LightningCLI's
    ``--trainer.callbacks.help lightning_baoc.BAOC`` list them; the table checks every value.

    A YAML template (``configs/*.yaml``) builds one with :meth:`from_config`.

    Example:
        >>> from lightning import Trainer
        >>> baoc = BAOC(memory_budget=0.35, warmup_steps=200)
        >>> trainer = Trainer(callbacks=[baoc])  # doctest: +SKIP
        >>> trainer.fit(model)  # configure_optimizers returns torch.optim.AdamW  # doctest: +SKIP
        >>> baoc.summary().state_fraction <= 0.35  # what it saved: a BAOCSummary  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        memory_budget: Union[int, float, str],
        time_budget: Union[float, str, None] = None,
        warmup_steps: int = 200,
        sample_every: int = 10,
        granularity: Literal["module", "layer", "param"] = "module",
        blocks: Optional[dict[str, Union[str, list[str]]]] = None,
        formats: Optional[list[FormatName]] = None,
        corrections: Optional[list[Literal["none", "ecc8", "ecc16"]]] = None,
        reevaluate_every_n_epochs: Optional[int] = None,
        monitor: Optional[str] = None,
        mode: Literal["min", "max"] = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        hysteresis: float = 0.1,
        horizon: int = 200,
        sparse_sampling: int = 4,
        capacity: int = 32,
        max_elements: int = 4096,
        instrument_share: float = 0.05,
        min_8bit_numel: int = 4096,
        calibration: Literal["auto", "prior"] = "auto",
        calibration_cache_dir: Optional[str] = None,
        report: ReportSetting = True,
        seed: int = 0,
        max_block_risk: Optional[float] = None,
        initial: Union[str, dict[str, str], None] = None,
    ) -> None:
        """Build the callback; every argument is checked here (a bad one raises :class:`~lightning_baoc.SettingError`
        naming it).

        Args:
            memory_budget: Optimizer-state memory allowed: a fraction in (0, 1] of the
                state torch.optim.AdamW would hold on the parameters trained (8 bytes
                per fp32 parameter, 4 per bf16 one; parameters added later included)
                (0.35 or '35%'), or an absolute size: an int of bytes or a string with a
                unit ('6GB', '512MiB').
            time_budget: Optimizer-step time allowed: a multiple >= 1 of the fp32 AdamW
                step (1.2 or '1.2x') or an absolute time ('12ms', with calibration
                'auto' only). null: no limit. (default: ``None``)
            warmup_steps: Optimizer steps, sampled, before the first allocation from
                measured statistics (>= sample_every + 2); they run in the start
                allocation, within the budgets (see 'initial'). (default: ``200``)
            sample_every: Sample the gradients every N optimizer steps during warm-up
                (and the step after, for the lag-1 cosine). (default: ``10``)
            granularity: Block granularity: 'module' (one block per module that owns
                parameters), 'layer' (one block per repeated layer, e.g. a transformer
                block) or 'param' (one block per tensor). (default: ``'module'``)
            blocks: Named blocks: block name -> glob or list of globs over parameter
                names (fnmatch, case-sensitive), matched before 'granularity'. Every
                glob must match a trainable parameter. (default: ``None``)
            formats: The optimizer-state formats the solver may pick (the optimizer's:
                AdamW's, or SGD's and Lion's fp32, bf16, int8, none). null: every format
                of the optimizer the device serves. (default: ``None``)
            corrections: Master-weight corrections the solver pairs with the formats of
                bf16/fp16 weights, per block, their bytes in the memory budget. null:
                all three (none, ecc8, ecc16) where weights are bf16/fp16, unless the
                optimizer holds its own (weight_correction), kept outside the budget.
                [none] opts out. (default: ``None``)
            reevaluate_every_n_epochs: Re-evaluate the allocation every N epochs. null:
                never on a schedule. (default: ``None``)
            monitor: A validation metric (as logged with self.log); a plateau of it
                triggers a re-evaluation. (default: ``None``)
            mode: 'min' if 'monitor' improves downwards (loss, perplexity), 'max' if
                upwards. (default: ``'min'``)
            patience: Validation checks without improvement of 'monitor' before a
                re-evaluation. (default: ``3``)
            min_delta: Smallest change of 'monitor' counted as an improvement. (default:
                ``0.0``)
            hysteresis: A re-evaluation migrates only if the new allocation lowers the
                total risk by more than this fraction (or the current one breaks a
                budget); keeps allocations from flapping. (default: ``0.1``)
            horizon: Optimizer steps over which the risk model lets zero-mean update
                noise average out. (default: ``200``)
            sparse_sampling: After warm-up, sample N times less often. (default: ``4``)
            capacity: Sampling steps kept in the ring buffer (the statistics' window).
                (default: ``32``)
            max_elements: Gradient elements sampled per block (a fixed random subset).
                (default: ``4096``)
            instrument_share: Share of the user's AdamW state (or 256 KiB if more) the
                sampler's ring and the risk model's shadow may hold, outside the budget:
                above it max_elements and the shadow shrink, to 32 sampled elements per
                block and one 1024-element super-block per tensor at least. (default: ``0.05``)
            min_8bit_numel: Tensors with fewer elements stay out of the 8-bit formats
                (as bitsandbytes), in an optimizer BAOC converts; a blockwise optimizer keeps
                its own, and another value here is refused. (default: ``4096``)
            calibration: 'auto': measure each format's step cost on the device once
                (cached); 'prior': built-in relative costs (a time budget must then be
                relative). (default: ``'auto'``)
            calibration_cache_dir: Cache directory of 'auto'. null: the user cache
                directory. (default: ``None``)
            report: Print the allocation table and write baoc_allocation.json / .png
                into the log directory. true: the PNG when matplotlib is installed (else
                a warning); 'json': no PNG; 'png': the PNG required (refused at start
                without matplotlib); false: no report. (default: ``True``)
            seed: Seed of the gradient sampling and of stochastic rounding. (default:
                ``0``)
            max_block_risk: Cap on the risk of one block: a format whose risk on a block
                exceeds it is never chosen for that block (risks are share-weighted: the
                block risks add up to the total risk). Lifted, with a warning, when the
                memory budget cannot be met otherwise. null: no cap. (default: ``None``)
            initial: The allocation the warm-up starts in: a previous run's
                baoc_allocation.json (its measured risks replace the prior) or a mapping
                block -> format (kept wherever the budgets allow). With corrections, a
                block names an option, 'int8+ecc8' (or 'int8': no correction). null: the
                allocation of least prior risk within the budgets. (default: ``None``)
        """
        super().__init__()
        self.config, own = split_settings(settings_of(locals()))
        # optional dependencies are checked now, not after a whole warm-up
        self.reporter = AllocationReporter(own["report"], "BAOC")
        self.controller = BAOCController(self.config)
        self._step_at_batch_start = -1
        self._at_boundary = True
        self._warned_missing_monitor = False
        self._warned_short_run = False
        self._meter = MemoryMeter()  # the run's measured memory, printed beside the planned peak at fit end
        self._restored_early = False
        self._resumed = False  # this fit resumed from a checkpoint (said once its state is restored)
        self._unwrap: Any = None
        self._deepspeed = False  # under DeepSpeedStrategy: the optimizer is DeepSpeed's client (setup decides)

    # ------------------------------------------------------------------ public

    @classmethod
    def from_config(cls, config: Any, overrides: Sequence[str] = ()) -> BAOC:
        """A BAOC callback from a config: a YAML file, its ``baoc`` section, or a loaded config.

        Args:
            config: a path to a YAML template (``configs/vision.yaml``), a
                :class:`~lightning_baoc.config.files.Config` or
                :class:`~lightning_baoc.config.files.BAOCSection`, or a mapping / OmegaConf
                ``DictConfig`` holding either a whole config (with a ``baoc`` key) or the
                ``baoc`` section alone.
            overrides: OmegaConf dotlist overrides, applied to a file only
                (``["baoc.memory_budget=0.25"]``) (default: none).

        Raises:
            ConfigError: an unknown key or a bad value; the message names the key and the source.

        Example:
            >>> baoc = BAOC.from_config("configs/vision.yaml", ["baoc.memory_budget=0.25"])  # doctest: +SKIP
            >>> baoc.config.memory_budget  # doctest: +SKIP
            0.25
        """
        if isinstance(config, (str, os.PathLike)):
            config = load_config(config, overrides)
        elif overrides:
            raise TypeError(
                f"BAOC.from_config(overrides={list(overrides)!r}) applies to a config file; pass a path, "
                f"or apply the overrides to the config before"
            )
        return cls(**baoc_kwargs(config))

    @property
    @override
    def state_key(self) -> str:
        # Structural arguments only: a budget changed between runs must not orphan the state (a
        # changed partition is found by on_load_checkpoint).
        return self._generate_state_key(granularity=self.config.granularity, blocks=self.config.blocks)

    @property
    def optimizer(self) -> BlockwiseAdamW | None:
        """The installed optimizer (``None`` before ``fit``)."""
        return self.controller.optimizer

    @property
    def allocation(self) -> dict[str, str]:
        """Block -> format in force (empty during warm-up)."""
        return dict(self.controller.allocation)

    @property
    def phase(self) -> str:
        """``"warmup"`` or ``"allocated"``."""
        return self.controller.phase

    def summary(self) -> BAOCSummary:
        """What BAOC saved, now: the optimizer state against the user's own optimizer's, the fraction, the
        formats and the master-weight corrections per block, the budget and the peaks
        (:class:`~lightning_baoc.BAOCSummary`). The same figures go to the loggers at each allocation
        (``baoc/state_bytes``, ``baoc/state_fraction``, ...) and into ``baoc_allocation.json``.

        Raises:
            RuntimeError: before ``trainer.fit`` installed the optimizer (nothing to summarize yet).

        Example:
            >>> trainer.fit(model)  # doctest: +SKIP
            >>> s = baoc.summary()  # doctest: +SKIP
            >>> print(f"{s.state_bytes:,} of {s.baseline_state_bytes:,} bytes ({s.state_fraction:.3f})")  # doctest: +SKIP
            206,064 of 688,208 bytes (0.299)
        """
        if not self.controller.installed:
            raise RuntimeError(
                "BAOC.summary() has nothing to summarize yet: trainer.fit installs the optimizer at fit start. "
                "Call it during or after trainer.fit(...)."
            )
        return self.controller.summary(self._measured_growth())

    def set_budget(self, memory_budget: int | float | str | None = None, time_budget: float | str | None = None) -> None:
        """Change a budget mid-training (on every rank); the next step boundary re-evaluates.

        Example:
            >>> baoc.set_budget(memory_budget=0.25)  # e.g. from a LightningModule hook  # doctest: +SKIP
        """
        self.controller.set_budget(memory_budget, time_budget)

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        why = _refused_strategy(trainer.strategy)
        if why is not None:
            raise RuntimeError(why)
        others = [cb for cb in trainer.callbacks if isinstance(cb, BAOC) and cb is not self]
        if others:
            raise RuntimeError(
                f"Trainer(callbacks=...) holds {len(others) + 1} BAOC callbacks; one optimizer has one "
                f"allocation: keep a single BAOC"
            )
        from lightning.pytorch.strategies import DeepSpeedStrategy

        self._deepspeed = isinstance(trainer.strategy, DeepSpeedStrategy)
        if self._deepspeed:  # DeepSpeed builds its engine in the strategy's setup, over this optimizer
            try:
                import deepspeed
            except ImportError as err:
                raise ModuleNotFoundError(
                    f"BAOC under {type(trainer.strategy).__name__} needs DeepSpeed: pip install 'lightning_baoc[deepspeed]'"
                ) from err
            check_deepspeed_version(deepspeed.__version__)
            check_offload(trainer.strategy.config or {})
            self._unwrap = wrap_configure_optimizers(pl_module, self.config.min_8bit_numel, self.config.seed)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        optimizers = trainer.strategy.optimizers
        if len(optimizers) != 1:
            raise RuntimeError(
                f"BAOC manages exactly one optimizer; configure_optimizers returned {len(optimizers)}. "
                f"Return a single torch.optim.AdamW/Adam (several param groups are fine)."
            )
        if self._deepspeed:
            self._install_deepspeed(trainer, pl_module)
            return
        self._restore_before_load(trainer)
        self._meter.start(pl_module.device)  # before install: the corrections and instruments it allocates count
        old = optimizers[0]
        new = self.controller.install(old, pl_module)
        if new is not old:
            trainer.strategy.optimizers = [new]  # also rebuilds strategy._lightning_optimizers
            for config in trainer.lr_scheduler_configs:
                rebind_scheduler(config.scheduler, new)
        self.controller.check_feasible(trainer.strategy.broadcast, trainer.is_global_zero)
        if not pl_module.automatic_optimization:
            rank_zero_info(
                "BAOC: manual optimization: fetch the optimizer with self.optimizers() in training_step "
                "(it is a BlockwiseAdamW now); gradients are sampled when optimizer.step() runs"
            )
        # no summary here: the states exist after the first step (a resume's are loaded after this hook)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resumed = trainer.ckpt_path is not None
        if self._resumed:  # the optimizer's state is restored by now
            rank_zero_info(self.controller.resumed_line())
        if self.controller.phase != "warmup":
            return
        try:
            total = trainer.estimated_stepping_batches
        except Exception:  # noqa: BLE001 - an estimate only; unknown lengths just skip the warning
            return
        if math.isfinite(total) and total < self.config.warmup_steps:
            self._warned_short_run = True
            rank_zero_warn(
                f"BAOC(warmup_steps={self.config.warmup_steps}) is longer than this run "
                f"({int(total)} optimizer steps): warm-up will not end, and the states stay in the start "
                f"allocation (chosen from the prior risk, not from measured statistics). Lower warmup_steps "
                f"to allocate from this run's statistics."
            )

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        if self._deepspeed:  # observed inside DeepSpeed's step, where it hands the client the gradients
            self.controller.open_released_step(trainer.global_step)
            return
        optimizer = self.controller.optimizer
        if optimizer is not None and optimizer.releases_gradients:
            # Gradient release steps each parameter during backward: what runs before the step runs
            # now, and the gradients are observed inside the release hooks (GradientRelease).
            event = self.controller.before_step(trainer.global_step, trainer.strategy.broadcast, trainer.is_global_zero)
            if event is not None:
                self._report(trainer, event)
            self.controller.open_released_step(trainer.global_step)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Before the step: new parameters would otherwise take fp32 state outside the budget, and
        # a format dropped from the menu at resume must not run a single step.
        if self._deepspeed:  # the gradients are observed inside DeepSpeed's step, which comes after this hook
            event = self.controller.before_step(trainer.global_step, trainer.strategy.broadcast, trainer.is_global_zero)
            if event is not None:
                self._report(trainer, event)
            return
        if self.controller.release_open:  # gradient release: observed in backward, completed here
            self.controller.close_released_step()
            return
        event = self.controller.before_step(trainer.global_step, trainer.strategy.broadcast, trainer.is_global_zero)
        if event is not None:
            self._report(trainer, event)
        # Gradients here are final for the step: accumulated, all-reduced, unscaled, not clipped.
        self.controller.observe(trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._at_boundary = trainer.global_step != self._step_at_batch_start
        if self._deepspeed and self._at_boundary and self.controller.release_open:
            self.controller.close_released_step()  # DeepSpeed's step has run: its gradients were observed
        self._meter.sample()
        if self._at_boundary and not self._resumed and trainer.global_step == 1:  # the run's first step: its states exist
            rank_zero_info(self.controller.summary_line())
        if self._at_boundary:
            self._maybe_allocate(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.state.fn == "fit":
            return
        monitor = self.config.monitor
        if monitor is not None:
            value: float | None = None
            metric = trainer.callback_metrics.get(monitor)
            if metric is not None:
                value = float(metric.item() if isinstance(metric, torch.Tensor) else metric)
            elif not self._warned_missing_monitor:
                self._warned_missing_monitor = True
                rank_zero_warn(
                    f"BAOC(monitor={monitor!r}) found no such metric after validation; logged metrics: "
                    f"{sorted(trainer.callback_metrics)[:10]}. Log it with self.log({monitor!r}, ...) "
                    f"or fix monitor; plateau re-evaluation is off until it appears."
                )
            value = trainer.strategy.broadcast(value)  # every rank counts rank zero's value
            self.controller.validation_end(value)
        if self._at_boundary:
            self._maybe_allocate(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.controller.epoch_end(trainer.current_epoch)
        if self._at_boundary:
            self._maybe_allocate(trainer)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.controller.phase == "warmup" and self.controller.installed and not self._warned_short_run:
            rank_zero_warn(
                f"BAOC: training ended after {trainer.global_step} optimizer steps, before warm-up ended "
                f"(warmup_steps={self.config.warmup_steps}); the optimizer states stayed fp32."
            )
        if self.report and self.controller.installed:
            rank_zero_info(self.memory_line())
        self.controller.close()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.controller.close()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.controller.close()
        if self._unwrap is not None:
            self._unwrap, unwrap = None, self._unwrap
            unwrap()

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # The state key holds the partition settings: resumed with another granularity or other
        # blocks patterns, Lightning would not find the state and the run would silently warm up
        # again over compact states. Take the one BAOC state under its old key; the controller
        # then maps the saved allocation onto the new blocks and re-evaluates, or refuses.
        states = checkpoint.get("callbacks") or {}
        if self.state_key in states:
            return
        found = self._other_keys(states)
        if len(found) == 1:
            self.load_state_dict(states[found[0]])

    def _other_keys(self, states: Mapping[str, Any]) -> list[str]:
        """The keys of BAOC states saved under another state key (other partition settings)."""
        return [k for k in states if isinstance(k, str) and k.startswith(type(self).__qualname__ + "{")]

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._restored_early:  # restored from the same checkpoint in on_fit_start already
            self._restored_early = False
            return
        self.controller.load_state_dict(state_dict)

    def _restore_before_load(self, trainer: Trainer) -> None:
        """Under a strategy that loads the checkpoint after ``on_fit_start`` (``ModelParallelStrategy``:
        model and optimizer through ``torch.distributed.checkpoint``, into the optimizer this hook
        installs), this callback's state must be restored before the optimizer's: the load fills a
        template built from the optimizer's formats, so the optimizer must hold the saved ones by then.
        Lightning has no hook between the two, so the strategy's ``load_checkpoint`` is wrapped (on
        this instance, until teardown) to restore the saved allocation from the checkpoint's
        metadata first; Lightning hands the same state to :meth:`load_state_dict` afterwards, which
        then has nothing left to do."""
        strategy = trainer.strategy
        if not strategy.restore_checkpoint_after_setup or "load_checkpoint" in vars(strategy):
            return
        original = strategy.load_checkpoint

        def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            self._restore_from_metadata(Path(checkpoint_path), type(strategy).__name__, strategy.optimizers)
            return original(checkpoint_path, *args, **kwargs)

        strategy.load_checkpoint = load_checkpoint  # type: ignore[method-assign]
        self._unwrap = lambda: vars(strategy).pop("load_checkpoint", None)

    def _restore_from_metadata(self, path: Path, strategy: str, optimizers: list[Any]) -> None:
        self._restored_early = False
        states = distributed_metadata(path, f"BAOC under {strategy}").get("callbacks") or {}
        found = [self.state_key] if self.state_key in states else self._other_keys(states)
        if len(found) != 1:
            raise RuntimeError(
                f"BAOC cannot resume {str(path)!r} under {strategy}: the checkpoint holds {len(found)} BAOC states "
                f"(saved without BAOC, or with several), and this strategy loads the optimizer's sharded state into "
                f"the formats BAOC's state names. Resume it as it was saved (without BAOC), or start a BAOC run from "
                f"its weights alone (load them in configure_model, without ckpt_path)."
            )
        check_saved_shards(path, optimizers, f"BAOC under {strategy}")
        self.controller.load_state_dict(states[found[0]])
        self._restored_early = True  # Lightning hands the same state to load_state_dict later

    # ------------------------------------------------------------------ internals

    def _install_deepspeed(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Install over DeepSpeed's client: the controller manages its fragments (the optimizer and its
        schedulers stay DeepSpeed's and Lightning's as they are)."""
        client = zero_client_of(trainer.strategy.deepspeed_engine)
        self._meter.start(pl_module.device)
        self.controller.install(client.inner, fragment_module(pl_module, client))
        self.controller.check_feasible(trainer.strategy.broadcast, trainer.is_global_zero)

    def _maybe_allocate(self, trainer: Trainer) -> AllocationEvent | None:
        event = self.controller.maybe_allocate(trainer.global_step, trainer.strategy.broadcast, trainer.is_global_zero)
        if event is not None:
            self._report(trainer, event)
        return event

    def _report(self, trainer: Trainer, event: AllocationEvent) -> None:
        # trainer.log_dir broadcasts: every rank must ask for it.
        directory = trainer.log_dir if self.reporter.enabled else None
        self.reporter(event, self.controller.history, directory, trainer.is_global_zero, trainer.loggers, rank_zero_info,
                      measured_peak_growth_bytes=self._measured_growth())

    def _measured_growth(self) -> int | None:
        measured = self._meter.measured()
        return None if measured is None else measured.growth

    def memory_line(self) -> str:
        """The planned peak beyond the weights and what was measured since fit start (printed at fit end
        when ``report`` is on; :mod:`lightning_baoc.report.memory`)."""
        return self._meter.line(self.controller.planned_peak())

    def measured_memory(self) -> MeasuredPeak | None:
        """What the run's memory measured since fit start (``None`` before it)."""
        return self._meter.measured()

    @property
    def report(self) -> bool:
        """Whether allocation reports are written."""
        return self.reporter.enabled

    @property
    def report_png(self) -> bool:
        """Whether the reports draw the PNG (decided at construction)."""
        return self.reporter.png

    @property
    def last_record(self) -> dict[str, Any] | None:
        """The JSON record of the last allocation (``None`` before the first)."""
        return self.reporter.last_record


__all__ = ["BAOC"]
