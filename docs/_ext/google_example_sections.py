"""A griffe extension for the API reference: Google-style ``Example:`` sections are examples.

The package's docstrings head their doctests ``Example:``, which griffe's Google parser reads as an
admonition titled "Example" and renders as Markdown, so ``>>>`` lines become block quotes and
``stats["0"]["snr"]`` a broken reference link. Renamed ``Examples:``, the section is parsed as
examples and the doctests are rendered as Python code.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension

EXAMPLE_HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.M)


class GoogleExampleSections(Extension):
    """Rename ``Example:`` section headings to ``Examples:`` in every docstring."""

    def on_instance(self, **kwargs: Any) -> None:
        obj = kwargs["obj"]
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
