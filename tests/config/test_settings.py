"""Each setting is declared once (``lightning_baoc.config.settings.SETTINGS``): ``BAOCConfig``, the config
loader and the JSON Schema derive from it; the callback's and the Fabric strategy's ``__init__`` spell
every setting out and are held to it here (name, order, type, default, help); one validator refuses
a bad value with the same error from Python and from a config file."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from lightning_baoc import BAOC, BAOCStrategy
from lightning_baoc.config.files import BAOCSection, ConfigError, baoc_kwargs, json_schema, parse_config, parse_section
from lightning_baoc.config.settings import CONTROLLER_SETTINGS, REQUIRED, SETTING, SETTINGS, SettingError
from lightning_baoc.control.controller import MIN_SAMPLES, BAOCConfig

ROOT = Path(__file__).resolve().parents[2]


def _params(cls: type) -> dict[str, inspect.Parameter]:
    return dict(list(inspect.signature(cls.__init__).parameters.items())[1:])


# ---------------------------------------------------------------------------- every consumer, every setting


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: s.name)
def test_every_setting_is_in_every_consumer_with_the_same_default(s: Any) -> None:
    default = inspect.Parameter.empty if s.default is REQUIRED else s.default
    for cls in (BAOC, BAOCStrategy):
        p = _params(cls)[s.name]
        assert p.default == default and type(p.default) is type(default), cls
        assert typing.get_type_hints(cls.__init__)[s.name] == s.type, cls
    # one name everywhere: the argument is the config key, the dataclass field and the schema's property
    schema = json_schema()["properties"]["baoc"]["properties"][s.name]
    assert schema["description"] == s.help
    assert BAOCSection.__dataclass_fields__[s.name].metadata["setting"] is s
    if s.default is REQUIRED:
        assert s.name in json_schema()["properties"]["baoc"]["required"]
        return
    assert schema["default"] == json.loads(json.dumps(s.default))
    section = parse_section({"memory_budget": 0.3})
    assert getattr(section, s.name) == s.default
    assert baoc_kwargs(section)[s.name] == s.default
    if s.controller:
        assert getattr(BAOCConfig(memory_budget=0.3), s.name) == s.default


def test_the_signatures_keep_their_order_and_memory_budget_first() -> None:
    assert list(_params(BAOC)) == [s.name for s in SETTINGS]
    assert list(_params(BAOCStrategy))[: len(SETTINGS)] == [s.name for s in SETTINGS]
    assert list(BAOCConfig.__dataclass_fields__) == [s.name for s in CONTROLLER_SETTINGS]
    baoc = BAOC(0.3, None, 50)  # positionally, as before
    assert (baoc.config.memory_budget, baoc.config.warmup_steps) == (0.3, 50)
    with pytest.raises(TypeError, match="memory_budget"):
        BAOC()  # type: ignore[call-arg]
    doc = " ".join(BAOC.__init__.__doc__.split())
    for s in SETTINGS:  # LightningCLI's help: each setting's text and default
        default = "" if s.default is REQUIRED else f" (default: ``{s.default!r}``)"
        assert f"{s.name}: {' '.join(s.help.split())}{default}" in doc, s.name
    assert "BAOC.__init__" in BAOCStrategy.__init__.__doc__  # the strategy's settings are the callback's
    assert MIN_SAMPLES == SETTING["capacity"].minimum


def test_the_adapters_init_is_source_that_names_every_setting() -> None:
    """Written out, not generated: ``inspect.getsource`` (a reader, go-to-definition) finds each parameter."""
    for cls in (BAOC, BAOCStrategy):
        source = inspect.getsource(cls.__init__)
        assert source.lstrip().startswith("def __init__(")
        missing = [s.name for s in SETTINGS if f"\n        {s.name}: " not in source]
        assert not missing, (cls, missing)


# ---------------------------------------------------------------------------- one validator, one error

BAD = {
    "memory_budget": 1.5, "time_budget": 0.5, "warmup_steps": 0, "sample_every": 0, "granularity": "row",
    "blocks": ["net.*"], "formats": ["fp32", "int4"], "reevaluate_every_n_epochs": 0, "monitor": 3,
    "mode": "up", "patience": 0, "min_delta": -1.0, "hysteresis": -0.1, "horizon": 0, "sparse_sampling": 0,
    "capacity": 1, "max_elements": 0, "instrument_share": -0.01, "min_8bit_numel": -1, "calibration": "fast",
    "calibration_cache_dir": 3, "report": "pdf", "seed": -1, "max_block_risk": -1, "initial": 3, "corrections": ["ecc4"],
}


def test_every_setting_has_a_bad_value_below() -> None:
    assert set(BAD) == set(SETTING)


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_value_is_the_same_error_from_python_and_from_yaml(name: str) -> None:
    value = BAD[name]
    kwargs = {"memory_budget": 0.3, name: value}
    with pytest.raises(SettingError) as python:
        BAOC(**kwargs)
    assert python.value.setting == name and f"Invalid {name}={value!r}" in str(python.value)
    with pytest.raises(SettingError) as fabric:
        BAOCStrategy(**kwargs)
    assert str(fabric.value) == str(python.value)
    with pytest.raises(ConfigError) as yaml:
        parse_config({"baoc": {"memory_budget": 0.3, name: value}}, source="vision.yaml")
    assert yaml.value.key == f"baoc.{name}" and yaml.value.setting == name
    assert str(yaml.value) == f"vision.yaml: baoc.{name}: {python.value.config_message}"
    assert python.value.config_message == f"invalid value {value!r}; " + str(python.value).split("; ", 1)[1]


def test_an_unknown_format_names_adamws_formats_and_sgd_and_lions_with_the_closest() -> None:
    # the optimizer is not known before install: both lists, and none (no momentum buffer) only in SGD's and Lion's
    message = (
        "Invalid formats=['fp32', 'int4']; unknown 'int4' (did you mean 'int8'?); AdamW's formats: ['fp32', "
        "'bf16_momentum', 'bf16', 'nomomentum', 'int8', 'int8_factored', 'nomomentum_int8', 'factored', 'offload']; "
        "SGD's and Lion's: ['fp32', 'bf16', 'int8', 'none'] (list formats of the optimizer configure_optimizers returns)"
    )
    with pytest.raises(SettingError) as python:
        BAOC(memory_budget=0.3, formats=["fp32", "int4"])
    assert str(python.value) == message
    with pytest.raises(ConfigError) as yaml:
        parse_config({"baoc": {"memory_budget": 0.3, "formats": ["fp32", "int4"]}}, source="vision.yaml")
    assert str(yaml.value) == "vision.yaml: baoc.formats: invalid value " + message.split("=", 1)[1]
    with pytest.raises(SettingError, match=r"unknown 'nomomentun' \(did you mean 'nomomentum'\?\), 'fp64';"):
        BAOC(memory_budget=0.3, formats=["nomomentun", "fp64"])


def test_a_choice_outside_its_literal_gets_the_closest_one() -> None:
    with pytest.raises(SettingError) as info:
        BAOC(memory_budget=0.3, granularity="modul")
    assert str(info.value) == "Invalid granularity='modul'; allowed: ['module', 'layer', 'param'] (did you mean 'module'?)"
    with pytest.raises(SettingError) as info:
        BAOC(memory_budget=0.3, corrections=["ecc4"])
    assert str(info.value) == "Invalid corrections=['ecc4']; unknown 'ecc4' (did you mean 'ecc8'?); allowed: ['none', 'ecc8', 'ecc16']"


def test_a_rule_between_settings_is_the_same_error_too() -> None:
    with pytest.raises(SettingError) as python:
        BAOC(memory_budget=0.3, warmup_steps=5)
    with pytest.raises(ConfigError) as yaml:
        parse_config({"baoc": {"memory_budget": 0.3, "warmup_steps": 5}})
    assert python.value.setting == yaml.value.setting == "warmup_steps"
    assert str(yaml.value) == f"<dict>: baoc.warmup_steps: {python.value}"


def test_a_setting_error_is_a_value_error_and_a_type_error() -> None:
    with pytest.raises(ValueError):
        BAOCConfig(memory_budget=0.3, patience=0)
    with pytest.raises(TypeError):
        BAOCConfig(memory_budget=0.3, monitor=3)


# ---------------------------------------------------------------------------- a new setting: one edit

NEW_SETTINGS = '''\
    Setting("quantile", float, "A made-up knob of the sampler.", default=0.5, minimum=0.0),
    Setting("style", Optional[Literal["plain", "fancy"]], "A made-up choice.", default=None),
    Setting("floor", int, "A made-up count.", default=2, minimum=1),
'''

CHECKS = '''
import inspect
from lightning_baoc import BAOC, BAOCStrategy
from lightning_baoc.config.files import BAOCSection, ConfigError, json_schema, parse_config
from lightning_baoc.config.settings import SettingError

for cls in (BAOC, BAOCStrategy):
    params = inspect.signature(cls.__init__).parameters
    assert params["quantile"].default == 0.5 and params["quantile"].annotation == "float", cls
    assert params["style"].default is None and params["floor"].default == 2, cls
baoc = BAOC(memory_budget=0.3, quantile=0.25, style="fancy")
assert (baoc.config.quantile, baoc.config.style, baoc.config.floor) == (0.25, "fancy", 2)
assert {"quantile", "style", "floor"} <= set(BAOCSection.__dataclass_fields__)

schema = json_schema()["properties"]["baoc"]["properties"]
assert schema["quantile"] == {
    "description": "A made-up knob of the sampler.", "type": "number", "minimum": 0.0, "default": 0.5}
assert schema["style"]["anyOf"][0] == {"enum": ["plain", "fancy"]}
assert schema["floor"]["minimum"] == 1

config = {"baoc": {"memory_budget": 0.3, "quantile": 0.75, "style": "plain", "floor": 3}}
cfg = parse_config(config)
assert (cfg.baoc.quantile, cfg.baoc.style, cfg.baoc.floor) == (0.75, "plain", 3)
built = BAOC.from_config(cfg)
assert (built.config.quantile, built.config.style, built.config.floor) == (0.75, "plain", 3)

try:
    BAOC(memory_budget=0.3, quantile=-1.0)
except SettingError as err:
    python = err
try:
    parse_config({"baoc": {"memory_budget": 0.3, "quantile": -1.0, "quantil": 1}})
except ConfigError as err:
    yaml = err
assert python.setting == yaml.setting == "quantile" and yaml.key == "baoc.quantile", (python, yaml)
assert str(yaml.errors[1]) == "<dict>: baoc.quantil: unknown key (did you mean baoc.quantile?); rename quantil to quantile", yaml
assert str(yaml.errors[0]).endswith(python.config_message)
print("picked up")
'''


NEW_PARAMETERS = '''\
        quantile: float = 0.5,
        style: Optional[Literal["plain", "fancy"]] = None,
        floor: int = 2,
'''


def test_a_new_setting_reaches_every_consumer_with_its_entry_and_its_two_parameters(tmp_path: Path) -> None:
    """A copy of the package whose only changes are three more entries in ``SETTINGS`` and their
    parameters in ``BAOC.__init__`` and ``BAOCStrategy.__init__``."""
    shutil.copytree(ROOT / "lightning_baoc", tmp_path / "lightning_baoc", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "lightning_baoc" / "config" / "settings.py"
    text = path.read_text()
    end = "\n)\n\n#: Argument name -> "
    assert text.count(end) == 1, "the declaration's end moved: update this test's marker"
    path.write_text(text.replace(end, f"\n{NEW_SETTINGS})\n\n#: Argument name -> "))
    for adapter in ("callback.py", "fabric.py"):
        path = tmp_path / "lightning_baoc" / "integrations" / adapter
        text = path.read_text()
        last = "        initial: Union[str, dict[str, str], None] = None,\n"
        assert text.count(last) == 1, f"{adapter}: the signature's last setting moved: update this test's marker"
        path.write_text(text.replace(last, last + NEW_PARAMETERS))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", CHECKS], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "picked up" in run.stdout, run.stderr[-3000:]
