"""``benchmarks/int8_mechanism.py``: its round trip is the optimizer's, and its torch Adam
continuation is BlockwiseAdamW's fp32 one, so its harms pair with ``risk_validation.py``'s."""

from __future__ import annotations

import int8_mechanism as M
import torch
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW
from lightning_baoc.formats import Canonical, StepHyper


def test_round_trip_is_the_int8_formats_own() -> None:
    torch.manual_seed(0)
    v = torch.exp(torch.randn(3000) * 2) * 1e-6
    fmt = FORMATS["int8"]
    views = {s.key: torch.zeros(s.numel, dtype=s.dtype) for s in fmt.layout(v.shape)}
    fmt.encode(Canonical(tuple(v.shape), exp_avg=torch.zeros_like(v), exp_avg_sq=v.clone()), views,
               StepHyper(0.0, 0.9, 0.999, 0.0, 0.0))
    expected = fmt.decode(views, v.shape).exp_avg_sq
    got = M.round_trip_v(v)
    assert torch.equal(got, expected)
    assert not torch.equal(got, v)  # 8 bits do lose something


def test_direction_distortion() -> None:
    m, v = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])
    err, usq = M.direction_distortion(m, v, v * 4, eps=0.0)  # every step halves
    assert usq == 2.0 and abs(err - 0.5) < 1e-7


def test_torch_adam_continuation_matches_blockwise_fp32() -> None:
    torch.manual_seed(0)

    def make() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))

    x, y = torch.randn(64, 16), torch.randn(64, 4)
    warm_model = make()
    warm = BlockwiseAdamW(warm_model.named_parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(5):
        warm.zero_grad()
        nn.functional.mse_loss(warm_model(x), y).backward()
        warm.step()
    a, b = make(), make()
    a.load_state_dict(warm_model.state_dict())
    b.load_state_dict(warm_model.state_dict())
    ref = BlockwiseAdamW(a.named_parameters(), lr=1e-2, weight_decay=0.0)
    ref.load_state_dict(warm.state_dict())
    stepper = M._Stepper(b, warm, 1e-2)
    for _ in range(10):
        for model, opt in ((a, ref), (b, stepper)):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-7)
