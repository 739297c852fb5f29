"""GradientRelease: the Lightning callback that turns on gradient release for a BlockwiseAdamW
(or BlockwiseSGD, BlockwiseLion).

Gradient release (:mod:`lightning_baoc.optim.gradient_release`) steps each parameter during backward and
frees its gradient at once. Lightning runs the closure (forward, backward) inside
``optimizer.step``, so the hooks step the parameters while backward runs and the ``step`` that
follows opens the next window. What release cannot do, the callback refuses at ``setup``, before
training, with the setting to change:

- ``gradient_clip_val``, or clipping in an overridden ``configure_gradient_clipping``: global-norm
  clipping needs all the gradients before any step;
- accumulation, set by ``accumulate_grad_batches > 1`` or a ``GradientAccumulationScheduler`` whose
  schedule accumulates in any epoch: every micro-batch would step on its own;
- a gradient scaler (``precision="16-mixed"``): the hooks would step on scaled gradients;
- an optimizer that is not a :class:`~lightning_baoc.BlockwiseAdamW`, or manual optimization.

Example::

    model.configure_optimizers = lambda: BlockwiseAdamW(model.named_parameters(), state_format="int8",
                                                        weight_correction="ecc8")
    Trainer(precision="bf16-true", callbacks=[GradientRelease()]).fit(model)
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_baoc.optim import BlockwiseOptimizer


class GradientRelease(pl.Callback):
    """Step every parameter in backward and free its gradient (see the module docstring)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        problems = []
        if trainer.accumulate_grad_batches != 1:
            problems.append(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches}: release steps every "
                f"micro-batch on its own; set accumulate_grad_batches=1"
            )
        for callback in trainer.callbacks:
            if isinstance(callback, GradientAccumulationScheduler) and any(
                factor != 1 for factor in callback.scheduling.values()
            ):
                problems.append(
                    f"GradientAccumulationScheduler(scheduling={callback.scheduling}): release steps every "
                    f"micro-batch on its own; remove the scheduler (or schedule 1 in every epoch)"
                )
        if is_overridden("configure_gradient_clipping", pl_module, pl.LightningModule):
            problems.append(
                f"{type(pl_module).__name__}.configure_gradient_clipping overridden: clipping runs after every "
                f"gradient is in, and release has stepped each parameter and freed its gradient in backward; "
                f"remove the override (clip per parameter in a release observer, or train without release)"
            )
        if trainer.gradient_clip_val:
            problems.append(
                f"gradient_clip_val={trainer.gradient_clip_val}: clipping needs every gradient before any "
                f"step, and release has freed them; remove gradient_clip_val"
            )
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            problems.append(
                f"precision={trainer.precision!r} with a gradient scaler: release would step on the scaled "
                f"gradients before the scaler unscales and checks them; use precision='bf16-true' or "
                f"'bf16-mixed' (no scaler)"
            )
        if not pl_module.automatic_optimization:
            problems.append("manual optimization: call optimizer.release_gradients() yourself and step() once per iteration")
        if problems:
            raise ValueError("GradientRelease cannot run with " + "; ".join(problems) + ".")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_train_start: after every callback's on_fit_start, so after BAOC has installed its optimizer
        for optimizer in trainer.optimizers:
            if not isinstance(optimizer, BlockwiseOptimizer):
                raise TypeError(
                    f"GradientRelease needs configure_optimizers to return a lightning_baoc.BlockwiseAdamW "
                    f"(or BlockwiseSGD, BlockwiseLion), got {type(optimizer).__name__}: build "
                    f"BlockwiseAdamW(model.named_parameters(), ...) instead"
                )
            optimizer.release_gradients()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            if isinstance(optimizer, BlockwiseOptimizer):
                optimizer.release_gradients(False)

    def state_dict(self) -> dict[str, Any]:
        return {}


__all__ = ["GradientRelease"]
