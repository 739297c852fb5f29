"""What the Triton kernels of the CUDA step share: Triton's optional import, the launch table's readers, the
16-bit weights and their fp32 masters, and the host's scalars of a launch.

The AdamW update (:mod:`lightning_baoc.kernels.triton_step`) and the factored formats' pre-pass
(:mod:`lightning_baoc.kernels.triton_factored`) both find their tensor among a launch's rows (:func:`_find`),
read its columns (:func:`_ptr`, :func:`_int32_at`), load 16-bit weights and gradients and rebuild the fp32
masters of 16-bit weights from their corrections (:func:`_load16`, :func:`_load_master`: ``formats/correction.py``),
and take their scalars in fp32 as the CPU step does (:func:`_f32`, :func:`_float_bits`, :func:`_common`). The
update builds on the pre-pass, so what both read lives here, below the two. Triton is an optional dependency
(it ships with torch's CUDA builds on Linux): :func:`triton_status` says whether it imports; without it the
device functions are not defined and the step takes the eager path.

Example:
    >>> from lightning_baoc.kernels.triton_common import _float_bits, triton_status
    >>> _float_bits(1.0), isinstance(triton_status()[0], bool)
    (1065353216, True)
"""

from __future__ import annotations

import struct
from typing import Any

import torch
from torch import Tensor

try:  # an optional dependency: the CUDA step's kernels
    import triton
    import triton.language as tl
except ImportError as err:  # pragma: no cover - depends on the installation
    triton = None
    tl = None
    _IMPORT_ERROR: str | None = str(err)
else:
    _IMPORT_ERROR = None


