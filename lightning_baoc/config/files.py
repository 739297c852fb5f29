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
      sampler: {sample_every: 10, sparse_sampling: 4, capacity: 32, max_elements: 4096, instrument_share: 0.02}

The section is derived from :data:`lightning_baoc.config.settings.SETTINGS`, where each setting is declared
once with its argument name and its key here: :class:`BAOCSection` and one dataclass per section of
keys (:class:`SamplerConfig` for ``sampler.*``...), :data:`BAOC_ARGUMENTS` (argument -> key:
``formats`` <- ``allowed_configs``, ``blocks`` <- ``block_id.patterns``, ``calibration`` <-
``calibration.mode``...), the checks of the values (:func:`lightning_baoc.config.settings.check_settings`,
the callback's own validator) and the JSON Schema (:func:`json_schema`). :func:`baoc_kwargs` and
:meth:`BAOC.from_config <lightning_baoc.BAOC.from_config>` turn a section into the callback.

Loading is strict: an unknown key anywhere (also in ``trainer``, checked against
``lightning.Trainer``'s arguments) and a value of the wrong type or out of range raise
:class:`ConfigError`, whose message names the key (``baoc.sampler.sample_every``) and where it
came from (the file, or the dotlist override that set it). Overrides are OmegaConf dotlists
(``baoc.memory_budget=0.25``); Hydra is not needed. The committed ``configs/baoc.schema.json`` is
regenerated with ``python -m lightning_baoc schema > configs/baoc.schema.json``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from lightning_baoc.config.settings import (
    SECTIONS,
    SETTINGS,
    Mismatch,
    Setting,
    SettingError,
    arg_doc,
    check_settings,
    conform,
    plain,
    type_name,
)

#: ``$id``-less draft of the generated schema.
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


class ConfigError(ValueError):
    """An unknown key or a bad value in a config; the message names the key and its source.

    Attributes:
        key: the dotted key (``"baoc.sampler.sample_every"``), or ``""`` for the whole config.
        source: where the value came from: a file name, ``"override 'k=v'"`` or ``"<dict>"``.
        setting: the ``BAOC`` argument of a ``baoc`` key (``"sample_every"``), else ``""``.

    Example:
        >>> try:
        ...     parse_config({"baoc": {"memory_budget": 0.3, "warmup": 100}})
        ... except ConfigError as err:
        ...     print(err.key)
        baoc.warmup
    """

    def __init__(self, message: str, key: str = "", source: str = "", setting: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.source = source
        self.setting = setting


def _help(text: str) -> dict[str, Any]:
    """Field metadata: the description (schema, docs)."""
    return {"help": text}


# ---------------------------------------------------------------------------- the baoc section


def _dataclass(name: str, doc: str, fields: list[tuple[str, Any, Any]], module: str | None) -> type:
    """A dataclass whose docstring's ``Args:`` (jsonargparse's help) are the fields' help texts."""
    args = [arg_doc(n, f.metadata["setting"].help if "setting" in f.metadata else f.metadata["help"], f.default) for n, _, f in fields]
    cls = dataclasses.make_dataclass(name, fields, namespace={"__doc__": "\n".join([doc, "", "Args:", *args, ""])})
    if module is not None:
        cls.__module__ = module  # pickles, and jsonargparse finds it, as a class written out
    return cls


def section_dataclass(settings: Sequence[Setting] = SETTINGS, module: str | None = None) -> type:
    """The ``baoc`` section's dataclass from ``settings``: a field per setting under its key, a
    nested dataclass per dotted prefix (``sampler`` -> ``SamplerConfig``), in first-appearance order.

    Fields carry ``{"setting": s}`` as metadata; nothing here is validated (see :func:`parse_section`).

    Example:
        >>> [f.name for f in dataclasses.fields(section_dataclass())][:4]
        ['memory_budget', 'time_budget', 'warmup_steps', 'sampler']
    """
    layout: dict[str, Any] = {}
    for s in settings:
        head, _, leaf = s.key.partition(".")
        if leaf:
            layout.setdefault(head, {})[leaf] = s
        else:
            layout[head] = s

    def leaf_field(s: Setting) -> Any:
        if s.required:
            return field(metadata={"setting": s})
        return field(default=s.default, metadata={"setting": s})

    fields: list[tuple[str, Any, Any]] = []
    for name, item in layout.items():
        if isinstance(item, Setting):
            fields.append((name, item.type, leaf_field(item)))
            continue
        doc = SECTIONS.get(name, f"The ``{name}`` settings.")
        cls_name = "".join(part.capitalize() for part in name.split("_")) + "Config"
        nested = _dataclass(cls_name, doc, [(k, s.type, leaf_field(s)) for k, s in item.items()], module)
        fields.append((name, nested, field(default_factory=nested, metadata=_help(doc))))
    doc = "The ``baoc`` section of a config: every setting of the BAOC callback."
    return _dataclass("BAOCSection", doc, fields, module)


#: The ``baoc`` section (:func:`section_dataclass` of :data:`~lightning_baoc.config.settings.SETTINGS`).
BAOCSection = section_dataclass(module=__name__)
_NESTED = {f.type.__name__: f.type for f in dataclasses.fields(BAOCSection) if dataclasses.is_dataclass(f.type)}
globals().update(_NESTED)  # each nested dataclass is a name of this module, for pickle and jsonargparse
BlockIdConfig: type = _NESTED["BlockIdConfig"]
RiskThresholdsConfig: type = _NESTED["RiskThresholdsConfig"]
ReEvaluationTriggerConfig: type = _NESTED["ReEvaluationTriggerConfig"]
SamplerConfig: type = _NESTED["SamplerConfig"]
CalibrationConfig: type = _NESTED["CalibrationConfig"]

#: ``BAOC`` argument -> the config key it comes from (under ``baoc``).
BAOC_ARGUMENTS: dict[str, str] = {s.name: s.key for s in SETTINGS}


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

    class_path: str = field(metadata=_help("The class (or factory) to build, importable as package.module.Name."))
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


# ---------------------------------------------------------------------------- loading


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


def _fail(source: _Source, key: str, message: str, setting: str = "") -> ConfigError:
    where = source.of(key)
    return ConfigError(f"{where}: {key}: {message}", key=key, source=where, setting=setting)


def _check_keys(cls: type, data: Mapping[str, Any], prefix: str, source: _Source) -> dict[str, Any]:
    """``cls``'s fields by name; a key of ``data`` that is none of them is an error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    dot = f"{prefix}." if prefix else ""
    for k in data:
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            where = f"in {prefix!r}" if prefix else "at the top level"
            raise _fail(source, f"{dot}{k}", f"unknown key{hint}; allowed keys {where}: {list(fields)}")
    return fields


def _raw_settings(cls: type, data: Any, prefix: str, source: _Source) -> dict[str, Any]:
    """Argument name -> value of the settings a section mapping holds (unchecked)."""
    if not isinstance(data, Mapping):
        raise _fail(source, prefix, f"invalid value {data!r}; expected a mapping")
    out: dict[str, Any] = {}
    for name, f in _check_keys(cls, data, prefix, source).items():
        s = f.metadata.get("setting")
        if name not in data:
            if s is not None and s.required:
                raise _fail(source, f"{prefix}.{name}", f"missing; expected {type_name(s.type, s)}: {s.help}", s.name)
        elif s is not None:
            out[s.name] = data[name]
        else:
            out.update(_raw_settings(f.type, data[name], f"{prefix}.{name}", source))
    return out


def _settings_of(cls: type) -> list[Setting]:
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        out += [f.metadata["setting"]] if "setting" in f.metadata else _settings_of(f.type)
    return out


def _instance(cls: type, values: Mapping[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        s = f.metadata.get("setting")
        if s is None:
            kwargs[f.name] = _instance(f.type, values)
        elif s.name in values:
            kwargs[f.name] = values[s.name]
    return cls(**kwargs)


def _section(cls: type, data: Any, prefix: str, source: _Source) -> Any:
    """A section instance from a mapping, every value checked by the settings' own validator."""
    settings = _settings_of(cls)
    try:
        values = check_settings(_raw_settings(cls, data, prefix, source), settings)
    except SettingError as err:
        key = {s.name: s.key for s in settings}[err.setting]
        raise _fail(source, f"{prefix}.{key}", err.config_message, err.setting) from None
    return _instance(cls, values)


def _component(hint: Any) -> type | None:
    """The dataclass a field holds (``ComponentConfig | None`` -> ``ComponentConfig``), if any."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    return next((o for o in options if dataclasses.is_dataclass(o)), None)


def _build(cls: type, data: Mapping[str, Any], prefix: str, source: _Source) -> Any:
    """An instance of dataclass ``cls`` from a mapping; unknown and missing keys are errors."""
    hints = typing.get_type_hints(cls)
    dot = f"{prefix}." if prefix else ""
    kwargs = {}
    for name, f in _check_keys(cls, data, prefix, source).items():
        key, hint = f"{dot}{name}", hints[name]
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _fail(source, key, f"missing; expected {type_name(hint)}: {f.metadata.get('help', '')}")
            continue
        value, component = data[name], _component(hint)
        if component is BAOCSection:
            kwargs[name] = _section(component, value, key, source)
        elif component is not None and isinstance(value, Mapping):
            kwargs[name] = _build(component, value, key, source)
        else:
            try:
                kwargs[name] = conform(value, hint)
            except Mismatch as bad:
                raise _fail(source, key, f"invalid value {value!r} ({type(value).__name__}); {bad.detail}") from None
    return cls(**kwargs)


@functools.lru_cache(maxsize=1)
def _trainer_arguments() -> tuple[str, ...]:
    from lightning.pytorch import Trainer

    return tuple(p for p in inspect.signature(Trainer.__init__).parameters if p != "self")


def _parse(data: Any, source: _Source) -> Config:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source.name}: expected a mapping with a 'baoc' section, got {type(data).__name__}", source=source.name
        )
    if "baoc" not in data:
        raise _fail(source, "baoc", "missing: the config needs a 'baoc' section (at least baoc.memory_budget)")
    config: Config = _build(Config, data, "", source)
    if config.trainer:
        allowed = _trainer_arguments()
        for k in config.trainer:
            if k not in allowed:
                close = difflib.get_close_matches(k, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise _fail(source, f"trainer.{k}", f"unknown key{hint}: not an argument of lightning.Trainer")
    return config


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
        SamplerConfig(sample_every=5, sparse_sampling=4, capacity=32, max_elements=4096, instrument_share=0.02)
    """
    return _parse(plain(data), _Source(source))


def parse_section(data: Mapping[str, Any] | Any, source: str = "<dict>") -> BAOCSection:
    """A validated :class:`BAOCSection` from the ``baoc`` section alone (keys named ``baoc.*``).

    Example:
        >>> parse_section({"memory_budget": 0.3, "allowed_configs": ["fp32", "int8"]}).allowed_configs
        ['fp32', 'int8']
    """
    return _parse({"baoc": plain(data)}, _Source(source)).baoc


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


def _kwargs(section: Any) -> dict[str, Any]:
    out = {}
    for s in _settings_of(type(section)):
        value = section
        for part in s.key.split("."):
            value = getattr(value, part)
        out[s.name] = value
    return out


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
        config = config.baoc
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        # instances (possibly built by LightningCLI / by hand) go through the same checks
        return _kwargs(parse_section(dataclasses.asdict(config), source=type(config).__name__))
    data = plain(config)
    if not isinstance(data, Mapping):
        raise TypeError(
            f"config must be a Config, a BAOCSection or a mapping, got {type(config).__name__}; "
            f"load a file with load_config(path)"
        )
    return _kwargs(parse_config(data).baoc if "baoc" in data else parse_section(data))


# ---------------------------------------------------------------------------- JSON Schema


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def _number_schema(hint: Any, s: Setting | None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer" if hint is int else "number"}
    if s is not None and s.minimum is not None:
        out["minimum"] = s.minimum
    if s is not None and s.exclusive_minimum is not None:
        out["exclusiveMinimum"] = s.exclusive_minimum
    if hint is float and s is not None and s.fraction_maximum is not None:
        out["maximum"] = s.fraction_maximum
    return out


def _schema_of(hint: Any, s: Setting | None) -> dict[str, Any]:
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
        return {"anyOf": [_schema_of(a, s) for a in typing.get_args(hint)]}
    if origin is list:
        (item,) = typing.get_args(hint)
        out: dict[str, Any] = {"type": "array", "items": _schema_of(item, None)}
        if s is not None and s.min_items:
            out["minItems"] = s.min_items
        if typing.get_origin(item) is Literal:  # a list of choices takes each once
            out["uniqueItems"] = True
        return out
    if origin is dict:
        _, item = typing.get_args(hint)
        return {"type": "object", "additionalProperties": _schema_of(item, None)}
    if hint is bool:
        return {"type": "boolean"}
    if hint in (int, float):
        return _number_schema(hint, s)
    if hint is str:
        return {"type": "string"}
    raise TypeError(f"no JSON Schema for the type {hint!r}")  # pragma: no cover - tested over all fields


def _dataclass_schema(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        s = f.metadata.get("setting")
        prop = _schema_of(hints[f.name], s)
        text = s.help if s is not None else f.metadata.get("help")
        if text:
            prop = {"description": text, **prop}
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


def json_schema(section: type | None = None) -> dict[str, Any]:
    """The JSON Schema of a config file, generated from :class:`Config` and its dataclasses.

    Types, allowed values (format names from :data:`~lightning_baoc.FORMATS`), ranges, defaults
    and descriptions of the ``baoc`` section all come from
    :data:`~lightning_baoc.config.settings.SETTINGS`. Budget strings are checked for their syntax by
    :func:`load_config`, not by the schema. Regenerate the committed copy with
    ``python -m lightning_baoc schema > configs/baoc.schema.json``.

    Args:
        section: the ``baoc`` section's dataclass (default: :class:`BAOCSection`; another one
            from :func:`section_dataclass`).

    Example:
        >>> schema = json_schema()
        >>> schema["required"], schema["properties"]["baoc"]["properties"]["allowed_configs"]["anyOf"][0]["items"]["enum"][0]
        (['baoc'], 'fp32')
    """
    schema = _dataclass_schema(Config)
    if section is not None:
        schema["properties"]["baoc"] = {
            "description": Config.__dataclass_fields__["baoc"].metadata["help"], **_dataclass_schema(section)
        }
    return {
        "$schema": SCHEMA_DIALECT,
        "$comment": "Generated by `python -m lightning_baoc schema` from lightning_baoc/config/settings.py; do not edit.",
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
    "section_dataclass",
]
