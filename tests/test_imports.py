"""Layering: the core never loads Lightning; only the integrations (the callback and the Fabric
strategy) do, and the package's public names still import from the top level."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import lightning_baoc

ROOT = Path(__file__).resolve().parent.parent
#: the modules that adapt the core to Lightning, the only ones allowed to import it: the callbacks
#: (BAOC, GradientRelease) and the Fabric strategy
INTEGRATIONS = {
    "lightning_baoc.integrations.callback",
    "lightning_baoc.integrations.fabric",
    "lightning_baoc.integrations.release",
}


def _core_modules() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(lightning_baoc.__path__, "lightning_baoc.")]
    return sorted(n for n in names if n not in INTEGRATIONS and not n.startswith(tuple(i + "." for i in INTEGRATIONS)))


def test_core_modules_import_without_lightning_in_a_fresh_process() -> None:
    modules = _core_modules()
    assert "lightning_baoc.solver" in modules and "lightning_baoc.control.controller" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    loaded = sorted(m for m in sys.modules if m == 'lightning' or m.startswith('lightning.'))\n"
        "    assert not loaded, f'{name} loads Lightning: {loaded[:3]}'\n"
        "print(len(sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_public_name_imports_from_the_top_level() -> None:
    for name in lightning_baoc.__all__:
        assert getattr(lightning_baoc, name) is not None, name
    assert set(lightning_baoc.__all__) <= set(dir(lightning_baoc))
