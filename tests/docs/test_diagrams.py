"""The docs cannot drift silently: mermaid blocks are sound and the names they cite exist.

- Every ```mermaid block in ``docs/*.md`` is non-empty, starts with a known diagram type and has
  balanced blocks (``subgraph``/``loop``/``alt``/``opt``/... against ``end``), brackets and quotes.
  (These are cheap structural checks, no renderer needed; the diagrams were also parsed by
  mermaid itself when written.)
- In ``docs/architecture.md``, every name written in backticks in the prose (``BlockwiseAdamW.set_formats``,
  ``risk_details``, ``on_fit_start``, ``sample_every``, ``int8``, ``lightning_baoc/sampling/__init__.py``) and every
  dotted name or ``name()`` call in its diagrams must resolve: to an object of the package
  (imported, then ``getattr`` along the dots; instance attributes and dataclass fields count), to
  a Lightning hook or attribute, to an argument of ``BAOC``, to a state format, or to a file of
  the repository.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"

KNOWN_DIAGRAMS = {
    "flowchart", "graph", "sequenceDiagram", "classDiagram", "stateDiagram", "stateDiagram-v2",
    "erDiagram", "gantt", "journey", "pie", "gitGraph", "mindmap", "timeline", "quadrantChart",
    "requirementDiagram", "C4Context", "sankey-beta", "xychart-beta", "block-beta",
}
FLOWCHART_DIRECTIONS = {"TB", "TD", "BT", "RL", "LR"}
SEQUENCE_OPENERS = {"loop", "alt", "opt", "par", "critical", "break", "rect", "box"}
SEQUENCE_MIDDLES = {"else": {"alt"}, "and": {"par"}, "option": {"critical"}}
FILE_SUFFIXES = {"json", "png", "py", "md", "yaml", "yml", "toml", "txt", "pt", "ckpt"}

IDENT = r"[A-Za-z_]\w*"
DOTTED = rf"{IDENT}(?:\.{IDENT})*"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
# In diagrams: dotted names (``GradientSampler.sample``) and calls (``configure_optimizers()``).
DIAGRAM_NAME = re.compile(rf"(?<![\w.])({IDENT}(?:\.{IDENT})+)|(?<![\w.])({IDENT})\(\)")


def mermaid_blocks(path: Path) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang.strip() == "mermaid"]


def statements(block: str) -> list[str]:
    """The block's lines without blanks and ``%%`` comments."""
    lines = [line.strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("%%")]


# ---------------------------------------------------------------------------- name resolution


@lru_cache(maxsize=None)
def package_namespaces() -> dict[str, Any]:
    """``lightning_baoc`` and every submodule, by full and by short name."""
    package = importlib.import_module("lightning_baoc")
    out: dict[str, Any] = {"lightning_baoc": package}
    for info in pkgutil.walk_packages(package.__path__, "lightning_baoc."):
        if info.name.endswith("__main__"):
            continue  # the CLI entry point; importing it is not needed to name things
        module = importlib.import_module(info.name)
        out[info.name] = module
        out.setdefault(info.name.rsplit(".", 1)[1], module)
    return out


@lru_cache(maxsize=None)
def external() -> tuple[dict[str, Any], tuple[Any, ...], frozenset[str], frozenset[str]]:
    """Lightning and torch roots, the classes whose hooks may be named bare, BAOC's arguments, formats."""
    import lightning
    import torch
    from lightning.fabric import Fabric
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import Strategy

    from lightning_baoc import BAOC, FORMATS

    roots = {
        "lightning": lightning,
        "torch": torch,
        "Trainer": Trainer,
        "LightningModule": LightningModule,
        "Callback": Callback,
        "Strategy": Strategy,
        "Fabric": Fabric,
    }
    arguments = frozenset(inspect.signature(BAOC.__init__).parameters) - {"self"}
    return roots, (Callback, LightningModule, Trainer, Strategy), arguments, frozenset(FORMATS)


