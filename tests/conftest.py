"""Shared test fixtures: small models and scikit-learn's embedded digits data set (see ``support``)."""

from __future__ import annotations

import pytest
import torch

from support import digits_tensors


@pytest.fixture(scope="session")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return digits_tensors()
