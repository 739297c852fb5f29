"""Shared by the documentation tests (``tests/docs/``): reading a page's bullet lists."""

from __future__ import annotations


def bullets(text: str) -> list[str]:
    """The text's top-level bullet items (``- ...``), continuation lines joined."""
    items: list[str] = []
    for line in text.splitlines():
        if line.startswith("- "):
            items.append(line)
        elif items and line.startswith("  ") and line.strip():
            items[-1] += " " + line.strip()
    return items
