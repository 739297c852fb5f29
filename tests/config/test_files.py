"""Configs (``lightning_baoc.config.files``): the templates in ``configs/``, strict loading with dotlist
overrides (every error of a config at once, each with its suggestion), the generated JSON Schema,
``BAOC.from_config``, ``lightning-baoc check`` on a bad config, and the per-block risk cap
(``max_block_risk``) in the controller."""

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
from support import one_thread  # noqa: F401  (one intra-op thread for the module's trainings)
from torch import nn

from lightning_baoc import BAOC, FORMATS
from lightning_baoc.__main__ import main as lightning_baoc_main
from lightning_baoc.config import settings
from lightning_baoc.config.files import (
    RETIRED_KEYS,
    BAOCSection,
    Config,
    ConfigError,
    baoc_kwargs,
    json_schema,
    lightning_cli_errors,
    load_config,
    override_errors,
    parse_config,
    parse_section,
    schema_text,
)
from lightning_baoc.config.settings import SETTING, SETTINGS
from lightning_baoc.control.controller import BAOCConfig, BAOCController

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TEMPLATES = sorted(CONFIGS.glob("*.yaml"))
SCHEMA_FILE = CONFIGS / "baoc.schema.json"


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
    assert list(baoc["properties"]) == [s.name for s in SETTINGS]  # flat: the keys are the arguments, in order
    items = baoc["properties"]["formats"]["anyOf"][0]["items"]["enum"]
    assert items == [*FORMATS, "none"]  # AdamW's formats, then SGD's and Lion's own (none; the rest are shared)
    assert baoc["properties"]["sample_every"]["minimum"] == 1


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
    assert baoc.config.formats == cfg.baoc.formats and "offload" not in baoc.config.formats
    assert baoc.config.blocks == cfg.baoc.blocks and baoc.config.monitor == cfg.baoc.monitor
    assert baoc_kwargs(cfg) == {s.name: getattr(cfg.baoc, s.name) for s in SETTINGS}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.stem)
def test_every_template_value_has_a_comment(template: Path) -> None:
    lines = template.read_text().splitlines()
    section = lines[lines.index("baoc:") + 1 : lines.index("", lines.index("baoc:"))]
    for i, line in enumerate(section):
        if line.startswith("  ") and not line.startswith("   ") and not line.lstrip().startswith("#"):
            assert section[i - 1].lstrip().startswith("#"), f"{template.name}: {line!r} has no comment"


