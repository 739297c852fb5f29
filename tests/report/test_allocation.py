"""The allocation reports (table, JSON, PNG, scalars), rank zero only."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from lightning_baoc import BAOC
from lightning_baoc.control.controller import AllocationEvent
from lightning_baoc.report.allocation import (
    ALLOCATION_SCHEMA,
    CORRECTION_HATCHES,
    FORMAT_COLORS,
    JSON_NAME,
    PNG_NAME,
    RENAMED_STATS,
    SCALAR_NAMES,
    allocation_line,
    allocation_table,
    block_stat,
    build_record,
    plot_allocation,
    scalars,
    validate_record,
    write_json,
    write_reports,
)
from lightning_baoc.tools.plan import load_statistics


def _event() -> AllocationEvent:
    stats = {
        "emb": {"stability": 0.12, "anisotropy": 1.8, "snr": 0.001, "noise_fraction": 0.999, "samples": 8.0},
        "attn": {"stability": math.nan, "anisotropy": 0.9, "snr": 0.02, "noise_fraction": 0.98, "samples": 1.0},
        "head": {"stability": -0.05, "anisotropy": 1.1, "snr": 0.03, "noise_fraction": 0.97, "samples": 8.0},
    }
    risk = {
        b: {"fp32": 0.0, "bf16": 0.01 * (i + 1), "int8": 0.02 * (i + 1), "factored": 0.1}
        for i, b in enumerate(stats)
    }
    return AllocationEvent(
        step=200,
        reason="warmup",
        formats={"emb": "bf16", "attn": "int8", "head": "fp32"},
        changed={"emb": ("fp32", "bf16"), "attn": ("fp32", "int8")},
        migrated={"emb.weight": ("fp32", "bf16"), "attn.weight": ("fp32", "int8")},
        kept=False,
        risk=risk,
        total_risk=0.01 + 0.04,
        solver_risk=0.05,
        statistics=stats,
        block_params={"emb": ["emb.weight"], "attn": ["attn.weight", "attn.bias"], "head": ["head.weight"]},
        block_numel={"emb": 65536, "attn": 16448, "head": 2560},
        block_bytes={"emb": 262144, "attn": 34952, "head": 20480},
        state_bytes_before=8 * (65536 + 16448 + 2560),
        state_bytes=262144 + 34952 + 20480,
        fp32_state_bytes=8 * (65536 + 16448 + 2560),
        memory_budget_bytes=int(0.5 * 8 * (65536 + 16448 + 2560)),
    )


def test_record_follows_the_schema_and_is_strict_json(tmp_path: Path) -> None:
    record = build_record(_event(), history=[{"step": 200, "reason": "warmup"}])
    validate_record(record)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(record, ALLOCATION_SCHEMA)
    assert {"step", "memory_budget_bytes", "state_bytes", "fp32_state_bytes", "blocks"} <= set(record)
    block = record["blocks"][1]
    assert block == {
        "name": "attn",
        "params": 16448,
        "param_names": ["attn.weight", "attn.bias"],
        "format": "int8",
        "state_format": "int8",
        "correction": "none",
        "state_bytes": 34952,
        "risk": {"fp32": 0.0, "bf16": 0.02, "int8": 0.04, "factored": 0.1},
        "format_risk": 0.04,
        "changed": True,
        "stats": {"stability": None, "anisotropy": 0.9, "snr": 0.02, "noise_fraction": 0.98, "samples": 1.0},
    }
    path = write_json(record, tmp_path)
    assert path.name == JSON_NAME
    assert json.loads(path.read_text()) == record  # NaN written as null: strict JSON


@pytest.mark.parametrize(
    "mutate, problem",
    [
        (lambda r: r.pop("fp32_state_bytes"), "misses 'fp32_state_bytes'"),
        (lambda r: r.update(step="200"), "$.step should be integer"),
        (lambda r: r["blocks"][0].pop("format"), "misses 'format'"),
        (lambda r: r["blocks"][0]["stats"].update(snr=float("nan")), "not finite"),
        (lambda r: r["blocks"][0]["stats"].pop("snr"), "stats misses 'snr'"),
        (lambda r: r["blocks"][0]["risk"].update(int8=-1.0), "below 0"),
        (lambda r: r["blocks"][0].update(params=True), "should be integer"),
    ],
)
def test_validation_names_the_problem(mutate: Any, problem: str) -> None:
    record = build_record(_event())
    mutate(record)
    with pytest.raises(ValueError, match=problem.replace("$", r"\$").replace("(", r"\(")):
        validate_record(record)


def test_table_lists_every_block_with_totals() -> None:
    record = build_record(_event())
    console = Console(record=True, width=160)
    console.print(allocation_table(record))
    text = console.export_text()
    for column in ("block", "parameters", "stability", "anisotropy", "SNR", "risk", "format", "bytes"):
        assert column in text
    for name, fmt in (("emb", "bf16"), ("attn", "int8"), ("head", "fp32")):
        assert any(name in line and fmt in line for line in text.splitlines())
    assert "84,544" in text  # parameters in total
    assert "660 KiB -> 310 KiB" in text and "saved 53.0%" in text


def test_png_and_scalars(tmp_path: Path) -> None:
    record = build_record(_event())
    png = plot_allocation(record, tmp_path / PNG_NAME)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    values = scalars(record)
    assert set(values) == set(SCALAR_NAMES) - {"baoc/measured_peak_growth_bytes"}  # not measured here
    assert values["baoc/state_bytes"] == 317576 and values["baoc/saved_fraction"] == pytest.approx(0.5304, abs=1e-4)
    assert values["baoc/baseline_state_bytes"] == 676352 and values["baoc/state_fraction"] == pytest.approx(0.4695, abs=1e-4)
    assert values["baoc/memory_budget_bytes"] == 338176 and values["baoc/correction_bytes"] == 0
    assert values["baoc/total_risk"] == pytest.approx(0.05)
    assert values["baoc/peak_state_bytes"] == record["peak_state_bytes"] >= record["state_bytes"]


def test_png_colours_an_option_by_its_format_and_hatches_its_correction(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    record = build_record(_event())
    for block, option in zip(record["blocks"], ("int8+ecc8", "none", "bf16+ecc16")):
        block["format"] = option
    drawn = []
    real = plt.Figure.savefig

    def keep(fig, *args, **kwargs):  # type: ignore[no-untyped-def]
        drawn.append(fig)
        return real(fig, *args, **kwargs)

    plt.Figure.savefig = keep  # type: ignore[method-assign]
    try:
        plot_allocation(record, tmp_path / PNG_NAME)
    finally:
        plt.Figure.savefig = real  # type: ignore[method-assign]
    bars = [p for p in drawn[0].axes[0].patches]
    assert [b.get_hatch() or "" for b in bars] == [CORRECTION_HATCHES["ecc8"], "", CORRECTION_HATCHES["ecc16"]]
    from matplotlib.colors import to_hex

    assert [to_hex(b.get_facecolor()) for b in bars] == [FORMAT_COLORS["int8"], FORMAT_COLORS["none"], FORMAT_COLORS["bf16"]]
    legend = {t.get_text() for t in drawn[0].legends[0].get_texts()}
    assert legend == {"int8+ecc8", "none", "bf16+ecc16"}


def test_the_planner_replans_from_the_json(tmp_path: Path) -> None:
    path = write_json(build_record(_event()), tmp_path)
    risk, missing = load_statistics(path, ["emb", "attn", "head"])
    assert missing == [] and risk["attn"]["int8"] == 0.04


def _older(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as earlier versions wrote it: the SNR under its former name, ``noise``."""
    old = json.loads(json.dumps(record))
    for block in old["blocks"]:
        block["stats"]["noise"] = block["stats"].pop("snr")
    return old


