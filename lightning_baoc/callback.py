"""The old home of the Lightning callback, kept so existing imports work; it now lives in
:mod:`lightning_baoc.integrations.callback`."""

from __future__ import annotations

from .integrations.callback import BAOC

__all__ = ["BAOC"]
