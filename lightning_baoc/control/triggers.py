"""When to re-evaluate the allocation: every ``reevaluate_every_n_epochs`` epochs, and when
``monitor`` has not improved for ``patience`` validation checks.

:class:`Triggers` only decides, as Lightning's ``EarlyStopping._evaluate_stopping_criteria`` does:
the controller makes a re-evaluation pending on its answer (after the first allocation only), which
runs at the next step boundary.
"""

from __future__ import annotations

import math

from lightning_baoc.config.settings import BAOCConfig


class Triggers:
    """The epoch and plateau triggers of re-evaluation.

    Args:
        config: the settings; reads ``reevaluate_every_n_epochs``, ``patience``, ``mode`` and
            ``min_delta`` at each call.

    Attributes:
        best: the best ``monitor`` value seen since the first allocation (``None``: none yet).
        wait: validation checks since ``best`` last improved (restarts at each allocation).

    Example:
        >>> triggers = Triggers(BAOCConfig(memory_budget=0.5, patience=2, reevaluate_every_n_epochs=3))
        >>> [triggers.evaluate(v) for v in (1.0, 0.9, 0.95, 0.92)]
        [(False, None), (False, None), (False, None), (True, 'plateau')]
        >>> [triggers.epoch_due(e) for e in range(4)]
        [False, False, True, False]
    """

    def __init__(self, config: BAOCConfig) -> None:
        self.config = config
        self.best: float | None = None
        self.wait = 0

    def epoch_due(self, epoch: int) -> bool:
        """Whether the end of epoch ``epoch`` (0-based) calls for a re-evaluation."""
        n = self.config.reevaluate_every_n_epochs
        return n is not None and (epoch + 1) % n == 0

    def evaluate(self, value: float | None) -> tuple[bool, str | None]:
        """Track a ``monitor`` value: ``(True, "plateau")`` after ``patience`` checks without an
        improvement of more than ``min_delta`` (the count then restarts), else ``(False, None)``.
        ``None`` and non-finite values are ignored."""
        if value is None or not math.isfinite(value):
            return False, None
        cfg = self.config
        improved = (
            self.best is None
            or (cfg.mode == "min" and value < self.best - cfg.min_delta)
            or (cfg.mode == "max" and value > self.best + cfg.min_delta)
        )
        if improved:
            self.best = float(value)
            self.wait = 0
            return False, None
        self.wait += 1
        if self.wait >= cfg.patience:
            self.wait = 0
            return True, "plateau"
        return False, None

    def restart(self) -> None:
        """Restart the count of checks without improvement (an allocation ran); ``best`` stays."""
        self.wait = 0


__all__ = ["Triggers"]
