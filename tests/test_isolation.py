"""Tests leave the process as they found it (``tests/conftest.py``'s guard), in any order.

Importing torch's internal test helpers (``torch.testing._internal``, which needs the ``expecttest`` package)
freezes ``torch.backends``' flags, after which every Lightning ``Trainer`` in the process fails; the test that
uses them runs them in a child process. Checked here: the guard notices a changed process and puts it back, and
that test and a Lightning resume test pass in one process in either order.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import _process_state, restore_process_state

ROOT = Path(__file__).resolve().parents[1]


def test_the_guard_names_what_a_test_changed_and_puts_it_back() -> None:
    start = _process_state()
    torch.backends.disable_global_flags()
    torch.set_default_dtype(torch.float64)
    changed = restore_process_state(start)
    assert set(changed) == {"torch.backends flags frozen (torch.testing._internal's import does it)", "default dtype"}
    assert changed["default dtype"] == (torch.float32, torch.float64)
    assert _process_state() == start and not torch.backends.flags_frozen()
    assert restore_process_state(start) == {}


@pytest.mark.slow  # two pytest processes of ~20 s; the default run itself is the forwards order, expecttest installed
@pytest.mark.parametrize("order", ["forwards", "reverse"])
def test_torch_s_own_inputs_and_a_lightning_resume_pass_in_one_process_in_either_order(order: str) -> None:
    pytest.importorskip("expecttest")
    tests = ["tests/optim/test_api.py::test_torch_own_optimizer_inputs_when_available",
             "tests/optim/test_checkpoint.py::test_lightning_resume_without_the_callback_fails_at_load"]
    if order == "reverse":
        tests.reverse()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"^3 passed", done.stdout, re.M), done.stdout[-500:]
