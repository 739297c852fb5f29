"""The compiled SGD and Lion step (``momentum_step`` in ``kernels/cpu_step.cpp``) against the eager
reference (``formats/momentum.py``): bit-equal weights, buffers and counts after 1 and 50 steps, for
every momentum format, both rules and their options, ragged and small shapes, 1-D tensors, bf16 and
fp16 weights with and without a correction, a non-finite gradient skipped, a buffer restarted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_baoc import MOMENTUM_FORMATS, BlockwiseLion, BlockwiseSGD
from lightning_baoc import kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels().available, reason="no C++ compiler: the eager step runs")

SHAPES = [(3000,), (700,), (37, 1100), (2048, 3), (1024,)]
OPTIONS = {
    "sgd": dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd-dampening": dict(momentum=0.8, dampening=0.25, weight_decay=1e-3, maximize=True),
    "lion": dict(betas=(0.9, 0.99), weight_decay=0.1),
    "lion-maximize": dict(betas=(0.95, 0.98), maximize=True),
}


def _params(dtype: torch.dtype) -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    return [(f"p{i}", nn.Parameter(torch.randn(s, generator=gen).to(dtype))) for i, s in enumerate(SHAPES)]


def _run(policy: str, fmt: str, option: str, dtype: torch.dtype, correction: str, steps: int):  # type: ignore[no-untyped-def]
    params = _params(dtype)
    cls = BlockwiseSGD if option.startswith("sgd") else BlockwiseLion
    lr = 1e-2 if cls is BlockwiseSGD else 1e-3
    opt = cls(params, lr=lr, state_format=fmt, min_8bit_numel=0, kernels=policy, weight_correction=correction,
              **OPTIONS[option])
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for _, p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        if step == 3:  # a non-finite gradient: that parameter is skipped, the others step
            params[2][1].grad[0, 0] = float("inf")
        with pytest.warns(RuntimeWarning) if step == 3 else _nothing():
            opt.step()
    return params, opt


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _assert_equal(a, b) -> None:  # type: ignore[no-untyped-def]
    (pa, oa), (pb, ob) = a, b
    for (name, x), (_, y) in zip(pa, pb):
        assert torch.equal(x, y), name
    for ra, rb in zip(oa._records.values(), ob._records.values()):  # noqa: SLF001
        assert torch.equal(ra.counts, rb.counts), ra.name
        for key in ra.views:
            assert torch.equal(ra.views[key], rb.views[key]), (ra.name, key)
        if ra.master_correction is not None:
            assert torch.equal(ra.master_correction, rb.master_correction), ra.name


@pytest.mark.parametrize("steps", [1, 50])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("fmt", list(MOMENTUM_FORMATS))
def test_kernel_equals_eager_fp32_weights(fmt: str, option: str, steps: int) -> None:
    if fmt == "none" and option == "sgd-dampening":
        pytest.skip("the same as 'sgd' without a buffer")
    _assert_equal(_run("compiled", fmt, option, torch.float32, "none", steps),
                  _run("eager", fmt, option, torch.float32, "none", steps))


@pytest.mark.parametrize("dtype,correction", [(torch.bfloat16, "none"), (torch.bfloat16, "ecc8"),
                                              (torch.bfloat16, "ecc16"), (torch.float16, "ecc8")])
@pytest.mark.parametrize("option", ["sgd", "lion"])
@pytest.mark.parametrize("fmt", ["int8", "bf16", "fp32"])
def test_kernel_equals_eager_16bit_weights(fmt: str, option: str, dtype: torch.dtype, correction: str) -> None:
    _assert_equal(_run("compiled", fmt, option, dtype, correction, 12),
                  _run("eager", fmt, option, dtype, correction, 12))


def test_sgd_buffer_restart_is_the_same_in_the_kernel() -> None:
    """After ``none`` and back, SGD's buffer starts as the next gradient in both steps."""
    runs = []
    for policy in ("compiled", "eager"):
        params, opt = _run(policy, "int8", "sgd", torch.float32, "none", 5)
        opt.set_formats({"p0": "none", "p3": "none"})
        opt.set_formats({"p0": "int8", "p3": "fp32"})
        gen = torch.Generator().manual_seed(9)
        for _ in range(4):
            for _, p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append((params, opt))
    _assert_equal(*runs)
    assert runs[0][1].momentum_step_count("p0") == 4 and runs[0][1].step_count("p0") == 9


def test_the_compiled_step_is_much_faster_than_the_eager_one() -> None:
    """The reason for the kernel: an int8 SGD step over 4M elements, compiled vs eager, same process."""
    import time

    def timed(policy: str) -> float:
        p = nn.Parameter(torch.randn(4 << 20))
        opt = BlockwiseSGD([p], lr=1e-2, momentum=0.9, state_format="int8", kernels=policy)
        p.grad = torch.randn_like(p)
        opt.step()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - t)
        return best

    assert timed("compiled") * 2 < timed("eager")
