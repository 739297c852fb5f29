"""The old home of the Fabric strategy, kept so existing imports work; it now lives in
:mod:`lightning_baoc.integrations.fabric`."""

from __future__ import annotations

from .integrations.fabric import BAOCStrategy

__all__ = ["BAOCStrategy"]
