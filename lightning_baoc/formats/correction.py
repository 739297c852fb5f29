"""Master-weight splitting: a 16-bit weight and an integer correction that hold the fp32 master.

A model trained in bf16 (Lightning ``precision="bf16-true"``) keeps only 16-bit weights, and an
update smaller than half a bf16 ulp of a weight is lost (measured: at lr 1e-5, 20 AdamW steps
changed 6.4% of bf16 weights). FlashOptim (arXiv 2602.23349) keeps the weight in 16 bits and the
rounding error in a small integer scaled to the weight's ULP; the optimizer steps the fp32 value
they reconstruct and splits the result again.

The split, for a master value ``x`` (fp32) and a weight dtype with ``p`` mantissa bits:

- the weight ``w = round_to_nearest_even(x)`` in the 16-bit dtype (what ``x.to(dtype)`` gives; magnitudes
  past the dtype's largest finite value saturate to it);
- the correction ``c = round(2**k * (x - w) / unit)``, clamped to ``[-(2**(k-1) - 1), 2**(k-1) - 1]``,
  an int8 (``ecc8``, ``k = 8``) or int16 (``ecc16``, ``k = 16``). The unit is the spacing of the dtype's
  numbers next to ``w`` on the side of ``x``: ``ulp(w)``, the spacing just above ``|w|`` (``2**(e - p)``
  for ``2**e <= |w| < 2**(e+1)``, the subnormal spacing below the smallest normal number), or half of it
  when ``|w|`` is a power of two and ``|x| < |w|`` (the binade below is twice as fine). The sign of ``c``
  against ``w``'s says which side, so the reconstruction knows the unit.

The reconstruction is ``x' = w + c * (unit / 2**k)``: ``c * (unit / 2**k)`` is exact (an integer times a
power of two, at most ``unit / 2``: no overflow near the dtype's largest value), and so is the sum
wherever the dtype's grid refined ``2**k`` times is representable in fp32 (always for ``bf16`` with
``ecc8`` and ``ecc16``, and ``fp16`` with ``ecc8``; ``fp16`` with ``ecc16`` resolves finer than fp32 and
rounds once).

The bound (``tests/formats/test_correction.py`` checks it on every bf16 and fp16 weight with a dense
sweep of fp32 values around each). ``x - w`` is exact in fp32 (Sterbenz: ``w/2 <= x <= 2w``), and
``|x - w| <= unit / 2`` (round to nearest), so the scaled residual ``s = (x - w) / unit`` lies in
``[-1/2, 1/2]`` and ``c / 2**k`` is its nearest point on the grid ``Z / 2**k``, clamped. Hence

    |x - x'| <= unit / 2**(k+1) <= ulp(w) / 2**(k+1)     (unit / 2**k at exact ties |s| = 1/2, clamped)

and, for ``fp16``/``ecc16``, plus half an fp32 ulp of ``x`` from the final rounding. Without a
correction the error is ``|x - w| <= unit / 2``. The grids nest (``{w}`` is ``c = 0``; ``ecc8``'s
points are every 256th of ``ecc16``'s), and each split takes the nearest point of its grid, so per
element ``error(none) >= error(ecc8) >= error(ecc16)``. For bf16, ``ecc16``'s grid is fp32's: it is
exact but at exact ties, where it is one fp32 ulp off.

The symmetric clamp makes the split of a reconstruction give back the same weight and correction
(``x'`` lies strictly inside ``w``'s rounding interval): a step that leaves ``x'`` as it is leaves both
as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

#: The corrections a parameter can hold, by name: none, or the number of bits.
CORRECTION_BITS = {"none": 0, "ecc8": 8, "ecc16": 16}
CORRECTIONS = tuple(CORRECTION_BITS)
_STORAGE = {8: torch.int8, 16: torch.int16}
#: Elements a split or a reconstruction computes at once: its fp32 temporaries stay a few MiB.
SLICE = 1 << 16


@dataclass(frozen=True)
class WeightDType:
    """A 16-bit weight dtype: its mantissa bits, smallest normal exponent and largest value."""

    mantissa_bits: int
    min_exponent: int
    max_value: float


WEIGHT_DTYPES = {
    torch.bfloat16: WeightDType(7, -126, torch.finfo(torch.bfloat16).max),
    torch.float16: WeightDType(10, -14, torch.finfo(torch.float16).max),
}


def corrections_refused(dtypes: Iterable[Iterable[torch.dtype]]) -> str | None:
    """Why master-weight corrections cannot be chosen for a model whose blocks train ``dtypes`` (one
    iterable of parameter dtypes per block): none of them is bf16 or fp16. ``None`` when one is.

    Example:
        >>> corrections_refused([[torch.float32]])
        'the model trains no bf16 or fp16 parameter (its weights are float32), and a correction applies to 16-bit weights only'
    """
    seen = {d for row in dtypes for d in row}
    if seen & WEIGHT_DTYPES.keys():
        return None
    kinds = "/".join(sorted(str(d).removeprefix("torch.") for d in seen)) or "none"
    return f"the model trains no bf16 or fp16 parameter (its weights are {kinds}), and a correction applies to 16-bit weights only"


def check_correction(name: str) -> int:
    """The number of bits of correction ``name`` (0 for ``"none"``), or a ``ValueError`` naming the choices."""
    if name not in CORRECTION_BITS:
        raise ValueError(f"unknown master-weight correction {name!r}; choose one of {', '.join(CORRECTIONS)}")
    return CORRECTION_BITS[name]


def correction_dtype(name: str) -> torch.dtype | None:
    """The integer dtype that stores correction ``name`` (``None`` for ``"none"``)."""
    bits = check_correction(name)
    return _STORAGE[bits] if bits else None


def _weight_dtype(dtype: torch.dtype) -> WeightDType:
    spec = WEIGHT_DTYPES.get(dtype)
    if spec is None:
        raise TypeError(f"master-weight corrections apply to bf16 and fp16 weights, not {dtype}")
    return spec


def ulp(weight: Tensor) -> Tensor:
    """The spacing of ``weight``'s dtype just above ``|weight|`` (fp32, exact powers of two)."""
    spec = _weight_dtype(weight.dtype)
    a = weight.to(torch.float32).abs()
    _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1): the leading bit is 2**(e - 1)
    exponent = torch.where(a < 2.0**spec.min_exponent, spec.min_exponent, e - 1) - spec.mantissa_bits
    return torch.ldexp(torch.ones_like(a), exponent)