def triton_status() -> tuple[bool, str]:
    """Whether Triton imports, and why not."""
    if triton is None:
        return False, f"triton is not installed ({_IMPORT_ERROR})"
    return True, f"triton {triton.__version__}"


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (the kernel's scalars, as the CPU step's ``static_cast<float>``)."""
    return struct.unpack("f", struct.pack("f", x))[0]


if triton is not None:
    @triton.jit
    def _u32(value: tl.constexpr):
        return tl.full((), value, tl.uint32)

    @triton.jit
    def _bf16_load(raw):
        """bf16 bits (as int16) -> fp32."""
        return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _exp2i(e):
        """2**e for an integral int32 e in [-149, 127] (subnormal below -126): exact (cpu_step.cpp exp2i)."""
        normal = ((tl.maximum(e, -126) + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        subnormal = (_u32(1) << tl.minimum(tl.maximum(e + 149, 0), 22).to(tl.uint32)).to(tl.float32, bitcast=True)
        return tl.where(e >= -126, normal, subnormal)

    @triton.jit
    def _unit_exponent(w, toward_zero, KIND: tl.constexpr, BITS: tl.constexpr):
        """The exponent of a correction's unit over 2**BITS (correction.py ``_unit``): the spacing of the
        weight's dtype next to |w| on the residual's side, half of it below a power of two."""
        P: tl.constexpr = 7 if KIND == 1 else 10
        EMIN: tl.constexpr = -126 if KIND == 1 else -14
        b = w.to(tl.uint32, bitcast=True) & _u32(0x7FFFFFFF)
        e = tl.maximum((b >> 23).to(tl.int32) - 127, EMIN)
        finer = toward_zero & ((b & _u32(0x7FFFFF)) == 0) & (b > _u32((EMIN + 127) << 23))
        return e - P - BITS - finer.to(tl.int32)

    @triton.jit
    def _points_to_zero(residual, w):
        return (residual != 0.0) & ((residual < 0.0) != (w < 0.0))

    @triton.jit
    def _load16(raw, KIND: tl.constexpr):
        """16-bit bits (as int16) of a bf16 (KIND 1) or fp16 (KIND 2) value -> fp32."""
        if KIND == 1:
            return _bf16_load(raw)
        return raw.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _store16(x, KIND: tl.constexpr):
        """fp32 -> 16-bit bits (as int16), rounded to nearest even as ``.to(dtype)`` (NaN -> bf16's 0x7FC0)."""
        if KIND == 1:
            u = x.to(tl.uint32, bitcast=True)
            rounded = (u + _u32(0x7FFF) + ((u >> 16) & _u32(1))) >> 16
            out = tl.where((u & _u32(0x7FFFFFFF)) > _u32(0x7F800000), _u32(0x7FC0), rounded)
            return out.to(tl.uint16).to(tl.int16, bitcast=True)
        return x.to(tl.float16).to(tl.int16, bitcast=True)

    @triton.jit
    def _load_master(p_ptr, c_ptr, idx, mask, KIND: tl.constexpr, BITS: tl.constexpr):
        """The fp32 masters of 16-bit weights and their corrections (correction.py ``reconstruct``)."""
        w = _load16(tl.load(p_ptr + idx, mask=mask, other=0), KIND)
        if BITS == 0:
            return w
        c = tl.load(c_ptr + idx, mask=mask, other=0).to(tl.float32)
        x = w + c * _exp2i(_unit_exponent(w, _points_to_zero(c, w), KIND, BITS))
        return tl.where(c == 0.0, w, x)

    @triton.jit
    def _store_master(x, p_ptr, c_ptr, idx, mask, KIND: tl.constexpr, BITS: tl.constexpr):
        """Split fp32 masters into 16-bit weights and corrections (correction.py ``split_into``)."""
        MAX: tl.constexpr = 3.3895313892515355e38 if KIND == 1 else 65504.0
        h = _store16(tl.minimum(tl.maximum(x, -MAX), MAX), KIND)
        tl.store(p_ptr + idx, h, mask=mask)
        if BITS != 0:
            LIMIT: tl.constexpr = 127.0 if BITS == 8 else 32767.0
            w = _load16(h, KIND)
            r = x - w
            e = _unit_exponent(w, _points_to_zero(r, w), KIND, BITS)
            first = tl.minimum(-e, 127)
            s = (r * _exp2i(first)) * _exp2i(-e - first)
            s = tl.minimum(tl.maximum(s, -40000.0), 40000.0)
            s = (s + 12582912.0) - 12582912.0
            s = tl.minimum(tl.maximum(s, -LIMIT), LIMIT)
            s = tl.where(s == s, s, 0.0)
            if BITS == 8:
                tl.store(c_ptr + idx, s.to(tl.int32).to(tl.int8), mask=mask)
            else:
                tl.store(c_ptr + idx, s.to(tl.int32).to(tl.int16), mask=mask)

    @triton.jit
    def _ptr(row, j: tl.constexpr, DTYPE: tl.constexpr):
        """Column ``j`` of a tensor's row of the table: an address, as a pointer to ``DTYPE``."""
        return tl.load(row + j).to(tl.pointer_type(DTYPE))

    @triton.jit
    def _int32_at(row, j: tl.constexpr):
        """Column ``j`` of the table as int32 (stored sign-extended)."""
        return tl.load(row + j).to(tl.int32)

    @triton.jit
    def _find(first, count, pid, SEARCH: tl.constexpr):
        """The tensor of program ``pid``: the ``lo`` with ``first[lo] <= pid < first[lo + 1]`` among the ``count``
        tensors' first programs (a binary search of ``SEARCH`` halvings)."""
        lo = tl.zeros((), tl.int64)
        hi = lo + count
        for _ in tl.static_range(SEARCH):
            mid = (lo + hi) // 2
            below = tl.load(first + mid) <= pid
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        return lo


#: Parameter and gradient dtypes as the kernel numbers them (``W``, ``G``).
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CORRECTION_BITS = {torch.int8: 8, torch.int16: 16}


def _float_bits(x: float) -> int:
    """The fp32 bits of ``x`` as a signed int32's value."""
    return struct.unpack("i", struct.pack("f", x))[0]


def _common(kinds: tuple[int, int], hyper: Any, limit_m: float, limit_v: float) -> dict[str, Any]:
    """The launch's scalars and format constants shared by every tensor of a step."""
    m_kind, v_kind = kinds
    wd, decoupled = hyper.weight_decay, hyper.decoupled_weight_decay
    w = _f32(1.0 - hyper.beta1)
    small = abs(w) < 0.5
    return dict(
        l2=_f32(wd), beta2=_f32(hyper.beta2),
        one_minus_beta2=_f32(1.0 - hyper.beta2), lerp_coeff=w if small else _f32(w - 1.0), eps=_f32(hyper.eps),
        gsign=-1.0 if hyper.maximize else 1.0, limit_m=_f32(limit_m), limit_v=_f32(limit_v), M=m_kind, V=v_kind,
        LERP_SMALL=small, L2=wd != 0.0 and not decoupled,
    )


def on_device(table: Tensor, device: torch.device) -> Tensor:
    """A launch's table (host int64) where the kernel reads it: on a GPU, a copy from pinned memory (no
    synchronisation with the host)."""
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


__all__ = ["triton_status"]
