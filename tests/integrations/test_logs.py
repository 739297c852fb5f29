"""BAOC's log lines (``lightning_baoc/integrations/logs.py``): one per event whatever configured logging.

With nothing configured (a plain script) BAOC's own handler prints the line; when the application configured
the root logger (Hydra, ``logging.basicConfig``) only the application's handler does; pytest's ``caplog``
captures it. ``tests/examples/test_commands.py`` counts the lines of a real Hydra run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest

from lightning_baoc.integrations import callback
from lightning_baoc.integrations.logs import LOGGER, Unhandled, events_logger, rank_zero_info


@contextlib.contextmanager
def root_handlers(*handlers: logging.Handler) -> Iterator[None]:
    """The root logger with only ``handlers`` (none: logging not configured, as in a plain script); pytest's
    capture handlers, which it adds at the start of each test phase, put back after."""
    root = logging.getLogger()
    before = root.handlers
    root.handlers = list(handlers)
    try:
        yield
    finally:
        root.handlers = before


def test_the_callback_logs_on_baocs_logger() -> None:
    assert callback.rank_zero_info is rank_zero_info
    log = events_logger()
    assert log is logging.getLogger(LOGGER) and log.level == logging.INFO and log.propagate
    assert [type(h) for h in log.handlers] == [Unhandled]
    assert events_logger().handlers == log.handlers  # set up once


def test_with_nothing_configured_baocs_handler_prints_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    with root_handlers():
        rank_zero_info("BAOC: phase warmup, 20 blocks")
    assert capsys.readouterr() == ("", "INFO: BAOC: phase warmup, 20 blocks\n")


def test_with_a_configured_root_logger_only_its_handler_prints_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    said: list[str] = []

    class Hydras(logging.Handler):  # what Hydra's job logging puts on the root logger
        def emit(self, record: logging.LogRecord) -> None:
            said.append(f"[{record.name}][{record.levelname}] - {record.getMessage()}")

    with root_handlers(Hydras()):
        rank_zero_info("BAOC: warmup allocation at step %d", 8)
    assert said == [f"[{LOGGER}][INFO] - BAOC: warmup allocation at step 8"]
    assert capsys.readouterr() == ("", "")  # not a second time


def test_a_handler_above_that_takes_only_warnings_leaves_info_to_baocs(capsys: pytest.CaptureFixture[str]) -> None:
    warnings_only = logging.StreamHandler()
    warnings_only.setLevel(logging.WARNING)
    with root_handlers(warnings_only):
        rank_zero_info("BAOC memory: planned peak 1 KiB")
    assert capsys.readouterr().err == "INFO: BAOC memory: planned peak 1 KiB\n"


def test_caplog_captures_each_line_once(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        rank_zero_info("BAOC: phase warmup")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [(LOGGER, logging.INFO, "BAOC: phase warmup")]
    assert capsys.readouterr().err == ""


def test_other_ranks_log_nothing(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with root_handlers():
        rank_zero_info("BAOC: phase warmup")
    assert capsys.readouterr().err == ""
