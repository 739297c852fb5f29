"""What installing the package pulls (``pyproject.toml``): what training needs and nothing else; the
``check`` and ``plan`` commands need nothing more; the rest is in extras that say what they are for, and
``dev`` (what ``.ci/run`` installs) is composed of them."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]

#: The training dependencies: the optimizer, the callback and the Fabric strategy with their defaults.
TRAINING = {"torch", "lightning", "numpy", "ninja", "omegaconf", "rich", "jsonschema"}
#: Modules the package imports only where a feature asks for them, and the extra that brings each
#: (triton: also torch's CUDA wheels on Linux; deepspeed: only lightning_baoc.optim.deepspeed and BAOC under
#: DeepSpeed import it).
OPTIONAL = {"matplotlib": "plot", "triton": "test", "deepspeed": "deepspeed"}
#: What a CPU machine must not get from a plain install.
NOT_FOR_TRAINING = {"mkdocs", "mkdocs-material", "matplotlib", "scikit-learn", "triton", "jsonargparse", "hydra-core", "pytest"}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _extra(name: str) -> set[str]:
    """The distributions an extra names, its own extras expanded."""
    out: set[str] = set()
    for text in PROJECT["optional-dependencies"][name]:
        req = Requirement(text)
        if _name(text) == "lightning-baoc":
            for inner in req.extras:
                out |= _extra(inner)
        else:
            out.add(_name(text))
    return out


def _closure(names: set[str]) -> set[str]:
    """``names`` and what they require, as installed here (no extras); torch's own requirements are the
    torch build's (its CUDA wheels bring triton), not ours."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name == "torch":
            continue
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        for text in reqs:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_name(text))
    return seen


def _imported(package: Path) -> set[str]:
    """Top-level names of the third-party modules the package's code imports (anywhere)."""
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "lightning_baoc"}


def test_the_dependencies_are_what_training_needs() -> None:
    assert {_name(d) for d in PROJECT["dependencies"]} == TRAINING
    pulled = _closure(TRAINING)
    assert not pulled & NOT_FOR_TRAINING, pulled & NOT_FOR_TRAINING


def test_every_module_the_package_imports_is_installed_with_it_or_an_extra() -> None:
    provided = _closure(TRAINING)
    by_module = packages_distributions()
    for module in sorted(_imported(ROOT / "lightning_baoc")):
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in by_module.get(module, [module])}
        if dists & provided:
            continue
        assert module in OPTIONAL, f"{module} is imported by lightning_baoc but neither a dependency nor an optional feature"
        assert dists & _extra(OPTIONAL[module]), (module, OPTIONAL[module])


def test_each_extra_says_what_it_is_for_and_dev_installs_what_the_tests_need() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = text[text.index("[project.optional-dependencies]") : text.index("[project.scripts]")]
    for name in PROJECT["optional-dependencies"]:
        before = block[: block.index(f"\n{name} = ")].rstrip().splitlines()[-1]
        assert before.startswith("# "), f"the extra {name!r} has no comment saying what it is for"
    assert _extra("dev") == _extra("test") | _extra("docs")
    assert {"pytest", "scikit-learn", "matplotlib", "jsonargparse", "torchmetrics", "triton"} <= _extra("test")
    assert {"mkdocs", "mkdocstrings"} <= _extra("docs")
    assert {"scikit-learn", "matplotlib", "jsonargparse", "hydra-core", "torchmetrics"} <= _extra("examples")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'pip install -q -e ".[dev]"' in ci
