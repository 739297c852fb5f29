"""The old home of ``lightning-baoc check``, kept so existing imports work; the checklist now lives
in :mod:`lightning_baoc.tools.check`."""

from __future__ import annotations

from .tools.check import (
    HYSTERESIS_RANGE,
    MAX_SAMPLER_OVERHEAD,
    MIN_WARMUP_SAMPLES,
    OVERHEAD_PER_GRADIENT_SHARE,
    CheckResult,
    SamplerEstimate,
    add_arguments,
    build_component,
    default_device,
    render,
    resolve_model,
    run,
    run_checks,
    sampler_overhead,
)

__all__ = [
    "HYSTERESIS_RANGE",
    "MAX_SAMPLER_OVERHEAD",
    "MIN_WARMUP_SAMPLES",
    "OVERHEAD_PER_GRADIENT_SHARE",
    "CheckResult",
    "SamplerEstimate",
    "add_arguments",
    "build_component",
    "default_device",
    "render",
    "resolve_model",
    "run",
    "run_checks",
    "sampler_overhead",
]
