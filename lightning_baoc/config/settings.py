"""Every setting of BAOC, declared once: :data:`SETTINGS`, and the one validator that checks them.

A :class:`Setting` holds a setting's name, its type (``Literal[...]`` where it takes a fixed set),
default, range and help. The name is the one word for the setting everywhere: the argument of
``BAOC`` and ``BAOCStrategy``, the key of a config file's ``baoc`` section (``baoc.sample_every``),
a dotlist override (``baoc.sample_every=5``), LightningCLI's option (``--baoc.sample_every``), the
JSON Schema's property and every error message. Everything else is derived from :data:`SETTINGS`,
in its order:

- :class:`BAOCConfig`, the controller's validated settings (all but the adapters' own ``report``);
- the checks of ``BAOC.__init__`` and ``BAOCStrategy.__init__``, whose signatures spell every setting
  out (annotations LightningCLI validates, a docstring whose ``Args:`` it shows as help) and are held
  to this table by ``tests/config/test_settings.py`` (:func:`settings_of` gathers their arguments);
- the ``baoc`` section of a config file: its dataclass, loader, defaults and JSON Schema
  (:mod:`lightning_baoc.config.files`).

Adding a setting is one entry here, its parameter in the two signatures (the test names what is
missing), and its use in the controller. :func:`check_settings` is the
only validator: a bad value raises :class:`SettingError`, which names the setting; the config
loader adds the file (or the override) and reports every error of a config at once
(:func:`check_setting` for each value, :func:`rule_errors` for the rules between them).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

from lightning_baoc.config.budget import (
    absolute_time_with_prior_error,
    is_absolute_time,
    parse_memory_budget,
    parse_time_budget,
)
from lightning_baoc.formats import DEFAULT_MIN_8BIT_NUMEL, FORMATS, MOMENTUM_FORMATS
from lightning_baoc.sampling import DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS
from lightning_baoc.sampling.blocks import GRANULARITIES


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of a setting that has none (``memory_budget``).
REQUIRED: Any = _Required()

#: Ring samples the statistics need: an SNR and a cosine of consecutive samples need two.
MIN_SAMPLES = 2

#: A state format's name: AdamW's (:data:`~lightning_baoc.FORMATS`) or SGD's and Lion's
#: (:data:`~lightning_baoc.formats.MOMENTUM_FORMATS`); install checks it against the optimizer's.
FormatName = Literal[tuple(dict.fromkeys([*FORMATS, *MOMENTUM_FORMATS]))]  # type: ignore[valid-type]
#: What ``BAOC(report=...)`` accepts: ``True`` (table, JSON, and the PNG when matplotlib is
#: installed), ``"json"`` (table and JSON), ``"png"`` (all three; matplotlib required), ``False``.
ReportSetting = Union[bool, Literal["json", "png"]]


class SettingError(ValueError, TypeError):
    """A setting's value refused; a ``ValueError`` (and a ``TypeError``, as a wrong type is).

    Attributes:
        setting: the setting's name (``"sample_every"``), its argument and its config key alike.
        config_message: the message a config file's loader shows after the key.

    Example:
        >>> try:
        ...     check_settings({"sample_every": 0})
        ... except SettingError as err:
        ...     print(err.setting, "|", err)
        sample_every | Invalid sample_every=0; expected an int >= 1
    """

    def __init__(self, setting: str, message: str, config_message: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting
        self.config_message = message if config_message is None else config_message


@dataclass(frozen=True)
class Setting:
    """One setting, as the callback, the Fabric strategy and a config file's ``baoc`` section take it.

    Args:
        name: the argument of ``BAOC``, ``BAOCStrategy`` and :class:`BAOCConfig`, and the key of a
            config's ``baoc`` section.
        type: the type (``Literal[...]`` for a fixed set; a list of a ``Literal`` takes each once).
        help: one paragraph: the CLI help, the docstrings and the schema's description.
        default: the default (:data:`REQUIRED`: none).
        minimum: numbers are ``>= minimum`` (default: ``None``).
        exclusive_minimum: numbers are ``> exclusive_minimum`` (default: ``None``).
        fraction_maximum: floats (fractions) are ``<= fraction_maximum``; ints are not (default: ``None``).
        min_items: a list holds at least this many items (default: ``None``).
        syntax: called with ``(value, name)`` once the type holds, to check a string's syntax;
            raises ``ValueError``/``TypeError`` naming the setting (default: ``None``).
        controller: a setting of the controller (:class:`BAOCConfig`), or only of the adapters
            (default: ``True``).
        allowed: what a list of choices takes, in words, for an error naming a value outside them
            (default: ``None``: the list of choices).

    Example:
        >>> SETTING["sample_every"].default
        10
    """

    name: str
    type: Any
    help: str
    default: Any = REQUIRED
    minimum: float | None = None
    exclusive_minimum: float | None = None
    fraction_maximum: float | None = None
    min_items: int | None = None
    syntax: Callable[[Any, str], Any] | None = None
    controller: bool = True
    allowed: str | None = None

    @property
    def required(self) -> bool:
        """Whether the setting has no default."""
        return self.default is REQUIRED


def _memory_budget_syntax(value: Any, name: str) -> None:
    parse_memory_budget(value, fp32_bytes=float(1 << 62), argument=name)


def _time_budget_syntax(value: Any, name: str) -> None:
    parse_time_budget(value, fp32_seconds=1.0, argument=name)


#: What ``formats`` takes: the optimizer is not known until install (which checks the formats are
#: its own), so both lists are named; ``none`` (no momentum buffer) is SGD's and Lion's only.
FORMATS_ALLOWED = (
    f"AdamW's formats: {list(FORMATS)}; SGD's and Lion's: {list(MOMENTUM_FORMATS)} (list formats of the "
    f"optimizer configure_optimizers returns)"
)


# ---------------------------------------------------------------------------- the declaration

#: Every setting, in the order of ``BAOC``'s arguments (and of a config's ``baoc`` section, the schema, the docs).
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "memory_budget", Union[int, float, str],
        "Optimizer-state memory allowed: a fraction in (0, 1] of the state torch.optim.AdamW would hold on "
        "the parameters trained (8 bytes per fp32 parameter, 4 per bf16 one; parameters added later "
        "included) (0.35 or '35%'), or an absolute size: an int of bytes or a string with a unit ('6GB', "
        "'512MiB').",
        exclusive_minimum=0, fraction_maximum=1.0, syntax=_memory_budget_syntax,
    ),
    Setting(
        "time_budget", Union[float, str, None],
        "Optimizer-step time allowed: a multiple >= 1 of the fp32 AdamW step (1.2 or '1.2x') or an "
        "absolute time ('12ms', with calibration 'auto' only). null: no limit.",
        default=None, minimum=1.0, syntax=_time_budget_syntax,
    ),
    Setting(
        "warmup_steps", int,
        "Optimizer steps, sampled, before the first allocation from measured statistics (>= sample_every + "
        "2); they run in the start allocation, within the budgets (see 'initial').",
        default=200, minimum=1,
    ),
    Setting(
        "sample_every", int,
        "Sample the gradients every N optimizer steps during warm-up (and the step after, for the lag-1 "
        "cosine).",
        default=10, minimum=1,
    ),
    Setting(
        "granularity", Literal[GRANULARITIES],  # type: ignore[valid-type]
        "Block granularity: 'module' (one block per module that owns parameters), 'layer' (one block per "
        "repeated layer, e.g. a transformer block) or 'param' (one block per tensor).",
        default="module",
    ),
    Setting(
        "blocks", Optional[dict[str, Union[str, list[str]]]],
        "Named blocks: block name -> glob or list of globs over parameter names (fnmatch, case-sensitive), "
        "matched before 'granularity'. Every glob must match a trainable parameter.",
        default=None,
    ),
    Setting(
        "formats", Optional[list[FormatName]],  # type: ignore[valid-type]
        "The optimizer-state formats the solver may pick (the optimizer's: AdamW's, or SGD's and Lion's "
        "fp32, bf16, int8, none). null: every format of the optimizer the device serves.",
        default=None, min_items=1, allowed=FORMATS_ALLOWED,
    ),
    Setting(
        "corrections", Optional[list[Literal["none", "ecc8", "ecc16"]]],
        "Master-weight corrections the solver pairs with the formats of bf16/fp16 weights, per block, their "
        "bytes in the memory budget. null: all three (none, ecc8, ecc16) where weights are bf16/fp16, unless the "
        "optimizer holds its own (weight_correction), kept outside the budget. [none] opts out.", default=None,
        min_items=1,
    ),
    Setting(
        "reevaluate_every_n_epochs", Optional[int],
        "Re-evaluate the allocation every N epochs. null: never on a schedule.",
        default=None, minimum=1,
    ),
    Setting(
        "monitor", Optional[str],
        "A validation metric (as logged with self.log); a plateau of it triggers a re-evaluation.",
        default=None,
    ),
    Setting(
        "mode", Literal["min", "max"],
        "'min' if 'monitor' improves downwards (loss, perplexity), 'max' if upwards.",
        default="min",
    ),
    Setting(
        "patience", int,
        "Validation checks without improvement of 'monitor' before a re-evaluation.",
        default=3, minimum=1,
    ),
    Setting(
        "min_delta", float,
        "Smallest change of 'monitor' counted as an improvement.",
        default=0.0, minimum=0.0,
    ),
    Setting(
        "hysteresis", float,
        "A re-evaluation migrates only if the new allocation lowers the total risk by more than this "
        "fraction (or the current one breaks a budget); keeps allocations from flapping.",
        default=0.1, minimum=0.0,
    ),
    Setting(
        "horizon", int,
        "Optimizer steps over which the risk model lets zero-mean update noise average out.",
        default=200, minimum=1,
    ),
    Setting(
        "sparse_sampling", int,
        "After warm-up, sample N times less often.",
        default=4, minimum=1,
    ),
    Setting(
        "capacity", int,
        "Sampling steps kept in the ring buffer (the statistics' window).",
        default=DEFAULT_CAPACITY, minimum=MIN_SAMPLES,
    ),
    Setting(
        "max_elements", int,
        "Gradient elements sampled per block (a fixed random subset).",
        default=DEFAULT_MAX_ELEMENTS, minimum=1,
    ),
    Setting(
        "instrument_share", float,
        "Share of the user's AdamW state (or 256 KiB if more) the sampler's ring and the risk model's shadow "
        "may hold, outside the budget: above it max_elements and the shadow shrink, to 32 sampled elements per "
        "block and one 1024-element super-block per tensor at least.", default=0.05, minimum=0.0,
    ),
    Setting(
        "min_8bit_numel", int,
        "Tensors with fewer elements stay out of the 8-bit formats (as bitsandbytes), in an optimizer BAOC "
        "converts; a blockwise optimizer keeps its own, and another value here is refused.",
        default=DEFAULT_MIN_8BIT_NUMEL, minimum=0,
    ),
    Setting(
        "calibration", Literal["auto", "prior"],
        "'auto': measure each format's step cost on the device once (cached); 'prior': built-in relative "
        "costs (a time budget must then be relative).",
        default="auto",
    ),
    Setting(
        "calibration_cache_dir", Optional[str],
        "Cache directory of 'auto'. null: the user cache directory.",
        default=None,
    ),
    Setting(
        "report", ReportSetting,
        "Print the allocation table and write baoc_allocation.json / .png into the log directory. true: the "
        "PNG when matplotlib is installed (else a warning); 'json': no PNG; 'png': the PNG required "
        "(refused at start without matplotlib); false: no report.",
        default=True, controller=False,
    ),
    Setting(
        "seed", int,
        "Seed of the gradient sampling and of stochastic rounding.",
        default=0, minimum=0,
    ),
    Setting(
        "max_block_risk", Optional[float],
        "Cap on the risk of one block: a format whose risk on a block exceeds it is never chosen for that "
        "block (risks are share-weighted: the block risks add up to the total risk). Lifted, with a "
        "warning, when the memory budget cannot be met otherwise. null: no cap.",
        default=None, minimum=0.0,
    ),
    Setting(
        "initial", Optional[Union[str, dict[str, str]]],
        "The allocation the warm-up starts in: a previous run's baoc_allocation.json (its measured risks "
        "replace the prior) or a mapping block -> format (kept wherever the budgets allow). With corrections, "
        "a block names an option, 'int8+ecc8' (or 'int8': no correction). null: the allocation of least "
        "prior risk within the budgets.",
        default=None,
    ),
)

#: Argument name -> :class:`Setting`.
SETTING: dict[str, Setting] = {s.name: s for s in SETTINGS}


# ---------------------------------------------------------------------------- the validator


class Mismatch(Exception):
    """A value that does not fit a type; ``detail`` says what was expected."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def plain(value: Any) -> Any:
    """OmegaConf containers (Hydra's arguments) and tuples as plain dicts and lists."""
    try:  # omegaconf is a dependency, but keep the settings usable without it
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is installed with the package
        pass
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _range(hint: Any, s: Setting | None) -> str:
    if s is None or hint not in (int, float):
        return ""
    out = [f">= {s.minimum}" if s.minimum is not None else "", f"> {s.exclusive_minimum}" if s.exclusive_minimum is not None else ""]
    if hint is float and s.fraction_maximum is not None:
        out.append(f"<= {s.fraction_maximum}")
    return " " + " and ".join(r for r in out if r) if any(out) else ""


