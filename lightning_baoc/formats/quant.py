"""Quantization helpers shared by the formats: companded 8-bit groups, bf16 stochastic rounding.

Companding follows FlashOptim (arXiv 2602.23349, "Optimizer state quantization"), groups of 32
elements with one 16-bit absmax scale per group:

- momentum: ``x / absmax -> softsign y = 2x / (1 + |x|) -> int8 round(127 y)``; inverse
  ``y = q / 127, x = y / (2 - |y|)``. Softsign spends more codes near zero, where most momentum
  values sit.
- second moment: ``sqrt(v) / absmax -> uint8 round(255 .)``; inverse squares. The square root
  halves the dynamic range the 8 bits must cover.

Scales are fp16 as in FlashOptim (their 11-bit precision matters: the largest element of each
group is reproduced to the scale's precision, and it dominates the squared error of v), but fp16
alone cannot hold gradient-sized numbers: its smallest normal value is 6.1e-5 and ``sqrt(v)`` of a
quiet layer's gradient can be 1e-7, which would flush whole groups to zero. So every super-block of
32 groups (1024 elements) also stores one int8 power-of-two exponent: scale = fp16 * 2**exp.
That costs 1 byte per 1024 elements per moment; quantization normalizes by the stored scale, so
encode and decode agree exactly.

Range (issue 14: a momentum decaying towards zero turned parameters into NaN): the exponent stays
in ``[-126, 127]``, where both ``2**exp`` and ``2**-exp`` are finite fp32 numbers. A group whose
scale falls below fp32's smallest normal number (``absmax < 2**-126``, about 1.2e-38) is flushed
to zero: its scale is stored as 0 and decodes to exactly 0 without a division; such values are
far below anything an update can feel next to ``eps``. At the top, scales saturate just below
fp32's largest finite value (for the second moment: below the largest ``sqrt(v)`` whose square is
finite), so an infinite or near-overflowing input is stored as a finite value, never as inf.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch
from torch import Tensor

GROUP = 32
#: Groups share one power-of-two exponent per super-block of 32 groups (1024 elements), so the
#: fp16 scales keep fp16's 11-bit precision while the exponent carries the range (see module doc).
SUPER_GROUPS = 32
SUPER = GROUP * SUPER_GROUPS
SCALE_DTYPE = torch.float16
EXP_DTYPE = torch.int8
# A super-block's largest scale is stored in [2**14, 2**15): below fp16's maximum (65504), and
# groups down to 2**-28 of it stay normal fp16 numbers.
_TOP_EXPONENT = 14
# Exponents whose power and reciprocal are both finite, normal fp32 numbers (2**-127 and below
# are denormal, and 1 / 2**-128 is inf: the NaN of issue 14's defect 1). Saturated scales need
# at most 113.
_EXP_MIN, _EXP_MAX = -126, 126
#: Groups whose scale is below this (fp32's smallest normal number) are flushed to zero, so that
#: the reciprocal of every stored scale is finite.
SCALE_MIN = torch.finfo(torch.float32).tiny
# Group maxima saturate 2**-10 below a limit, so that the fp16 rounding of a scale (at most 2**-11
# up) cannot carry a stored scale past it: past fp32's maximum for the momentum, past the largest
# sqrt(v) whose square is finite (2**64 - 2**40) for the second moment.
_ROUNDING_MARGIN = 1.0 - 2.0**-10
#: Largest momentum group maximum stored (larger values and inf saturate to it): ~3.40e38.
M_SCALE_MAX = torch.finfo(torch.float32).max * _ROUNDING_MARGIN
#: Largest ``sqrt(v)`` group maximum stored: its decoded square stays finite (~3.39e38).
V_SCALE_MAX = float(torch.nextafter(torch.tensor(2.0**64), torch.tensor(0.0))) * _ROUNDING_MARGIN


def sqrt_rn(x: Tensor) -> Tensor:
    """The correctly rounded square root of fp32 ``x`` (a new tensor).

    torch's fp32 ``sqrt`` on the CPU is not correctly rounded in every build (an MKL build is one
    ulp off in about 17% of elements), while the compiled step's is (``kernels/cpu_step.cpp``); the
    root taken in fp64 and rounded once to fp32 is exact, on every build and device, so both steps
    agree to the bit.
    """
    return x.double().sqrt_().to(x.dtype)


def num_groups(numel: int) -> int:
    """Number of quantization groups (scales) for ``numel`` elements."""
    return -(-numel // GROUP)


def num_supers(numel: int) -> int:
    """Number of super-blocks (exponents) for ``numel`` elements."""
    return -(-numel // SUPER)


def _per_group(x: Tensor, scales: Tensor) -> Tensor:
    """Multiply flat ``x`` in place by its group's (fp32) scale; the tail group may be short."""
    n = x.numel()
    full = (n // GROUP) * GROUP
    if full:
        x[:full].view(-1, GROUP).mul_(scales[: full // GROUP].unsqueeze(1))
    if full < n:
        x[full:].mul_(scales[-1])
    return x


def _phased(x: Tensor, phase: int) -> Tensor:
    """``x`` preceded by ``phase`` zeros (a new tensor; ``x`` itself for phase 0): a chunk whose first
    element sits ``phase`` elements into its 32-element group, laid out on whole groups. A zero
    changes no group's absolute maximum."""
    return torch.constant_pad_nd(x, (phase, 0)) if phase else x


def _super_rows(groups: Tensor) -> Tensor:
    """Per-group values as one row per super-block (the tail row padded with zeros)."""
    pad = (-groups.numel()) % SUPER_GROUPS
    if pad:
        groups = torch.constant_pad_nd(groups, (0, pad))
    return groups.view(-1, SUPER_GROUPS)


def group_absmax(x: Tensor) -> Tensor:
    """Absolute maximum of every group of 32 (the last group may be shorter)."""
    n = x.numel()
    full = (n // GROUP) * GROUP
    parts = []
    if full:
        parts.append(x[:full].view(-1, GROUP).abs().amax(dim=1))
    if full < n:
        parts.append(x[full:].abs().amax().reshape(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _store_scales(
    absmax: Tensor, scales_out: Tensor, exps_out: Tensor, limit: float, skip: int = 0, edges: Tensor | None = None
) -> Tensor:
    """Store fp16 scales with a shared exponent per super-block; return per-group fp32 reciprocals.

    Normalizing by the stored (rounded) scale keeps encode and decode in exact agreement; values
    a rounding pushes past 1 are clamped by the callers. Group maxima saturate at ``limit`` (an
    inf input included) and groups under :data:`SCALE_MIN` are stored as 0 (see the module
    docstring), so every stored scale is finite and every returned reciprocal too (0 for a zero
    group: nothing is divided by it).

    ``skip``: the groups of the first super-block before ``absmax``'s first (a chunk starting inside
    a super-block, :func:`quantize_momentum`'s ``lead``). ``edges``: the maxima of the first and the
    last super-block over elements beyond this chunk (``edges[1]``, ``edges[3]``; a shard's
    neighbours', :func:`edge_maxima`), so that a super-block split among shards takes one exponent.
    """
    n = absmax.numel()
    rows = _super_rows(_phased(absmax.clamp(max=limit), skip))
    top = rows.amax(dim=1)
    if edges is not None:
        outer = edges.clamp(max=limit)
        top[:1] = torch.maximum(top[:1], outer[1:2])
        top[-1:] = torch.maximum(top[-1:], outer[3:4])
    # log2(0) = -inf: an all-zero super-block gets the smallest exponent (its scales are all 0)
    exps = torch.log2(top).floor_().sub_(_TOP_EXPONENT).clamp_(_EXP_MIN, _EXP_MAX)
    exps_out.copy_(exps)
    unit = torch.exp2(exps).unsqueeze_(1)  # finite and normal, as is 1 / unit
    scales = rows.div(unit).to(SCALE_DTYPE)
    stored = scales.to(torch.float32).mul_(unit)  # exactly what decoding computes
    flushed = stored < SCALE_MIN
    scales.masked_fill_(flushed, 0.0)
    scales_out.copy_(scales.view(-1)[skip : skip + n])
    return torch.where(flushed, 0.0, stored.reciprocal()).view(-1)[skip : skip + n]


def _load_scales(scales: Tensor, exps: Tensor, skip: int = 0) -> Tensor:
    """Per-group fp32 scales, fp16 scale * 2**exponent: exact, as the product is normal or 0
    (``skip``: the groups of the first super-block before ``scales``' first)."""
    unit = torch.exp2(exps.to(torch.float32)).unsqueeze_(1)
    rows = _super_rows(_phased(scales.to(torch.float32), skip))
    return rows.mul_(unit).view(-1)[skip : skip + scales.numel()]


def _fold_groups(absmax: Tensor, edges: Tensor | None) -> Tensor:
    """``absmax`` with the first and last groups' maxima beyond the chunk folded in (``edges[0]``,
    ``edges[2]``: :func:`_store_scales`)."""
    if edges is not None:
        absmax[:1] = torch.maximum(absmax[:1], edges[0:1])
        absmax[-1:] = torch.maximum(absmax[-1:], edges[2:3])
    return absmax


def edge_maxima(values: Tensor, lead: int = 0) -> Tensor:
    """The absolute maxima of the first group, the first super-block, the last group and the last
    super-block of a flat chunk whose first element sits ``lead`` elements into its super-block
    (4 fp32 values): what a shard shares with its neighbours where its edges cut a group or a
    super-block (for the second moment, of ``sqrt(v)``)."""
    groups = group_absmax(_phased(values, lead % GROUP))
    top = _super_rows(_phased(groups, lead // GROUP)).amax(dim=1)
    return torch.stack([groups[0], top[0], groups[-1], top[-1]]).to(torch.float32)


def quantize_momentum(
    x: Tensor, codes_out: Tensor, scales_out: Tensor, exps_out: Tensor, lead: int = 0, edges: Tensor | None = None
) -> None:
    """Companded int8 quantization of a flat fp32 momentum chunk (``x`` is overwritten).

    ``lead``: where the chunk's first element sits in its super-block (0 but for the first chunk of
    a shard starting inside one: its groups and super-blocks are the whole parameter's, not the
    shard's); ``edges``: the maxima beyond the chunk of its first and last groups and super-blocks
    (a shard's neighbours', :func:`edge_maxima` order; ``None``: none), so that a group split
    among shards takes one scale, the one-process scale.
    """
    phase = lead % GROUP
    x = _phased(x, phase)
    inv = _store_scales(_fold_groups(group_absmax(x), edges), scales_out, exps_out, M_SCALE_MAX, lead // GROUP, edges)
    _per_group(x, inv).clamp_(-1.0, 1.0)
    # softsign: y = 2x / (1 + |x|)
    y = x.abs().add_(1.0)
    torch.div(x, y, out=y).mul_(2.0 * 127.0).round_()
    codes_out.copy_(y[phase:])


def dequantize_momentum(codes: Tensor, scales: Tensor, exps: Tensor, lead: int = 0) -> Tensor:
    """Inverse of :func:`quantize_momentum`: a new flat fp32 tensor."""
    phase = lead % GROUP
    y = _phased(codes.to(torch.float32), phase).mul_(1.0 / 127.0)  # a product, not a quotient: one division less per element
    x = y.abs().neg_().add_(2.0)
    torch.div(y, x, out=x)
    return _per_group(x, _load_scales(scales, exps, lead // GROUP))[phase:]


def quantize_sqrt(
    v: Tensor, codes_out: Tensor, scales_out: Tensor, exps_out: Tensor, lead: int = 0, edges: Tensor | None = None
) -> None:
    """sqrt-companded uint8 quantization of a flat fp32 second-moment chunk (``v`` is overwritten;
    ``lead`` and ``edges`` as :func:`quantize_momentum`'s, over ``sqrt(v)``)."""
    phase = lead % GROUP
    s = _phased(sqrt_rn(v.clamp_(min=0.0)), phase)
    inv = _store_scales(_fold_groups(group_absmax(s), edges), scales_out, exps_out, V_SCALE_MAX, lead // GROUP, edges)
    _per_group(s, inv).clamp_(0.0, 1.0).mul_(255.0).round_()
    codes_out.copy_(s[phase:])


def dequantize_sqrt(codes: Tensor, scales: Tensor, exps: Tensor, lead: int = 0) -> Tensor:
    """Inverse of :func:`quantize_sqrt`: a new flat fp32 tensor.

    Code 0 stands for every ``sqrt(v)`` below half a step (``absmax / 510``); it decodes to that
    bound rather than to 0. Decoding it to 0 (FlashOptim's plain inverse) turns the update of such
    an element into ``m / eps``, and without momentum into ``g / eps``: measured here, digits runs
    with ``nomomentum_int8`` diverged that way. The bound caps the step at the size the group's
    precision allows; a group of exact zeros (scale 0) still decodes to 0.
    """
    phase = lead % GROUP
    s = _phased(codes.to(torch.float32).clamp_(min=0.5), phase).mul_(1.0 / 255.0)
    _per_group(s, _load_scales(scales, exps, lead // GROUP))
    s = s[phase:]
    return s.mul_(s)  # finite: s <= V_SCALE_MAX * (1 + 2**-11) < 2**64 - 2**40


#: Stochastic rounding draws its noise from a counter-based hash (no generator, no stored state):
#: element ``i`` under a 32-bit ``key`` hashes to ``h = lowbias32(i + key)`` (a 32-bit integer
#: hash, constants from C. Wellons' hash-prospector search); the momentum's noise is the top 16
#: bits of ``h``, the second moment's the bottom 16, so one hash serves both moments. The key
#: mixes the optimizer's seed, the parameter's step count and a hash of its name
#: (:func:`stream_key`), so a resumed run rounds exactly as the uninterrupted one, any device
#: computes the same bits, and the compiled step (``kernels/cpu_step.cpp``, ``rounding_bits``)
#: reproduces them from the index alone.
_M32 = 0xFFFFFFFF
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def mix32(x: int) -> int:
    """The 32-bit integer hash of the rounding noise, on a Python int."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


@functools.lru_cache(maxsize=65536)
def name_salt(name: str) -> int:
    """The 32-bit hash of a parameter's name in its rounding keys (CRC-32; the same in every process)."""
    return zlib.crc32(name.encode())


def stream_key(seed: int, step: int, salt: int) -> int:
    """The 32-bit rounding key of one parameter (``salt``: a hash of its name) at one step."""
    return mix32(_step_key(seed, step) ^ (salt & _M32))


def stream_keys(seed: int, steps: list[int], salts: np.ndarray, which: np.ndarray) -> np.ndarray:
    """:func:`stream_key` of many parameters at once (numpy ``uint64``): parameter ``i`` at step
    ``steps[which[i]]`` with salt ``salts[i]``; the same bits, with one Python hash per distinct step."""
    m32 = np.uint64(_M32)
    x = np.array([_step_key(seed, s) for s in steps], dtype=np.uint64)[which] ^ (salts & m32)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x21F0AAAD)) & m32  # products below 2**64: exact in uint64
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x735A2D97)) & m32
    return x ^ (x >> np.uint64(15))


@functools.lru_cache(maxsize=256)
def _step_key(seed: int, step: int) -> int:
    """The part of :func:`stream_key` that every parameter at one step shares (computed once per step)."""
    return mix32(mix32(seed) ^ (step & _M32))


def rounding_hash(start: int, stop: int, key: int, device: torch.device) -> Tensor:
    """``lowbias32(i + key)`` of the elements ``[start, stop)`` (int64 in ``[0, 2**32)``): both moments' noise
    of a slice (:func:`rounding_bits`), computed once where a caller stores both (``BF16.store``)."""
    x = torch.arange(start, stop, dtype=torch.int64, device=device).add_(key).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    x.mul_(0x21F0AAAD).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x735A2D97).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    return x


def rounding_bits(start: int, stop: int, which: int, key: int, device: torch.device,
                  hashed: Tensor | None = None) -> Tensor:
    """The 16-bit noise (int64 in ``[0, 2**16)``) of elements ``[start, stop)`` of a stream (``hashed``: their
    :func:`rounding_hash`, where the caller holds it already; not modified)."""
    x = rounding_hash(start, stop, key, device) if hashed is None else hashed
    return x >> 16 if which == 0 else x & 0xFFFF


def bf16_stochastic(x: Tensor, out: Tensor, key: int, start: int = 0, which: int = 0,
                    hashed: Tensor | None = None) -> None:
    """Write fp32 ``x`` (elements ``[start, start + x.numel())`` of stream ``which``) into bf16 ``out``
    with stochastic rounding (``hashed``: the elements' :func:`rounding_hash`, where the caller holds it).

    Adding 16 random bits below the bf16 mantissa and truncating rounds up with probability equal
    to the discarded fraction, so the rounding is unbiased: ``E[round(x)] = x``. Round-to-nearest
    would freeze ``v * 0.999`` at ``v`` (``tests/formats/test_quantization.py`` runs both roundings).

    Above bf16's largest finite value (3.3895e38, below fp32's 3.4028e38) rounding up carries
    into the infinite exponent; such values (and an overflowed inf) saturate at bf16's maximum.
    """
    bits = x.contiguous().view(torch.int32)
    noise = rounding_bits(start, start + bits.numel(), which, key, x.device, hashed).view(bits.shape)
    noisy = torch.add(bits, noise.to(torch.int32))
    out.copy_(noisy.bitwise_and_(-65536).view(torch.float32).clamp_(-_BF16_MAX, _BF16_MAX))


def bf16_round_nearest(x: Tensor, out: Tensor, key: int = 0, start: int = 0, which: int = 0,
                       hashed: Tensor | None = None) -> None:
    """Round-to-nearest bf16 store (the naive choice; kept to demonstrate stagnation in tests)."""
    out.copy_(x)
