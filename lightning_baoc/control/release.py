"""The BAOC controller's observation of gradients under gradient release.

With gradient release (``BlockwiseAdamW.release_gradients()``) each parameter steps inside its
post-accumulate-grad hook during backward and its gradient is freed at once, so nothing is left for
:meth:`~lightning_baoc.control.controller.BAOCController.observe` after backward. The adapters open the step's
observation before backward (:meth:`ReleaseObservationMixin.open_released_step`); the optimizer's
gradient observer (:meth:`~lightning_baoc.optim.gradient_release.ReleaseMixin.add_gradient_observer`) feeds
each gradient to the sampler and takes its shadow-moment sample inside the hook, just before the
parameter steps; :meth:`ReleaseObservationMixin.close_released_step` completes the step (parameters
that kept their gradient, the shadow's samples applied with one synchronization). The numbers are
those :meth:`observe` would store (``tests/integrations/test_callback_release.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightning_baoc.optim import BlockwiseOptimizer


class ReleaseObservationMixin:
    """Gradient-release observation of :class:`~lightning_baoc.control.controller.BAOCController`."""

    optimizer: BlockwiseOptimizer | None
    sampler: Any
    shadow: Any
    _observer_handle: Any
    _release_open: tuple[int, float | None, bool, set[str]] | None
    _shadow_samples: list[Any]
    # the controller's (and BlocksMixin's)
    _require_installed: Callable[[str], None]
    _sampling_step: Callable[[int], bool]
    _counted: Callable[[int, bool], bool]
    _betas: Callable[[], dict[str, tuple[float, float]]]

    def _watch_released_gradients(self, optimizer: BlockwiseOptimizer) -> None:
        """Observe the gradients gradient release frees (:meth:`BlockwiseAdamW.add_gradient_observer`)."""
        if self._observer_handle is not None:
            self._observer_handle.remove()
        self._observer_handle = optimizer.add_gradient_observer(self._observe_released)
        self._release_open = None

    def open_released_step(self, step: int, grad_scale: float | None = None) -> None:
        """With gradient release, call before the step's backward (on every rank): each parameter's
        gradient then feeds the shadow moments and the sampler inside the release hook, just before
        the parameter steps, and :meth:`close_released_step` completes the step's observation. The
        two calls take the place of :meth:`observe`, and store the same numbers."""
        self._require_installed("open_released_step")
        if self._release_open is not None:  # a step that ran no backward: drop its open sample
            if self.sampler is not None:
                self.sampler.abort()
        began = self.sampler is not None and self._sampling_step(step) and self.sampler.begin(step, grad_scale)
        self._release_open = (step, grad_scale, began, set())
        self._shadow_samples = []

    def _observe_released(self, p: torch.Tensor) -> None:
        if self._release_open is None or self.optimizer is None:
            return
        _, grad_scale, began, observed = self._release_open
        name = self.optimizer.param_name(p)
        observed.add(name)
        if self.shadow is not None:  # applied at close_released_step, with one synchronization
            self._shadow_samples += self.shadow.samples({name: p}, self._betas(), grad_scale)
        if began:
            self.sampler.gather_param(p)  # type: ignore[union-attr]

    @property
    def release_open(self) -> bool:
        """Whether a step's observation under gradient release is open (:meth:`open_released_step`)."""
        return self._release_open is not None

    def close_released_step(self) -> bool:
        """Complete the observation :meth:`open_released_step` opened: parameters that kept their
        gradient (not released) are observed now. Returns whether a sample was taken."""
        if self._release_open is None:
            return False
        step, grad_scale, began, observed = self._release_open
        self._release_open = None
        if self.shadow is not None and self.optimizer is not None:
            rest = {n: p for n, p in self.optimizer.named_params.items() if n not in observed}
            self.shadow.apply(self._shadow_samples + self.shadow.samples(rest, self._betas(), grad_scale))
        self._shadow_samples = []
        if not began:
            return False
        return self._counted(step, self.sampler.finish())  # type: ignore[union-attr]
