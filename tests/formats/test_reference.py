"""Every format's fast step against its readable reference (``lightning_baoc.formats.reference``):
decode -> textbook fp32 AdamW -> encode, on the same state, gradient and rounding key."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW
from lightning_baoc.formats import resolve_format
from lightning_baoc.formats.reference import reference_step
from lightning_baoc.formats.quant import name_salt, stream_key

#: Largest relative difference allowed between the fast and the reference parameters' movement
#: (and between their decoded states), per format: ten times the largest measured over the shapes
#: below after 1 and after 50 steps (in brackets). The fast steps fuse and reorder fp32 operations
#: (torch's foreach order, chunked 8-bit updates, factored means as scaled sums), so they agree to
#: fp32 rounding; in bf16_momentum one momentum element on a bf16 rounding boundary after 50 steps
#: rounds the other way.
BOUND = {
    "fp32": 1e-5,  # [1.0e-6]
    "offload": 1e-5,  # [1.0e-6]
    "nomomentum": 1e-5,  # [4.2e-7]
    "factored": 1e-5,  # [6.4e-7]
    "bf16_momentum": 6e-4,  # [5.5e-5]
    "bf16": 1e-5,  # [7.7e-7]
    "int8": 1e-5,  # [8.1e-7]
    "int8_factored": 2e-5,  # [1.1e-6]
    "nomomentum_int8": 1e-5,  # [4.7e-7]
}
SHAPES = [(64, 48), (96,), (16, 8, 3)]


def _relative(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return float((a - b).norm() / scale.norm().clamp_min(1e-30))


@pytest.mark.parametrize("steps", [1, 50])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fast_step_equals_the_reference_step(fmt: str, steps: int) -> None:
    assert set(BOUND) == set(FORMATS)
    for shape in SHAPES:
        if resolve_format(fmt, shape, 0) != fmt:
            continue  # this shape falls back to another format (1-D tensors have no factored form)
        gen = torch.Generator().manual_seed(0)
        p = nn.Parameter(torch.randn(shape, generator=gen))
        opt = BlockwiseAdamW([("w", p)], lr=1e-2, weight_decay=0.1, state_format=fmt, min_8bit_numel=0)
        grads = [torch.randn(shape, generator=gen) * (1.0 + 0.1 * i) for i in range(steps + 1)]
        p.grad = grads[0]
        opt.step()  # the state exists from here: both start from it
        q = p.detach().clone()
        start = p.detach().clone()
        record = opt._records[p]  # noqa: SLF001 - the test reads the compact state directly
        views = {k: v.clone() for k, v in record.views.items()}
        for i in range(1, steps + 1):
            key = stream_key(opt.seed, record.step + 1, name_salt("w"))  # the step's rounding
            hyper = dataclasses.replace(opt._hyper_for(p), noise_key=key)  # noqa: SLF001
            reference_step(fmt, views, q, grads[i], hyper, step=record.step + 1, momentum_step=record.m_step + 1)
            p.grad = grads[i]
            opt.step()
        moved = p.detach() - start
        error = _relative(p.detach(), q, moved)
        assert error <= BOUND[fmt], (fmt, shape, steps, error)
        fast = FORMATS[fmt].decode(record.views, shape)
        slow = FORMATS[fmt].decode(views, shape)
        v_error = _relative(fast.dense_v(), slow.dense_v(), slow.dense_v())
        assert v_error <= BOUND[fmt], (fmt, shape, steps, "v", v_error)
        if slow.exp_avg is not None:
            m_error = _relative(fast.exp_avg, slow.exp_avg, slow.exp_avg)
            assert m_error <= BOUND[fmt], (fmt, shape, steps, "m", m_error)
