"""Configs (``lightning_baoc.config.files``): the templates in ``configs/``, strict loading with dotlist
overrides, the generated JSON Schema, ``BAOC.from_config``, and the per-block risk cap
(``risk_thresholds.max_block_risk``) in the controller."""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import yaml
from omegaconf import OmegaConf
from torch import nn

from lightning_baoc import BAOC, FORMATS
from lightning_baoc.config.files import (
    BAOC_ARGUMENTS,
    BAOCSection,
    Config,
    ConfigError,
    baoc_kwargs,
    json_schema,
    load_config,
    parse_config,
    parse_section,
    schema_text,
)
from lightning_baoc.control.controller import BAOCConfig, BAOCController

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TEMPLATES = sorted(CONFIGS.glob("*.yaml"))
SCHEMA_FILE = CONFIGS / "baoc.schema.json"


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json_schema())


def _edited(tmp_path: Path, template: Path, edit: Any) -> Path:
    """A copy of ``template`` with ``edit(data)`` applied (YAML, interpolations kept as text)."""
    data = yaml.safe_load(template.read_text())
    edit(data)
    out = tmp_path / template.name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


# ---------------------------------------------------------------------------- templates and schema


def test_the_three_templates_exist() -> None:
    assert {p.stem for p in TEMPLATES} == {"vision", "language", "diffusion"}


def test_committed_schema_is_the_generated_one() -> None:
    # Regenerate with: python -m lightning_baoc schema > configs/baoc.schema.json
    assert SCHEMA_FILE.read_text() == schema_text()


