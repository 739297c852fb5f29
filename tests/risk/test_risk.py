"""The risk model: properties on constructed states, and a reduced validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW
from lightning_baoc.risk import risk_details, risk_table


def _opt_with_state(weights: dict[str, torch.Tensor], m: dict, v: dict, step: int = 1000) -> BlockwiseAdamW:
    module = nn.Module()
    for name, w in weights.items():
        setattr(module, name, nn.Parameter(w.clone()))
    opt = BlockwiseAdamW(module.named_parameters(), min_8bit_numel=0)
    sd = {
        "state": {i: {"step": torch.tensor(float(step)), "exp_avg": m[n], "exp_avg_sq": v[n]} for i, n in enumerate(weights)},
        "param_groups": [{"params": list(range(len(weights)))}],
    }
    opt.load_state_dict(sd)
    return opt


def test_fp32_and_offload_are_free_and_all_scores_nonnegative() -> None:
    torch.manual_seed(0)
    w = {"a": torch.randn(64, 96), "b": torch.randn(96)}
    m = {k: torch.randn_like(t) * 1e-3 for k, t in w.items()}
    v = {k: torch.rand_like(t) * 1e-6 + 1e-7 for k, t in w.items()}
    opt = _opt_with_state(w, m, v)
    risk = risk_table(opt, {"blk": ["a", "b"]})
    assert set(risk["blk"]) == set(FORMATS)
    assert risk["blk"]["fp32"] == 0.0 and risk["blk"]["offload"] == 0.0
    assert all(r >= 0 for r in risk["blk"].values())


def test_factored_risk_follows_rank_of_v() -> None:
    torch.manual_seed(0)
    rows, cols = torch.rand(128) + 0.5, torch.rand(64) + 0.5
    rank1 = torch.outer(rows, cols) * 1e-6
    uneven = rank1 * torch.exp(torch.randn(128, 64) * 2)  # far from rank one
    w = {"low": torch.zeros(128, 64), "high": torch.zeros(128, 64)}
    m = {"low": rank1.sqrt() * 0.5, "high": uneven.sqrt() * 0.5}
    v = {"low": rank1, "high": uneven}
    details = risk_details(_opt_with_state(w, m, v), {"low": ["low"], "high": ["high"]})
    assert details["low"].bias["factored"] < 1e-6
    assert details["high"].bias["factored"] > 100 * max(details["low"].bias["factored"], 1e-9)


def test_dropping_momentum_costs_more_where_gradients_are_noisy_and_less_over_longer_horizons() -> None:
    torch.manual_seed(0)
    v = torch.rand(64, 64) * 1e-6 + 1e-7
    w = {"clean": torch.zeros(64, 64), "noisy": torch.zeros(64, 64)}
    m = {"clean": v.sqrt() * 0.95, "noisy": v.sqrt() * 0.05}  # |m| ~ sqrt(v): little noise
    opt = _opt_with_state(w, m, {"clean": v, "noisy": v})
    short = risk_details(opt, {"clean": ["clean"], "noisy": ["noisy"]}, horizon=10)
    long = risk_details(opt, {"clean": ["clean"], "noisy": ["noisy"]}, horizon=1000)
    assert short["noisy"].variance["nomomentum"] > 10 * short["clean"].variance["nomomentum"]
    assert long["noisy"].variance["nomomentum"] == pytest.approx(short["noisy"].variance["nomomentum"] / 100)
    assert short["noisy"].noise_ratio > 100  # one step's noise dwarfs its signal, as risk.py's docstring warns


def test_8bit_groups_with_wide_range_are_seen() -> None:
    torch.manual_seed(0)
    # within each group of 32, one large entry and many tiny ones: 8 bits cannot hold the tiny
    # ones; their updates (half the signal) are lost, and the risk sees it
    v = torch.full((64, 64), 1e-12)
    v[:, ::32] = 1e-4
    m = v.sqrt() * 0.5
    details = risk_details(_opt_with_state({"w": torch.zeros(64, 64)}, {"w": m}, {"w": v}), {"w": ["w"]})
    bias = details["w"].bias
    assert bias["nomomentum"] == 0.0 and bias["factored"] < 1e-9  # exact / rank-one v
    assert 0.5 < bias["int8"] <= 1.0
    # without momentum a zero-coded v used to turn g into g / eps; it now decodes to the group's
    # precision bound, so the update of those elements shrinks instead of exploding
    assert 0.5 < bias["nomomentum_int8"] <= 1.0


def test_bad_arguments() -> None:
    opt = _opt_with_state({"w": torch.zeros(8, 8)}, {"w": torch.zeros(8, 8)}, {"w": torch.ones(8, 8)})
    with pytest.raises(ValueError, match="Invalid horizon: 0"):
        risk_table(opt, {"w": ["w"]}, horizon=0)
    with pytest.raises(ValueError, match="Unknown format 'fp8'"):
        risk_table(opt, {"w": ["w"]}, formats=["fp8"])


def _8bit_opt(v: dict[str, torch.Tensor], min_8bit_numel: int = 0) -> BlockwiseAdamW:
    module = nn.Module()
    for name, t in v.items():
        setattr(module, name, nn.Parameter(torch.zeros_like(t)))
    opt = BlockwiseAdamW(module.named_parameters(), min_8bit_numel=min_8bit_numel)
    sd = {
        "state": {i: {"step": torch.tensor(1000.0), "exp_avg": t.sqrt() * 0.5, "exp_avg_sq": t} for i, t in enumerate(v.values())},
        "param_groups": [{"params": list(range(len(v)))}],
    }
    opt.load_state_dict(sd)
    return opt


def test_8bit_rounding_enters_at_the_model_wide_level_and_zero_codes_stay_the_blocks_own() -> None:
    torch.manual_seed(0)
    smooth = torch.rand(64, 64) * 1e-6 + 1e-6  # narrow range in every group: fine codes
    rough = torch.exp(torch.randn(64, 64) * 1.5) * 1e-6  # wide range: coarse codes, few zeros
    wide = torch.full((64, 64), 1e-12)
    wide[:, ::32] = 1e-4  # one large entry per group: the tiny ones are coded 0
    v = {"smooth": smooth, "rough": rough, "wide": wide}
    blocks = {k: [k] for k in v}
    details = risk_details(_8bit_opt(v), blocks)

    # one round trip alone: the rough block's rounding error is far above the smooth one's
    alone = {k: risk_details(_8bit_opt({k: t}), {k: [k]})[k].bias["int8"] for k, t in v.items()}
    assert alone["rough"] > 3 * alone["smooth"]
    # pooled: smooth and rough get the same rounding level (their ||u||^2 are all in 8 bits)
    assert details["smooth"].bias["int8"] == pytest.approx(details["rough"].bias["int8"], rel=1e-6)
    # between the two: the level is the ||u||^2-weighted mean over the model's non-zero codes
    assert min(alone["smooth"], alone["rough"]) < details["smooth"].bias["int8"] < 1e-2
    # the zero-coded elements of the wide block stay its own: half its signal is lost
    assert 0.5 < details["wide"].bias["int8"] <= 1.0
    assert details["wide"].bias["nomomentum_int8"] > 0.5
    # scores stay share x bias: int8 ranks the two ordinary blocks by their share of progress
    ratio = {k: details[k].risk["int8"] / details[k].share for k in ("smooth", "rough")}
    assert ratio["smooth"] == pytest.approx(ratio["rough"], rel=1e-6)


def test_8bit_level_skips_tensors_held_in_fp32_for_their_size() -> None:
    torch.manual_seed(0)
    big, small = torch.rand(64, 64) * 1e-6 + 1e-7, torch.rand(16) * 1e-6 + 1e-7
    details = risk_details(_8bit_opt({"big": big, "small": small}, min_8bit_numel=1024), {"big": ["big"], "small": ["small"]})
    assert details["small"].bias["int8"] == 0.0  # falls back to fp32: no 8-bit error to pool
    assert details["big"].bias["int8"] > 0.0
