"""The README is a front page and the documentation site in ``docs/`` builds clean.

- ``mkdocs build --strict`` succeeds: a broken link or anchor, a page left out of the navigation, a
  snippet of the README that went missing or a public name the API reference cannot resolve fails it.
- The README is at most 150 lines, and its quickstart (the ``## Quickstart`` section, with
  ``Trainer(callbacks=[BAOC(``) ends within its first 40.
- Every headline figure is one line that links the docs page holding its table (which must exist, anchor
  included, and name the command that measured it); every decimal number it quotes appears on a linked page.
- Each benchmark's section markers are on the page it writes to, and ``write_docs_section`` replaces
  only what is between them.
- The API reference names every public name by its top-level path, and only those.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify
from support_docs import bullets

import lightning_baoc

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`\n]+`")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

# (page under docs/, section) each benchmark writes, and the script that writes it.
BENCHMARK_SECTIONS = [
    ("quality.py", "benchmarks/quality.md", "quality"),
    ("step_time.py", "benchmarks/step-time.md", "step_time"),
    ("sampler_overhead.py", "benchmarks/sampler-overhead.md", "sampler_overhead"),
    ("solver.py", "benchmarks/solver.md", "solver_bench"),
    ("risk_validation.py", "benchmarks/risk-validation.md", "risk_validation_digits"),
    ("risk_validation.py", "benchmarks/risk-validation.md", "risk_validation_chargpt"),
    ("risk_validation.py", "benchmarks/risk-validation.md", "risk_validation_ddpm"),
    ("int8_mechanism.py", "benchmarks/int8-mechanism.md", "int8_mechanism_ddpm"),
    ("int8_mechanism.py", "benchmarks/int8-mechanism.md", "int8_mechanism_chargpt"),
]


def section(text: str, name: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    assert start in text and end in text, f"markers of section {name!r} missing"
    return text[text.index(start) + len(start) : text.index(end)]


def anchors(page: Path) -> set[str]:
    """The heading ids MkDocs gives a page (the toc extension's default slugs)."""
    text = FENCE.sub("", page.read_text())
    return {slugify(re.sub(r"[`*]", "", m), "-") for m in re.findall(r"^#{1,6} +(.+?)\s*$", text, re.M)}


def resolve_link(target: str, base: Path) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return (base / path).resolve(), anchor


# ---------------------------------------------------------------------------- the site


@pytest.mark.slow  # a whole mkdocs build (4-5 s); the pages, links and figures are held by default by this file's other tests
def test_mkdocs_build_strict_succeeds(tmp_path: Path) -> None:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail('mkdocs is not installed: pip install -e ".[docs]" (the dev extra includes it)')
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "site" / "api" / "index.html").is_file()
    assert 'id="lightning_baoc.BAOC"' in (tmp_path / "site" / "api" / "index.html").read_text()


def test_api_reference_names_every_public_name_by_its_top_level_path() -> None:
    entries = re.findall(r"^::: *(\S+)", (DOCS / "api.md").read_text(), re.M)
    deep = [e for e in entries if e.count(".") != 1 or not e.startswith("lightning_baoc.")]
    assert not deep, f"docs/api.md names modules' paths, which move; use lightning_baoc.NAME: {deep}"
    named = {e.split(".", 1)[1] for e in entries}
    assert named == set(lightning_baoc.__all__), (
        f"docs/api.md and lightning_baoc.__all__ differ: missing {sorted(set(lightning_baoc.__all__) - named)}, "
        f"not public {sorted(named - set(lightning_baoc.__all__))}"
    )


# ---------------------------------------------------------------------------- the README


def test_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail to docs/ (at most 150)"
    first = [i for i, line in enumerate(lines, 1) if "Trainer(callbacks=[BAOC(" in line]
    assert first and first[0] <= 40, f"Trainer(callbacks=[BAOC(...)]) first appears on line {first or None} (at most 40)"
    start = lines.index("## Quickstart") + 1 if "## Quickstart" in lines else None
    assert start and start < first[0], "the README has no '## Quickstart' section before its Trainer(...) line"
    end = next((i for i, line in enumerate(lines[start:], start + 1) if line.startswith("## ")), len(lines) + 1) - 1
    assert end <= 40, f"the README's quickstart runs to line {end} (it must end within the first 40)"
    assert "BAOC" in lines[0] and "Budget-Aware Optimizer Configurator" in lines[0], (
        f"the README's first line must spell out what BAOC stands for: {lines[0]!r}"
    )


