"""The AdamW step of the compact formats on CUDA: one Triton launch per format over all its tensors.

The eager step (:mod:`lightning_baoc.formats`) launches a few hundred CUDA kernels per 128K
elements, and on a GPU it is bound by those launches (on an H200, 21M parameters in int8 took 340x
the step of ``torch.optim.AdamW(fused=True)``). :func:`adamw_step` runs the whole step of every tensor
of a format as one launch of one program per 1024-element super-block: decode the moments, AdamW in
fp32, encode (group absmax, one shared exponent, fp16 scales, codes), each byte read and written once.
The tensors' addresses and per-tensor scalars (size, step size, bias correction, rounding key) travel
in one int64 table, copied to the device from pinned memory; each program finds its tensor by a binary
search of the tensors' first super-blocks. One launch per kind of tensors: parameter and gradient
dtypes, correction width, and whether the device decides the skip. The factored formats first run one
kernel per tensor for the row and column sums of the squared gradient (partial column sums per 16
rows, added in a fixed order: deterministic), then the vectors' update as the eager step does it.

The kernel computes the operations of the compiled CPU step (``cpu_step.cpp``) in the same order,
which are the eager step's: divisions and square roots correctly rounded (``div_rn``,
``sqrt_rn``), no contraction into fused multiply-adds but those written (``enable_fp_fusion`` off),
the bf16 stochastic rounding from the same counter-based hash of (key, element). The super-block's
exponent is read from the bits of its largest group maximum, where the eager step takes
``floor(log2(top))``: the two differ only when ``log2`` rounds up to an integer just below a power
of two, and then only in the exponent byte; the stored scale (fp16 scale times the power) and the
codes are the same, since the fp16 rounding is relative.

Served: every format with a kernel (``kernel_kinds``) but ``offload``; the fp32 pair only for 16-bit
parameters (torch's fused kernel serves fp32 ones, and this kernel steps them only at a step that kernel
skipped for another tensor's flag: ``repair``); fp32, bf16 and fp16 parameters and gradients,
contiguous, with the states on the parameter's device. A 16-bit parameter's fp32 master is rebuilt
from the weight and its master-weight correction (``formats/correction.py``) per super-block, stepped
and split again in the same pass. An item with a ``skip_flag`` (its finiteness decided on the device:
``optim/stepping.py``) is skipped by the kernel itself where the flag is set. Every other item takes
the eager step. Triton is an optional dependency: it ships with torch's CUDA builds on Linux;
:func:`~.triton_common.triton_status` says whether it imports; the device functions this step shares with the
factored formats' pre-pass (:mod:`.triton_factored`, which runs first) are in :mod:`.triton_common`.
``tests/kernels/test_triton_step.py`` runs the kernels through Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``) against the eager step; ``tests/integrations/test_cuda.py`` on a GPU.
"""

from __future__ import annotations

import array
import math
from typing import Any

import torch
from torch import Tensor

from lightning_baoc.formats.base import factor_dims
from lightning_baoc.formats.kinds import M_FP32, M_KEYS, M_NONE, V_FACTORED, V_FP32, V_KEYS
from lightning_baoc.kernels import TRITON_SERVED as SERVED
from lightning_baoc.kernels.triton_common import _CORRECTION_BITS, _KINDS, _common, _f32, _float_bits, on_device, tl, triton
from lightning_baoc.kernels.triton_factored import FactoredWork

if triton is not None:  # the device functions this module's kernels share with the factored pre-pass
    from lightning_baoc.kernels.triton_common import (
        _bf16_load, _find, _int32_at, _load16, _load_master, _ptr, _store_master, _u32,
    )

_SUPER = 1024

#: The columns of a tensor's row in the table of a launch (int64 each: addresses, then scalars; a
#: tensor the kernel does not read for this format is given the parameter's address). The first
#: super-block of each tensor follows the rows.
_COLUMNS = ("param", "grad", "correction", "m", "m_scale", "m_exp", "v", "v_scale", "v_exp", "row_factor",
            "col_factor", "skip_flag", "numel", "cols", "noise_key", "lr_step", "inv_sqrt_bc2", "decay")
_SKIP_COLUMN, _NUMEL_COLUMN, _KEY_COLUMN, _FACTOR_COLUMN = (
    _COLUMNS.index(name) for name in ("skip_flag", "numel", "noise_key", "row_factor"))