def _table_text(record: dict[str, Any]) -> str:
    console = Console(record=True, width=160)
    console.print(allocation_table(record))
    return console.export_text()


def test_a_record_of_an_earlier_version_with_noise_still_loads_with_the_same_values(tmp_path: Path) -> None:
    assert RENAMED_STATS == {"noise": "snr"}
    record = build_record(_event())
    old = _older(record)
    assert all("snr" not in b["stats"] and "noise" in b["stats"] for b in old["blocks"])
    validate_record(old)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(old, ALLOCATION_SCHEMA)
    snr = [block_stat(b["stats"], "snr") for b in record["blocks"]]
    assert snr == [0.001, 0.02, 0.03] and [block_stat(b["stats"], "snr") for b in old["blocks"]] == snr
    assert _table_text(old) == _table_text(record) and "0.0200" in _table_text(old)
    assert plot_allocation(old, tmp_path / PNG_NAME).stat().st_size > 5000
    (tmp_path / "old").mkdir()
    old_path = tmp_path / "old" / JSON_NAME
    old_path.write_text(json.dumps(old))  # as an earlier version left it
    new_path = write_json(record, tmp_path / "new")
    names = ["emb", "attn", "head"]
    assert load_statistics(old_path, names) == load_statistics(new_path, names)


class _Logger:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((metrics, step))


