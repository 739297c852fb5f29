"""BAOCStrategy: the BAOC lifecycle in a Lightning Fabric training loop.

Fabric has no loop of its own to hook into, but every optimizer step of a Fabric loop goes
through ``strategy.optimizer_step`` and every model/optimizer pair through
``strategy.setup_module_and_optimizers`` (``fabric.setup``) or ``strategy.setup_optimizer``
(``fabric.setup_optimizers``). A strategy therefore sees exactly the two moments the lifecycle
needs, without any change to the user's loop:

- at set-up it installs the :class:`~lightning_baoc.BlockwiseAdamW` in place of the user's
  AdamW/Adam (the object ``fabric.setup`` returns wraps the new optimizer) and checks the budgets;
- at each ``optimizer.step()`` it first takes parameters added since set-up into the allocation
  (``add_param_group``: allocated at once, within the budget) and runs a re-allocation due to
  settings changed at resume, so no step runs outside them; then it samples the gradients (final
  there: the user's loop has run every backward of the accumulation window, under DDP the last
  one synchronized them; an fp16 loss scale still applied is divided out), lets the step run,
  and then, between steps, allocates at warm-up end and runs pending re-evaluations.

Fabric branches on ``isinstance`` of its built-in strategies, so ``BAOCStrategy(...)`` returns an
instance of a subclass of both ``BAOCStrategy`` and the Fabric strategy it extends
(``SingleDeviceStrategy``, ``DDPStrategy`` with ``base="ddp"``, ``ModelParallelStrategy`` (FSDP2)
with ``base="model_parallel"``, ``DeepSpeedStrategy`` with ``base="deepspeed"``). Under DeepSpeed,
``fabric.setup`` builds DeepSpeed's engine over BAOC's ZeRO client
(:mod:`lightning_baoc.integrations.deepspeed`): each rank holds the states of its fragments of
DeepSpeed's flat partitions, the gradients are observed inside DeepSpeed's step, and ``fabric.save``/
``fabric.load`` go through DeepSpeed's checkpoints (the controller's state in its client state).

Epochs and validation are the loop's own: call ``strategy.on_train_epoch_end(epoch)`` and
``strategy.on_validation_end(value)`` between optimizer steps (or register the strategy as a
Fabric callback, ``Fabric(strategy=s, callbacks=[s])``, and use ``fabric.call``; the strategy then
also finds ``fabric.loggers`` for its scalars). ``strategy.summary()`` returns the run's figures (a
:class:`~lightning_baoc.BAOCSummary`: state bytes against the baseline, formats, corrections, peaks). Checkpoints: put ``strategy.controller`` (the
:class:`~lightning_baoc.control.controller.BAOCController`, which has ``state_dict``/``load_state_dict``),
under a key of your choice, into the state given to ``fabric.save``/``fabric.load``.

Example:
    >>> strategy = BAOCStrategy(memory_budget=0.3, warmup_steps=100)  # doctest: +SKIP
    >>> fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)  # doctest: +SKIP
    >>> model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))  # doctest: +SKIP
    >>> ...  # the usual loop: fabric.backward(loss); optimizer.step()  # doctest: +SKIP
    >>> fabric.save("ckpt.pt", {"model": model, "optimizer": optimizer, "baoc": strategy.controller})  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning_baoc.integrations.logs import rank_zero_info  # BAOC's lines, once under Hydra too
from torch import nn
from torch.optim import Optimizer

from lightning_baoc.config.settings import FormatName, ReportSetting, settings_of, split_settings
from lightning_baoc.control.controller import AllocationEvent, BAOCController, rebind_scheduler
from lightning_baoc.control.summary import BAOCSummary
from lightning_baoc.integrations.checkpoints import check_saved_shards, distributed_metadata
from lightning_baoc.integrations.deepspeed import check_offload, client_of, fragment_module, zero_client_of
from lightning_baoc.optim.deepspeed import check_deepspeed_version
from lightning_baoc.report.allocation import AllocationReporter
from lightning_baoc.report.memory import MemoryMeter

_BASES = ("single_device", "ddp", "model_parallel", "deepspeed")


class BAOCStrategy:
    """A Fabric strategy that runs the BAOC lifecycle (see the module docstring).

    The arguments are ``memory_budget`` and, keyword-only, the other settings of
    :data:`lightning_baoc.config.settings.SETTINGS` (as :class:`~lightning_baoc.BAOC`'s; ``report`` prints
    the table and, with ``report_dir``, writes the files), then the strategy's own (``base``,
    ``report_dir``, ``strategy_kwargs``, ``risk_fn``): see ``__init__``.

    Attributes:
        controller: the :class:`~lightning_baoc.control.controller.BAOCController` (checkpoint it) (the
            name :class:`~lightning_baoc.BAOC` gives it too).
        last_record: the JSON record of the last allocation (``None`` before the first).
        last_metrics: its logger scalars (``{}`` before the first).

    Example:
        >>> s = BAOCStrategy(memory_budget=0.3, warmup_steps=40)
        >>> from lightning.fabric.strategies import SingleDeviceStrategy
        >>> isinstance(s, SingleDeviceStrategy), s.controller.config.warmup_steps
        (True, 40)
    """

    def __new__(cls, *args: Any, base: str = "single_device", **kwargs: Any) -> BAOCStrategy:
        if cls is not BAOCStrategy:  # a concrete class (or unpickling): build it as is
            return super().__new__(cls)
        if base not in _BASES:
            raise ValueError(f"Invalid base={base!r}; allowed: {list(_BASES)} (the Fabric strategy BAOC extends)")
        target = {"single_device": _BAOCSingleDeviceStrategy, "ddp": _BAOCDDPStrategy,
                  "model_parallel": _BAOCModelParallelStrategy, "deepspeed": _BAOCDeepSpeedStrategy}[base]
        return super().__new__(target)

    def __init__(
        self,
        memory_budget: Union[int, float, str],
        *,
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
        base: Literal["single_device", "ddp", "model_parallel", "deepspeed"] = "single_device",
        report_dir: str | os.PathLike[str] | None = None,
        strategy_kwargs: dict[str, Any] | None = None,
        risk_fn: Callable[..., Any] | None = None,
    ) -> None:
        """Build the strategy; every setting is checked here (a bad one raises :class:`~lightning_baoc.SettingError`
        naming it).

        The settings, ``memory_budget`` to ``initial``, are :class:`~lightning_baoc.BAOC`'s, with the same types,
        defaults and meaning (``help(BAOC.__init__)`` describes each); here every one after ``memory_budget`` is
        keyword-only. Then the strategy's own:

        Args:
            base: the Fabric strategy extended: ``"single_device"``, ``"ddp"``, ``"model_parallel"``
                (``ModelParallelStrategy``: FSDP2, its ``parallelize_fn`` in ``strategy_kwargs``) or
                ``"deepspeed"`` (``DeepSpeedStrategy``, ZeRO 1-3: ``strategy_kwargs={"stage": 3}``; needs the
                ``deepspeed`` extra) (default: ``"single_device"``).
            report_dir: directory for ``baoc_allocation.json``/``.png`` (default: ``None``: the table is
                printed, no files are written).
            strategy_kwargs: arguments of the base strategy, e.g. ``{"device": "cuda:0"}`` (default: ``None``).
            risk_fn: a risk model replacing :func:`lightning_baoc.risk.risk_table` (default: ``None``).
        """
        config, own = split_settings(settings_of(locals()))
        self.controller = BAOCController(config, risk_fn)
        self.report_dir = None if report_dir is None else os.fspath(report_dir)
        self.reporter = AllocationReporter(own["report"], "BAOCStrategy")  # optional dependencies: checked now
        self._baoc_module: nn.Module | None = None
        self._baoc_replaced: weakref.ReferenceType[Optimizer] | None = None
        self._baoc_loggers: list[Any] = []
        self._baoc_meter = MemoryMeter()  # the run's memory measured from set-up, for summary() and the reports
        super().__init__(**(strategy_kwargs or {}))  # the Fabric strategy next in the MRO

    # ------------------------------------------------------------------ set-up

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None) -> Any:
        """Install BAOC on the optimizer, then let the base strategy set both up."""
        self._baoc_module = module
        optimizers = [self._baoc_install(optimizers, scheduler)]
        return super().setup_module_and_optimizers(module, optimizers, scheduler)  # type: ignore[misc]

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Remember the (unwrapped) module, for ``fabric.setup_optimizers`` later."""
        if self._baoc_module is None:
            self._baoc_module = module
        return super().setup_module(module)  # type: ignore[misc]

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers`` path: install on the module set up before."""
        if not self.controller.installed or optimizer is not self.controller.optimizer:
            if self._baoc_module is None:
                raise RuntimeError(
                    "BAOCStrategy: set the model up before its optimizer (fabric.setup(model, optimizer) "
                    "or fabric.setup_module(model) then fabric.setup_optimizers(optimizer))"
                )
            optimizer = self._baoc_install([optimizer], None)
        return super().setup_optimizer(optimizer)  # type: ignore[misc]

    def _baoc_install(self, optimizers: list[Optimizer], scheduler: Any) -> Optimizer:
        if len(optimizers) != 1:
            raise ValueError(
                f"BAOCStrategy manages exactly one optimizer; got {len(optimizers)}. Set up a single "
                f"torch.optim.AdamW/Adam (several param groups are fine)."
            )
        old = optimizers[0]
        if self.controller.installed and old is self.controller.optimizer:
            return old
        assert self._baoc_module is not None
        self._baoc_meter.start(self.root_device)  # type: ignore[attr-defined]  # before install: what it allocates counts
        new = self.controller.install(old, self._baoc_module)
        if new is not old:
            if scheduler is not None:
                rebind_scheduler(scheduler, new)
            # A scheduler built on the old optimizer and not passed to fabric.setup still drives
            # the learning rate: both optimizers now share the same param-group dicts.
            old.param_groups = new.param_groups
            self._baoc_replaced = weakref.ref(old)
        self.controller.check_feasible(self.broadcast, self.is_global_zero)  # type: ignore[attr-defined]
        # no summary here: the states are created at the first step (0 B now), and a fabric.load that may
        # follow restores another phase; the first step says where the run starts, a load that it resumed
        return new

    # ------------------------------------------------------------------ the step

    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> Any:
        """With gradient release (``optimizer.release_gradients()``), open the step's observation
        before backward: each parameter then steps in backward, its gradient observed just before."""
        optimizer = self.controller.optimizer
        if optimizer is not None and optimizer.releases_gradients and not self.controller.release_open:
            if self._baoc_grad_scale(optimizer) is not None:
                raise RuntimeError(
                    "BAOCStrategy: gradient release with an fp16 loss scaler would step on scaled gradients; "
                    "use precision='bf16-true' or 'bf16-mixed', or turn release off"
                )
            self._baoc_before_step()
            self.controller.open_released_step(self.controller.steps)
        return super().backward(tensor, module, *args, **kwargs)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Take in new parameters (re-allocating before the step if due), sample the gradients,
        step, then allocate if due (between steps). Under gradient release the first two ran
        before backward (:meth:`backward`); the observation is completed here."""
        if self.controller.release_open:
            self.controller.close_released_step()
        else:
            self._baoc_before_step()
            if "closure" not in kwargs:  # with a closure the gradients do not exist yet
                self.controller.observe(self.controller.steps, grad_scale=self._baoc_grad_scale(optimizer))
        output = super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
        self._baoc_after_step()
        return output

    def _baoc_before_step(self) -> None:
        """What is due before a step: parameters added since set-up, a re-allocation due to changed settings."""
        event = self.controller.before_step(self.controller.steps, self.broadcast, self.is_global_zero)  # type: ignore[attr-defined]
        if event is not None:
            self._baoc_report(event)

    def _baoc_after_step(self) -> None:
        """Count the step, say where the run starts after its first, allocate if due."""
        old = self._baoc_replaced() if self._baoc_replaced is not None else None
        if old is not None:
            old._opt_called = True  # type: ignore[attr-defined]  # for a scheduler left on it
        self.controller.step_completed()
        self._baoc_meter.sample()
        if self.controller.steps == 1:  # the run's first step (a resumed run counts on): its states exist now
            rank_zero_info(self.controller.summary_line())
        self._baoc_maybe_allocate()

    def _baoc_grad_scale(self, optimizer: Any) -> float | None:
        """The fp16 loss scale the gradients still carry (``None`` if unscaled or no scaler)."""
        scaler = getattr(self.precision, "scaler", None)  # type: ignore[attr-defined]
        if scaler is None or not scaler.is_enabled():
            return None
        try:
            from torch.amp.grad_scaler import OptState

            state = scaler._per_optimizer_states.get(id(optimizer))
            if state is not None and state.get("stage") is OptState.UNSCALED:
                return None  # fabric.clip_gradients unscaled them already
        except (ImportError, AttributeError):  # pragma: no cover - torch internals moved
            pass
        scale = float(scaler.get_scale())
        return scale if math.isfinite(scale) and scale > 0 else None

    def _baoc_maybe_allocate(self) -> AllocationEvent | None:
        event = self.controller.maybe_allocate(self.controller.steps, self.broadcast, self.is_global_zero)  # type: ignore[attr-defined]
        if event is not None:
            self._baoc_report(event)
        return event

    def _baoc_report(self, event: AllocationEvent) -> None:
        is_zero = bool(self.is_global_zero)  # type: ignore[attr-defined]
        self.reporter(event, self.controller.history, self.report_dir, is_zero, self._baoc_loggers, rank_zero_info,
                      measured_peak_growth_bytes=self._baoc_measured_growth())

    def _baoc_measured_growth(self) -> int | None:
        measured = self._baoc_meter.measured()
        return None if measured is None else measured.growth

    def summary(self) -> BAOCSummary:
        """What BAOC saved, now (:class:`~lightning_baoc.BAOCSummary`, as :meth:`BAOC.summary
        <lightning_baoc.BAOC.summary>`); the measured peak is the device's since ``fabric.setup``.

        Raises:
            RuntimeError: before ``fabric.setup`` installed the optimizer (nothing to summarize yet).

        Example:
            >>> s = strategy.summary()  # doctest: +SKIP
            >>> f"{s.state_bytes:,} of {s.baseline_state_bytes:,} bytes"  # the loop of tests/integrations/test_fabric.py  # doctest: +SKIP
            '63,584 of 213,072 bytes'
        """
        if not self.controller.installed:
            raise RuntimeError(
                "BAOCStrategy.summary() has nothing to summarize yet: fabric.setup(model, optimizer) installs the "
                "optimizer. Call it after fabric.setup."
            )
        return self.controller.summary(self._baoc_measured_growth())

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

    @property
    def last_metrics(self) -> dict[str, float]:
        """Its logger scalars (``{}`` before the first)."""
        return self.reporter.last_metrics

    # ------------------------------------------------------------------ triggers (call between steps)

    def on_train_epoch_end(self, epoch: int, **_: Any) -> None:
        """Count an epoch for ``reevaluate_every_n_epochs``; re-evaluates at once if due."""
        self.controller.epoch_end(int(epoch))
        self._baoc_maybe_allocate()

    def on_validation_end(self, value: float | torch.Tensor | None = None, **_: Any) -> None:
        """Report the monitored metric (rank zero's counts); re-evaluates at once on a plateau."""
        if isinstance(value, torch.Tensor):
            value = float(value.item())
        value = self.broadcast(value)  # type: ignore[attr-defined]
        self.controller.validation_end(value)
        self._baoc_maybe_allocate()

    def set_budget(self, memory_budget: int | float | str | None = None, time_budget: float | str | None = None) -> None:
        """Change a budget mid-training (on every rank); the next step re-evaluates against it."""
        self.controller.set_budget(memory_budget, time_budget)

    def on_after_setup(self, fabric: Any, module: Any = None, **_: Any) -> None:
        """Fabric callback hook (when the strategy is also a callback): pick up ``fabric.loggers``."""
        self._baoc_loggers = list(getattr(fabric, "loggers", []))

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> Any:
        """``fabric.load``: the base strategy's, then, where the state held the controller, one line that
        says the run resumed, at which step, in which phase and allocation, with the state restored."""
        resumed = isinstance(state, dict) and any(v is self.controller for v in state.values())
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)  # type: ignore[misc]
        if resumed:
            rank_zero_info(self.controller.resumed_line())
        return remainder

    def teardown(self) -> None:
        """Stop the sampler's worker, then the base strategy's teardown."""
        self.controller.close()
        super().teardown()  # type: ignore[misc]