@pytest.mark.parametrize(
    "edit, key, says",
    [
        (lambda d: d["baoc"].update(memroy_budget=0.3), "baoc.memroy_budget", " (did you mean baoc.memory_budget?)"),
        (lambda d: d["baoc"].update(sampler={"every": 3}), "baoc.sampler.every", " (did you mean baoc.sample_every?)"),
        (lambda d: d["baoc"].update(sampler={"sample_every": 3}), "baoc.sampler.sample_every",
         "; the key is now baoc.sample_every"),
        (lambda d: d.update(optimizer={"lr": 1}), "optimizer", "; the keys at the top level: ['baoc', "),
        (lambda d: d["trainer"].update(max_step=10), "trainer.max_step", " (did you mean trainer.max_steps?)"),
        (lambda d: d["model"].update(args={}), "model.args", " (did you mean model.init_args?)"),
    ],
    ids=["baoc", "old-section-typo", "old-key", "top-level", "trainer", "model"],
)
def test_an_unknown_key_in_a_template_is_an_error_naming_the_key(tmp_path: Path, edit: Any, key: str, says: str) -> None:
    path = _edited(tmp_path, CONFIGS / "vision.yaml", edit)
    with pytest.raises(ConfigError, match="unknown key") as info:
        load_config(path)
    assert info.value.key == key and str(info.value).startswith(f"{path}: {key}: unknown key{says}"), info.value
    if not key.startswith("trainer."):  # the schema leaves trainer's keys to Trainer's signature
        assert not _validator().is_valid(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize(
    "edit, key, words",
    [
        (lambda d: d["baoc"].update(memory_budget=1.5), "baoc.memory_budget", "<= 1.0"),
        (lambda d: d["baoc"].update(memory_budget=-1), "baoc.memory_budget", "> 0"),
        (lambda d: d["baoc"].update(memory_budget="3 parsecs"), "baoc.memory_budget", "Unknown unit"),
        (lambda d: d["baoc"].update(time_budget=0.5), "baoc.time_budget", ">= 1.0"),
        (lambda d: d["baoc"].update(formats=["fp32", "int4"]), "baoc.formats", "int4"),
        (lambda d: d["baoc"].update(formats="int8"), "baoc.formats", "a list"),
        (lambda d: d["baoc"].update(sample_every=0), "baoc.sample_every", ">= 1"),
        (lambda d: d["baoc"].update(warmup_steps="long"), "baoc.warmup_steps", "an int"),
        (lambda d: d["baoc"].update(granularity="row"), "baoc.granularity", "allowed"),
        (lambda d: d["baoc"].update(mode="up"), "baoc.mode", "allowed"),
        (lambda d: d["baoc"].update(hysteresis=-0.1), "baoc.hysteresis", ">= 0"),
        (lambda d: d["baoc"].update(max_block_risk=-1), "baoc.max_block_risk", ">= 0"),
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


# ---------------------------------------------------------------------------- every error at once


def _many_typos(d: dict) -> None:
    d["baoc"]["sampel_every"] = d["baoc"].pop("sample_every")  # a typo in baoc
    d["baoc"]["sampler"] = {"capacity": 16}  # 0.1.0's nested key
    d["baoc"]["formats"] = ["fp32", "int4"]  # a bad value
    d["trainer"]["max_step"] = 100  # a typo in trainer
    d["model"]["init_arg"] = d["model"].pop("init_args")  # a typo in model


def test_every_error_of_a_file_is_reported_at_once_each_with_its_suggestion(tmp_path: Path) -> None:
    path = _edited(tmp_path, CONFIGS / "vision.yaml", _many_typos)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert isinstance(err, ValueError)
    assert str(err) == "\n".join([
        f"5 errors in {path}:",
        f"  {path}: baoc.formats: invalid value ['fp32', 'int4']; unknown 'int4' (did you mean 'int8'?); "
        f"{settings.FORMATS_ALLOWED}",
        f"  {path}: baoc.sampel_every: unknown key (did you mean baoc.sample_every?); rename sampel_every to sample_every",
        f"  {path}: baoc.sampler.capacity: unknown key; the key is now baoc.capacity",
        f"  {path}: trainer.max_step: unknown key (did you mean trainer.max_steps?): not an argument of lightning.Trainer; "
        "rename max_step to max_steps",
        f"  {path}: model.init_arg: unknown key (did you mean model.init_args?); rename init_arg to init_args",
    ])
    assert [e.key for e in err.errors] == [  # in the file's order
        "baoc.formats", "baoc.sampel_every", "baoc.sampler.capacity", "trainer.max_step", "model.init_arg"]
    assert [e.suggestion for e in err.errors] == [
        "", "baoc.sample_every", "baoc.capacity", "trainer.max_steps", "model.init_args"]
    assert [e.fix for e in err.errors] == [  # a key moved out of its section has no rename: the message says where
        "", "rename sampel_every to sample_every", "", "rename max_step to max_steps", "rename init_arg to init_args"]
    assert {e.source for e in err.errors} == {str(path)} and err.errors[0].setting == "formats"
    assert (err.key, err.source) == (err.errors[0].key, err.errors[0].source)  # the first error's


def test_every_error_of_the_overrides_is_reported_naming_its_override() -> None:
    overrides = ["baoc.sampel_every=5", "baoc.sampler.sample_every=5", "baoc.memory_budget=2.5", "trainer.max_step=3"]
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "vision.yaml", overrides)
    assert str(info.value) == "\n".join([
        f"4 errors in {CONFIGS / 'vision.yaml'}:",
        "  override 'baoc.memory_budget=2.5': baoc.memory_budget: invalid value 2.5; a fraction must be <= 1.0 "
        "(an absolute size is an int of bytes or a string with a unit, e.g. '6GB')",
        "  override 'baoc.sampel_every=5': baoc.sampel_every: unknown key (did you mean baoc.sample_every?); "
        "write baoc.sample_every=5",
        "  override 'baoc.sampler.sample_every=5': baoc.sampler.sample_every: unknown key; the key is now "
        "baoc.sample_every; write baoc.sample_every=5",
        "  override 'trainer.max_step=3': trainer.max_step: unknown key (did you mean trainer.max_steps?): not an "
        "argument of lightning.Trainer; write trainer.max_steps=3",
    ])
    assert [e.source for e in info.value.errors] == [f"override {o!r}" for o in [overrides[2], *overrides[:2], overrides[3]]]


@pytest.mark.parametrize("old", list(RETIRED_KEYS))
def test_a_key_of_the_old_nested_section_names_the_key_that_replaced_it(old: str) -> None:
    new = RETIRED_KEYS[old]
    value = SETTING[new].default
    head, _, leaf = old.partition(".")
    with pytest.raises(ConfigError) as info:
        parse_config({"baoc": {"memory_budget": 0.3, head: {leaf: value} if leaf else value}}, source="old.yaml")
    renamed = "" if leaf else f"; rename {old} to {new}"  # a key of an old section moves up: no rename says it
    assert str(info.value) == f"old.yaml: baoc.{old}: unknown key; the key is now baoc.{new}{renamed}"
    assert info.value.suggestion == f"baoc.{new}"
    assert getattr(parse_section({"memory_budget": 0.3, new: value}), new) == value  # the new key holds it


def test_missing_budget_and_rules_between_settings_are_listed_with_the_rest() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"baoc": {"warmup_steps": 5, "granualrity": "layer"}, "seed_everything": "x"})
    assert [e.key for e in info.value.errors] == [
        "baoc.granualrity", "baoc.memory_budget", "baoc.warmup_steps", "seed_everything"]
    assert str(info.value.errors[1]).startswith("<dict>: baoc.memory_budget: missing; expected an int > 0 or a finite number > 0")
    assert str(info.value.errors[2]) == (
        "<dict>: baoc.warmup_steps: Invalid warmup_steps=5 for sample_every=10: the statistics need 2 gradient "
        "samples, taken at steps 0 and 10; use warmup_steps >= 12 or a smaller sample_every"
    )
    # a rule is not applied to a value already refused (sample_every=0 is not "taken at step 0")
    with pytest.raises(ConfigError) as info:
        parse_config({"baoc": {"memory_budget": 0.3, "warmup_steps": 5, "sample_every": 0}})
    assert [e.key for e in info.value.errors] == ["baoc.sample_every"]


