"""The risk of a master-weight correction (``lightning_baoc/risk/correction.py``): the part of each
expected update a bf16 weight loses to its rounding, per correction.

Checked on shadow moments set to a known gradient and on ones measured from training: updates far
below half a bf16 ulp are lost whole without a correction and with ``ecc8`` (relative loss 1), and
kept by ``ecc16`` within its grid; updates far above it are kept by all; the order none >= ecc8 >= ecc16
holds on every block; fp32 parameters and tensors that never stepped score 0; SGD and Lion scale the
step as their rules do.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_baoc import BlockwiseAdamW, BlockwiseLion, BlockwiseSGD
from lightning_baoc.formats.correction import ulp
from lightning_baoc.risk.correction import correction_risk_table, expected_step
from lightning_baoc.risk.momentum import shadow_betas
from lightning_baoc.risk.shadow import ShadowMoments

BLOCKS = {"first": ["0.weight", "0.bias"], "last": ["2.weight", "2.bias"]}


def _model(dtype: torch.dtype = torch.bfloat16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8)).to(dtype)


def _betas(opt: torch.optim.Optimizer) -> dict[str, tuple[float, float]]:
    if opt.rule == "adamw":  # type: ignore[attr-defined]
        return {n: (0.9, 0.999) for n in opt.named_params}  # type: ignore[attr-defined]
    return shadow_betas(opt)


def _known_shadow(opt: torch.optim.Optimizer, signal: float, noise: float) -> ShadowMoments:
    """Shadow moments of a gradient with mean ``+-signal`` per element and deviation ``noise``."""
    shadow = ShadowMoments(opt.named_params)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(1)
    for entry in shadow.entries.values():
        m = signal * torch.sign(torch.randn(entry.exp_avg.shape, generator=gen))
        entry.exp_avg.copy_(m)
        entry.exp_avg_sq.copy_(m * m + noise**2)
        entry.steps = 10**6  # bias corrections of 1
    return shadow


@pytest.mark.parametrize("lr", [1e-6, 1e-1])
def test_updates_below_and_above_the_weights_ulp(lr: float) -> None:
    model = _model()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # magnitudes in [0.5, 1): a bf16 ulp of 2**-8 on every weight
        for p in model.parameters():
            p.copy_((0.5 + 0.49 * torch.rand(p.shape, generator=gen)) * torch.sign(torch.randn(p.shape, generator=gen)))
    opt = BlockwiseAdamW(model.named_parameters(), lr=lr, weight_decay=0.0, eps=1e-8)
    shadow = _known_shadow(opt, 1e-3, 0.0)  # d = lr * sign(m) on every element
    table = correction_risk_table(opt, BLOCKS, shadow, _betas(opt))
    shares = {b: sum(row.values()) for b, row in table.items()}
    assert all(s > 0 for s in shares.values())
    # shares: progress sum(m d) = lr * 1e-3 * numel, so the blocks share by their elements
    share_first = (64 * 128 + 128) / sum(p.numel() for p in model.parameters())
    for block, row in table.items():
        share = share_first if block == "first" else 1.0 - share_first
        assert row["none"] >= row["ecc8"] >= row["ecc16"] >= 0.0
        if lr == 1e-6:
            # an update of 1e-6 is under half of ecc8's grid (2**-8 / 256) too
            assert min(float(ulp(p).min()) for p in model.parameters()) / 256 > 2e-6
            assert row["none"] == pytest.approx(share, rel=1e-6) and row["ecc8"] == pytest.approx(share, rel=1e-6)
            assert row["ecc16"] < 0.01 * share  # kept within ecc16's grid (ulp / 65536)
        else:
            # 0.1 is ~10 ulps and more of these weights: none keeps most, ecc8 and ecc16 all but rounding
            assert row["none"] < 0.05 * share and row["ecc8"] < 1e-5 * share and row["ecc16"] < 1e-9 * share


def test_fp32_parameters_and_unstepped_tensors_score_zero() -> None:
    opt = BlockwiseAdamW(_model(torch.float32).named_parameters(), lr=1e-6)
    table = correction_risk_table(opt, BLOCKS, _known_shadow(opt, 1e-3, 0.0), _betas(opt))
    assert all(r == 0.0 for row in table.values() for r in row.values())
    opt16 = BlockwiseAdamW(_model().named_parameters(), lr=1e-6)
    fresh = ShadowMoments(opt16.named_params)
    table = correction_risk_table(opt16, BLOCKS, fresh, _betas(opt16))
    assert all(r == 0.0 for row in table.values() for r in row.values())
    with pytest.raises(ValueError, match="unknown master-weight correction 'ecc4'"):
        correction_risk_table(opt16, BLOCKS, fresh, _betas(opt16), corrections=["none", "ecc4"])


def test_measured_from_training_in_bf16() -> None:
    """An AdamW run in bf16 at lr 1e-5 (the case that lost 6.4% of updates): dropping the correction
    is the largest risk on every block; ecc16 is at least 1000 times smaller than none."""
    model = _model()
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-5, weight_correction="ecc16", min_8bit_numel=0)
    shadow = ShadowMoments(opt.named_params)
    gen = torch.Generator().manual_seed(2)
    target = torch.randn(64, 8, generator=gen)
    for _ in range(30):
        x = torch.randn(32, 64, generator=gen)
        opt.zero_grad()
        ((model(x.to(torch.bfloat16)).float() - x @ target) ** 2).mean().backward()
        shadow.update(opt.named_params, _betas(opt))
        opt.step()
    table = correction_risk_table(opt, BLOCKS, shadow, _betas(opt))
    assert sum(sum(row.values()) for row in table.values()) > 0
    for block, row in table.items():
        assert row["none"] > row["ecc8"] > row["ecc16"] >= 0.0, (block, row)
        assert row["ecc16"] < 1e-3 * row["none"]


def test_sgd_and_lion_steps_follow_their_rules() -> None:
    m, v, x = torch.full((4,), 2.0, dtype=torch.float64), torch.full((4,), 5.0, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    sgd = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0}
    assert torch.allclose(expected_step("sgd", sgd, m, v, x), torch.full((4,), 0.1 * 2.0 / 0.1, dtype=torch.float64))
    assert torch.allclose(expected_step("sgd", {**sgd, "momentum": 0.0}, m, v, x), torch.full((4,), 0.2, dtype=torch.float64))
    lion = {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.0}
    # noise 1 (v - m^2), mean 2: erf(2 / (0.1 * sqrt 2)) = 1 within float precision
    assert torch.allclose(expected_step("lion", lion, m, v, x), torch.full((4,), 0.01, dtype=torch.float64))
    for opt in (BlockwiseSGD(_model().named_parameters(), lr=1e-5, momentum=0.9),
                BlockwiseLion(_model().named_parameters(), lr=1e-6)):
        table = correction_risk_table(opt, BLOCKS, _known_shadow(opt, 1e-3, 1e-4), _betas(opt))
        for row in table.values():
            assert row["none"] >= row["ecc8"] >= row["ecc16"] and row["none"] > 100 * row["ecc16"]


def test_an_l2_penalty_joins_the_expected_gradient() -> None:
    """SGD's weight decay and Adam's L2 penalty enter the gradient inside the step (the shadow saw the
    raw one): the expected step is the one a real step takes on a deterministic gradient."""
    torch.manual_seed(0)
    x, g = torch.randn(256, dtype=torch.float64), 1e-3 * torch.randn(256, dtype=torch.float64)
    for rule, opt in (
        ("sgd", BlockwiseSGD([nn.Parameter(x.float().clone())], lr=0.01, momentum=0.0, weight_decay=0.1)),
        ("adamw", BlockwiseAdamW([nn.Parameter(x.float().clone())], lr=1e-3, weight_decay=0.1, decoupled_weight_decay=False)),
    ):
        p = next(iter(opt.named_params.values()))
        p.grad = g.float().clone()
        before = p.detach().double().clone()
        opt.step()
        taken = before - p.detach().double()
        expected = expected_step(rule, opt.param_groups[0], g, g * g, before)
        assert torch.allclose(expected, taken, rtol=1e-4, atol=1e-9), rule

