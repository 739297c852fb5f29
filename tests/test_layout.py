"""The package layout diagram of ``docs/architecture.md`` is in step with the package tree, and the
size limits hold in the package, the benchmarks, the examples and the tests (modules under 600 lines, functions at
most 80)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_baoc"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
#: Where the size limits hold: the package, and the repository's other code.
SIZED = (PACKAGE, ROOT / "benchmarks", ROOT / "examples", ROOT / "tests")


def _layout_block() -> str:
    blocks = re.findall(r"```mermaid\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    (layout,) = [b for b in blocks if "%% package layout" in b]
    return layout


def _tree() -> set[str]:
    """Top-level modules (``budget``) and packages (``solver/``) of the package."""
    out = set()
    for path in PACKAGE.iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            out.add(path.name + "/")
        elif path.suffix == ".py" and path.name != "__init__.py":
            out.add(path.stem)
    return out


def test_layout_diagram_names_every_module_and_package_and_nothing_else() -> None:
    nodes = [line for line in _layout_block().splitlines() if not line.strip().startswith("subgraph")]
    labels = set(re.findall(r'\w+\["(\w+/?)(?:<br/>[^"]*)?"\]', "\n".join(nodes)))
    tree = _tree()
    assert tree - labels == set(), f"in the package, not in the diagram: {sorted(tree - labels)}"
    assert labels - tree == set(), f"in the diagram, not in the package: {sorted(labels - tree)}"


def test_modules_and_functions_stay_within_the_size_limits() -> None:
    too_long = []
    for path in sorted(p for folder in SIZED for p in folder.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(ROOT).as_posix()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, too_long


# folders of tests that are not packages of the library: the repository's other parts
NON_PACKAGE_TEST_FOLDERS = {"docs", "examples", "benchmarks"}
# top-level test modules about the package as a whole
PACKAGE_WIDE_TESTS = {"test_imports.py", "test_layout.py"}


def test_tests_mirror_the_package_tree() -> None:
    """``tests/solver/`` tests ``lightning_baoc/solver/``; ``tests/test_budget.py`` tests ``budget.py``."""
    tests = ROOT / "tests"
    packages = {name.rstrip("/") for name in _tree() if name.endswith("/")}
    modules = {name for name in _tree() if not name.endswith("/")}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    stray = folders - packages - NON_PACKAGE_TEST_FOLDERS
    assert not stray, f"test folders that name no package of lightning_baoc: {sorted(stray)}"
    unowned = []
    for path in tests.glob("test_*.py"):
        subject = path.stem.removeprefix("test_")
        if path.name in PACKAGE_WIDE_TESTS:
            continue
        if not any(subject == m or subject.startswith(m + "_") for m in modules):
            unowned.append(path.name)
    assert not unowned, f"top-level test modules that name no top-level module: {sorted(unowned)}"
    for folder in folders:
        assert list((tests / folder).glob("test_*.py")), f"tests/{folder}/ holds no tests"
