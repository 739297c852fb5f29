"""The package's import graph, read from the source: no module comes back to itself through the modules it
imports, no two top-level folders import each other, and an import of the package inside a function says why
it is not at the top of its module.

Every import is an edge, wherever it is written: at the top, inside a function, under ``if TYPE_CHECKING:``
(an import hidden in a function is still a dependency, and a circle through it only waits for the first call).
A module's imports of its own ancestor packages are not edges (whoever imports ``lightning_baoc.optim.pools``
runs ``lightning_baoc/optim/__init__.py`` first); ``from pkg import name`` is an edge to ``pkg.name`` where that
is a module, else to ``pkg``. A folder is ``lightning_baoc.<name>``: a subpackage, or a module at the package top.

An import of a package module inside a function stays there only with a comment on its line or the line above
that gives the reason: an optional dependency it would pull in, or its measured import time (``# lazy: importing
triton costs 0.4 s (python -X importtime)``), so that a circle cannot hide in a function unnoticed.

Each check runs on the package and, to show that it can fail, on a small source tree written in ``tmp_path``.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_baoc"
#: What a comment on a function-level import must name: an optional dependency, or an import time measured in
#: seconds or milliseconds (``0.4 s``, ``120 ms``).
REASON = re.compile(r"optional|\d+(?:\.\d+)?\s*m?s\b", re.IGNORECASE)
#: Comments that are tool directives, not reasons.
PRAGMA = re.compile(r"^(noqa|type:|pragma|fmt:|pylint:|isort:)", re.IGNORECASE)

Graph = dict[str, dict[str, tuple[Path, int]]]  # module -> imported module -> (file, line) of the first import


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root`` by its dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    """The package's modules that ``node`` (in module ``name``) imports."""
    if isinstance(node, ast.Import):
        found = []
        for alias in node.names:
            parts = alias.name.split(".")
            prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
            found += [p for p in prefixes if p in known][:1]  # the module itself, else its nearest package
        return found
    base = node.module or ""
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
    return subs + ([base] if base in known and len(subs) < len(node.names) else [])


#: The statements an import can sit in (a function's, a class's, a branch's body): the expressions, most of a
#: tree, are not read.
_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)


@lru_cache(maxsize=None)
def _source(path: Path) -> tuple[list[tuple[ast.Import | ast.ImportFrom, bool]], list[str]]:
    """The import statements of a file in line order, each with whether it is inside a function (a method, a
    nested function), and the file's lines."""
    text = path.read_text(encoding="utf-8")
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, inside))
            elif isinstance(child, _BLOCKS):
                visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(text, filename=str(path)), False)
    return sorted(found, key=lambda item: item[0].lineno), text.splitlines()


@lru_cache(maxsize=None)
def import_graph(root: Path, package: str) -> Graph:
    """Module -> the package's modules it imports (every import: top level, functions, ``TYPE_CHECKING``),
    without its edges to its own ancestor packages, each with where it is first imported."""
    known = modules(root, package)
    graph: Graph = {name: {} for name in known}
    for name, path in known.items():
        for node, _ in _source(path)[0]:
            for target in _targets(name, path, node, known):
                if target != name and not name.startswith(target + "."):
                    graph[name].setdefault(target, (path, node.lineno))
    return graph


def _where(graph: Graph, a: str, b: str, root: Path) -> str:
    path, line = graph[a][b]
    return f"{a} -> {b} ({path.relative_to(root)}:{line})"


def _reach(graph: Graph, start: str) -> dict[str, str | None]:
    """Every module reachable from ``start``, each with the module it was first reached from (breadth first)."""
    seen: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        a = queue.popleft()
        for b in graph.get(a, {}):
            if b not in seen:
                seen[b] = a
                queue.append(b)
    return seen


def cycles(graph: Graph, root: Path) -> list[str]:
    """A circle through each group of modules that import each other (a strongly connected component):
    the shortest through its first module, as its chain of imports with the line of each; empty when the
    graph has no circle."""
    reach = {a: _reach(graph, a) for a in graph}
    done: set[str] = set()
    found = []
    for a in sorted(graph):
        if a in done:
            continue
        component = {b for b in reach[a] if a in reach[b]}
        done |= component
        if len(component) < 2:
            continue
        best: list[str] = []
        for b in sorted(set(graph[a]) & component):  # the shortest way back to a, from each of its imports
            parents, path = _reach(graph, b), [a]
            while path[-1] != b:  # the breadth-first tree from b, walked back from a
                path.append(parents[path[-1]])  # type: ignore[arg-type]
            chain = [a] + path[::-1]
            if not best or len(chain) < len(best):
                best = chain
        steps = "; ".join(_where(graph, x, y, root) for x, y in zip(best, best[1:]))
        found.append(f"{' -> '.join(best)} (the circle among {sorted(component)}): {steps}")
    return found


def folder_of(module: str) -> str:
    """``lightning_baoc.<name>``: the top-level folder (or top-level module) a module is in."""
    return ".".join(module.split(".")[:2])


def folder_pairs(graph: Graph, root: Path, package: str) -> list[str]:
    """Every two top-level folders that import each other, each with an import of each way."""
    between: dict[tuple[str, str], str] = {}
    for a, targets in graph.items():
        for b in targets:
            fa, fb = folder_of(a), folder_of(b)
            if fa != fb and package not in (fa, fb):
                between.setdefault((fa, fb), _where(graph, a, b, root))
    return [f"{fa} <-> {fb}: {between[fa, fb]}; {between[fb, fa]}"
            for fa, fb in sorted(between) if fa < fb and (fb, fa) in between]


def _comment(line: str) -> str:
    """The comment of a source line, without tool directives (``# noqa``, ``# type: ignore``)."""
    if "#" not in line:
        return ""
    text = line[line.index("#") + 1:].strip()
    return "" if PRAGMA.match(text) else text


