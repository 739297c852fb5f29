"""The controller's options (``lightning_baoc.control.options.Options``), alone: formats, or formats
paired with master-weight corrections, read from and applied to the optimizer, and their risk."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support_control import instrumented
from torch import nn

from lightning_baoc import BlockwiseAdamW
from lightning_baoc.control.options import Options
from lightning_baoc.costs.options import PRIOR_CORRECTION_RISK
from lightning_baoc.formats import format_state_bytes


def _model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(dtype)


def _options(model: nn.Module, **settings: Any) -> tuple[Options, BlockwiseAdamW]:
    opt = BlockwiseAdamW(model.parameters(), lr=1e-3)
    inst = instrumented(model, opt, **settings)
    return Options(inst.config, inst.blocks, inst.tables, inst), opt


def _step(model: nn.Module, opt: BlockwiseAdamW) -> None:
    opt.zero_grad()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to(next(model.parameters()).dtype)
    model(x).float().pow(2).mean().backward()
    opt.step()


def test_without_corrections_an_option_is_a_format() -> None:
    model = _model()
    options, opt = _options(model, formats=["fp32", "bf16", "int8"])
    assert not options.paired and options.formats_offered() == ["fp32", "bf16", "int8"]
    table = {"0": {"fp32": 0.0, "int8": 0.5}}
    extended = options.with_corrections(opt, table, measured=True)
    assert extended == table and extended["0"] is not table["0"]  # a copy
    options.apply(opt, {"0": "int8", "2": "bf16"}, options.blocks.params)
    assert options.current(opt) == {"0": "int8", "2": "bf16"}
    options.apply(opt, {"1": "fp32"})  # one parameter: its block holds two formats now
    assert options.current(opt)["0"] == "mixed"
    _step(model, opt)
    held = opt.formats()
    shapes = options.tables.shapes
    expected = {
        b: sum(format_state_bytes(held[n], s, opt.min_8bit_numel) for n, s in zip(names, shapes[b]))
        for b, names in options.blocks.params.items()
    }
    assert options.held_bytes(opt) == expected


def test_with_corrections_options_pair_formats_with_corrections() -> None:
    model = _model(torch.bfloat16)
    options, opt = _options(model, formats=["bf16", "int8"], corrections=["none", "ecc8"])
    assert options.paired
    assert options.tables.offered == ["bf16", "bf16+ecc8", "int8", "int8+ecc8"]
    assert options.formats_offered() == ["bf16", "int8"]
    options.apply(opt, {"0": "int8+ecc8", "2": "bf16"}, options.blocks.params)
    assert options.current(opt) == {"0": "int8+ecc8", "2": "bf16"}
    named = opt.named_params
    assert [opt.target_correction(named[n]) for n in options.blocks.params["0"]] == ["ecc8", "ecc8"]
    _step(model, opt)
    held = opt.formats()
    corrections = sum(opt.held_correction(n).untyped_storage().nbytes() for n in options.blocks.params["0"])  # type: ignore[union-attr]
    states = sum(format_state_bytes(held[n], s, opt.min_8bit_numel) for n, s in zip(options.blocks.params["0"], options.tables.shapes["0"]))
    assert corrections > 0 and options.held_bytes(opt)["0"] == states + corrections


def test_the_corrections_risk_is_the_prior_or_measured_on_the_shadow() -> None:
    model = _model(torch.bfloat16)
    options, opt = _options(model, formats=["bf16", "int8"], corrections=["none", "ecc8"])
    by_format = {"0": {"bf16": 0.1, "int8": 0.2}}
    prior = options.with_corrections(opt, by_format, measured=False)
    assert set(prior["0"]) == {"bf16", "bf16+ecc8", "int8", "int8+ecc8"}
    # an option's risk: its format's plus its correction's prior (times the share of 16-bit elements: all here)
    assert prior["0"]["int8"] == pytest.approx(0.2 + PRIOR_CORRECTION_RISK["none"])
    assert prior["0"]["int8+ecc8"] == pytest.approx(0.2 + PRIOR_CORRECTION_RISK["ecc8"])
    assert prior["0"]["int8+ecc8"] < prior["0"]["int8"]
    measured = options.with_corrections(opt, by_format, measured=True)
    assert set(measured["0"]) == set(prior["0"]) and measured != prior


def test_shrinking_corrections_are_set_before_the_states_convert_and_growing_ones_after() -> None:
    model = _model(torch.bfloat16)
    options, opt = _options(model, formats=["bf16", "int8"], corrections=["none", "ecc8", "ecc16"])
    options.apply(opt, {"0": "bf16+ecc8", "2": "bf16+ecc8"}, options.blocks.params)
    calls: list[tuple[str, dict[str, str]]] = []
    set_formats, set_corrections = opt.set_formats, opt.set_weight_corrections
    opt.set_formats = lambda formats, **kw: (calls.append(("formats", dict(formats))), set_formats(formats, **kw))[1]  # type: ignore[method-assign]
    opt.set_weight_corrections = lambda c, **kw: (calls.append(("corrections", dict(c))), set_corrections(c, **kw))[1]  # type: ignore[method-assign]
    options.apply(opt, {"0": "int8", "2": "int8+ecc16"}, options.blocks.params)
    assert [kind for kind, _ in calls] == ["corrections", "formats", "corrections"]
    assert calls[0][1] == {"0": "none", "1": "none"} and calls[2][1] == {"2": "ecc16", "3": "ecc16"}
    assert options.current(opt) == {"0": "int8", "2": "int8+ecc16"}
