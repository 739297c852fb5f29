"""The re-evaluation triggers (``lightning_baoc.control.triggers.Triggers``), alone: a pure decision on
the epoch index and on each ``monitor`` value, as Lightning's ``EarlyStopping`` decides."""

from __future__ import annotations

import math

import pytest

from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.control.triggers import Triggers


def _triggers(**settings: object) -> Triggers:
    return Triggers(BAOCConfig(memory_budget=0.5, **settings))  # type: ignore[arg-type]


def test_every_n_epochs_or_never() -> None:
    assert [e for e in range(9) if _triggers(reevaluate_every_n_epochs=3).epoch_due(e)] == [2, 5, 8]
    assert [e for e in range(3) if _triggers(reevaluate_every_n_epochs=1).epoch_due(e)] == [0, 1, 2]
    assert not any(_triggers(reevaluate_every_n_epochs=None).epoch_due(e) for e in range(5))


@pytest.mark.parametrize(
    "mode, values, due_at",
    [
        ("min", [1.0, 0.9, 0.9, 0.95, 0.8, 0.85, 0.81], [3, 6]),
        ("max", [0.1, 0.2, 0.2, 0.15, 0.3, 0.3, 0.3], [3, 6]),
    ],
)
def test_a_plateau_of_patience_checks(mode: str, values: list[float], due_at: list[int]) -> None:
    triggers = _triggers(patience=2, mode=mode)
    answers = [triggers.evaluate(v) for v in values]
    assert [i for i, (due, _) in enumerate(answers) if due] == due_at
    assert {reason for due, reason in answers if due} == {"plateau"}
    assert all(reason is None for due, reason in answers if not due)


def test_min_delta_none_and_non_finite_values() -> None:
    triggers = _triggers(patience=1, min_delta=0.1)
    assert triggers.evaluate(1.0) == (False, None) and triggers.best == 1.0
    assert triggers.evaluate(0.95) == (True, "plateau")  # better, by less than min_delta: no improvement
    assert triggers.evaluate(0.85) == (False, None) and triggers.best == 0.85
    for ignored in (None, math.nan, math.inf):
        assert triggers.evaluate(ignored) == (False, None)
    assert triggers.best == 0.85 and triggers.wait == 0


def test_restart_counts_again_and_keeps_the_best() -> None:
    triggers = _triggers(patience=3)
    for v in (1.0, 2.0, 2.0):
        triggers.evaluate(v)
    assert triggers.wait == 2
    triggers.restart()
    assert triggers.wait == 0 and triggers.best == 1.0
    assert [triggers.evaluate(1.5)[0] for _ in range(3)] == [False, False, True]