def test_schema_is_a_valid_json_schema_generated_from_the_dataclasses() -> None:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    baoc = schema["properties"]["baoc"]
    # every dataclass field is in the schema, with its description; nothing hand-written
    assert set(baoc["properties"]) == {f for f in BAOCSection.__dataclass_fields__}
    assert set(schema["properties"]) == set(Config.__dataclass_fields__)
    assert all(p.get("description") for p in baoc["properties"].values())
    assert baoc["required"] == ["memory_budget"] and baoc["additionalProperties"] is False
    items = baoc["properties"]["allowed_configs"]["anyOf"][0]["items"]["enum"]
    assert items == [*FORMATS, "none"]  # AdamW's formats, then SGD's and Lion's own (none; the rest are shared)
    assert baoc["properties"]["sampler"]["properties"]["sample_every"]["minimum"] == 1


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.stem)
def test_schema_validates_every_template(template: Path) -> None:
    raw = yaml.safe_load(template.read_text())  # as an editor sees the file
    _validator().validate(raw)
    resolved = OmegaConf.to_container(OmegaConf.load(template), resolve=True)
    _validator().validate(resolved)


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.stem)
def test_every_template_loads_and_builds_a_callback(template: Path) -> None:
    cfg = load_config(template)
    assert isinstance(cfg, Config) and cfg.model is not None and cfg.data is not None
    assert cfg.trainer["max_steps"] == cfg.model.init_args["max_steps"]  # ${trainer.max_steps} resolved
    baoc = BAOC.from_config(template)
    assert baoc.config.memory_budget == cfg.baoc.memory_budget
    assert baoc.config.formats == cfg.baoc.allowed_configs and "offload" not in baoc.config.formats
    assert baoc.config.blocks == cfg.baoc.block_id.patterns
    assert baoc.config.monitor == cfg.baoc.re_evaluation_trigger.monitor


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda d: d["baoc"].update(memroy_budget=0.3), "baoc.memroy_budget"),
        (lambda d: d["baoc"]["sampler"].update(every=3), "baoc.sampler.every"),
        (lambda d: d["baoc"]["risk_thresholds"].update(max_risk=0.1), "baoc.risk_thresholds.max_risk"),
        (lambda d: d.update(optimizer={"lr": 1}), "optimizer"),
        (lambda d: d["trainer"].update(max_step=10), "trainer.max_step"),
        (lambda d: d["model"].update(args={}), "model.args"),
    ],
    ids=["baoc", "sampler", "risk_thresholds", "top-level", "trainer", "model"],
)
def test_an_unknown_key_in_a_template_is_an_error_naming_the_key(tmp_path: Path, edit: Any, key: str) -> None:
    path = _edited(tmp_path, CONFIGS / "vision.yaml", edit)
    with pytest.raises(ConfigError, match="unknown key") as info:
        load_config(path)
    assert info.value.key == key and key in str(info.value) and str(path) in str(info.value)
    if not key.startswith("trainer."):  # the schema leaves trainer's keys to Trainer's signature
        assert not _validator().is_valid(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize(
    "edit, key, words",
    [
        (lambda d: d["baoc"].update(memory_budget=1.5), "baoc.memory_budget", "<= 1.0"),
        (lambda d: d["baoc"].update(memory_budget=-1), "baoc.memory_budget", "> 0"),
        (lambda d: d["baoc"].update(memory_budget="3 parsecs"), "baoc.memory_budget", "Unknown unit"),
        (lambda d: d["baoc"].update(time_budget=0.5), "baoc.time_budget", ">= 1.0"),
        (lambda d: d["baoc"].update(allowed_configs=["fp32", "int4"]), "baoc.allowed_configs", "int4"),
        (lambda d: d["baoc"].update(allowed_configs="int8"), "baoc.allowed_configs", "a list"),
        (lambda d: d["baoc"]["sampler"].update(sample_every=0), "baoc.sampler.sample_every", ">= 1"),
        (lambda d: d["baoc"].update(warmup_steps="long"), "baoc.warmup_steps", "an int"),
        (lambda d: d["baoc"]["block_id"].update(granularity="row"), "baoc.block_id.granularity", "allowed"),
        (lambda d: d["baoc"]["re_evaluation_trigger"].update(mode="up"), "baoc.re_evaluation_trigger.mode", "allowed"),
        (lambda d: d["baoc"]["risk_thresholds"].update(hysteresis=-0.1), "baoc.risk_thresholds.hysteresis", ">= 0"),
        (lambda d: d["baoc"]["risk_thresholds"].update(max_block_risk=-1), "baoc.risk_thresholds.max_block_risk", ">= 0"),
        (lambda d: d["baoc"].update(report="yes"), "baoc.report", "a boolean"),
        (lambda d: d["baoc"].pop("memory_budget"), "baoc.memory_budget", "missing"),
    ],
)
def test_a_bad_value_in_a_template_is_an_error_naming_the_key(tmp_path: Path, edit: Any, key: str, words: str) -> None:
    path = _edited(tmp_path, CONFIGS / "language.yaml", edit)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert info.value.key == key and key in message and str(path) in message and words in message, message
    if words not in ("Unknown unit",):  # budget strings are checked by the loader, not the schema
        assert not _validator().is_valid(yaml.safe_load(path.read_text()))


def test_cross_field_rules_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"baoc\.warmup_steps: Invalid warmup_steps=5 for sample_every=10") as info:
        parse_config({"baoc": {"memory_budget": 0.3, "warmup_steps": 5}})
    assert info.value.key == "baoc.warmup_steps"


def test_an_int_budget_stays_bytes_and_a_float_a_fraction() -> None:
    assert parse_section({"memory_budget": 1_000_000}).memory_budget == 1_000_000
    assert isinstance(parse_section({"memory_budget": 1_000_000}).memory_budget, int)
    assert parse_section({"memory_budget": 0.25}).memory_budget == 0.25
    assert parse_section({"memory_budget": "6GB"}).memory_budget == "6GB"


# ---------------------------------------------------------------------------- overrides


