"""Typed BAOC configs: the dataclasses behind the YAML templates, loading with overrides, JSON Schema.

A config file (``configs/vision.yaml``, ``configs/language.yaml``, ``configs/diffusion.yaml``)
holds a ``baoc`` section in the vocabulary of the BAOC paper, and optionally the sections a
``LightningCLI`` config has (``trainer``, ``model``, ``data``, ``seed_everything``, ``ckpt_path``),
so one file serves :func:`load_config`, ``examples/cli.py`` (LightningCLI), ``examples/hydra_baoc.py``
(Hydra) and ``lightning-baoc check``:

.. code-block:: yaml

    baoc:
      memory_budget: 0.35            # fraction of fp32 AdamW state memory, or "6GB"
      time_budget: null              # multiple of the fp32 optimizer step, or "12ms"
      warmup_steps: 200
      allowed_configs: [fp32, bf16_momentum, bf16, int8, int8_factored, nomomentum, factored]
      block_id: {granularity: layer, patterns: {embeddings: ["wte.*", "wpe.*"]}}
      risk_thresholds: {max_block_risk: null, hysteresis: 0.1, horizon: 200}
      re_evaluation_trigger: {every_n_epochs: null, monitor: val_loss, mode: min, patience: 3, min_delta: 0.0}
      sampler: {sample_every: 10, sparse_sampling: 4, capacity: 32, max_elements: 4096}

The field names map onto :class:`~lightning_baoc.BAOC`'s arguments (:func:`baoc_kwargs`;
:meth:`BAOC.from_config <lightning_baoc.BAOC.from_config>` builds the callback):

================================================  ==============================
config key                                        ``BAOC`` argument
================================================  ==============================
``memory_budget``, ``time_budget``                the same
``warmup_steps``, ``min_8bit_numel``, ``seed``,   the same
``report``
``allowed_configs``                               ``formats``
``block_id.granularity`` / ``block_id.patterns``  ``granularity`` / ``blocks``
``risk_thresholds.max_block_risk``                ``max_block_risk``
``risk_thresholds.hysteresis`` / ``.horizon``     ``hysteresis`` / ``horizon``
``re_evaluation_trigger.every_n_epochs``          ``reevaluate_every_n_epochs``
``re_evaluation_trigger.monitor`` (``mode``,      ``monitor`` (``mode``, ``patience``,
``patience``, ``min_delta``)                      ``min_delta``)
``sampler.sample_every`` (``sparse_sampling``,    the same
``capacity``, ``max_elements``)
``calibration.mode`` / ``calibration.cache_dir``  ``calibration`` / ``calibration_cache_dir``
================================================  ==============================

Loading is strict: an unknown key anywhere (also in ``trainer``, checked against
``lightning.Trainer``'s arguments) and a value of the wrong type or out of range raise
:class:`ConfigError`, whose message names the key (``baoc.sampler.sample_every``) and where it
came from (the file, or the dotlist override that set it). Overrides are OmegaConf dotlists
(``baoc.memory_budget=0.25``); Hydra is not needed.

The JSON Schema (:func:`json_schema`) is generated from the same dataclasses (types, ranges,
allowed values, defaults and descriptions); the committed ``configs/baoc.schema.json`` is
regenerated with ``python -m lightning_baoc schema > configs/baoc.schema.json``.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from .budget import parse_memory_budget, parse_time_budget
from .formats import DEFAULT_MIN_8BIT_NUMEL, FORMATS
from .sampler import DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS

#: ``$id``-less draft of the generated schema.
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

#: Top-level keys a LightningCLI ``fit`` config may hold besides ``baoc``.
_LIGHTNING_CLI_KEYS = ("seed_everything", "trainer", "model", "data", "ckpt_path")


class ConfigError(ValueError):
    """An unknown key or a bad value in a config; the message names the key and its source.

    Attributes:
        key: the dotted key (``"baoc.sampler.sample_every"``), or ``""`` for the whole config.
        source: where the value came from: a file name, ``"override 'k=v'"`` or ``"<dict>"``.

    Example:
        >>> try:
        ...     parse_config({"baoc": {"memory_budget": 0.3, "warmup": 100}})
        ... except ConfigError as err:
        ...     print(err.key)
        baoc.warmup
    """

    def __init__(self, message: str, key: str = "", source: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.source = source


def _help(text: str, **constraints: Any) -> dict[str, Any]:
    """Field metadata: the description (schema, docs) and range constraints (schema, loader)."""
    return {"help": text, **constraints}


# ---------------------------------------------------------------------------- the dataclasses


@dataclass
class BlockIdConfig:
    """How parameters are grouped into blocks, the unit that gets one state format.

    Args:
        granularity: ``"module"`` (one block per module owning parameters, weight and bias
            together), ``"layer"`` (one block per repeated layer, e.g. a transformer block) or
            ``"param"`` (one per tensor) (default: ``"module"``).
        patterns: named blocks by glob patterns over parameter names (``fnmatch``), block name ->
            glob or list of globs, matched before ``granularity`` (default: ``None``).

    Example:
        >>> BlockIdConfig(granularity="layer", patterns={"embeddings": ["wte.*", "wpe.*"]}).granularity
        'layer'
    """

    granularity: Literal["module", "layer", "param"] = field(
        default="module",
        metadata=_help(
            "Block granularity: 'module' (one block per module that owns parameters), 'layer' (one block "
            "per repeated layer, e.g. a transformer block) or 'param' (one block per tensor)."
        ),
    )
    patterns: dict[str, Union[str, list[str]]] | None = field(
        default=None,
        metadata=_help(
            "Named blocks: block name -> glob or list of globs over parameter names (fnmatch, "
            "case-sensitive), matched before 'granularity'. Every glob must match a trainable parameter."
        ),
    )


@dataclass
class RiskThresholdsConfig:
    """Limits on risk, and how much better a re-allocation must be to happen.

    Args:
        max_block_risk: a format whose risk on a block exceeds this is never chosen for that
            block (the risk table's scale: share-weighted, the block risks add up to the total);
            lifted with a warning when the memory budget cannot be met otherwise
            (default: ``None``: no cap).
        hysteresis: a re-evaluation migrates only if the total risk drops by more than this
            fraction, or the current allocation breaks a budget (default: 0.1).
        horizon: optimizer steps over which the risk model lets update noise average out
            (default: 200).

    Example:
        >>> RiskThresholdsConfig(max_block_risk=0.05).hysteresis
        0.1
    """

    max_block_risk: float | None = field(
        default=None,
        metadata=_help(
            "Cap on the risk of one block: a format whose risk on a block exceeds it is never chosen for "
            "that block (risks are share-weighted: the block risks add up to the total risk). Lifted, with "
            "a warning, when the memory budget cannot be met otherwise. null: no cap.",
            minimum=0.0,
        ),
    )
    hysteresis: float = field(
        default=0.1,
        metadata=_help(
            "A re-evaluation migrates only if the new allocation lowers the total risk by more than this "
            "fraction (or the current one breaks a budget); keeps allocations from flapping.",
            minimum=0.0,
        ),
    )
    horizon: int = field(
        default=200,
        metadata=_help("Optimizer steps over which the risk model lets zero-mean update noise average out.", minimum=1),
    )


@dataclass
class ReEvaluationTriggerConfig:
    """When the allocation is decided again, with fresh statistics, after the first one.

    Args:
        every_n_epochs: re-evaluate every N epochs (default: ``None``: never on a schedule).
        monitor: a logged validation metric; its plateau triggers a re-evaluation
            (default: ``None``).
        mode: ``"min"`` or ``"max"``: the direction in which ``monitor`` improves (default: ``"min"``).
        patience: validation checks without improvement before re-evaluating (default: 3).
        min_delta: smallest change of ``monitor`` counted as an improvement (default: 0.0).

    Example:
        >>> ReEvaluationTriggerConfig(monitor="val_acc", mode="max").patience
        3
    """

    every_n_epochs: int | None = field(
        default=None, metadata=_help("Re-evaluate the allocation every N epochs. null: never on a schedule.", minimum=1)
    )
    monitor: str | None = field(
        default=None,
        metadata=_help("A validation metric (as logged with self.log); a plateau of it triggers a re-evaluation."),
    )
    mode: Literal["min", "max"] = field(
        default="min", metadata=_help("'min' if 'monitor' improves downwards (loss, perplexity), 'max' if upwards.")
    )
    patience: int = field(
        default=3, metadata=_help("Validation checks without improvement of 'monitor' before a re-evaluation.", minimum=1)
    )
    min_delta: float = field(
        default=0.0, metadata=_help("Smallest change of 'monitor' counted as an improvement.", minimum=0.0)
    )


@dataclass
class SamplerConfig:
    """The gradient sampler: how often and how much of each block's gradient is sampled.

    Args:
        sample_every: sample every N optimizer steps during warm-up (default: 10).
        sparse_sampling: after warm-up, sample N times less often (default: 4).
        capacity: sampling steps kept in the ring buffer (default: 32).
        max_elements: gradient elements sampled per block (default: 4096).

    Example:
        >>> SamplerConfig(sample_every=5).max_elements
        4096
    """

    sample_every: int = field(
        default=10,
        metadata=_help(
            "Sample the gradients every N optimizer steps during warm-up (and the step after, for the "
            "lag-1 cosine).",
            minimum=1,
        ),
    )
    sparse_sampling: int = field(
        default=4, metadata=_help("After warm-up, sample N times less often.", minimum=1)
    )
    capacity: int = field(
        default=DEFAULT_CAPACITY,
        metadata=_help("Sampling steps kept in the ring buffer (the statistics' window).", minimum=2),
    )
    max_elements: int = field(
        default=DEFAULT_MAX_ELEMENTS,
        metadata=_help("Gradient elements sampled per block (a fixed random subset).", minimum=1),
    )


@dataclass
class CalibrationConfig:
    """Where the per-format step costs of a time budget come from.

    Args:
        mode: ``"auto"`` (measured once on the device, cached) or ``"prior"`` (built-in relative
            costs) (default: ``"auto"``).
        cache_dir: cache directory of ``"auto"`` (default: ``None``: the user cache directory).

    Example:
        >>> CalibrationConfig().mode
        'auto'
    """

    mode: Literal["auto", "prior"] = field(
        default="auto",
        metadata=_help("'auto': measure each format's step cost on the device once (cached); 'prior': built-in costs."),
    )
    cache_dir: str | None = field(
        default=None, metadata=_help("Cache directory of 'auto'. null: the user cache directory.")
    )


@dataclass
class BAOCSection:
    """The ``baoc`` section of a config: every setting of the BAOC callback.

    Args:
        memory_budget: optimizer-state memory allowed: a fraction in (0, 1] of the fp32 AdamW
            state (``0.35``, ``"35%"``) or absolute (``"6GB"``, ``"512MiB"``, an int of bytes).
        time_budget: optimizer-step time allowed: a multiple >= 1 of the fp32 AdamW step
            (``1.2``) or absolute (``"12ms"``) (default: ``None``: no limit).
        warmup_steps: fp32 optimizer steps, sampled, before the first allocation (default: 200).
        allowed_configs: the formats the solver may pick (default: ``None``: every format the
            device serves).
        block_id: how parameters form blocks (:class:`BlockIdConfig`).
        risk_thresholds: risk cap and hysteresis (:class:`RiskThresholdsConfig`).
        re_evaluation_trigger: when to re-allocate (:class:`ReEvaluationTriggerConfig`).
        sampler: gradient sampling (:class:`SamplerConfig`).
        calibration: step costs for the time budget (:class:`CalibrationConfig`).
        min_8bit_numel: tensors with fewer elements stay out of the 8-bit formats (default: 4096).
        report: print the allocation table and write ``baoc_allocation.json``/``.png``: ``True``
            (the PNG when matplotlib is installed), ``"json"``, ``"png"`` (the PNG required) or
            ``False`` (default: True).
        seed: seed of the gradient sampling and of stochastic rounding (default: 0).

    Example:
        >>> BAOCSection(memory_budget=0.35).sampler.sample_every
        10
    """

    memory_budget: Union[float, int, str] = field(
        metadata=_help(
            "Optimizer-state memory allowed: a fraction in (0, 1] of the fp32 AdamW state (0.35 or '35%'), "
            "or an absolute size: an int of bytes or a string with a unit ('6GB', '512MiB').",
            exclusive_minimum=0,
            float_maximum=1.0,
        ),
    )
    time_budget: Union[float, str, None] = field(
        default=None,
        metadata=_help(
            "Optimizer-step time allowed: a multiple >= 1 of the fp32 AdamW step (1.2 or '1.2x') or an "
            "absolute time ('12ms'). null: no limit.",
            minimum=1.0,
        ),
    )
    warmup_steps: int = field(
        default=200,
        metadata=_help(
            "Optimizer steps in fp32 AdamW, sampled, before the first allocation; at least sample_every + 2.",
            minimum=1,
        ),
    )
    allowed_configs: list[str] | None = field(
        default=None,
        metadata=_help(
            "The optimizer-state formats the solver may pick. null: every format the device serves.",
            item_enum=tuple(FORMATS),
            min_items=1,
        ),
    )
    block_id: BlockIdConfig = field(default_factory=BlockIdConfig, metadata=_help("How parameters form blocks."))
    risk_thresholds: RiskThresholdsConfig = field(
        default_factory=RiskThresholdsConfig, metadata=_help("Risk cap and hysteresis.")
    )
    re_evaluation_trigger: ReEvaluationTriggerConfig = field(
        default_factory=ReEvaluationTriggerConfig,
        metadata=_help("When the allocation is decided again with fresh statistics."),
    )
    sampler: SamplerConfig = field(default_factory=SamplerConfig, metadata=_help("Gradient sampling."))
    calibration: CalibrationConfig = field(
        default_factory=CalibrationConfig, metadata=_help("Step costs for the time budget.")
    )
    min_8bit_numel: int = field(
        default=DEFAULT_MIN_8BIT_NUMEL,
        metadata=_help("Tensors with fewer elements stay out of the 8-bit formats (as bitsandbytes).", minimum=0),
    )
    report: Union[bool, Literal["json", "png"]] = field(
        default=True,
        metadata=_help(
            "Print the allocation table and write baoc_allocation.json / .png into the log directory. true: the "
            "PNG when matplotlib is installed (else a warning); 'json': no PNG; 'png': the PNG required "
            "(refused at start without matplotlib); false: no report."
        ),
    )
    seed: int = field(default=0, metadata=_help("Seed of the gradient sampling and of stochastic rounding.", minimum=0))


@dataclass
class ComponentConfig:
    """A class to instantiate, as LightningCLI writes it: ``class_path`` and ``init_args``.

    Args:
        class_path: the importable class or factory, ``package.module.Name``.
        init_args: keyword arguments of the call (default: none).

    Example:
        >>> ComponentConfig("workloads.ViTDigits", {"max_steps": 300}).class_path
        'workloads.ViTDigits'
    """

    class_path: str = field(
        metadata=_help("The class (or factory) to build, importable as package.module.Name.")
    )
    init_args: dict[str, Any] = field(default_factory=dict, metadata=_help("Keyword arguments of the call."))


@dataclass
class Config:
    """A whole config file: the ``baoc`` section and the optional LightningCLI sections.

    Args:
        baoc: the BAOC settings (:class:`BAOCSection`).
        seed_everything: LightningCLI's global seed (default: ``None``).
        trainer: ``lightning.Trainer`` arguments (default: none).
        model: the LightningModule (:class:`ComponentConfig`) (default: ``None``).
        data: the LightningDataModule (:class:`ComponentConfig`) (default: ``None``).
        ckpt_path: a checkpoint to resume from (default: ``None``).

    Example:
        >>> Config(BAOCSection(memory_budget=0.3)).trainer
        {}
    """

    baoc: BAOCSection = field(metadata=_help("BAOC settings: the budgets, the formats, blocks, triggers."))
    seed_everything: Union[int, bool, None] = field(
        default=None, metadata=_help("LightningCLI's global seed (true: a random one).")
    )
    trainer: dict[str, Any] = field(
        default_factory=dict,
        metadata=_help(
            "lightning.Trainer arguments (LightningCLI's trainer section); keys are checked against "
            "Trainer's signature when loaded."
        ),
    )
    model: ComponentConfig | None = field(
        default=None, metadata=_help("The LightningModule (class_path, init_args), as LightningCLI writes it.")
    )
    data: ComponentConfig | None = field(
        default=None, metadata=_help("The LightningDataModule (class_path, init_args), as LightningCLI writes it.")
    )
    ckpt_path: str | None = field(default=None, metadata=_help("A checkpoint to resume from."))


# ---------------------------------------------------------------------------- type conversion


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if hint is type(None):
        return "null"
    if hint is Any:
        return "any value"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    if origin is Literal:
        return "one of " + str(list(typing.get_args(hint)))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    if origin is dict:
        return "a mapping"
    return {int: "an int", float: "a number", str: "a string", bool: "a boolean"}.get(hint, str(hint))


class _Source:
    """Names where a key's value came from: the file, or the dotlist override that set it."""

    def __init__(self, name: str, overrides: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.overrides = dict(overrides or {})

    def of(self, key: str) -> str:
        for okey, text in self.overrides.items():
            if key == okey or key.startswith(okey + ".") or okey.startswith(key + "."):
                return f"override {text!r}"
        return self.name


def _fail(source: _Source, key: str, message: str) -> ConfigError:
    where = source.of(key)
    return ConfigError(f"{where}: {key}: {message}", key=key, source=where)


def _check_range(value: float, meta: Mapping[str, Any], key: str, source: _Source) -> None:
    low = meta.get("minimum")
    if low is not None and value < low:
        raise _fail(source, key, f"invalid value {value!r}; expected >= {low}")
    xlow = meta.get("exclusive_minimum")
    if xlow is not None and value <= xlow:
        raise _fail(source, key, f"invalid value {value!r}; expected > {xlow}")


def _convert(value: Any, hint: Any, key: str, source: _Source, meta: Mapping[str, Any]) -> Any:
    """``value`` checked against the type ``hint`` (ints are accepted as floats, never bools)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if hint is type(None):
        if value is None:
            return None
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, Mapping):
            return _build(hint, value, key, source)
    elif origin is Literal:
        allowed = list(typing.get_args(hint))
        if value in allowed and isinstance(value, str):
            return value
        raise _fail(source, key, f"invalid value {value!r}; allowed: {allowed}")
    elif origin in (Union, types.UnionType):
        # An exact type first: an int stays an int where int is allowed (a memory budget of bytes),
        # and is read as a float only where it is not.
        options = sorted(typing.get_args(hint), key=lambda o: o is not type(value))
        for option in options:
            if _matches(value, option):
                return _convert(value, option, key, source, meta)
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (item,) = typing.get_args(hint)
            out = [_convert(v, item, f"{key}[{i}]", source, {}) for i, v in enumerate(value)]
            if meta.get("min_items") and len(out) < meta["min_items"]:
                raise _fail(source, key, f"invalid value {value!r}; expected at least {meta['min_items']} item(s)")
            enum = meta.get("item_enum")
            if enum is not None:
                unknown = [v for v in out if v not in enum]
                if unknown:
                    raise _fail(source, key, f"unknown {unknown}; allowed: {list(enum)}")
                duplicated = sorted({v for v in out if out.count(v) > 1})
                if duplicated:
                    raise _fail(source, key, f"{duplicated} listed twice; list each once")
            return out
    elif origin is dict:
        if isinstance(value, Mapping):
            _, item = typing.get_args(hint)
            out_map = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise _fail(source, f"{key}.{k}", f"keys must be strings, got {k!r}")
                out_map[k] = _convert(v, item, f"{key}.{k}", source, {})
            return out_map
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            _check_range(value, meta, key, source)
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise _fail(source, key, f"invalid value {value!r}; expected a finite number")
            _check_range(value, meta, key, source)
            if meta.get("float_maximum") is not None and value > meta["float_maximum"]:
                raise _fail(
                    source,
                    key,
                    f"invalid value {value!r}; a fraction must be <= {meta['float_maximum']} (an absolute size is an "
                    f"int of bytes or a string with a unit, e.g. '6GB')",
                )
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    got = f"{value!r} ({type(value).__name__})"
    raise _fail(source, key, f"invalid value {got}; expected {_type_name(hint)}")


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the shape of ``hint`` (the member of a Union to convert it with)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, (list, tuple))
    if origin is dict or dataclasses.is_dataclass(hint):
        return isinstance(value, Mapping)
    if origin is Literal:
        return value in typing.get_args(hint)
    return False


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, data: Mapping[str, Any], prefix: str, source: _Source) -> Any:
    """An instance of dataclass ``cls`` from a mapping; unknown and missing keys are errors."""
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    dot = f"{prefix}." if prefix else ""
    for k in data:
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            where = f"in {prefix!r}" if prefix else "at the top level"
            raise _fail(source, f"{dot}{k}", f"unknown key{hint}; allowed keys {where}: {list(fields)}")
    kwargs = {}
    for name, f in fields.items():
        key = f"{dot}{name}"
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _fail(source, key, f"missing; expected {_type_name(hints[name])}: {f.metadata.get('help', '')}")
            continue
        kwargs[name] = _convert(data[name], hints[name], key, source, f.metadata)
    return cls(**kwargs)


# ---------------------------------------------------------------------------- semantics


#: ``BAOC`` argument -> the config key it comes from (under ``baoc``).
BAOC_ARGUMENTS: dict[str, str] = {
    "memory_budget": "memory_budget",
    "time_budget": "time_budget",
    "warmup_steps": "warmup_steps",
    "sample_every": "sampler.sample_every",
    "granularity": "block_id.granularity",
    "blocks": "block_id.patterns",
    "formats": "allowed_configs",
    "reevaluate_every_n_epochs": "re_evaluation_trigger.every_n_epochs",
    "monitor": "re_evaluation_trigger.monitor",
    "mode": "re_evaluation_trigger.mode",
    "patience": "re_evaluation_trigger.patience",
    "min_delta": "re_evaluation_trigger.min_delta",
    "hysteresis": "risk_thresholds.hysteresis",
    "horizon": "risk_thresholds.horizon",
    "sparse_sampling": "sampler.sparse_sampling",
    "capacity": "sampler.capacity",
    "max_elements": "sampler.max_elements",
    "min_8bit_numel": "min_8bit_numel",
    "calibration": "calibration.mode",
    "calibration_cache_dir": "calibration.cache_dir",
    "report": "report",
    "seed": "seed",
    "max_block_risk": "risk_thresholds.max_block_risk",
}


def _get(section: BAOCSection, path: str) -> Any:
    value: Any = section
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _kwargs(section: BAOCSection) -> dict[str, Any]:
    out = {arg: _get(section, path) for arg, path in BAOC_ARGUMENTS.items()}
    out["formats"] = None if out["formats"] is None else list(out["formats"])
    if out["blocks"] is not None:
        out["blocks"] = {k: (list(v) if isinstance(v, list) else v) for k, v in out["blocks"].items()}
    return out


def _check_semantics(section: BAOCSection, prefix: str, source: _Source) -> None:
    """Budgets' syntax and the cross-field rules, by the same code the callback runs."""
    from .controller import BAOCConfig

    try:
        parse_memory_budget(section.memory_budget, fp32_bytes=float(1 << 62), argument=f"{prefix}memory_budget")
    except (TypeError, ValueError) as err:
        raise _fail(source, f"{prefix}memory_budget", str(err)) from None
    if section.time_budget is not None:
        try:
            parse_time_budget(section.time_budget, fp32_seconds=1.0, argument=f"{prefix}time_budget")
        except (TypeError, ValueError) as err:
            raise _fail(source, f"{prefix}time_budget", str(err)) from None
    kwargs = _kwargs(section)
    kwargs.pop("report")
    try:
        BAOCConfig(**kwargs)
    except (TypeError, ValueError) as err:
        text = str(err)
        # the argument named first in the message is the one it is about
        found = [(m.start(), arg) for arg in BAOC_ARGUMENTS if (m := re.search(rf"\b{arg}\b", text))]
        key = prefix + BAOC_ARGUMENTS[min(found)[1]] if found else prefix.rstrip(".")
        raise _fail(source, key, text) from None


_TRAINER_ARGUMENTS: tuple[str, ...] | None = None


def _trainer_arguments() -> tuple[str, ...]:
    global _TRAINER_ARGUMENTS
    if _TRAINER_ARGUMENTS is None:
        from lightning.pytorch import Trainer

        params = inspect.signature(Trainer.__init__).parameters
        _TRAINER_ARGUMENTS = tuple(p for p in params if p != "self")
    return _TRAINER_ARGUMENTS


def _parse(data: Any, source: _Source) -> Config:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source.name}: expected a mapping with a 'baoc' section, got {type(data).__name__}", source=source.name
        )
    if "baoc" not in data:
        raise _fail(source, "baoc", "missing: the config needs a 'baoc' section (at least baoc.memory_budget)")
    config: Config = _build(Config, data, "", source)
    _check_semantics(config.baoc, "baoc.", source)
    if config.trainer:
        allowed = _trainer_arguments()
        for k in config.trainer:
            if k not in allowed:
                close = difflib.get_close_matches(k, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise _fail(source, f"trainer.{k}", f"unknown key{hint}: not an argument of lightning.Trainer")
    return config


def _plain(data: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(data, (DictConfig, ListConfig)):
            return OmegaConf.to_container(data, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return data


def parse_config(data: Mapping[str, Any] | Any, source: str = "<dict>") -> Config:
    """A validated :class:`Config` from a mapping (or an OmegaConf ``DictConfig``, e.g. Hydra's).

    Args:
        data: the whole config, with a ``baoc`` section.
        source: named in error messages (default: ``"<dict>"``).

    Raises:
        ConfigError: an unknown key, a missing ``baoc.memory_budget``, or a bad value; the message
            names the key and ``source``.

    Example:
        >>> parse_config({"baoc": {"memory_budget": "35%", "sampler": {"sample_every": 5}}}).baoc.sampler
        SamplerConfig(sample_every=5, sparse_sampling=4, capacity=32, max_elements=4096)
    """
    return _parse(_plain(data), _Source(source))


def parse_section(data: Mapping[str, Any] | Any, source: str = "<dict>") -> BAOCSection:
    """A validated :class:`BAOCSection` from the ``baoc`` section alone (keys named ``baoc.*``).

    Example:
        >>> parse_section({"memory_budget": 0.3, "allowed_configs": ["fp32", "int8"]}).allowed_configs
        ['fp32', 'int8']
    """
    return _parse({"baoc": _plain(data)}, _Source(source)).baoc


def _parse_overrides(overrides: Sequence[str]) -> tuple[Any, dict[str, str]]:
    from omegaconf import OmegaConf

    if isinstance(overrides, str):
        raise TypeError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
    keys: dict[str, str] = {}
    for text in overrides:
        if not isinstance(text, str) or "=" not in text or not text.split("=", 1)[0].strip():
            raise ConfigError(
                f"override {text!r}: expected 'key=value' with a dotted key, e.g. 'baoc.memory_budget=0.25'",
                source=f"override {text!r}",
            )
        key = text.split("=", 1)[0].strip().lstrip("+~")
        keys[key] = text
    try:
        return OmegaConf.from_dotlist([t.lstrip("+") for t in overrides]), keys
    except Exception as err:  # noqa: BLE001 - OmegaConf raises several grammar errors
        raise ConfigError(f"overrides {list(overrides)!r}: {err}", source="overrides") from None


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config with OmegaConf, apply dotlist overrides, validate it strictly.

    Args:
        path: a YAML file with a ``baoc`` section (e.g. ``configs/vision.yaml``).
        overrides: OmegaConf dotlist overrides, applied in order (``"baoc.memory_budget=0.25"``,
            ``"baoc.allowed_configs=[fp32,int8]"``) (default: none). ``${...}`` interpolations are
            resolved after merging.

    Returns:
        The :class:`Config`.

    Raises:
        ConfigError: the file cannot be read or parsed, a key is unknown, or a value is bad; the
            message names the key, and the file or the override that set it.

    Example:
        >>> cfg = load_config("configs/vision.yaml", ["baoc.memory_budget=0.25"])  # doctest: +SKIP
        >>> cfg.baoc.memory_budget  # doctest: +SKIP
        0.25
    """
    from omegaconf import OmegaConf

    name = os.fspath(path)
    try:
        loaded = OmegaConf.load(name)
    except FileNotFoundError:
        raise ConfigError(f"{name}: no such config file", source=name) from None
    except Exception as err:  # noqa: BLE001 - yaml and OmegaConf raise several error types
        raise ConfigError(f"{name}: cannot parse the YAML: {err}", source=name) from None
    if OmegaConf.is_list(loaded):
        raise ConfigError(f"{name}: expected a mapping with a 'baoc' section, got a list", source=name)
    merged = loaded
    keys: dict[str, str] = {}
    if overrides:
        dotlist, keys = _parse_overrides(overrides)
        merged = OmegaConf.merge(loaded, dotlist)
    source = _Source(name, keys)
    try:
        data = OmegaConf.to_container(merged, resolve=True)
    except Exception as err:  # noqa: BLE001 - interpolation errors
        raise ConfigError(f"{name}: cannot resolve an interpolation: {err}", source=name) from None
    return _parse(data, source)


def baoc_kwargs(config: Config | BAOCSection | Mapping[str, Any] | Any) -> dict[str, Any]:
    """The keyword arguments of :class:`~lightning_baoc.BAOC` that a config asks for.

    Args:
        config: a :class:`Config`, a :class:`BAOCSection`, or a mapping / ``DictConfig`` of a
            whole config (with ``baoc``) or of the ``baoc`` section alone. It is validated again.

    Example:
        >>> kw = baoc_kwargs({"memory_budget": 0.3, "sampler": {"sample_every": 5}, "warmup_steps": 50})
        >>> kw["memory_budget"], kw["sample_every"], kw["warmup_steps"], kw["formats"]
        (0.3, 5, 50, None)
    """
    if isinstance(config, Config):
        section = config.baoc
    elif isinstance(config, BAOCSection):
        section = config
    else:
        data = _plain(config)
        if not isinstance(data, Mapping):
            raise TypeError(
                f"config must be a Config, a BAOCSection or a mapping, got {type(config).__name__}; "
                f"load a file with load_config(path)"
            )
        section = parse_config(data).baoc if "baoc" in data else parse_section(data)
        return _kwargs(section)
    # dataclass instances (possibly built by LightningCLI / by hand) go through the same checks
    return _kwargs(parse_section(dataclasses.asdict(section), source=type(section).__name__))


# ---------------------------------------------------------------------------- JSON Schema


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def _schema_of(hint: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if hint is Any:
        return {}
    if hint is type(None):
        return {"type": "null"}
    if dataclasses.is_dataclass(hint):
        return _dataclass_schema(hint)
    if origin is Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin in (Union, types.UnionType):
        return {"anyOf": [_schema_of(a, meta) for a in typing.get_args(hint)]}
    if origin is list:
        (item,) = typing.get_args(hint)
        items = _schema_of(item, {})
        if meta.get("item_enum") is not None:
            items = {"enum": list(meta["item_enum"])}
        out: dict[str, Any] = {"type": "array", "items": items}
        if meta.get("min_items"):
            out["minItems"] = meta["min_items"]
        if meta.get("item_enum") is not None:
            out["uniqueItems"] = True
        return out
    if origin is dict:
        _, item = typing.get_args(hint)
        return {"type": "object", "additionalProperties": _schema_of(item, {})}
    if hint is bool:
        return {"type": "boolean"}
    if hint in (int, float):
        out = {"type": "integer" if hint is int else "number"}
        if meta.get("minimum") is not None:
            out["minimum"] = meta["minimum"]
        if meta.get("exclusive_minimum") is not None:
            out["exclusiveMinimum"] = meta["exclusive_minimum"]
        if hint is float and meta.get("float_maximum") is not None:
            out["maximum"] = meta["float_maximum"]
        return out
    if hint is str:
        return {"type": "string"}
    raise TypeError(f"no JSON Schema for the type {hint!r}")  # pragma: no cover - tested over all fields


def _dataclass_schema(cls: type) -> dict[str, Any]:
    hints = _hints(cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        prop = _schema_of(hints[f.name], f.metadata)
        if "help" in f.metadata:
            prop = {"description": f.metadata["help"], **prop}
        if f.default is not dataclasses.MISSING:
            prop["default"] = _jsonable(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            prop["default"] = _jsonable(f.default_factory())
        else:
            required.append(f.name)
        properties[f.name] = prop
    doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
    out: dict[str, Any] = {"title": cls.__name__, "description": doc, "type": "object", "properties": properties}
    if required:
        out["required"] = required
    out["additionalProperties"] = False
    return out


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a config file, generated from :class:`Config` and its dataclasses.

    Types, allowed values (format names from :data:`~lightning_baoc.FORMATS`), ranges, defaults
    and descriptions all come from the dataclass fields. Budget strings are checked for their
    syntax by :func:`load_config`, not by the schema. Regenerate the committed copy with
    ``python -m lightning_baoc schema > configs/baoc.schema.json``.

    Example:
        >>> schema = json_schema()
        >>> schema["required"], schema["properties"]["baoc"]["properties"]["allowed_configs"]["anyOf"][0]["items"]["enum"][0]
        (['baoc'], 'fp32')
    """
    schema = _dataclass_schema(Config)
    return {
        "$schema": SCHEMA_DIALECT,
        "$comment": "Generated by `python -m lightning_baoc schema` from lightning_baoc/config.py; do not edit.",
        **schema,
        "title": "lightning_baoc config",
    }


def schema_text() -> str:
    """:func:`json_schema` as the text of ``configs/baoc.schema.json`` (2-space indent, newline)."""
    import json

    return json.dumps(json_schema(), indent=2) + "\n"


__all__ = [
    "BAOC_ARGUMENTS",
    "BAOCSection",
    "BlockIdConfig",
    "CalibrationConfig",
    "ComponentConfig",
    "Config",
    "ConfigError",
    "ReEvaluationTriggerConfig",
    "RiskThresholdsConfig",
    "SamplerConfig",
    "baoc_kwargs",
    "json_schema",
    "load_config",
    "parse_config",
    "parse_section",
    "schema_text",
]
