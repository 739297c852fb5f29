"""``benchmarks/step_host.py``: its stubs take out the kernels' work and nothing else, so that what it
times is the host's (the decisions and the counts still move, the parameters and states do not)."""

from __future__ import annotations

import pytest
import step_host as H
import torch
from torch import nn

from lightning_baoc import BlockwiseAdamW


def _stepped(path: str, fmt: str, stubbed: bool) -> tuple[bool, int]:
    """Whether a step through ``path`` moved the weight, and the weight's step count after it."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = BlockwiseAdamW(model.named_parameters(), state_format=fmt, min_8bit_numel=0)
    step = H._stubbed(path, opt.step) if stubbed else H._timed(opt.step)  # noqa: SLF001
    step()  # the states made
    before = model.weight.detach().clone()
    assert step() >= 0.0
    return not torch.equal(before, model.weight.detach()), opt._records[model.weight].step  # noqa: SLF001


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_the_compiled_path_without_its_kernel_does_the_host_work_alone(fmt: str) -> None:
    assert _stepped("compiled", fmt, stubbed=False) == (True, 2)
    moved, count = _stepped("compiled", fmt, stubbed=True)
    assert not moved  # the kernel (which moves the counts itself) did not run
    assert count == 0


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_the_device_path_without_its_launch_does_the_host_work_alone(fmt: str) -> None:
    pytest.importorskip("triton")
    moved, count = _stepped("device", fmt, stubbed=True)
    assert not moved  # no launch: the weight keeps its value
    assert count == 2  # while the host counted both steps (the device decides the skips)