def test_a_dotlist_override_changes_the_budget() -> None:
    base = load_config(CONFIGS / "vision.yaml")
    cfg = load_config(CONFIGS / "vision.yaml", ["baoc.memory_budget=0.25", "baoc.sampler.sample_every=5"])
    assert base.baoc.memory_budget == 0.35 and cfg.baoc.memory_budget == 0.25
    assert cfg.baoc.sampler.sample_every == 5
    assert BAOC.from_config(CONFIGS / "vision.yaml", ["baoc.memory_budget=0.25"]).config.memory_budget == 0.25
    listed = load_config(CONFIGS / "vision.yaml", ["baoc.allowed_configs=[fp32,int8]", "baoc.memory_budget=6MB"])
    assert listed.baoc.allowed_configs == ["fp32", "int8"] and listed.baoc.memory_budget == "6MB"
    # interpolations resolve after the overrides
    assert load_config(CONFIGS / "vision.yaml", ["trainer.max_steps=50"]).model.init_args["max_steps"] == 50


@pytest.mark.parametrize(
    "override, key",
    [("baoc.memroy_budget=0.25", "baoc.memroy_budget"), ("baoc.memory_budget=2.5", "baoc.memory_budget")],
)
def test_a_bad_override_is_an_error_naming_the_override(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "vision.yaml", [override])
    assert info.value.key == key and f"override {override!r}" in str(info.value)


def test_a_malformed_override_and_a_missing_file_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected 'key=value'"):
        load_config(CONFIGS / "vision.yaml", ["baoc.memory_budget"])
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(TypeError, match="list of 'key=value'"):
        load_config(CONFIGS / "vision.yaml", "baoc.memory_budget=0.2")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- BAOC arguments


def test_every_baoc_argument_comes_from_the_config_with_the_same_default() -> None:
    params = {k: p for k, p in inspect.signature(BAOC.__init__).parameters.items() if k != "self"}
    assert set(BAOC_ARGUMENTS) == set(params)
    kwargs = baoc_kwargs({"memory_budget": 0.3})
    for name, p in params.items():
        if p.default is not inspect.Parameter.empty:
            assert kwargs[name] == p.default, name
    # the config settings are BAOCConfig's too (report is the callback's own)
    assert set(BAOC_ARGUMENTS) - {"report"} == set(BAOCConfig.__dataclass_fields__)


def test_from_config_takes_a_section_a_mapping_or_a_dictconfig() -> None:
    section = {"memory_budget": "30%", "warmup_steps": 40, "risk_thresholds": {"max_block_risk": 0.05}}
    for source in (section, {"baoc": section}, OmegaConf.create({"baoc": section}), parse_section(section)):
        baoc = BAOC.from_config(source)
        assert baoc.config.memory_budget == "30%" and baoc.config.max_block_risk == 0.05
    with pytest.raises(ConfigError, match="baoc.sampler"):
        BAOC.from_config({"memory_budget": 0.3, "sampler": {"capacity": 1}})
    with pytest.raises(TypeError, match="applies to a config file"):
        BAOC.from_config(section, ["baoc.memory_budget=0.2"])


# ---------------------------------------------------------------------------- max_block_risk


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


class _Risk:
    """int8 is the cheapest risk on every block, but far over any cap on block '2'."""

    def __call__(self, optimizer: Any, blocks: Any, statistics: Any, formats: Any = None, horizon: int = 200) -> Any:
        table = {}
        for b in blocks:
            row = {f: 0.0 if f == "fp32" else 0.01 for f in formats}
            row["int8"] = 0.5 if b == "2" else 0.001
            table[b] = row
        return {b: {f: table[b][f] for f in formats} for b in blocks}


def _allocate(**settings: Any) -> BAOCController:
    model = _model()
    ctl = BAOCController(
        BAOCConfig(warmup_steps=6, sample_every=2, formats=["fp32", "bf16", "int8"], min_8bit_numel=0, **settings),
        risk_fn=_Risk(),
    )
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    for step in range(6):
        opt.zero_grad()
        model(torch.randn(16, 64)).square().mean().backward()
        ctl.observe(step)
        opt.step()
        ctl.maybe_allocate(step + 1)
    assert ctl.phase == "allocated"
    ctl.close()
    return ctl


