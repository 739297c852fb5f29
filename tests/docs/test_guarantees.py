"""README's "Guarantees" section cannot drift: every promise names a test, and every test it names exists.

Each bullet of the section (between ``<!-- guarantees:start -->`` and ``<!-- guarantees:end -->``)
must cite at least one test as ``tests/<file>.py::<test function>``; the file must exist and define
that function (a parametrized test is named by its function).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CITATION = re.compile(r"tests/([\w/]+\.py)::(\w+)")


def guarantees_section() -> str:
    text = README.read_text()
    start = text.index("<!-- guarantees:start -->")
    stop = text.index("<!-- guarantees:end -->")
    return text[start:stop]


def bullets(section: str) -> list[str]:
    """The section's bullet items, continuation lines joined."""
    items: list[str] = []
    for line in section.splitlines():
        if line.startswith("- "):
            items.append(line)
        elif items and line.startswith("  ") and line.strip():
            items[-1] += " " + line.strip()
    return items


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    }


def test_every_guarantee_names_a_test_that_exists() -> None:
    items = bullets(guarantees_section())
    assert len(items) >= 8, f"the Guarantees section lists only {len(items)} promises"
    missing: list[str] = []
    for item in items:
        cited = CITATION.findall(item)
        assert cited, f"this guarantee names no test: {item[:120]!r}"
        for file, name in cited:
            path = ROOT / "tests" / file
            if not path.is_file() or name not in defined_tests(path):
                missing.append(f"tests/{file}::{name}")
    assert not missing, f"README's Guarantees cite tests that do not exist: {missing}"


def test_the_checker_rejects_a_missing_test(tmp_path: Path) -> None:
    # The checker's own parts on a known input: one real test, one invented.
    real = "tests/docs/test_readme_guarantees.py::test_every_guarantee_names_a_test_that_exists"
    section = f"- a promise ({real})\n  continued\n- another (tests/docs/test_readme_guarantees.py::test_invented)\n"
    items = bullets(section)
    assert len(items) == 2 and items[0].endswith("continued")
    names = defined_tests(ROOT / "tests" / "docs" / "test_readme_guarantees.py")
    cited = [n for item in items for _, n in CITATION.findall(item)]
    assert [n in names for n in cited] == [True, False]
