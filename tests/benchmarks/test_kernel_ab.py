"""``benchmarks/kernel_ab.py --kernel-only``: the compiled operators' calls of one step are recorded with
their arguments and replayed, and the reference is torch's fused AdamW operator over the same tensors."""

from __future__ import annotations

import kernel_ab as K
import pytest
import torch
from torch import nn

from lightning_baoc import BlockwiseAdamW, kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels().available, reason=f"no compiled kernels: {kernels.cpu_kernels().detail}")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_the_recorded_calls_are_the_steps_and_replay_steps_again() -> None:
    model = _model()
    opt = BlockwiseAdamW(model.named_parameters(), state_format="int8", min_8bit_numel=0)
    before = _weights(model)
    calls = K.recorded_calls(opt, "lightning_baoc")
    assert [op for op, _ in calls] == [torch.ops.lightning_baoc.adamw_step]  # one call for the group's tensors
    stepped = _weights(model)
    assert all(not torch.equal(a, b) for a, b in zip(before, stepped))  # recording took the step
    # the recorded call replayed moves every weight again, exactly as the same call made by hand
    twin = _model()
    twin_opt = BlockwiseAdamW(twin.named_parameters(), state_format="int8", min_8bit_numel=0)
    (op, args), = K.recorded_calls(twin_opt, "lightning_baoc")
    K.replay(calls)()
    op(*args)
    for a, b, c in zip(stepped, _weights(model), _weights(twin)):
        assert not torch.equal(a, b)
        assert torch.equal(b, c)


def test_replaying_no_call_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="called no compiled operator"):
        K.replay([])


def test_the_reference_is_torch_fused_adamw_over_the_same_tensors() -> None:
    model, twin = _model(), _model()
    K.fused_adamw(list(model.parameters()))()
    torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.01, fused=True).step()
    for a, b in zip(_weights(model), _weights(twin)):
        assert torch.equal(a, b)
