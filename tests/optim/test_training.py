"""Every format trains a real task (digits, 600 steps).

Final test losses measured with ``python -m pytest tests/optim/test_training.py -s`` (CPU, torch 2.13,
seed 0; fp32 reaches 0.0742) are in ``docs/optimizer.md``; each format's bound below is its measured
loss plus a margin, so a regression in any format fails here.
"""

from __future__ import annotations

import pytest
from support import one_thread, train_digits  # noqa: F401 - one_thread applies to the module

from lightning_baoc import FORMATS

STEPS = 600

# measured final test loss (seed 0) + margin; see the module docstring
MEASURED = {
    "fp32": 0.0742,
    "bf16_momentum": 0.0742,
    "bf16": 0.0742,
    "nomomentum": 0.0786,
    "int8": 0.0741,
    "int8_factored": 0.0776,
    "nomomentum_int8": 0.0770,
    "factored": 0.0794,
    "offload": 0.0742,
}
# 25% over the measured loss: seeds are fixed, the margin covers other CPUs' float reductions
BOUNDS = {fmt: 1.25 * loss for fmt, loss in MEASURED.items()}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_trains(fmt: str, digits) -> None:
    test_loss, losses = train_digits(fmt, digits, steps=STEPS)
    print(f"{fmt}: final test loss {test_loss:.4f}")
    assert test_loss < BOUNDS[fmt], (fmt, test_loss)
    assert sum(losses[-50:]) / 50 < 0.25 * sum(losses[:10]) / 10
