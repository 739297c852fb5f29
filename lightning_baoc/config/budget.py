"""Budgets as users write them, turned into absolute numbers, and human-readable units.

A memory budget is a fraction of the fp32 AdamW state memory (``0.35``, ``"35%"``) or an absolute
size (``6_000_000_000``, ``"6GB"``, ``"512MiB"``). A time budget is a multiple of the fp32 AdamW
optimizer-step time (``1.10`` allows a 10% slower step) or an absolute time (``"12ms"``).

Pure Python: no torch, no numpy (the solver and the CLI both use it).
"""

from __future__ import annotations

import math
import numbers
import re
import warnings

#: Size units accepted in memory budgets: decimal (SI) and binary (IEC) multiples of a byte.
MEMORY_UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "PIB": 2**50,
}

#: Time units accepted in absolute time budgets, in seconds.
TIME_UNITS: dict[str, float] = {"S": 1.0, "MS": 1e-3, "US": 1e-6, "µS": 1e-6, "NS": 1e-9}

_UNIT_NAMES = "B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB"

#: An int memory budget below this many bytes, where a user wrote it, is almost certainly a fraction
#: written without its decimal point (``memory_budget=1`` for ``1.0``): it is honoured, with a
#: warning (``parse_memory_budget(..., warn_small_int=True)``).
SMALL_INT_BUDGET = 1024

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_SIZE_RE = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-z]*)\s*$")
_PERCENT_RE = re.compile(rf"^\s*({_NUMBER})\s*%\s*$")
_TIME_RE = re.compile(rf"^\s*({_NUMBER})\s*(s|ms|us|µs|ns)\s*$", re.IGNORECASE)
_MULTIPLE_RE = re.compile(rf"^\s*({_NUMBER})\s*[xX]?\s*$")

#: The forms a memory budget may take, as error messages and the CLI help list them.
MEMORY_BUDGET_FORMS = (
    "a fraction in (0, 1] of the optimizer state plain AdamW would hold (0.35 or '35%'), "
    "or an absolute size: an int of bytes or a string with a unit "
    "(B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB; e.g. '6GB', '512MiB')"
)
#: The forms a time budget may take.
TIME_BUDGET_FORMS = (
    "a multiple of the fp32 AdamW optimizer-step time >= 1.0 (1.10 or '1.10x' allows a 10% slower "
    "step), or an absolute time: a string with a unit (s, ms, us, ns; e.g. '12ms')"
)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def parse_memory_budget(
    value: object, fp32_bytes: float | None, argument: str = "memory_budget", warn_small_int: bool = False
) -> int:
    """Turn a memory budget as users write it into bytes.

    Args:
        value: a fraction of the fp32 AdamW state memory (a float in (0, 1], or a string like
            ``"35%"`` or ``"0.35"``), or an absolute size (an int of bytes, or a string with a unit:
            ``"6GB"``, ``"512MiB"``; decimal units are powers of 1000, ``KiB``... powers of 1024).
        fp32_bytes: the fp32 AdamW state bytes a fraction refers to (``None`` if unknown: then only
            absolute budgets are accepted).
        argument: the argument name used in error messages (default: ``"memory_budget"``).
        warn_small_int: warn about an int below :data:`SMALL_INT_BUDGET` bytes (where a user
            wrote the budget: ``memory_budget=1`` is one byte, not 100%) (default: False).

    Returns:
        The budget in bytes, rounded down (a budget is never widened by rounding).

    Raises:
        ValueError: the value is zero, negative, not finite, a fraction above 1, a fraction
            without ``fp32_bytes``, or an unparsable string; the message lists the allowed forms.
        TypeError: the value is neither a number nor a string.

    Example:
        >>> parse_memory_budget(0.25, fp32_bytes=8_000)
        2000
        >>> parse_memory_budget("512MiB", fp32_bytes=None)
        536870912
        >>> parse_memory_budget("6GB", fp32_bytes=None)
        6000000000
    """
    if isinstance(value, str):
        text = value.strip()
        percent = _PERCENT_RE.match(text)
        if percent:
            return _fraction_bytes(float(percent.group(1)) / 100.0, fp32_bytes, argument, value)
        match = _SIZE_RE.match(text)
        if not match:
            raise ValueError(f"Unparsable {argument}={value!r}; allowed: {MEMORY_BUDGET_FORMS}")
        number, unit = float(match.group(1)), match.group(2)
        if not unit:
            # A bare number in a string (from a command line or a config) is read like a float.
            return _fraction_bytes(number, fp32_bytes, argument, value)
        scale = MEMORY_UNITS.get(unit.upper())
        if scale is None:
            raise ValueError(
                f"Unknown unit {unit!r} in {argument}={value!r}; allowed units: {_UNIT_NAMES} "
                f"(case-insensitive); allowed: {MEMORY_BUDGET_FORMS}"
            )
        return _absolute_bytes(number * scale, argument, value)
    if not _is_real(value):
        raise TypeError(
            f"{argument} must be a number or a string, got {value!r} of type {type(value).__name__}; "
            f"allowed: {MEMORY_BUDGET_FORMS}"
        )
    if isinstance(value, numbers.Integral):
        if warn_small_int and 0 < int(value) < SMALL_INT_BUDGET:
            warnings.warn(
                f"{argument}={value!r} is an int, read as {int(value)} byte{'s' if int(value) != 1 else ''} of optimizer "
                f"state; for a fraction write a float in (0, 1] "
                f"({'1.0 or 100% for the whole state' if int(value) == 1 else 'e.g. 0.35 or 35%'}), for a size a "
                f"string with a unit ('512MiB')",
                UserWarning,
                stacklevel=2,
            )
        return _absolute_bytes(int(value), argument, value)
    return _fraction_bytes(float(value), fp32_bytes, argument, value)