if triton is not None:
    _COLUMN_COUNT = tl.constexpr(len(_COLUMNS))
    _SKIP_FLAG, _NUMEL, _COLS, _NOISE_KEY, _LR_STEP, _INV_SQRT_BC2, _DECAY = (
        tl.constexpr(_COLUMNS.index(name))
        for name in ("skip_flag", "numel", "cols", "noise_key", "lr_step", "inv_sqrt_bc2", "decay")
    )

    @triton.jit
    def _mix(x):
        """The 32-bit hash of the rounding noise (quant.rounding_bits; cpu_step.cpp rounding_bits)."""
        x = x ^ (x >> 16)
        x = x * _u32(0x21F0AAAD)
        x = x ^ (x >> 15)
        x = x * _u32(0x735A2D97)
        return x ^ (x >> 15)

    @triton.jit
    def _bf16_stochastic(x, noise):
        """Stochastic rounding to bf16 (quant.bf16_stochastic): bits as int16."""
        r = (x.to(tl.uint32, bitcast=True) + noise) & _u32(0xFFFF0000)
        magnitude = r & _u32(0x7FFFFFFF)
        saturated = (r & _u32(0x80000000)) | tl.minimum(magnitude, _u32(0x7F7F0000))
        out = tl.where(magnitude > _u32(0x7F800000), _u32(0x7FC00000), saturated) >> 16
        return out.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def _pow2(e):
        """2**e for an integral int32 e in [-126, 127]: exact."""
        return ((e + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _rint(x):
        """Round to nearest even, for |x| < 2**22 (the codes)."""
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def _load_scales(s_ptr, e_ptr, sb, gidx, gmask):
        """The super-block's group scales as fp32 (fp16 scale * 2**exponent), one per row."""
        unit = _pow2(tl.load(e_ptr + sb).to(tl.int32))
        return tl.load(s_ptr + gidx, mask=gmask, other=0.0).to(tl.float32) * unit

    @triton.jit
    def _store_scales(absmax, limit, s_ptr, e_ptr, sb, gidx, gmask):
        """Group maxima -> fp16 scales and one exponent (quant._store_scales); the reciprocals."""
        a = tl.where(absmax != absmax, absmax, tl.minimum(absmax, limit))
        top = tl.max(a, axis=0)
        # floor(log2(top)) of a normal number is its exponent field; 0 and subnormals clamp to -126
        e = ((top.to(tl.uint32, bitcast=True) >> 23) & _u32(0xFF)).to(tl.int32) - 127 - 14
        e = tl.minimum(tl.maximum(e, -126), 126)
        h = (a * _pow2(-e)).to(tl.float16)
        stored = h.to(tl.float32) * _pow2(e)
        flushed = stored < 1.1754943508222875e-38
        tl.store(s_ptr + gidx, tl.where(flushed, 0.0, h.to(tl.float32)).to(tl.float16), mask=gmask)
        tl.store(e_ptr + sb, e.to(tl.int8))
        return tl.where(flushed, 0.0, tl.math.div_rn(tl.full(stored.shape, 1.0, tl.float32), tl.where(flushed, 1.0, stored)))

    @triton.jit
    def _encode_momentum(m, m_ptr, s_ptr, e_ptr, idx, mask, sb, gidx, gmask, limit):
        """Companded int8 codes of a super-block's momentum, its scales and exponent (quant.quantize_momentum)."""
        m = tl.where(mask, m, 0.0)
        inv = _store_scales(tl.max(tl.abs(m), axis=1), limit, s_ptr, e_ptr, sb, gidx, gmask)
        u = tl.minimum(tl.maximum(m * inv[:, None], -1.0), 1.0)
        code = _rint(tl.math.div_rn(u, tl.abs(u) + 1.0) * 254.0)
        tl.store(m_ptr + idx, code.to(tl.int32).to(tl.int8), mask=mask)

    @triton.jit
    def _encode_sqrt(root, v_ptr, s_ptr, e_ptr, idx, mask, sb, gidx, gmask, limit):
        """sqrt-companded uint8 codes of a super-block's second moment from its root (quant.quantize_sqrt)."""
        s = tl.where(mask, root, 0.0)
        inv = _store_scales(tl.max(s, axis=1), limit, s_ptr, e_ptr, sb, gidx, gmask)
        u = tl.minimum(tl.maximum(s * inv[:, None], 0.0), 1.0)
        tl.store(v_ptr + idx, _rint(u * 255.0).to(tl.int32).to(tl.uint8), mask=mask)

    @triton.jit
    def _superblock(
        p_ptr, g_ptr, c_ptr, m_ptr, ms_ptr, me_ptr, v_ptr, vs_ptr, ve_ptr, rf_ptr, cf_ptr, sb, cols, n, key,
        lr_step, decay, l2, beta2, one_minus_beta2, lerp_coeff, inv_sqrt_bc2, eps, gsign, limit_m, limit_v,
        M: tl.constexpr, V: tl.constexpr, LERP_SMALL: tl.constexpr, L2: tl.constexpr,
        W: tl.constexpr, G: tl.constexpr, CB: tl.constexpr,
    ):
        """One AdamW step of super-block ``sb`` of one tensor (cpu_step.cpp ``superblock``), as 32 x 32."""
        rows = tl.arange(0, 32)
        idx = sb * 1024 + rows[:, None] * 32 + tl.arange(0, 32)[None, :]
        mask = idx < n
        gidx = sb * 32 + rows
        gmask = gidx * 32 < n
        # parameters and gradients in fp32: fp32 tensors, or 16-bit ones (the masters rebuilt from corrections)
        if G == 0:
            g = tl.load(g_ptr + idx, mask=mask, other=0.0) * gsign
        else:
            g = _load16(tl.load(g_ptr + idx, mask=mask, other=0), G) * gsign
        if W == 0:
            p = tl.load(p_ptr + idx, mask=mask, other=0.0)
        else:
            p = _load_master(p_ptr, c_ptr, idx, mask, W, CB)
        if L2:
            g = tl.fma(p, l2, g)
        p = p * decay
        # the second moment: its square root and the denominator
        if V == 3:  # factored: rf[row] * cf[col], the rank-1 estimate's root (factored_math.sqrt_factors)
            d = tl.load(rf_ptr + idx // cols, mask=mask, other=0.0) * tl.load(cf_ptr + idx % cols, mask=mask, other=0.0) + eps
            # inf where AdamW's own (1 - beta2) g g overflows: no update there, as torch's (factored_math.overflowed)
            d = tl.where((one_minus_beta2 * g) * g == float("inf"), float("inf"), d)
        elif V == 0:
            v0 = tl.load(v_ptr + idx, mask=mask, other=0.0)
        elif V == 1:
            v0 = _bf16_load(tl.load(v_ptr + idx, mask=mask, other=0))
        else:
            codes = tl.load(v_ptr + idx, mask=mask, other=0).to(tl.float32)
            x = (tl.maximum(codes, 0.5) * 0.003921568859368563) * _load_scales(vs_ptr, ve_ptr, sb, gidx, gmask)[:, None]
            v0 = x * x
        if V != 3:
            v = tl.fma(one_minus_beta2 * g, g, v0 * beta2)
            root = tl.sqrt_rn(v)
            d = root * inv_sqrt_bc2 + eps
        # the momentum and the parameter
        if M == 0:
            p = p + tl.math.div_rn(lr_step * g, d)
        else:
            if M == 1:
                m0 = tl.load(m_ptr + idx, mask=mask, other=0.0)
            elif M == 2:
                m0 = _bf16_load(tl.load(m_ptr + idx, mask=mask, other=0))
            else:
                y = tl.load(m_ptr + idx, mask=mask, other=0).to(tl.float32) * 0.007874015718698502
                m0 = tl.math.div_rn(y, 2.0 - tl.abs(y)) * _load_scales(ms_ptr, me_ptr, sb, gidx, gmask)[:, None]
            if LERP_SMALL:
                m = tl.fma(lerp_coeff, g - m0, m0)
            else:
                m = tl.fma(lerp_coeff, g - m0, g)
            p = p + tl.math.div_rn(lr_step * m, d)
        if W == 0:
            tl.store(p_ptr + idx, p, mask=mask)
        else:
            _store_master(p, p_ptr, c_ptr, idx, mask, W, CB)
        # the moments
        if M == 2 or V == 1:
            h = _mix(idx.to(tl.uint32) + key.to(tl.uint32))
        if M == 1:
            tl.store(m_ptr + idx, m, mask=mask)
        elif M == 2:
            tl.store(m_ptr + idx, _bf16_stochastic(m, h >> 16), mask=mask)
        elif M == 3:
            _encode_momentum(m, m_ptr, ms_ptr, me_ptr, idx, mask, sb, gidx, gmask, limit_m)
        if V == 0:
            tl.store(v_ptr + idx, v, mask=mask)
        elif V == 1:
            tl.store(v_ptr + idx, _bf16_stochastic(v, h & _u32(0xFFFF)), mask=mask)
        elif V == 2:
            _encode_sqrt(root, v_ptr, vs_ptr, ve_ptr, idx, mask, sb, gidx, gmask, limit_v)

    @triton.jit(do_not_specialize=["count"])
    def _adamw_tensors(
        table, count, any_flag, l2, beta2, one_minus_beta2, lerp_coeff, eps, gsign, limit_m, limit_v,
        M: tl.constexpr, V: tl.constexpr, LERP_SMALL: tl.constexpr, L2: tl.constexpr,
        W: tl.constexpr, G: tl.constexpr, CB: tl.constexpr, SKIP: tl.constexpr, SEARCH: tl.constexpr,
        REPAIR: tl.constexpr,
    ):
        """One AdamW step of ``count`` tensors in one launch, one program per 1024-element super-block:
        the program finds its tensor among the tensors' first super-blocks (a binary search of
        ``SEARCH`` halvings) and reads the tensor's addresses and scalars from its row of ``table``
        (:data:`_COLUMNS`); none where the tensor's skip flag is set (``SKIP``: the device decided its
        finiteness). ``REPAIR``: nothing at all unless ``any_flag`` (fp32) is set, the step of a batch
        that torch's fused kernel skipped whole for that flag."""
        if REPAIR:
            if tl.load(any_flag) == 0.0:
                return
        pid = tl.program_id(0).to(tl.int64)
        first = table + count * _COLUMN_COUNT
        lo = _find(first, count, pid, SEARCH)
        row = table + lo * _COLUMN_COUNT
        if SKIP:
            if tl.load(_ptr(row, _SKIP_FLAG, tl.float32)) != 0.0:
                return
        WT: tl.constexpr = tl.float32 if W == 0 else tl.int16
        GT: tl.constexpr = tl.float32 if G == 0 else tl.int16
        CT: tl.constexpr = tl.int8 if CB == 8 else tl.int16
        MT: tl.constexpr = tl.float32 if M == 1 else (tl.int16 if M == 2 else tl.int8)
        VT: tl.constexpr = tl.float32 if V == 0 else (tl.int16 if V == 1 else tl.uint8)
        _superblock(
            _ptr(row, 0, WT), _ptr(row, 1, GT), _ptr(row, 2, CT), _ptr(row, 3, MT), _ptr(row, 4, tl.float16),
            _ptr(row, 5, tl.int8), _ptr(row, 6, VT), _ptr(row, 7, tl.float16), _ptr(row, 8, tl.int8),
            _ptr(row, 9, tl.float32), _ptr(row, 10, tl.float32), pid - tl.load(first + lo), tl.load(row + _COLS),
            tl.load(row + _NUMEL), _int32_at(row, _NOISE_KEY), _int32_at(row, _LR_STEP).to(tl.float32, bitcast=True),
            _int32_at(row, _DECAY).to(tl.float32, bitcast=True), l2, beta2, one_minus_beta2, lerp_coeff,
            _int32_at(row, _INV_SQRT_BC2).to(tl.float32, bitcast=True),
            eps, gsign, limit_m, limit_v, M, V, LERP_SMALL, L2, W, G, CB,
        )


def serves(
    kinds: tuple[int, int] | None, param: Tensor, grad: Tensor, views: dict[str, Tensor], correction: Tensor | None = None
) -> bool:
    """Whether :func:`adamw_step` steps this item: a served pair of kinds; fp32, bf16 or fp16 parameter
    and gradient, contiguous; a 16-bit parameter's master-weight correction, if any, contiguous; every
    tensor on the parameter's device."""
    return (
        triton is not None
        and ((kinds in SERVED and (kinds[1] != V_FACTORED or factor_dims(param.shape) is not None))
             or (kinds == (M_FP32, V_FP32) and param.dtype != torch.float32))
        and param.dtype in _KINDS
        and grad.dtype in _KINDS
        and param.is_contiguous()
        and grad.is_contiguous()
        and grad.device == param.device
        and all(t.device == param.device for t in views.values())
        and (correction is None or (param.dtype != torch.float32 and correction.is_contiguous()
                                    and correction.numel() == param.numel()
                                    and correction.dtype in _CORRECTION_BITS and correction.device == param.device))
    )


def _bits(t: Tensor) -> Tensor:
    """A 16-bit tensor as its int16 bits (what the kernel loads and stores), any other as it is."""
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def _signed32(bits: int) -> int:
    """32 bits as a signed int32's value (the table holds them sign-extended)."""
    return bits - (1 << 32) if bits >= 1 << 31 else bits


def _state_addresses(param: Tensor, views: dict[str, Tensor], corr: Tensor | None,
                     keys: tuple[str | None, ...]) -> list[int]:
    """A tensor's correction and state addresses in the table's column order (the parameter's address for
    those its format has not): shared by :func:`_row` and the planned step's table."""
    p = param.data_ptr()
    return [p if corr is None else corr.data_ptr()] + [p if k is None else views[k].data_ptr() for k in keys]


def _launch_kind(param: Tensor, grad_dtype: torch.dtype, corr: Tensor | None, skip: bool) -> tuple[int, int, int, bool]:
    """The launch a tensor goes to: (W, G, CB, SKIP), its weight and gradient dtypes, correction width, and
    whether the device decides its skip."""
    return _KINDS[param.dtype], _KINDS[grad_dtype], 0 if corr is None else _CORRECTION_BITS[corr.dtype], skip


def _row(it: Any, corr: Tensor | None, keys: tuple[str | None, ...], factors: tuple[int, int, int] | None,
         scalars: tuple[int, int], decay: int) -> list[int]:
    """One tensor's row of the launch's table (:data:`_COLUMNS`): its addresses (``keys``: its states' names
    in the column order, ``None`` for those its format has not), then its scalars (``scalars``: the bits of
    its step size and of its ``1 / sqrt(bias_correction2)``; ``decay``: :func:`decay_bits`)."""
    p = it.param.data_ptr()
    addresses = [p, it.grad.data_ptr(), *_state_addresses(it.param, it.views, corr, keys)]
    row_factor, col_factor, cols = factors if factors is not None else (p, p, 1)
    addresses += [row_factor, col_factor, p if it.skip_flag is None else it.skip_flag.data_ptr()]
    return addresses + [it.param.numel(), cols, _signed32(it.noise_key & 0xFFFFFFFF), *scalars, decay]


def _factored_prework(items: list[Any], corrections: list[Tensor | None], hyper: Any,
                      alive: list[Any]) -> dict[int, tuple[int, int, int]]:
    """The factored items' vectors and factors, all at once (:class:`~.triton_factored.FactoredWork`: two
    launches); each item's factors' addresses and columns, by its index. ``alive`` keeps the buffers the
    update's launch reads."""
    live = [i for i, it in enumerate(items) if it.param.numel()]
    if not live:
        return {}
    chosen = [items[i] for i in live]
    work = FactoredWork([it.param for it in chosen], [it.grad.dtype for it in chosen], [it.views for it in chosen],
                        [corrections[i] for i in live])
    buffers = work.buffers()
    zero = torch.zeros(1, dtype=torch.float32, device=work.device)  # the flag of an item the host decided: stepped
    alive += [buffers, zero]
    sums, finish = work.tables([it.grad.data_ptr() for it in chosen],
                               [zero.data_ptr() if it.skip_flag is None else it.skip_flag.data_ptr() for it in chosen],
                               [_float_bits(it.bias_correction2) for it in chosen], hyper)
    alive += [sums, finish]
    work.launch(sums, finish, buffers, hyper)
    return {i: (rf, cf, int(work.cols[k])) for k, (i, (rf, cf)) in enumerate(zip(live, work.factors(buffers)))}


def step_scalars(bias_correction1: float, bias_correction2: float, has_m: bool, lr: float) -> tuple[int, int]:
    """The bits of a tensor's step size and of its ``1 / sqrt(bias_correction2)`` (its table's columns
    after the rounding key)."""
    lr_step = -lr / bias_correction1 if has_m else -lr
    return _float_bits(lr_step), _float_bits(1.0 / math.sqrt(bias_correction2))


def decay_bits(hyper: Any) -> int:
    """The bits of the decoupled weight decay's factor ``1 - lr * weight_decay`` (fp32; 1 without it): the
    table's last column, so that a launch captured in a CUDA graph reads the step's learning rate."""
    wd = hyper.weight_decay
    return _float_bits(_f32(1.0 - hyper.lr * wd) if wd != 0.0 and hyper.decoupled_weight_decay else 1.0)


def launch_options(kind: tuple[int, int, int, bool], count: int, repair: Tensor | None) -> dict[str, Any]:
    """The compile-time options of a launch over ``count`` tensors of one ``kind`` (W, G, CB, SKIP)."""
    w_kind, g_kind, bits, skip = kind
    return dict(W=w_kind, G=g_kind, CB=bits, SKIP=skip, SEARCH=max(count - 1, 1).bit_length(), REPAIR=repair is not None,
                enable_fp_fusion=False)


def adamw_step(
    kinds: tuple[int, int], items: list[Any], hyper: Any, limit_m: float, limit_v: float,
    corrections: list[Tensor | None] | None = None, repair: Tensor | None = None,
) -> None:
    """One AdamW step of ``items`` (:class:`~lightning_baoc.formats.StepItem`, all served:
    :func:`serves`), whose counts, bias corrections and rounding keys the optimizer has set;
    ``corrections``: each 16-bit parameter's master-weight correction, or ``None``. One launch per
    kind of tensors (parameter and gradient dtypes, correction width, whether the device decides the
    skip), over all of them: the addresses and scalars of each tensor travel in one table.

    ``repair``: a one-element fp32 flag on the device, set where torch's fused kernel skipped these
    fp32 items (its ``found_inf``: any of them held inf or NaN). The launch then steps those whose own
    flag is clear, and does nothing where ``repair`` is 0 (the fused kernel stepped them all), so that
    one fused call serves the batch and each item still skips alone. Every item carries its flag."""
    if repair is not None and any(it.skip_flag is None for it in items):
        raise ValueError("adamw_step(repair=...) steps items whose skip the device decides: each needs its skip_flag")
    m_kind, v_kind = kinds
    has_m = m_kind != M_NONE
    common = _common(kinds, hyper, limit_m, limit_v)
    launches: dict[tuple[int, int, int, bool], tuple[list[int], list[int]]] = {}
    alive = []  # the factored formats' factors, read by the launches below
    keys = M_KEYS.get(m_kind, (None, None, None)) + V_KEYS[v_kind]
    scalars: dict[tuple[float, float], tuple[int, int]] = {}  # by bias corrections: most tensors share them
    decay = decay_bits(hyper)
    corrections = corrections or [None] * len(items)
    factored: dict[int, tuple[int, int, int]] = {}  # item index -> its factors' addresses and its columns
    if v_kind == V_FACTORED:
        factored = _factored_prework(items, corrections, hyper, alive)
    for index, (it, corr) in enumerate(zip(items, corrections)):
        n = it.param.numel()
        if n == 0:
            continue
        key = _launch_kind(it.param, it.grad.dtype, corr, it.skip_flag is not None)
        factors = factored.get(index)
        rows, firsts = launches.setdefault(key, ([], [0]))
        bits = scalars.get((it.bias_correction1, it.bias_correction2))
        if bits is None:
            bits = scalars[(it.bias_correction1, it.bias_correction2)] = step_scalars(
                it.bias_correction1, it.bias_correction2, has_m, hyper.lr)
        rows += _row(it, corr, keys, factors, bits, decay)
        firsts.append(firsts[-1] + (n + _SUPER - 1) // _SUPER)
    if not launches:
        return
    device = items[0].param.device  # one device per call (the optimizer buckets by device)
    for kind, (rows, firsts) in launches.items():
        rows += firsts[:-1]
        table = on_device(torch.frombuffer(array.array("q", rows), dtype=torch.int64), device)  # no Python loop
        count = len(firsts) - 1
        _adamw_tensors[(firsts[-1],)](table, count, table if repair is None else repair,
                                      **launch_options(kind, count, repair), **common)


__all__ = ["SERVED", "adamw_step", "serves", "step_scalars"]
