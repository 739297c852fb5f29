"""Every ordered pair of formats converts live state with bounded error."""

from __future__ import annotations

import itertools

import pytest
import torch
from support import train_digits
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW
from lightning_baoc.formats import Canonical

# relative error (norm of difference / norm) a conversion may add, by target format
M_TOL = {"fp32": 1e-7, "offload": 1e-7, "bf16_momentum": 2**-8, "bf16": 2**-8, "int8": 0.02, "int8_factored": 0.02}
V_TOL = {"fp32": 1e-7, "offload": 1e-7, "nomomentum": 1e-7, "bf16_momentum": 1e-7, "bf16": 2**-8, "int8": 0.02, "nomomentum_int8": 0.02}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _trained_param(fmt: str) -> tuple[nn.Parameter, BlockwiseAdamW]:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(96, 80))
    opt = BlockwiseAdamW([("w", p)], lr=1e-2, state_format="fp32")
    target = torch.randn(96, 80) * torch.linspace(0.1, 3.0, 80)  # anisotropic columns
    for _ in range(30):
        opt.zero_grad()
        ((p - target) ** 2 * torch.rand(96, 80)).sum().backward()
        opt.step()
    opt.set_formats({"w": fmt})
    return p, opt


@pytest.mark.parametrize("src,dst", list(itertools.product(FORMATS, FORMATS)))
def test_every_pair_converts_with_bounded_error(src: str, dst: str) -> None:
    p, opt = _trained_param(src)
    before: Canonical = opt.param_state("w")
    steps = opt.step_count("w")
    changed = opt.set_formats({"w": dst})
    assert opt.formats()["w"] == dst
    assert changed == ({} if src == dst else {"w": (src, dst)})
    assert opt.step_count("w") == steps  # the step count is kept
    after: Canonical = opt.param_state("w")
    # first moment: kept within the target's precision, dropped, or re-created from the gradient
    if FORMATS[dst].has_momentum:
        expected_m = before.exp_avg if before.exp_avg is not None else (1 - 0.9) * p.grad
        assert _rel(after.exp_avg, expected_m) <= M_TOL[dst], (src, dst)
    else:
        assert after.exp_avg is None
    # second moment: factored targets keep the row/column means exactly; dense ones the values
    if FORMATS[dst].factored:
        row, col = before.factored_v()
        assert _rel(after.row, row) <= 1e-6 and _rel(after.col, col) <= 1e-6, (src, dst)
    else:
        assert _rel(after.dense_v(), before.dense_v()) <= V_TOL[dst], (src, dst)
    assert opt.state_bytes() == FORMATS[dst].state_bytes(p.shape)
    opt.step()  # and it keeps training
    assert torch.isfinite(p).all()


def test_fp32_int8_fp32_is_the_int8_round_trip() -> None:
    p, opt = _trained_param("fp32")
    exact = opt.param_state("w")
    opt.set_formats({"w": "int8"})
    quantized = opt.param_state("w")
    opt.set_formats({"w": "fp32"})
    back = opt.param_state("w")
    assert torch.equal(back.exp_avg, quantized.exp_avg)
    assert torch.equal(back.exp_avg_sq, quantized.exp_avg_sq)
    assert 0 < _rel(back.exp_avg, exact.exp_avg) <= M_TOL["int8"]
    assert 0 < _rel(back.exp_avg_sq, exact.exp_avg_sq) <= V_TOL["int8"]


def test_momentum_recreated_without_gradient_starts_cold() -> None:
    p, opt = _trained_param("nomomentum")
    opt.zero_grad(set_to_none=True)
    opt.set_formats({"w": "fp32"})
    assert torch.count_nonzero(opt.param_state("w").exp_avg) == 0
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    opt.step()
    # m_step restarts at 1: the bias-corrected momentum equals the gradient, not 0.1 of it
    v = opt.param_state("w").exp_avg_sq
    step = opt.step_count("w")
    expected = 1e-2 * torch.ones_like(p) / ((v / (1 - 0.999**step)).sqrt() + 1e-8)
    assert torch.allclose(before * (1 - 1e-2 * 1e-2) - p.detach(), expected, rtol=1e-4)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "fp32"])
def test_no_loss_spike_after_conversion(fmt: str, digits) -> None:
    _, losses = train_digits(fmt, digits, steps=300, switch_at=200)
    before = sum(losses[180:200]) / 20
    after = max(losses[200:220])
    print(f"{fmt}: mean loss before switch {before:.4f}, max over 20 steps after {after:.4f}")
    assert after < max(3 * before, before + 0.1), (fmt, before, after)