def test_lightning_baoc_check_lists_every_error_of_a_config(tmp_path: Path, capsys: Any) -> None:
    def two_typos(d: dict) -> None:
        d["baoc"]["hysterisis"] = d["baoc"].pop("hysteresis")
        d["trainer"]["max_epoch"] = 3

    path = _edited(tmp_path, CONFIGS / "vision.yaml", two_typos)
    with pytest.raises(SystemExit) as info:
        lightning_baoc_main(["check", "--config", str(path), "--model", "tiny", "--device", "cpu"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "\n".join([
        f"lightning-baoc check: error: 2 errors in {path}:",
        f"  {path}: baoc.hysterisis: unknown key (did you mean baoc.hysteresis?); rename hysterisis to hysteresis",
        f"  {path}: trainer.max_epoch: unknown key (did you mean trainer.max_epochs?): not an argument of lightning.Trainer; "
        "rename max_epoch to max_epochs",
        "",
    ])


def test_lightning_cli_errors_checks_each_input_alone() -> None:
    # one input of a merged LightningCLI config: no setting is missing, no rule between settings applies
    assert lightning_cli_errors({"baoc": {"warmup_steps": 5}, "trainer": {"max_steps": 3}}, "a.yaml") == []
    data = {
        "fit": {"baoc": {"sampel_every": 3}},
        "trainer": {"callbacks": [{"class_path": "lightning_baoc.BAOC", "init_args": {"sampler": {"sample_every": 3}}},
                                  {"class_path": "lightning.pytorch.callbacks.EarlyStopping", "init_args": {"x": 1}}]},
    }
    assert [str(e) for e in lightning_cli_errors(data, "b.yaml")] == [
        "b.yaml: trainer.callbacks[0].init_args.sampler.sample_every: unknown key; the key is now "
        "trainer.callbacks[0].init_args.sample_every",
        "b.yaml: fit.baoc.sampel_every: unknown key (did you mean fit.baoc.sample_every?); rename sampel_every to "
        "sample_every",
    ]


def test_lightning_cli_errors_reads_a_callbacks_argument_as_written_for_baoc_only() -> None:
    # --trainer.callbacks.KEY (and .init_args.KEY) set the last callback added: BAOC's settings are checked there,
    # named as written, and the message ends with the argument to write
    def errors(arg: str, node: dict, callback: str) -> list[str]:
        found = lightning_cli_errors({"trainer": {"callbacks": node}}, f"argument {arg!r}", argument=arg, callback=callback)
        return [str(e) for e in found]

    arg = "--trainer.callbacks.init_args.warmup_stepz=100"
    assert errors(arg, {"init_args": {"warmup_stepz": 100}}, "lightning_baoc.BAOC") == [
        f"argument {arg!r}: trainer.callbacks.init_args.warmup_stepz: unknown key (did you mean "
        "trainer.callbacks.init_args.warmup_steps?); write --trainer.callbacks.init_args.warmup_steps=100"]
    arg = "--trainer.callbacks.granularity layers"  # a bad value: the setting's message, no rewrite
    assert errors(arg, {"granularity": "layers"}, "BAOC") == [
        f"argument {arg!r}: trainer.callbacks.granularity: invalid value 'layers'; allowed: ['module', 'layer', 'param'] "
        "(did you mean 'layer'?)"]
    assert errors("--trainer.callbacks.patience=3", {"patience": 3}, "lightning.pytorch.callbacks.EarlyStopping") == []


def test_override_errors_check_keys_before_hydra_composes_each_with_the_override_to_write() -> None:
    template = yaml.safe_load((CONFIGS / "vision.yaml").read_text())
    assert "instrument_share" not in template["baoc"]  # so its override needs Hydra's '+'
    found = override_errors(
        [
            "baoc.memory_budgett=0.25",  # Hydra would advise '+baoc.memory_budgett'
            "+baoc.memory_budgett=0.3",  # Hydra would add the typo
            "+baoc.instrument_sharre=0.1",  # the key meant is not in the template: the '+' stays
            "baoc.instrument_sharre=0.1",  # ... and is added
            "++baoc.sampel_every=5",  # force-add: as written
            "baoc.sampler.sample_every=5",  # 0.1.0's nested key
            "trainer.max_step=3",
            "baco.memory_budget=0.2",  # the section's name
            "baoc.formats=[fp32,int8]", "baoc.memory_budget=0.5,0.35",  # valid keys, a sweep: not checked here
            "baoc.blocks.embeddings=[wte.*]", "model.init_args.depth=2", "hydra.run.dir=out", "hydra/launcher=basic",
        ],
        template,
    )
    assert [(e.key, e.fix) for e in found] == [
        ("baoc.memory_budgett", "write baoc.memory_budget=0.3"),  # the last override of a key is the one named
        ("baoc.instrument_sharre", "write +baoc.instrument_share=0.1"),
        ("baoc.sampel_every", "write ++baoc.sample_every=5"),
        ("baoc.sampler.sample_every", "write baoc.sample_every=5"),
        ("trainer.max_step", "write trainer.max_steps=3"),
        ("baco", "write baoc.memory_budget=0.2"),
    ]
    assert str(found[0]) == (
        "override '+baoc.memory_budgett=0.3': baoc.memory_budgett: unknown key (did you mean baoc.memory_budget?); "
        "write baoc.memory_budget=0.3")
    assert str(found[4]) == (
        "override 'trainer.max_step=3': trainer.max_step: unknown key (did you mean trainer.max_steps?): not an argument "
        "of lightning.Trainer; write trainer.max_steps=3")
    # without the template, the override to write keeps the one's prefix; a value the shell would split is quoted
    assert [e.fix for e in override_errors(["baoc.fromats=[fp32, int8]", "+baoc.memroy_budget=0.2"])] == [
        "write 'baoc.formats=[fp32, int8]'", "write +baoc.memory_budget=0.2"]
    assert override_errors(["baoc.sample_every=5", "+trainer.enable_progress_bar=false", "seed_everything=3"]) == []


def test_parse_config_names_the_override_that_set_a_key() -> None:
    data = {"baoc": {"memory_budget": 0.3, "sample_every": 0, "sampel_every": 3}}
    with pytest.raises(ConfigError) as info:
        parse_config(data, "the Hydra config", overrides=["baoc.sample_every=0", "+baoc.sampel_every=3"])
    assert [str(e) for e in info.value.errors] == [
        "override 'baoc.sample_every=0': baoc.sample_every: invalid value 0; expected an int >= 1",
        "override '+baoc.sampel_every=3': baoc.sampel_every: unknown key (did you mean baoc.sample_every?); "
        "write +baoc.sample_every=3",
    ]


def test_an_int_budget_stays_bytes_and_a_float_a_fraction() -> None:
    assert parse_section({"memory_budget": 1_000_000}).memory_budget == 1_000_000
    assert isinstance(parse_section({"memory_budget": 1_000_000}).memory_budget, int)
    assert parse_section({"memory_budget": 0.25}).memory_budget == 0.25
    assert parse_section({"memory_budget": "6GB"}).memory_budget == "6GB"


# ---------------------------------------------------------------------------- overrides


def test_a_dotlist_override_changes_the_budget() -> None:
    base = load_config(CONFIGS / "vision.yaml")
    cfg = load_config(CONFIGS / "vision.yaml", ["baoc.memory_budget=0.25", "baoc.sample_every=5"])
    assert base.baoc.memory_budget == 0.35 and cfg.baoc.memory_budget == 0.25
    assert cfg.baoc.sample_every == 5
    assert BAOC.from_config(CONFIGS / "vision.yaml", ["baoc.memory_budget=0.25"]).config.memory_budget == 0.25
    listed = load_config(CONFIGS / "vision.yaml", ["baoc.formats=[fp32,int8]", "baoc.memory_budget=6MB"])
    assert listed.baoc.formats == ["fp32", "int8"] and listed.baoc.memory_budget == "6MB"
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
    assert list(BAOCSection.__dataclass_fields__) == list(params)  # the keys are the arguments, in order
    kwargs = baoc_kwargs({"memory_budget": 0.3})
    for name, p in params.items():
        if p.default is not inspect.Parameter.empty:
            assert kwargs[name] == p.default, name
    # the config settings are BAOCConfig's too (report is the callback's own)
    assert set(params) - {"report"} == set(BAOCConfig.__dataclass_fields__)


def test_from_config_takes_a_section_a_mapping_or_a_dictconfig() -> None:
    section = {"memory_budget": "30%", "warmup_steps": 40, "max_block_risk": 0.05}
    for source in (section, {"baoc": section}, OmegaConf.create({"baoc": section}), parse_section(section)):
        baoc = BAOC.from_config(source)
        assert baoc.config.memory_budget == "30%" and baoc.config.max_block_risk == 0.05
    with pytest.raises(ConfigError, match=r"baoc\.capacity: invalid value 1; expected an int >= 2"):
        BAOC.from_config({"memory_budget": 0.3, "capacity": 1})
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
    assert capped.optimizer.state_bytes() <= 0.5 * capped.fp32_state_bytes()


def test_max_block_risk_is_lifted_with_a_warning_when_the_budget_needs_it() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctl = _allocate(memory_budget=0.3, max_block_risk=0.1)
    messages = [str(w.message) for w in caught if "max_block_risk" in str(w.message)]
    assert messages and "cap is lifted" in messages[0] and "under the cap it needs" in messages[0]
    assert ctl.allocation["2"] == "int8"  # the budget holds: memory is the hard limit
    assert ctl.optimizer.state_bytes() <= 0.3 * ctl.fp32_state_bytes()


def test_schema_file_is_json() -> None:
    assert json.loads(SCHEMA_FILE.read_text())["title"] == "lightning_baoc config"


# ---------------------------------------------------------------------------- the Hydra example


def _hydra_example() -> Any:
    import importlib
    import sys

    before = list(sys.path)
    try:
        return importlib.import_module("hydra_baoc")
    finally:  # what its import put on sys.path (once: a second import finds the module cached)
        sys.path[:] = before


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
        "baoc.memory_budget=0.3", "baoc.warmup_steps=8", "baoc.sample_every=3", "baoc.report=false",
        "trainer.max_steps=12", "trainer.val_check_interval=6", "data.init_args.batch_size=32",
        f"trainer.default_root_dir={tmp_path}", "+trainer.enable_progress_bar=false",
    ]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose(config_name="vision", overrides=overrides)
    metrics = example.train(cfg)
    assert "val_acc" in metrics
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        bad = compose(config_name="vision", overrides=["baoc.sample_every=0", "+baoc.sampel_every=3"])
    with pytest.raises(ConfigError) as info:
        example.train(bad)
    assert str(info.value) == (
        "2 errors in the Hydra config:\n"
        "  the Hydra config: baoc.sample_every: invalid value 0; expected an int >= 1\n"
        "  the Hydra config: baoc.sampel_every: unknown key (did you mean baoc.sample_every?); rename sampel_every to "
        "sample_every"
    )


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
