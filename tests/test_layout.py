"""The package's layout: folders are the pipeline's stages, the top holds little, names are not reused,
the core never imports an adapter, the tests mirror the package, and the layout diagram of
``docs/architecture.md`` is in step with the tree."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_baoc"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: The package top: these two, and at most this many modules besides.
TOP_ENTRIES = {"__init__.py", "__main__.py"}
MAX_TOP_MODULES = 2
#: The adapters: the only package that knows a training framework; nothing else imports it.
ADAPTERS = "lightning_baoc.integrations"


def _layout_block() -> str:
    blocks = re.findall(r"```mermaid\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    (layout,) = [b for b in blocks if "%% package layout" in b]
    return layout


def _tree() -> set[str]:
    """Top-level modules (``report``) and packages (``solver/``) of the package."""
    out = set()
    for path in PACKAGE.iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            out.add(path.name + "/")
        elif path.suffix == ".py" and path.name != "__init__.py":
            out.add(path.stem)
    return out


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, source: str | None = None) -> set[str]:
    """The modules ``path`` imports, relative imports resolved (``from .x import y``: ``pkg.x`` and ``pkg.x.y``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_the_package_top_holds_init_main_and_at_most_two_modules() -> None:
    files = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py"}
    assert TOP_ENTRIES <= files
    others = sorted(files - TOP_ENTRIES)
    assert len(others) <= MAX_TOP_MODULES, f"modules at the package top (each belongs in a stage's folder): {others}"


def test_no_file_name_is_used_three_times() -> None:
    counts = Counter(p.name for p in _modules() if p.name != "__init__.py")
    reused = {name: n for name, n in counts.items() if n >= 3}
    assert not reused, f"file names used three times or more (name each by what it holds): {reused}"


def test_no_core_module_imports_the_adapters() -> None:
    offenders = []
    for path in _modules():
        if _module_name(path).startswith(ADAPTERS) or path == PACKAGE / "__init__.py":  # the adapters; the public face
            continue
        hits = sorted(m for m in _imported(path) if m == ADAPTERS or m.startswith(ADAPTERS + "."))
        if hits:
            offenders.append(f"{path.relative_to(ROOT)}: {hits}")
    assert not offenders, offenders


def test_the_import_reader_resolves_relative_and_absolute_imports() -> None:
    """The check above reads what it should: a core module importing the adapters either way is caught."""
    where = PACKAGE / "optim" / "optimizer.py"
    assert "lightning_baoc.integrations.swap" in _imported(where, "from ..integrations import swap\n")
    assert "lightning_baoc.integrations.callback" in _imported(where, "from ..integrations.callback import BAOC\n")
    assert "lightning_baoc.integrations.fabric" in _imported(where, "import lightning_baoc.integrations.fabric\n")
    assert "lightning_baoc.optim.pools" in _imported(where, "from .pools import Record\n")


def test_every_package_has_its_tests_folder() -> None:
    tests = ROOT / "tests"
    packages = sorted(name.rstrip("/") for name in _tree() if name.endswith("/"))
    missing = [p for p in packages if not list((tests / p).glob("test_*.py"))]
    assert not missing, f"packages without a tests/<package>/ folder of tests: {missing}"


def test_layout_diagram_names_every_module_and_package_and_nothing_else() -> None:
    nodes = [line for line in _layout_block().splitlines() if not line.strip().startswith("subgraph")]
    labels = set(re.findall(r'\w+\["(\w+/?)(?:<br/>[^"]*)?"\]', "\n".join(nodes)))
    tree = _tree()
    assert tree - labels == set(), f"in the package, not in the diagram: {sorted(tree - labels)}"
    assert labels - tree == set(), f"in the diagram, not in the package: {sorted(labels - tree)}"


# folders of tests that are not packages of the library: the repository's other parts
NON_PACKAGE_TEST_FOLDERS = {"docs", "examples", "benchmarks"}
# top-level test modules about the package (or its test suite) as a whole
PACKAGE_WIDE_TESTS = {"test_imports.py", "test_import_graph.py", "test_layout.py", "test_isolation.py"}


def test_tests_mirror_the_package_tree() -> None:
    """``tests/solver/`` tests ``lightning_baoc/solver/``; a top-level ``tests/test_<module>.py`` tests a top-level module."""
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
