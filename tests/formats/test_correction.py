"""Master-weight splitting (``lightning_baoc/formats/correction.py``): on every finite bf16 and fp16
weight, a dense sweep of fp32 masters across its rounding interval (33 points on each half, both
exact ties, and the 4 fp32 neighbours on each side), positive and negative:

- the weight is ``x.to(dtype)``;
- the reconstruction error is within the derived bound: ``unit / 2**(k+1)``, ``unit / 2**k`` at
  exact ties (the unit: the spacing to ``w``'s neighbour on the side of ``x``), plus half an fp32 ulp where fp16's ``ecc16`` grid is finer than fp32's;
- per element, ``error(none) >= error(ecc8) >= error(ecc16)``; for bf16, ``ecc16`` is exact but at ties;
- the split of a reconstruction gives back the same weight and correction.
"""

from __future__ import annotations

import pytest
import torch
from support import one_thread  # noqa: F401 - one_thread applies to the module

from lightning_baoc.formats.correction import (
    CORRECTIONS,
    WEIGHT_DTYPES,
    check_correction,
    error_bound,
    reconstruct,
    split,
    ulp,
)

MAX_PATTERN = {torch.bfloat16: 0x7F7F, torch.float16: 0x7BFF}  # the largest finite magnitude


def _weights(dtype: torch.dtype) -> torch.Tensor:
    """Every finite non-negative weight of ``dtype``, in order, as fp64."""
    patterns = torch.arange(0, MAX_PATTERN[dtype] + 1, dtype=torch.int32).to(torch.int16)
    return patterns.view(dtype).to(torch.float64)


def _masters(dtype: torch.dtype) -> torch.Tensor:
    w = _weights(dtype)[:-1]  # the largest has no upper neighbour
    nxt = _weights(dtype)[1:]
    prev = torch.cat([-nxt[:1], w[:-1]])  # below +0: the mirror of the smallest subnormal
    t = torch.linspace(0.0, 1.0, 33, dtype=torch.float64)
    upper = w[:, None] + (nxt - w)[:, None] / 2 * t  # t = 1: the exact tie (representable in fp32)
    lower = w[:, None] - (w - prev)[:, None] / 2 * t
    w32 = w.to(torch.float32)
    steps = [w32]
    for _ in range(4):  # the fp32 neighbours of w
        steps.append(torch.nextafter(steps[-1], torch.tensor(float("inf"))))
    down = [w32]
    for _ in range(4):
        down.append(torch.nextafter(down[-1], torch.tensor(float("-inf"))))
    near = torch.stack(steps[1:] + down[1:], dim=1).to(torch.float64)
    x = torch.cat([upper, lower, near], dim=1).to(torch.float32).reshape(-1)
    x = x[x.abs() <= WEIGHT_DTYPES[dtype].max_value]
    return torch.cat([x, -x])


def _spacing(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The distance from ``w`` to its neighbour in its dtype on the side of ``x`` (fp64), from the bit
    patterns: the unit the correction counts in."""
    mag = w.view(torch.int16).to(torch.int32) & 0x7FFF
    toward_zero = (x.abs() < w.to(torch.float32).abs()) & (mag > 0)
    neighbour = torch.where(toward_zero, mag - 1, mag + 1).to(torch.int16).view(w.dtype).to(torch.float64)
    return (neighbour - w.to(torch.float64).abs()).abs()


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.slow), torch.float16], ids=["bf16", "fp16"])  # fp16 by default
def test_reconstruction_is_within_the_bound_and_ordered(dtype: torch.dtype) -> None:
    x = _masters(dtype)
    assert x.numel() > 4_000_000
    x64 = x.to(torch.float64)
    errors = {}
    for name in CORRECTIONS:
        w, c = split(x, dtype, name)
        assert torch.equal(w, x.to(dtype)), name  # the weight is round-to-nearest-even
        rec = reconstruct(w, c)
        assert rec.dtype == torch.float32
        errors[name] = (rec.to(torch.float64) - x64).abs()
        again_w, again_c = split(rec, dtype, name)  # idempotent
        assert torch.equal(again_w, w) and (c is None or torch.equal(again_c, c)), name
    w = x.to(dtype)
    u = _spacing(w, x)
    assert (u <= ulp(w).to(torch.float64)).all()
    s = (x64 - w.to(torch.float64)) / u
    tie = s.abs() == 0.5
    assert int(tie.sum()) > 60_000  # both ties of every weight are in the sweep
    assert (s.abs() <= 0.5).all()
    fp32_half_ulp = (torch.nextafter(x.abs(), torch.tensor(float("inf"))) - x.abs()).to(torch.float64) / 2
    for name in ("ecc8", "ecc16"):
        k = check_correction(name)
        bound = torch.where(tie, u * 2.0**-k, u * 2.0 ** -(k + 1))
        if dtype == torch.float16 and name == "ecc16":
            bound = bound + fp32_half_ulp
        excess = errors[name] - bound
        assert float(excess.max()) <= 0.0, (name, float(excess.max()))
        # the documented bound, in ulps above the weight, away from ties
        extra = fp32_half_ulp if dtype == torch.float16 and name == "ecc16" else 0.0
        assert (errors[name] - extra <= error_bound(w, name).to(torch.float64))[~tie].all()
    assert (errors["none"] <= u / 2).all()
    assert (errors["none"] >= errors["ecc8"]).all()
    assert (errors["ecc8"] >= errors["ecc16"]).all()
    if dtype == torch.bfloat16:  # ecc16's grid is fp32's: exact but at exact ties
        assert (errors["ecc16"][~tie] == 0).all()
        assert float(errors["ecc16"][tie].div(u[tie]).max()) == 2.0**-16
    # the corrections gain what they claim: ecc8 ~256x, ecc16 ~65536x below the weight's rounding
    assert float(errors["none"].mean() / errors["ecc8"].mean()) > 100
    assert float(errors["ecc8"].mean() / errors["ecc16"].clamp_min(0).mean().clamp_min(1e-300)) > 100


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_out_of_range_and_nonfinite_masters(dtype: torch.dtype) -> None:
    top = WEIGHT_DTYPES[dtype].max_value
    x = torch.tensor([top * 1.5, -top * 1.5, float("nan"), 0.0, -0.0], dtype=torch.float32)
    w, c = split(x, dtype, "ecc8")
    assert torch.equal(w[:2].float(), torch.tensor([top, -top]))  # saturated, never inf
    assert int(c[2]) == 0 and torch.isnan(w[2])
    assert torch.isfinite(reconstruct(w[:2], c[:2])).all()


def test_unknown_names_and_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="ecc8"):
        check_correction("ecc4")
    with pytest.raises(TypeError, match="bf16 and fp16"):
        split(torch.zeros(3), torch.float32, "ecc8")