@pytest.mark.parametrize("rank", [0, 1])
def test_callback_reports_on_rank_zero_only(rank: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    baoc = BAOC(memory_budget=0.5)
    logger = _Logger()
    asked: list[bool] = []

    def log_dir() -> str:
        asked.append(True)  # every rank must ask: trainer.log_dir is a collective under DDP
        return str(tmp_path)

    class Trainer(SimpleNamespace):
        log_dir = property(lambda self: log_dir())

    trainer = Trainer(is_global_zero=rank == 0, loggers=[logger], global_step=200)
    baoc._report(trainer, _event())  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert asked == [True]
    assert baoc.last_record is not None and baoc.last_record["step"] == 200
    if rank == 0:
        assert "BAOC allocation at step 200" in out
        assert (tmp_path / JSON_NAME).exists() and (tmp_path / PNG_NAME).exists()
        assert logger.logged == [(scalars(baoc.last_record), 200)]
    else:
        assert out == "" and not (tmp_path / JSON_NAME).exists() and logger.logged == []


def test_write_reports_without_a_directory_prints_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert write_reports(build_record(_event()), None) == {}
    assert "BAOC allocation" in capsys.readouterr().out
    paths = write_reports(build_record(_event()), tmp_path / "logs", table=False)
    assert sorted(p.name for p in paths.values()) == [JSON_NAME, PNG_NAME]


def test_the_record_and_the_line_name_the_corrections_beside_the_states(tmp_path: Path) -> None:
    """Corrections in the budget (``BAOC(corrections=...)``): the line gives their bytes, per parameter and with the
    state against the budget; the record holds them under the summary's names; corrections the optimizer holds of
    its own are said to be outside the budget. Without corrections the line is as it was."""
    from dataclasses import replace

    event = _event()
    numel = sum(event.block_numel.values())  # 84,544
    paired = replace(event, formats={"emb": "bf16+ecc8", "attn": "int8+none", "head": "fp32+none"},
                     correction_bytes=65536, corrections_in_budget=True)
    record = build_record(paired, measured_peak_growth_bytes=2**20)
    validate_record(record)
    assert (record["correction_bytes"], record["corrections_in_budget"], record["measured_peak_growth_bytes"]) == (65536, True, 2**20)
    assert [(b["state_format"], b["correction"]) for b in record["blocks"]] == [("bf16", "ecc8"), ("int8", "none"), ("fp32", "none")]
    assert record["state_fraction"] == pytest.approx(317576 / 676352)
    assert scalars(record)["baoc/correction_bytes"] == 65536 and scalars(record)["baoc/measured_peak_growth_bytes"] == 2**20
    assert allocation_line(paired) == (
        "BAOC: warmup allocation at step 200: 2 block(s) converted; optimizer state 676,352 -> 317,576 bytes (53.0% of "
        "AdamW's state saved; peak so far 0); weight corrections 65,536 bytes (0.78 B/param), with the state 383,112 of "
        "the 338,176-byte budget; total risk 0.05"
    )
    assert f"{65536 / numel:.2f}" == "0.78"
    own = replace(event, correction_bytes=84544, corrections={"emb": "ecc8", "attn": "ecc8", "head": "ecc8"})
    assert "; weight corrections 84,544 bytes (1.00 B/param), outside the budget (the optimizer's own weight_correction);" in allocation_line(own)
    assert [b["correction"] for b in build_record(own)["blocks"]] == ["ecc8", "ecc8", "ecc8"]
    assert "weight corrections" not in allocation_line(replace(event, correction_bytes=0))
    console = Console(record=True, width=200)
    console.print(allocation_table(record))
    assert "weight corrections 64 KiB (in the budget)" in console.export_text()


def test_a_record_of_an_earlier_version_gives_the_scalars_it_can() -> None:
    """Records written before the summary's names: no baseline (the fp32 state), no corrections, no measured peak."""
    old = {"step": 3, "memory_budget_bytes": 400, "state_bytes": 300, "fp32_state_bytes": 1000, "total_risk": 0.5, "blocks": []}
    validate_record(old)
    assert scalars(old) == {
        "baoc/state_bytes": 300.0, "baoc/baseline_state_bytes": 1000.0, "baoc/state_fraction": 0.3,
        "baoc/saved_fraction": 0.7, "baoc/correction_bytes": 0.0, "baoc/memory_budget_bytes": 400.0,
        "baoc/peak_state_bytes": 300.0, "baoc/total_risk": 0.5,
    }
