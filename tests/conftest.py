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


def _process_state() -> dict[str, object]:
    """What a test could change for the tests after it in the same process."""
    return {
        "torch.backends flags frozen (torch.testing._internal's import does it)": torch.backends.flags_frozen(),
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "anomaly detection": torch.is_anomaly_enabled(),
    }


_START = _process_state()


def restore_process_state(start: dict[str, object]) -> dict[str, tuple[object, object]]:
    """What changed since ``start`` (``_process_state()``), each as (before, after), put back as it was."""
    changed = {k: (start[k], v) for k, v in _process_state().items() if v != start[k]}
    if changed:
        if torch.backends.flags_frozen() and not next(iter(start.values())):  # the module's own global (no setter)
            torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
        torch.set_default_dtype(start["default dtype"])  # type: ignore[arg-type]
        torch.set_grad_enabled(bool(start["grad mode"]))
        torch.use_deterministic_algorithms(bool(start["deterministic algorithms"]))
        torch.autograd.set_detect_anomaly(bool(start["anomaly detection"]))
    return changed


@pytest.fixture(autouse=True)
def _leaves_the_process_as_it_found_it() -> object:
    """A test must not change the process for the tests after it: where one did, it errors (naming what it
    changed) and the state is put back, so that the failure stays with the test that caused it."""
    yield
    changed = restore_process_state(_START)
    # Lightning's Trainer(deterministic=True) turns deterministic algorithms on for the whole process and never
    # off: put back, not a failure
    changed.pop("deterministic algorithms", None)
    if changed:
        pytest.fail(f"the test changed the process for the tests after it: {changed} (before, after)")


@pytest.fixture(scope="session")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return digits_tensors()