class _BAOCDeepSpeedStrategy(BAOCStrategy, DeepSpeedStrategy):
    """BAOCStrategy under DeepSpeed ZeRO (``DeepSpeedStrategy``): ``fabric.setup`` hands DeepSpeed a ZeRO client
    over a fp32 :class:`~lightning_baoc.BlockwiseAdamW` (the user's groups and hyperparameters), the controller
    manages the client's fragments; each step observes the gradients DeepSpeed hands the client, then
    allocates if due."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            import deepspeed
        except ImportError as err:
            raise ModuleNotFoundError("BAOCStrategy(base='deepspeed') needs DeepSpeed: pip install 'lightning_baoc[deepspeed]'") from err
        check_deepspeed_version(deepspeed.__version__)
        super().__init__(*args, **kwargs)
        check_offload(self.config or {})

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None) -> Any:
        """DeepSpeed's engine over the client of the one optimizer, then the controller over the client's fragments."""
        if len(optimizers) != 1:
            raise ValueError(
                f"BAOCStrategy manages exactly one optimizer; got {len(optimizers)}. Set up a single "
                f"torch.optim.AdamW/Adam (several param groups are fine).")
        old, config = optimizers[0], self.controller.config
        client = client_of(old, module, config.min_8bit_numel, config.seed)
        if scheduler is not None:
            rebind_scheduler(scheduler, client)
        engine, wrapped, scheduler = DeepSpeedStrategy.setup_module_and_optimizers(self, module, [client], scheduler)
        client = zero_client_of(engine)
        if client is not old:  # a scheduler left on the user's optimizer drives the client's groups
            old.param_groups = client.param_groups
        self._baoc_module = module
        self._baoc_meter.start(self.root_device)
        self.controller.install(client.inner, fragment_module(module, client))
        self.controller.check_feasible(self.broadcast, self.is_global_zero)
        return engine, wrapped, scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """DeepSpeed's refusal (it sets the optimizer up only with its module, in ``fabric.setup``)."""
        return DeepSpeedStrategy.setup_optimizer(self, optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """What is due before the step, DeepSpeed's step with its gradients observed (DeepSpeed hands them to
        the client inside it), then an allocation if due. Fabric steps DeepSpeed's ZeRO optimizer at every
        ``optimizer.step()`` (not the engine, whose ``gradient_accumulation_steps`` it leaves at 1)."""
        self._baoc_before_step()
        self.controller.open_released_step(self.controller.steps)
        output = DeepSpeedStrategy.optimizer_step(self, optimizer, **kwargs)
        self.controller.close_released_step()  # (not after a failed step: closing sums the sample over the ranks)
        self._baoc_after_step()
        return output


class _BAOCSingleDeviceStrategy(BAOCStrategy, SingleDeviceStrategy):
    """BAOCStrategy on one device (``SingleDeviceStrategy``)."""


class _BAOCDDPStrategy(BAOCStrategy, DDPStrategy):
    """BAOCStrategy under DDP (``DDPStrategy``): rank zero decides, the allocation is broadcast."""


class _BAOCModelParallelStrategy(BAOCStrategy, ModelParallelStrategy):
    """BAOCStrategy under FSDP2 (``ModelParallelStrategy``): each rank holds its shards' states.

    ``fabric.load`` of a distributed checkpoint fills a template built from the optimizer's formats,
    and restores the rest of the state (the controller's) only afterwards, as a plain dict: the
    controller put in the state is restored here first, from the checkpoint's metadata, so the
    optimizer holds the saved formats when its state is read, and it stays in the user's state."""

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> Any:
        keys = [k for k, v in state.items() if v is self.controller] if isinstance(state, dict) else []
        if keys:
            path = self.broadcast(path)
            saved = distributed_metadata(path, "BAOCStrategy")
            if keys[0] not in saved:
                raise KeyError(f"the checkpoint {str(path)!r} holds no {keys[0]!r} (the BAOC controller's state)")
            check_saved_shards(path, [v for v in state.values() if isinstance(v, torch.optim.Optimizer)], "BAOCStrategy")
            self.controller.load_state_dict(saved[keys[0]])
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)  # type: ignore[misc]
        for k in keys:
            state[k] = self.controller  # the base strategy put the saved dict in its place
        return remainder


__all__ = ["BAOCStrategy"]
