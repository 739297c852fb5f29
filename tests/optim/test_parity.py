"""All-fp32 BlockwiseAdamW matches torch.optim.AdamW / Adam."""

from __future__ import annotations

import pytest
import torch
from support import mlp, one_thread  # noqa: F401 - one_thread applies to the module
from torch import nn

from lightning_baoc import BlockwiseAdamW

STEPS = 200


def _groups(model: nn.Sequential, layers: tuple[int, ...]) -> list[dict]:
    decay = [model[i].weight for i in layers]
    no_decay = [p for i in layers for p in [model[i].bias]] + list(model[1].parameters())
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _run_pair(reference_cls: type, ours_kwargs: dict, ref_kwargs: dict) -> float:
    a, b = mlp((20, 64, 64, 5)), mlp((20, 64, 64, 5))
    ref = reference_cls(_groups(a, (0, 3)), lr=3e-3, **ref_kwargs)
    ours = BlockwiseAdamW(_groups(b, (0, 3)), lr=3e-3, **ours_kwargs)
    sched_a = torch.optim.lr_scheduler.CosineAnnealingLR(ref, T_max=STEPS)
    sched_b = torch.optim.lr_scheduler.CosineAnnealingLR(ours, T_max=STEPS)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(512, 20, generator=gen), torch.randint(0, 5, (512,), generator=gen)
    for step in range(STEPS):
        if step == 60:  # a group added later, with its own lr and weight decay
            ref.add_param_group({"params": list(a[6].parameters()), "lr": 1e-3, "weight_decay": 0.05})
            ours.add_param_group({"params": list(b[6].parameters()), "lr": 1e-3, "weight_decay": 0.05})
        sl = slice((step % 16) * 32, (step % 16 + 1) * 32)
        for model, opt, sched in ((a, ref, sched_a), (b, ours, sched_b)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
            opt.step()
            sched.step()
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("foreach", [False, True])
def test_fp32_matches_adamw(foreach: bool) -> None:
    diff = _run_pair(torch.optim.AdamW, {}, {"foreach": foreach})
    assert diff <= 1e-6, diff


def test_fp32_equals_fused_adamw_bit_for_bit() -> None:
    """The eager fp32 step runs torch's fused kernel on the same inputs (lightning_baoc.formats.fused_adam);
    the compiled CPU step (the default) is the kernel's own AdamW, within rounding of it."""
    assert _run_pair(torch.optim.AdamW, {"kernels": "eager"}, {"fused": True}) == 0.0
    diff = _run_pair(torch.optim.AdamW, {"kernels": "auto"}, {"fused": True})
    assert diff <= 1e-6, diff


def test_fp32_matches_adam_with_l2_and_maximize() -> None:
    diff = _run_pair(torch.optim.Adam, {"decoupled_weight_decay": False}, {})
    assert diff <= 1e-6, diff
    diff = _run_pair(torch.optim.AdamW, {"maximize": True}, {"maximize": True})
    assert diff <= 1e-6, diff


def test_param_groups_stay_one_to_one() -> None:
    model = mlp((8, 16, 4))
    opt = BlockwiseAdamW(_groups(model, (0, 3)), lr=1e-3)
    assert len(opt.param_groups) == 2
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.set_formats({"0": "int8", "1": "bf16"})
    assert len(opt.param_groups) == 2
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4]
    assert all(g["state_format"] == "fp32" for g in opt.param_groups)


def test_from_optimizer_inherits_state_and_continues_identically() -> None:
    a, b = mlp((20, 32, 5)), mlp((20, 32, 5))
    ref = torch.optim.AdamW(a.parameters(), lr=2e-3, weight_decay=0.05)
    src = torch.optim.AdamW(b.parameters(), lr=2e-3, weight_decay=0.05)
    x, y = torch.randn(64, 20), torch.randint(0, 5, (64,))
    for step in range(30):
        if step == 10:
            src = BlockwiseAdamW.from_optimizer(src, b)
            assert isinstance(src, BlockwiseAdamW)
            assert src.step_count("0.weight") == 10
        for model, opt in ((a, ref), (b, src)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    diff = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert diff <= 1e-6, diff
    assert src.param_groups[0]["weight_decay"] == 0.05


def test_from_optimizer_refuses_other_optimizers() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="AdamW and torch.optim.Adam"):
        BlockwiseAdamW.from_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        BlockwiseAdamW.from_optimizer(torch.optim.AdamW(model.parameters(), amsgrad=True))
