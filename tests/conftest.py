"""Shared test fixtures: small models and scikit-learn's embedded digits data set (see ``support``)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # the CUDA step's Triton kernels run in Triton's interpreter on the CPU (tests/kernels/test_triton_step.py);
    # Triton reads this when it is imported, so it is set before anything imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support import digits_tensors


@pytest.fixture(scope="session")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return digits_tensors()