def _instance_attributes(cls: type) -> set[str]:
    """Attributes a class assigns to ``self`` anywhere in its source, and its dataclass fields."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("lightning_baoc"):
            try:
                source = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            names.update(re.findall(r"\bself\.(\w+)\s*(?::[^=\n]*)?=(?!=)", source))
    return names


def _walk(obj: Any, attrs: list[str]) -> bool:
    for i, attr in enumerate(attrs):
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif inspect.isclass(obj) and i == len(attrs) - 1 and attr in _instance_attributes(obj):
            return True
        else:
            return False
    return True


def resolves(name: str) -> bool:
    """Whether a dotted name exists in the package, in Lightning/torch, as a BAOC argument or format."""
    first, *rest = name.split(".")
    spaces = package_namespaces()
    if first == "lightning_baoc":
        return _walk(spaces["lightning_baoc"], rest)
    candidates = [m for m in spaces.values() if hasattr(m, first)]
    if first in spaces:
        candidates.append(spaces[first])  # a submodule by its short name: ``risk.risk_details``
        if _walk(spaces[first], rest):
            return True
    for module in candidates:
        if module is not spaces.get(first) and _walk(getattr(module, first), rest):
            return True
    roots, hook_owners, arguments, formats = external()
    if first in roots:
        return _walk(roots[first], rest)
    if not rest:
        return first in arguments or first in formats or any(hasattr(owner, first) for owner in hook_owners)
    return False


def prose_names(text: str) -> tuple[list[str], list[str]]:
    """(names to resolve, repository paths to find) in the inline code spans outside fences."""
    names, paths = [], []
    for span in INLINE_CODE.findall(FENCE.sub("", text)):
        span = span.strip()
        if "/" in span and " " not in span:
            paths.append(span)
        elif re.fullmatch(rf"{DOTTED}\.({'|'.join(FILE_SUFFIXES)})", span):
            continue  # a file name such as baoc_allocation.json
        elif m := re.fullmatch(rf"({DOTTED})(?:\(.*\))?", span):
            names.append(m.group(1))  # a name, or a call: its callee
    return names, paths


def diagram_names(block: str) -> list[str]:
    out = []
    for dotted, call in DIAGRAM_NAME.findall(block):
        name = dotted or call
        if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
            continue
        out.append(name)
    return out


# ---------------------------------------------------------------------------- mermaid checks


def check_mermaid(block: str) -> list[str]:
    """Problems of one mermaid block (empty list if none)."""
    lines = statements(block)
    if not lines:
        return ["empty mermaid block"]
    header = lines[0].split()
    kind = header[0]
    if kind not in KNOWN_DIAGRAMS:
        return [f"unknown diagram type {kind!r}; known: {sorted(KNOWN_DIAGRAMS)}"]
    problems = []
    if len(lines) < 2:
        problems.append(f"{kind} block has a header and nothing else")
    for i, line in enumerate(lines, 1):
        if line.count('"') % 2:
            problems.append(f"line {i}: unbalanced double quotes: {line!r}")
    if kind in ("flowchart", "graph"):
        if len(header) > 1 and header[1] not in FLOWCHART_DIRECTIONS:
            problems.append(f"unknown flowchart direction {header[1]!r}; allowed: {sorted(FLOWCHART_DIRECTIONS)}")
        depth = 0
        for i, line in enumerate(lines[1:], 2):
            word = line.split()[0]
            if word == "subgraph":
                depth += 1
            elif word == "end":
                depth -= 1
                if depth < 0:
                    problems.append(f"line {i}: 'end' without a subgraph")
                    depth = 0
            bare = re.sub(r'"[^"]*"', '""', line)  # brackets inside quoted labels do not count
            for open_, close in ("[]", "()", "{}"):
                if bare.count(open_) != bare.count(close):
                    problems.append(f"line {i}: unbalanced {open_}{close}: {line!r}")
        if depth:
            problems.append(f"{depth} subgraph(s) without 'end'")
    if kind == "sequenceDiagram":
        stack: list[str] = []
        for i, line in enumerate(lines[1:], 2):
            word = line.split()[0].rstrip(":")
            if word in SEQUENCE_OPENERS:
                stack.append(word)
            elif word in SEQUENCE_MIDDLES and (not stack or stack[-1] not in SEQUENCE_MIDDLES[word]):
                problems.append(f"line {i}: {word!r} outside {sorted(SEQUENCE_MIDDLES[word])}")
            elif word == "end":
                if not stack:
                    problems.append(f"line {i}: 'end' closes nothing")
                else:
                    stack.pop()
        if stack:
            problems.append(f"unclosed block(s): {stack}")
    return problems


# ---------------------------------------------------------------------------- tests


DOC_FILES = sorted(DOCS.glob("*.md"))


def test_architecture_doc_has_both_diagrams() -> None:
    kinds = [statements(b)[0].split()[0] for b in mermaid_blocks(ARCHITECTURE)]
    assert "flowchart" in kinds and "sequenceDiagram" in kinds, kinds


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_mermaid_blocks_are_sound(path: Path) -> None:
    text = path.read_text()
    blocks = mermaid_blocks(path)
    assert len(blocks) == text.count("```mermaid"), f"{path.name}: a ```mermaid fence is not closed"
    for n, block in enumerate(blocks):
        problems = check_mermaid(block)
        assert not problems, f"{path.name}, mermaid block {n}: {problems}"


def test_architecture_prose_names_exist() -> None:
    names, paths = prose_names(ARCHITECTURE.read_text())
    assert len(names) > 50, "the name extraction found too little: has the doc's markup changed?"
    missing = sorted({n for n in names if not resolves(n)})
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"
    absent = sorted({p for p in paths if not (ROOT / p).exists()})
    assert not absent, f"docs/architecture.md cites paths that do not exist: {absent}"


def test_architecture_diagram_names_exist() -> None:
    names = [n for block in mermaid_blocks(ARCHITECTURE) for n in diagram_names(block)]
    assert len(names) > 30, "the diagram name extraction found too little"
    missing = sorted({n for n in names if not resolves(n)})
    assert not missing, f"docs/architecture.md's diagrams name what the code does not have: {missing}"


def test_the_checks_catch_drift() -> None:
    """The checks have teeth: renamed names, broken blocks and unknown types fail."""
    assert resolves("BlockwiseAdamW.set_formats") and resolves("risk_details")
    assert resolves("lightning_baoc.risk.risk_details") and resolves("BAOCController.pending")
    assert resolves("on_before_optimizer_step") and resolves("sample_every") and resolves("int8")
    assert not resolves("BlockwiseAdamW.set_format")
    assert not resolves("risk_detail") and not resolves("lightning_baoc.risk.nothing")
    assert not resolves("on_before_optimiser_step") and not resolves("int4")
    assert prose_names("`BAOC(memory_budget=0.3)`, `x.json`, `a + b`\n```\n`no`\n```\n") == (["BAOC"], [])
    assert check_mermaid("   \n%% only a comment\n") == ["empty mermaid block"]
    assert check_mermaid("flowchart XY\n  A --> B")
    assert check_mermaid("flowchart TD\n  subgraph S\n  A --> B")
    assert check_mermaid('flowchart TD\n  A["x] --> B')
    assert check_mermaid("sequenceDiagram\n  loop x\n  A->>B: m")
    assert check_mermaid("sequenceDiagram\n  A->>B: m\n  else\n")
    assert check_mermaid("sequence\n  A->>B: m")
    assert not check_mermaid("sequenceDiagram\n  alt a\n  A->>B: m\n  else b\n  B->>A: n\n  end")
