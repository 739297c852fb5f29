"""When to re-evaluate the allocation: every ``reevaluate_every_n_epochs`` epochs, and when
``monitor`` has not improved for ``patience`` validation checks.

A mixin of :class:`~lightning_baoc.control.controller.BAOCController`; a trigger only makes a
re-evaluation pending, which runs at the next step boundary.
"""

from __future__ import annotations

import math
from typing import Any


class TriggersMixin:
    """Epoch and plateau triggers of the controller (see the module docstring)."""

    # provided by the controller this is mixed into
    config: Any
    phase: str
    pending: str | None
    best: float | None
    wait: int

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


__all__ = ["TriggersMixin"]