def type_name(hint: Any, s: Setting | None = None) -> str:
    """``hint`` in words, with the range of ``s`` (``"an int >= 1"``)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return "any value"
    if hint is type(None):
        return "None"
    if dataclasses.is_dataclass(hint) or origin is dict:
        return "a mapping"
    if origin is Literal:
        return "one of " + str(list(typing.get_args(hint)))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a, s) for a in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        if typing.get_origin(item) is Literal:
            return f"a list of names from {list(typing.get_args(item))}"
        return f"a list of {type_name(item)}"
    names = {int: "an int", float: "a finite number", str: "a string", bool: "a boolean"}
    return names.get(hint, str(hint)) + _range(hint, s)


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the shape of ``hint`` (which member of a Union converts it)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, (str, os.PathLike))
    if origin is list:
        return isinstance(value, (list, tuple))
    if origin is dict or dataclasses.is_dataclass(hint):
        return isinstance(value, Mapping)
    if origin is Literal:
        return value in typing.get_args(hint)
    return False


def _number(value: Any, hint: Any, s: Setting | None) -> Any:
    if hint is float and not math.isfinite(value):
        raise Mismatch("expected a finite number")
    low, xlow = (s.minimum, s.exclusive_minimum) if s is not None else (None, None)
    if (low is not None and value < low) or (xlow is not None and value <= xlow):
        raise Mismatch(f"expected {type_name(hint, s)}")
    if hint is float and s is not None and s.fraction_maximum is not None and value > s.fraction_maximum:
        raise Mismatch(
            f"a fraction must be <= {s.fraction_maximum} (an absolute size is an int of bytes or a string with "
            f"a unit, e.g. '6GB')"
        )
    return hint(value)


def did_you_mean(word: Any, choices: Sequence[str]) -> str | None:
    """The choice closest to ``word`` (difflib, case-insensitive), or ``None`` if none is close.

    Example:
        >>> did_you_mean("int4", ["fp32", "int8", "factored"])
        'int8'
    """
    if not isinstance(word, str):
        return None
    lowered = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1)
    return lowered[close[0]] if close else None


def _unknown(names: Sequence[Any], choices: Sequence[str]) -> str:
    """``'int4' (did you mean 'int8'?), 3``: each unknown name with its closest choice."""
    out = []
    for name in names:
        close = did_you_mean(name, choices)
        out.append(f"{name!r} (did you mean {close!r}?)" if close else repr(name))
    return ", ".join(out)


def _list(value: Any, hint: Any, s: Setting | None) -> list[Any]:
    (item,) = typing.get_args(hint)
    if typing.get_origin(item) is Literal:  # a list of choices: known names, each once
        allowed = list(typing.get_args(item))
        unknown = [v for v in value if not (isinstance(v, str) and v in allowed)]
        if unknown:
            takes = s.allowed if s is not None and s.allowed else f"allowed: {allowed}"
            raise Mismatch(f"unknown {_unknown(unknown, allowed)}; {takes}")
        duplicated = sorted({v for v in value if value.count(v) > 1})
        if duplicated:
            raise Mismatch(f"{duplicated} listed twice; list each once")
    out = [conform(v, item) for v in value]
    if s is not None and s.min_items and len(out) < s.min_items:
        raise Mismatch(f"expected at least {s.min_items} item(s)")
    return out


def conform(value: Any, hint: Any, s: Setting | None = None) -> Any:
    """``value`` checked against ``hint`` and the range of ``s``, normalized (ints read as floats
    where only a float fits, tuples as lists, paths as strings).

    Raises:
        Mismatch: the value does not fit; its ``detail`` says what was expected.
    """
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = list(typing.get_args(hint))
        if isinstance(value, str) and value in allowed:
            return value
        close = did_you_mean(value, [str(a) for a in allowed])
        raise Mismatch(f"allowed: {allowed}" + (f" (did you mean {close!r}?)" if close else ""))
    if origin in (Union, types.UnionType):
        # An exact type first: an int stays an int where int is allowed (a memory budget in bytes).
        for option in sorted(typing.get_args(hint), key=lambda o: o is not type(value)):
            if matches(value, option):
                return conform(value, option, s)
    elif matches(value, hint):
        if hint in (int, float):
            return _number(value, hint, s)
        if hint is str:
            return os.fspath(value)
        if origin is list:
            return _list(list(value), hint, s)
        if origin is dict:
            _, item = typing.get_args(hint)
            bad = [k for k in value if not isinstance(k, str)]
            if bad:
                raise Mismatch(f"keys must be strings, got {bad[0]!r}")
            return {k: conform(v, item) for k, v in value.items()}
        return value
    raise Mismatch(f"expected {type_name(hint, s)}")


def check_setting(s: Setting, value: Any) -> Any:
    """``value`` of setting ``s``, checked and normalized; a bad one raises :class:`SettingError`.

    Example:
        >>> check_setting(SETTING["hysteresis"], 1)
        1.0
    """
    value = plain(value)
    try:
        out = conform(value, s.type, s)
    except Mismatch as bad:
        raise SettingError(s.name, f"Invalid {s.name}={value!r}; {bad.detail}", f"invalid value {value!r}; {bad.detail}") from None
    if s.syntax is not None and out is not None:
        try:
            s.syntax(out, s.name)
        except (TypeError, ValueError) as err:
            raise SettingError(s.name, str(err)) from None
    return out


def rule_errors(values: Mapping[str, Any]) -> list[SettingError]:
    """The rules between settings that checked ``values`` (name -> value) break, each error naming the
    setting to change. A rule whose settings are not all in ``values`` is not applied.

    Example:
        >>> [err.setting for err in rule_errors({"sample_every": 10, "warmup_steps": 5})]
        ['warmup_steps']
    """
    errors = []
    sample_every, warmup_steps = values.get("sample_every"), values.get("warmup_steps")
    # Two ring samples (steps 0 and sample_every) and the follower of the second (lag-1 cosine).
    least = None if sample_every is None else sample_every + (2 if sample_every > 1 else 1)
    if least is not None and warmup_steps is not None and warmup_steps < least:
        errors.append(SettingError(
            "warmup_steps",
            f"Invalid warmup_steps={warmup_steps} for sample_every={sample_every}: the statistics need "
            f"{MIN_SAMPLES} gradient samples, taken at steps 0 and {sample_every}; use warmup_steps >= {least} "
            f"or a smaller sample_every",
        ))
    if values.get("calibration") == "prior" and is_absolute_time(values.get("time_budget")):
        err = absolute_time_with_prior_error(
            values["time_budget"], "time_budget", "calibration='auto' to measure the step in seconds on the device."
        )
        errors.append(SettingError("time_budget", str(err)))
    return errors


def check_settings(values: Mapping[str, Any], settings: Sequence[Setting] = SETTINGS) -> dict[str, Any]:
    """The one validator: ``values`` (argument name -> value) checked and normalized.

    Settings left out are taken at their defaults for the rules between settings.

    Raises:
        SettingError: a bad value, or values that do not go together; it names the setting.

    Example:
        >>> check_settings({"memory_budget": "30%", "formats": ("fp32", "int8")})["formats"]
        ['fp32', 'int8']
    """
    by_name = {s.name: s for s in settings}
    unknown = [k for k in values if k not in by_name]
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; the settings: {list(by_name)}")
    out = {k: check_setting(by_name[k], v) for k, v in values.items()}
    defaults = {s.name: s.default for s in settings if not s.required}
    broken = rule_errors({**defaults, **out})
    if broken:
        raise broken[0]
    return out


# ---------------------------------------------------------------------------- derived signatures


def arg_doc(name: str, text: str, default: Any = REQUIRED) -> str:
    """One Google-style ``Args:`` entry, ``(default: X)`` appended, wrapped at 100 columns."""
    suffix = "" if default is REQUIRED or default is dataclasses.MISSING else f" (default: {default!r})"
    return "\n".join("    " + line for line in textwrap.wrap(
        f"{name}: {text}{suffix}", 96, subsequent_indent="    ", break_on_hyphens=False, break_long_words=False
    ))


def args_section(settings: Sequence[Setting] = SETTINGS) -> str:
    """A Google-style ``Args:`` section from the settings' help texts."""
    return "\n".join(["Args:", *(arg_doc(s.name, s.help, s.default) for s in settings)])


