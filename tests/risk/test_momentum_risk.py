"""The risk terms of SGD's and Lion's momentum formats (``lightning_baoc/risk/momentum.py``).

On shadow moments measured from training (SGD) or set to a known signal-to-noise ratio (Lion): fp32
scores zero; dropping the buffer costs the most (SGD's step falls to ``1 - beta`` of the buffer's) and 8
bits more than bf16; the scores do not depend
on the gradients' scale; Lion's sign descent (``none``) is harmless when the gradient's sign is
certain and harmful when noise dominates; a group without momentum scores zero in every format.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_baoc import BlockwiseAdamW, BlockwiseLion, BlockwiseSGD
from lightning_baoc.risk.momentum import momentum_risk_details, momentum_risk_table, shadow_betas
from lightning_baoc.risk.shadow import ShadowMoments

BLOCKS = {"first": ["0.weight", "0.bias"], "last": ["2.weight", "2.bias"]}


def _trained_sgd(steps: int = 40, momentum: float = 0.9):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8))
    opt = BlockwiseSGD(model.named_parameters(), lr=0.05, momentum=momentum, min_8bit_numel=0)
    shadow = ShadowMoments(opt.named_params)
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(64, 8, generator=gen)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen)
        opt.zero_grad()
        ((model(x) - x @ target) ** 2).mean().backward()
        shadow.update(opt.named_params, shadow_betas(opt))
        opt.step()
    return opt, shadow


def test_sgd_scores_order_the_formats() -> None:
    opt, shadow = _trained_sgd()
    details = momentum_risk_details(opt, BLOCKS, shadow)
    assert sum(br.share for br in details.values()) == pytest.approx(1.0)
    for block, br in details.items():
        assert br.risk["fp32"] == 0.0
        assert br.risk["none"] > br.risk["int8"] > br.risk["bf16"] > 0.0, (block, br.risk)
        assert br.variance["int8"] == br.variance["bf16"] == 0.0
        # no buffer: the step is the raw gradient, 1 - beta = 0.1 of the buffer's (a step-size bias), with
        # less noise than the buffer's in absolute terms (0.01 of the gradient's against 0.053)
        assert br.bias["none"] == pytest.approx(0.81) and br.variance["none"] == 0.0


@pytest.mark.slow  # long; momentum risk is held by default by test_sgd_scores_order_the_formats
def test_sgd_none_with_dampening_is_unbiased_noise() -> None:
    """With ``dampening = momentum`` the buffer is an average: dropping it keeps the step size and adds
    the noise the buffer damped, ``1 - (1 - beta) / (1 + beta)`` of the gradient's."""
    opt, shadow = _trained_sgd()
    for group in opt.param_groups:
        group["dampening"] = 0.9
    for block, br in momentum_risk_details(opt, BLOCKS, shadow, horizon=1).items():
        noise = 0.0
        for name in BLOCKS[block]:
            entry = shadow.entries[name]
            m = entry.exp_avg.double() / (1 - 0.9**entry.steps)
            v = entry.exp_avg_sq.double() / (1 - 0.999**entry.steps)
            noise += float((v - m * m).clamp_min(0).sum()) * opt.named_params[name].numel() / m.numel()
        assert br.bias["none"] == pytest.approx(0.0, abs=1e-12)
        assert br.variance["none"] == pytest.approx((1 - 0.1 / 1.9) * noise / br.update_sq, rel=1e-9)


@pytest.mark.slow  # long; momentum risk is held by default by test_sgd_scores_order_the_formats
def test_scores_do_not_depend_on_the_gradients_scale() -> None:
    opt, shadow = _trained_sgd()
    before = momentum_risk_table(opt, BLOCKS, shadow, seed=3)
    for entry in shadow.entries.values():
        entry.exp_avg.mul_(1024.0)  # gradients 1024x larger (a power of two: the rounding is the same)
        entry.exp_avg_sq.mul_(1024.0**2)
    after = momentum_risk_table(opt, BLOCKS, shadow, seed=3)
    for block in before:
        for fmt in before[block]:
            assert after[block][fmt] == pytest.approx(before[block][fmt], rel=1e-6, abs=1e-12), (block, fmt)


@pytest.mark.slow  # long; momentum risk is held by default by test_sgd_scores_order_the_formats
def test_a_group_without_momentum_scores_zero() -> None:
    opt, shadow = _trained_sgd(momentum=0.0)
    table = momentum_risk_table(opt, BLOCKS, shadow)
    assert all(r == 0.0 for row in table.values() for r in row.values())


def _lion_with_snr(ratio: float):  # type: ignore[no-untyped-def]
    """A BlockwiseLion and shadow moments whose gradient noise is ``ratio`` times the signal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8))
    opt = BlockwiseLion(model.named_parameters(), lr=1e-4, min_8bit_numel=0)
    shadow = ShadowMoments(opt.named_params)
    gen = torch.Generator().manual_seed(2)
    for entry in shadow.entries.values():
        m = torch.randn(entry.exp_avg.shape, generator=gen)
        entry.exp_avg.copy_(m)
        entry.exp_avg_sq.copy_(m * m * (1.0 + ratio**2))
        entry.steps = 10_000  # bias corrections of 1
    return opt, shadow


def test_lion_sign_descent_is_harmless_only_when_the_sign_is_certain() -> None:
    opt, shadow = _lion_with_snr(1e-3)
    clean = momentum_risk_details(opt, BLOCKS, shadow)
    opt, shadow = _lion_with_snr(10.0)
    noisy = momentum_risk_details(opt, BLOCKS, shadow)
    for block in BLOCKS:
        assert clean[block].risk["none"] < 1e-6, clean[block].risk
        assert noisy[block].risk["none"] > 100 * noisy[block].risk["int8"] > 0.0, noisy[block].risk
        assert noisy[block].risk["fp32"] == 0.0 and noisy[block].risk["int8"] >= noisy[block].risk["bf16"]


def test_only_the_momentum_optimizers_are_scored() -> None:
    model = nn.Linear(4, 4)
    opt = BlockwiseAdamW(model.named_parameters())
    with pytest.raises(TypeError, match="scores BlockwiseSGD and BlockwiseLion, got BlockwiseAdamW"):
        momentum_risk_details(opt, {"a": ["weight"]}, ShadowMoments(opt.named_params))
    sgd, shadow = _trained_sgd(steps=2)
    with pytest.raises(ValueError, match="Unknown format 'nomomentum'"):
        momentum_risk_table(sgd, BLOCKS, shadow, formats=["fp32", "nomomentum"])