def unexplained_function_imports(root: Path, package: str) -> list[str]:
    """Each import of a package module inside a function whose line, and the line above, give no reason
    (:data:`REASON`) for it not being at the top of its module."""
    known = modules(root, package)
    found = []
    for name, path in known.items():
        imports, lines = _source(path)
        for node, inside in imports:
            if not inside or not _targets(name, path, node, known):
                continue
            first, last = node.lineno, node.end_lineno or node.lineno
            above = lines[first - 2].strip() if first >= 2 else ""
            said = [_comment(lines[first - 1]), _comment(lines[last - 1]), _comment(above) if above.startswith("#") else ""]
            if not any(REASON.search(c) for c in said):
                found.append(f"{path.relative_to(root)}:{first}: {lines[first - 1].strip()}")
    return found


# ---------------------------------------------------------------------------- the package


def test_no_module_of_the_package_imports_itself_back() -> None:
    graph = import_graph(ROOT, PACKAGE)
    # the reader reads: the controller's edges to the optimizer and to its own parts are there
    assert {"lightning_baoc.optim", "lightning_baoc.control.blocks"} <= set(graph["lightning_baoc.control.controller"])
    found = cycles(graph, ROOT)
    assert not found, "modules that import each other (move the shared part down, or the code to its user):\n" + "\n".join(found)


def test_no_two_top_level_folders_import_each_other() -> None:
    found = folder_pairs(import_graph(ROOT, PACKAGE), ROOT, PACKAGE)
    assert not found, "folders that import each other (one of them is the lower layer):\n" + "\n".join(found)


def test_every_import_inside_a_function_says_why_it_is_there() -> None:
    found = unexplained_function_imports(ROOT, PACKAGE)
    assert not found, (
        "imports of the package inside functions without a reason (move them to the top of the module, or say "
        "on the line or above it which optional dependency or how many seconds of import they spare, e.g. "
        "'# lazy: importing triton costs 0.4 s (python -X importtime)'):\n" + "\n".join(found))


# ---------------------------------------------------------------------------- the checks can fail


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_circle_through_a_function_or_type_checking_is_found_and_named(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/x/__init__.py": "from pkg.x.a import A\n",
        "pkg/x/a.py": "from typing import TYPE_CHECKING\nimport pkg\nfrom pkg import x\n"
                      "if TYPE_CHECKING:\n    from .b import B\nA = 1\n",
        "pkg/x/b.py": "def f():\n    from pkg.x import c\n    return c\n",
        "pkg/x/c.py": "from pkg.x import a\n",
        "pkg/x/d.py": "from pkg.x.a import A\n",
    }
    root = _tree(tmp_path / "before", files)
    graph = import_graph(root, "pkg")
    assert graph["pkg.x.a"] == {"pkg.x.b": (root / "pkg/x/a.py", 5)}  # its ancestors pkg and pkg.x are not edges
    assert set(graph["pkg.x"]) == {"pkg.x.a"} and set(graph["pkg.x.d"]) == {"pkg.x.a"}
    (found,) = cycles(graph, root)
    assert found.startswith("pkg.x.a -> pkg.x.b -> pkg.x.c -> pkg.x.a ")
    assert "pkg.x.b -> pkg.x.c (pkg/x/b.py:2)" in found and "pkg.x.c -> pkg.x.a (pkg/x/c.py:1)" in found
    after = _tree(tmp_path / "after", {**files, "pkg/x/c.py": "X = 1\n"})
    assert cycles(import_graph(after, "pkg"), after) == []


def test_two_folders_importing_each_other_are_found_without_a_module_circle(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "from pkg.low import base\n",
        "pkg/__main__.py": "from pkg.high import top\n",
        "pkg/low/__init__.py": "",
        "pkg/low/base.py": "B = 1\n",
        "pkg/low/model.py": "def f():\n    from ..high.top import T\n    return T\n",
        "pkg/high/__init__.py": "",
        "pkg/high/top.py": "from pkg.low.base import B\nT = B\n",
    }
    root = _tree(tmp_path / "before", files)
    graph = import_graph(root, "pkg")
    assert cycles(graph, root) == []
    assert folder_pairs(graph, root, "pkg") == [
        "pkg.high <-> pkg.low: pkg.high.top -> pkg.low.base (pkg/high/top.py:1); "
        "pkg.low.model -> pkg.high.top (pkg/low/model.py:2)"]
    after = _tree(tmp_path / "after", {**files, "pkg/low/model.py": "M = 1\n"})
    assert folder_pairs(import_graph(after, "pkg"), after, "pkg") == []  # __main__ and the top are no pair


def test_an_import_inside_a_function_needs_its_reason_on_its_line_or_above(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import json\n\n\ndef f():\n"
                    "    import os  # not the package's: no reason needed\n"
                    "    from pkg import b  # noqa: F401\n"
                    "    from pkg import c  # lazy: c imports an optional dependency\n"
                    "    # lazy: importing d costs 0.4 s (python -X importtime)\n"
                    "    from pkg.d import (\n        D,\n    )\n"
                    "    from . import b as again  # imported here\n"
                    "    return lambda: __import__('json')\n",
        "pkg/b.py": "try:\n    from pkg import d\nexcept ImportError:\n    d = None\n\n\n"
                    "class K:\n    def m(self):\n        if d is None:\n            import pkg.c\n        return pkg.c\n",
        "pkg/c.py": "",
        "pkg/d.py": "D = 1\n",
    })
    assert unexplained_function_imports(root, "pkg") == [
        "pkg/a.py:6: from pkg import b  # noqa: F401",
        "pkg/a.py:12: from . import b as again  # imported here",
        "pkg/b.py:10: import pkg.c",
    ]