def _fraction_bytes(fraction: float, fp32_bytes: float | None, argument: str, raw: object) -> int:
    if not math.isfinite(fraction) or fraction <= 0.0:
        raise ValueError(f"{argument}={raw!r} must be positive and finite; allowed: {MEMORY_BUDGET_FORMS}")
    if fraction > 1.0:
        raise ValueError(
            f"{argument}={raw!r} is a fraction above 1 of the fp32 AdamW state memory: a budget above "
            f"full fp32 AdamW needs no allocation. Use a fraction in (0, 1], or an absolute size "
            f"(an int of bytes or a string like '6GB'); allowed: {MEMORY_BUDGET_FORMS}"
        )
    if fp32_bytes is None:
        raise ValueError(
            f"{argument}={raw!r} is a fraction of the fp32 AdamW state memory, which is unknown here "
            f"(not every block has an 'fp32' memory entry); pass an absolute size instead, e.g. '6GB'"
        )
    amount = fraction * fp32_bytes
    # 0.6 * 2400 is 1439.9999999999998 in floating point: snap such products to the integer meant
    nearest = round(amount)
    if abs(amount - nearest) <= 1e-9 * max(1.0, abs(amount)):
        amount = nearest
    result = int(math.floor(amount))
    if result <= 0:
        raise ValueError(f"{argument}={raw!r} is less than one byte of {fp32_bytes} fp32 bytes; allowed: {MEMORY_BUDGET_FORMS}")
    return result


def _absolute_bytes(amount: float | int, argument: str, raw: object) -> int:
    if isinstance(amount, float) and not math.isfinite(amount):
        raise ValueError(f"{argument}={raw!r} must be finite; allowed: {MEMORY_BUDGET_FORMS}")
    if amount <= 0:
        raise ValueError(f"{argument}={raw!r} must be positive; allowed: {MEMORY_BUDGET_FORMS}")
    result = int(math.floor(amount))
    if result <= 0:
        raise ValueError(f"{argument}={raw!r} is less than one byte; allowed: {MEMORY_BUDGET_FORMS}")
    return result


