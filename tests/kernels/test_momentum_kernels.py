"""The compiled SGD and Lion step (``momentum_step`` in ``kernels/cpu_step.cpp``) against the eager
reference (``formats/momentum.py``), through the harness (``tests/support_formats.py``): bf16 and fp16
weights with and without a correction, a non-finite gradient skipped, a buffer restarted, and the
kernel's speed. Every momentum format with both rules and their options after 1 and 50 steps:
``tests/formats/test_backends.py``."""

from __future__ import annotations

import pytest
import support_formats as H
import torch
from torch import nn

from lightning_baoc import BlockwiseSGD, kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels().available, reason="no C++ compiler: the eager step runs")

SHAPES = [(3000,), (700,), (37, 1100), (2048, 3), (1024,)]
#: The rules' options here (every option of both rules: tests/formats/test_backends.py).
OPTIONS = {"sgd": dict(momentum=0.9, nesterov=True, weight_decay=1e-2), "lion": dict(betas=(0.9, 0.99), weight_decay=0.1, lr=1e-3)}


@pytest.mark.parametrize("dtype,correction", [(torch.bfloat16, "none"), (torch.bfloat16, "ecc8"),
                                              (torch.bfloat16, "ecc16"), (torch.float16, "ecc8")])
@pytest.mark.parametrize("option", ["sgd", "lion"])
@pytest.mark.parametrize("fmt", ["int8", "bf16", "fp32"])
def test_kernel_equals_eager_16bit_weights(fmt: str, option: str, dtype: torch.dtype, correction: str) -> None:
    runs = [H.run(fmt, backend, SHAPES, 12, optimizer=option, nonfinite_at=3, param_dtype=dtype, weight_correction=correction,
                  **OPTIONS[option]) for backend in ("compiled", "eager")]
    H.assert_agree(fmt, "compiled", *runs, SHAPES, optimizer=option)


def test_sgd_buffer_restart_is_the_same_in_the_kernel() -> None:
    """After ``none`` and back, SGD's buffer starts as the next gradient in both steps."""
    runs = []
    for policy in ("compiled", "eager"):
        gen = torch.Generator().manual_seed(0)
        params = [(f"p{i}", nn.Parameter(torch.randn(s, generator=gen))) for i, s in enumerate(SHAPES)]
        opt = BlockwiseSGD(params, lr=1e-2, state_format="int8", min_8bit_numel=0, kernels=policy, **OPTIONS["sgd"])
        for step in range(9):
            if step == 5:
                opt.set_formats({"p0": "none", "p3": "none"})
                opt.set_formats({"p0": "int8", "p3": "fp32"})
            for _, p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append([t for _, p in params for t in [p.detach(), *H.state_of(opt, p)]])
        assert opt.momentum_step_count("p0") == 4 and opt.step_count("p0") == 9
    H.assert_agree("int8", "compiled", *runs, SHAPES, optimizer="sgd")


def test_the_compiled_step_is_much_faster_than_the_eager_one() -> None:
    """The reason for the kernel: an int8 SGD step over 4M elements, compiled vs eager, same process, on one
    thread, their steps interleaved and each the best of seven (a load that comes and goes falls on both)."""
    import time

    steps = {}
    for policy in ("compiled", "eager"):
        p = nn.Parameter(torch.randn(4 << 20))
        opt = BlockwiseSGD([p], lr=1e-2, momentum=0.9, state_format="int8", kernels=policy)
        p.grad = torch.randn_like(p)
        opt.step()
        steps[policy] = opt.step
    best = {policy: float("inf") for policy in steps}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(7):
            for policy, step in steps.items():
                t = time.perf_counter()
                step()
                best[policy] = min(best[policy], time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    assert best["compiled"] * 2 < best["eager"], best