def split(master: Tensor, dtype: torch.dtype, correction: str) -> tuple[Tensor, Tensor | None]:
    """``master`` (fp32) as a ``dtype`` weight and its correction (``None`` for ``"none"``)."""
    weight = torch.empty(master.shape, dtype=dtype, device=master.device)
    store = correction_dtype(correction)
    corr = torch.empty(master.shape, dtype=store, device=master.device) if store is not None else None
    split_into(master, weight, corr)
    return weight, corr


def split_into(master: Tensor, weight: Tensor, correction: Tensor | None) -> None:
    """Write the split of ``master`` (fp32, ``weight``'s shape) into ``weight`` and ``correction``,
    in slices of :data:`SLICE` elements (the temporaries stay a few MiB whatever the size).

    ``correction`` is contiguous (the optimizer allocates it so); ``weight`` may be laid out otherwise
    (channels-last, a transposed view): it is then split into a contiguous 16-bit copy, checked before
    anything is written, and copied in at the end (one 16-bit transient of the weight's size)."""
    spec = _weight_dtype(weight.dtype)
    if correction is not None and not correction.is_contiguous():
        raise ValueError("split_into: a master-weight correction is stored contiguous")
    if master.shape != weight.shape or (correction is not None and correction.shape != weight.shape):
        raise ValueError(f"split_into: master {tuple(master.shape)}, weight {tuple(weight.shape)} and correction "
                         f"{None if correction is None else tuple(correction.shape)} differ in shape")
    if not weight.is_contiguous():
        dense = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        split_into(master, dense, correction)
        weight.copy_(dense)
        return
    x_all = master.reshape(-1)
    w_all = weight.view(-1)
    c_all = None if correction is None else correction.view(-1)
    bits = 0 if correction is None else {torch.int8: 8, torch.int16: 16}[correction.dtype]
    limit = 2.0 ** (bits - 1) - 1
    for start in range(0, x_all.numel(), SLICE):
        x = x_all[start : start + SLICE].to(torch.float32)
        w_out = w_all[start : start + SLICE]
        w_out.copy_(x.clamp(-spec.max_value, spec.max_value))
        if c_all is None:
            continue
        w = w_out.to(torch.float32)
        r = x - w  # exact (Sterbenz)
        s = r.div_(_unit(w_out, _toward_zero(r, w))).mul_(2.0**bits)  # exact: the unit is a power of two
        c_all[start : start + SLICE].copy_(torch.nan_to_num_(s.round_(), nan=0.0).clamp_(-limit, limit))


def reconstruct(weight: Tensor, correction: Tensor | None) -> Tensor:
    """The fp32 master value ``weight + correction * unit / 2**k`` (``weight`` alone without one), a
    new contiguous tensor of ``weight``'s shape, computed in slices of :data:`SLICE` elements."""
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device).copy_(weight)
    if correction is None:
        return out
    bits = {torch.int8: 8, torch.int16: 16}[correction.dtype]
    flat_w, flat_c, flat_out = weight.reshape(-1), correction.reshape(-1), out.view(-1)
    for start in range(0, flat_out.numel(), SLICE):
        w16 = flat_w[start : start + SLICE]
        w = flat_out[start : start + SLICE]
        c = flat_c[start : start + SLICE].to(torch.float32)
        unit = _unit(w16, _toward_zero(c, w)).mul_(2.0**-bits)  # unit / 2**k first: no overflow near the largest value
        w.copy_(torch.where(c == 0, w, w + c.mul_(unit)))  # c = 0 keeps w as it is, -0.0 included
    return out


def _toward_zero(residual: Tensor, w: Tensor) -> Tensor:
    """Where the residual points from ``w`` toward zero (signs compared: a product may underflow)."""
    return (residual != 0) & ((residual < 0) != (w < 0))


def _unit(weight: Tensor, toward_zero: Tensor) -> Tensor:
    """The spacing of ``weight``'s dtype on the side of ``|weight|`` a residual points to: ``ulp``
    above, half of it below a power of two (the binade below is twice as fine)."""
    spec = _weight_dtype(weight.dtype)
    u = ulp(weight)
    a = weight.to(torch.float32).abs()
    mantissa, _ = torch.frexp(a)
    finer = toward_zero & (mantissa == 0.5) & (a > 2.0**spec.min_exponent)
    return torch.where(finer, u * 0.5, u)


def error_bound(weight: Tensor, correction: str) -> Tensor:
    """A bound on ``|x - reconstruct(split(x))|`` for a master ``x`` that splits to ``weight``, away
    from exact ties (module docstring): ``ulp(w) / 2**(k+1)``, ``ulp(w) / 2`` without correction."""
    return ulp(weight).mul_(2.0 ** -(check_correction(correction) + 1))


__all__ = [
    "CORRECTIONS",
    "CORRECTION_BITS",
    "WEIGHT_DTYPES",
    "check_correction",
    "correction_dtype",
    "error_bound",
    "reconstruct",
    "split",
    "split_into",
    "ulp",
]