def settings_of(arguments: Mapping[str, Any], settings: Sequence[Setting] = SETTINGS) -> dict[str, Any]:
    """The settings among a written-out ``__init__``'s arguments (its ``locals()``), by name, in the table's order.

    ``BAOC.__init__`` and ``BAOCStrategy.__init__`` spell every setting out (their source is what a reader,
    ``inspect`` and LightningCLI see); ``tests/config/test_settings.py`` holds their signatures to :data:`SETTINGS`.

    Example:
        >>> list(settings_of({"self": None, **{s.name: s.default for s in SETTINGS}}))[:3]
        ['memory_budget', 'time_budget', 'warmup_steps']
    """
    return {s.name: arguments[s.name] for s in settings}


#: The controller's settings (:data:`SETTINGS` without the adapters' own).
CONTROLLER_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.controller)


def _config_post_init(self: Any) -> None:
    checked = check_settings({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, CONTROLLER_SETTINGS)
    for name, value in checked.items():
        setattr(self, name, value)


BAOCConfig = dataclasses.make_dataclass(
    "BAOCConfig",
    [(s.name, s.type, dataclasses.field(**({} if s.required else {"default": s.default}))) for s in CONTROLLER_SETTINGS],
    namespace={
        "__post_init__": _config_post_init,
        "__doc__": "Every setting of the BAOC lifecycle but the adapters' ``report``, checked by "
        ":func:`check_settings`.\n\nGenerated from :data:`SETTINGS`.\n\n" + args_section(CONTROLLER_SETTINGS)
        + "\n\nExample:\n    >>> BAOCConfig(memory_budget=0.3, warmup_steps=100).sample_every\n    10\n",
    },
)
BAOCConfig.__module__ = __name__  # pickles by name, as a class written out


def split_settings(values: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The adapters' settings as a :class:`BAOCConfig` and the checked adapter-only ones.

    Example:
        >>> config, own = split_settings({"memory_budget": 0.3, "report": "json"})
        >>> config.memory_budget, own
        (0.3, {'report': 'json'})
    """
    own = {s.name for s in SETTINGS if not s.controller}
    checked = check_settings({k: v for k, v in values.items() if k in own})
    return BAOCConfig(**{k: v for k, v in values.items() if k not in own}), checked


__all__ = [
    "BAOCConfig", "CONTROLLER_SETTINGS", "FORMATS_ALLOWED", "FormatName", "MIN_SAMPLES", "REQUIRED",
    "ReportSetting", "SETTING", "SETTINGS", "Setting", "SettingError", "arg_doc", "args_section",
    "check_setting", "check_settings", "did_you_mean", "rule_errors", "settings_of", "split_settings",
]
