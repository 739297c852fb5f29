"""Every example in the package's docstrings runs and prints what it says (one runner for all modules).

A module's examples run in that module's namespace with ``torch`` and ``nn`` added (as a reader of
the docs has them); the public classes that ``lightning_baoc.optim`` re-exports under its own name are
found, and run, there.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch
from support import one_thread  # noqa: F401 (the examples' figures are those of one thread)
from torch import nn

import lightning_baoc

_MODULES = sorted(m.name for m in pkgutil.walk_packages(lightning_baoc.__path__, "lightning_baoc."))


def _runs_examples(name: str) -> bool:
    tests = doctest.DocTestFinder().find(importlib.import_module(name))
    return any(not example.options.get(doctest.SKIP) for test in tests for example in test.examples)


_WITH_EXAMPLES = [name for name in _MODULES if _runs_examples(name)]


def test_the_runner_finds_the_examples() -> None:
    assert len(_WITH_EXAMPLES) >= 30
    for name in ("lightning_baoc.optim", "lightning_baoc.control.options", "lightning_baoc.config.budget"):
        assert name in _WITH_EXAMPLES


@pytest.mark.parametrize("name", _WITH_EXAMPLES)
def test_the_examples_of(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"torch": torch, "nn": nn}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} fail"
