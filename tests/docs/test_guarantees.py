"""The guarantees cannot drift: every promise names a test, and every test it names exists.

``docs/guarantees.md`` holds the promises: each bullet must cite at least one test as
``tests/<file>.py::<test function>``; the file must exist and define that function (a parametrized test is
named by its function). The README's "Guarantees" section is the short list: each of its bullets links a
section of ``docs/guarantees.md``, and every section of that page is linked from it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from markdown.extensions.toc import slugify
from support_docs import bullets

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUARANTEES = ROOT / "docs" / "guarantees.md"
CITATION = re.compile(r"tests/([\w/]+\.py)::(\w+)")
LINK = re.compile(r"\]\(docs/guarantees\.md#([\w-]+)\)")


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    }


def readme_section(title: str) -> str:
    """The README's ``## title`` section, up to the next ``## `` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    stop = text.find("\n## ", start + 1)
    return text[start : stop if stop >= 0 else len(text)]


def test_every_guarantee_names_a_test_that_exists() -> None:
    items = bullets(GUARANTEES.read_text())
    assert len(items) >= 8, f"docs/guarantees.md lists only {len(items)} promises"
    missing: list[str] = []
    for item in items:
        cited = CITATION.findall(item)
        assert cited, f"this guarantee names no test: {item[:120]!r}"
        for file, name in cited:
            path = ROOT / "tests" / file
            if not path.is_file() or name not in defined_tests(path):
                missing.append(f"tests/{file}::{name}")
    assert not missing, f"docs/guarantees.md cites tests that do not exist: {missing}"


def test_the_readme_lists_every_section_of_the_guarantees_page() -> None:
    sections = {slugify(h, "-") for h in re.findall(r"^## +(.+?)\s*$", GUARANTEES.read_text(), re.M)}
    assert len(sections) >= 4, f"docs/guarantees.md has only {len(sections)} sections"
    items = bullets(readme_section("Guarantees"))
    assert items, "the README's Guarantees section lists nothing"
    linked = set()
    for item in items:
        anchors = LINK.findall(item)
        assert anchors, f"this README guarantee links no section of docs/guarantees.md: {item[:100]!r}"
        linked.update(anchors)
    assert linked <= sections, f"the README links sections docs/guarantees.md lacks: {sorted(linked - sections)}"
    assert sections <= linked, f"sections of docs/guarantees.md the README does not list: {sorted(sections - linked)}"


def test_the_checker_rejects_a_missing_test() -> None:
    # The checker's own parts on a known input: one real test, one invented.
    real = "tests/docs/test_guarantees.py::test_every_guarantee_names_a_test_that_exists"
    text = f"## A\n\n- a promise ({real})\n  continued\n\n- another (tests/docs/test_guarantees.py::test_invented)\n"
    items = bullets(text)
    assert len(items) == 2 and items[0].endswith("continued")
    names = defined_tests(ROOT / "tests" / "docs" / "test_guarantees.py")
    cited = [n for item in items for _, n in CITATION.findall(item)]
    assert [n in names for n in cited] == [True, False]
