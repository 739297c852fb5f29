"""Typed BAOC configs: the dataclass behind the YAML templates, loading with overrides, JSON Schema.

A config file (``configs/vision.yaml``, ``configs/language.yaml``, ``configs/diffusion.yaml``) holds a
``baoc`` section whose keys are the settings' names, the arguments of :class:`~lightning_baoc.BAOC`:
one word for each setting in Python (``BAOC(sample_every=5)``), in a file (``baoc.sample_every``), in a
dotlist override (``baoc.sample_every=5``), in LightningCLI (``--baoc.sample_every``), in the JSON
Schema and in every message. Optionally it holds the sections a ``LightningCLI`` config has
(``trainer``, ``model``, ``data``, ``seed_everything``, ``ckpt_path``), so one file serves
:func:`load_config`, ``examples/cli.py`` (LightningCLI), ``examples/hydra_baoc.py`` (Hydra) and
``lightning-baoc check``:

.. code-block:: yaml

    baoc:
      memory_budget: 0.35            # fraction of fp32 AdamW state memory, or "6GB"
      time_budget: null              # multiple of the fp32 optimizer step, or "12ms"
      warmup_steps: 200
      formats: [fp32, bf16_momentum, bf16, int8, int8_factored, nomomentum, factored]
      granularity: layer
      blocks: {embeddings: ["wte.*", "wpe.*"]}
      monitor: val_loss
      sample_every: 10

The section is :class:`BAOCSection`, a dataclass generated from
:data:`lightning_baoc.config.settings.SETTINGS` (a field per setting, its type, default and help); its
values are checked by the callback's own validator (:func:`~lightning_baoc.config.settings.check_setting`,
:func:`~lightning_baoc.config.settings.rule_errors`), and the JSON Schema (:func:`json_schema`) is
generated from it. :func:`baoc_kwargs` and :meth:`BAOC.from_config <lightning_baoc.BAOC.from_config>`
turn a section into the callback.

Loading is strict and reports every error of a config at once: an unknown key anywhere (also in
``trainer``, checked against ``lightning.Trainer``'s arguments) with its closest known key, a missing
``baoc.memory_budget``, a value of the wrong type or out of range with the setting's message. One
:class:`ConfigError` lists them all; each names the key (``baoc.sample_every``) and where it came from
(the file, or the dotlist override that set it). A key of 0.1.0's nested section
(``baoc.sampler.sample_every``, :data:`RETIRED_KEYS`) is an unknown key whose message names the key
that replaced it. Overrides are OmegaConf dotlists (``baoc.memory_budget=0.25``); Hydra is not needed.
:func:`lightning_cli_errors` runs the same checks on a LightningCLI config, before jsonargparse sees it, and
:func:`override_errors` on the keys of command-line overrides (Hydra's too), before anything composes them.
An unknown key's message ends with what to write instead (:attr:`ConfigError.fix`): the override or
argument corrected, or the key renamed.
The committed ``configs/baoc.schema.json`` is regenerated with
``python -m lightning_baoc schema > configs/baoc.schema.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import shlex
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

from lightning_baoc.config.settings import (
    SETTING,
    SETTINGS,
    Mismatch,
    Setting,
    SettingError,
    args_section,
    check_setting,
    conform,
    did_you_mean,
    plain,
    rule_errors,
    type_name,
)

#: ``$id``-less draft of the generated schema.
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

#: The keys of version 0.1.0's nested ``baoc`` section (the BAOC paper's vocabulary) -> the setting
#: that replaced each. They are not read: a file that still uses one gets an error naming the new key.
RETIRED_KEYS: dict[str, str] = {
    "allowed_configs": "formats",
    "block_id.granularity": "granularity",
    "block_id.patterns": "blocks",
    "master_weights.corrections": "corrections",
    "re_evaluation_trigger.every_n_epochs": "reevaluate_every_n_epochs",
    "re_evaluation_trigger.monitor": "monitor",
    "re_evaluation_trigger.mode": "mode",
    "re_evaluation_trigger.patience": "patience",
    "re_evaluation_trigger.min_delta": "min_delta",
    "risk_thresholds.hysteresis": "hysteresis",
    "risk_thresholds.horizon": "horizon",
    "risk_thresholds.max_block_risk": "max_block_risk",
    "sampler.sample_every": "sample_every",
    "sampler.sparse_sampling": "sparse_sampling",
    "sampler.capacity": "capacity",
    "sampler.max_elements": "max_elements",
    "sampler.instrument_share": "instrument_share",
    "calibration.mode": "calibration",
    "calibration.cache_dir": "calibration_cache_dir",
}
_RETIRED_SECTIONS = {key.split(".")[0] for key in RETIRED_KEYS if "." in key}

#: How ``lightning.pytorch.cli.LightningCLI`` configs name the callback in ``trainer.callbacks``.
BAOC_CLASS_PATHS = ("lightning_baoc.BAOC", "lightning_baoc.integrations.callback.BAOC", "BAOC")


class ConfigError(ValueError):
    """The errors of a config: unknown keys and bad values, every one found, each naming its key and source.

    With one error, the message is that error (``"vision.yaml: baoc.sample_every: invalid value 0;
    expected an int >= 1"``); with several, a line per error under a count.

    Attributes:
        errors: every error, each a :class:`ConfigError` of one key (a single error lists itself).
        key: the dotted key (``"baoc.sample_every"``), or ``""`` for the whole config; of the first
            error when there are several.
        source: where the value came from: a file name, ``"override 'k=v'"``, ``"argument '--k=v'"``
            or ``"<dict>"``.
        setting: the setting of a ``baoc`` key (``"sample_every"``), else ``""``.
        suggestion: the key meant, for an unknown key with a close one (``"baoc.sample_every"``), else ``""``.
        fix: what to write instead of an unknown key, the end of its message: the override or argument
            corrected (``"write baoc.sample_every=5"``, ``"write --trainer.callbacks.warmup_steps=100"``), or
            in a file or a mapping the key renamed (``"rename warmup to warmup_steps"``); else ``""``.

    Example:
        >>> try:
        ...     parse_config({"baoc": {"memory_budget": 0.3, "warmup": 100, "sample_every": 0}})
        ... except ConfigError as err:
        ...     print(err)
        ...     print([e.key for e in err.errors], err.errors[0].suggestion)
        2 errors in <dict>:
          <dict>: baoc.warmup: unknown key (did you mean baoc.warmup_steps?); rename warmup to warmup_steps
          <dict>: baoc.sample_every: invalid value 0; expected an int >= 1
        ['baoc.warmup', 'baoc.sample_every'] baoc.warmup_steps
    """

    def __init__(
        self,
        message: str,
        key: str = "",
        source: str = "",
        setting: str = "",
        suggestion: str = "",
        errors: Sequence[ConfigError] | None = None,
        fix: str = "",
    ) -> None:
        super().__init__(message)
        self.key = key
        self.source = source
        self.setting = setting
        self.suggestion = suggestion
        self.fix = fix
        self.errors: list[ConfigError] = list(errors) if errors else [self]

    @classmethod
    def of(cls, errors: Sequence[ConfigError], where: str = "the config") -> ConfigError:
        """One error for ``errors``: the error itself if there is one, else a count and a line per error."""
        if not errors:
            raise ValueError("ConfigError.of needs at least one error")
        if len(errors) == 1:
            return errors[0]
        first = errors[0]
        lines = "\n".join(f"  {e}" for e in errors)
        return cls(
            f"{len(errors)} errors in {where}:\n{lines}", first.key, first.source, first.setting, first.suggestion, errors,
            fix=first.fix,
        )


def _help(text: str, **more: Any) -> dict[str, Any]:
    """Field metadata: the description (schema, docs), and ``missing``: the message when it is left out."""
    return {"help": text, **more}


# ---------------------------------------------------------------------------- the baoc section


def _section_class() -> type:
    """:class:`BAOCSection` from :data:`~lightning_baoc.config.settings.SETTINGS`: a field per setting,
    under its name, carrying ``{"setting": s}`` as metadata; nothing is validated here."""
    fields = [
        (s.name, s.type, field(metadata={"setting": s}) if s.required else field(default=s.default, metadata={"setting": s}))
        for s in SETTINGS
    ]
    doc = (
        "The ``baoc`` section of a config: every setting of the BAOC callback, under its argument's name.\n\n"
        "Generated from :data:`~lightning_baoc.config.settings.SETTINGS`; :func:`parse_section` validates.\n\n"
        + args_section(SETTINGS)
        + "\n\nExample:\n    >>> parse_section({'memory_budget': 0.3, 'sample_every': 5}).sample_every\n    5\n"
    )
    cls = dataclasses.make_dataclass("BAOCSection", fields, namespace={"__doc__": doc})
    cls.__module__ = __name__  # pickles, and jsonargparse finds it, as a class written out
    return cls


#: The ``baoc`` section (generated from :data:`~lightning_baoc.config.settings.SETTINGS`).
BAOCSection = _section_class()


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

    baoc: BAOCSection = field(  # type: ignore[valid-type]
        metadata=_help(
            "BAOC settings: the budgets, the formats, blocks, triggers.",
            missing="the config needs a 'baoc' section (at least baoc.memory_budget)",
        )
    )
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


# ---------------------------------------------------------------------------- checking, every error


#: An override or argument as written: its prefix (``--``, Hydra's ``+`` / ``++`` / ``~``), its dotted
#: key, and the rest (``=value``, `` value`` or nothing).
_WRITTEN = re.compile(r"([-+~]*)([^=\s]+)(.*)", re.S)


def _override_key(text: str) -> str:
    """The dotted key of an override as written: ``'+baoc.sample_every=5'`` -> ``'baoc.sample_every'``."""
    return text.split("=", 1)[0].strip().lstrip("+~")


def _command_text(text: str) -> str:
    """``text`` as typed in a shell: quoted where the shell would split or expand it."""
    prefix, key, rest = _WRITTEN.fullmatch(text).groups()  # type: ignore[union-attr]
    if rest[:1].isspace():  # "--key value": two words
        return f"{shlex.quote(prefix + key)} {shlex.quote(rest.strip())}"
    return shlex.quote(text)


class _Source:
    """Names where a key's value came from (the file, or the override or argument that set it), and
    what to write instead of an unknown key.

    Args:
        name: the file, ``"<dict>"``, or the label of a command-line argument.
        labels: dotted key -> ``"override 'k=v'"``, for the keys an override set.
        texts: dotted key -> the override as written (``"+baoc.sampel_every=5"``).
        argument: the command-line argument that is the whole source, as written.
        present: Hydra's primary config: whether a dotted key is in it (an override of a key that is
            not needs Hydra's ``+``, one of a key that is must not have it).
    """

    def __init__(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        texts: Mapping[str, str] | None = None,
        argument: str | None = None,
        present: Callable[[str], bool] | None = None,
    ) -> None:
        self.name = name
        self.labels = dict(labels or {})
        self.texts = dict(texts or {})
        self.argument = argument
        self.present = present

    def _override(self, key: str) -> str | None:
        for okey in reversed(list(self.labels)):  # the last override of a key set it
            if key == okey or key.startswith(okey + ".") or okey.startswith(key + "."):
                return okey
        return None

    def of(self, key: str) -> str:
        okey = self._override(key)
        return self.name if okey is None else self.labels[okey]

    def fix(self, key: str, suggestion: str) -> str:
        """What to write instead of the unknown ``key`` when ``suggestion`` is meant: the override or
        argument that set it, corrected; else (a file, a mapping) the key renamed, when it stays where it is."""
        okey = self._override(key)
        written = self.texts.get(okey) if okey is not None else self.argument
        if written is None:
            (parent, _, old), (new_parent, _, new) = key.rpartition("."), suggestion.rpartition(".")
            return f"rename {old} to {new}" if parent == new_parent and old != new else ""
        match = _WRITTEN.fullmatch(written)
        if match is None:
            return ""
        prefix, dotted, rest = match.groups()
        if dotted != key and not dotted.startswith(key + "."):  # the key is inside the value: nothing to rewrite
            return ""
        corrected = suggestion + dotted[len(key):]
        if self.present is not None and prefix in ("", "+"):  # Hydra: '+' adds a key, and only a new one
            prefix = "" if self.present(corrected) else "+"
        return f"write {_command_text(prefix + corrected + rest)}"


def _suggest(old: str) -> tuple[str | None, bool]:
    """The setting meant by the unknown ``baoc`` key ``old`` (dotted below ``baoc``), and whether
    ``old`` is one of :data:`RETIRED_KEYS` (the key renamed) rather than a near miss."""
    if old in RETIRED_KEYS:
        return RETIRED_KEYS[old], True
    names = [s.name for s in SETTINGS]
    if "." not in old and (close := did_you_mean(old, names)):
        return close, False
    if close := did_you_mean(old, list(RETIRED_KEYS)):  # a near miss of an old key: "sampler.every"
        return RETIRED_KEYS[close], False
    head, _, leaf = old.rpartition(".")
    return did_you_mean(old.replace(".", "_"), names) or (did_you_mean(leaf, names) if head else None), False


class _Errors:
    """Every error of one config, each with its key and where it came from."""

    def __init__(self, source: _Source) -> None:
        self.source = source
        self.found: list[ConfigError] = []

    def add(self, key: str, message: str, setting: str = "", suggestion: str = "") -> None:
        """One error of ``key``; with a ``suggestion``, its message ends with what to write instead."""
        where = self.source.of(key)
        fix = self.source.fix(key, suggestion) if suggestion else ""
        text = f"{where}: {key}: {message}" + (f"; {fix}" if fix else "")
        self.found.append(ConfigError(text, key, where, setting, suggestion, fix=fix))

    def unknown(self, key: str, known: Sequence[str], prefix: str, note: str = "", listed: bool = True) -> None:
        """``key`` (dotted, under ``prefix``) is none of ``known``: its closest one, else (``listed``) them all."""
        dot = f"{prefix}." if prefix else ""
        close = did_you_mean(key.rpartition(".")[2], known)
        if close:
            self.add(key, f"unknown key (did you mean {dot}{close}?){note}", suggestion=f"{dot}{close}")
        elif listed:
            where = f"of {prefix}" if prefix else "at the top level"
            self.add(key, f"unknown key{note}; the keys {where}: {list(known)}")
        else:
            self.add(key, f"unknown key{note}")

    def unknown_setting(self, key: str, old: str, prefix: str) -> None:
        """``key`` (``prefix`` + ``.`` + ``old``) is no setting: the setting meant, or the list."""
        new, renamed = _suggest(old)
        if new is None:
            self.add(key, f"unknown key; the keys of {prefix}: {[s.name for s in SETTINGS]}")
        elif renamed:
            self.add(key, f"unknown key; the key is now {prefix}.{new}", suggestion=f"{prefix}.{new}")
        else:
            self.add(key, f"unknown key (did you mean {prefix}.{new}?)", suggestion=f"{prefix}.{new}")


def _section(data: Any, prefix: str, errors: _Errors, whole: bool = True) -> dict[str, Any]:
    """The checked settings of a ``baoc`` section (name -> value), every error added to ``errors``.

    ``whole``: the section is complete, so a missing required setting and the rules between settings
    are errors too (a LightningCLI config merged from several sources checks each one alone).
    """
    if not isinstance(data, Mapping):
        errors.add(prefix, f"invalid value {data!r}; expected a mapping of settings")
        return {}
    checked: dict[str, Any] = {}
    failed: set[str] = set()
    for k, value in data.items():
        name, key = str(k), f"{prefix}.{k}"
        if name in _RETIRED_SECTIONS and isinstance(value, Mapping):  # 0.1.0's nested section
            for leaf in value:
                errors.unknown_setting(f"{key}.{leaf}", f"{name}.{leaf}", prefix)
            failed.add(name)
        elif name in SETTING:
            try:
                checked[name] = check_setting(SETTING[name], value)
            except SettingError as err:
                errors.add(key, err.config_message, name)
                failed.add(name)
        else:
            errors.unknown_setting(key, name, prefix)
    if not whole:
        return checked
    for s in SETTINGS:
        if s.required and s.name not in data:
            errors.add(f"{prefix}.{s.name}", f"missing; expected {type_name(s.type, s)}: {s.help}", s.name)
    values = {**{s.name: s.default for s in SETTINGS if not s.required}, **checked}
    for err in rule_errors({k: v for k, v in values.items() if k not in failed}):
        errors.add(f"{prefix}.{err.setting}", err.config_message, err.setting)
    return checked


@functools.lru_cache(maxsize=1)
def _trainer_arguments() -> tuple[str, ...]:
    from lightning.pytorch import Trainer

    return tuple(p for p in inspect.signature(Trainer.__init__).parameters if p != "self")


def _trainer(data: Any, prefix: str, errors: _Errors) -> None:
    """The keys of a ``trainer`` section, against ``lightning.Trainer``'s arguments."""
    if not isinstance(data, Mapping):
        errors.add(prefix, f"invalid value {data!r}; expected a mapping of lightning.Trainer arguments")
        return
    allowed = _trainer_arguments()
    for k in data:
        if str(k) not in allowed:
            errors.unknown(f"{prefix}.{k}", allowed, prefix, note=": not an argument of lightning.Trainer", listed=False)


def _component(hint: Any) -> type | None:
    """The dataclass a field holds (``ComponentConfig | None`` -> ``ComponentConfig``), if any."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    return next((o for o in options if dataclasses.is_dataclass(o)), None)


def _build(cls: type, data: Any, prefix: str, errors: _Errors) -> Any:
    """An instance of dataclass ``cls`` from a mapping, every error added to ``errors`` (then ``None``)."""
    if not isinstance(data, Mapping):
        errors.add(prefix, f"invalid value {data!r}; expected a mapping")
        return None
    before = len(errors.found)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    dot = f"{prefix}." if prefix else ""
    kwargs = {}
    for k, value in data.items():
        name, key = str(k), f"{dot}{k}"
        if name not in fields:
            errors.unknown(key, list(fields), prefix)
            continue
        hint, component = hints[name], _component(hints[name])
        if component is BAOCSection:
            count = len(errors.found)
            checked = _section(value, key, errors)
            kwargs[name] = BAOCSection(**checked) if len(errors.found) == count else None
        elif cls is Config and name == "trainer":
            _trainer(value, key, errors)
            kwargs[name] = value
        elif component is not None and isinstance(value, Mapping):
            kwargs[name] = _build(component, value, key, errors)
        else:
            try:
                kwargs[name] = conform(value, hint)
            except Mismatch as bad:
                errors.add(key, f"invalid value {value!r} ({type(value).__name__}); {bad.detail}")
    for name, f in fields.items():
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing = f.metadata.get("missing") or f"expected {type_name(hints[name])}: {f.metadata.get('help', '')}"
            errors.add(f"{dot}{name}", f"missing; {missing}")
    return cls(**kwargs) if len(errors.found) == before else None


def _parse(data: Any, source: _Source) -> Config:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source.name}: expected a mapping with a 'baoc' section, got {type(data).__name__}", source=source.name
        )
    errors = _Errors(source)
    config = _build(Config, data, "", errors)
    if errors.found:
        raise ConfigError.of(errors.found, source.name)
    return config


def parse_config(data: Mapping[str, Any] | Any, source: str = "<dict>", overrides: Sequence[str] = ()) -> Config:
    """A validated :class:`Config` from a mapping (or an OmegaConf ``DictConfig``, e.g. Hydra's).

    Args:
        data: the whole config, with a ``baoc`` section.
        source: named in error messages (default: ``"<dict>"``).
        overrides: the overrides already applied to ``data`` (Hydra's ``HydraConfig.get().overrides.task``),
            as written: an error of a key one of them set names that override, and an unknown key the
            override to write instead (default: none).

    Raises:
        ConfigError: every unknown key (with its closest known key), a missing
            ``baoc.memory_budget``, every bad value; each names its key and ``source`` (or its override).

    Example:
        >>> parse_config({"baoc": {"memory_budget": "35%", "sample_every": 5}}).baoc.sample_every
        5
        >>> try:
        ...     parse_config({"baoc": {"memory_budget": 0.3, "sampel_every": 5}}, "the Hydra config", ["+baoc.sampel_every=5"])
        ... except ConfigError as err:
        ...     print(err)
        override '+baoc.sampel_every=5': baoc.sampel_every: unknown key (did you mean baoc.sample_every?); write +baoc.sample_every=5
    """
    return _parse(plain(data), _Source(source, *_override_labels(overrides)))


def parse_section(data: Mapping[str, Any] | Any, source: str = "<dict>") -> BAOCSection:  # type: ignore[valid-type]
    """A validated :class:`BAOCSection` from the ``baoc`` section alone (keys named ``baoc.*``).

    Example:
        >>> parse_section({"memory_budget": 0.3, "formats": ["fp32", "int8"]}).formats
        ['fp32', 'int8']
    """
    return _parse({"baoc": plain(data)}, _Source(source)).baoc


def lightning_cli_errors(
    data: Mapping[str, Any] | Any,
    source: str = "<dict>",
    *,
    argument: str | None = None,
    callback: str | None = None,
) -> list[ConfigError]:
    """Every error of the BAOC settings and ``trainer`` keys of one LightningCLI input (a config file
    or an argument), before jsonargparse parses it; an empty list when there is none.

    Args:
        data: the input as a config: a file's content, or an argument as a one-key config
            (``--baoc.sample_every=5``: ``{"baoc": {"sample_every": 5}}``).
        source: named in every message: the file, or ``"argument '--k=v'"`` (default: ``"<dict>"``).
        argument: the argument ``data`` came from, as written: an unknown key's message then ends with
            the argument to write instead (``write --baoc.sample_every=5``); a file's with the key to
            rename (default: ``None``, not an argument).
        callback: the class path of the callback that jsonargparse's ``--trainer.callbacks.KEY`` (or
            ``.init_args.KEY``) sets: the last one added before it. When it is BAOC, the argument's
            ``{"trainer": {"callbacks": {KEY: value}}}`` is checked as BAOC's settings, named
            ``trainer.callbacks.KEY`` as written (default: ``None``).

    Checked as :func:`load_config` checks them: the ``baoc`` section (``examples/cli.py``'s) and the
    ``init_args`` of every BAOC in ``trainer.callbacks`` (the same keys: BAOC's arguments), unknown keys
    with their closest known key and bad values with the setting's message; the keys of ``trainer``
    against ``lightning.Trainer``'s arguments. Sections of a subcommand (``fit: {trainer: ...}``) too.
    A LightningCLI config is merged from several files and arguments, so each input is checked alone:
    a missing setting and the rules between settings are left to the merged section, which
    :meth:`BAOC.from_config <lightning_baoc.BAOC.from_config>` (or ``BAOC(...)``) checks. The other
    sections are jsonargparse's.

    Example:
        >>> [str(e) for e in lightning_cli_errors({"trainer": {"max_step": 10}}, "my.yaml")]
        ['my.yaml: trainer.max_step: unknown key (did you mean trainer.max_steps?): not an argument of lightning.Trainer; rename max_step to max_steps']
        >>> arg = "--trainer.callbacks.warmup_stepz=100"
        >>> [err] = lightning_cli_errors({"trainer": {"callbacks": {"warmup_stepz": 100}}}, f"argument {arg!r}",
        ...                              argument=arg, callback="lightning_baoc.BAOC")
        >>> print(err)
        argument '--trainer.callbacks.warmup_stepz=100': trainer.callbacks.warmup_stepz: unknown key (did you mean trainer.callbacks.warmup_steps?); write --trainer.callbacks.warmup_steps=100
    """
    data = plain(data)
    errors = _Errors(_Source(source, argument=argument))
    if not isinstance(data, Mapping):
        return []

    def check(node: Mapping[str, Any], dot: str) -> None:
        if node.get("baoc") is not None:
            _section(node["baoc"], f"{dot}baoc", errors, whole=False)
        trainer = node.get("trainer")
        if trainer is None:
            return
        _trainer(trainer, f"{dot}trainer", errors)
        callbacks = trainer.get("callbacks") if isinstance(trainer, Mapping) else None
        if isinstance(callbacks, Mapping) and "class_path" not in callbacks:  # --trainer.callbacks.KEY=value
            if callback in BAOC_CLASS_PATHS:
                nested = set(callbacks) == {"init_args"}
                _section(callbacks["init_args"] if nested else callbacks,
                         f"{dot}trainer.callbacks" + (".init_args" if nested else ""), errors, whole=False)
            return
        items = [callbacks] if isinstance(callbacks, Mapping) else callbacks if isinstance(callbacks, list) else []
        for i, item in enumerate(items):
            if isinstance(item, Mapping) and item.get("class_path") in BAOC_CLASS_PATHS and "init_args" in item:
                _section(item["init_args"], f"{dot}trainer.callbacks[{i}].init_args", errors, whole=False)

    check(data, "")
    for subcommand in ("fit", "validate", "test", "predict"):
        if isinstance(data.get(subcommand), Mapping):
            check(data[subcommand], f"{subcommand}.")
    return errors.found


def _has(data: Any, dotted: str) -> bool:
    """Whether the mapping ``data`` holds the dotted key (``"baoc.sample_every"``)."""
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


def _key_errors(key: str, errors: _Errors) -> None:
    """The errors of one dotted key of an override, its value left out (a sweep, a value to compose)."""
    parts = key.split(".")
    fields = {f.name: f for f in dataclasses.fields(Config)}
    head = parts[0]
    if head not in fields:
        errors.unknown(head, list(fields), "")
    elif len(parts) == 1:
        return
    elif head == "baoc":
        name = parts[1]
        if name not in SETTING:  # below a setting (blocks.embeddings) is its value
            old = ".".join(parts[1:]) if name in _RETIRED_SECTIONS else name
            errors.unknown_setting(f"baoc.{old}", old, "baoc")
    elif head == "trainer":
        _trainer({parts[1]: None}, "trainer", errors)
    elif head in ("model", "data") and parts[1] not in {f.name for f in dataclasses.fields(ComponentConfig)}:
        errors.unknown(f"{head}.{parts[1]}", [f.name for f in dataclasses.fields(ComponentConfig)], head)


def override_errors(
    overrides: Sequence[str], config: Mapping[str, Any] | Any | None = None
) -> list[ConfigError]:
    """Every unknown key of command-line overrides, before anything applies them: each with its closest
    known key and the override to write instead; an empty list when there is none.

    The overrides are OmegaConf dotlists (``baoc.sample_every=5``) or Hydra's (``+baoc.sample_every=5``,
    ``++k=v``, ``~k``, sweeps ``baoc.memory_budget=0.5,0.35``). Only their keys are checked, as
    :func:`load_config` checks a file's: ``baoc`` keys against the settings (a key of 0.1.0's nested
    section gets the key that replaced it), ``trainer`` keys against ``lightning.Trainer``'s arguments,
    the sections' names. Values are left to the composed config (:func:`parse_config`): a sweep is no
    value yet. Hydra's own keys (``hydra.*``) and config groups (``group/option``, ``@package``) are not
    this config's and are skipped.

    Hydra refuses ``baoc.memory_budgett=0.25`` (the key is not in the config) with its advice to write
    ``+baoc.memory_budgett=0.25``, and then applies that typo; checked here first, both get the key meant.

    Args:
        overrides: the overrides as written on the command line.
        config: the config they apply to (Hydra's primary config, as a mapping): the override to write
            then has Hydra's ``+`` exactly when its key is not in it (default: ``None``: as written).

    Example:
        >>> config = {"baoc": {"memory_budget": 0.35, "sample_every": 10}}
        >>> for err in override_errors(["baoc.memory_budgett=0.25", "+baoc.sample_evry=5", "+baoc.reprot=false"], config):
        ...     print(err)
        override 'baoc.memory_budgett=0.25': baoc.memory_budgett: unknown key (did you mean baoc.memory_budget?); write baoc.memory_budget=0.25
        override '+baoc.sample_evry=5': baoc.sample_evry: unknown key (did you mean baoc.sample_every?); write baoc.sample_every=5
        override '+baoc.reprot=false': baoc.reprot: unknown key (did you mean baoc.report?); write +baoc.report=false
    """
    labels, texts = _override_labels(overrides)
    keys = {key: None for key in labels if not ("/" in key or "@" in key or key.split(".")[0] == "hydra")}
    present = None if config is None else functools.partial(_has, _unresolved(config))
    errors = _Errors(_Source("the overrides", labels, texts, present=present))
    for key in keys:
        _key_errors(key, errors)
    return errors.found


def _unresolved(config: Mapping[str, Any] | Any) -> Any:
    """``config`` as plain dicts and lists, an OmegaConf container's interpolations left unresolved
    (only its keys are read)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(config, (DictConfig, ListConfig)):
            return OmegaConf.to_container(config, resolve=False)
    except ImportError:  # pragma: no cover - omegaconf is installed with the package
        pass
    return config


# ---------------------------------------------------------------------------- loading


def _override_labels(overrides: Sequence[str]) -> tuple[dict[str, str], dict[str, str]]:
    """For each dotted key an override sets: its label in messages (``"override 'k=v'"``) and its text."""
    if isinstance(overrides, str):
        raise TypeError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
    labels: dict[str, str] = {}
    texts: dict[str, str] = {}
    for text in overrides:
        if isinstance(text, str) and _override_key(text):
            labels[_override_key(text)] = f"override {text!r}"
            texts[_override_key(text)] = text
    return labels, texts


def _parse_overrides(overrides: Sequence[str]) -> tuple[Any, dict[str, str], dict[str, str]]:
    from omegaconf import OmegaConf

    labels, texts = _override_labels(overrides)
    for text in overrides:
        if not isinstance(text, str) or "=" not in text or not _override_key(text):
            raise ConfigError(
                f"override {text!r}: expected 'key=value' with a dotted key, e.g. 'baoc.memory_budget=0.25'",
                source=f"override {text!r}",
            )
    try:
        return OmegaConf.from_dotlist([t.lstrip("+") for t in overrides]), labels, texts
    except Exception as err:  # noqa: BLE001 - OmegaConf raises several grammar errors
        raise ConfigError(f"overrides {list(overrides)!r}: {err}", source="overrides") from None


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config with OmegaConf, apply dotlist overrides, validate it strictly.

    Args:
        path: a YAML file with a ``baoc`` section (e.g. ``configs/vision.yaml``).
        overrides: OmegaConf dotlist overrides, applied in order (``"baoc.memory_budget=0.25"``,
            ``"baoc.formats=[fp32,int8]"``) (default: none). ``${...}`` interpolations are
            resolved after merging.

    Returns:
        The :class:`Config`.

    Raises:
        ConfigError: the file cannot be read or parsed, or it holds errors: every unknown key (with
            its closest known key, and the override to write or the key to rename) and every bad value,
            each naming its key, and the file or the override that set it (:attr:`ConfigError.errors`
            lists them).

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
    labels: dict[str, str] = {}
    texts: dict[str, str] = {}
    if overrides:
        dotlist, labels, texts = _parse_overrides(overrides)
        merged = OmegaConf.merge(loaded, dotlist)
    try:
        data = OmegaConf.to_container(merged, resolve=True)
    except Exception as err:  # noqa: BLE001 - interpolation errors
        raise ConfigError(f"{name}: cannot resolve an interpolation: {err}", source=name) from None
    return _parse(data, _Source(name, labels, texts))


def baoc_kwargs(config: Config | BAOCSection | Mapping[str, Any] | Any) -> dict[str, Any]:  # type: ignore[valid-type]
    """The keyword arguments of :class:`~lightning_baoc.BAOC` that a config asks for.

    Args:
        config: a :class:`Config`, a :class:`BAOCSection`, or a mapping / ``DictConfig`` of a
            whole config (with ``baoc``) or of the ``baoc`` section alone. It is validated again.

    Example:
        >>> kw = baoc_kwargs({"memory_budget": 0.3, "sample_every": 5, "warmup_steps": 50})
        >>> kw["memory_budget"], kw["sample_every"], kw["warmup_steps"], kw["formats"]
        (0.3, 5, 50, None)
    """
    if isinstance(config, Config):
        config = config.baoc
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        # instances (possibly built by LightningCLI / by hand) go through the same checks
        config = parse_section(dataclasses.asdict(config), source=type(config).__name__)
    else:
        data = plain(config)
        if not isinstance(data, Mapping):
            raise TypeError(
                f"config must be a Config, a BAOCSection or a mapping, got {type(config).__name__}; "
                f"load a file with load_config(path)"
            )
        config = parse_config(data).baoc if "baoc" in data else parse_section(data)
    return {s.name: getattr(config, s.name) for s in SETTINGS}


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


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a config file, generated from :class:`Config` and its dataclasses.

    Types, allowed values (format names from :data:`~lightning_baoc.FORMATS`), ranges, defaults
    and descriptions of the ``baoc`` section all come from
    :data:`~lightning_baoc.config.settings.SETTINGS`. Budget strings are checked for their syntax by
    :func:`load_config`, not by the schema. Regenerate the committed copy with
    ``python -m lightning_baoc schema > configs/baoc.schema.json``.

    Example:
        >>> schema = json_schema()
        >>> schema["required"], schema["properties"]["baoc"]["properties"]["formats"]["anyOf"][0]["items"]["enum"][0]
        (['baoc'], 'fp32')
    """
    return {
        "$schema": SCHEMA_DIALECT,
        "$comment": "Generated by `python -m lightning_baoc schema` from lightning_baoc/config/settings.py; do not edit.",
        **_dataclass_schema(Config),
        "title": "lightning_baoc config",
    }


def schema_text() -> str:
    """:func:`json_schema` as the text of ``configs/baoc.schema.json`` (2-space indent, newline)."""
    import json

    return json.dumps(json_schema(), indent=2) + "\n"


__all__ = [
    "BAOCSection",
    "BAOC_CLASS_PATHS",
    "ComponentConfig",
    "Config",
    "ConfigError",
    "RETIRED_KEYS",
    "baoc_kwargs",
    "json_schema",
    "lightning_cli_errors",
    "load_config",
    "override_errors",
    "parse_config",
    "parse_section",
    "schema_text",
]
