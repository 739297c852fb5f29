"""The observation of gradients under gradient release.

With gradient release (``BlockwiseAdamW.release_gradients()``) each parameter steps inside its
post-accumulate-grad hook during backward and its gradient is freed at once, so nothing is left for
:meth:`~lightning_baoc.control.controller.BAOCController.observe` after backward. The adapters open the
step's observation before backward (:meth:`ReleasedGradientObserver.open`, through the controller's
``open_released_step``); the optimizer's gradient observer
(:meth:`BlockwiseAdamW.add_gradient_observer <lightning_baoc.BlockwiseAdamW.add_gradient_observer>`) feeds each gradient
to the sampler and takes its shadow-moment sample inside the hook, just before the parameter steps;
:meth:`ReleasedGradientObserver.close` completes the step (parameters that kept their gradient, the
shadow's samples applied with one synchronization). The numbers are those
:meth:`~lightning_baoc.control.controller.BAOCController.observe` would store
(``tests/integrations/test_callback_release.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lightning_baoc.control.instrumentation import Instrumentation
from lightning_baoc.optim import BlockwiseOptimizer


class OpenStep(NamedTuple):
    """A step whose released gradients are being observed."""

    step: int
    grad_scale: float | None
    sampling: bool  # whether the sampler began a sample at this step
    observed: set[str]  # the parameters observed so far (their gradients released)


class ReleasedGradientObserver:
    """Feeds the instruments with the gradients gradient release frees, inside the release hook.

    Args:
        instrumentation: the sampler and shadow moments fed, and their sampling schedule.

    Attributes:
        open_step: the step observed now (:class:`OpenStep`), or ``None`` between :meth:`close`
            and the next :meth:`open`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from lightning_baoc import BlockwiseAdamW
        >>> from lightning_baoc.config.settings import BAOCConfig
        >>> from lightning_baoc.control.blocks import Blocks
        >>> from lightning_baoc.control.tables import BlockTables
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)); opt = BlockwiseAdamW(model.parameters())
        >>> config = BAOCConfig(memory_budget=0.5, sample_every=1, calibration="prior")
        >>> blocks = Blocks(config); blocks.build(opt, model); tables = BlockTables(config, blocks); tables.refresh(opt)
        >>> inst = Instrumentation(config, blocks, tables); inst.restart_sampler(model); inst.restart_shadow(opt)
        >>> observer = ReleasedGradientObserver(inst); observer.watch(opt)
        >>> _ = opt.release_gradients()
        >>> observer.open(0, allocated=False)
        >>> model(torch.randn(4, 8)).sum().backward()  # each parameter steps in its hook
        >>> sorted(observer.open_step.observed), observer.close(), inst.ring_samples
        (['0', '1', '2', '3'], True, 1)
        >>> inst.close()
    """

    def __init__(self, instrumentation: Instrumentation) -> None:
        self.instrumentation = instrumentation
        self.open_step: OpenStep | None = None
        self._optimizer: BlockwiseOptimizer | None = None
        self._handle: Any = None  # the optimizer's gradient observer
        self._shadow_samples: list[Any] = []  # the shadow's samples of the released gradients

    @property
    def is_open(self) -> bool:
        """Whether a step's observation is open (:meth:`open`)."""
        return self.open_step is not None

    def watch(self, opt: BlockwiseOptimizer) -> None:
        """Observe the gradients ``opt`` releases (:meth:`BlockwiseAdamW.add_gradient_observer`),
        instead of those of an optimizer watched before."""
        if self._handle is not None:
            self._handle.remove()
        self._optimizer = opt
        self._handle = opt.add_gradient_observer(self._observe)
        self.open_step = None

    def open(self, step: int, grad_scale: float | None = None, allocated: bool = False) -> None:
        """Open the observation of ``step``, before its backward; a step opened before that ran no
        backward drops its sample.

        Args:
            step: optimizer steps completed before this one.
            grad_scale: the loss scale the gradients still carry, if any (fp16 AMP).
            allocated: whether the first allocation has run (sampling is sparser then).
        """
        inst = self.instrumentation
        sampler = inst.sampler
        if self.open_step is not None and sampler is not None:  # a step that ran no backward
            sampler.abort()
        began = sampler is not None and inst.sampling_step(step, allocated) and sampler.begin(step, grad_scale)
        self.open_step = OpenStep(step, grad_scale, began, set())
        self._shadow_samples = []

    def _observe(self, p: torch.Tensor) -> None:
        opened, opt = self.open_step, self._optimizer
        if opened is None or opt is None:
            return
        inst = self.instrumentation
        name = opt.param_name(p)
        opened.observed.add(name)
        if inst.shadow is not None:  # applied at close, with one synchronization
            self._shadow_samples += inst.shadow.samples({name: p}, inst.betas(opt), opened.grad_scale)
        if opened.sampling:
            inst.sampler.gather_param(p)  # type: ignore[union-attr]

    def close(self) -> bool:
        """Complete the observation :meth:`open` began: parameters that kept their gradient (not
        released) are observed now. Returns whether a sample was taken."""
        opened, opt = self.open_step, self._optimizer
        if opened is None:
            return False
        self.open_step = None
        inst = self.instrumentation
        if inst.shadow is not None and opt is not None:
            rest = {n: p for n, p in opt.named_params.items() if n not in opened.observed}
            inst.shadow.apply(self._shadow_samples + inst.shadow.samples(rest, inst.betas(opt), opened.grad_scale))
        self._shadow_samples = []
        if not opened.sampling:
            return False
        return inst.count(opened.step, inst.sampler.finish())  # type: ignore[union-attr]


__all__ = ["OpenStep", "ReleasedGradientObserver"]
