"""One line of ``lightning-baoc check``'s checklist: :class:`CheckResult`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckResult:
    """One line of the checklist.

    Attributes:
        name: the check (``"formats served"``).
        passed: whether it passed.
        detail: what was found, with the figures.
        fix: how to fix a failure (empty when it passed).
        figures: the figures behind ``detail``, by name (the memory budget's: ``budget_bytes``,
            ``fp32_bytes`` and the device state bytes of each phase, ``start``, ``warm-up``,
            ``conversion`` (its bound) and ``steady``); empty where a check has none.
    """

    name: str
    passed: bool
    detail: str
    fix: str = ""
    figures: dict[str, int] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """``"PASS"`` or ``"FAIL"``."""
        return "PASS" if self.passed else "FAIL"


__all__ = ["CheckResult"]
