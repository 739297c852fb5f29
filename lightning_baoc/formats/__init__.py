"""The optimizer-state formats: one per file, and the registry :data:`FORMATS`.

``FORMATS[name]`` is the format object; :func:`resolve_format` gives the format a tensor of a given
shape really gets (1-D tensors have no factored form, tensors under the 8-bit threshold stay
unquantized), and :func:`format_state_bytes` the exact bytes it allocates.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from lightning_baoc.formats.base import (
    Canonical, Shape, StateFormat, StepHyper, StepItem, TensorSpec, factor_dims, numel_of,
)
from lightning_baoc.formats.bf16 import BF16
from lightning_baoc.formats.bf16_momentum import BF16Momentum
from lightning_baoc.formats.factored import Factored
from lightning_baoc.formats.fp32 import FP32
from lightning_baoc.formats.int8 import Int8
from lightning_baoc.formats.int8_factored import Int8Factored
from lightning_baoc.formats.momentum import MOMENTUM_FORMATS
from lightning_baoc.formats.nomomentum import NoMomentum
from lightning_baoc.formats.nomomentum_int8 import NoMomentumInt8
from lightning_baoc.formats.offload import Offload

#: Tensors with fewer elements stay out of the 8-bit formats by default (bitsandbytes keeps
#: tensors under 4096 elements in 32 bit: their bytes are negligible and their scales are not).
DEFAULT_MIN_8BIT_NUMEL = 4096

_ORDER = (FP32, BF16Momentum, BF16, NoMomentum, Int8, Int8Factored, NoMomentumInt8, Factored, Offload)

#: Registry: format name -> format object (read-only), in the order of README.md's "State formats" table.
FORMATS: Mapping[str, StateFormat] = MappingProxyType({cls.name: cls() for cls in _ORDER})


#: The format registry of each update rule (``BlockwiseOptimizer.rule``): AdamW's :data:`FORMATS`,
#: SGD's and Lion's :data:`MOMENTUM_FORMATS`.
RULE_FORMATS: Mapping[str, Mapping[str, StateFormat]] = MappingProxyType(
    {"adamw": FORMATS, "sgd": MOMENTUM_FORMATS, "lion": MOMENTUM_FORMATS}
)


#: The optimizer each update rule is named after, in messages and reports.
RULE_NAMES: Mapping[str, str] = MappingProxyType({"adamw": "AdamW", "sgd": "SGD", "lion": "Lion"})


def formats_of(rule: str) -> Mapping[str, StateFormat]:
    """The format registry of update rule ``rule`` (``"adamw"``, ``"sgd"``, ``"lion"``).

    Example:
        >>> list(formats_of("sgd"))
        ['fp32', 'bf16', 'int8', 'none']
    """
    try:
        return RULE_FORMATS[rule]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown update rule {rule!r}; allowed: {list(RULE_FORMATS)}") from None


def check_format_name(
    value: object, argument: str = "state_format", registry: Mapping[str, StateFormat] | None = None
) -> str:
    """Validate a format name of ``registry`` (default :data:`FORMATS`); raises
    ``TypeError``/``ValueError`` naming ``argument``."""
    registry = FORMATS if registry is None else registry
    if not isinstance(value, str):
        raise TypeError(
            f"{argument} must be a format name (str), got {value!r} of type {type(value).__name__}; "
            f"allowed: {list(registry)}"
        )
    if value not in registry:
        raise ValueError(f"Unknown {argument} {value!r}; allowed: {list(registry)}")
    return value


def resolve_format(name: str, shape: Shape, min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL) -> str:
    """The format a tensor of ``shape`` really gets when ``name`` is asked for.

    Follows each format's ``fallback`` while the format cannot hold the shape: ``factored`` on a
    1-D tensor becomes ``nomomentum``; ``int8_factored`` becomes ``int8``, then ``fp32`` under the
    8-bit threshold; ``nomomentum_int8`` under the threshold becomes ``nomomentum``.

    Example:
        >>> resolve_format("factored", (512,))
        'nomomentum'
        >>> resolve_format("int8", (1024, 1024))
        'int8'
    """
    return resolve_in(FORMATS, name, shape, min_8bit_numel)


def resolve_in(registry: Mapping[str, StateFormat], name: str, shape: Shape, min_8bit_numel: int) -> str:
    """:func:`resolve_format` over another registry (:data:`MOMENTUM_FORMATS`)."""
    check_format_name(name, registry=registry)
    fmt = registry[name]
    while not fmt.accepts(shape, min_8bit_numel):
        if fmt.fallback is None:  # pragma: no cover - every restricted format has a fallback
            raise ValueError(f"format {fmt.name!r} cannot hold shape {tuple(shape)}")
        fmt = registry[fmt.fallback]
    return fmt.name


def format_state_bytes(
    name: str, shape: Shape, min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL, rule: str = "adamw"
) -> int:
    """Exact state bytes allocated for a tensor of ``shape`` asked to use format ``name`` of the
    update rule ``rule``'s registry (:func:`formats_of`; default: AdamW's :data:`FORMATS`).

    This counts every stored tensor (codes, scales, factors) of the resolved format, wherever it
    lives; for ``offload`` these are host bytes (see :class:`~.offload.Offload`).

    Example:
        >>> format_state_bytes("fp32", (1024, 1024))
        8388608
        >>> format_state_bytes("int8", (1024, 1024))  # per moment: 1 B a code, 2 B a scale per 32, 1 B per 1,024
        2230272
    """
    registry = formats_of(rule)
    return registry[resolve_in(registry, name, shape, min_8bit_numel)].state_bytes(shape)


__all__ = [
    "FORMATS",
    "MOMENTUM_FORMATS",
    "DEFAULT_MIN_8BIT_NUMEL",
    "RULE_FORMATS",
    "RULE_NAMES",
    "Canonical",
    "StateFormat",
    "StepHyper",
    "StepItem",
    "TensorSpec",
    "check_format_name",
    "factor_dims",
    "format_state_bytes",
    "formats_of",
    "numel_of",
    "resolve_format",
    "resolve_in",
]