def parse_time_budget(value: object, fp32_seconds: float | None, argument: str = "time_budget") -> float:
    """Turn a time budget as users write it into seconds per optimizer step.

    Args:
        value: a multiple of the fp32 AdamW step time, at least 1.0 (a number, or a string like
            ``"1.10"`` / ``"1.10x"``), or an absolute time (a string with a unit: ``"12ms"``).
        fp32_seconds: the fp32 AdamW step time a multiple refers to (``None`` if unknown: then only
            absolute budgets are accepted).
        argument: the argument name used in error messages (default: ``"time_budget"``).

    Returns:
        The budget in seconds.

    Raises:
        ValueError: zero, negative or non-finite values, a multiple below 1.0, a multiple without
            ``fp32_seconds``, or an unparsable string; the message lists the allowed forms.
        TypeError: the value is neither a number nor a string.

    Example:
        >>> parse_time_budget(1.10, fp32_seconds=2.0)
        2.2
        >>> parse_time_budget("12ms", fp32_seconds=None)
        0.012
    """
    if isinstance(value, str):
        timed = _TIME_RE.match(value)
        if timed:
            seconds = float(timed.group(1)) * TIME_UNITS[timed.group(2).upper()]
            if not math.isfinite(seconds) or seconds <= 0.0:
                raise ValueError(f"{argument}={value!r} must be positive and finite; allowed: {TIME_BUDGET_FORMS}")
            return seconds
        multiple = _MULTIPLE_RE.match(value)
        if not multiple:
            raise ValueError(f"Unparsable {argument}={value!r}; allowed: {TIME_BUDGET_FORMS}")
        return _multiple_seconds(float(multiple.group(1)), fp32_seconds, argument, value)
    if not _is_real(value):
        raise TypeError(
            f"{argument} must be a number or a string, got {value!r} of type {type(value).__name__}; "
            f"allowed: {TIME_BUDGET_FORMS}"
        )
    return _multiple_seconds(float(value), fp32_seconds, argument, value)


def is_absolute_time(value: object) -> bool:
    """Whether a valid time budget is an absolute time (a string with a unit) rather than a multiple.

    Example:
        >>> is_absolute_time("12ms"), is_absolute_time(1.2), is_absolute_time("1.2x"), is_absolute_time(None)
        (True, False, False, False)
    """
    if value is None:
        return False
    try:
        parse_time_budget(value, fp32_seconds=None)  # a multiple needs the fp32 time: it raises
    except (TypeError, ValueError):
        return False
    return True


def absolute_time_with_prior_error(value: object, argument: str, fix: str) -> ValueError:
    """The error for an absolute time budget where step times are the unitless prior costs.

    The prior costs (:data:`~lightning_baoc.costs.calibration.PRIOR_STEP_COST`) are relative to the fp32
    AdamW step and carry no unit, so seconds cannot be compared with them: one rule and one message
    for the callback, ``plan`` and ``check``.

    Args:
        value: the time budget as given.
        argument: its name where the user gave it (``"time_budget"``, ``"--time-budget"``).
        fix: how to measure seconds instead, in the caller's terms (``"calibration='auto'"``).
    """
    return ValueError(
        f"Invalid {argument}={value!r}: it is an absolute time, but step times here are the built-in prior "
        f"costs, which are relative to fp32 AdamW and have no unit, so an absolute time cannot be compared "
        f"with them. Give a multiple of the fp32 step instead (e.g. {argument}=1.2), or {fix}"
    )


def _multiple_seconds(multiple: float, fp32_seconds: float | None, argument: str, raw: object) -> float:
    if not math.isfinite(multiple) or multiple <= 0.0:
        raise ValueError(f"{argument}={raw!r} must be positive and finite; allowed: {TIME_BUDGET_FORMS}")
    if multiple < 1.0:
        raise ValueError(
            f"{argument}={raw!r} is a multiple of the fp32 AdamW step time and must be >= 1.0 "
            f"(1.10 allows a 10% slower step; write {1.0 + multiple:g} for a {multiple:.0%} slowdown); "
            f"allowed: {TIME_BUDGET_FORMS}"
        )
    if fp32_seconds is None:
        raise ValueError(
            f"{argument}={raw!r} is a multiple of the fp32 AdamW step time, which is unknown here "
            f"(not every block has an 'fp32' time entry); pass an absolute time instead, e.g. '12ms'"
        )
    return multiple * fp32_seconds


