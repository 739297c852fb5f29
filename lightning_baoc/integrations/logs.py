"""BAOC's log lines, one per event wherever logging is set up: plain Python, Hydra, pytest's ``caplog``.

The callback's lines (the start allocation, each allocation, the summary, the memory line at fit end)
are records of the ``lightning_baoc.integrations`` logger (:data:`LOGGER`), written on rank zero by
:func:`rank_zero_info`. They used to be Lightning's ``rank_zero_info`` records, of the
``lightning.pytorch`` logger; the ``lightning`` package gives its logger a console handler of its own
and lets records propagate to the root logger too, so once an application configures the root
logger (Hydra does, for every run) each line printed twice: by Lightning's handler and by the
root's (issue 61).

The logger is at level ``INFO`` (as Lightning's own are), propagates, and has one handler,
:class:`Unhandled`, that writes a record to ``sys.stderr`` only when no handler above it would: when
the application has configured logging (Hydra, ``logging.basicConfig``, pytest's capture), the
application's handlers print the line, once; when nothing is configured (a plain script), this
handler prints it, as ``INFO: BAOC: ...``, the look of Lightning's lines around it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

#: The logger of the callback's lines.
LOGGER = "lightning_baoc.integrations"


class Unhandled(logging.Handler):
    """Writes a record to ``sys.stderr`` (looked up at each record, so captures see it) only when no
    handler of the loggers above would handle it: Python's last-resort handler, for every level.

    Example:
        >>> import io, contextlib
        >>> log = logging.getLogger("lightning_baoc.integrations.example")
        >>> log.setLevel(logging.INFO); log.addHandler(Unhandled()); log.propagate = False
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     log.info("BAOC: phase warmup")
        >>> err.getvalue()
        'INFO: BAOC: phase warmup\\n'
    """

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if _handled_above(logging.getLogger(record.name), record.levelno):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a failing handler never raises
            self.handleError(record)


def _handled_above(logger: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` from ``logger`` reaches a handler other than :class:`Unhandled`."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, Unhandled) and level >= h.level for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent  # type: ignore[assignment]
    return False


def events_logger() -> logging.Logger:
    """The logger of BAOC's lines, :data:`LOGGER`, set up once: level ``INFO``, one :class:`Unhandled`.

    Example:
        >>> log = events_logger()
        >>> log.name, log.level == logging.INFO, [type(h).__name__ for h in log.handlers]
        ('lightning_baoc.integrations', True, ['Unhandled'])
    """
    log = logging.getLogger(LOGGER)
    if not any(isinstance(h, Unhandled) for h in log.handlers):
        log.setLevel(logging.INFO)
        log.addHandler(Unhandled())
    return log


def rank_zero_info(message: Any, *args: Any, **kwargs: Any) -> None:
    """Log ``message`` at ``INFO`` on :data:`LOGGER`, on rank zero only (Lightning's ``rank_zero_info``,
    on BAOC's logger; the rank is the one Lightning set for this process).

    Example:
        >>> rank_zero_info("BAOC: phase warmup, 20 blocks")  # doctest: +SKIP
    """
    # imported here: this module loads without Lightning (tests/test_imports.py); its callers have it
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) != 0:
        return
    kwargs.setdefault("stacklevel", 2)  # the caller's line
    events_logger().info(message, *args, **kwargs)


__all__ = ["LOGGER", "Unhandled", "events_logger", "rank_zero_info"]