def test_max_block_risk_keeps_a_format_over_the_cap_off_that_block() -> None:
    # Budget 0.3 of fp32: int8 (~0.27) everywhere is the least total risk without a cap...
    free = _allocate(memory_budget=0.3)
    assert free.allocation == {"0": "int8", "2": "int8", "4": "int8"}
    # ...with a cap of 0.1, block '2' may not take int8 (risk 0.5) and gets bf16 instead,
    # which a budget of 0.5 allows.
    capped = _allocate(memory_budget=0.5, max_block_risk=0.1)
    assert capped.allocation["2"] != "int8" and capped.allocation["0"] == "int8"
    assert capped.optimizer.state_bytes() <= 0.5 * capped.fp32_state_bytes


def test_max_block_risk_is_lifted_with_a_warning_when_the_budget_needs_it() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctl = _allocate(memory_budget=0.3, max_block_risk=0.1)
    messages = [str(w.message) for w in caught if "max_block_risk" in str(w.message)]
    assert messages and "cap is lifted" in messages[0] and "under the cap it needs" in messages[0]
    assert ctl.allocation["2"] == "int8"  # the budget holds: memory is the hard limit
    assert ctl.optimizer.state_bytes() <= 0.3 * ctl.fp32_state_bytes


def test_schema_file_is_json() -> None:
    assert json.loads(SCHEMA_FILE.read_text())["title"] == "lightning_baoc config"


# ---------------------------------------------------------------------------- the Hydra example


def _hydra_example() -> Any:
    import importlib
    import sys

    try:
        return importlib.import_module("hydra_baoc")
    finally:
        sys.path.remove(str(ROOT / "examples"))


def test_hydra_example_says_how_to_get_hydra_when_it_is_missing(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    example = _hydra_example()
    monkeypatch.setattr(example, "hydra", None)
    with pytest.raises(SystemExit) as info:
        example.main()
    assert info.value.code == 2 and "pip install hydra-core" in capsys.readouterr().err


def test_hydra_example_trains_from_a_composed_template(tmp_path: Path) -> None:
    pytest.importorskip("hydra", reason="hydra-core is an optional dependency (the examples extra)")
    from hydra import compose, initialize_config_dir

    example = _hydra_example()
    overrides = [
        "baoc.memory_budget=0.3", "baoc.warmup_steps=8", "baoc.sampler.sample_every=3", "baoc.report=false",
        "trainer.max_steps=12", "trainer.val_check_interval=6", "data.init_args.batch_size=32",
        f"trainer.default_root_dir={tmp_path}", "+trainer.enable_progress_bar=false",
    ]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose(config_name="vision", overrides=overrides)
    metrics = example.train(cfg)
    assert "val_acc" in metrics
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        bad = compose(config_name="vision", overrides=["baoc.sampler.sample_every=0"])
    with pytest.raises(ConfigError, match="baoc.sampler.sample_every"):
        example.train(bad)


@pytest.mark.parametrize("value", [True, False, "json", "png"])
def test_report_setting_reaches_the_callback_from_a_config(value: object) -> None:
    from lightning_baoc import BAOC

    if value == "png":
        pytest.importorskip("matplotlib")
    config = parse_config({"baoc": {"memory_budget": 0.3, "report": value}})
    baoc = BAOC.from_config(config)
    assert baoc.report is (value is not False)
    assert baoc.report_png is (value in (True, "png"))


def test_report_setting_outside_its_values_is_refused_naming_them() -> None:
    with pytest.raises(ConfigError, match=r"baoc\.report: invalid value 'pdf'.*a boolean or one of \['json', 'png'\]"):
        parse_config({"baoc": {"memory_budget": 0.3, "report": "pdf"}})