def round_up(value: float, decimals: int = 3) -> str:
    """``value`` rounded up to ``decimals`` decimals: a budget written with it is never too small.

    Example:
        >>> round_up(0.25001), round_up(0.25), round_up(1.0000000000000002)
        ('0.251', '0.250', '1.000')
    """
    scale = 10**decimals
    return f"{math.ceil(value * scale - 1e-9) / scale:.{decimals}f}"


def ceil_significant(value: float, digits: int = 3) -> float:
    """``value`` rounded up (away from zero) to ``digits`` significant digits.

    Example:
        >>> ceil_significant(0.011801), ceil_significant(1.88), ceil_significant(1.881)
        (0.0119, 1.88, 1.89)
    """
    if value == 0.0 or not math.isfinite(value):
        return value
    exponent = math.floor(math.log10(abs(value))) - digits + 1
    # a value already on the grid (up to float noise) stays there
    units = math.ceil(abs(value) / 10.0**exponent - 1e-9)
    # written through its decimal digits, so that 1.88 is 1.88 and not 188 * 0.01 = 1.8800000000000001
    return math.copysign(float(f"{units}e{exponent}"), value)


def _format_units(n: float, units: tuple[str, ...], base: float, up: bool) -> str:
    if not math.isfinite(n):
        return str(n)
    value = float(n)
    for i, unit in enumerate(units):
        if abs(value) < base or unit == units[-1]:
            if unit == "B":
                return f"{int(math.ceil(value) if up else round(value))} B"
            if up:
                rounded = ceil_significant(value)
                if abs(rounded) >= base and i + 1 < len(units):  # 1023.6 KiB rounds up to 1 MiB
                    return f"{ceil_significant(value / base):.3g} {units[i + 1]}"
                value = rounded
            return f"{value:.3g} {unit}"
        value /= base
    raise AssertionError("unreachable")  # pragma: no cover


def format_bytes(n: float, up: bool = False) -> str:
    """Bytes in binary units, three significant digits.

    Args:
        n: bytes.
        up: round up, not to the nearest (for a smallest feasible budget: giving the printed
            value back is never too small) (default: False).

    Example:
        >>> format_bytes(1536 * 2**20)
        '1.5 GiB'
        >>> format_bytes(100)
        '100 B'
        >>> format_bytes(2001, up=True), format_bytes(2001)
        ('1.96 KiB', '1.95 KiB')
    """
    return _format_units(n, ("B", "KiB", "MiB", "GiB", "TiB"), 1024.0, up)


def format_decimal_bytes(n: float, up: bool = False) -> str:
    """Bytes in decimal units (GB = 1e9), three significant digits (``up``: rounded up).

    Example:
        >>> format_decimal_bytes(53_907_324_928)
        '53.9 GB'
    """
    return _format_units(n, ("B", "KB", "MB", "GB", "TB"), 1000.0, up)


def format_seconds(seconds: float, up: bool = False) -> str:
    """Seconds in s / ms / us, three significant digits (``up``: rounded up).

    Example:
        >>> format_seconds(0.0123)
        '12.3 ms'
        >>> format_seconds(1.8812, up=True), format_seconds(1.8812)
        ('1.89 s', '1.88 s')
    """
    if not math.isfinite(seconds):
        return str(seconds)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale or unit == "us":
            value = seconds / scale
            if up:
                rounded = ceil_significant(value)
                if abs(rounded) >= 1000 and unit != "s":  # 999.6 ms rounds up to 1 s
                    return f"{ceil_significant(value / 1000):.3g} {'s' if unit == 'ms' else 'ms'}"
                value = rounded
            return f"{value:.3g} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


__all__ = [
    "SMALL_INT_BUDGET",
    "ceil_significant",
    "MEMORY_BUDGET_FORMS",
    "MEMORY_UNITS",
    "TIME_BUDGET_FORMS",
    "TIME_UNITS",
    "format_bytes",
    "format_decimal_bytes",
    "format_seconds",
    "absolute_time_with_prior_error",
    "is_absolute_time",
    "parse_memory_budget",
    "parse_time_budget",
    "round_up",
]