def test_readme_links_resolve() -> None:
    text = README.read_text()
    for target in LINK.findall(text):
        if "://" in target:
            continue
        path, anchor = resolve_link(target, ROOT)
        assert path.is_file(), f"README links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"README links to {target}: no heading with that anchor"


def test_readme_python_blocks_compile_and_import_public_names() -> None:
    blocks = [body for lang, body in FENCE.findall(README.read_text()) if lang == "python"]
    assert blocks, "the README has no python block (the quickstart)"
    for body in blocks:
        tree = ast.parse(body)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "lightning_baoc":
                missing = [a.name for a in node.names if not hasattr(lightning_baoc, a.name)]
                assert not missing, f"the README imports {missing} from lightning_baoc, which has no such names"


# A command as the docs pages record one: a benchmark, a module, a test run or the GPU suite.
COMMAND = re.compile(r"(?m)(`|^)(python (benchmarks/|-m |examples/)|bash benchmarks/)")


def test_every_headline_figure_links_its_docs_page_and_command() -> None:
    text = section(README.read_text(), "headline")
    assert not [line for line in text.splitlines() if line.startswith("  ")], (
        "a headline figure runs over more than one line: one line each, the detail on its page"
    )
    items = bullets(text)
    assert len(items) >= 3, "the headline section lists too few figures"
    for item in items:
        prose = CODE_SPAN.sub("", item)
        if not re.search(r"\d", prose):
            continue
        pages = []
        for target in LINK.findall(item):
            path, anchor = resolve_link(target, ROOT)
            assert path.is_file() and DOCS in path.parents, f"{target} is not a docs page: {item[:80]!r}"
            assert not anchor or anchor in anchors(path), f"{target}: no such anchor on the page"
            pages.append(path.read_text())
        assert pages, f"this figure links to no docs page: {item[:100]!r}"
        assert any(COMMAND.search(page) for page in pages), (
            f"no page this figure links names the command that measured it: {item[:100]!r}"
        )
        for number in re.findall(r"\d+\.\d+", prose):
            assert any(number in page for page in pages), (
                f"{number} is quoted in the README but appears on none of the pages it links: {item[:100]!r}"
            )


# ---------------------------------------------------------------------------- the benchmarks' sections


@pytest.mark.parametrize("script, page, name", BENCHMARK_SECTIONS, ids=[n for _, _, n in BENCHMARK_SECTIONS])
def test_benchmark_section_is_on_the_page_it_writes_to(script: str, page: str, name: str) -> None:
    text = (DOCS / page).read_text()
    body = section(text, name)
    assert "Command: `python " in body, f"{page}, section {name}: the table does not say which command made it"
    assert page in (ROOT / "benchmarks" / script).read_text(), f"benchmarks/{script} does not write to docs/{page}"


def test_write_docs_section_replaces_between_the_markers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = list(sys.path)
    try:
        import _report
    finally:  # what its import put on sys.path (nothing when another test imported it first)
        sys.path[:] = before
    monkeypatch.setattr(_report, "DOCS", tmp_path)
    monkeypatch.setattr(_report, "ROOT", tmp_path)
    page = tmp_path / "bench.md"
    page.write_text("# Bench\n\nkept\n<!-- t:start -->\nold\n<!-- t:end -->\ntail\n")
    _report.write_docs_section("bench.md", "t", "new table\n")
    assert page.read_text() == "# Bench\n\nkept\n<!-- t:start -->\nnew table\n<!-- t:end -->\ntail\n"
    _report.write_docs_section("bench.md", "u", "added")
    assert page.read_text().endswith("tail\n\n<!-- u:start -->\nadded\n<!-- u:end -->\n")
    with pytest.raises(FileNotFoundError, match="page='nope.md'"):
        _report.write_docs_section("nope.md", "t", "x")
